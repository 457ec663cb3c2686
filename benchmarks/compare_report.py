"""compare.py's output: the notes on the time predictions, the per-model table (.md), its CSV and plot,
the two summaries (checkmate against each peer at the peer's measured peak, and against the best
baseline at each budget), and `render`, which rebuilds the .md and .png from a CSV."""
from __future__ import annotations

import csv
import os
import platform
from dataclasses import fields
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import torch

from compare_measure import Row  # benchmarks/ (this script's folder) is on sys.path

__all__ = ["timed_note", "disagreement", "disagreement_note", "machine", "COLUMNS", "write_results", "peer_summary",
           "baseline_summary", "render", "MiB"]

MiB = 2**20


def timed_note(timed) -> str:
    """One line: how the measured-cost graph was timed, and the sum of its ops' times."""
    t = timed.meta.get("cost_timing", {})
    est = t.get("estimated_nodes", [])
    return (f"measured cost model: {len(timed.nodes)} nodes, {t.get('signatures')} distinct op calls timed on "
            f"{t.get('device')} ({t.get('warmup')} warm-up runs, median of {t.get('repeats')}, torch threads "
            f"{t.get('torch_threads')}, {t.get('seconds')} s); sum of op times "
            f"{t.get('first_computation_ns', timed.total_cost) / 1e6:.1f} ms"
            + (f"; {len(est)} nodes priced by the FLOP model: {', '.join(est[:5])}" if est else ""))


def disagreement(rows: list[Row], pred: str) -> tuple[float, float, int, int] | None:
    """(largest, mean |pred/meas - 1|, count, how many over 10%) over the distinct schedules of the
    remat rows that were measured, keep_all's own schedule left out (its ratios are 1 by
    construction); `pred` names the Row field holding the prediction."""
    keep = next((r.schedule_sha for r in rows if r.strategy == "keep_all"), None)
    seen: dict[str, float] = {}
    for r in rows:
        p = getattr(r, pred)
        if r.family.startswith("remat") and r.schedule_sha and r.schedule_sha != keep and p and r.time_ratio:
            seen.setdefault(r.schedule_sha, abs(p / r.time_ratio - 1))
    if not seen:
        return None
    errs = list(seen.values())
    return max(errs), sum(errs) / len(errs), len(errs), sum(e > 0.10 for e in errs)


def disagreement_note(rows: list[Row], extra_ns: dict[str, float] | None = None,
                      keep_cpu_s: float | None = None) -> str:
    """One line: how far the predicted time ratios are from the measured ones (time/keep), for the
    FLOP cost model ("time pred") and the measured one ("time pred (measured)"); with `extra_ns`,
    also the measured model's extra nanoseconds over keep_all's measured step time (the step
    spends time outside the ops too: Python, autograd, the allocator)."""
    parts = []
    for label, field_name in (("FLOP model (time pred)", "pred_time_ratio"),
                              ("measured model (time pred (measured))", "pred_time_ratio_measured")):
        d = disagreement(rows, field_name)
        parts.append(f"{label}: " + ("no schedule to compare" if d is None else
                                      f"largest {d[0]:.1%}, mean {d[1]:.1%} over {d[2]} distinct schedules, "
                                      f"{d[3]} over 10%"))
    if extra_ns and keep_cpu_s:
        over_step = [dataclasses_replace(r, pred_time_ratio=1 + extra_ns[r.schedule_sha] / (keep_cpu_s * 1e9))
                     for r in rows if r.schedule_sha in extra_ns]
        d = disagreement(over_step, "pred_time_ratio")
        if d is not None:
            parts.append(f"measured model's extra time over keep_all's measured step time: largest {d[0]:.1%}, "
                         f"mean {d[1]:.1%}, {d[3]} over 10%")
    return "time prediction vs measurement, |pred/meas - 1|: " + "; ".join(parts)


# ---- output ---------------------------------------------------------------------------------------

