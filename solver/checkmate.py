"""checkmate: the optimal strategy. Plans under a budget at the least extra compute, with a proven
lower bound on what any plan must recompute.

`solve(graph, budget_bytes)`:
  1. candidates: equal_spacing's, chen_greedy's and revolve's plans (and, on small graphs, the
     plan of Checkmate's MILP, Jain et al. 2020, on a coarsened graph: solver/checkmate_model.py,
     run on the backends in turn by solver/checkmate_attempts.py), each refined on the fine graph
     (solver/refine.py);
  2. the bound and plans of the rows over the budget (solver/peak_rows.py): for each step that
     keeping everything puts over the budget, a small model of what any plan must recompute to
     fit there; when the best plan is within `mip_gap` of it, that is the proof and step 3 is
     skipped (a language model's loss head: one row decides);
     then the certified search on the fine graph (solver/checkmate_certified.py): a relaxation of
     the problem whose LP is solved and branched on (solver/relaxation.py, solver/certify.py), each
     LP solution turned into plans (solver/guided.py), until the best plan is within `mip_gap` of
     the bound or a deterministic work limit is spent; the bound is the larger of the two;
  3. the cheapest plan that fits, with plan.lower_bound (proven: no schedule whose first
     computations follow the graph's order fits the budget at a lower extra cost), plan.gap =
     (extra cost - lower bound) / extra cost, and status "optimal" when the gap is within
     mip_gap, "feasible" otherwise, "infeasible" when nothing fits (details["reason"] says
     whether that is proven).
`min_feasible_budget` is the peak of the lowest-peak plan known (solver/checkmate_lowest.py), with
a proven lower bound on any plan's peak in its details.

`solve` never raises for a solver failure and never calls a budget infeasible that
min_feasible_budget (same options) reported feasible: its lowest-peak plan is the last fallback.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

from remat.core.training_graph import TrainingGraph
from remat.solver import equal_spacing
from remat.solver.backends import available as backend_available
from remat.solver.backends import attempts, default_backend
from remat.solver.checkmate_attempts import (MIN_NODES, NODE_WORK, SolverFallbackWarning, cut_to_deadline,
                                             make_limits, node_limit, solve_milp, warn_fallback)
from remat.solver.checkmate_certified import RELAXATION_MAX_NODES, certified_search
from remat.solver.checkmate_lowest import MILP_MAX_COARSE_NODES, lowest_peak_plan, min_feasible_budget
from remat.solver.checkmate_model import build_model, memory_unit, milp_peak, set_start, solution_stages
from remat.solver.checkmate_stages import (DEFAULT_COARSEN_TO, baseline_schedules, coarse_graph, judge_schedules,
                                           plan_from_stages)
from remat.core.plan import Plan, PlanStatus, plan_from_schedule
from remat.solver.peak_rows import peak_rows_search
from remat.solver.options import StrategyOptions, check_choice, check_int, check_number
from remat.solver.refine import drop_recomputations
from remat.core.simulator import simulate

__all__ = ["Options", "solve", "min_feasible_budget", "node_limit", "SolverFallbackWarning", "DEFAULT_COARSEN_TO",
           "NODE_WORK", "MIN_NODES", "MILP_MAX_COARSE_NODES"]

BASELINES_MAX_NODES = 1000  # larger graphs: the baselines only when the certified search finds nothing
TINY = 1e-12


@dataclass(frozen=True)
class Options(StrategyOptions):
    """checkmate's options (see `solve`). The ones `min_feasible_budget` takes too (the
    lowest-peak plan is `solve`'s last fallback) are `lowest_peak_kwargs()`."""

    backend: str = "auto"
    max_nodes: int | None = None
    time_limit_s: float | None = None
    coarsen_to: int | None = DEFAULT_COARSEN_TO
    warm_start: bool = True
    mip_gap: float | None = 1e-4
    threads: int | None = 1
    msg: bool = False
    milp: str = "auto"
    certify: bool = True
    max_iterations: int | None = None

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, ("auto", "highs", "cbc"))
        check_choice("milp", self.milp, ("auto", "always", "never"))
        for name in ("warm_start", "msg", "certify"):
            check_choice(name, getattr(self, name), (True, False))
        check_int("max_nodes", self.max_nodes, 1, optional=True)
        check_int("coarsen_to", self.coarsen_to, 1, optional=True)
        check_int("threads", self.threads, 1, optional=True)
        check_int("max_iterations", self.max_iterations, 1, optional=True)
        check_number("time_limit_s", self.time_limit_s, 0, optional=True, strict=True)
        check_number("mip_gap", self.mip_gap, 0, optional=True)

    def lowest_peak_kwargs(self) -> dict:
        return {k: getattr(self, k) for k in ("backend", "max_nodes", "time_limit_s", "coarsen_to", "threads", "mip_gap")}


