"""checkmate's third stage: which schedule the plan is made of.

The cheapest refined plan within the budget (then the lowest peak, then the MILP's on a tie).
Where none fits, the plans the lowest-peak search found (solver/checkmate/lowest_peak.py, cached per
graph and options) answer: the cheapest of those that fits, so `solve` never calls a budget
infeasible that min_feasible_budget reported feasible; where none fits the plan is "infeasible"
and holds the lowest-peak schedule, with whether infeasibility is proven.
"""
from __future__ import annotations

from dataclasses import dataclass

from remat.core.plan import Plan
from remat.core.simulator import SimResult, simulate
from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.backends import Limits
from remat.solver.checkmate.candidates import Refined
from remat.solver.checkmate.lowest_peak import cheapest_known_fit, lowest_peak_plan
from remat.solver.checkmate.milp import MilpOutcome
from remat.solver.checkmate.milp_attempts import warn_fallback

__all__ = ["Choice", "choose", "fallback_to_lowest_peak"]


@dataclass(frozen=True)
class Choice:
    """The third stage's result: the schedule, its simulation, where it came from, and what
    plan.details says about the choice. `fits` False: nothing fits the budget."""

    schedule: list[str]
    sim: SimResult
    fits: bool
    schedule_source: str
    refined_from: str | None = None
    reason: str | None = None  # why nothing better was found, or why nothing fits
    fallback: dict | None = None  # {"reason", "candidates"} where a fallback answered
    warning: str | None = None
    milp_plan: dict | None = None  # the MILP's own plan before refining
    lowest_peak: dict | None = None  # {"peak_bytes", "source"} where the lowest-peak plan was asked for
    peak_lower_bound: int | None = None
    proof: str | None = None
    proven_infeasible: bool = False

    def details(self) -> dict:
        """The choice's keys of plan.details (core/plan_details.py)."""
        out: dict = {}
        if self.lowest_peak is not None:
            out["lowest_peak"] = self.lowest_peak
            out["peak_lower_bound"] = self.peak_lower_bound
        for key in ("proof", "fallback", "reason", "refined_from"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["schedule_source"] = self.schedule_source
        if self.milp_plan is not None:
            out["milp_plan"] = self.milp_plan
        if self.warning is not None:
            out["warning"] = self.warning
        return out


def choose(refined: dict[str, Refined], budget_bytes: int, milp: MilpOutcome | None,
           es: Plan | None) -> Choice | None:
    """The cheapest refined plan within the budget, or None when none fits. When the MILP ran and
    gave nothing, the plan says the others answered, with a warning where a backend failed."""
    fits = [(n, r) for n, r in refined.items() if r.sim.peak_bytes <= budget_bytes]
    if not fits:
        return None
    fallback = reason = warning = milp_plan = None
    if milp is not None and milp.plan is None:  # the MILP ran and gave nothing: others answer
        reason = milp.reason
        fallback = {"reason": reason, "candidates": sorted({n for n, _ in fits})}
        if milp.failed:
            # stacklevel 4: warn_fallback, here, checkmate's solve, its caller
            warn_fallback(f"checkmate: {reason}; answering with the best heuristic plan that fits "
                          f"(equal_spacing / the relaxation's plans, refined on the fine graph)", stacklevel=4)
    name, best = min(fits, key=lambda c: (c[1].sim.extra_cost, c[1].sim.peak_bytes, c[0] != "milp"))
    if milp is not None and milp.plan is not None:
        milp_plan = {"extra_cost": milp.plan.extra_cost, "peak_bytes": milp.plan.predicted_peak_bytes}
        if es is not None and es.fits and es.extra_cost < milp.plan.extra_cost - 1e-9:
            warning = (f"equal_spacing (k={es.details.get('k')}, extra cost {es.extra_cost:g}) beats "
                       "the MILP's own plan: the limits or the coarsening cost the MILP")
    return Choice(best.schedule, best.sim, True, name, refined_from=name, reason=reason, fallback=fallback,
                  warning=warning, milp_plan=milp_plan)


def fallback_to_lowest_peak(graph: TrainingGraph, g: TrainingGraph, budget_bytes: int, milp: MilpOutcome | None,
                            proven: bool, *, backend: str, coarsen_to: int | None, limits: Limits,
                            deadline: float | None) -> Choice:
    """No candidate fits: the cheapest plan the lowest-peak search found that fits (its needless
    recomputations dropped), else the lowest-peak plan's schedule with nothing fitting. `proven`:
    the certificate proves infeasibility."""
    failed = milp is not None and milp.failed
    reason = (milp.reason if milp is not None else None) or ("proven infeasible" if proven else "no plan found")
    low = lowest_peak_plan(graph, backend=backend, coarsen_to=coarsen_to, limits=limits, deadline=deadline)
    record = {"peak_bytes": low.predicted_peak_bytes, "source": low.details.get("schedule_source")}
    floor = low.details.get("peak_lower_bound")
    proof = None
    if floor is not None and budget_bytes < floor:
        proven = True
        proof = f"no schedule peaks below {floor} bytes (the relaxation's bound)"
    if low.predicted_peak_bytes <= budget_bytes:
        if failed:
            # stacklevel 4: warn_fallback, here, checkmate's solve, its caller
            warn_fallback(f"checkmate: {reason}; answering with the best heuristic plan that fits "
                          f"(equal_spacing / lowest-peak plan, refined on the fine graph)", stacklevel=4)
        source, sched = cheapest_known_fit(graph, budget_bytes, backend=backend, coarsen_to=coarsen_to,
                                           limits=limits, deadline=deadline)
        return Choice(sched, simulate(graph, sched), True, "fallback", refined_from="lowest_peak", reason=reason,
                      fallback={"reason": reason, "candidates": ["lowest_peak"], "answered_by": source},
                      lowest_peak=record, peak_lower_bound=floor, proof=proof)
    if failed:
        warn_fallback(f"checkmate: {reason}; no known plan fits {budget_bytes} bytes", stacklevel=4)
    milp_infeasible = milp is not None and milp.infeasible
    if proven or milp_infeasible and g is graph:
        reason = "proven infeasible"
    return Choice(low.schedule, simulate(graph, low.schedule), False, "lowest_peak", reason=reason,
                  lowest_peak=record, peak_lower_bound=floor, proof=proof, proven_infeasible=proven)
