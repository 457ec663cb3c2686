"""Checkmate's MILP (Jain et al., MLSys 2020) on a coarsened graph: when it runs, running it, and
the strategy `checkmate_milp` that answers with its plan alone.

The gate, stated once (`milp_gate`): with milp="auto" the MILP runs when the coarse graph has at
most MILP_MAX_COARSE_NODES nodes. The graph is coarsened to `coarsen_to` nodes (DEFAULT_COARSEN_TO,
90) and a graph no larger than that is left as it is, so with the defaults the MILP runs on graphs
of at most 64 nodes, i.e. hand-made and toy graphs, never on a captured model of real size (there
the certified search answers); milp="always" runs it at any size, milp="never" never. PuLP is
imported only by the modules that build and solve the MILP (milp_model.py, backends.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from remat.core.plan import Plan, PlanStatus, finished, plan_from_schedule
from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.backends import BACKENDS, Limits, default_backend
from remat.solver.checkmate.backends import available as backend_available
from remat.solver.checkmate.milp_attempts import cut_to_deadline, make_limits, solve_milp, warn_fallback
from remat.solver.checkmate.milp_model import build_model, memory_unit, milp_peak, objective_value, set_start, \
    solution_stages
from remat.solver.checkmate.milp_stages import DEFAULT_COARSEN_TO, baseline_schedules, coarse_graph, judge_schedules, \
    plan_from_stages, stages_of
from remat.solver.options import StrategyOptions, check_choice, check_int, check_number
from remat.solver.refine import drop_recomputations
from remat.solver.schedule import keep_all_schedule
from remat.core.simulator import simulate

__all__ = ["MILP_MAX_COARSE_NODES", "MILP_MODES", "milp_gate", "resolve_backend", "MilpOutcome", "run_milp",
           "min_peak_plan", "Options", "solve"]

MILP_MAX_COARSE_NODES = 64  # milp="auto": the MILP runs on coarse graphs up to this size (its size grows
# with the square of the nodes; the budget MILP and the lowest peak's min-peak MILP share the gate)
MILP_MODES = ("auto", "always", "never")


def milp_gate(coarse_nodes: int, milp: str) -> str | None:
    """Why the MILP does not run on a coarse graph of `coarse_nodes` nodes under `milp`, or None
    when it runs."""
    if milp == "always" or milp == "auto" and coarse_nodes <= MILP_MAX_COARSE_NODES:
        return None
    if milp == "never":
        return "not run: milp='never'"
    return f"not run: {coarse_nodes} coarse nodes > {MILP_MAX_COARSE_NODES} (milp='always' runs it)"


def resolve_backend(backend: str, milp: str = "auto") -> str:
    """The backend "auto" resolves to; a caller's error (an unknown backend or milp mode, HiGHS
    asked for but not installed) raises here, before any work."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)} or 'auto'")
    backend = default_backend() if backend == "auto" else backend
    if backend == "highs" and not backend_available("highs"):
        raise ImportError("backend='highs' needs the `highspy` package (pip install highspy)")
    if milp not in MILP_MODES:
        raise ValueError(f"milp must be 'auto', 'always' or 'never', got {milp!r}")
    return backend


@dataclass(frozen=True)
class MilpOutcome:
    """What one run of the MILP gave: its plan on the fine graph (None: none, `reason` says why),
    how it was built and solved. `details()` is its part of plan.details."""

    plan: Plan | None
    backend: str  # the backend that answered (the one asked for when none did)
    unit_bytes: int
    counts: dict  # the model's variables by kind, and "constraints"
    build_s: float
    baseline: dict | None  # the baseline plan that warm-started it
    attempts: list = field(default_factory=list)  # one entry per backend tried
    milp_s: float = 0.0
    solution: dict | None = None  # objective, best bound, status, gap, peak of its solution
    reason: str | None = None  # why it gave no plan
    failed: bool = False  # no plan because a backend failed (an error, or no answer for no known reason)
    infeasible: bool = False  # proven infeasible on the coarse graph

    def details(self) -> dict:
        """The MILP's keys of plan.details (core/plan_details.py)."""
        out = {"unit_bytes": self.unit_bytes,
               "variables": {k: v for k, v in self.counts.items() if k != "constraints"},
               "constraints": self.counts["constraints"], "build_s": self.build_s}
        if self.baseline is not None:
            out["baseline"] = self.baseline
        out.update(attempts=self.attempts, milp_s=self.milp_s)
        if self.attempts:
            out["backend"] = self.backend
        if self.solution is not None:
            out.update(self.solution)
        if self.plan is not None:
            out["coarse_peak_bytes"] = self.plan.details["coarse_peak_bytes"]
            out["coarse_extra_cost"] = self.plan.details["coarse_extra_cost"]
            if not self.plan.fits:  # rounding in the model; never expected, never hidden
                out["milp_overshoot_bytes"] = self.plan.predicted_peak_bytes - self.plan.budget_bytes
        if self.reason is not None:
            out["reason"] = self.reason
        if self.infeasible:
            out["milp_infeasible"] = True
        if self.failed:
            out["milp_failed"] = True
        return out