def solve(graph: TrainingGraph, budget_bytes: int, *, backend: str = "auto",
          max_nodes: int | None = None, time_limit_s: float | None = None,
          coarsen_to: int | None = DEFAULT_COARSEN_TO, warm_start: bool = True,
          mip_gap: float | None = 1e-4, threads: int | None = 1, msg: bool = False,
          milp: str = "auto", certify: bool = True, max_iterations: int | None = None) -> Plan:
    """The cheapest plan found under `budget_bytes` (the step's peak, resident memory included),
    with a proven lower bound on the extra cost of any plan (see the module docstring).

    milp: "auto" (Checkmate's MILP when the coarse graph has at most MILP_MAX_COARSE_NODES nodes),
    "always" or "never". backend: the MILP's, "auto" (HiGHS when highspy is installed, else CBC),
    "highs" or "cbc"; a failing backend falls back to the next one, then to the other candidates,
    with a SolverFallbackWarning (plan.details["attempts"]). max_nodes: the MILP's node limit
    (None: node_limit(binaries)). coarsen_to: the MILP's coarse node count (None: the fine graph).
    certify: run the certified search (the lower bound and the relaxation's plans);
    max_iterations: its work limit in simplex iterations (None: scaled to the model). The default
    limits are work limits, so the same graph and budget give the same plan on an idle or a busy
    machine; time_limit_s adds a wall-clock limit (and with it load dependence), and the best plan
    found by then is returned with its bound. mip_gap: the relative gap at which the plan counts
    as optimal and the search stops."""
    t0 = time.perf_counter()
    mip_gap = 0.0 if mip_gap is None else mip_gap
    requested = backend
    backend = _check_options(backend, milp)
    deadline = None if time_limit_s is None else t0 + time_limit_s
    limits = make_limits(time_limit_s, max_nodes, mip_gap, threads)
    g = coarse_graph(graph, coarsen_to)
    details = {"coarse_nodes": len(g.nodes), "fine_nodes": len(graph.nodes), "backend": backend,
               "backend_requested": requested, "limits": asdict(limits), "coarse_peak_bytes": None}
    es, cands, milp_plan = _candidates(graph, g, budget_bytes, details, backend=backend, limits=limits,
                                       deadline=deadline, warm_start=warm_start, msg=msg, milp=milp, certify=certify)
    refined = _refine(graph, cands, budget_bytes)
    details["refined"] = {n: {"extra_cost": s.extra_cost, "peak_bytes": s.peak_bytes} for n, (_, s) in refined.items()}
    bound, proven_infeasible = 0.0, False
    if certify:
        bound, proven_infeasible = _certify(graph, budget_bytes, refined, details, mip_gap=mip_gap,
                                            max_iterations=max_iterations, deadline=deadline)
    details.setdefault("variables", details.get("relaxation", {}).get("variables"))
    details.setdefault("constraints", details.get("relaxation", {}).get("rows"))
    fits = _fitting(refined, budget_bytes, milp_plan, details)
    if not fits and es is None:  # a large graph the certified search found nothing for: the baselines
        es, late = _heuristics(graph, budget_bytes, details)
        # not filtered again: each fits, and refining keeps a plan within the budget
        fits = [(n, r, sim) for n, (r, sim) in _refine(graph, late, budget_bytes).items()]
    if not fits:
        if es is None:
            es = _equal_spacing(graph, budget_bytes, details)
        return _nothing_fits(graph, g, budget_bytes, es, details, t0, proven_infeasible, bound,
                             backend=requested, coarsen_to=coarsen_to, limits=limits, deadline=deadline)
    sched, sim = _choose(fits, milp_plan, es, details)
    return _finish(graph, sched, sim, budget_bytes, bound, mip_gap, details, t0)


def _check_options(backend: str, milp: str) -> str:
    """The backend "auto" resolves to; a caller's error (an unknown backend or milp mode, HiGHS
    asked for but not installed) raises here, before any work."""
    backend = default_backend() if backend == "auto" else backend
    attempts(backend, False)  # an unknown backend raises
    if backend == "highs" and not backend_available("highs"):
        raise ImportError("backend='highs' needs the `highspy` package (pip install highspy)")
    if milp not in ("auto", "always", "never"):
        raise ValueError(f"milp must be 'auto', 'always' or 'never', got {milp!r}")
    return backend


