"""Command line: `remat demo` (the main job) and `remat plan` (solve once, save the plan)."""
from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from remat.default_model import GPTConfig, default_inputs, default_model
from remat.report import format_table, reference_step, run_strategy
from remat.solver.plan import InfeasibleBudgetError

__all__ = ["main"]

MiB = 2**20


def _config(a: argparse.Namespace) -> GPTConfig:
    return GPTConfig(n_layer=a.layers, block_size=a.seq, batch_size=a.batch, n_embd=a.embd,
                     n_head=a.heads, dropout=a.dropout, attn_dropout=a.attn_dropout, attention=a.attention)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256, help="sequence length")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--budget-frac", type=float, default=0.5,
                   help="budget as a fraction of keep_all's measured peak (default 0.5)")
    p.add_argument("--budget-mib", type=float, default=None, help="absolute budget in MiB (overrides --budget-frac)")
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit, seconds")
    p.add_argument("--attention", choices=["explicit", "sdpa"], default="explicit",
                   help="how the model spells attention (default: explicit softmax(QK^T)V)")
    p.add_argument("--attn-dropout", type=float, default=None, help="dropout on attention probs (default: --dropout)")
    p.add_argument("--fused-attention", choices=["exact", "all", "off"], default="exact",
                   help="attention run as remat's flash op: 'exact' where it computes the same function "
                        "(no attention dropout), 'all' also with attention dropout (remat's own masks), "
                        "'off' never (default: exact)")


def machine() -> str:
    return f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {platform.platform()}"


def demo(a: argparse.Namespace) -> int:
    cfg = _config(a)
    model = default_model(cfg)
    inputs = default_inputs(cfg)
    print(f"remat demo: GPT {cfg.n_layer} layers, seq {cfg.block_size}, batch {cfg.batch_size}, "
          f"width {cfg.n_embd}, dropout {cfg.dropout}, {cfg.attention} attention, fused attention: "
          f"{a.fused_attention}  [{machine()}]")
    fused = a.fused_attention
    ref = reference_step(model, inputs, seed=0, fused_attention=fused)
    rows = [run_strategy(model, inputs, "keep_all", None, reference=ref, fused_attention=fused)]
    keep_peak = rows[0].measured_peak_bytes
    budget = int(a.budget_mib * MiB) if a.budget_mib else int(a.budget_frac * keep_peak)
    print(f"keep_all measured peak {keep_peak / MiB:.2f} MiB; budget {budget / MiB:.2f} MiB")
    notes = []
    for strategy in ("equal_spacing", "checkmate"):
        try:
            rows.append(run_strategy(model, inputs, strategy, budget, reference=ref, time_limit_s=a.time_limit,
                                     fused_attention=fused))
        except InfeasibleBudgetError as e:
            notes.append(f"{strategy}: infeasible: {e}")
    print(format_table(rows, keep_peak))
    for n in notes:
        print(n)
    # train a few steps with the optimized module
    from remat.api import optimize

    cm = [r for r in rows if r.strategy == "checkmate"]
    if a.steps > 0 and cm:
        opt = optimize(model, example_inputs=inputs, plan=cm[0].plan, fused_attention=fused)  # the plan just solved
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(a.steps):
            optim.zero_grad(set_to_none=True)
            loss = opt(*inputs)
            loss.backward()
            optim.step()
            losses.append(round(loss.item(), 4))
        print(f"trained {a.steps} steps with the checkmate module: losses {losses}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "config": vars(cfg), "budget_bytes": budget,
                       "keep_all_peak": keep_peak, "rows": [r.as_dict() for r in rows], "notes": notes}, f, indent=1)
    return 0


def plan_cmd(a: argparse.Namespace) -> int:
    from remat.api import capture, solve

    cfg = _config(a)
    model = default_model(cfg)
    inputs = default_inputs(cfg)
    keep = run_strategy(model, inputs, "keep_all", None, fused_attention=a.fused_attention).measured_peak_bytes
    budget = int(a.budget_mib * MiB) if a.budget_mib else int(a.budget_frac * keep)
    graph = capture(model, inputs, fused_attention=a.fused_attention)
    try:
        plan = solve(graph, budget, solver=a.solver, time_limit_s=a.time_limit)
    except InfeasibleBudgetError as e:
        print(f"infeasible: {e}", file=sys.stderr)
        return 1
    plan.save(a.out)
    print(f"{a.solver}: {plan.status}, predicted peak {plan.predicted_peak_bytes / MiB:.2f} MiB "
          f"(budget {budget / MiB:.2f}), extra cost {plan.extra_cost / graph.total_cost:.1%}, "
          f"solved in {plan.solve_time_s:.1f} s -> {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remat", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="optimize the built-in GPT and compare strategies")
    _model_args(d)
    d.add_argument("--steps", type=int, default=3, help="training steps with the optimized module")
    d.add_argument("--json", default=None, help="also write the results here")
    d.set_defaults(fn=demo)
    pl = sub.add_parser("plan", help="solve for the built-in GPT and save the plan as JSON")
    _model_args(pl)
    pl.add_argument("--solver", default="checkmate", choices=["checkmate", "equal_spacing", "keep_all"])
    pl.add_argument("--out", default="plan.json")
    pl.set_defaults(fn=plan_cmd)
    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    raise SystemExit(main())
