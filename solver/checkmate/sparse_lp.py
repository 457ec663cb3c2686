"""A small sparse LP/MILP builder run on HiGHS (highspy), for models too large to build in PuLP.

The relaxation in solver/checkmate/bounds.py has tens of thousands of variables; PuLP builds such a model one
Python object per coefficient. Here variables and rows are plain lists, handed to HiGHS in one
`passModel` call. Solves are deterministic: one thread, a fixed seed, and (unless the caller gives
a wall-clock limit) only work limits.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["SparseModel", "Solution", "HotLP", "MipCheck", "interrupt_with"]


@dataclass
class Solution:
    """What HiGHS returned. status: "optimal", "limit" (a limit stopped a MIP), "infeasible", or
    "error". objective: the incumbent's value (None when there is none); bound: a proven lower
    bound on the model's minimum (the LP optimum, or the MIP's dual bound), None if unknown.
    x: the incumbent's variable values (None when there is none)."""

    status: str
    objective: float | None
    bound: float | None
    x: np.ndarray | None
    seconds: float
    nodes: int = 0
    iterations: int = 0  # simplex iterations (a MILP's: over all its LPs), a deterministic measure of work


class SparseModel:
    """Minimise c.x subject to lo <= A x <= hi and variable bounds, some variables integral."""

    def __init__(self):
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.cost: list[float] = []
        self.integral: list[bool] = []
        self._starts: list[int] = []
        self._index: list[int] = []
        self._value: list[float] = []
        self._lo: list[float] = []
        self._hi: list[float] = []

    @property
    def num_vars(self) -> int:
        """How many variables the model has."""
        return len(self.lb)

    @property
    def num_rows(self) -> int:
        """How many rows the model has."""
        return len(self._lo)

    def var(self, lb: float = 0.0, ub: float = 1.0, cost: float = 0.0, integral: bool = False) -> int:
        """A new variable; returns its column index."""
        self.lb.append(lb)
        self.ub.append(ub)
        self.cost.append(cost)
        self.integral.append(integral)
        return len(self.lb) - 1

    def row(self, terms, lo: float = -math.inf, hi: float = math.inf) -> None:
        """Add lo <= sum(a * x_j for j, a in terms) <= hi (repeated columns are summed)."""
        merged: dict[int, float] = {}
        for j, a in terms:
            merged[j] = merged.get(j, 0.0) + a
        self._starts.append(len(self._index))
        for j, a in merged.items():
            if a:
                self._index.append(j)
                self._value.append(a)
        self._lo.append(lo)
        self._hi.append(hi)

    def violations(self, x, tol: float = 1e-7) -> list[str]:
        """The rows and variable bounds the point `x` breaks, beyond a relative tolerance (the
        tests' check that a model is a relaxation: every real schedule's point satisfies it)."""
        x = np.asarray(x, float)
        lo, hi = np.array(self._lo, float), np.array(self._hi, float)
        lengths = np.diff(np.array(self._starts + [len(self._index)], dtype=np.int64))
        terms = np.array(self._value, float) * x[np.array(self._index, dtype=np.int64)]
        a = np.bincount(np.repeat(np.arange(self.num_rows), lengths), weights=terms, minlength=self.num_rows)
        scale = 1 + np.maximum(np.abs(a), np.maximum(np.where(np.isfinite(lo), np.abs(lo), 0),
                                                      np.where(np.isfinite(hi), np.abs(hi), 0)))
        broken = np.flatnonzero((a < lo - tol * scale) | (a > hi + tol * scale))
        out = [f"row {r}: {self._lo[r]} <= {a[r]} <= {self._hi[r]}" for r in broken]
        inside = (np.array(self.lb) - 1e-9 <= x) & (x <= np.array(self.ub) + 1e-9)
        out += [f"var {j}" for j in np.flatnonzero(~inside)]
        return out

    def highs(self, *, integral: bool = False, max_nodes: int | None = None, time_limit_s: float | None = None,
              mip_gap: float = 1e-6, msg: bool = False, extra_rows: list | None = None,
              cutoff: float | None = None, max_improving: int | None = None, max_iterations: int | None = None,
              target: float | None = None):
        """A HiGHS instance holding the model (the LP relaxation unless integral), single-threaded
        with seed 0. extra_rows: [(columns, lo, hi)] rows with coefficients 1 appended after the
        model's own (the branch-and-bound's class rows). For the MILP: cutoff, HiGHS's objective
        bound (its search prunes what is above it, and status "infeasible" then says only that
        nothing is below it; a solution above it may still come back where presolve solves the model
        whole); max_improving: it stops after that many improving solutions; target: it stops at
        its first solution at or below this objective (HiGHS's objective target; status "limit",
        with that solution and the dual bound so far). max_iterations: a work limit on the LP's
        simplex iterations (status "limit" when it stops there)."""
        import highspy

        from remat.solver.checkmate.backends import new_highs

        h = new_highs(highspy) if not msg else highspy.Highs()
        h.setOptionValue("output_flag", bool(msg))
        opts = {"threads": 1, "random_seed": 0, "mip_rel_gap": mip_gap, "mip_abs_gap": 0.0}
        if max_nodes is not None:
            opts["mip_max_nodes"] = int(max_nodes)
        if time_limit_s is not None:
            opts["time_limit"] = float(max(time_limit_s, 0.01))
        if integral and cutoff is not None:
            opts["objective_bound"] = float(cutoff)
        if integral and max_improving is not None:
            opts["mip_max_improving_sols"] = int(max_improving)
        if integral and target is not None:
            opts["objective_target"] = float(target)
        if max_iterations is not None:
            opts["simplex_iteration_limit"] = int(max_iterations)
        for k, v in opts.items():
            h.setOptionValue(k, v)
        starts, index, value = list(self._starts), list(self._index), list(self._value)
        lo, hi = list(self._lo), list(self._hi)
        for cols, a, b in extra_rows or ():
            starts.append(len(index))
            index += list(cols)
            value += [1.0] * len(cols)
            lo.append(a)
            hi.append(b)
        n = self.num_vars
        integ = np.array(self.integral if integral else [False] * n, np.uint8)
        h.passModel(n, len(lo), len(index), 2, 1, 0.0, np.array(self.cost, float), _clip(self.lb), _clip(self.ub),
                    _clip(lo), _clip(hi), np.array(starts, np.int32), np.array(index, np.int32),
                    np.array(value, float), integ)
        return h

    def solve(self, *, integral: bool = False, max_nodes: int | None = None, time_limit_s: float | None = None,
              mip_gap: float = 1e-6, start: np.ndarray | None = None, msg: bool = False,
              cutoff: float | None = None, max_improving: int | None = None,
              max_iterations: int | None = None, target: float | None = None,
              interrupt: Callable[[MipCheck], bool] | None = None) -> Solution:
        """Solve the LP relaxation (integral=False) or the MILP, single-threaded with seed 0.
        start: a feasible point for the MILP to start from (ignored when HiGHS rejects it).
        cutoff, max_improving, max_iterations, target: see `highs`. interrupt: for the MILP,
        called at each of HiGHS's interrupt checks (a MipCheck); True stops it there (status
        "limit", with its incumbent and bound so far)."""
        t0 = time.perf_counter()
        h = self.highs(integral=integral, max_nodes=max_nodes, time_limit_s=time_limit_s, mip_gap=mip_gap, msg=msg,
                       cutoff=cutoff, max_improving=max_improving, max_iterations=max_iterations, target=target)
        n = self.num_vars
        if start is not None and integral:
            h.setSolution(n, np.arange(n, dtype=np.int32), np.asarray(start, float))
        if interrupt is not None and integral:
            interrupt_with(h, interrupt)
        _run(h)
        return _solution(h, integral, time.perf_counter() - t0)

    def set_row_bounds(self, r: int, lo: float | None = None, hi: float | None = None) -> None:
        """Change row r's bounds (None: leave that side as it is)."""
        if lo is not None:
            self._lo[r] = lo
        if hi is not None:
            self._hi[r] = hi


