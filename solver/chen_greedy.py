"""chen_greedy: Chen et al.'s greedy memory-budgeted segmentation.

Source: T. Chen, B. Xu, C. Zhang, C. Guestrin, "Training Deep Nets with Sublinear Memory Cost",
arXiv:1604.06174 (2016), Algorithm 3 ("Memory Planning with Budget") and the search over its
budget described in Section 4.3 (and implemented by the authors in dmlc/mxnet-memonger,
`search_plan`).

What is implemented, exactly:

* **Algorithm 3** (`segment`): walk the forward nodes in topological order, adding each node's
  output size to a running total `temp`; when the node is a candidate stage-splitting point and
  `temp > B`, it becomes a split point (its value is kept for the backward) and `temp` restarts
  at 0. Candidates are the articulation points of the forward graph (values that separate it,
  such as the residual stream between blocks; equal_spacing.checkpoint_candidates), as Chen's
  candidate set C is "where the graph can be split". Every value between split points is
  recomputed in the backward (schedule_from_kept: on demand, from the nearest kept values).
  Random values (saved generator states, masks that cannot be replayed) and step outputs are
  always kept, never recomputed; a replayable dropout is recomputed like any other value.
* **The search over B**: the paper runs Algorithm 3 at B = 0, then at B = sqrt(x * y) where x is
  the kept bytes and y the largest segment of the previous run (memonger repeats this guess three
  times, then sweeps `ntrial` evenly spaced thresholds between the smallest segment size seen and
  sqrt(2) times the last guess). We run exactly those thresholds, plus a geometric grid of
  `grid` thresholds from the smallest output size to the total forward bytes (so every budget
  has a chance to be met), judge every distinct split set with the simulator, and return the
  cheapest plan (least extra cost) whose peak fits the budget. Chen's own selection criterion,
  the least memory, is what we return when nothing fits (status "infeasible"), as equal_spacing
  does.

Not implemented: the paper's in-place/sharing memory planner (the simulator does the memory
accounting), and the "mirror" attribute tuning of memonger beyond the thresholds above.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from remat.core.training_graph import TrainingGraph
from remat.solver.options import StrategyOptions, check_int
from remat.solver.equal_spacing import checkpoint_candidates
from remat.core.plan import Plan, finished, plan_from_schedule
from remat.solver.schedule import cheapest_fitting, schedule_from_kept

__all__ = ["Options", "solve", "segment", "thresholds"]


def segment(graph: TrainingGraph, threshold: float, candidates: list[str] | None = None
            ) -> tuple[list[str], int, int]:
    """Chen's Algorithm 3 at segment budget `threshold` (bytes): the split points (kept values,
    topological order), x = their total bytes and y = the largest segment's accumulated bytes."""
    cands = set(checkpoint_candidates(graph) if candidates is None else candidates)
    temp = x = y = 0
    kept: list[str] = []
    for v in graph.forward_nodes:
        temp += v.out_bytes
        if v.name in cands and temp > threshold:
            x += v.out_bytes
            y = max(y, temp)
            kept.append(v.name)
            temp = 0
    return kept, x, max(y, temp)


def thresholds(graph: TrainingGraph, candidates: list[str] | None = None, *, rounds: int = 3,
               ntrial: int = 6, grid: int = 48) -> list[float]:
    """The segment budgets tried: Chen's sqrt(x*y) guesses starting from B = 0 (`rounds` times),
    memonger's `ntrial` linear steps, and a geometric grid of `grid` values over the forward's
    output sizes. Sorted, distinct."""
    cands = checkpoint_candidates(graph) if candidates is None else candidates
    out = {0.0}
    b, smallest_y = 0.0, None
    for _ in range(rounds):
        _, x, y = segment(graph, b, cands)
        smallest_y = y if smallest_y is None else min(smallest_y, y)
        b = math.sqrt(x * y)
        out.add(b)
    top = b * math.sqrt(2)
    step = (top - (smallest_y or 0)) / ntrial if ntrial else 0
    if step > 0:
        out.update((smallest_y or 0) + step * (k + 1) for k in range(ntrial))
    sizes = [v.out_bytes for v in graph.forward_nodes if v.out_bytes > 0]
    if sizes and grid > 1:
        lo, hi = min(sizes), sum(sizes)
        out.update(lo * (hi / lo) ** (k / (grid - 1)) for k in range(grid))
    return sorted(out)


@dataclass(frozen=True)
class Options(StrategyOptions):
    """The segment budgets `thresholds` tries: `rounds` of Chen's sqrt(x*y) guesses, memonger's
    `ntrial` linear steps, a geometric grid of `grid` values."""

    rounds: int = 3
    ntrial: int = 6
    grid: int = 48

    def __post_init__(self) -> None:
        for name in ("rounds", "ntrial", "grid"):
            check_int(name, getattr(self, name), 0)


def solve(graph: TrainingGraph, budget_bytes: int | None = None, *, rounds: int = 3, ntrial: int = 6,
          grid: int = 48) -> Plan:
    """The cheapest plan (least extra cost) of Chen's greedy segmentation over the thresholds of
    `thresholds(graph, rounds=, ntrial=, grid=)` whose simulated peak fits `budget_bytes`
    (None: no budget, the cheapest of all). Status "heuristic"; when no threshold fits, the
    lowest-peak plan with status "infeasible". details: the winning threshold, its split points
    and segment sizes, and how many distinct split sets were judged."""
    t0 = time.perf_counter()
    cands = checkpoint_candidates(graph)
    seen: set[tuple[str, ...]] = set()
    plans = []
    for b in thresholds(graph, cands, rounds=rounds, ntrial=ntrial, grid=grid):
        kept, x, y = segment(graph, b, cands)
        if tuple(kept) in seen:
            continue
        seen.add(tuple(kept))
        plans.append(plan_from_schedule(graph, schedule_from_kept(graph, kept), strategy="chen_greedy",
                                        budget_bytes=budget_bytes, status="heuristic",
                                        details={"threshold_bytes": b, "split_points": len(kept),
                                                 "kept_bytes": x, "max_segment_bytes": y,
                                                 "candidates": len(cands)}))
    chosen = cheapest_fitting(plans)
    return finished(chosen, t0, details={**chosen.details, "split_sets_judged": len(seen)})
