"""backends: run a PuLP MILP on HiGHS (through highspy, the default) or CBC (through PuLP).

Why not PuLP's own HiGHS class: it has no warm start, builds the model one column and one row at a
time from Python, and raises KeyError when HiGHS stops at a node limit (kSolutionLimit is missing
from its status table). Here the model is passed to highspy in one call, a start point is given with
`setSolution`, and every HiGHS status is mapped.

Determinism: by default a solve is cut by a WORK limit (branch-and-bound nodes), never by the
wall clock, and runs single-threaded, so the same model gives the same answer on an idle or a
loaded machine. A wall-clock `time_limit_s` is available as a safety net; with it the
answer depends on the machine's load.

Every failure (an exception from the solver, a crashed CBC process, a status nobody expects) is
raised as `BackendError`, so the caller can fall back to another backend.
"""
from __future__ import annotations

from remat.core.errors import RematError

import functools
import math
import os
import re
import tempfile
import threading
import warnings
from dataclasses import dataclass

__all__ = ["Limits", "Outcome", "BackendError", "BACKENDS", "import_pulp", "available", "default_backend",
           "attempts", "run", "new_highs"]

BACKENDS = ("highs", "cbc")  # in order of preference: the first available one is the default


class BackendError(RematError, RuntimeError):
    """A MILP backend failed (error, crash, unexpected status): try the next one."""


@dataclass(frozen=True)
class Limits:
    """How long a MILP may run. max_nodes is a deterministic work limit (HiGHS's
    simplex_iteration_limit does not bound a MIP, and its MIP has no other); time_limit_s (None:
    no limit) is wall clock, so with it the result depends on machine load."""
    max_nodes: int | None = None  # branch-and-bound nodes (the root node's work is bounded by the solver)
    time_limit_s: float | None = None  # wall-clock safety net (load-dependent)
    mip_gap: float | None = 1e-4  # relative gap at which the search stops: proven "optimal"
    threads: int | None = 1  # 1: the same search path on every run


@dataclass
class Outcome:
    """What a backend returned. status: "optimal" (proven within mip_gap), "feasible" (a limit
    stopped it with an incumbent), "infeasible" (proven), or "none" (a limit stopped it with no
    incumbent). On "optimal"/"feasible" the PuLP variables' varValue hold the solution."""
    status: str
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    stopped_by: str | None = None  # which limit stopped the search, when one did


@functools.lru_cache(maxsize=None)
def import_pulp():
    """PuLP, imported the first time it is needed, from a thread of its own. PuLP's first import
    keeps an exception (COPT's library not found: `pulp.apis.copt_api.COPT_DLL.err`) whose
    traceback holds every frame of the stack that imported it: imported inside a user's function
    (remat.optimize's first solve), that function's locals (the model, its parameters on the GPU)
    would never be freed. A thread's stack holds nothing of the caller's. Only the MILP needs PuLP
    (this module and milp_model.py); the certified search calls HiGHS directly."""
    found: dict = {}

    def run():
        try:
            import pulp

            found["module"] = pulp
        except ImportError as e:
            found["error"] = str(e)

    t = threading.Thread(target=run, name="remat-import-pulp")
    t.start()
    t.join()
    if "error" in found:
        raise ImportError(f"the MILP needs PuLP (pip install pulp): {found['error']}")
    return found["module"]


def available(backend: str) -> bool:
    """Whether `backend` can run here (highspy importable; PuLP's bundled CBC present)."""
    return _available(backend)


@functools.lru_cache(maxsize=None)
def _available(backend: str) -> bool:
    if backend == "highs":
        try:
            import highspy  # noqa: F401
        except ImportError:
            return False
        return True
    if backend == "cbc":
        pulp = import_pulp()

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3 announcing its 4.0 API
                return bool(pulp.PULP_CBC_CMD(msg=False).available())
        except Exception:  # a broken PuLP install: CBC is simply not there
            return False
    return False


def default_backend() -> str:
    """The first available backend of BACKENDS (HiGHS when highspy is installed)."""
    for b in BACKENDS:
        if available(b):
            return b
    raise ImportError("no MILP backend: install highspy (pip install highspy) or PuLP with its CBC")