class HotLP:
    """One HiGHS instance holding a SparseModel's LP, solved again after some of the model's bounds
    changed from the basis of its last solve (a change of right-hand sides leaves that basis dual
    feasible: the dual simplex goes on from it, where a new instance starts from nothing)."""

    def __init__(self, model: SparseModel):
        self.model = model
        self.h = model.highs()

    def solve(self, rows=(), cols=()) -> Solution:
        """The LP after the model's bounds of `rows` and `cols` changed (pushed to HiGHS first). A
        hot start that ends neither optimal nor infeasible is run again from scratch."""
        t0 = time.perf_counter()
        h, m = self.h, self.model
        rows, cols = np.asarray(rows, np.int32), np.asarray(cols, np.int32)
        if rows.size:
            h.changeRowsBounds(rows.size, rows, _clip(m._lo[r] for r in rows), _clip(m._hi[r] for r in rows))
        if cols.size:
            h.changeColsBounds(cols.size, cols, _clip(m.lb[j] for j in cols), _clip(m.ub[j] for j in cols))
        _run(h)
        sol = _solution(h, False, time.perf_counter() - t0)
        if sol.status not in ("optimal", "infeasible"):
            h.clearSolver()
            _run(h)
            sol = _solution(h, False, time.perf_counter() - t0)
        return sol


