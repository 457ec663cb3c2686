"""A lower bound that certifies: branch and bound over the relaxation's LP (solver/checkmate/relaxation.py).

The LP of the relaxation is fractional where a memory row is a knapsack: a value recomputed 0.23
times, or half-recomputed in two places. Branching on single variables rarely moves the bound on a
network of identical blocks, because the fraction moves to the same value in another block at the
same LP cost. So the branches are on *class sums*: the values of structurally identical nodes
(same op, bytes, workspace and cost: the same tensor in every block) form a class, and the number
of times a class is recomputed, sum of its R variables, is an integer in every schedule, so
"sum <= floor(s)" or "sum >= ceil(s)" splits the problem without losing any schedule. When every
class sum is integral, single fractional variables are branched on. Best-first: the bound is the
least LP value among the open nodes (less a safety margin for HiGHS's tolerances); nodes at or
above the incumbent plan's cost are pruned (the optimum is at most that cost anyway).

The search is cut by deterministic work limits (simplex iterations over all LPs, and LPs solved),
optionally by wall clock, and stops once the bound is within `target_gap` of the incumbent, or when
STALL LPs in a row have not raised it by STALL_RISE of the gap left. Every node's LP solution is
offered to `on_solution` (the caller turns it into plans: a better incumbent prunes more).
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np

from remat.solver.checkmate.relaxation import Relaxation

__all__ = ["Certificate", "certify", "classes", "STALL", "STALL_RISE", "SIMPLEX_REPORT", "WORK_FLOOR",
           "DEVEX_FROM_ROWS"]

# the branch and bound may always spend this many simplex iterations, whatever its work factor
# (a small graph's root LP takes a few hundred; proving its optimum takes some thousands)
WORK_FLOOR = 30_000
# LPs without the bound rising before the search gives up (deterministic) ... On a CNN the bound
# creeps up by 1e-5 of the gap per LP, 150 LPs for nothing; on RegNet (945 nodes, LPs of 80k rows)
# it rose by 0.04 points of its 5.5% gap in the 50 LPs after its third. Where the bound rises it
# does so within a few LPs (every transformer of benchmarks/certificates.py). Not fewer, even
# where a flat bound hands over to HiGHS's root cuts (RegNet, LeViT: flat for 20 LPs, 4-8 s):
# tests/conftest.py's transformer_like(4) at 60% of keep_all is flat for 13 LPs, then rises by a
# tenth by its 19th, where the cuts after 8 LPs proved a gap of 8.9% instead of 3.6%
STALL = 20
STALL_RISE = 0.01  # ... by at least this share of the gap left
# On relaxations of this many rows or more the root LP takes the branch and bound's whole
# iteration budget (WORK_ROWS / rows, solver/checkmate/certified_search.py), and HiGHS's devex
# pricing solves it sooner than its default dual steepest edge, whose iterations cost more (T5,
# 238k rows: 81k devex iterations against 77k). Below it the node LPs count:
# steepest edge takes fewer iterations per LP, and the work limit counts iterations.
DEVEX_FROM_ROWS = 100_000
SIMPLEX_REPORT = 2000  # simplex iterations between two progress reports within one LP


@dataclass
class Certificate:
    """What the branch and bound proved: `bound` (model units: multiply by rel.cost_scale) is a lower
    bound on the relaxation's optimum; `x` the LP solution of the open node with the least value."""

    bound: float
    root: float
    lps: int
    iterations: int
    seconds: float
    stopped_by: str  # "proved" (no open node below the incumbent), "gap", "work limit", "stalled", "time limit",
    # "root LP limit" (the root LP did not finish within its limits: no bound), or the reason `root_stop` gave
    # (no branching) or `stop_check` gave
    x: np.ndarray | None = None
    infeasible: bool = False
    log: list = field(default_factory=list)


def classes(rel: Relaxation) -> list[list[int]]:
    """R columns grouped by the class of their node (op, bytes, workspace, cost)."""
    out: dict = {}
    for (u, _), col in rel.computed.items():
        v = rel.graph.nodes[u]
        out.setdefault((v.op, v.out_bytes, v.workspace_bytes, round(v.cost, 6)), []).append(col)
    return [cols for _, cols in sorted(out.items(), key=lambda kv: min(kv[1]))]


