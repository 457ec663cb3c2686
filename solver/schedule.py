"""Turn a choice of kept forward values into a full schedule (Checkmate's "given S, derive R").

The forward runs once in topological order. A forward value that is not kept is still computed in
the forward (later forward nodes read it) but is not read across the forward/backward boundary:
when a backward node needs it, it is recomputed right before that node, together with any other
dropped value the recomputation needs, and the recomputed instance is then read by every later
backward node until its last use. Random nodes and step outputs are always kept.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from remat.core.training_graph import RNG_STATE_OP, TrainingGraph

if TYPE_CHECKING:  # only for annotations: plan.py builds on this module
    from remat.core.plan import Plan

__all__ = ["schedule_from_kept", "keep_all_schedule", "cheapest_fitting"]


def keep_all_schedule(graph: TrainingGraph) -> list[str]:
    """Every node once, in topological order: no recomputation."""
    return [n.name for n in graph.nodes]


def schedule_from_kept(graph: TrainingGraph, kept: Iterable[str]) -> list[str]:
    """The schedule that keeps the forward values `kept` (plus every non-recomputable one) for the
    backward and recomputes any other one right before the first backward node that needs it.
    A dropout replayed from a saved generator state at least its size (a small mask; the state is
    5056 bytes) is kept too: recomputing it would keep the larger state."""
    kept = set(kept) | {n.name for n in graph.forward_nodes if not n.recomputable}
    kept |= {n.name for n in graph.forward_nodes
             if any(graph.node(i).op == RNG_STATE_OP and graph.node(i).out_bytes >= n.out_bytes for i in n.inputs)}
    schedule = [n.name for n in graph.forward_nodes]
    # forward values available in the backward: kept ones, plus recomputed instances
    available = set(kept)

    def ensure(name: str) -> None:
        if name in available:
            return
        node = graph.node(name)
        for i in node.inputs:
            ensure(i)
        schedule.append(name)
        available.add(name)

    for n in graph.backward_nodes:
        for i in n.inputs:
            if not graph.node(i).is_backward:
                ensure(i)
        schedule.append(n.name)
    return schedule


def cheapest_fitting(plans: Iterable["Plan"]) -> "Plan":
    """What a heuristic that judges candidate plans answers: the cheapest plan that fits its budget,
    else the lowest-peak one (ties: cheaper), marked "infeasible" (the API then names its peak as
    the smallest budget found feasible)."""
    best = lowest = None
    for plan in plans:
        if lowest is None or (plan.predicted_peak_bytes, plan.extra_cost) < (lowest.predicted_peak_bytes,
                                                                             lowest.extra_cost):
            lowest = plan
        if plan.fits and (best is None or plan.extra_cost < best.extra_cost):
            best = plan
    if lowest is None:
        raise ValueError("no candidate plan to choose from")
    if best is None:
        from remat.core.plan import PlanStatus  # (plan.py imports the simulator, which imports this)

        return dataclasses.replace(lowest, status=PlanStatus.INFEASIBLE)
    return best
