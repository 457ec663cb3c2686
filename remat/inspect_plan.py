"""`remat inspect`: a saved plan explained to someone who has never seen remat.

* `summary_text(plan)`: what the plan is for (model, inputs, device, torch, solver), its numbers
  (budget, predicted peak beside keep_all's, extra compute, bound and gap, where the peak is) and
  a table per module: what the backward needs from it, what the plan keeps and what it recomputes.
* `plot_timeline(plan, path)`: predicted memory over one training step for keep_all and for the
  plan, against compute on the x axis (so recomputation shows as extra length), with the budget,
  the resident memory, the recomputations and the forward/backward boundary marked (matplotlib).

Both need the graph saved with the plan (plan files of schema 2); the summary of a schema 1 file
says so.
"""
from __future__ import annotations

from remat.core.errors import RematError
from remat.machine_info import MiB
from remat.core.plan import Plan
from remat.core.module_summary import TOP_LEVEL, module_summary, rollup, step_timeline
from remat.solver.schedule import keep_all_schedule

__all__ = ["summary_text", "plot_timeline", "NeedsGraphError"]


class NeedsGraphError(RematError, ValueError):
    """The plan has no graph saved with it (a schema 1 file): it cannot be tabled or plotted."""


def _mib(b: float) -> str:
    return f"{b / MiB:.2f}"


def _inputs(ctx: dict) -> str:
    items = ctx.get("inputs", [])
    parts = [f"{i['arg']} {tuple(i['shape'])} {i['dtype']}" if "shape" in i else f"{i['arg']}={i['value']}"
             for i in items]
    return ", ".join(parts) or "?"


def _model(ctx: dict) -> str:
    p = ctx.get("parameters", {})
    values = p.get("values")
    size = f"{values / 1e6:.2f} M values in {p.get('tensors')} parameter and buffer tensors" if values is not None else ""
    return f"{ctx.get('model', '?')} ({size}, {ctx.get('dtype', '?')})" if size else ctx.get("model", "?")


def _needs_graph(plan: Plan) -> None:
    if plan.graph is None:
        raise NeedsGraphError("this plan has no graph saved with it (a plan file of schema version 1): solve "
                              "again with this remat (remat solve ...) to inspect it")


