"""Strategies side by side on the default GPT at several budgets, measured for real.

    python benchmarks/core.py [--fracs 0.9 0.7 0.5] [--min-feasible] [--fused-attention exact|all|off]
                              [--out benchmarks/results]

For each budget (a fraction of keep_all's measured peak) it optimizes the model with
equal_spacing and checkmate, runs a real training step, and prints predicted vs measured peak
(CPU: profiler memory events; CUDA: max_memory_allocated), extra compute (cost model and
FLOPs), solve time, and whether loss and gradients match the unmodified model (fp32, dropout on).
With --fused-attention all the model's attention (dropout included) runs remat's flash op, and
the reference is the model run eagerly with the same fused attention; results then go to
core_<device>_fused_all.{txt,json}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from remat.api import capture
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.machine_info import MiB, machine
from remat.report import format_table, reference_step, run_strategy
from remat.core.plan import InfeasibleBudgetError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fracs", type=float, nargs="+", default=[0.9, 0.7, 0.5])
    ap.add_argument("--min-feasible", action="store_true", default=True,
                    help="also run checkmate at the smallest feasible budget it finds")
    ap.add_argument("--no-min-feasible", dest="min_feasible", action="store_false")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="optional wall-clock limit on the MILP (default: deterministic work limits only)")
    ap.add_argument("--fused-attention", choices=["exact", "all", "off"], default="exact")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    fused = a.fused_attention

    cfg = GPTConfig(n_layer=a.layers, block_size=a.seq)
    model, inputs = default_model(cfg), default_inputs(cfg)
    print(f"default GPT: {cfg}\nmachine: {machine()}\nfused attention: {fused}")
    ref = reference_step(model, inputs, seed=0, fused_attention=fused)
    keep = run_strategy(model, inputs, "keep_all", None, reference=ref, fused_attention=fused)
    K = keep.measured_peak_bytes
    rows, notes = [keep], []
    budgets = [(f"{f:.0%}", int(f * K), None) for f in a.fracs]
    if a.min_feasible:
        from remat.solver.checkmate import min_feasible_budget

        t0 = time.perf_counter()
        m, min_plan = min_feasible_budget(capture(model, inputs, fused_attention=fused), time_limit_s=a.time_limit,
                                          return_plan=True)
        notes.append(f"checkmate smallest feasible budget: {m / MiB:.2f} MiB = {m / K:.1%} of keep_all "
                     f"({min_plan.details.get('schedule_source')}, found in {time.perf_counter() - t0:.1f} s; its plan is deployed as is)")
        budgets.append(("min", m, min_plan))
    for label, b, plan in budgets:
        for strategy in ("equal_spacing", "checkmate"):
            try:
                rows.append(run_strategy(model, inputs, strategy, b, reference=ref, time_limit_s=a.time_limit,
                                         plan=plan if strategy == "checkmate" else None, fused_attention=fused))
            except InfeasibleBudgetError as e:
                notes.append(f"budget {label} ({b / MiB:.2f} MiB): {strategy} infeasible; {e}")
    table = format_table(rows, K)
    text = "\n".join([f"machine: {machine()}", f"model: {cfg}", f"fused attention: {fused}",
                      f"keep_all measured peak: {K / MiB:.2f} MiB",
                      table, *notes])
    print(table)
    for n in notes:
        print(n)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"core_{'cuda' if torch.cuda.is_available() else 'cpu'}" + ("" if fused == "exact" else f"_fused_{fused}")
    (out / f"{stem}.txt").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"machine": machine(), "config": vars(cfg), "fused_attention": fused,
                                                  "rows": [r.as_dict() for r in rows], "notes": notes}, indent=1))
    print(f"wrote {out / stem}.txt and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
