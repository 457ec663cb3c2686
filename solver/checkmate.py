"""checkmate: Checkmate's MILP (Jain et al., MLSys 2020) over a coarsened graph, solved with PuLP.

`solve(graph, budget_bytes)` builds the MILP (solver/checkmate_model.py) on the coarsened graph,
warm-starts it with the cheapest fitting baseline schedule (solver/checkmate_stages.py), runs it on
the backends in turn (solver/checkmate_attempts.py: HiGHS, then CBC, under a deterministic node
limit), expands its schedule to the fine graph and spends the slack the coarse model leaves there
(solver/refine.py). `min_feasible_budget` is the
peak of the lowest-peak plan known (solver/checkmate_lowest.py).

`solve` never raises for a solver failure and never calls a budget infeasible that
min_feasible_budget (same options) reported feasible: when the MILP has no fitting plan it answers
with equal_spacing's plan or the cached lowest-peak plan, refined on the fine graph.
"""
from __future__ import annotations

import time
from dataclasses import asdict

from remat.graph_capture.training_graph import TrainingGraph
from remat.solver import equal_spacing
from remat.solver.backends import available as backend_available
from remat.solver.backends import attempts, default_backend
from remat.solver.checkmate_attempts import (MIN_NODES, NODE_WORK, SolverFallbackWarning, cut_to_deadline,
                                             make_limits, node_limit, solve_milp, warn_fallback)
from remat.solver.checkmate_lowest import lowest_peak_plan, min_feasible_budget
from remat.solver.checkmate_model import build_model, memory_unit, milp_peak, set_start, solution_stages
from remat.solver.checkmate_stages import (DEFAULT_COARSEN_TO, baseline_schedules, coarse_graph, judge_schedules,
                                           onto_finer, plan_from_stages)
from remat.solver.plan import Plan, plan_from_schedule
from remat.solver.refine import drop_recomputations
from remat.solver.simulator import simulate

__all__ = ["solve", "min_feasible_budget", "node_limit", "SolverFallbackWarning", "DEFAULT_COARSEN_TO",
           "NODE_WORK", "MIN_NODES"]


