"""The lowest-peak plan Checkmate knows, and `min_feasible_budget`, its peak.

The min-peak MILP (the budget rows become M >= U[t,k] + workspace + kept + resident, minimise M)
against equal_spacing's lowest-peak plan, whichever peaks lower on the fine graph. Cached per graph
object and options: min_feasible_budget and solve's last fallback read the same entry, so every
budget at or above the one reported is a budget solve accepts.
"""
from __future__ import annotations

import copy
import time
import weakref
from dataclasses import replace

from remat.graph_capture.training_graph import TrainingGraph
from remat.solver import equal_spacing
from remat.solver.backends import Limits, default_backend
from remat.solver.checkmate_attempts import cut_to_deadline, make_limits, solve_milp, warn_fallback
from remat.solver.checkmate_model import build_model, memory_unit, milp_peak, set_start, solution_stages
from remat.solver.checkmate_stages import (DEFAULT_COARSEN_TO, baseline_schedules, coarse_graph,
                                           plan_from_stages, stages_of)
from remat.solver.plan import Plan
from remat.solver.simulator import simulate

__all__ = ["min_feasible_budget", "lowest_peak_plan", "min_peak_plan"]


def min_peak_plan(graph: TrainingGraph, g: TrainingGraph, backend: str, limits: Limits,
                  attempts_log: list) -> Plan | None:
    """Minimise M >= U[t,k] + workspace + kept + resident over the MILP's space (no budget)."""
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


# lowest-peak plans per (graph object, options): min_feasible_budget and solve's last fallback read
# the same entry, so the budget one reports is a budget the other accepts, whatever the limits
_LOWEST: dict = {}


def lowest_peak_plan(graph: TrainingGraph, *, backend: str, coarsen_to: int | None, limits: Limits,
                     deadline: float | None = None) -> Plan:
    """The lowest-peak plan known: the min-peak MILP's or equal_spacing's lowest, whichever peaks
    lower (cached per graph object and options `limits`, whatever wall clock was left before
    `deadline` when it was computed; a copy is returned)."""
    key = (id(graph), backend, coarsen_to, limits)
    hit = _LOWEST.get(key)
    if hit is not None and hit[0]() is graph:
        return copy.deepcopy(hit[1])
    t0 = time.perf_counter()
    name = default_backend() if backend == "auto" else backend
    g = coarse_graph(graph, coarsen_to)
    log: list = []
    plan = min_peak_plan(graph, g, name, cut_to_deadline(limits, deadline), log)
    # equal_spacing's lowest-peak plan is a valid answer too; the coarse model can miss it
    es = equal_spacing.solve(graph, 1)
    failed = [a for a in log if "error" in a]
    if plan is None or es.predicted_peak_bytes < plan.predicted_peak_bytes:
        if plan is not None:
            es.details["min_peak_milp_bytes"] = plan.predicted_peak_bytes
        es.strategy, es.status = "checkmate", "feasible"
        es.details["schedule_source"] = ("equal_spacing (lower peak than the min-peak MILP)" if plan is not None
                                         else "equal_spacing (the min-peak MILP found no plan)")
        plan = es
    else:
        plan.details["schedule_source"] = "min_peak_milp"
    if failed:
        warn_fallback(f"min-peak MILP backend failure ({failed[0]['error']}); "
                      f"answered by {log[-1]['backend'] if 'status' in log[-1] else 'equal_spacing'}")
    plan.details["attempts"] = log
    plan.budget_bytes = plan.predicted_peak_bytes
    plan.solve_time_s = time.perf_counter() - t0  # coarsening and the comparison included
    # the callback holds the dict itself: at interpreter exit the module global may already be None
    _LOWEST[key] = (weakref.ref(graph, lambda _, k=key, cache=_LOWEST: cache.pop(k, None)), plan)
    return copy.deepcopy(plan)


def min_feasible_budget(graph: TrainingGraph, *, backend: str = "auto",
                        max_nodes: int | None = None,
                        time_limit_s: float | None = None, coarsen_to: int | None = DEFAULT_COARSEN_TO,
                        threads: int | None = 1, mip_gap: float | None = 1e-4, return_plan: bool = False,
                        **_: object):
    """The smallest budget for which a plan was found: solve the MILP minimising the peak (a
    variable M >= U[t,k] + workspace + kept + resident for every t, k) and return the FINE
    simulated peak of that plan (with coarsening it can be below the coarse model's own peak,
    which is in plan.details). When equal_spacing's lowest-peak plan peaks lower (or the MILP
    finds nothing), that plan is the answer; plan.details says which one it is. `solve` with the
    same options accepts every budget at or above this answer: this plan is its last fallback
    (cached per graph object). Options as in `solve` (mip_gap does not apply: kept for symmetry)."""
    limits = make_limits(time_limit_s, max_nodes, mip_gap, threads)
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    plan = lowest_peak_plan(graph, backend=backend, coarsen_to=coarsen_to, limits=limits, deadline=deadline)
    return (plan.predicted_peak_bytes, plan) if return_plan else plan.predicted_peak_bytes
