"""The lowest-peak bisection: a low-peak schedule, and a proven lower bound on every schedule's
peak, from the cost relaxation's LP at probe budgets (`lowest_peak_search`, for
solver/checkmate/lowest_peak.py).

The smallest-peak relaxation (recomputation free) gives the first schedule and bound; budgets
between them are probed by bisection, each with the cost relaxation's LP there (a BudgetProbe,
hot-started from the last probe's basis) and plans read off its solution (guided.py). The first
probe's LP, from nothing, costs the most (Mamba2, 888 nodes: 27-30 s of the search's 72; it is
made three quarters of the way up, where plans fit on large graphs, FIRST_PROBE_AT), and where
it finds no plan the next probe is known before it ends: on large relaxations the two are solved at
once, in two threads (`FirstProbes`), where the search has two CPUs of its own (not where it runs
beside another: `sharing_cpus`). The last fitting probe's LP is read again from nothing for a
cheaper plan (`_cold_at`), except where the first probe's LP went over that read's work limit: there
the read stops at the limit with nothing. Mamba2's smallest budget: 72 -> 54 s, the same budget
(benchmarks/results/smallest_budget.txt).
"""
from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from remat.core.simulator import simulate
from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.guided import best_guided, drops_at, fit, schedule_from_live
from remat.solver.checkmate.certified_search import RELAXATION_MAX_VARIABLES
from remat.solver.checkmate.relaxation import SAFETY, Relaxation
from remat.solver.checkmate.sparse_lp import HotLP, Solution

__all__ = ["lowest_peak_search", "BudgetProbe", "FirstProbes", "sharing_cpus", "PROBE_MAX_VARIABLES",
           "PEAK_RESOLUTION", "COLD_MAX_ITERATIONS", "PAIR_MIN_VARIABLES", "FIRST_PROBE_AT"]

# lowest_peak_search probes budgets only on relaxations up to this many variables: the first
# probe (the cost relaxation's LP at a budget, from nothing) takes 2-3 s at 36k variables
# (Qwen2-small), over two minutes at 180k (T5, 748 nodes: 130k simplex iterations at ~1 ms each)
PROBE_MAX_VARIABLES = 100_000
# lowest_peak_search stops once the best peak found (by a probe) is within this share of the
# highest budget at which no plan was found: Gemma-3 (840 nodes) went on to probe budgets 100 bytes
# apart on a 12 MB peak, 8 of its 15 probes after its best peak was within 0.1% (84 -> 50 s)
PEAK_RESOLUTION = 1e-3
# a work limit on the last probe's LP read again from nothing (`_cold_at`: a cheaper plan at the
# same peak, where there is one), in simplex iterations. At the smallest budgets of the 75 models of
# benchmarks/certificates.py it ran on 26, and gave the plan kept on three, in 10k-23k iterations
# (ALBERT, ResNet-50, DistilBERT); the three over this limit gave none and took the longest:
# Gemma-3 32k (6 s), DeepSeek-V3 40k (5 s), Mamba2 52k (24 s of its 98)
COLD_MAX_ITERATIONS = 30_000
# on relaxations of PAIR_MIN_VARIABLES or more, until the first probe's LP is solved, the bisection
# probes this share of the way up from the highest budget with no plan to the best peak, not half of
# it: that LP, from nothing, costs the most (Mamba2: 26 s wherever it is solved; the hot-started ones
# after it 0.2-16 s), and there the relaxation's bound lies far under the peaks plans reach, so the
# first probe at half way found no plan and the next went up from it (Mamba2: 15.2 MB, then 16.4 MB;
# plans from 16.6 MB). At the smallest budgets of the seven saved graphs that large
# (`min_feasible_budget`, then `checkmate.solve` there; two at a time beside the code at half way):
# Mamba2 75 -> 65 s, DeepSeek-V3 28 -> 19 s (a plan 0.11 points cheaper), Funnel 30 -> 28, Zamba2
# 15 -> 14, Pegasus-X 21 -> 23, DPT 26 -> 27 (0.02 points dearer), SwinV2 15 -> 15 (the same plan);
# every smallest budget the same. Alone, Mamba2 57.2 -> 47.0 s in all and DeepSeek-V3 26.0 -> 18.0 s
# (benchmarks/results/smallest_budget.txt). Smaller relaxations bisect from half way: their first
# LP takes seconds, and on a 20-node chain the LP three quarters up, solved from nothing, read no
# plan where the half-way one's successor did (71 B instead of 69)
FIRST_PROBE_AT = 0.75
# the first probe's LP is paired with the next (FirstProbes) on relaxations of this many variables
# or more (the smallest-peak relaxation's): at the smallest budgets of the 82 saved graphs of
# benchmarks/certificates.py and unseen_models.py the first probe took 3-30 s above it (Mamba2 30 s,
# 68k variables), at most 5 s below; below it pairing saves little and changes which optimum of a
# degenerate LP the second probe reads (GPT-BigCode, 18k: a plan 0.04% higher peaking, 61 -> 70% extra)
PAIR_MIN_VARIABLES = 60_000