def certify(rel: Relaxation, *, incumbent: float = math.inf, target_gap: float = 1e-4,
            max_iterations: int | None = None, work_factor: float | None = None, max_lps: int | None = None,
            time_limit_s: float | None = None, on_solution=None, on_lp=None,
            root_iterations: int | None = None, on_simplex=None, root_stop=None,
            known_bound: float = -math.inf, good_gap: float = 0.0, patience: int = 0,
            stop_check=None) -> Certificate:
    """Branch and bound on the relaxation's LP (see the module docstring). incumbent: the cost of
    the best plan known, in model units; on_solution(x, value) may return a better one. Work
    limits: max_iterations simplex iterations in all (or work_factor times the root LP's, never
    below WORK_FLOOR), and max_lps LPs; root_iterations bounds the root LP's simplex iterations (a
    root LP stopped by it, or by the time limit, proves nothing: the bound is 0, stopped_by "root
    LP limit"). on_lp(lps, bound, incumbent, work), if given, is called after each branching
    (work: the share of the simplex iteration limit spent, None without one), on_simplex(iterations)
    every SIMPLEX_REPORT iterations of an LP (progress). root_stop(root), if given, is asked with the
    root LP's value (model units) once the root's solution was offered: a reason not to branch
    (stopped_by), or None. known_bound: a bound proved
    otherwise (model units): the gap the search stops at is the incumbent's over the larger of its
    own bound and this one. good_gap: it also stops (stopped_by "good gap") once that gap is within
    good_gap and `patience` LPs have passed since the incumbent last improved. stop_check(bound, root),
    if given, is asked after each branching with the search's bound and the root LP's value (model
    units): a reason to stop there (stopped_by), or None."""
    import highspy

    t0 = time.perf_counter()
    m = rel.model
    cls = classes(rel)
    base = m.num_rows
    inf = highspy.kHighsInf
    h = m.highs(extra_rows=[(cols, -inf, inf) for cols in cls])
    if m.num_rows >= DEVEX_FROM_ROWS:
        h.setOptionValue("simplex_dual_edge_weight_strategy", 1)
    M = highspy.HighsModelStatus
    if on_simplex is not None:
        last = [0]

        def report(_type, _msg, data_out, _data_in, _user) -> None:
            it = int(data_out.simplex_iteration_count)
            if it - last[0] >= SIMPLEX_REPORT or it < last[0]:
                last[0] = it
                on_simplex(it)

        h.setCallback(report, None)
        h.startCallback(highspy.cb.HighsCallbackType.kCallbackSimplexInterrupt)
    cost = np.array(m.cost, float)
    integral = np.array(m.integral, bool)
    lb0, ub0 = np.array(m.lb, float), np.array(m.ub, float)
    iters = 0

    def lp(node) -> tuple[float | None, np.ndarray | None]:
        nonlocal iters
        rows, cols = node
        for r, (a, b) in rows.items():
            h.changeRowBounds(base + r, a, b)
        for j, (a, b) in cols.items():
            h.changeColBounds(j, a, b)
        if time_limit_s is not None:  # the wall-clock limit holds inside an LP too
            h.setOptionValue("time_limit", float(max(0.01, time_limit_s - (time.perf_counter() - t0))))
        h.run()
        status[0] = h.getModelStatus()
        ok = status[0] == M.kOptimal
        out = (h.getInfo().objective_function_value, np.array(h.getSolution().col_value)) if ok else (None, None)
        iters += int(h.getInfo().simplex_iteration_count)
        for r in rows:
            h.changeRowBounds(base + r, -inf, inf)
        for j in cols:
            h.changeColBounds(j, lb0[j], ub0[j] if math.isfinite(ub0[j]) else inf)
        return out

    status = [None]
    if root_iterations is not None:
        h.setOptionValue("simplex_iteration_limit", int(root_iterations))
    root, x = lp(({}, {}))
    h.setOptionValue("simplex_iteration_limit", highspy.kHighsIInf)
    if work_factor is not None:
        cap = int(max(work_factor * iters, WORK_FLOOR))
        max_iterations = cap if max_iterations is None else min(max_iterations, cap)
    if root is None and status[0] in (M.kTimeLimit, M.kIterationLimit):
        return Certificate(0.0, 0.0, 1, iters, time.perf_counter() - t0, "root LP limit")
    if root is None:
        return Certificate(math.inf, math.inf, 1, iters, time.perf_counter() - t0, "proved", infeasible=True)
    if on_solution is not None:
        incumbent = min(incumbent, on_solution(x, root))
    reason = root_stop(root) if root_stop is not None else None
    if reason is not None:
        return Certificate(min(root, incumbent), root, 1, iters, time.perf_counter() - t0, reason, x)
    heap = [(root, 0, ({}, {}), x)]
    count, lps, stopped = 1, 1, "proved"
    last_rise = [root, 1]  # the best bound so far and the LP count when it last rose
    last_better = 1  # the LP count when the incumbent last improved
    log = []
    while heap:
        value, _, node, x = heap[0]
        if value >= incumbent * (1 - 1e-9):
            heap = []
            break
        proved = max(value, known_bound)  # what the search and the bound proved otherwise prove together
        if incumbent < math.inf and incumbent - proved <= target_gap * max(incumbent, 1e-12):
            stopped = "gap"
            break
        if (good_gap > 0 and incumbent < math.inf and incumbent - proved <= good_gap * max(incumbent, 1e-12)
                and lps - last_better >= patience):
            stopped = "good gap"
            break
        if max_iterations is not None and iters >= max_iterations or max_lps is not None and lps >= max_lps:
            stopped = "work limit"
            break
        if value > last_rise[0] + max(STALL_RISE * (incumbent - last_rise[0]) if incumbent < math.inf else 0.0,
                                      1e-9 * abs(last_rise[0]) + 1e-12):
            last_rise[:] = [value, lps]
        elif lps - last_rise[1] >= STALL:
            stopped = "stalled"
            break
        if time_limit_s is not None and time.perf_counter() - t0 >= time_limit_s:
            stopped = "time limit"
            break
        branch = _branch(x, node, cls, cost, integral)
        if branch is None:  # an integral point of the relaxation: the relaxation is solved
            break
        heapq.heappop(heap)
        for child in branch:
            v, xc = lp(child)
            lps += 1
            if v is None:
                continue
            if on_solution is not None and v < incumbent:
                found = on_solution(xc, v)
                if found < incumbent:
                    incumbent, last_better = found, lps
            if v < incumbent * (1 - 1e-9):
                count += 1
                heapq.heappush(heap, (v, count, child, xc))
        log.append((lps, heap[0][0] if heap else incumbent, incumbent))
        if on_lp is not None:
            on_lp(lps, log[-1][1], incumbent, iters / max_iterations if max_iterations else None)
        reason = stop_check(heap[0][0], root) if stop_check is not None and heap else None
        if reason is not None:
            stopped = reason
            break
    bound = min(heap[0][0], incumbent) if heap else incumbent
    best_x = heap[0][3] if heap else None
    return Certificate(bound, root, lps, iters, time.perf_counter() - t0, stopped, best_x, log=log)


