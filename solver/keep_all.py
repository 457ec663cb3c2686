"""keep_all: no recomputation; every forward value the backward reads stays in memory."""
from __future__ import annotations

import time
from dataclasses import dataclass

from remat.solver.options import StrategyOptions
from remat.core.training_graph import TrainingGraph
from remat.core.plan import Plan, finished, plan_from_schedule
from remat.solver.schedule import keep_all_schedule

__all__ = ["Options", "solve"]


@dataclass(frozen=True)
class Options(StrategyOptions):
    """keep_all takes no options."""


def solve(graph: TrainingGraph, budget_bytes: int | None = None) -> Plan:
    """The plan that recomputes nothing; status "infeasible" when its peak exceeds `budget_bytes`."""
    t0 = time.perf_counter()
    plan = plan_from_schedule(graph, keep_all_schedule(graph), strategy="keep_all",
                              budget_bytes=budget_bytes, status="heuristic")
    return finished(plan, t0)
