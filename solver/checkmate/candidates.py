"""checkmate's first stage: the candidate plans, each refined on the fine graph.

The heuristics' plans (equal_spacing's when it fits, chen_greedy's and revolve's when they do) on
graphs up to BASELINES_MAX_NODES nodes, and first of all the coarse MILP's plan where its gate
lets it run (solver/checkmate/milp.py). Each candidate's needless recomputations are then dropped
on the fine graph (solver/refine.py) and it is simulated there.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from remat.core.plan import Plan
from remat.core.simulator import SimResult, simulate
from remat.core.training_graph import TrainingGraph
from remat.solver import equal_spacing
from remat.solver.checkmate.backends import Limits
from remat.solver.checkmate.milp import MilpOutcome, milp_gate, run_milp
from remat.solver.checkmate.peak_rows import PeakRowsResult, peak_rows_search
from remat.solver.refine import drop_recomputations

__all__ = ["BASELINES_MAX_NODES", "LOWEST_PEAK_CANDIDATE", "COLD_MILP_MAX_NODES", "Refined", "Candidates", "gather", "heuristics", "refine", "equal_spacing_record"]

BASELINES_MAX_NODES = 1000  # larger graphs: the baselines only when the certified search finds nothing
LOWEST_PEAK_CANDIDATE = "lowest_peak"  # the lowest-peak search's plan, where no heuristic fits (`gather`)
# Where no heuristic fits (at or near the smallest feasible budget), the MILP runs without a start only
# on coarse graphs up to this size, where it proves the optimum there in a fraction of a second (the
# training chains of tests/test_checkmate.py, up to 18 nodes); on larger ones, where the lowest-peak
# search ran, its plan is the candidate instead: cold, the MILP ran to its node limit for no plan on
# a GPT block of 62 nodes (16 s) and GroupViT's 54-node vision block
COLD_MILP_MAX_NODES = 32


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
    rows_first: PeakRowsResult | None = None  # the rows' search that proved a plan before the MILP


def gather(graph: TrainingGraph, g: TrainingGraph, budget_bytes: int, *, backend: str, limits: Limits,
           deadline: float | None, warm_start: bool, msg: bool, milp: str, certify: bool,
           mip_gap: float = 0.0, known_fit: Callable[[], tuple[str, list[str]] | None] | None = None) -> Candidates:
    """The candidates under `budget_bytes`: the heuristics' (unless the graph is too large for them
    and the certified search runs) and, first, the MILP's over the coarse graph `g` where it runs
    and its plan fits. Under milp="auto" with certify, the rows over the budget are searched
    before the MILP, and where they prove a plan within `mip_gap` (a proven optimum) the MILP
    does not run (`rows_first` carries that search on to certify). `known_fit`: the lowest-peak
    search's cheapest plan that fits, where that search ran (the candidate where no heuristic fits
    on a coarse graph over COLD_MILP_MAX_NODES, instead of the MILP)."""
    es = None
    schedules: list[tuple[str, list[str]]] = []
    if len(graph.nodes) <= BASELINES_MAX_NODES or not certify:
        es, schedules = heuristics(graph, budget_bytes)
    skipped = milp_gate(len(g.nodes), milp)
    refined = refine(graph, schedules, budget_bytes)
    rows = None
    if skipped is None and milp == "auto" and certify:
        rows = _rows_first(graph, budget_bytes, refined, mip_gap, deadline)
        if rows is not None:
            skipped = ("not run: the rows over the budget prove that no plan fits" if math.isinf(rows.bound) else
                       "not run: the rows over the budget prove the best plan found within mip_gap of any it could find")
    if (skipped is None and known_fit is not None and len(g.nodes) > COLD_MILP_MAX_NODES
            and not _fits(refined, budget_bytes)):
        # at or near the smallest feasible budget no heuristic fits, and the MILP, without a start,
        # can run to its node limit for no plan at all (a GPT block of 62 nodes at its smallest
        # budget: 16 s, then the lowest-peak fallback). Where the lowest-peak search ran for this
        # graph, its cheapest plan that fits is the candidate instead (that block's solve: 18.1 ->
        # 0.2 s, the same plan); the certified search is not run for it (strategy.py), as where
        # nothing fits
        found = known_fit()
        if found is not None:
            refined = refine(graph, [(LOWEST_PEAK_CANDIDATE, found[1])], budget_bytes)
            skipped = ("not run: no heuristic fits the budget (at or near the smallest feasible one); the "
                       "lowest-peak search's cheapest plan that fits is the candidate")
    outcome = None
    if skipped is None:
        # stacklevel 5: warn_fallback, run_milp, here, checkmate's solve, its caller
        outcome = run_milp(graph, g, budget_bytes, backend=backend, limits=limits, deadline=deadline,
                           warm_start=warm_start, msg=msg, stacklevel=5)
        if outcome.plan is not None and outcome.plan.fits:
            refined = {**refine(graph, [("milp", outcome.plan.schedule)], budget_bytes), **refined}
    return Candidates(refined, es, outcome, skipped, rows)


def _fits(refined: dict[str, Refined], budget_bytes: int) -> bool:
    return any(r.sim.peak_bytes <= budget_bytes for r in refined.values())


def _rows_first(graph: TrainingGraph, budget_bytes: int, refined: dict[str, Refined], mip_gap: float,
                deadline: float | None) -> PeakRowsResult | None:
    """The rows' search (peak_rows.py) from the best refined candidate that fits, where it proves a
    plan (its own or that candidate) within `mip_gap`, or that no plan fits; else None. On a small
    graph the rows often prove the optimum in a fraction of a second where the MILP runs to its
    node limit without one: GroupViT's vision blocks (54 and 61 nodes) 6.3-7.5 s each, at each of their levels."""
    best = min((r.sim.extra_cost for r in refined.values() if r.sim.peak_bytes <= budget_bytes), default=math.inf)
    left = None if deadline is None else max(0.5, deadline - time.perf_counter())
    rows = peak_rows_search(graph, budget_bytes, incumbent=best, mip_gap=mip_gap, time_limit_s=left)
    if math.isinf(rows.bound):
        return rows  # no schedule fits: the MILP could find none either
    cost = min(best, rows.extra_cost)
    proven = math.isfinite(cost) and cost - rows.bound <= mip_gap * cost + 1e-12
    return rows if proven else None


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
