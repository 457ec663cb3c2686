"""Lower bounds on the extra cost of any plan under a budget.

`lower_bound` solves the relaxation of solver/checkmate/relaxation.py (whose docstring says why every
schedule is a point of it): its LP optimum, or the dual bound of its MILP after a node limit, is a
proven lower bound on the extra cost of every schedule whose first computations follow the graph's
order and whose simulated peak is within the budget. `point_of_schedule` maps a real schedule to
the relaxation's variables: a start for the MILP, and in the tests the check that the relaxation
is one (every real schedule must satisfy every row, at an objective no higher than its cost).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.relaxation import SAFETY, Relaxation
from remat.solver.checkmate.sparse_lp import Solution

__all__ = ["BoundResult", "lower_bound", "peak_lower_bound", "safe_bound", "solve_relaxation", "point_of_schedule"]


@dataclass
class BoundResult:
    """A lower bound on the extra cost of every schedule within the budget (math.inf: none fits),
    how it was obtained, and the solution it came with (a guide for plans, not a plan)."""

    bound: float
    status: str  # "lp", "milp-optimal", "milp-limit", "infeasible" (proven: no schedule fits), "none"
    seconds: float
    variables: int = 0
    rows: int = 0
    relaxed_cost: float | None = None  # the MILP incumbent's objective (cost units), if any
    x: np.ndarray | None = None  # the solution (LP or MILP incumbent)
    nodes: int = 0


def safe_bound(rel: Relaxation, value: float) -> float:
    """A model bound (in the model's cost units) as a bound in cost units, less a safety margin
    for the solver's tolerances."""
    return max(0.0, value * rel.cost_scale * (1 - SAFETY) - SAFETY * 1e-3 * rel.graph.total_cost)


def solve_relaxation(rel: Relaxation, *, integral: bool = False, max_nodes: int | None = None,
                     time_limit_s: float | None = None, start: np.ndarray | None = None) -> BoundResult:
    """Solve a built relaxation (LP, or MILP under the limits) into a BoundResult."""
    m = rel.model
    t0 = time.perf_counter()
    if rel.infeasible_at is not None:
        return BoundResult(math.inf, "infeasible", 0.0, m.num_vars, m.num_rows)
    sol: Solution = m.solve(integral=integral, max_nodes=max_nodes, time_limit_s=time_limit_s, start=start)
    secs = time.perf_counter() - t0
    if sol.status == "infeasible":
        return BoundResult(math.inf, "infeasible", secs, m.num_vars, m.num_rows)
    if sol.bound is None:
        return BoundResult(0.0, "none", secs, m.num_vars, m.num_rows, x=sol.x)
    status = "lp" if not integral else ("milp-optimal" if sol.status == "optimal" else "milp-limit")
    return BoundResult(safe_bound(rel, sol.bound), status, secs, m.num_vars, m.num_rows,
                       relaxed_cost=None if sol.objective is None else sol.objective * rel.cost_scale,
                       x=sol.x, nodes=sol.nodes)


def lower_bound(graph: TrainingGraph, budget: int, *, integral: bool = False, max_nodes: int | None = None,
                time_limit_s: float | None = None, **options) -> BoundResult:
    """A proven lower bound on the extra cost of every schedule (first computations in graph
    order) whose simulated peak is within `budget`: the relaxation's LP optimum, or with
    integral=True the MILP's dual bound after at most `max_nodes` branch-and-bound nodes (and
    `time_limit_s`, if given). math.inf when the relaxation proves that no schedule fits.
    options: Relaxation's (dense, group_target, fwd_reads_only, transients)."""
    t0 = time.perf_counter()
    rel = Relaxation(graph, budget, **options)
    out = solve_relaxation(rel, integral=integral, max_nodes=max_nodes, time_limit_s=time_limit_s)
    out.seconds = time.perf_counter() - t0
    return out


def peak_lower_bound(graph: TrainingGraph, *, integral: bool = False, max_nodes: int | None = None,
                     time_limit_s: float | None = None, **options) -> tuple[int, dict]:
    """A proven lower bound, in bytes, on the simulated peak of every schedule whose first
    computations follow the graph's order: the optimum (LP, or the MILP's dual bound under the
    limits) of the relaxation with the budget made a variable and recomputation free. Returns
    (bytes, details)."""
    t0 = time.perf_counter()
    rel = Relaxation(graph, None, **options)
    sol = rel.model.solve(integral=integral, max_nodes=max_nodes, time_limit_s=time_limit_s)
    value = sol.bound if sol.bound is not None else 0.0
    bound = max(0, math.floor(value * rel.mem_scale * (1 - SAFETY)) - 1)
    return bound, {"status": sol.status, "variables": rel.model.num_vars, "rows": rel.model.num_rows,
                   "integral": integral, "s": round(time.perf_counter() - t0, 3)}


def point_of_schedule(rel: Relaxation, schedule: list[str]) -> np.ndarray:
    """The relaxation's variables for a real schedule (first computations in graph order): L =
    the parts live after each state, C = computed again before the deadline, R = computed in the
    interval, a sitting state = the state of the group's sitting row of least modelled memory,
    W and y = the parts carried through an interval. A schedule within the budget satisfies every
    row at an objective no higher than its extra cost."""
    from remat.core.simulator import last_reads

    g = rel.graph
    idx, n = g.index, rel.n
    comps: list[list[int]] = [[] for _ in range(n)]
    for p, name in enumerate(schedule):
        comps[idx[name]].append(p)
    tau = [c[0] for c in comps]
    if any(b <= a for a, b in zip(tau, tau[1:])):
        raise ValueError("the schedule's first computations are not in the graph's order")
    spans: dict = {}  # (u, k) -> [(computed at, freed after)]
    start: dict = {}
    for s, frees in enumerate(last_reads(g, schedule)):
        u = idx[schedule[s]]
        for k in range(len(rel.part_bytes[u])):
            start[u, k] = s
        for name, k in frees:
            spans.setdefault((idx[name], k), []).append((start[idx[name], k], s))

    def live(u, k, pos):  # part k of u live after position pos
        return any(p <= pos < f for p, f in spans.get((u, k), ()))

    at = {s: tau[s] for s in range(n)}  # state -> schedule position it stands for
    # sitting states over the same rows stand for one row: the one where their modelled parts
    # hold the least memory together (so the memory row of every one of those rows holds)
    keys_of: dict = {}
    for (u, k, s) in rel.live:
        if s >= n:
            keys_of.setdefault(s, []).append((u, k))
    by_span: dict = {}
    for j, (_, a, b) in enumerate(rel.sitting_spans):
        by_span.setdefault((a, b), []).append(n + j)
    for (a, b), states in by_span.items():
        keys = [key for s in states for key in keys_of.get(s, ())]
        best = min(range(a, b + 1), key=lambda t: sum(rel.part_bytes[u][k] * live(u, k, tau[t]) for u, k in keys))
        for s in states:
            at[s] = tau[best]
    at[-1] = math.inf
    x = np.zeros(rel.model.num_vars)
    if rel.peak is not None:
        from remat.core.simulator import simulate

        x[rel.peak] = simulate(g, schedule).peak_bytes / rel.mem_scale
    for (u, k, s), col in rel.live.items():  # a value left out of the model is live whenever read
        x[col] = 1.0 if u in rel.unmodelled else float(live(u, k, at[s]))
    for (u, s), col in rel.again.items():
        d = rel.deadline[u, s]
        end = tau[d] if d < n else math.inf
        x[col] = float(any(at[s] < p < end for p in comps[u]))
    for (u, b), col in rel.computed.items():
        a = rel.interval[u, b][0]
        x[col] = float(any(at[a] < p <= at[b] for p in comps[u]))
    ms = rel.mem_scale
    for j, (_, _, M, parts) in rel.sitting.items():
        x[M] = sum(bts / ms * x[col] for col, bts in parts)
    for t, (W, ys) in rel.carried.items():
        total = sum(x[M] for a, b, M, _ in rel.sitting.values() if a <= t <= b)
        for y, u, k, read in ys:
            if y is None:  # a non-recomputable part: its L
                total += rel.part_bytes[u][k] / ms * x[rel.live[u, k, t]]
                continue
            x[y] = max(0.0, (1.0 if read else x[rel.live[u, k, t]]) - x[rel.computed[u, t]])
            total += rel.part_bytes[u][k] / ms * x[y]
        x[W] = total
    return x