def summary_text(plan: Plan, *, depth: int | None = None, top: int | None = None, name: str = "plan") -> str:
    """The plan as text: context, numbers, and the per-module table (module paths cut to `depth`
    parts; only the `top` modules with the most recomputation when given)."""
    ctx = plan.context
    lines = [f"{name}: {plan.strategy} plan, status {plan.status}"]
    if ctx:
        mode = "train" if ctx.get("training", True) else "eval"
        opts = ", ".join(f"{k}={v}" for k, v in ctx.get("solver_options", {}).items()) or "defaults"
        lines += [f"model:    {_model(ctx)}",
                  f"inputs:   {_inputs(ctx)}",
                  f"device:   {ctx.get('device', '?')}{' (' + ctx['device_name'] + ')' if ctx.get('device_name') else ''}"
                  f", {mode} mode, {ctx.get('autocast', '?')}, fused attention {ctx.get('fused_attention', '?')}",
                  f"solver:   {ctx.get('solver', plan.strategy)} ({opts}), solved in {plan.solve_time_s:.1f} s, "
                  f"torch {ctx.get('torch', '?')}",
                  f"machine:  {ctx.get('machine', '?')}"]
    else:
        lines.append("(no context saved: a plan file of schema version 1)")
    if plan.graph is None:
        lines.append(f"budget {_mib(plan.budget_bytes) if plan.budget_bytes else '-'} MiB, predicted peak "
                     f"{_mib(plan.predicted_peak_bytes)} MiB; no graph saved with it: solve again with this remat "
                     f"(remat solve ...) for the per-module table and the plot")
        return "\n".join(lines)
    g = plan.graph
    keep = step_timeline(g, keep_all_schedule(g))
    mine = step_timeline(g, plan.schedule)
    lines.append(f"graph:    {len(g.nodes)} nodes ({len(g.forward_nodes)} forward, {len(g.backward_nodes)} backward), "
                 f"fingerprint {plan.graph_fingerprint}")
    budget = f"{_mib(plan.budget_bytes)} MiB" if plan.budget_bytes is not None else "none"
    lines.append("")
    lines.append(f"budget              {budget}")
    lines.append(f"keep_all peak       {_mib(keep.peak_bytes)} MiB (recomputes nothing)")
    where = ""
    if mine.peak_step >= 0:
        s = mine.peak_step
        where = f", at step {s + 1} of {len(plan.schedule)}: {mine.names[s]} in {mine.modules[s]} " \
                f"({'backward' if mine.backward[s] else 'forward'})"
    lines.append(f"this plan's peak    {_mib(plan.predicted_peak_bytes)} MiB = {plan.predicted_peak_bytes / keep.peak_bytes:.1%} "
                 f"of keep_all's{where}")
    lines.append(f"resident            {_mib(mine.resident_bytes)} MiB (parameters, buffers, inputs: live throughout)")
    lines.append(f"extra compute       {plan.extra_cost / g.total_cost:.1%} of a step ({len(plan.schedule) - len(g.nodes)} "
                 f"recomputations, {plan.extra_flops / 1e9:.3f} GFLOP of matmul-like ops)")
    bound = getattr(plan, "lower_bound", None)  # on the extra cost, proven by the solver
    gap = "-" if plan.gap is None else f"{plan.gap:.2%}"
    lines.append(f"cost                {plan.total_cost:.4g} = plain step {g.total_cost:.4g} + extra {plan.extra_cost:.4g}; "
                 f"lower bound on the extra: {'-' if bound is None else f'{bound:.4g} ({bound / g.total_cost:.1%} of a step)'}"
                 f"; gap {gap}")
    rows = rollup(module_summary(g, plan.schedule), depth)
    total = {k: sum(r[k] for r in rows) for k in rows[0] if k != "module"}
    if top:
        rows = sorted(rows, key=lambda r: -r["extra_cost"])[:top]
    lines.append("")
    lines.append("per module: 'saved' = its forward values the backward reads (keep_all keeps them all), 'kept' = "
                 "those this plan keeps; 'recomp' = values it computes again for the backward (each counted once, "
                 "also values the backward does not read itself, e.g. the inputs of a recomputed op), 'recomps' = "
                 "recomputations, 'extra cost' = theirs, 'cost share' = the module's share of a plain step")
    w = max([len("module")] + [len(r["module"]) for r in rows])
    head = (f"{'module':<{w}} {'saved MiB':>10} {'kept MiB':>9} {'recomp MiB':>10} {'values':>6} {'recomps':>7} "
            f"{'extra cost':>10} {'cost share':>10}")
    lines += [head, "-" * len(head)]

    def row(r: dict) -> str:
        return (f"{r['module']:<{w}} {_mib(r['saved_bytes']):>10} {_mib(r['kept_bytes']):>9} "
                f"{_mib(r['recomputed_bytes']):>10} {r['recomputed_values']:>6} {r['recomputations']:>7} "
                f"{r['extra_cost'] / g.total_cost:>10.2%} {r['cost'] / g.total_cost:>10.2%}")

    lines += [row(r) for r in rows]
    lines += ["-" * len(head), row({"module": "total", **total})]
    return "\n".join(lines)