def run_milp(graph: TrainingGraph, g: TrainingGraph, budget_bytes: int, *, backend: str, limits: Limits,
             deadline: float | None, warm_start: bool, msg: bool, stacklevel: int = 4) -> MilpOutcome:
    """Checkmate's MILP on the coarse graph `g` of `graph` under `budget_bytes`, warm-started from
    the best baseline schedule that fits (when `warm_start`), on `backend` and then the others
    (solver/checkmate/milp_attempts.py). A backend failure that another backend answered warns
    (SolverFallbackWarning; `stacklevel` as warn_fallback takes it: 4 points at the caller of
    run_milp's caller)."""
    t0 = time.perf_counter()
    unit = memory_unit(budget_bytes, g)
    model = build_model(g, budget_bytes, unit)
    build_s = round(time.perf_counter() - t0, 3)
    best_base, _ = judge_schedules(g, baseline_schedules(graph, g), budget_bytes)
    warm = bool(warm_start and best_base is not None and set_start(model, best_base[2]))
    baseline = None if best_base is None else {"name": best_base[0], "extra_cost": best_base[1].extra_cost,
                                               "coarse_peak_bytes": best_base[1].peak_bytes, "warm_start": warm}
    log: list = []
    t1 = time.perf_counter()
    out = solve_milp(model, backend, cut_to_deadline(limits, deadline), warm, msg, log)
    milp_s = round(time.perf_counter() - t1, 3)
    answered = log[-1]["backend"] if log else backend
    failed = any("error" in a for a in log)
    common = dict(backend=answered, unit_bytes=unit, counts=model.counts, build_s=build_s, baseline=baseline,
                  attempts=log, milp_s=milp_s)
    if out.status in ("optimal", "feasible"):
        if failed:
            first = next(a for a in log if "error" in a)
            warn_fallback(f"MILP backend failure ({first['error']}); answered by {answered}", stacklevel=stacklevel)
        solution = {"objective": objective_value(model), "best_bound": out.bound, "stopped_by": out.stopped_by,
                    "milp_peak_bytes": milp_peak(model), "milp_status": out.status, "milp_gap": out.gap}
        plan = plan_from_stages(graph, g, solution_stages(model), strategy="checkmate", budget=budget_bytes,
                                status=out.status, t0=t0, gap=out.gap, details={})
        return MilpOutcome(plan=plan, solution=solution, **common)  # a failure another backend answered: warned
    if out.status == "infeasible":
        return MilpOutcome(plan=None, reason="proven infeasible", infeasible=True, failed=failed, **common)
    if out.stopped_by is not None:
        return MilpOutcome(plan=None, reason=f"no incumbent within the MILP's {out.stopped_by}", failed=failed,
                           **common)
    reason = "every backend failed: " + "; ".join(f"{a['backend']}: {a.get('error') or a['status']}" for a in log)
    return MilpOutcome(plan=None, reason=reason, failed=True, **common)


@dataclass(frozen=True)
class Options(StrategyOptions):
    """checkmate_milp's options (see `solve`)."""

    backend: str = "auto"
    max_nodes: int | None = None
    time_limit_s: float | None = None
    coarsen_to: int | None = DEFAULT_COARSEN_TO
    warm_start: bool = True
    mip_gap: float | None = 1e-4
    threads: int | None = 1
    msg: bool = False

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, ("auto", "highs", "cbc"))
        for name in ("warm_start", "msg"):
            check_choice(name, getattr(self, name), (True, False))
        check_int("max_nodes", self.max_nodes, 1, optional=True)
        check_int("coarsen_to", self.coarsen_to, 1, optional=True)
        check_int("threads", self.threads, 1, optional=True)
        check_number("time_limit_s", self.time_limit_s, 0, optional=True, strict=True)
        check_number("mip_gap", self.mip_gap, 0, optional=True)


