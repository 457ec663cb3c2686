"""checkmate's second stage: the proven lower bound on any plan's extra cost, and the plans its
searches find on the way.

First the rows over the budget (solver/checkmate/peak_rows.py): for each step that keeping
everything puts over the budget, a small model of what any plan must hold or recompute there. Where
their bound already proves the best candidate within `mip_gap`, or the graph is too large for the
whole step's relaxation (RELAXATION_MAX_NODES), that is the certificate; otherwise the certified
search runs (solver/checkmate/certified_search.py: the relaxation's LP, branch and bound on it,
plans read off its solutions), started from the candidates, and the larger bound of the two holds.
Where that still leaves a gap over MORE_ROWS_GAP, the rows' search goes on from its several rows'
MILP with the rows that MILP's plan misses (peak_rows.py), a row a round until the gap is within
MORE_ROWS_GAP, where that MILP is small enough; on a graph too large for the relaxation, right
after the rows (UMT5, 1,278 nodes, at half its activation memory: a plan 11.38% -> 8.97% extra,
gap 39.9% -> 23.5%, for ~2 s; Mistral-7B-like at its smallest feasible budget: 0.686% -> 0.640%).

On a relaxation over MIP_MAX_VARIABLES those rounds run before the certified search where their
first is predicted cheap (ROUNDS_FIRST_MAX_ITERATIONS), and where they prove the plan within
SKIP_SEARCH_GAP the certified search does not run; nor where the rows alone prove it within
certified_search.GOOD_GAP on such a relaxation (where its branch and bound would stop anyway), or
within HUGE_SKIP_GAP on the largest (HUGE_SKIP_MIN_VARIABLES), where the rounds also go further
(HUGE_ROUNDS_MAX_ITERATIONS) and their proof within MORE_ROWS_GAP spares it; nor,
on the largest relaxations (NEAR_FLOOR_MIN_VARIABLES), at a budget within NEAR_FLOOR of the rows'
floor on the peak, where the relaxation's LP bounds under the rows.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from remat.core.simulator import simulate
from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.candidates import Refined
from remat.solver.checkmate.certified_search import GOOD_GAP, MIP_MAX_VARIABLES, RELAXATION_MAX_NODES, certified_search
from remat.solver.checkmate.relaxation import Relaxation
from remat.solver.checkmate.peak_rows import GENERATION_GROWTH, PeakRowsResult, peak_floor, peak_rows_search

__all__ = ["Certificate", "certify", "ROWS_SOURCE", "MORE_ROWS_GAP", "ROUNDS_FIRST_MAX_ITERATIONS",
           "SKIP_SEARCH_GAP", "NEAR_FLOOR", "NEAR_FLOOR_MIN_VARIABLES", "HUGE_SKIP_GAP", "HUGE_SKIP_MIN_VARIABLES",
           "HUGE_ROUNDS_MAX_ITERATIONS"]

ROWS_SOURCE = "peak rows: the row models of the steps keep-all puts over the budget"
# where the certified search leaves a gap over this, the rows' search goes on, adding the rows its
# several rows' plan misses (peak_rows.py, GENERATION_ROUNDS; DINOv2 at half its activation memory:
# gap 6.8% -> 0%)
TINY = 1e-12
MORE_ROWS_GAP = 0.05
# The rounds run before the certified search where the first is predicted (GENERATION_GROWTH times
# the several rows' MILP's simplex iterations) within this many simplex iterations: they are the
# cheaper of the two there, and often close the gap that search leaves (Falcon-Mamba, 616 nodes,
# at half its activation memory: the search 17.6 s at its work limit with a gap of 15.7%, then the
# rounds 14.2 s to 0.01%; first, the rounds alone: 14.2 s). Where the first is predicted dearer
# the search runs first, as the rounds may not close the gap: Gemma-2's (predicted 11.9k, 15.6k
# iterations, 6.4 s) leaves it at 7.8%, the search's own is 2.7%.
ROUNDS_FIRST_MAX_ITERATIONS = 10_000
# Where the rounds that ran first prove the plan within this gap, the certified search does not
# run: it could make the plan that much cheaper at most. At half the activation memory of the
# models of benchmarks/certificates.py, where the rounds proved a plan within 2% the search never
# found a cheaper one (T5: the rounds 6.488% extra, gap 1.0%, in 7.5 s; the search 6.509%, gap
# 4.0%, in 11.7 s); over it, it did (Llama: 5.653% -> 5.550% from a gap of 3.5%, ResNet-50: 3.698%
# -> 3.565% from 4.9%). Not where the rows alone prove it (without rounds): the search found
# cheaper plans there (BART: 7.938% -> 7.905% from a gap of 1.5%).
SKIP_SEARCH_GAP = 0.02
# Within NEAR_FLOOR of the rows' floor on the peak (peak_rows.peak_floor: what every schedule holds
# at its worst step), on a relaxation of NEAR_FLOOR_MIN_VARIABLES or more, the certified search does
# not run: there every step is near the budget, the row models (integral) bound what must be
# recomputed far above the relaxation's LP (fractions of values held), and the root LP from nothing,
# the costliest one, comes in under the rows' bound with plans dearer than theirs. At the smallest
# budgets of a tenth round's decoders: Zaya (951 nodes, 88k variables, the budget at the floor) 12 s
# of its root LP, 62k simplex iterations, for a bound 5% under the rows' and plans 3-4x dearer than
# the rows'; GLM-MoE-DSA (817 nodes, 153k variables, 3.2% over the floor) 38 s to its root LP's work
# limit, no plan read there. On smaller relaxations the root is cheap and its cuts can lift the bound
# (MobileNetV2, 28k variables, at its smallest budget: a gap of 4.5% from HiGHS's root cuts)
NEAR_FLOOR = 0.05
NEAR_FLOOR_MIN_VARIABLES = 60_000
# On relaxations of HUGE_SKIP_MIN_VARIABLES or more, the rows' proof of the best candidate within
# HUGE_SKIP_GAP (not GOOD_GAP) spares the certified search: there its root LP from nothing alone
# takes 6-25 s, and at half the activation memory of the 62 saved graphs of
# benchmarks/certificates.py and a tenth round's decoders it found no cheaper plan on any
# relaxation that large (DeepSeek-V3 66k variables, Mamba2 72k, LARA-mini 97k, GLM-MoE-DSA 153k,
# mT5 178k), its bound lifting DeepSeek-V3's gap from 1.62% to 1.43% in 22.5 s (mT5's, 6.06% to
# 4.82%, is over this gap: searched still); LARA-mini 9.7 s and GLM-MoE-DSA 10.4 s for nothing
HUGE_SKIP_GAP = 0.03
HUGE_SKIP_MIN_VARIABLES = 60_000
# On those relaxations the rounds that run first go on up to this many simplex iterations, not
# peak_rows.GENERATION_MAX_ITERATIONS (the search's root LP alone takes about as many there, on
# hundreds of thousands of rows), and where they prove the plan within MORE_ROWS_GAP (their own
# goal), not SKIP_SEARCH_GAP, the search does not run: what it would add there is a bound, and the
# rounds' is as good. mT5 (842 nodes, 178k variables) at half its activation memory: a second round
# (predicted 51k simplex iterations after 17k; 15k, 6 s) proves the same plan within 4.75%, where
# the search's root LP (102k iterations, 21-25 s) proved 4.82%: 36.7 -> 12.4 s (benchmarks/results/
# certificates.txt). At a quarter, DeepSeek-V3's second round (35k, 11 s) leaves its gap at 9.2%:
# 48 -> 54 s, the same plan
HUGE_ROUNDS_MAX_ITERATIONS = 100_000


@dataclass(frozen=True)
class Certificate:
    """The second stage's result: the proven lower bound on the extra cost of any plan (math.inf:
    no schedule fits), whether the budget is proven infeasible, the plans the searches found
    ("peak_rows", "relaxation"), and their records for plan.details."""

    bound: float = 0.0
    proven_infeasible: bool = False
    plans: dict[str, Refined] = field(default_factory=dict)
    rows: dict | None = None  # the rows' record (peak_rows_search's details)
    search: dict | None = None  # the certified search's record, where it ran
    bound_source: str | None = None  # what gave the bound
    certify_skipped: str | None = None  # why the certified search did not run on a large graph

    def details(self) -> dict:
        """The certificate's keys of plan.details (core/plan_details.py)."""
        out: dict = {}
        if self.rows is not None:
            out["peak_rows"] = self.rows
        out.update(self.search or {})
        if self.bound_source is not None:
            out["bound_source"] = self.bound_source
        if self.certify_skipped is not None:
            out["certify_skipped"] = self.certify_skipped
        return out