def plot_timeline(plan: Plan, path: str, *, title: str | None = None) -> None:
    """Save the predicted-memory plot of `plan` (PNG, or any format matplotlib infers from `path`)."""
    _needs_graph(plan)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = plan.graph
    keep = step_timeline(g, keep_all_schedule(g))
    mine = step_timeline(g, plan.schedule)
    scale = 100.0 / g.total_cost  # x in % of a keep_all step's compute

    def xy(t):
        xs, ys = [], []
        for a, b, m in zip(t.start, t.end, t.memory):
            xs += [a * scale, b * scale]
            ys += [m / MiB, m / MiB]
        return xs, ys

    fig, ax = plt.subplots(figsize=(12, 6.2), dpi=110)
    kx, ky = xy(keep)
    px, py = xy(mine)
    ax.axhspan(0, mine.resident_bytes / MiB, color="0.9", zorder=0)
    ax.text(1, mine.resident_bytes / MiB / 2, "parameters, buffers and inputs (resident the whole step)",
            va="center", fontsize=8, color="0.35")
    ax.plot(kx, ky, color="0.55", lw=1.2, label=f"keep_all (recomputes nothing): peak {_mib(keep.peak_bytes)} MiB")
    ax.plot(px, py, color="tab:blue", lw=1.4,
            label=f"{plan.strategy} plan: peak {_mib(mine.peak_bytes)} MiB, +{plan.extra_cost / g.total_cost:.1%} compute")
    if plan.budget_bytes is not None:
        ax.axhline(plan.budget_bytes / MiB, color="tab:red", ls="--", lw=1.2,
                   label=f"budget {_mib(plan.budget_bytes)} MiB")
    rx = [(a + b) / 2 * scale for a, b, r in zip(mine.start, mine.end, mine.recompute) if r]
    ry = [m / MiB for m, r in zip(mine.memory, mine.recompute) if r]
    if rx:
        ax.scatter(rx, ry, s=14, color="tab:orange", zorder=3,
                   label=f"recomputation ({len(rx)} ops computed a second time)")
    top = max(ky + py + ([plan.budget_bytes / MiB] if plan.budget_bytes else [])) * 1.12
    ends = [t.end[t.forward_end] * scale for t in (keep, mine) if t.forward_end is not None]
    for x in dict.fromkeys(round(e, 6) for e in ends):  # the same line when the forwards cost the same
        ax.axvline(x, color="0.3", ls=":", lw=1)
        ax.text(x, top * 0.99, "forward  ", color="0.3", fontsize=8, va="top", ha="right")
        ax.text(x, top * 0.99, "  backward", color="0.3", fontsize=8, va="top", ha="left")
    for t, color in ((keep, "0.45"), (mine, "tab:blue")):
        if t.peak_step >= 0:
            s = t.peak_step
            where = "the model's own code" if t.modules[s] == TOP_LEVEL else t.modules[s]
            ax.annotate(f"peak {_mib(t.peak_bytes)} MiB\nat {t.names[s]} in {where}", xy=((t.start[s] + t.end[s]) / 2 * scale,
                        t.peak_bytes / MiB), xytext=(12, 8), textcoords="offset points", fontsize=8, color=color,
                        arrowprops=dict(arrowstyle="-", color=color, lw=0.8))
    ax.set_ylim(0, top)
    ax.set_xlim(0, max(kx + px) * 1.01)
    ax.set_xlabel("progress through one training step (forward, then backward), in % of keep_all's compute "
                  "(remat's cost model)")
    ax.set_ylabel("predicted memory in use (MiB)")
    ctx = plan.context
    ax.set_title(title or f"Predicted memory of one training step: {ctx.get('model', g.name)}"
                 f"{' on ' + _inputs(ctx) if ctx else ''}", fontsize=10)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.95, bbox_to_anchor=(1, 0.93))
    ax.grid(alpha=0.25)
    fig.text(0.01, 0.01, "The ops of one step (loss = model(*inputs); loss.backward()) run from left to right, "
             "each as wide as its compute; the line is the memory allocated while it runs.\nA plan frees some "
             "activations after their last use in the forward and computes them again (orange) when the backward "
             "needs them: a lower peak for a longer step.", fontsize=7.5, color="0.3")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path)
    plt.close(fig)