# how many searches this one runs beside, itself included (`sharing_cpus`)
_SHARING: contextvars.ContextVar[int] = contextvars.ContextVar("remat_searches_sharing_cpus", default=1)


@contextmanager
def sharing_cpus(searches: int) -> Iterator[None]:
    """Within: this search runs beside others, `searches` in all, on the same CPUs (remat/solving.py
    `at_once` runs a call's searches in threads; nested, the counts multiply). The first probes are
    paired only where each search has two CPUs of its own: Mamba2's and Funnel's two loss heads,
    searched at once on 2 cores with their first probes paired, ran four LPs on two cores and took
    86 s and 38 s to find their smallest budgets, 76 s and 31 s unpaired (the same budgets)."""
    token = _SHARING.set(_SHARING.get() * max(1, searches))
    try:
        yield
    finally:
        _SHARING.reset(token)


def _cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cpus_per_search() -> int:
    """The CPUs this search may count as its own: the process's, shared with the searches beside it."""
    return _cpus() // _SHARING.get()


class BudgetProbe:
    """The cost relaxation's LP at budgets up to `top`, as lowest_peak_search probes them: one
    relaxation built once, at `top` (its structure does not depend on the budget), moved to each
    probe's budget (Relaxation.set_budget) and solved from the last probe's basis (HotLP) instead
    of built and solved from nothing each time. `rel` is the relaxation at the last budget solved."""

    def __init__(self, graph: TrainingGraph, top: int):
        self.rel = Relaxation(graph, top)
        self.lp = HotLP(self.rel.model)
        self.rows = [r for r, _, _ in self.rel.budget_rows]
        self.cols = self.rel.budget_columns

    def solve(self, budget: int) -> Solution | None:
        """The LP at `budget`; None where some row's fixed bytes alone are over it (nothing fits)."""
        self.rel.set_budget(budget)
        if self.rel.infeasible_at is not None:
            return None
        return self.lp.solve(self.rows, self.cols)


