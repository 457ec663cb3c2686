"""Checkmate's stages as schedules: a flat schedule split into the MILP's frontier-advancing stages
and back, the baseline schedules that warm-start the MILP, and a (coarse) solution turned into a
Plan on the fine graph.

Stage t ends with the first computation of node t; within a stage each node runs at most once, in
topological order. After solving, the schedule is stage by stage, the R=1 nodes of a stage in
topological order; recomputations nobody reads are dropped (solver/refine.py's `prune_unread`, as
the runtime drops them), then it is expanded to the fine graph, and the Plan is judged by the
simulator on the FINE graph (its predicted peak is that simulator's number).
"""
from __future__ import annotations

import time

from remat.core.training_graph import TrainingGraph
from remat.solver import equal_spacing
from remat.solver.checkmate.coarsen import coarsen, expand_schedule
from remat.core.plan import Plan, plan_from_schedule
from remat.solver.refine import prune_unread
from remat.solver.schedule import keep_all_schedule, schedule_from_kept
from remat.core.simulator import simulate

__all__ = ["DEFAULT_COARSEN_TO", "coarse_graph", "stages_of", "normalise_stages", "flat_schedule",
           "baseline_schedules", "judge_schedules", "plan_from_stages"]

DEFAULT_COARSEN_TO = 90  # coarse nodes: the MILP's size grows with the square of it


def coarse_graph(graph: TrainingGraph, coarsen_to: int | None) -> TrainingGraph:
    """The graph the MILP works on: `graph` coarsened to `coarsen_to` nodes (solver/checkmate/coarsen.py),
    or `graph` itself when it is no larger or coarsen_to is None."""
    if coarsen_to is None or len(graph.nodes) <= coarsen_to:
        return graph
    return coarsen(graph, coarsen_to)


def stages_of(g: TrainingGraph, schedule: list[str]) -> list[list[int]] | None:
    """Split a flat schedule into frontier-advancing stages (stage t ends with the first
    computation of node t), each stage's nodes sorted in topological order; None if the first
    computations are not in the graph's order or a stage computes a node twice."""
    idx = g.index
    stages: list[list[int]] = [[] for _ in g.nodes]
    frontier = 0
    cur: list[int] = []
    seen: set[int] = set()
    for name in schedule:
        i = idx[name]
        if i not in seen:
            if i != frontier:
                return None
            seen.add(i)
            cur.append(i)
            if len(set(cur)) != len(cur):
                return None
            stages[frontier] = sorted(cur)
            frontier += 1
            cur = []
        else:
            cur.append(i)
    return stages


def normalise_stages(g: TrainingGraph, stages: list[list[int]]) -> list[list[int]]:
    """Move each recomputation that no node of its own stage reads to the next stage (the model
    only has R[t,i] where a reader of i may run in stage t), until none is left."""
    idx = g.index
    users = [[idx[u] for u in g.users[v.name]] for v in g.nodes]
    stages = [list(st) for st in stages]
    for t in range(len(stages)):
        changed = True
        while changed:
            changed = False
            here = set(stages[t])
            for i in sorted(stages[t], reverse=True):
                if i != t and not any(u in here for u in users[i]):
                    stages[t].remove(i)
                    here.discard(i)
                    if t + 1 < len(stages) and i not in stages[t + 1]:
                        stages[t + 1] = sorted(stages[t + 1] + [i])
                    changed = True
    return stages


def flat_schedule(g: TrainingGraph, stages: list[list[int]]) -> list[str]:
    """The stages one after the other, as node names: the schedule they stand for."""
    return [g.nodes[i].name for st in stages for i in st]


def baseline_schedules(fine: TrainingGraph, g: TrainingGraph) -> list[tuple[str, list[str]]]:
    """Candidate coarse schedules (name, schedule): keep_all, equal spacing on the coarse graph
    for every k, and the fine graph's equal-spacing kept sets mapped to their runs."""
    out = [("keep_all", keep_all_schedule(g))]
    cands = equal_spacing.checkpoint_candidates(g)
    for k in range(1, len(cands) + 2):
        out.append((f"equal_spacing(coarse k={k})", schedule_from_kept(g, cands[k - 1::k])))
    if fine is not g:
        owner = {m: v.name for v in g.nodes for m in v.members}
        fc = equal_spacing.checkpoint_candidates(fine)
        for k in range(1, len(fc) + 2):
            kept = {owner[x] for x in fc[k - 1::k]}
            out.append((f"equal_spacing(fine k={k})", schedule_from_kept(g, kept)))
    return out


def judge_schedules(g: TrainingGraph, cands: list[tuple[str, list[str]]], budget_bytes: int):
    """Each candidate (name, schedule) over `g` as the MILP's stages (unread recomputations pruned,
    each recomputation moved to a stage that reads it), simulated on `g`: the cheapest that fits
    `budget_bytes` and the lowest-peak one, each (name, SimResult, stages), or None when there is
    none. Candidates whose first computations are out of the graph's order are left out."""
    best = lowest = None
    for name, sched in cands:
        stages = stages_of(g, prune_unread(g, sched))
        if stages is not None:
            stages = normalise_stages(g, stages)
        if stages is None:
            continue
        sim = simulate(g, flat_schedule(g, stages))
        if lowest is None or sim.peak_bytes < lowest[1].peak_bytes:
            lowest = (name, sim, stages)
        if sim.peak_bytes <= budget_bytes and (best is None or sim.extra_cost < best[1].extra_cost):
            best = (name, sim, stages)
    return best, lowest


def plan_from_stages(graph: TrainingGraph, g: TrainingGraph, stages: list[list[int]], *, strategy: str,
                     budget: int | None, status: str, t0: float, gap: float | None, details: dict) -> Plan:
    """The Plan on the fine `graph` of a solution's `stages` over `g` (its coarsening, or `graph`
    itself): the flat schedule without unread recomputations, expanded to the fine graph and pruned
    there again, judged by the fine simulator; the coarse peak and cost go into details."""
    coarse_sched = prune_unread(g, flat_schedule(g, stages))
    csim = simulate(g, coarse_sched)
    fine_sched = prune_unread(graph, expand_schedule(g, coarse_sched)) if g is not graph else coarse_sched
    details = {**details, "coarse_peak_bytes": csim.peak_bytes, "coarse_extra_cost": csim.extra_cost}
    plan = plan_from_schedule(graph, fine_sched, strategy=strategy, budget_bytes=budget,
                              status=status, solve_time_s=time.perf_counter() - t0, gap=gap,
                              details=details)
    return plan
