"""Fine-level clean-up of a schedule: drop recomputations the budget does not need.

The MILP plans on a coarsened graph whose memory model is conservative (a coarse node keeps all
of its outputs alive until the last of them is read), so its plans often land well under the
budget on the fine graph. Deleting a recomputation step always leaves a valid schedule: readers
after it simply read the previous instance, which then lives longer. We delete, most expensive
first, every recomputation whose removal keeps the fine simulated peak within the budget, and
prune recomputations nothing reads. Cost can only go down; the peak stays within the budget.
"""
from __future__ import annotations

from collections import Counter

from remat.graph_capture.training_graph import TrainingGraph
from remat.solver.simulator import last_reads, simulate

__all__ = ["prune_unread", "drop_recomputations"]


def prune_unread(graph: TrainingGraph, schedule: list[str]) -> list[str]:
    """Remove every computation whose instance no step reads while another instance of the same
    node remains, until none is left: each removal lowers the cost and never raises the peak, and
    the runtime drops such an instance as dead code, so the plan must not count it. The first
    instance goes too when a later one exists (Checkmate's frontier-advancing stages compute node t
    in stage t even when it is recomputed before anyone reads it; the min-peak MILP, which does not
    price compute, leaves many such), and so does a last one nothing reads. The one pruning used
    everywhere: solver/checkmate_stages.py on the MILP's schedules, and drop_recomputations here."""
    sched = list(schedule)
    while True:
        frees = last_reads(graph, sched)
        count = Counter(sched)
        dead = set()
        for s, name in enumerate(sched):
            # an instance all of whose outputs are freed at its own step was never read
            node = graph.node(name)
            own = sum(1 for f, _ in frees[s] if f == name)
            if count[name] > 1 and own == max(len(node.out_parts), 1) and node.kept_bytes == 0:
                dead.add(s)
                count[name] -= 1
        if not dead:
            return sched
        sched = [n for s, n in enumerate(sched) if s not in dead]


def drop_recomputations(graph: TrainingGraph, schedule: list[str], budget_bytes: int,
                        passes: int = 2) -> list[str]:
    """`schedule` with, most expensive first, every recomputation whose removal keeps the fine
    simulated peak within `budget_bytes` removed (`passes` rounds), and unread instances pruned
    (prune_unread) before and after each round. Cost only goes down; the peak stays in the budget
    (if `schedule`'s did)."""
    sched = prune_unread(graph, schedule)
    for _ in range(passes):
        seen: set[str] = set()
        steps = []
        for s, name in enumerate(sched):
            if name in seen:
                steps.append(s)
            seen.add(name)
        steps.sort(key=lambda s: -graph.node(sched[s]).cost)
        removed: set[int] = set()
        for s in steps:
            trial = [n for k, n in enumerate(sched) if k != s and k not in removed]
            if simulate(graph, trial).peak_bytes <= budget_bytes:
                removed.add(s)
        if not removed:
            break
        sched = prune_unread(graph, [n for k, n in enumerate(sched) if k not in removed])
    return sched