def machine() -> str:
    """One line: platform, cores, threads, torch version, load."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
            f"torch {torch.__version__}, python {platform.python_version()}, {platform.platform()}, "
            f"load average at start {load}")


def _mib(x):
    return "-" if x is None else f"{x / MiB:.2f}"


def _g(x):
    return "-" if x is None else f"{x / 1e9:.3f}"


def _r(x):
    return "-" if x is None else f"{x:.3f}"


COLUMNS = ["strategy", "budget MiB", "status", "pred MiB", "meas MiB", "meas/keep", "xFLOP pred G", "xFLOP meas G",
           "time pred", "time pred (measured)", "time/keep", "time/base", "step ms (cpu/wall)", "solve s", "gap",
           "grads", "note"]


def _cells(r: Row, keep_peak: int) -> list[str]:
    grads = r.grads if r.grads != "DIFF" else f"DIFF ({r.max_grad_err:.1e})"
    return [r.strategy + (" @peer" if r.family == "remat@peer" else ""), _mib(r.budget_bytes), r.status,
            _mib(r.predicted_peak), _mib(r.measured_peak),
            "-" if r.measured_peak is None else f"{r.measured_peak / keep_peak:.3f}", _g(r.pred_xflops),
            _g(r.meas_xflops), _r(r.pred_time_ratio), _r(r.pred_time_ratio_measured), _r(r.time_ratio),
            _r(r.base_ratio),
            "-" if r.cpu_s is None else f"{r.cpu_s * 1e3:.0f}/{r.wall_s * 1e3:.0f}",
            "-" if r.solve_s is None else f"{r.solve_s:.2f}", "-" if r.gap is None else f"{r.gap:.2g}",
            grads or "-", r.note.replace("|", "/")]


def write_results(out: Path, name: str, desc: str, rows: list[Row], notes: list[str], head: list[str]) -> None:
    keep_peak = next(r.measured_peak for r in rows if r.strategy == "keep_all")
    lines = [f"# {name}: strategies side by side", "", *[f"    {h}" for h in head], f"    model: {desc}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(r, keep_peak)) + " |" for r in rows]
    lines += ["", "time pred: 1 + extra cost / step cost (remat's cost model); time pred (measured): the same "
              "schedule judged by the simulator on the measured-cost graph (remat.capture(..., "
              "cost_model='measured'): each op's median time on this machine, as recomputed), 1 + extra ns / sum "
              "of the first computations' ns; "
              "time/keep: median CPU time of a step "
              "over keep_all's, their steps alternating; time/base: over the row's own base (keep_all for remat "
              "rows, the eager model for checkpoint peers, torch.compile at budget 1.0 for compile rows). "
              "xFLOP: matmul-like FLOPs of "
              "recomputation (count_flops minus keep_all's, or minus the eager model's for peers).", ""]
    lines += [f"* {n}" for n in notes]
    lines += ["", "## checkmate against each peer, at the peer's measured peak", "",
              *peer_summary(rows)]
    lines += ["", "## checkmate against the best baseline, at each budget of the sweep", "",
              *baseline_summary(rows)]
    (out / f"compare_{name}.md").write_text("\n".join(lines) + "\n")
    with open(out / f"compare_{name}.csv", "w", newline="") as f:
        for h in head:
            f.write(f"# {h}\n")
        f.write(f"# model: {desc}\n")
        for n in notes:
            f.write(f"# note: {n}\n")
        w = csv.writer(f)
        names = [x.name for x in fields(Row)]
        w.writerow(names)
        for r in rows:
            w.writerow([getattr(r, k) for k in names])
    _plot(out / f"compare_{name}.png", name, rows, head[0])


def peer_summary(rows: list[Row]) -> list[str]:
    """Markdown lines: for each peer, checkmate solved at the peer's measured peak (the
    "remat@peer" rows; keep_all where the peer peaks at or above it) against the peer: measured
    peak, measured extra FLOPs, gradients and step time over each one's own base."""
    keep = next(r for r in rows if r.strategy == "keep_all")
    at: dict[int, Row] = {}  # budget -> its checkmate row (of two measured: the one recomputing fewer FLOPs)
    for r in (r for r in rows if r.family == "remat@peer"):
        best = at.get(r.budget_bytes)
        if best is None or (r.measured_peak is not None and (r.meas_xflops or 0) < (best.meas_xflops or 0)):
            at[r.budget_bytes] = r
    head = ["peer", "peer MiB", "peer xFLOP G", "peer time/base", "peer grads", "checkmate MiB",
            "checkmate xFLOP G", "checkmate time/keep", "checkmate grads", "verdict"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for p in rows:
        if p.family != "peer" or p.strategy.startswith("eager"):
            continue
        if p.measured_peak is None:
            out.append(f"| {p.strategy} | - | - | - | - | - | - | - | - | peer failed: {p.note[:80]} |")
            continue
        c = keep if p.measured_peak >= keep.measured_peak else at.get(p.measured_peak)
        if c is None:
            verdict = "not compared (--no-match-peers)"
        elif c.measured_peak is None:
            verdict = f"checkmate cannot reach this peak ({c.status}: {c.note})"
        else:
            dx = (p.meas_xflops or 0) - (c.meas_xflops or 0)
            wins = [c.measured_peak <= p.measured_peak, dx > 0, c.grads == "exact"]
            rel = f"{c.meas_xflops / p.meas_xflops:.0%} of the peer's" if p.meas_xflops else "peer recomputes no FLOPs"
            more = f"{abs(dx) / 1e9:.3f} GFLOP {'fewer' if dx >= 0 else 'more'} extra FLOPs ({rel})"
            verdict = ("beats it" if all(wins) else "ties" if dx == 0 and wins[0] else "does not beat it") + \
                f": {more}, peak {(c.measured_peak - p.measured_peak) / MiB:+.2f} MiB" + \
                ("" if c.strategy in ("checkmate", "keep_all") else f" ({c.strategy})")
            if p.grads_same_masks.startswith("DIFF"):  # benchmarks/amb_dropout_grads.py: Inductor's own RNG too
                verdict += ("; the peer's gradients are wrong with fallback_random=True (eager's masks in the "
                            "forward, others in its recomputation)")
        cm = c if c is not None and c.measured_peak is not None else None
        out.append("| " + " | ".join([
            p.strategy, _mib(p.measured_peak), _g(p.meas_xflops), _r(p.base_ratio),
            (p.grads or "-") + (f" (same masks: {p.grads_same_masks})" if p.grads_same_masks else ""),
            _mib(cm.measured_peak) if cm else "-", _g(cm.meas_xflops) if cm else "-",
            _r(cm.time_ratio) if cm else "-", (cm.grads if cm else "-") or "-", verdict]) + " |")
    return out


def baseline_summary(rows: list[Row]) -> list[str]:
    """Markdown lines: at each budget of the sweep where checkmate has a plan, its measured extra
    FLOPs and time/keep against the baseline (a remat strategy other than keep_all and checkmate)
    that recomputes the fewest measured FLOPs there."""
    head = ["budget MiB", "checkmate xFLOP G", "checkmate time/keep", "best baseline", "its xFLOP G",
            "its time/keep", "checkmate's FLOPs less by"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    sweep = [r for r in rows if r.family == "remat" and r.budget_bytes is not None and r.measured_peak is not None]
    for c in (r for r in sweep if r.strategy == "checkmate"):
        others = [r for r in sweep if r.budget_bytes == c.budget_bytes and r.strategy not in ("checkmate", "keep_all")]
        if not others:
            out.append(f"| {_mib(c.budget_bytes)} | {_g(c.meas_xflops)} | {_r(c.time_ratio)} | no baseline fits | "
                       "- | - | - |")
            continue
        b = min(others, key=lambda r: (r.meas_xflops, r.time_ratio or 0))
        less = (b.meas_xflops - c.meas_xflops) / 1e9
        out.append(f"| {_mib(c.budget_bytes)} | {_g(c.meas_xflops)} | {_r(c.time_ratio)} | {b.strategy} | "
                   f"{_g(b.meas_xflops)} | {_r(b.time_ratio)} | {less:.3f} GFLOP"
                   + (f" ({less * 1e9 / b.meas_xflops:.0%} of its)" if b.meas_xflops else "") + " |")
    return out


def render(out: Path) -> None:
    """Rewrite compare_<model>.md and .png from compare_<model>.csv (e.g. after changing the
    report's layout); notes come from the CSV, or from the existing .md when the CSV has none."""
    types = {f.name: str(f.type) for f in fields(Row)}
    for path in sorted(out.glob("compare_*.csv")):
        name = path.stem[len("compare_"):]
        comments = [ln[2:].rstrip("\n") for ln in path.read_text().splitlines() if ln.startswith("# ")]
        head = [c for c in comments if c.startswith(("machine:", "command:"))]
        desc = next(c[len("model: "):] for c in comments if c.startswith("model: "))
        notes = [c[len("note: "):] for c in comments if c.startswith("note: ")]
        if not notes and (out / f"compare_{name}.md").exists():
            md = (out / f"compare_{name}.md").read_text().split("## checkmate against each peer")[0]
            notes = [ln[2:] for ln in md.splitlines() if ln.startswith("* ")]
        rows = []
        with open(path, newline="") as f:
            for d in csv.DictReader(ln for ln in f if not ln.startswith("#")):
                kw = {}
                for k, v in d.items():
                    t = types[k]
                    kw[k] = (None if v == "" and "None" in t else int(v) if t.startswith("int") else
                             float(v) if t.startswith("float") else v)
                rows.append(Row(**kw))
        write_results(out, name, desc, rows, notes, head)
        print(f"rewrote {out / f'compare_{name}.md'} and .png")


def _plot(path: Path, name: str, rows: list[Row], head: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.measured_peak is None or r.base_ratio is None:
            continue
        curves.setdefault(r.curve, []).append((r.measured_peak / MiB, 100 * (r.base_ratio - 1)))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    markers = "os^vD<>pP*Xh"
    for k, (curve, pts) in enumerate(sorted(curves.items())):
        pts = sorted(set(pts))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[k % len(markers)], label=curve,
                color=plt.get_cmap("tab20")(k % 20), linestyle="-" if len(pts) > 1 else "none")
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("extra step time over the strategy's own base (%)")
    ax.set_title(f"{name}: extra step time vs measured peak\n{head[:110]}", fontsize=9)
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
