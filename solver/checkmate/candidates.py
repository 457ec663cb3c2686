"""checkmate's first stage: the candidate plans, each refined on the fine graph.

The heuristics' plans (equal_spacing's when it fits, chen_greedy's and revolve's when they do) on
graphs up to BASELINES_MAX_NODES nodes, and first of all the coarse MILP's plan where its gate
lets it run (solver/checkmate/milp.py). Each candidate's needless recomputations are then dropped
on the fine graph (solver/refine.py) and it is simulated there.
"""
from __future__ import annotations

from dataclasses import dataclass

from remat.core.plan import Plan
from remat.core.simulator import SimResult, simulate
from remat.core.training_graph import TrainingGraph
from remat.solver import equal_spacing
from remat.solver.checkmate.backends import Limits
from remat.solver.checkmate.milp import MilpOutcome, milp_gate, run_milp
from remat.solver.refine import drop_recomputations

__all__ = ["BASELINES_MAX_NODES", "Refined", "Candidates", "gather", "heuristics", "refine", "equal_spacing_record"]

BASELINES_MAX_NODES = 1000  # larger graphs: the baselines only when the certified search finds nothing


@dataclass(frozen=True)
class Refined:
    """A candidate schedule with its needless recomputations dropped, and its simulation."""

    schedule: list[str]
    sim: SimResult


@dataclass(frozen=True)
class Candidates:
    """The first stage's result: the refined candidates by name (in the order they are preferred
    on a tie), equal_spacing's plan (None where the graph was too large for the heuristics), and
    the MILP's outcome (None where it did not run: `milp_skipped` says why)."""

    refined: dict[str, Refined]
    equal_spacing: Plan | None
    milp: MilpOutcome | None
    milp_skipped: str | None


def gather(graph: TrainingGraph, g: TrainingGraph, budget_bytes: int, *, backend: str, limits: Limits,
           deadline: float | None, warm_start: bool, msg: bool, milp: str, certify: bool) -> Candidates:
    """The candidates under `budget_bytes`: the heuristics' (unless the graph is too large for them
    and the certified search runs) and, first, the MILP's over the coarse graph `g` where it runs
    and its plan fits."""
    es = None
    schedules: list[tuple[str, list[str]]] = []
    if len(graph.nodes) <= BASELINES_MAX_NODES or not certify:
        es, schedules = heuristics(graph, budget_bytes)
    skipped = milp_gate(len(g.nodes), milp)
    outcome = None
    if skipped is None:
        # stacklevel 5: warn_fallback, run_milp, here, checkmate's solve, its caller
        outcome = run_milp(graph, g, budget_bytes, backend=backend, limits=limits, deadline=deadline,
                           warm_start=warm_start, msg=msg, stacklevel=5)
        if outcome.plan is not None and outcome.plan.fits:
            schedules.insert(0, ("milp", outcome.plan.schedule))
    return Candidates(refine(graph, schedules, budget_bytes), es, outcome, skipped)


def heuristics(graph: TrainingGraph, budget_bytes: int) -> tuple[Plan, list[tuple[str, list[str]]]]:
    """equal_spacing's plan, and the heuristic candidates: its schedule when it fits, then the
    baselines'."""
    es = equal_spacing.solve(graph, budget_bytes)
    cands = [("equal_spacing", es.schedule)] if es.fits else []
    return es, cands + _baselines(graph, budget_bytes)


def refine(graph: TrainingGraph, schedules: list[tuple[str, list[str]]], budget_bytes: int) -> dict[str, Refined]:
    """Each (name, schedule) with its needless recomputations dropped on the fine graph, simulated."""
    out = {}
    for name, sched in schedules:
        r = drop_recomputations(graph, sched, budget_bytes)
        out[name] = Refined(r, simulate(graph, r))
    return out


def equal_spacing_record(es: Plan) -> dict:
    """equal_spacing's plan as plan.details records it beside checkmate's."""
    return {"fits": es.fits, "extra_cost": es.extra_cost, "peak_bytes": es.predicted_peak_bytes,
            "k": es.details.get("k")}


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
