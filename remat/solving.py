"""Solving a TrainingGraph under a budget with one strategy, and the smallest budget it can meet.

`solve` is the public entry point (`remat.solve`); the pipeline (remat/pipeline.py) and the FSDP2
helpers (remat/distributed.py) call it too, so an infeasible budget is refused the same way
everywhere: InfeasibleBudgetError naming the smallest budget the same strategy reaches.
"""
from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from remat.core import progress
from remat.core.training_graph import TrainingGraph
from remat.solver import get_options, get_solver
from remat.core.plan import LOWEST_PEAK, InfeasibleBudgetError, Plan
from remat.solver.checkmate.peak_bisection import sharing_cpus
from remat.validate import check_solve_args

__all__ = ["solve", "smallest_feasible", "known_smallest_feasible", "smallest_feasible_of_each", "at_once",
           "infeasible_budget", "strategy_options"]


def solve(graph: TrainingGraph, budget_bytes: int | None, solver: str = "checkmate",
          time_limit_s: float | None = None, *, quiet: bool = False, **solver_kwargs) -> Plan:
    """Plan `graph` under `budget_bytes` with one strategy; raise InfeasibleBudgetError when no
    plan fits, naming the smallest budget found feasible (a budget this call then accepts, with the
    same options). time_limit_s: an optional wall-clock limit on checkmate's MILP (None: only its
    deterministic work limits, so the plan does not depend on the machine's load). quiet: no
    progress on stderr."""
    check_solve_args(graph, budget_bytes, solver, time_limit_s, solver_kwargs)  # before any solving
    with progress.quiet(quiet):
        return _solve(graph, budget_bytes, solver, time_limit_s, solver_kwargs)


def _solve(graph: TrainingGraph, budget_bytes: int | None, solver: str, time_limit_s: float | None,
           solver_kwargs: dict) -> Plan:
    plan = get_solver(solver)(graph, budget_bytes, **strategy_options(solver, time_limit_s, solver_kwargs).as_kwargs())
    if budget_bytes is not None and (plan.status == "infeasible" or not plan.fits):
        raise infeasible_budget(solver, budget_bytes, smallest_feasible(graph, solver, time_limit_s, **solver_kwargs))
    return plan


def infeasible_budget(solver: str, budget_bytes: int, smallest: int) -> InfeasibleBudgetError:
    """The error refusing `budget_bytes`, naming `smallest`, the smallest budget found feasible."""
    return InfeasibleBudgetError(
        f"no {solver} plan fits {budget_bytes / 2**20:.2f} MiB; the smallest budget found feasible "
        f"is {smallest / 2**20:.2f} MiB ({smallest} bytes)", min_feasible_bytes=smallest)


def smallest_feasible(graph: TrainingGraph, solver: str, time_limit_s: float | None = None,
                       **solver_kwargs) -> int:
    """The smallest budget `solve` accepts with these options: for checkmate the peak of its
    lowest-peak plan, which `solve` falls back to (cached per graph), so the two never disagree."""
    options = strategy_options(solver, time_limit_s, solver_kwargs)
    if solver == "checkmate":
        from remat.solver.checkmate import min_feasible_budget

        return min_feasible_budget(graph, **options.lowest_peak_kwargs())
    # baselines: the lowest peak they reach with these options, with no budget they must meet
    return get_solver(solver)(graph, LOWEST_PEAK, **options.as_kwargs()).predicted_peak_bytes


def known_smallest_feasible(graph: TrainingGraph, solver: str, time_limit_s: float | None = None,
                            **solver_kwargs) -> int | None:
    """smallest_feasible where it is already known for `graph` (an equal graph) and these options
    (checkmate's lowest-peak search is cached), else None: nothing is searched."""
    if solver != "checkmate":
        return None
    from remat.solver.checkmate.lowest_peak import known_min_feasible_budget

    return known_min_feasible_budget(graph, **strategy_options(solver, time_limit_s, solver_kwargs).lowest_peak_kwargs())


def smallest_feasible_of_each(graphs: dict, solver: str, time_limit_s: float | None = None,
                              **solver_kwargs) -> dict:
    """smallest_feasible of each graph ({key: graph} -> {key: bytes}), the graphs searched at once
    (`at_once`): the two loss heads of Funnel (772 nodes) on this 2-core machine, 51 s one after the
    other, 40 s at once. Each search is the one it would be alone on one CPU (its work limits count
    simplex iterations, not seconds; its first probes are not paired: peak_bisection.sharing_cpus)."""
    return at_once({k: (lambda g=g: smallest_feasible(g, solver, time_limit_s, **solver_kwargs))
                    for k, g in graphs.items()}, solver_kwargs)


def at_once(calls: dict[Any, Callable[[], Any]], solver_kwargs: dict, workers: int = 2) -> dict:
    """{key: call()} for solver calls, run in `workers` threads, each in the caller's context
    (progress silenced or not). HiGHS lets go of the GIL while it solves, and checkmate's searches
    are mostly LPs. Only with HiGHS's one thread per solve (checkmate's default, `threads=1`): a MILP
    asking for another count than its thread's HiGHS scheduler has resets HiGHS's global scheduler
    (backends.py), which is not safe while another thread solves; otherwise one after the other."""
    if len(calls) < 2 or solver_kwargs.get("threads", 1) != 1:
        return {k: call() for k, call in calls.items()}
    n = min(workers, len(calls))
    pool = ThreadPoolExecutor(n, thread_name_prefix="remat-solve")

    def beside(call: Callable[[], Any]) -> Any:
        with sharing_cpus(n):  # a search's first probes are not paired where the CPUs are taken
            return call()

    try:
        futures = {k: pool.submit(contextvars.copy_context().run, beside, call) for k, call in calls.items()}
        return {k: f.result() for k, f in futures.items()}
    finally:
        # not waited for: an interrupt (Ctrl+C) or a search's error returns at once, the other
        # searches finishing in their threads, unread (HiGHS cannot be stopped inside an LP)
        pool.shutdown(wait=False, cancel_futures=True)


def strategy_options(solver: str, time_limit_s: float | None, solver_kwargs: dict):
    """The strategy's Options (time_limit_s goes to the strategies that take it, checkmate's and the
    MILP's: the baselines take no time)."""
    options = get_options(solver)
    takes_time = "time_limit_s" in {f.name for f in dataclasses.fields(options)}
    kwargs = {**solver_kwargs, "time_limit_s": time_limit_s} if takes_time else solver_kwargs
    return options.make(solver, kwargs)
