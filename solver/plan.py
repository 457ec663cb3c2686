"""Plan: what a solver decides, in a form that can be saved, loaded and deployed later."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from remat.graph_capture.training_graph import TrainingGraph
from remat.solver.simulator import simulate

__all__ = ["Plan", "plan_from_schedule", "InfeasibleBudgetError"]


class InfeasibleBudgetError(ValueError):
    """No plan of this strategy fits the budget; `min_feasible_bytes` is the smallest budget
    for which one was found (None when unknown)."""

    def __init__(self, message: str, min_feasible_bytes: int | None = None):
        super().__init__(message)
        self.min_feasible_bytes = min_feasible_bytes


@dataclass
class Plan:
    strategy: str  # "checkmate", "keep_all", "equal_spacing", ...
    budget_bytes: int | None  # what it was asked to fit (None: no budget)
    schedule: list[str]  # flat execution order over the graph's nodes; repeats are recomputations
    predicted_peak_bytes: int  # the simulator's peak for `schedule`, resident memory included
    total_cost: float
    extra_cost: float  # cost of recomputation, FLOP-equivalents
    extra_flops: int  # matmul-like FLOPs of recomputation (what FlopCounterMode adds)
    status: str  # "optimal", "feasible" (gap below), "heuristic", or "infeasible"
    solve_time_s: float = 0.0
    gap: float | None = None  # relative MIP gap certified by the solver (0 when optimal)
    graph_fingerprint: str = ""  # TrainingGraph.fingerprint() of the graph it was made for
    details: dict = field(default_factory=dict)  # strategy-specific numbers (coarse size, k, ...)

    @property
    def recomputed(self) -> dict[str, list[int]]:
        """node name -> the schedule steps at which it is recomputed."""
        seen: set[str] = set()
        out: dict[str, list[int]] = {}
        for s, name in enumerate(self.schedule):
            if name in seen:
                out.setdefault(name, []).append(s)
            seen.add(name)
        return out

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.predicted_peak_bytes <= self.budget_bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        return cls(**json.loads(s))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())


def plan_from_schedule(graph: TrainingGraph, schedule: list[str], *, strategy: str,
                       budget_bytes: int | None, status: str, solve_time_s: float = 0.0,
                       gap: float | None = None, details: dict | None = None) -> Plan:
    """Judge `schedule` with the simulator and package it as a Plan."""
    sim = simulate(graph, schedule)
    return Plan(strategy=strategy, budget_bytes=budget_bytes, schedule=list(schedule),
                predicted_peak_bytes=sim.peak_bytes, total_cost=sim.total_cost,
                extra_cost=sim.extra_cost, extra_flops=sim.extra_flops, status=status,
                solve_time_s=solve_time_s, gap=gap, graph_fingerprint=graph.fingerprint(),
                details=dict(details or {}))
