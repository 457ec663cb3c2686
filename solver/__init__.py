"""Solvers: one module per strategy, one signature `solve(graph, budget_bytes, ...) -> Plan`."""
from remat.solver.plan import InfeasibleBudgetError, Plan, plan_from_schedule
from remat.solver.simulator import ScheduleError, SimResult, simulate

__all__ = ["Plan", "InfeasibleBudgetError", "plan_from_schedule", "simulate", "SimResult",
           "ScheduleError", "STRATEGIES", "get_solver"]

STRATEGIES = ("checkmate", "keep_all", "equal_spacing", "chen_greedy", "per_block", "selective", "revolve")


def get_solver(name: str):
    """The `solve` function of a strategy, imported lazily."""
    import importlib

    if name not in STRATEGIES:
        raise ValueError(f"unknown solver {name!r}; choose one of {', '.join(STRATEGIES)}")
    return importlib.import_module(f"remat.solver.{name}").solve
