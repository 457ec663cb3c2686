"""Solvers: one module per strategy (checkmate a package of its stages, solver/checkmate/; its coarse
MILP alone, `checkmate_milp`, is solver/checkmate/milp.py), one signature
`solve(graph, budget_bytes, **options) -> Plan` whose keyword options are the fields of the
strategy's frozen `Options` (solver/options.py)."""
from remat.core.plan import InfeasibleBudgetError, Plan, plan_from_schedule
from remat.core.simulator import ScheduleError, SimResult, simulate

__all__ = ["Plan", "InfeasibleBudgetError", "plan_from_schedule", "simulate", "SimResult",
           "ScheduleError", "STRATEGIES", "get_solver", "get_options"]

STRATEGIES = ("checkmate", "keep_all", "equal_spacing", "chen_greedy", "per_block", "selective", "revolve",
              "checkmate_milp")
# the module of each strategy whose name is not its own module's
_MODULES = {"checkmate_milp": "remat.solver.checkmate.milp"}


def get_solver(name: str):
    """The `solve` function of a strategy, imported lazily."""
    import importlib

    if name not in STRATEGIES:
        raise ValueError(f"unknown solver {name!r}; choose one of {', '.join(STRATEGIES)}")
    return importlib.import_module(_MODULES.get(name, f"remat.solver.{name}")).solve


def get_options(name: str):
    """The `Options` dataclass of a strategy, imported lazily."""
    import importlib

    if name not in STRATEGIES:
        raise ValueError(f"unknown solver {name!r}; choose one of {', '.join(STRATEGIES)}")
    return importlib.import_module(_MODULES.get(name, f"remat.solver.{name}")).Options
