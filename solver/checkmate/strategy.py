"""checkmate's `solve`: its options, and its stages run one after the other as plain calls.

    options -> candidates -> certify -> choose -> plan

1. options (`Options`, the backend resolved by `milp.resolve_backend`): a caller's error raises
   before any work;
2. candidates (candidates.py): the heuristics' plans and, where its gate lets it run, the coarse
   MILP's (milp.py), each refined on the fine graph;
3. certify (certify.py): the proven lower bound (the rows over the budget, then the certified
   search) and the plans those searches find;
4. choose (choose.py): the cheapest plan that fits, or the lowest-peak fallback;
5. plan (here): the Plan, its gap and status, and its details, built once from the stages'
   results.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from remat.core.full_collections import rare_full_collections
from remat.core.plan import Plan, PlanStatus, plan_from_schedule
from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.candidates import (LOWEST_PEAK_CANDIDATE, Candidates, equal_spacing_record, gather,
                                              heuristics, refine)
from remat.solver.checkmate.certify import Certificate
from remat.solver.checkmate.certify import certify as certify_stage
from remat.solver.checkmate.choose import Choice, choose, fallback_to_lowest_peak
from remat.solver.checkmate.lowest_peak import cached_known_fit
from remat.solver.checkmate.milp import MILP_MODES, resolve_backend
from remat.solver.checkmate.milp import Options as MilpOptions
from remat.solver.checkmate.milp_attempts import make_limits
from remat.solver.checkmate.milp_stages import DEFAULT_COARSEN_TO, coarse_graph
from remat.solver.options import check_choice, check_int

__all__ = ["Options", "solve"]

TINY = 1e-12


@dataclass(frozen=True)
class Options(MilpOptions):
    """checkmate's options (see `solve`): the MILP's (solver/checkmate/milp.py), whether and how
    the MILP and the certified search run. The ones `min_feasible_budget` takes too (the
    lowest-peak plan is `solve`'s last fallback) are `lowest_peak_kwargs()`."""

    milp: str = "auto"
    certify: bool = True
    max_iterations: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("milp", self.milp, MILP_MODES)
        check_choice("certify", self.certify, (True, False))
        check_int("max_iterations", self.max_iterations, 1, optional=True)

    def lowest_peak_kwargs(self) -> dict:
        """The options min_feasible_budget takes, as keyword arguments."""
        return {k: getattr(self, k) for k in ("backend", "max_nodes", "time_limit_s", "coarsen_to", "threads", "mip_gap")}


@rare_full_collections()  # a solve allocates by the million: full collections cost it seconds
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
    name = resolve_backend(backend, milp)
    deadline = None if time_limit_s is None else t0 + time_limit_s
    limits = make_limits(time_limit_s, max_nodes, mip_gap, threads)
    g = coarse_graph(graph, coarsen_to)

    def known_fit():  # the lowest-peak search's plans, where it ran for this graph (min_feasible_budget)
        return cached_known_fit(graph, budget_bytes, backend=backend, coarsen_to=coarsen_to, limits=limits)

    cands = gather(graph, g, budget_bytes, backend=name, limits=limits, deadline=deadline, warm_start=warm_start,
                   msg=msg, milp=milp, certify=certify, mip_gap=mip_gap, known_fit=known_fit)
    cert = Certificate()
    if certify:
        # the lowest-peak search's plan (gather's candidate where no heuristic fits) does not make the
        # certified search run: at or near the smallest feasible budget it is skipped (certify.py)
        searched_from = {k: v for k, v in cands.refined.items() if k != LOWEST_PEAK_CANDIDATE}
        cert = certify_stage(graph, budget_bytes, searched_from, mip_gap=mip_gap, max_iterations=max_iterations,
                             deadline=deadline, rows=cands.rows_first)
    es = cands.equal_spacing
    choice = choose({**cands.refined, **cert.plans}, budget_bytes, cands.milp, es)
    if choice is None and es is None:  # a large graph the certified search found nothing for: the heuristics
        es, late = heuristics(graph, budget_bytes)
        choice = choose(refine(graph, late, budget_bytes), budget_bytes, cands.milp, es)
    if choice is None:
        if es is None:
            es = heuristics(graph, budget_bytes)[0]
        choice = fallback_to_lowest_peak(graph, g, budget_bytes, cands.milp, cert.proven_infeasible, backend=backend,
                                         coarsen_to=coarsen_to, limits=limits, deadline=deadline)
    details = _details(graph, g, name, backend, limits, cands, cert, choice, es)
    return _plan(graph, choice, budget_bytes, cert.bound, mip_gap if choice.schedule_source != "fallback" else 0.0,
                 details, t0)


def _details(graph: TrainingGraph, g: TrainingGraph, backend: str, requested: str, limits, cands: Candidates,
             cert: Certificate, choice: Choice, es: Plan | None) -> dict:
    """plan.details, built once from the stages' results (keys: core/plan_details.py)."""
    details: dict = {"coarse_nodes": len(g.nodes), "fine_nodes": len(graph.nodes), "backend": backend,
                     "backend_requested": requested, "limits": asdict(limits), "coarse_peak_bytes": None}
    if es is not None:
        details["equal_spacing"] = equal_spacing_record(es)
    if cands.milp is not None:
        details.update(cands.milp.details())
    else:
        details["milp"] = cands.milp_skipped
    details["refined"] = {n: {"extra_cost": r.sim.extra_cost, "peak_bytes": r.sim.peak_bytes}
                          for n, r in cands.refined.items()}
    details.update(cert.details())
    details.setdefault("variables", details.get("relaxation", {}).get("variables"))
    details.setdefault("constraints", details.get("relaxation", {}).get("rows"))
    details.update(choice.details())
    return details


def _plan(graph: TrainingGraph, choice: Choice, budget_bytes: int, bound: float, mip_gap: float, details: dict,
          t0: float) -> Plan:
    """The Plan of the chosen schedule: with its bound, gap and status where it fits, else
    "infeasible"."""
    if not choice.fits:
        return plan_from_schedule(graph, choice.schedule, strategy="checkmate", budget_bytes=budget_bytes,
                                  status="infeasible", solve_time_s=time.perf_counter() - t0, details=details)
    cost = choice.sim.extra_cost
    if bound > cost * (1 + 1e-9) + 1e-6:
        # The plan is cheaper than the bound: it is not one the relaxation covers (it reorders
        # first computations, as revolve's can on a branching graph), so nothing is proven about
        # schedules like it. Say so rather than call it optimal.
        details["bound_scope"] = (f"the relaxation's bound {bound:g} covers schedules that first compute the nodes "
                                  "in graph order; this plan reorders them, so its optimality is not proven")
        bound = 0.0
    gap = (cost - bound) / max(cost, TINY) if cost > TINY else 0.0
    status = PlanStatus.OPTIMAL if gap <= mip_gap + 1e-12 else PlanStatus.FEASIBLE
    return plan_from_schedule(graph, choice.schedule, strategy="checkmate", budget_bytes=budget_bytes, status=status,
                              solve_time_s=time.perf_counter() - t0, gap=gap, lower_bound=bound, details=details)