@dataclass(frozen=True)
class MipCheck:
    """What HiGHS tells a MILP's interrupt check: how many checks so far (itself included), its
    dual bound, its best solution's objective (inf: none yet) and the branch-and-bound nodes it
    has run (0 while in the root node), all in the model's units."""

    checks: int
    dual_bound: float
    primal_bound: float
    nodes: int


def interrupt_with(h, interrupt: Callable[[MipCheck], bool]) -> None:
    """HiGHS instance `h`'s MILP interrupt checks (deterministic on one thread) handed to
    `interrupt` as MipChecks; True stops the MILP there."""
    import highspy

    checks = [0]

    def check(_type, _message, data_out, data_in, _user) -> None:
        checks[0] += 1
        if interrupt(MipCheck(checks[0], data_out.mip_dual_bound, data_out.mip_primal_bound,
                              int(data_out.mip_node_count))):
            data_in.user_interrupt = True

    h.setCallback(check, None)
    h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)


def _clip(xs) -> np.ndarray:
    """Bounds as HiGHS takes them: infinities as its own infinity."""
    import highspy

    return np.clip(np.fromiter(xs, float), -highspy.kHighsInf, highspy.kHighsInf)


def _run(h) -> None:
    import highspy

    if h.run() == highspy.HighsStatus.kError:
        highspy.Highs.resetGlobalScheduler(True)  # another thread count was set before in this process
        h.run()


def _solution(h, integral: bool, secs: float) -> Solution:
    """What HiGHS's last run found (see Solution)."""
    import highspy

    M = highspy.HighsModelStatus
    ms = h.getModelStatus()
    info = h.getInfo()
    if ms in (M.kInfeasible, M.kUnboundedOrInfeasible):
        return Solution("infeasible", None, math.inf, None, secs)
    has_x = info.primal_solution_status == 2
    x = np.array(h.getSolution().col_value) if has_x else None
    obj = info.objective_function_value if has_x else None
    nodes = int(getattr(info, "mip_node_count", 0) or 0)
    iters = max(int(info.simplex_iteration_count), 0)
    if not integral:
        if ms != M.kOptimal:
            return Solution("error" if ms not in (M.kTimeLimit, M.kIterationLimit) else "limit",
                            None, None, None, secs, iterations=iters)
        # the LP optimum is the bound (its dual value equals the primal one at optimality)
        return Solution("optimal", obj, obj, x, secs, iterations=iters)
    bound = info.mip_dual_bound
    bound = bound if math.isfinite(bound) else None
    if ms == M.kOptimal:
        return Solution("optimal", obj, bound if bound is not None else obj, x, secs, nodes, iters)
    if ms in (M.kSolutionLimit, M.kTimeLimit, M.kIterationLimit, M.kInterrupt, M.kObjectiveTarget):
        return Solution("limit", obj, bound, x, secs, nodes, iters)
    return Solution("error", obj, None, x, secs, nodes, iters)
