"""Fine-level clean-up of a schedule: drop recomputations the budget does not need.

The MILP plans on a coarsened graph whose memory model is conservative (a coarse node keeps all
of its outputs alive until the last of them is read), so its plans often land well under the
budget on the fine graph. Deleting a recomputation step always leaves a valid schedule: readers
after it simply read the previous instance, which then lives longer. We delete, most expensive
first, every recomputation whose removal keeps the fine simulated peak within the budget, and
prune recomputations nothing reads. Cost can only go down; the peak stays within the budget.
"""
from __future__ import annotations

from remat.core.training_graph import TrainingGraph
from remat.core.simulator import dead_steps, simulate

__all__ = ["prune_unread", "drop_recomputations"]


def prune_unread(graph: TrainingGraph, schedule: list[str]) -> list[str]:
    """Remove every computation whose instance no step reads while another instance of the same
    node remains, until none is left: each removal lowers the cost and never raises the peak, and
    the runtime drops such an instance as dead code, so the plan must not count it. The first
    instance goes too when a later one exists (Checkmate's frontier-advancing stages compute node t
    in stage t even when it is recomputed before anyone reads it; the min-peak MILP, which does not
    price compute, leaves many such), and so does a last one nothing reads. The one pruning used
    everywhere: solver/checkmate/milp_stages.py on the MILP's schedules, and drop_recomputations here."""
    dead = dead_steps(graph, schedule)  # the round-by-round removals, in one pass
    return [name for s, name in enumerate(schedule) if s not in dead]


def drop_recomputations(graph: TrainingGraph, schedule: list[str], budget_bytes: int,
                        passes: int = 3) -> list[str]:
    """`schedule` with, most expensive first, every recomputation whose removal keeps the fine
    simulated peak within `budget_bytes` removed (up to `passes` rounds), and unread instances
    pruned (prune_unread) before and after each round. Cost only goes down; the peak stays in the
    budget (if `schedule`'s did).

    A round judges each removal on a memory timeline instead of re-simulating the schedule:
    removing the recomputation at step p of u hands its reads to u's previous instance, which then
    also lives over the steps between its last remaining read and p (+ u's bytes there); nothing
    else grows (the inputs p read may die earlier, which the timeline keeps counting: it only ever
    overestimates). Each accepted removal updates the timeline and the instances' reads; the
    round's schedule is then simulated exactly (it fits: the timeline bounded it from above).
    When a round removes nothing, later rounds may also ask the simulator about a few removals the
    timeline rejects (it overestimates), until one removes nothing; `passes` + 8 rounds at most."""
    sched = prune_unread(graph, schedule)
    exact = 0
    for _ in range(passes + 8):
        removed = _drop_round(graph, sched, budget_bytes, exact)
        if not removed:
            if exact:
                break
            exact = max(4, 20_000 // max(len(sched), 1))  # rounds that may also ask the simulator
            continue
        trial = prune_unread(graph, [n for k, n in enumerate(sched) if k not in removed])
        if simulate(graph, trial).peak_bytes > budget_bytes:  # never expected: keep the last good one
            break
        sched = trial
    return sched


def _drop_round(graph: TrainingGraph, sched: list[str], budget_bytes: int, exact_left: int = 0) -> set[int]:
    """The steps of one round of drop_recomputations (see there)."""
    import numpy as np

    from remat.core.simulator import parts_read

    sim = simulate(graph, sched)
    timeline = np.array(sim.timeline, dtype=np.float64)
    idx = graph.index
    nodes = [graph.nodes[idx[n]] for n in sched]
    nparts = [max(len(v.out_parts), 1) for v in nodes]
    current: dict[str, int] = {}  # node -> step of its current instance
    prev_of: dict[int, int] = {}  # recomputation step -> step of the instance before it
    reads: dict[tuple[int, int], list[int]] = {}  # (instance step, part) -> steps reading it
    read_by: dict[int, list[tuple[int, int]]] = {}  # step -> (instance step, part) it reads
    for s, v in enumerate(nodes):
        for i in v.inputs:
            src = current[i]
            for k in parts_read(graph.nodes[idx[i]], v.name):
                reads.setdefault((src, k), []).append(s)
                read_by.setdefault(s, []).append((src, k))
        if v.name in current:
            prev_of[s] = current[v.name]
        current[v.name] = s
    steps = sorted(prev_of, key=lambda s: -nodes[s].cost)
    removed: set[int] = set()
    for p in steps:
        q = prev_of[p]
        while q in removed:  # the instance before it was removed too: its reads went further back
            q = prev_of[q]
        parts = graph.nodes[idx[sched[p]]].out_parts
        sizes = [b for b, _ in parts] if parts else [nodes[p].out_bytes]
        grow = []  # (first step of growth, bytes)
        for k in range(nparts[p]):
            if reads.get((p, k)):
                last = max(reads.get((q, k), []) + [q])
                grow.append((last + 1, sizes[k]))
        lo = min((a for a, _ in grow), default=p)
        add = np.zeros(p - lo) if p > lo else None
        if add is not None:
            for a, b in grow:
                add[a - lo:] += b
            window = timeline[lo:p] + add
            if window.size and window.max() > budget_bytes:
                if exact_left <= 0:
                    continue
                exact_left -= 1  # the timeline overestimates: ask the simulator
                keep = [k for k in range(len(sched)) if k not in removed and k != p]
                trial = simulate(graph, [sched[k] for k in keep])
                if trial.peak_bytes > budget_bytes:
                    continue
                timeline[:] = -np.inf
                timeline[keep] = trial.timeline
                window = None
            if window is not None:
                timeline[lo:p] = window
        removed.add(p)
        timeline[p] = -np.inf
        for k in range(nparts[p]):  # p's readers now read q
            rs = reads.pop((p, k), [])
            reads.setdefault((q, k), []).extend(rs)
        for src, k in read_by.get(p, []):  # p no longer reads its inputs
            lst = reads.get((src, k))
            if lst and p in lst:
                lst.remove(p)
        prev_of_next = [s for s, pq in prev_of.items() if pq == p]
        for s in prev_of_next:
            prev_of[s] = q
    return removed