def _heuristics(graph: TrainingGraph, budget_bytes: int, details: dict) -> tuple[Plan, list[tuple[str, list[str]]]]:
    """equal_spacing's plan, and the heuristic candidates: its schedule when it fits, then the
    baselines'."""
    es = _equal_spacing(graph, budget_bytes, details)
    cands = [("equal_spacing", es.schedule)] if es.fits else []
    return es, cands + _baselines(graph, budget_bytes)


def _candidates(graph, g, budget_bytes, details, *, backend, limits, deadline, warm_start, msg, milp,
                certify) -> tuple[Plan | None, list[tuple[str, list[str]]], Plan | None]:
    """Phase 1, the plans to refine: the heuristics' (unless the graph is too large for them and the
    certified search runs) and, first, the coarse MILP's when `milp` runs it and it fits. Returns
    (equal_spacing's plan or None, the candidates, the MILP's plan or None)."""
    es = None
    cands: list[tuple[str, list[str]]] = []
    if len(graph.nodes) <= BASELINES_MAX_NODES or not certify:
        es, cands = _heuristics(graph, budget_bytes, details)
    milp_plan = None
    if milp == "always" or milp == "auto" and len(g.nodes) <= MILP_MAX_COARSE_NODES:
        milp_plan = _milp(graph, g, budget_bytes, backend, limits, deadline, warm_start, msg, details)
        if milp_plan is not None and milp_plan.fits:
            cands.insert(0, ("milp", milp_plan.schedule))
    else:
        details["milp"] = f"not run: {len(g.nodes)} coarse nodes > {MILP_MAX_COARSE_NODES} (milp='always' runs it)"
    return es, cands, milp_plan


def _refine(graph: TrainingGraph, cands: list[tuple[str, list[str]]], budget_bytes: int) -> dict:
    """Phase 2: each candidate with its needless recomputations dropped on the fine graph, and its
    simulation: name -> (schedule, simulation)."""
    refined = {}
    for name, sched in cands:
        r = drop_recomputations(graph, sched, budget_bytes)
        refined[name] = (r, simulate(graph, r))
    return refined


def _certify(graph, budget_bytes, refined, details, *, mip_gap, max_iterations, deadline) -> tuple[float, bool]:
    """Phase 3: the bound and plans of the rows over the budget (solver/peak_rows.py), then, unless
    they already prove the best plan within `mip_gap`, the certified search, started from the
    refined candidates. Plans of their own join `refined` as "peak_rows" and "relaxation". Returns
    (the proven lower bound, whether infeasibility is proven)."""
    def best_cost() -> float:
        return min((sim.extra_cost for _, sim in refined.values() if sim.peak_bytes <= budget_bytes), default=math.inf)

    left = None if deadline is None else max(0.5, deadline - time.perf_counter())
    rows = peak_rows_search(graph, budget_bytes, incumbent=best_cost(), mip_gap=mip_gap, time_limit_s=left)
    details["peak_rows"] = rows.details
    if math.isinf(rows.bound):
        details["bound_source"] = f"peak rows: no schedule fits at {rows.details['infeasible_row']}"
        return rows.bound, True
    if rows.schedule is not None:
        refined["peak_rows"] = (rows.schedule, simulate(graph, rows.schedule))
    best = best_cost()
    large = len(graph.nodes) > RELAXATION_MAX_NODES
    if best - rows.bound <= mip_gap * best + TINY or large:
        details["bound_source"] = "peak rows: the row models of the steps keep-all puts over the budget"
        if large:
            details["certify_skipped"] = (f"{len(graph.nodes)} nodes > {RELAXATION_MAX_NODES}: the whole step's relaxation "
                                          "is not built (millions of variables and GBs at this size)")
        return rows.bound, False
    starts = [(n, r) for n, (r, _) in refined.items()]
    left = None if deadline is None else max(0.5, deadline - time.perf_counter())
    res = certified_search(graph, budget_bytes, starts=starts, mip_gap=mip_gap, max_iterations=max_iterations,
                           time_limit_s=left)
    details.update(res.details)
    if res.schedule is not None and res.details.get("plan_source") == "relaxation":
        refined["relaxation"] = (res.schedule, simulate(graph, res.schedule))
    if math.isinf(res.bound):
        return res.bound, True
    if rows.bound > res.bound:  # else the certified search's own words (which relaxation, how many LPs)
        details["bound_source"] = "peak rows: the row models of the steps keep-all puts over the budget"
    return max(res.bound, rows.bound), False