def _branch(x: np.ndarray, node, cls: list, cost: np.ndarray, integral: np.ndarray):
    """The two children of `node` at its LP solution x: on the class sum whose fraction costs the
    most, else on the single fractional variable whose fraction costs the most; None if x is
    integral."""
    rows, cols = node
    best = None
    for r, members in enumerate(cls):
        s = float(x[members].sum())
        f = s - math.floor(s)
        if 1e-6 < f < 1 - 1e-6:
            score = cost[members[0]] * min(f, 1 - f)
            if best is None or score > best[0]:
                best = (score, r, s)
    if best is not None:
        _, r, s = best
        a, b = rows.get(r, (-math.inf, math.inf))
        lo_child = ({**rows, r: (a, min(b, math.floor(s)))}, cols)
        hi_child = ({**rows, r: (max(a, math.ceil(s)), b)}, cols)
        return [lo_child, hi_child]
    frac = np.where(integral & (x > 1e-6) & (x < 1 - 1e-6))[0]
    if frac.size == 0:
        return None
    score = np.minimum(x[frac], 1 - x[frac]) * (cost[frac] + 1e-9)
    j = int(frac[np.argmax(score)])
    return [(rows, {**cols, j: (0.0, 0.0)}), (rows, {**cols, j: (1.0, 1.0)})]
