"""Solvers: one module per strategy, one signature `solve(graph, budget_bytes, **options) -> Plan`
whose keyword options are the fields of the strategy's frozen `Options` (solver/options.py)."""
import threading

from remat.core.plan import InfeasibleBudgetError, Plan, plan_from_schedule
from remat.core.simulator import ScheduleError, SimResult, simulate

__all__ = ["Plan", "InfeasibleBudgetError", "plan_from_schedule", "simulate", "SimResult",
           "ScheduleError", "STRATEGIES", "get_solver", "get_options"]

STRATEGIES = ("checkmate", "keep_all", "equal_spacing", "chen_greedy", "per_block", "selective", "revolve")


def get_solver(name: str):
    """The `solve` function of a strategy, imported lazily."""
    import importlib

    if name not in STRATEGIES:
        raise ValueError(f"unknown solver {name!r}; choose one of {', '.join(STRATEGIES)}")
    return importlib.import_module(f"remat.solver.{name}").solve


def get_options(name: str):
    """The `Options` dataclass of a strategy, imported lazily."""
    import importlib

    if name not in STRATEGIES:
        raise ValueError(f"unknown solver {name!r}; choose one of {', '.join(STRATEGIES)}")
    return importlib.import_module(f"remat.solver.{name}").Options


def _import_pulp_on_its_own_stack() -> None:
    """Import PuLP once, from a thread of its own. PuLP's first import keeps an exception (COPT's
    library not found: `pulp.apis.copt_api.COPT_DLL.err`) whose traceback holds every frame of
    the stack that imported it: imported inside a user's function (remat.optimize's first solve),
    that function's locals (the model, its parameters on the GPU) would never be freed. A thread's
    stack holds nothing of the caller's."""
    def run():
        try:
            import pulp  # noqa: F401
        except ImportError:  # reported where a solver needs it
            pass

    t = threading.Thread(target=run, name="remat-import-pulp")
    t.start()
    t.join()


_import_pulp_on_its_own_stack()

