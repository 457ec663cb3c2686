"""Plans for each distinct block graph at several budgets, from its smallest feasible one to
keep_all's peak (the levels remat/blockwise.py and remat/distributed.py choose from for a step's
blocks), solved two at a time and remembered per graph: a call refused under the smallest budget
and called again at the one its InfeasibleBudgetError named plans the same blocks at the same
levels, whatever the budget asked (TimeSeriesTransformer's blocks: ~8 s of solves spared)."""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Any

from remat.core.plan import Plan
from remat.core.training_graph import TrainingGraph
from remat.solver import get_solver
from remat.solving import at_once, smallest_feasible, solve

__all__ = ["level_plans", "plans_at_levels", "forget_level_plans", "LEVEL_MEMO_SIZE", "LEVEL_GAP"]

# distinct block graphs whose level plans are remembered, the most recent kept
LEVEL_MEMO_SIZE = 64
# checkmate's gap for the levels above a graph's smallest budget (unless the caller asks for one):
# a step's plan is its blocks' plans at one level, chosen by a bound and a measurement, not
# certified as a whole, so proving each level's plan optimal buys no certificate. Nystromformer's
# block (283 nodes; its iterative pseudo-inverse) at its level 1: 20 s proving its plan within
# 1.2%, 9.6 s within 1.9%, the same plan. The smallest budget's search and solve keep the gap asked
# (the budget a refusal names, and the lowest-peak plans the other levels' solves read)
LEVEL_GAP = 0.02

_LEVEL_MEMO: OrderedDict[tuple, list[Plan]] = OrderedDict()  # (graph, _memo_key) -> its plans at the levels
_MEMO_LOCK = threading.Lock()  # blocks may be planned in threads


def level_plans(graph: TrainingGraph, levels: int, solver: str, time_limit_s: float | None,
                solver_kwargs: dict) -> list[Plan]:
    """Plans for `graph` at `levels` budgets from its smallest feasible one to keep_all's peak (solved
    two at a time)."""
    return plans_at_levels({0: graph}, levels, solver, time_limit_s, solver_kwargs)[0]


def plans_at_levels(graphs: dict[Any, TrainingGraph], levels: int, solver: str, time_limit_s: float | None,
                    solver_kwargs: dict) -> dict[Any, list[Plan]]:
    """level_plans of each graph ({key: graph} -> {key: plans}): the smallest feasible budgets searched
    two at a time, then every graph's budgets solved in one queue, two at a time, each graph's lowest
    first (the tightest budget's solve is the slowest: started first, the others fill the second
    thread around it; one queue, not one per graph inside one over the graphs, keeps two solves at
    once rather than four on two CPUs), checkmate's above the smallest within LEVEL_GAP. A graph
    equal to one planned before with the same options (without a wall-clock limit, the solves
    depend on nothing else) gets the plans remembered for it (LEVEL_MEMO_SIZE graphs, the most
    recent kept)."""
    memo = _memo_key(levels, solver, time_limit_s, solver_kwargs)
    with _MEMO_LOCK:
        known = {k: _LEVEL_MEMO.get((g, memo)) for k, g in graphs.items()} if memo is not None else {}
    todo = {k: g for k, g in graphs.items() if known.get(k) is None}
    solved = _solved_at_levels(todo, levels, solver, time_limit_s, solver_kwargs) if todo else {}
    if memo is not None:
        with _MEMO_LOCK:
            for k, plans in solved.items():
                _LEVEL_MEMO[todo[k], memo] = plans
                _LEVEL_MEMO.move_to_end((todo[k], memo))
            for k in graphs:
                if known.get(k) is not None:
                    _LEVEL_MEMO.move_to_end((graphs[k], memo))
            while len(_LEVEL_MEMO) > LEVEL_MEMO_SIZE:
                _LEVEL_MEMO.popitem(last=False)
    # a remembered plan is tied to this graph (an equal one, traced again)
    return {k: solved[k] if k in solved else [dataclasses.replace(p, graph=graphs[k]) for p in known[k]]
            for k in graphs}


def _memo_key(levels: int, solver: str, time_limit_s: float | None, solver_kwargs: dict) -> tuple | None:
    """What besides the graph the level plans depend on; None where they are not remembered (a
    wall-clock limit makes them depend on the machine's load; options that cannot be hashed)."""
    if time_limit_s is not None:
        return None
    key = (levels, solver, tuple(sorted(solver_kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _solved_at_levels(graphs: dict[Any, TrainingGraph], levels: int, solver: str, time_limit_s: float | None,
                      solver_kwargs: dict) -> dict[Any, list[Plan]]:
    """plans_at_levels' solves, nothing remembered."""
    lows = at_once({k: (lambda g=g: smallest_feasible(g, solver, time_limit_s, **solver_kwargs))
                    for k, g in graphs.items()}, solver_kwargs)
    budgets = {}
    for k, g in graphs.items():
        high = max(get_solver("keep_all")(g, None).predicted_peak_bytes, lows[k])
        budgets[k] = [lows[k] + (high - lows[k]) * j // max(levels - 1, 1) for j in range(levels)]
    # each budget solved once: a block whose smallest feasible budget is keep_all's peak (a small
    # one) has the same budget at every level
    jobs = dict.fromkeys((k, budgets[k][j]) for j in range(levels) for k in graphs)
    above = ({**solver_kwargs, "mip_gap": LEVEL_GAP} if solver == "checkmate" and "mip_gap" not in solver_kwargs
             else solver_kwargs)
    plans = at_once({(k, b): (lambda g=graphs[k], b=b, kw=solver_kwargs if b == budgets[k][0] else above:
                              solve(g, b, solver=solver, time_limit_s=time_limit_s, quiet=True, **kw))
                     for k, b in jobs}, solver_kwargs)
    return {k: [plans[(k, b)] for b in budgets[k]] for k in graphs}


def forget_level_plans() -> None:
    """Forget every remembered graph's level plans."""
    with _MEMO_LOCK:
        _LEVEL_MEMO.clear()