def certify(graph: TrainingGraph, budget_bytes: int, refined: dict[str, Refined], *, mip_gap: float,
            max_iterations: int | None, deadline: float | None, rows: PeakRowsResult | None = None) -> Certificate:
    """The bound under `budget_bytes`, given the refined candidates (see the module docstring).
    rows: the rows' search already run from these candidates (candidates.py, before the MILP)."""
    def best_plan(plans: dict[str, Refined]) -> Refined | None:
        return min((r for r in plans.values() if r.sim.peak_bytes <= budget_bytes),
                   key=lambda r: r.sim.extra_cost, default=None)

    def best_cost(plans: dict[str, Refined]) -> float:
        plan = best_plan(plans)
        return math.inf if plan is None else plan.sim.extra_cost

    known = dict(refined)
    left = None if deadline is None else max(0.5, deadline - time.perf_counter())
    if rows is None:
        rows = peak_rows_search(graph, budget_bytes, incumbent=best_cost(known), mip_gap=mip_gap, time_limit_s=left)
    if math.isinf(rows.bound):
        return Certificate(rows.bound, True, rows=rows.details,
                           bound_source=f"peak rows: no schedule fits at {rows.details['infeasible_row']}")
    plans = {}
    if rows.schedule is not None:
        plans["peak_rows"] = known["peak_rows"] = Refined(rows.schedule, simulate(graph, rows.schedule))
    best = best_cost(known)

    def more_rows(bound: float, source: str | None, max_iterations: int | None = None) -> tuple[float, str | None]:
        """Where the best plan is over MORE_ROWS_GAP above `bound`, the rows' search goes on with
        the rows its several rows' plan misses, up to `max_iterations` simplex iterations (None:
        peak_rows.GENERATION_MAX_ITERATIONS): (the bound, its source) after it."""
        plan = best_plan(known)
        if plan is None or rows.together is None or plan.sim.extra_cost - bound <= MORE_ROWS_GAP * plan.sim.extra_cost:
            return bound, source
        cost = plan.sim.extra_cost
        left = None if deadline is None else max(0.5, deadline - time.perf_counter())
        more = peak_rows_search(graph, budget_bytes, incumbent=cost, mip_gap=mip_gap, time_limit_s=left,
                                more_rows_from=rows, incumbent_schedule=plan.schedule, rounds_gap=MORE_ROWS_GAP,
                                known_bound=bound, rounds_max_iterations=max_iterations)
        rows.details["more_rows"] = more.details
        if more.schedule is not None and more.extra_cost < cost:
            plans["peak_rows"] = known["peak_rows"] = Refined(more.schedule, simulate(graph, more.schedule))
        if more.bound > bound:  # never above a plan that fits (a model proving none fits would be wrong)
            bound, source = min(more.bound, cost), ROWS_SOURCE + ", with the rows their plans miss"
        return bound, source

    if math.isfinite(best) and best - rows.bound <= mip_gap * best + TINY:
        return Certificate(rows.bound, False, plans, rows.details, bound_source=ROWS_SOURCE)
    if math.isinf(best) and len(graph.nodes) <= RELAXATION_MAX_NODES:
        # No plan fits yet (at or near the smallest feasible budget, where the plan comes from the
        # lowest peak's search): the certified search is not run. It finds cheaper plans there
        # (BLOOM at its smallest feasible budget: 49.7% -> 26.0% extra, gap 0) but takes up to ~55 s
        # more (DINOv2: 0.3 -> 56.6 s, two solves at a time), where finding that budget and solving
        # there may take a minute in all.
        return Certificate(rows.bound, False, plans, rows.details, bound_source=ROWS_SOURCE,
                           certify_skipped="no candidate plan fits the budget (at or near the smallest feasible one)")
    if len(graph.nodes) > RELAXATION_MAX_NODES:
        skipped = (f"{len(graph.nodes)} nodes > {RELAXATION_MAX_NODES}: the whole step's relaxation is not built "
                   "(millions of variables and GBs at this size)")
        bound, source = more_rows(rows.bound, ROWS_SOURCE)
        return Certificate(bound, False, plans, rows.details, bound_source=source, certify_skipped=skipped)
    t0 = time.perf_counter()
    rel = Relaxation(graph, budget_bytes)
    built_s = round(time.perf_counter() - t0, 3)
    bound, source = rows.bound, ROWS_SOURCE
    # on a relaxation up to MIP_MAX_VARIABLES the search ends in HiGHS's MILP of it, which proves
    # the optimum where the rows prove their rows only (MobileNet at half its activation memory: the
    # search 3.951% extra, optimal, in 4.0 s; the rounds first 3.971%, gap 1.8%): there it runs first
    large = rel.model.num_vars > MIP_MAX_VARIABLES
    # Where the rows alone prove the best candidate within certified_search.GOOD_GAP (1%) on a relaxation
    # over MIP_MAX_VARIABLES, the certified search does not run either: its branch and bound would stop
    # there once GOOD_GAP_PATIENCE LPs had passed without a cheaper plan, and a plan its reads gave could
    # be cheaper by under GOOD_GAP. LiLT (457 nodes) at half its activation memory: the rows' gap 0.55%,
    # then the root LP and four more (73k simplex iterations, 52 s) for the same plan: 52 -> 2 s. Of the
    # 79 saved graphs of benchmarks/certificates.py and a tenth round of architectures, at half their
    # activation memory it applies to four (GPT-Neo 6.5 -> 4.4 s, StarCoder2 2.4 -> 1.0, LiLT, MobileViT
    # 11.9 -> 2.9: the same plans but MobileViT's, 2.19140% -> 2.19143% extra), at 30% to five (GPT-Neo
    # 8.3 -> 2.8 s and GPT-J 17.2 -> 5.2, the same plans; MarianMT 16.697% -> 16.703% extra, mBART
    # 16.001% -> 16.045%, Pegasus 16.338% -> 16.342%, each 7-8 -> 2 s). Not where the rows prove it within
    # more (BART's 1.5%, whose search makes the plan 0.4% cheaper: SKIP_SEARCH_GAP above)
    huge = rel.model.num_vars >= HUGE_SKIP_MIN_VARIABLES
    enough = HUGE_SKIP_GAP if huge else GOOD_GAP
    if large and math.isfinite(best) and best - rows.bound <= enough * best + TINY:
        return Certificate(rows.bound, False, plans, rows.details, bound_source=ROWS_SOURCE,
                           certify_skipped=f"the rows prove the plan within {enough:.0%} of optimal (the "
                                           f"relaxation: {rel.model.num_vars} variables)")
    first = large and _first_round_predicted(rows) <= ROUNDS_FIRST_MAX_ITERATIONS
    if first:
        bound, source = more_rows(bound, source, HUGE_ROUNDS_MAX_ITERATIONS if huge else None)
        best = best_cost(known)
        enough = MORE_ROWS_GAP if huge else SKIP_SEARCH_GAP
        if "more_rows" in rows.details and best - bound <= enough * best + TINY:
            return Certificate(bound, False, plans, rows.details, bound_source=source,
                               certify_skipped=f"the rows' rounds prove the plan within {enough:.0%} of "
                                               f"optimal (the relaxation: {rel.model.num_vars} variables)")
    if rel.model.num_vars >= NEAR_FLOOR_MIN_VARIABLES and budget_bytes <= (1 + NEAR_FLOOR) * peak_floor(graph):
        if not first:
            bound, source = more_rows(bound, source)
        return Certificate(bound, False, plans, rows.details, bound_source=source,
                           certify_skipped=f"the budget is within {NEAR_FLOOR:.0%} of the rows' floor on the peak, "
                                           f"where the relaxation's LP ({rel.model.num_vars} variables) bounds under "
                                           "the rows")
    left = None if deadline is None else max(0.5, deadline - time.perf_counter())
    # the rows' own bound, not their rounds': where the root LP is far under it the search reads the
    # root's plans and does not branch (certified_search.ROOT_UNDER_OTHER_BOUND, set on that bound);
    # the rounds' stops its branching once its reads are spent (certified_search.READS_SPENT)
    res = certified_search(graph, budget_bytes, starts=[(n, r.schedule) for n, r in known.items()],
                           mip_gap=mip_gap, max_iterations=max_iterations, time_limit_s=left,
                           other_bound=rows.bound, relaxation=rel,
                           rounds_bound=bound if first and "more_rows" in rows.details else 0.0)
    search = dict(res.details)
    search["relaxation"]["build_s"] = built_s
    if res.schedule is not None and search.get("plan_source") == "relaxation":
        plans["relaxation"] = Refined(res.schedule, simulate(graph, res.schedule))
    # the search's own words say which relaxation and how many LPs, unless the rows' bound is higher
    search_source = search.pop("bound_source", None)
    skipped = search.pop("certify_skipped", None)
    if math.isinf(res.bound):
        return Certificate(res.bound, True, plans, rows.details, search, search_source, skipped)
    if res.bound >= bound:
        bound, source = res.bound, search_source
    known.update(plans)
    if not first:
        bound, source = more_rows(bound, source)
    return Certificate(bound, False, plans, rows.details, search, source, skipped)


def _first_round_predicted(rows: PeakRowsResult) -> float:
    """The simplex iterations the rounds' first MILP is predicted to take: GENERATION_GROWTH times
    those of the several rows' MILP it extends by a row (math.inf where there is none)."""
    return math.inf if rows.together is None else GENERATION_GROWTH * rows.together[2]