def _fitting(refined: dict, budget_bytes: int, milp_plan: Plan | None, details: dict) -> list:
    """The refined plans within the budget, as (name, schedule, simulation). When the MILP ran and
    gave nothing, they answer instead: details["fallback"] says so, with a warning if it failed."""
    fits = [(n, s, sim) for n, (s, sim) in refined.items() if sim.peak_bytes <= budget_bytes]
    if fits and milp_plan is None and "reason" in details:  # the MILP ran and gave nothing: others answer
        details["fallback"] = {"reason": details["reason"], "candidates": sorted({n for n, _, _ in fits})}
        if details.get("milp_failed"):
            # stacklevel 4: warn_fallback, here, solve, solve's caller
            warn_fallback(f"checkmate: {details['reason']}; answering with the best heuristic plan that fits "
                          f"(equal_spacing / the relaxation's plans, refined on the fine graph)", stacklevel=4)
    return fits


def _choose(fits: list, milp_plan: Plan | None, es: Plan | None, details: dict) -> tuple:
    """Phase 4: the cheapest fitting plan (then the lowest peak, then the MILP's on a tie), recorded
    in details with the MILP's own plan. Returns (schedule, simulation)."""
    name, sched, sim = min(fits, key=lambda c: (c[2].extra_cost, c[2].peak_bytes, c[0] != "milp"))
    details["refined_from"] = name
    details["schedule_source"] = "milp" if name == "milp" else name
    if milp_plan is not None:
        details["milp_plan"] = {"extra_cost": milp_plan.extra_cost, "peak_bytes": milp_plan.predicted_peak_bytes}
        if es is not None and es.fits and es.extra_cost < milp_plan.extra_cost - 1e-9:
            details["warning"] = (f"equal_spacing (k={es.details.get('k')}, extra cost {es.extra_cost:g}) beats "
                                  "the MILP's own plan: the limits or the coarsening cost the MILP")
    return sched, sim


def _finish(graph, sched, sim, budget_bytes, bound, mip_gap, details, t0) -> Plan:
    """The Plan for the chosen schedule, with its bound, gap and status."""
    cost = sim.extra_cost
    if bound > cost * (1 + 1e-9) + 1e-6:
        # The plan is cheaper than the bound: it is not one the relaxation covers (it reorders
        # first computations, as revolve's can on a branching graph), so nothing is proven about
        # schedules like it. Say so rather than call it optimal.
        details["bound_scope"] = (f"the relaxation's bound {bound:g} covers schedules that first compute the nodes "
                                  "in graph order; this plan reorders them, so its optimality is not proven")
        bound = 0.0
    gap = (cost - bound) / max(cost, TINY) if cost > TINY else 0.0
    status = PlanStatus.OPTIMAL if gap <= mip_gap + 1e-12 else PlanStatus.FEASIBLE
    return plan_from_schedule(graph, sched, strategy="checkmate", budget_bytes=budget_bytes, status=status,
                              solve_time_s=time.perf_counter() - t0, gap=gap, lower_bound=bound, details=details)


def _equal_spacing(graph: TrainingGraph, budget_bytes: int, details: dict) -> Plan:
    """equal_spacing's plan, recorded in details."""
    es = equal_spacing.solve(graph, budget_bytes)
    details["equal_spacing"] = {"fits": es.fits, "extra_cost": es.extra_cost, "peak_bytes": es.predicted_peak_bytes,
                                "k": es.details.get("k")}
    return es


def _baselines(graph: TrainingGraph, budget_bytes: int) -> list[tuple[str, list[str]]]:
    """chen_greedy's and revolve's plans when they fit (cheap starting points; on graphs whose
    backward revolve reorders, its plan is one the relaxation does not cover). A baseline that
    fails is skipped."""
    out = []
    if len(graph.nodes) > BASELINES_MAX_NODES:
        return out
    from remat.solver import chen_greedy, revolve

    for name, mod in (("chen_greedy", chen_greedy), ("revolve", revolve)):
        try:
            p = mod.solve(graph, budget_bytes)
        except Exception:  # noqa: BLE001 - NotAChainError, or a baseline's own failure: not ours to raise
            continue
        if p.fits:
            out.append((name, p.schedule))
    return out


