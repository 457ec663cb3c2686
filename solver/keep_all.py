"""keep_all: no recomputation; every forward value the backward reads stays in memory."""
from __future__ import annotations

import time

from remat.core.training_graph import TrainingGraph
from remat.core.plan import Plan, finished, plan_from_schedule
from remat.solver.schedule import keep_all_schedule

__all__ = ["solve"]


def solve(graph: TrainingGraph, budget_bytes: int | None = None, **_: object) -> Plan:
    """The plan that recomputes nothing; status "infeasible" when its peak exceeds `budget_bytes`."""
    t0 = time.perf_counter()
    plan = plan_from_schedule(graph, keep_all_schedule(graph), strategy="keep_all",
                              budget_bytes=budget_bytes, status="heuristic")
    return finished(plan, t0)
