"""The fewest matmul FLOPs any plan must recompute to fit a budget: checkmate's certified search with
extra FLOPs as its only objective (each node costs its FLOPs + 1, so views and pointwise ops are
all but free), reporting its plan and its proven lower bound.

    python benchmarks/flop_floor.py [--out benchmarks/results]

Run at the measured peaks where benchmarks/compare.py finds checkmate recomputing some FLOPs and at
least as many as torch.compile's activation_memory_budget partitioner (read from the compare
results files): a bound at or above the peer's extra FLOPs proves that no schedule of the eager
graph reaches that peak recomputing fewer, i.e. the peer's peak comes from Inductor's fusion
(intermediates it never materialises), not from a better choice of what to recompute.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import time
from pathlib import Path

from remat.api import capture
from remat.core.training_graph import TrainingGraph
from remat.machine_info import MiB, machine
from remat.solver.checkmate import solve

RESULTS = Path(__file__).parent / "results"


def flop_objective(graph: TrainingGraph) -> TrainingGraph:
    """The same graph with every node costing its FLOPs + 1 (a cost must be > 0)."""
    nodes = tuple(dataclasses.replace(n, cost=float(n.flops) + 1.0) for n in graph.nodes)
    return TrainingGraph(nodes=nodes, resident_bytes=graph.resident_bytes, name=graph.name, meta=dict(graph.meta),
                         tangents=graph.tangents)


def _model(name: str):
    """The model and inputs compare.py runs (its defaults)."""
    from remat import models
    from remat.default_model import default_inputs, default_model

    if name == "gpt":
        return default_model(), default_inputs()
    return getattr(models, f"build_{name}")(), getattr(models, f"{name}_inputs")()


def _peer_rows(name: str) -> list[tuple[str, int]]:
    """(peer, measured peak bytes, peer's extra FLOPs) of the compare rows where checkmate recomputes
    FLOPs, and no fewer than the memory-budget partitioner."""
    with open(RESULTS / f"compare_{name}.csv") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    peers = {r["strategy"]: r for r in rows if r["strategy"].startswith("torch.compile amb=")}
    out = []
    for r in rows:
        at_peer = r["strategy"] == "checkmate" and r["family"] == "remat@peer"
        peer = r["note"].split("measured peak of ")[-1] if at_peer else None
        p = peers.get(peer)
        if p and int(r["meas_xflops"] or 0) > 0 and int(r["meas_xflops"]) >= int(p["meas_xflops"] or 0):
            out.append((peer, int(p["measured_peak"]), int(p["meas_xflops"] or 0)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt", "unet", "resnet", "mobilenet"])
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    lines = [f"machine: {machine()}",
             "fewest extra matmul FLOPs of any plan at a compare peer's measured peak (certified search, "
             "objective: FLOPs); bound proven over schedules computing the nodes first in graph order",
             f"{'model':<10} {'peer':<22} {'budget MiB':>10} {'peer GFLOP':>10} {'plan GFLOP':>10} "
             f"{'bound GFLOP':>11} {'status':>9} {'solve s':>8}"]
    for name in a.models:
        rows = _peer_rows(name)
        if not rows:
            lines.append(f"{name:<10} (no peer row where checkmate recomputes FLOPs, as many as the partitioner or more)")
            continue
        model, inputs = _model(name)
        g = flop_objective(capture(model, inputs, quiet=True))
        for peer, budget, peer_flops in rows:
            mib = budget / MiB
            t0 = time.perf_counter()
            plan = solve(g, budget)
            lb = plan.lower_bound if plan.lower_bound is not None else float("nan")
            lines.append(f"{name:<10} {peer:<22} {mib:>10.2f} {peer_flops / 1e9:>10.4f} {plan.extra_flops / 1e9:>10.4f} "
                         f"{lb / 1e9:>11.4f} "
                         f"{plan.status:>9} {time.perf_counter() - t0:>8.1f}")
            print(lines[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flop_floor.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