def _milp(graph, g, budget_bytes, backend, limits, deadline, warm_start, msg, details) -> Plan | None:
    """Checkmate's MILP on the coarse graph `g`: its plan on the fine graph (None when it has none;
    details say why). A proven infeasibility is recorded in details["milp_infeasible"]."""
    t0 = time.perf_counter()
    unit = memory_unit(budget_bytes, g)
    model = build_model(g, budget_bytes, unit)
    details.update({"unit_bytes": unit, "variables": {k: v for k, v in model.counts.items() if k != "constraints"},
                    "constraints": model.counts["constraints"], "build_s": round(time.perf_counter() - t0, 3)})
    best_base, _ = judge_schedules(g, baseline_schedules(graph, g), budget_bytes)
    warm = bool(warm_start and best_base is not None and set_start(model, best_base[2]))
    if best_base is not None:
        details["baseline"] = {"name": best_base[0], "extra_cost": best_base[1].extra_cost,
                               "coarse_peak_bytes": best_base[1].peak_bytes, "warm_start": warm}
    details["attempts"] = []
    t1 = time.perf_counter()
    out = solve_milp(model, backend, cut_to_deadline(limits, deadline), warm, msg, details["attempts"])
    details["milp_s"] = round(time.perf_counter() - t1, 3)
    if details["attempts"] and details["attempts"][-1]["backend"] != backend:
        details["backend"] = details["attempts"][-1]["backend"]  # the one that answered
    failed = [a for a in details["attempts"] if "error" in a]
    if out.status in ("optimal", "feasible"):
        import pulp

        details.update({"objective": pulp.value(model.prob.objective), "best_bound": out.bound,
                        "stopped_by": out.stopped_by, "milp_peak_bytes": milp_peak(model),
                        "milp_status": out.status, "milp_gap": out.gap})
        if failed:
            # stacklevel 5: warn_fallback, here, _candidates, solve, solve's caller
            warn_fallback(f"MILP backend failure ({failed[0]['error']}); answered by {details['backend']}",
                          stacklevel=5)
        plan = plan_from_stages(graph, g, solution_stages(model), strategy="checkmate", budget=budget_bytes,
                                status=out.status, t0=t0, gap=out.gap, details={})
        details["coarse_peak_bytes"] = plan.details["coarse_peak_bytes"]
        details["coarse_extra_cost"] = plan.details["coarse_extra_cost"]
        if not plan.fits:  # rounding in the model; never expected, never hidden
            details["milp_overshoot_bytes"] = plan.predicted_peak_bytes - budget_bytes
        return plan
    if out.status == "infeasible":
        details["reason"] = "proven infeasible"
        details["milp_infeasible"] = True
    elif out.stopped_by is not None:
        details["reason"] = f"no incumbent within the MILP's {out.stopped_by}"
    else:
        details["reason"] = "every backend failed: " + "; ".join(
            f"{a['backend']}: {a.get('error') or a['status']}" for a in details["attempts"])
        details["milp_failed"] = True
    if failed:
        details["milp_failed"] = True
    return None


def _nothing_fits(graph, g, budget_bytes, es, details, t0, proven, bound, *, backend, coarsen_to, limits,
                  deadline) -> Plan:
    """No candidate fits: the lowest-peak plan min_feasible_budget reports (cached per graph and
    options) answers when it fits; else an "infeasible" plan holding the lowest-peak schedule."""
    failed = details.get("milp_failed", False)
    reason = details.get("reason") or ("proven infeasible" if proven else "no plan found")
    if proven and "reason" not in details:
        reason = "proven infeasible"
    low = lowest_peak_plan(graph, backend=backend, coarsen_to=coarsen_to, limits=limits, deadline=deadline)
    details["lowest_peak"] = {"peak_bytes": low.predicted_peak_bytes, "source": low.details.get("schedule_source")}
    floor = low.details.get("peak_lower_bound")
    details["peak_lower_bound"] = floor
    if floor is not None and budget_bytes < floor:
        proven = True
        details["proof"] = f"no schedule peaks below {floor} bytes (the relaxation's bound)"
    if low.predicted_peak_bytes <= budget_bytes:
        details["fallback"] = {"reason": reason, "candidates": ["lowest_peak"]}
        details["reason"] = reason
        if failed:
            warn_fallback(f"checkmate: {reason}; answering with the best heuristic plan that fits "
                          f"(equal_spacing / lowest-peak plan, refined on the fine graph)", stacklevel=4)
        sched = drop_recomputations(graph, low.schedule, budget_bytes)
        details["schedule_source"] = "fallback"
        details["refined_from"] = "lowest_peak"
        return _finish(graph, sched, simulate(graph, sched), budget_bytes, bound, 0.0, details, t0)
    if failed:
        warn_fallback(f"checkmate: {reason}; no known plan fits {budget_bytes} bytes", stacklevel=4)
    details["reason"] = "proven infeasible" if proven or details.get("milp_infeasible") and g is graph else reason
    details["schedule_source"] = "lowest_peak"
    plan = plan_from_schedule(graph, low.schedule, strategy="checkmate", budget_bytes=budget_bytes,
                              status="infeasible", solve_time_s=time.perf_counter() - t0, details=details)
    return plan