def solve(graph: TrainingGraph, budget_bytes: int, *, backend: str = "auto",
          max_nodes: int | None = None, time_limit_s: float | None = None,
          coarsen_to: int | None = DEFAULT_COARSEN_TO, warm_start: bool = True,
          mip_gap: float | None = 1e-4, threads: int | None = 1, msg: bool = False,
          presolve: bool = True, **_: object) -> Plan:
    """Checkmate's MILP under `budget_bytes` (the step's peak, resident memory included).

    backend: "auto" (default: HiGHS when highspy is installed, else CBC), "highs" or "cbc"; a
    backend that fails falls back to the next one, and then to the best heuristic plan, with a
    SolverFallbackWarning (plan.details["attempts"] and ["fallback"] say what happened).
    max_nodes: the deterministic work limit (branch-and-bound nodes after the root; None:
    node_limit(binaries), scaled to the model; the MILP runs single-threaded with threads=1): with
    it alone the same graph and budget give the same plan on an idle or a busy machine.
    time_limit_s: an optional wall-clock safety net (None: none); with it the plan depends on the
    machine's load. coarsen_to: coarse node count the MILP works on (None: the fine graph).

    Status "optimal" (proven, within `mip_gap` of the extra cost), "feasible" (a limit stopped the
    search with an incumbent, plan.gap is the relative gap; or a fallback plan that fits), or
    "infeasible" (no plan fits: the plan holds the lowest-peak baseline schedule, for
    information). Never "infeasible" for a budget at or above min_feasible_budget's answer with
    the same options: that plan is the last fallback. presolve: with CBC on 60+ coarse nodes,
    first solve a coarser MILP (a quarter of the limits) to warm-start this one."""
    t0 = time.perf_counter()
    requested = backend
    backend = default_backend() if backend == "auto" else backend
    attempts(backend, False)  # an unknown backend is a caller's error: raise before any work
    if backend == "highs" and not backend_available("highs"):
        raise ImportError("backend='highs' needs the `highspy` package (pip install highspy)")
    limits = make_limits(time_limit_s, max_nodes, mip_gap, threads)
    g = coarse_graph(graph, coarsen_to)
    unit = memory_unit(budget_bytes, g)
    model = build_model(g, budget_bytes, unit)
    details = {"coarse_nodes": len(g.nodes), "fine_nodes": len(graph.nodes), "backend": backend,
               "backend_requested": requested, "limits": asdict(limits),
               "unit_bytes": unit, "variables": {k: v for k, v in model.counts.items()
                                                 if k != "constraints"},
               "constraints": model.counts["constraints"], "build_s": round(time.perf_counter() - t0, 3)}
    # baselines on the coarse graph, in the MILP's own model: the cheapest fitting one warm-starts.
    # With CBC on a large coarse graph, a quick MILP on a coarser graph is one more candidate
    # (CBC's own incumbents are weak there; HiGHS does not need it)
    cands = baseline_schedules(graph, g)
    if presolve and backend == "cbc" and warm_start and g is not graph and len(g.nodes) >= 60:
        sub = solve(graph, budget_bytes, backend=backend, coarsen_to=int(len(g.nodes) * 0.65),
                    max_nodes=max(1, (max_nodes or node_limit(model.counts["binaries"])) // 4),
                    time_limit_s=time_limit_s and time_limit_s * 0.25, warm_start=True,
                    mip_gap=mip_gap, threads=threads, presolve=False)
        details["presolve"] = {"coarse_nodes": sub.details["coarse_nodes"], "status": sub.status,
                               "extra_cost": sub.extra_cost, "s": round(sub.solve_time_s, 3)}
        if sub.status != "infeasible" and getattr(sub, "_coarse_schedule", None) is not None:
            coarser = coarse_graph(graph, sub.details["coarse_nodes"])
            refined = onto_finer(coarser, g, sub._coarse_schedule)
            if refined is not None:
                cands.append((f"milp(coarse {len(coarser.nodes)})", refined))
    best_base, lowest = judge_schedules(g, cands, budget_bytes)
    warm = bool(warm_start and best_base is not None and set_start(model, best_base[2]))
    if best_base is not None:
        details["baseline"] = {"name": best_base[0], "extra_cost": best_base[1].extra_cost,
                               "coarse_peak_bytes": best_base[1].peak_bytes, "warm_start": warm}
    es = equal_spacing.solve(graph, budget_bytes)  # the fine graph's baseline, for the record
    details["equal_spacing"] = {"fits": es.fits, "extra_cost": es.extra_cost,
                                "peak_bytes": es.predicted_peak_bytes, "k": es.details.get("k")}
    t1 = time.perf_counter()
    details["attempts"] = []
    deadline = None if time_limit_s is None else t0 + time_limit_s
    out = solve_milp(model, backend, cut_to_deadline(limits, deadline), warm, msg, details["attempts"])
    details["milp_s"] = round(time.perf_counter() - t1, 3)
    if details["attempts"] and details["attempts"][-1]["backend"] != backend:
        details["backend"] = details["attempts"][-1]["backend"]  # the one that answered
    failed = [a for a in details["attempts"] if "error" in a]
    if out.status in ("optimal", "feasible"):
        import pulp

        details["objective"] = pulp.value(model.prob.objective)
        details["best_bound"] = out.bound
        details["stopped_by"] = out.stopped_by
        details["milp_peak_bytes"] = milp_peak(model)
        details["schedule_source"] = "milp"
        if failed:
            warn_fallback(f"MILP backend failure ({failed[0]['error']}); answered by {details['backend']}")
        plan = plan_from_stages(graph, g, solution_stages(model), strategy="checkmate", budget=budget_bytes,
                                status=out.status, t0=t0, gap=out.gap, details=details)
        if plan.fits:
            plan = _polish(graph, plan, [es], budget_bytes, t0)
            if es.fits and es.extra_cost < plan.details["milp_plan"]["extra_cost"] - 1e-9:
                plan.details["warning"] = (f"equal_spacing (k={es.details.get('k')}, extra cost "
                                           f"{es.extra_cost:g}) beats the MILP's own plan: the limits "
                                           "or the coarsening cost the MILP")
            return plan
        # rounding in the model; never expected, never hidden: the fallbacks below answer
        details["milp_overshoot_bytes"] = plan.predicted_peak_bytes - budget_bytes
        reason = "the MILP's plan overshoots the budget in the fine simulator"
    elif out.status == "infeasible":
        reason = "proven infeasible"
    elif out.stopped_by is not None:  # deterministic: no backend failed
        reason = f"no incumbent within the MILP's {out.stopped_by}"
    else:
        reason = ("every backend failed: " + "; ".join(f"{a['backend']}: {a.get('error') or a['status']}"
                                                       for a in details["attempts"]))
    details["reason"] = reason
    return _fallback(graph, g, budget_bytes, es, lowest, details, t0,
                     failed=bool(failed) or (out.status == "none" and out.stopped_by is None),
                     backend=requested, coarsen_to=coarsen_to, limits=limits, deadline=deadline)


def _fallback(graph, g, budget_bytes, es, lowest, details, t0, *, failed, backend, coarsen_to,
              limits, deadline) -> Plan:
    """No MILP plan fits: answer with the cheapest (after fine refinement) of equal_spacing's plan
    and the lowest-peak plan min_feasible_budget reports (cached per graph and options), when they
    fit; else an "infeasible" plan holding the lowest-peak schedule. `failed`: the MILP backends
    failed (not a proven infeasibility), so a SolverFallbackWarning says so."""
    fits = [es] if es.fits else []
    if not fits or details["reason"] == "proven infeasible" and g is not graph:
        # the coarse model is conservative: the lowest-peak plan may fit the fine graph; and a
        # budget at or above min_feasible_budget's answer must be answered with a plan
        low = lowest_peak_plan(graph, backend=backend, coarsen_to=coarsen_to, limits=limits, deadline=deadline)
        details["lowest_peak"] = {"peak_bytes": low.predicted_peak_bytes,
                                  "source": low.details.get("schedule_source")}
        if low.predicted_peak_bytes <= budget_bytes:
            fits.append(low)
    if fits:
        src = min(fits, key=lambda p: p.extra_cost)
        details["fallback"] = {"reason": details["reason"],
                               "candidates": [("equal_spacing" if p is es else "lowest_peak") for p in fits]}
        details["schedule_source"] = "fallback"
        details["coarse_peak_bytes"] = None
        if failed:
            warn_fallback(f"checkmate: {details['reason']}; answering with the best heuristic plan that fits "
                          f"(equal_spacing / lowest-peak plan, refined on the fine graph)")
        start = plan_from_schedule(graph, src.schedule, strategy="checkmate", budget_bytes=budget_bytes,
                                   status="feasible", details=details)
        return _polish(graph, start, [p for p in fits if p is not src], budget_bytes, t0,
                       first="equal_spacing" if src is es else "lowest_peak")
    if failed:
        warn_fallback(f"checkmate: {details['reason']}; no known plan fits {budget_bytes} bytes")
    name, _, stages = lowest
    details["schedule_source"] = name
    return plan_from_stages(graph, g, stages, strategy="checkmate", budget=budget_bytes, status="infeasible",
                            t0=t0, gap=None, details=details)


def _polish(graph: TrainingGraph, plan: Plan, others: list[Plan], budget_bytes: int, t0: float,
            first: str = "milp") -> Plan:
    """Spend the slack the coarse model leaves: drop, on the fine graph, every recomputation the
    budget does not need (solver/refine.py), starting from `plan` and from each fitting plan of
    `others` (equal_spacing's, the lowest-peak one); keep the cheaper. The MILP's own numbers stay
    in details."""
    cands = [(first, drop_recomputations(graph, plan.schedule, budget_bytes))]
    for p in others:
        if p.predicted_peak_bytes <= budget_bytes:
            name = "equal_spacing" if p.strategy == "equal_spacing" else "lowest_peak"
            cands.append((name, drop_recomputations(graph, p.schedule, budget_bytes)))
    judged = [(name, sched, simulate(graph, sched)) for name, sched in cands]
    name, sched, sim = min(judged, key=lambda c: (c[2].extra_cost, c[2].peak_bytes))
    details = {**plan.details, "milp_plan": {"extra_cost": plan.extra_cost,
                                             "peak_bytes": plan.predicted_peak_bytes},
               "refined": {n: {"extra_cost": r.extra_cost, "peak_bytes": r.peak_bytes} for n, _, r in judged},
               "refined_from": name}
    out = plan_from_schedule(graph, sched, strategy="checkmate", budget_bytes=budget_bytes,
                             status=plan.status, solve_time_s=time.perf_counter() - t0, gap=plan.gap,
                             details=details)
    out._coarse_schedule = getattr(plan, "_coarse_schedule", None)
    return out