def min_peak_plan(graph: TrainingGraph, g: TrainingGraph, backend: str, limits: Limits,
                  attempts_log: list) -> Plan | None:
    """The MILP minimising the peak over the coarse graph `g` of `graph` (no budget: the budget
    rows become M >= U[t,k] + workspace + kept + resident, minimise M), warm-started from the
    lowest-peak baseline schedule; its plan on the fine graph, or None when it found none."""
    t0 = time.perf_counter()
    total = g.resident_bytes + sum(v.out_bytes + v.kept_bytes + max(v.workspace_bytes, 0)
                                   for v in g.nodes)
    unit = memory_unit(total, g)
    model = build_model(g, None, unit, minimise_peak=True)
    base = min(baseline_schedules(graph, g), key=lambda ns: simulate(g, ns[1]).peak_bytes)
    stages = stages_of(g, base[1])
    warm = stages is not None and set_start(model, stages)
    out = solve_milp(model, backend, replace(limits, mip_gap=None), warm, False, attempts_log)
    if out.status not in ("optimal", "feasible"):
        return None
    return plan_from_stages(graph, g, solution_stages(model), strategy="checkmate", budget=None,
                            status=out.status, t0=t0, gap=out.gap,
                            details={"milp_peak_bytes": milp_peak(model), "coarse_nodes": len(g.nodes)})


def solve(graph: TrainingGraph, budget_bytes: int | None, *, backend: str = "auto", max_nodes: int | None = None,
          time_limit_s: float | None = None, coarsen_to: int | None = DEFAULT_COARSEN_TO, warm_start: bool = True,
          mip_gap: float | None = 1e-4, threads: int | None = 1, msg: bool = False) -> Plan:
    """Checkmate's MILP alone, as the paper solves it: the graph coarsened to `coarsen_to` nodes
    (None: the fine graph), the MILP solved on `backend` under its deterministic node limit
    (solver/checkmate/milp_attempts.py), its plan expanded to the fine graph with its needless
    recomputations dropped. No certified search and no other candidates: the reference the
    checkmate strategy improves on. The MILP's size grows with the square of `coarsen_to`.
    Where the budget MILP has no plan (or the budget is None or below the resident bytes, as
    LOWEST_PEAK), the MILP minimising the peak answers, with status "infeasible" where even it
    does not fit."""
    t0 = time.perf_counter()
    name = resolve_backend(backend)
    limits = make_limits(time_limit_s, max_nodes, mip_gap, threads)
    deadline = None if time_limit_s is None else t0 + time_limit_s
    g = coarse_graph(graph, coarsen_to)
    details: dict = {"coarse_nodes": len(g.nodes), "fine_nodes": len(graph.nodes)}
    if budget_bytes is not None and budget_bytes >= graph.resident_bytes:
        out = run_milp(graph, g, budget_bytes, backend=name, limits=limits, deadline=deadline,
                       warm_start=warm_start, msg=msg)
        details.update(out.details())
        if out.plan is not None:
            sched = drop_recomputations(graph, out.plan.schedule, budget_bytes)
            return finished(plan_from_schedule(graph, sched, strategy="checkmate_milp", budget_bytes=budget_bytes,
                                               status=out.plan.status, gap=out.plan.gap, details=details), t0)
    log: list = []
    low = min_peak_plan(graph, g, name, cut_to_deadline(limits, deadline), log)
    details["attempts"] = details.get("attempts", []) + log
    if low is None:  # not even the min-peak MILP found a plan within its limits: nothing to offer
        details["reason"] = "the min-peak MILP found no plan within its limits"
        return finished(plan_from_schedule(graph, keep_all_schedule(graph), strategy="checkmate_milp",
                                           budget_bytes=budget_bytes, status=PlanStatus.INFEASIBLE,
                                           details=details), t0, status=PlanStatus.INFEASIBLE)
    sched = drop_recomputations(graph, low.schedule, low.predicted_peak_bytes)
    details["milp_peak_bytes"] = low.details["milp_peak_bytes"]
    return finished(plan_from_schedule(graph, sched, strategy="checkmate_milp", budget_bytes=budget_bytes,
                                       status=low.status, gap=low.gap, details=details), t0)