class FirstProbes:
    """The probes' LPs for lowest_peak_search. On a relaxation of PAIR_MIN_VARIABLES or more, with
    two CPUs of its own (`sharing_cpus`) and HiGHS on one thread per solve (`paired`), the first one
    (from nothing, the costliest) is solved together with the probe that follows it where it finds no plan, on a
    second BudgetProbe in another thread (HiGHS lets go of the GIL while it solves); every other
    one on the BudgetProbe that solved the last probe used, from its basis. Deterministic: both
    first LPs run to their end, whichever is read."""

    def __init__(self, graph: TrainingGraph, top: int, paired: bool):
        self.graph, self.top, self.paired = graph, top, paired
        self.probe: BudgetProbe | None = None
        self.ahead: tuple[int, Solution | None, BudgetProbe] | None = None  # the LP solved with the first
        self.first_iterations = 0  # the first LP's simplex iterations, from nothing

    def solve(self, budget: int, if_none: int) -> Solution | None:
        """The LP at `budget` (None: nothing fits it); with the first, where paired, the LP at
        `if_none` too (`ahead`), the probe after this one where it finds no plan."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == budget:
            self.probe = ahead[2]
            return ahead[1]
        if self.probe is not None:
            return self.probe.solve(budget)
        if not self.paired:
            self.probe = BudgetProbe(self.graph, self.top)
            return self._first(self.probe.solve(budget))

        def solved(b: int) -> tuple[BudgetProbe, Solution | None]:
            probe = BudgetProbe(self.graph, self.top)
            return probe, probe.solve(b)

        pool = ThreadPoolExecutor(1, thread_name_prefix="remat-probe")
        try:
            other = pool.submit(solved, if_none)
            self.probe, lp = solved(budget)
            spare, spare_lp = other.result()
        finally:
            pool.shutdown(wait=False)  # an interrupt returns at once (HiGHS cannot be stopped inside an LP)
        self.ahead = (if_none, spare_lp, spare)
        return self._first(lp)

    def _first(self, lp: Solution | None) -> Solution | None:
        self.first_iterations = lp.iterations if lp is not None else 0
        return lp


def lowest_peak_search(graph: TrainingGraph, probes: int | None = None, floor: int = 0,
                       fitted: list | None = None, paired: bool = True) -> tuple[list[str] | None, int]:
    """A low-peak schedule, and a proven lower bound on every schedule's peak (bytes); no schedule
    (None, `floor`) where the relaxation has over RELAXATION_MAX_VARIABLES variables.

    Start: the schedule read off the relaxation of the smallest peak (Relaxation with budget None:
    recomputation free), whose optimum is the first bound (or `floor`, a bound known, where that
    is higher). Then bisect between the bound and the best peak found: a probe budget is first
    tried with `fit` on that schedule's drops (until the first LP is solved the probe budget lies
    FIRST_PROBE_AT of the way up, not half), then with the cost relaxation at that budget (its
    plans, `best_guided`; one BudgetProbe for all probes, each LP hot-started from the last, the
    first paired with the next where `paired` and the relaxation is large: FirstProbes);
    when that relaxation's LP is infeasible no schedule fits the probe budget, and the bound
    rises to it; once a probe's plan fitted, the bisection stops where the best peak is within
    PEAK_RESOLUTION of that bound or of the last probe that found no plan. The last probe whose
    plan fitted is also solved from nothing (`_cold_at`, within COLD_MAX_ITERATIONS). probes: how
    many budgets are probed (None: 16, and none on relaxations over PROBE_MAX_VARIABLES). fitted:
    where given, every probe's plan that fitted is appended to it (cheaper at higher peaks)."""
    rel = Relaxation(graph, None)
    if rel.model.num_vars > RELAXATION_MAX_VARIABLES:
        # its LP alone would take minutes (BigBird-Pegasus's block-sparse attention, 939 nodes: 305k
        # variables, over 5 minutes on one core), as the certified search's would: no schedule
        # from it, the floor given stays the bound
        return None, floor
    sol = rel.model.solve()
    if sol.x is None:
        return [v.name for v in graph.nodes], floor
    bound = max(floor, int(sol.bound * rel.mem_scale * (1 - SAFETY)) - 1)
    best, best_peak, best_drops = None, None, None
    for th in (0.9, 0.5):
        drops = drops_at(rel, sol.x, th)
        sched = schedule_from_live(graph, drops)
        peak = simulate(graph, sched).peak_bytes
        if best_peak is None or peak < best_peak:
            best, best_peak, best_drops = sched, peak, drops
    if probes is None:
        probes = 0 if rel.model.num_vars > PROBE_MAX_VARIABLES else 16
    pair = paired and rel.model.num_vars >= PAIR_MIN_VARIABLES and _cpus_per_search() >= 2
    lps = FirstProbes(graph, best_peak, pair)
    first_at = FIRST_PROBE_AT if rel.model.num_vars >= PAIR_MIN_VARIABLES else 0.5
    lo, last = bound, None  # last: the last probe whose plan fitted, and its LP
    for _ in range(probes):
        # within the resolution only once a probe's plan fitted: a probe's plan prices recomputation
        # (and is read again in full, _cold_at); the first schedule, read off the smallest peak's
        # relaxation, does not (RoBERTa's lowest-peak plan, stopped before any fitted: 65.5% -> 92.0%)
        if best_peak - lo <= (1 if last is None else max(1, PEAK_RESOLUTION * best_peak)):
            break
        # until the first LP is solved (from nothing, the costliest), FIRST_PROBE_AT of the way up
        mid = lo + int((first_at if lps.probe is None else 0.5) * (best_peak - lo))
        if lps.ahead is not None and lo < lps.ahead[0] < best_peak:
            mid = lps.ahead[0]  # solved with the first probe, for where that one found no plan
        sched, lp = fit(graph, best_drops, mid, max_rounds=30), None
        if sched is None:
            lp = lps.solve(mid, (mid + best_peak) // 2)
            if lp is None or lp.status == "infeasible":
                lo = bound = mid + 1  # proven: nothing fits `mid`
                continue
            # a probe asks whether anything fits `mid`: the thresholds' plans first, the threshold
            # searches (most of a probe's time) only where none of those fits; the plan of the
            # last probe is read in full again below (_cold_at)
            found = None
            for search in (False, True) if lp.x is not None else ():
                found = best_guided(graph, lps.probe.rel, lp.x, mid, search=search)
                if found is not None:
                    break
            sched = found[0] if found else None
        if sched is None:
            lo = mid
        else:
            best, best_peak, last = sched, simulate(graph, sched).peak_bytes, (mid, lp)
            if fitted is not None:
                fitted.append(sched)
    # the cold read is not made where the first probe's LP, also from nothing, went over its work
    # limit: at the 82 saved graphs' smallest budgets each such read stopped at the limit with no
    # plan (Gemma-3, DeepSeek-V3, Mamba2: 5-6 s each), and every one that gave the plan kept ran on
    # a graph whose first probe took 10k-23k iterations (ALBERT, ResNet-50, DistilBERT)
    if last is not None and last[1] is not None and lps.first_iterations <= COLD_MAX_ITERATIONS:
        best = _cold_at(graph, best, best_peak, last[0])
    return best, bound


def _cold_at(graph: TrainingGraph, best: list[str], peak: int, budget: int) -> list[str]:
    """`best` (read off the hot-started LP at `budget`), or the plan read off the same LP solved
    from nothing, where that one is cheaper and peaks no higher: a hot start can end at another
    optimum of the same LP, whose plans differ (ResNet-50's at its smallest budget cost 1.3% more).
    `best` where that LP takes more than COLD_MAX_ITERATIONS simplex iterations."""
    rel = Relaxation(graph, budget)
    lp = rel.model.solve(max_iterations=COLD_MAX_ITERATIONS) if rel.infeasible_at is None else None
    found = best_guided(graph, rel, lp.x, budget) if lp is not None and lp.x is not None else None
    if found is None:
        return best
    sim, old = simulate(graph, found[0]), simulate(graph, best)
    return found[0] if sim.peak_bytes <= peak and sim.extra_cost < old.extra_cost else best

