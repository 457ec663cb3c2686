"""Running Checkmate's MILP: the backends tried in turn, the deterministic work limit, and the
warning given when the answer does not come from the backend asked for.

Solving (solver/checkmate/backends.py): HiGHS by default, CBC as the fallback, each try recorded in
plan.details["attempts"]. The default limit is a node count, not wall clock, so the plan does not
depend on the machine's load.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import replace

from remat.core.errors import RematWarning
from remat.solver.checkmate.backends import BackendError, Limits, Outcome, attempts
from remat.solver.checkmate.backends import run as run_backend
from remat.solver.checkmate.milp_model import MilpModel

__all__ = ["NODE_WORK", "MIN_NODES", "POLISH_RESERVE_S", "SolverFallbackWarning", "warn_fallback",
           "node_limit", "make_limits", "cut_to_deadline", "solve_milp"]

# The default solve's work limit (no wall clock): branch-and-bound nodes after the root,
# NODE_WORK / binaries^2 (a node's LP grows with the model, and so does the tree), at least
# MIN_NODES. The 4-layer default GPT (256 nodes coarsened to 90: 5008 binaries) gets MIN_NODES, the
# root only: 48 to 96 s of HiGHS on 2 cores at 90% to 50% of keep_all, min-peak 51.79 MiB
# (benchmarks/results/core_cpu.txt); when the limit was tuned (4851 binaries then), 3 to 30 nodes
# took 128 s for the same final plans and the same min-peak. The tests' 9-layer training chain
# (18 nodes, 162 binaries) gets 1143 nodes, enough to prove optimality with CBC too.
NODE_WORK = 30_000_000
MIN_NODES = 1
POLISH_RESERVE_S = 3.0  # of a wall-clock time_limit_s, seconds kept for the fine refinement


class SolverFallbackWarning(RematWarning):
    """A MILP backend failed; the plan came from another backend or a heuristic (plan.details)."""


def warn_fallback(text: str, stacklevel: int = 3) -> None:
    """Warn (SolverFallbackWarning) that a backend failed, naming the one that answered instead;
    the warning points at the caller of the function that calls this (stacklevel 3), or further
    up the stack."""
    warnings.warn(text, SolverFallbackWarning, stacklevel=stacklevel)


def node_limit(binaries: int) -> int:
    """The default node limit of a MILP with `binaries` binary variables (a pure function of the
    model, so the same model always gets the same limit)."""
    return max(MIN_NODES, NODE_WORK // max(1, binaries) ** 2)


def make_limits(time_limit_s, max_nodes, mip_gap, threads) -> Limits:
    """The backends' Limits from solve's and min_feasible_budget's keyword options."""
    return Limits(max_nodes=max_nodes, time_limit_s=time_limit_s, mip_gap=mip_gap, threads=threads)


def cut_to_deadline(limits: Limits, deadline: float | None) -> Limits:
    """`limits` with the wall-clock limit cut to what is left before `deadline` (None: no wall
    clock), keeping POLISH_RESERVE_S for the work after the MILP."""
    if deadline is None:
        return limits
    return replace(limits, time_limit_s=max(1.0, deadline - time.perf_counter() - POLISH_RESERVE_S))


def solve_milp(model: MilpModel, backend: str, limits: Limits, warm: bool, msg: bool, log: list) -> Outcome:
    """Run the MILP on `backend`, falling back to the other backends (backends.attempts) when one
    fails: an error or crash (BackendError), or no solution for no known reason. A search its work
    limit stopped before any incumbent ("none", stopped_by set) is an answer, not a failure: the
    weaker backends would not do better within the same limit, so the caller's fallbacks follow.
    Each try is appended to `log`. Returns the first outcome that is not a failure, else "none"."""
    if limits.max_nodes is None:
        limits = replace(limits, max_nodes=node_limit(model.counts["binaries"]))
    deadline = None if limits.time_limit_s is None else time.perf_counter() + limits.time_limit_s
    last = Outcome("none")
    for name, w in attempts(backend, warm):
        lim = limits
        if deadline is not None:  # the wall-clock safety net covers all tries together
            lim = replace(limits, time_limit_s=max(1.0, deadline - time.perf_counter()))
        t = time.perf_counter()
        try:
            out = run_backend(model.prob, name, lim, warm=w, msg=msg)
        except BackendError as e:
            log.append({"backend": name, "warm_start": w, "error": str(e),
                        "s": round(time.perf_counter() - t, 3)})
            continue
        log.append({"backend": name, "warm_start": w, "status": out.status, "max_nodes": lim.max_nodes,
                    "stopped_by": out.stopped_by, "s": round(time.perf_counter() - t, 3)})
        if out.status != "none" or out.stopped_by is not None:
            return out
        last = out
    return last