def attempts(backend: str, warm: bool) -> list[tuple[str, bool]]:
    """The (backend, warm start) runs to try in order: the requested backend, then the others that
    are available; CBC warm-started once more without its start file (its `-mips` start crashes
    the bundled binary now and then)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)} or 'auto'")
    order = [backend] + [b for b in BACKENDS if b != backend and available(b)]
    out: list[tuple[str, bool]] = []
    for b in order:
        out.append((b, warm))
        if b == "cbc" and warm:
            out.append((b, False))
    return out


def run(prob, backend: str, limits: Limits, *, warm: bool = False, msg: bool = False) -> Outcome:
    """Solve the PuLP problem `prob` with `backend`; warm: start from the variables' current
    values (set with setInitialValue). Raises BackendError on any failure."""
    try:
        if backend == "highs":
            return _run_highs(prob, limits, warm, msg)
        if backend == "cbc":
            return _run_cbc(prob, limits, warm, msg)
    except BackendError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the solver raised, the caller falls back
        raise BackendError(f"{backend}: {type(e).__name__}: {e}") from e
    raise ValueError(f"unknown backend {backend!r}")


# ---- HiGHS ----------------------------------------------------------------------------------------

def _run_highs(prob, limits: Limits, warm: bool, msg: bool) -> Outcome:
    import highspy
    import numpy as np
    pulp = import_pulp()

    variables = prob.variables()
    col = {v.name: j for j, v in enumerate(variables)}
    n = len(variables)
    cost = np.zeros(n)
    for v, c in prob.objective.items():
        cost[col[v.name]] = c
    inf = highspy.kHighsInf
    lower = np.array([-inf if v.lowBound is None else v.lowBound for v in variables], float)
    upper = np.array([inf if v.upBound is None else v.upBound for v in variables], float)
    integral = np.array([v.cat == pulp.const.LpInteger for v in variables], np.uint8)
    starts, index, value, rlo, rup = [0], [], [], [], []
    for c in prob.constraints.values():
        for v, a in c.items():
            if a:
                index.append(col[v.name])
                value.append(a)
        starts.append(len(index))
        rhs = -c.constant  # PuLP keeps the constant on the left: sum a x + constant (sense) 0
        rlo.append(rhs if c.sense in (pulp.const.LpConstraintGE, pulp.const.LpConstraintEQ) else -inf)
        rup.append(rhs if c.sense in (pulp.const.LpConstraintLE, pulp.const.LpConstraintEQ) else inf)
    h = new_highs(highspy) if not msg else highspy.Highs()
    h.setOptionValue("output_flag", bool(msg))
    options = {"mip_rel_gap": limits.mip_gap, "mip_max_nodes": limits.max_nodes,
               "time_limit": limits.time_limit_s, "threads": limits.threads, "random_seed": 0}
    for key, val in options.items():
        if val is not None:
            _set(h, key, val)
    m = len(rlo)
    _check(h.passModel(n, m, len(index), 2, 1, float(prob.objective.constant or 0.0), cost, lower, upper,
                       np.array(rlo, float), np.array(rup, float), np.array(starts[:-1], np.int32),
                       np.array(index, np.int32), np.array(value, float), integral), "passModel")
    if warm:
        start = np.array([v.varValue if v.varValue is not None else 0.0 for v in variables], float)
        _check(h.setSolution(n, np.arange(n, dtype=np.int32), start), "setSolution")
    status = h.run()
    if status == highspy.HighsStatus.kError and limits.threads is not None:
        # the process-wide scheduler was started with another thread count: restart it once
        highspy.Highs.resetGlobalScheduler(True)
        status = h.run()
    _check(status, "run")
    ms = h.getModelStatus()
    M = highspy.HighsModelStatus
    info = h.getInfo()
    if ms in (M.kInfeasible, M.kUnboundedOrInfeasible):
        return Outcome("infeasible")
    stopped = {M.kSolutionLimit: "node limit", M.kIterationLimit: "iteration limit",
               M.kTimeLimit: "time limit", M.kInterrupt: "interrupt"}.get(ms)
    if ms != M.kOptimal and stopped is None:
        raise BackendError(f"highs: unexpected model status {h.modelStatusToString(ms)}")
    if info.primal_solution_status != 2:  # 2 = feasible point: a limit hit before any incumbent
        return Outcome("none", stopped_by=stopped)
    x = h.getSolution().col_value
    for j, v in enumerate(variables):
        v.varValue = x[j]
    obj = info.objective_function_value
    bound = info.mip_dual_bound
    gap = info.mip_gap if math.isfinite(info.mip_gap) else None
    return Outcome("optimal" if ms == M.kOptimal else "feasible", objective=obj,
                   bound=bound if math.isfinite(bound) else None, gap=gap, stopped_by=stopped)


def _set(h, key: str, val) -> None:
    status = h.setOptionValue(key, val)
    if status != __import__("highspy").HighsStatus.kOk:
        raise BackendError(f"highs: cannot set option {key}={val!r}")


def _check(status, what: str) -> None:
    import highspy

    if status == highspy.HighsStatus.kError:
        raise BackendError(f"highs: {what} failed")


# ---- CBC ------------------------------------------------------------------------------------------

def _run_cbc(prob, limits: Limits, warm: bool, msg: bool) -> Outcome:
    pulp = import_pulp()

    # every file CBC reads or writes lives in this directory, removed even when CBC crashes
    with tempfile.TemporaryDirectory(prefix="remat_cbc_") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(msg=msg, timeLimit=limits.time_limit_s, gapRel=limits.mip_gap,
                                       threads=limits.threads, warmStart=warm, maxNodes=limits.max_nodes,
                                       logPath=None if msg else log_path)
        solver.tmpDir = tmp
        try:
            prob.solve(solver)
        except pulp.PulpSolverError as e:
            raise BackendError(f"cbc{' (warm start)' if warm else ''}: {e}") from e
        log = ""
        if os.path.exists(log_path):
            with open(log_path) as f:
                log = f.read()
    if prob.status == pulp.LpStatusInfeasible:
        return Outcome("infeasible")
    stopped = None
    m = re.search(r"Result - Stopped on ([^\n]*)", log)
    if m:  # "time", "nodes", "node limit", "iterations", ...
        why = m.group(1).strip().lower()
        stopped = "time limit" if "time" in why else "node limit" if "node" in why else why
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if stopped or prob.status == pulp.LpStatusNotSolved:
            return Outcome("none", stopped_by=stopped)
        raise BackendError(f"cbc: status {pulp.LpStatus.get(prob.status)}, solution status {prob.sol_status}")
    bound = gap = None
    m = re.search(r"Lower bound:\s+(-?[\d.e+-]+)", log)
    if m:
        bound = float(m.group(1))
    m = re.search(r"Gap:\s+(-?[\d.e+-]+)", log)
    if m:
        gap = float(m.group(1))
    obj = pulp.value(prob.objective) or 0.0
    proven = "Result - Optimal solution found" in log or (not log and stopped is None)
    if prob.sol_status == pulp.LpSolutionOptimal and proven:
        return Outcome("optimal", objective=obj, bound=bound, gap=gap if gap is not None else 0.0)
    if gap is None and bound is not None:
        gap = (obj - bound) / max(abs(obj), 1e-12)
    return Outcome("feasible", objective=obj, bound=bound, gap=gap, stopped_by=stopped)


_BANNER_LOCK = threading.Lock()
_banner_printed = False


def new_highs(highspy):
    """A Highs instance without its banner: the C++ constructor prints it to the process's stdout
    (once per process), before any option can turn output off, into the middle of the user's own
    output. stdout's file descriptor points at /dev/null for the first constructor alone, under a
    lock: two threads swapping the descriptor at once (solves run two at a time) could leave it
    pointing at /dev/null for good."""
    global _banner_printed
    if _banner_printed:
        return highspy.Highs()
    import ctypes
    import sys

    with _BANNER_LOCK:
        if _banner_printed:
            return highspy.Highs()
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                try:
                    return highspy.Highs()
                finally:
                    ctypes.CDLL(None).fflush(None)  # C stdio's buffer goes to /dev/null too
                    _banner_printed = True
        finally:
            os.dup2(saved, 1)
            os.close(saved)
