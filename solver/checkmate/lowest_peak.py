"""The lowest-peak plan checkmate knows, `min_feasible_budget` (its peak), and a proven lower
bound on any plan's peak.

Candidates, whichever peaks lowest on the fine graph: equal_spacing's lowest-peak plan, on small
coarse graphs the min-peak MILP (the budget rows become M >= U[t,k] + workspace + kept + resident,
minimise M), each with its peak then lowered by local moves (solver/checkmate/peak_relief.py), and
where those stay more than CLOSE_TO_FLOOR above the rows' floor the rows' low-peak schedule
(solver/checkmate/peak_rows.py `lowest_peak_by_rows`), relieved too, and the relaxation's
(solver/checkmate/peak_bisection.py `lowest_peak_search`, and its first probe's plan that fitted;
on graphs over RELAXATION_MAX_NODES nodes the rows' alone, not relieved where within DESCEND_GAP of
the floor); on graphs up to DESCEND_MAX_NODES
nodes the certified search then tries to go lower. Every plan found on the way that no other beats
on both peak and extra cost is kept with it: where solve's own candidates do not fit a budget, the
cheapest of those that fits answers (`cheapest_known_fit`).
plan.details["peak_lower_bound"] is the rows' floor, or the relaxation's bound where it ran and
is higher: no schedule whose first computations follow the graph's order peaks below it, so a
budget under it is infeasible as a fact. Cached per graph (equal graphs alike: TrainingGraph's
own equality, its meta aside) and options: min_feasible_budget and solve's last fallback read the
same entry, so every budget at or above the one reported is a budget solve accepts.
"""
from __future__ import annotations

import copy
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from remat.core.full_collections import rare_full_collections
from remat.core.training_graph import TrainingGraph
from remat.solver import equal_spacing
from remat.solver.checkmate.backends import Limits, default_backend
from remat.solver.checkmate.milp import milp_gate, min_peak_plan
from remat.solver.checkmate.milp_attempts import cut_to_deadline, make_limits, warn_fallback
from remat.solver.checkmate.milp_stages import DEFAULT_COARSEN_TO, coarse_graph
from remat.solver.checkmate.certified_search import RELAXATION_MAX_NODES, certified_search
from remat.solver.checkmate.peak_bisection import lowest_peak_search
from remat.solver.checkmate.peak_relief import MAX_ROUNDS, relieve_peak
from remat.solver.checkmate.peak_rows import lowest_peak_by_rows, peak_floor
from remat.core.plan import LOWEST_PEAK, Plan, PlanStatus, plan_from_schedule
from remat.solver.refine import drop_recomputations
from remat.core.simulator import simulate

__all__ = ["min_feasible_budget", "known_min_feasible_budget", "lowest_peak_plan", "cheapest_known_fit", "cached_known_fit",
           "known_plans", "KnownPlan",
           "CLOSE_TO_FLOOR", "DESCEND_MAX_NODES", "CACHED_PROBLEMS", "ROWS_RELIEF_ROUNDS", "ROWS_RELIEF_STEPS"]

# on graphs up to DESCEND_MAX_NODES nodes the lowest peak is pushed down by the certified search
# (above it, on eight models of 141-748 nodes, U-Net, the GPTs, ViT, BERT, Qwen2, T5, ResNet-50,
# two steps of it took 5-90 s and lowered no peak) ...
DESCEND_MAX_NODES = 100
DESCEND_GAP = 0.01  # ... unless it is already within 1% of the proven floor
# the relaxation's lowest-peak bisection runs only where the best candidate's peak is further than
# this above the proven floor (what it could win at most)
CLOSE_TO_FLOOR = 0.001
# the rows' low-peak schedule is relieved for at most ROWS_RELIEF_ROUNDS rounds, and at most
# ROWS_RELIEF_STEPS // its length (each round simulates peak_relief.CANDIDATES moves of the whole
# schedule): it starts 10-40% above the others' peaks, and where relieving it won (BERT,
# DistilBERT, ELECTRA, DeBERTa-v2, RoBERTa 2-5% lower; cheaper plans on T5, mT5), it did within
# 100 rounds, on schedules of 1,600-2,200 steps within 25-50; Gemma-3's (3,590 steps) took 200
# rounds, 11 s, to stay 2.6% above the others', DeepSeek-V3's (2,300) 200 rounds, 10 s, to reach
# the peak the relaxation's bisection reaches too
ROWS_RELIEF_ROUNDS = 100
ROWS_RELIEF_STEPS = 100_000


# lowest-peak plans per (graph, options), the most recent CACHED_PROBLEMS of them, keyed by the
# graph's own equality (nodes, bytes, costs, resident bytes, tangents, name; not its meta):
# min_feasible_budget and solve's last fallback read the same entry, so the budget one reports is a
# budget the other accepts, whatever the limits; and a model traced again at the same shapes (a
# budget refused, then asked again at the smallest one the refusal named) is not searched again.
# A search within a tighter gap serves a looser one (`_cached`)
_LOWEST: OrderedDict = OrderedDict()
_LOWEST_LOCK = threading.Lock()  # blocks may be planned in threads
CACHED_PROBLEMS = 8


@dataclass(frozen=True)
class KnownPlan:
    """A plan the lowest-peak search found: its fine simulated peak and extra cost, the candidate it
    came from, and its schedule."""

    peak_bytes: int
    extra_cost: float
    source: str
    schedule: tuple[str, ...]


def lowest_peak_plan(graph: TrainingGraph, *, backend: str, coarsen_to: int | None, limits: Limits,
                     deadline: float | None = None) -> Plan:
    """The lowest-peak plan known: of the min-peak MILP's (small coarse graphs), equal_spacing's
    and (when those stay more than CLOSE_TO_FLOOR above the rows' floor) the rows' and the
    relaxation's lowest-peak plans, each with its peak relieved, and the certified search's (small
    graphs, when those stay more than DESCEND_GAP above the proven floor), the one that peaks lowest
    (cached per graph, equal graphs alike, and options `limits`, whatever wall clock was left
    before `deadline` when it was computed; a copy is returned)."""
    return _copy_for(_searched(graph, backend, coarsen_to, limits, deadline)[0], graph)


def cheapest_known_fit(graph: TrainingGraph, budget_bytes: int, *, backend: str, coarsen_to: int | None,
                       limits: Limits, deadline: float | None = None) -> tuple[str, list[str]] | None:
    """Of the plans the lowest-peak search found (lowest_peak_plan's entry: its candidates before
    and after their peaks were relieved, the bisection's probes), those no other one beats on both
    peak and extra cost, the cheapest within `budget_bytes` once the recomputations that budget
    does not need are dropped: (its source, its schedule); None where none fits. The lowest-peak
    plan alone would answer a budget above its peak dearly: BERT's, 5% under the bisection's
    plan, costs 118% extra at that plan's peak, where the bisection's costs 85%."""
    known = known_plans(graph, backend=backend, coarsen_to=coarsen_to, limits=limits, deadline=deadline)
    return _cheapest_fit(graph, known, budget_bytes)


def cached_known_fit(graph: TrainingGraph, budget_bytes: int, *, backend: str, coarsen_to: int | None,
                     limits: Limits) -> tuple[str, list[str]] | None:
    """cheapest_known_fit where the lowest-peak search is cached for `graph` and these options (a
    budget at or near the smallest feasible one that search found), else None: nothing is searched."""
    with _LOWEST_LOCK:
        hit = _cached((graph, backend, coarsen_to, limits))
    return None if hit is None else _cheapest_fit(graph, hit[1], budget_bytes)


def _cached(key: tuple):
    """The cache's entry for `key` (graph, backend, coarsen_to, limits), else the one searched with
    the same options but a tighter gap (its plans serve a looser gap as well: each is a schedule as
    valid, its lowest peak as low or lower; remat/block_levels.py solves the levels above a block's
    smallest budget within a looser gap than that budget's search), else None; the most recently
    used entry. Called with _LOWEST_LOCK held."""
    if key not in _LOWEST:
        graph, backend, coarsen_to, limits = key
        asked = limits.mip_gap or 0.0
        key = next((k for k in reversed(_LOWEST)  # the most recent first
                    if k[1:3] == (backend, coarsen_to) and (k[3].mip_gap or 0.0) <= asked
                    and replace(k[3], mip_gap=limits.mip_gap) == limits and k[0] == graph), None)
        if key is None:
            return None
    _LOWEST.move_to_end(key)
    return _LOWEST[key]


def _cheapest_fit(graph: TrainingGraph, known: tuple[KnownPlan, ...],
                  budget_bytes: int) -> tuple[str, list[str]] | None:
    """Of `known`, the cheapest within `budget_bytes` once the recomputations that budget does not
    need are dropped: (its source, its schedule); None where none fits."""
    best = None
    for k in known:
        if k.peak_bytes > budget_bytes:
            continue
        sched = drop_recomputations(graph, list(k.schedule), budget_bytes)
        cost = simulate(graph, sched).extra_cost
        if best is None or cost < best[0]:
            best = (cost, k.source, sched)
    return None if best is None else best[1:]


def known_plans(graph: TrainingGraph, *, backend: str, coarsen_to: int | None, limits: Limits,
                deadline: float | None = None) -> tuple[KnownPlan, ...]:
    """The plans the lowest-peak search found that no other one beats on both peak and extra cost,
    peak ascending (so extra cost descending): the first is the lowest peak's (cached with
    lowest_peak_plan's entry)."""
    return _searched(graph, backend, coarsen_to, limits, deadline)[1]


def _searched(graph: TrainingGraph, backend: str, coarsen_to: int | None, limits: Limits,
              deadline: float | None) -> tuple[Plan, tuple[KnownPlan, ...]]:
    """The lowest-peak plan, and every plan found on the way that no other beats on both peak and
    extra cost (peak ascending), from the cache or searched and cached."""
    key = (graph, backend, coarsen_to, limits)
    with _LOWEST_LOCK:
        hit = _cached(key)
        if hit is not None:
            return hit
    t0 = time.perf_counter()
    name = default_backend() if backend == "auto" else backend
    g = coarse_graph(graph, coarsen_to)
    log: list = []
    cands: list = []  # (peak, source, Plan)
    seen: list = []  # (source, schedule): every plan found, for cheapest_known_fit
    es = replace(equal_spacing.solve(graph, LOWEST_PEAK), strategy="checkmate", status=PlanStatus.FEASIBLE)
    small = len(graph.nodes) <= RELAXATION_MAX_NODES
    floor = peak_floor(graph) if small else 0
    es_relieved = _relieved(graph, es.predicted_peak_bytes, "equal_spacing", es) if small else None
    # the min-peak MILP only where equal_spacing's plan, relieved, is over the rows' floor: at the
    # floor no schedule peaks lower (a GPT block of 62 nodes: its MILP 10.4 s of the 11 s search, for
    # a plan peaking no lower)
    if milp_gate(len(g.nodes), "auto") is None and not (es_relieved is not None and es_relieved[0] <= floor):
        milp = min_peak_plan(graph, g, name, cut_to_deadline(limits, deadline), log)
        if milp is not None:
            cands.append((milp.predicted_peak_bytes, "min_peak_milp", milp))
    cands.append((es.predicted_peak_bytes, "equal_spacing", es))
    if small:
        seen += [(_SOURCES[s], c.schedule) for _, s, c in cands]
        cands = [es_relieved if s == "equal_spacing" else _relieved(graph, p, s, c) for p, s, c in cands]
        bound = floor
        # equal_spacing's plan relieved and the rows' floor take seconds: where that plan is within
        # CLOSE_TO_FLOOR of the floor, the relaxation's bisection (minutes: on a Llama-like graph of
        # 564 nodes 150 s, to come out 0.03% above the floor) and the rows' schedule are not run
        if min(c[0] for c in cands) > bound * (1 + CLOSE_TO_FLOOR):
            # the rows' low-peak schedule, relieved (seconds): under the others' on ten of the 79
            # graphs of benchmarks/certificates.py and unseen_models.py (BERT, DistilBERT,
            # ELECTRA 5% lower, Mamba 4%, DeBERTa-v2, RoBERTa 2%). It does not spare the bisection
            # where it reaches the floor: DeepSeek-V3's plan there costs 182% extra, the
            # bisection's, at the same peak, 52%
            rows = _rows_candidate(graph)[0]
            seen.append((_SOURCES["rows"], rows[2].schedule))
            rounds = min(ROWS_RELIEF_ROUNDS, ROWS_RELIEF_STEPS // max(len(rows[2].schedule), 1))
            cands.append(_relieved(graph, *rows, max_rounds=rounds))
            probes: list = []
            # the first probes two at a time only with HiGHS on one thread per solve (solving.at_once)
            sched, bound = lowest_peak_search(graph, floor=bound, fitted=probes, paired=limits.threads == 1)
            seen += [("relaxation (a probe)", p) for p in probes]
            if sched is not None:  # (None: a relaxation too large to solve)
                guided = plan_from_schedule(graph, sched, strategy="checkmate", budget_bytes=None, status="feasible")
                seen.append((_SOURCES["relaxation"], guided.schedule))
                cands.append(_relieved(graph, guided.predicted_peak_bytes, "relaxation", guided))
            if probes and probes[0] != sched:
                # the first probe's plan that fitted, relieved too: the highest-peaking of the
                # probes' plans, it recomputes the least, and relieved it may peak lower or cost
                # less than the last. At the smallest budgets of the saved graphs of
                # benchmarks/certificates.py, found and solved there: MPNet 0.03% lower; the same
                # budgets, cheaper plans: Gemma 62.4% -> 51.1% extra, Qwen3 98.2% -> 87.1%, ALBERT
                # 69.1% -> 62.3%, Granite 74.9% -> 70.9%; 1-3 s more (benchmarks/results/smallest_budget.txt)
                first = plan_from_schedule(graph, probes[0], strategy="checkmate", budget_bytes=None, status="feasible")
                cands.append(_relieved(graph, first.predicted_peak_bytes, "first_probe", first))
    else:
        # the rows' low-peak schedule (the whole step's relaxation takes minutes and GBs here)
        rows, bound = _rows_candidate(graph)
        cands.append(rows)
        seen += [(_SOURCES[s], c.schedule) for _, s, c in cands]
        # local moves cost minutes here (Mistral-7B-like, 3,601 nodes): skipped once a candidate is
        # within DESCEND_GAP of the floor (they could win at most that)
        if min(c[0] for c in cands) > bound * (1 + DESCEND_GAP):
            cands = [_relieved(graph, *c) for c in cands]
    best = min(cands, key=lambda c: (c[0], c[2].extra_cost))
    # the certified search, one byte under the best peak at a time, only on small graphs and where
    # the best peak is not already within DESCEND_GAP of the bound (there it costs the most and
    # finds the least)
    if len(graph.nodes) <= DESCEND_MAX_NODES and best[0] > bound * (1 + DESCEND_GAP):
        def search(budget):
            # any plan under `budget` answers a step down (its cost is solve's to lower at the
            # budget reported): mip_gap 1 ends the search at its first plan, with no MILP after it to
            # price the plans (a 45-node model with a loss head: 16.8 -> 3.1 s, the same peak and plan)
            res = certified_search(graph, budget, starts=[], mip_gap=1.0)
            return res.schedule, math.isinf(res.bound)

        sched, bound = _descend(graph, best[2].schedule, bound, search)
        found = plan_from_schedule(graph, sched, strategy="checkmate", budget_bytes=None, status="feasible")
        if found.predicted_peak_bytes < best[0]:
            cands.append((found.predicted_peak_bytes, "certified", found))
    failed = [a for a in log if "error" in a]
    _, source, chosen = min(cands, key=lambda c: (c[0], c[2].extra_cost))
    source = _label(source, chosen)
    if failed:
        warn_fallback(f"min-peak MILP backend failure ({failed[0]['error']}); "
                      f"answered by {log[-1]['backend'] if 'status' in log[-1] else source}")
    details = {**chosen.details, "schedule_source": source, "lowest_peak_candidates": {s: p for p, s, _ in cands},
               "peak_lower_bound": bound,  # proven: no schedule peaks lower
               "attempts": log}
    plan = replace(chosen, details=details, budget_bytes=chosen.predicted_peak_bytes,
                   solve_time_s=time.perf_counter() - t0)  # coarsening and the comparison included
    seen += [(_label(s, c), c.schedule) for _, s, c in cands]
    entry = (plan, _undominated(graph, seen))
    with _LOWEST_LOCK:
        _LOWEST[key] = entry
        while len(_LOWEST) > CACHED_PROBLEMS:
            _LOWEST.popitem(last=False)
    return entry


_SOURCES = {"min_peak_milp": "min_peak_milp", "relaxation": "relaxation (lowest peak)", "rows": "rows (lowest peak)",
            "first_probe": "relaxation (its first probe's plan)",
            "equal_spacing": "equal_spacing (lowest peak)", "certified": "certified search"}


def _label(source: str, plan: Plan) -> str:
    """How plan.details and the kept plans name a candidate's plan."""
    return _SOURCES[source] + (", peak relieved" if "peak_relieved_from" in plan.details else "")


def _rows_candidate(graph: TrainingGraph) -> tuple[tuple[int, str, Plan], int]:
    """The rows' low-peak schedule as a candidate (peak, "rows", plan), and the rows' floor."""
    sched, bound = lowest_peak_by_rows(graph)
    rows = plan_from_schedule(graph, sched, strategy="checkmate", budget_bytes=None, status="feasible")
    return (rows.predicted_peak_bytes, "rows", rows), bound


def _undominated(graph: TrainingGraph, seen: list) -> tuple[KnownPlan, ...]:
    """The plans of `seen` ((source, schedule) pairs) that no other beats on both peak and extra
    cost, peak ascending; of equal ones, the first seen."""
    known = []
    for source, sched in seen:
        sim = simulate(graph, sched)
        known.append(KnownPlan(sim.peak_bytes, sim.extra_cost, source, tuple(sched)))
    known.sort(key=lambda k: (k.peak_bytes, k.extra_cost))  # stable: of equal ones, the first seen
    out: list[KnownPlan] = []
    for k in known:
        if not out or k.extra_cost < out[-1].extra_cost:
            out.append(k)
    return tuple(out)


def _copy_for(plan: Plan, graph: TrainingGraph) -> Plan:
    """A copy of the cached `plan` for `graph` (equal to the one it was made for; its fingerprint
    may differ where its meta records other traced bytes)."""
    return replace(plan, details=copy.deepcopy(plan.details), graph=graph, graph_fingerprint=graph.fingerprint())


def _relieved(graph: TrainingGraph, peak: int, source: str, plan: Plan,
              max_rounds: int = MAX_ROUNDS) -> tuple[int, str, Plan]:
    """The candidate with its peak lowered by local moves (solver/checkmate/peak_relief.py, at most
    `max_rounds` rounds), then its recomputations that the lower peak does not need dropped; the
    candidate itself when that lowers nothing."""
    sched = relieve_peak(graph, plan.schedule, max_rounds=max_rounds)
    low = simulate(graph, sched).peak_bytes
    if low >= peak:
        return peak, source, plan
    sched = drop_recomputations(graph, sched, low)
    better = plan_from_schedule(graph, sched, strategy="checkmate", budget_bytes=None, status=PlanStatus.FEASIBLE,
                                details={**plan.details, "peak_relieved_from": peak})
    return better.predicted_peak_bytes, source, better


@rare_full_collections()  # see core/full_collections.py
def min_feasible_budget(graph: TrainingGraph, *, backend: str = "auto",
                        max_nodes: int | None = None,
                        time_limit_s: float | None = None, coarsen_to: int | None = DEFAULT_COARSEN_TO,
                        threads: int | None = 1, mip_gap: float | None = 1e-4, return_plan: bool = False):
    """The smallest budget for which a plan was found: the FINE simulated peak of the lowest-peak
    candidate (the relaxation's low-peak schedule, equal_spacing's lowest-peak plan, and on small
    coarse graphs the MILP minimising the peak, a variable M >= U[t,k] + workspace + kept +
    resident for every t, k); plan.details says which one it is, and holds "peak_lower_bound",
    below which no plan exists. `solve` with the
    same options accepts every budget at or above this answer: this plan is its last fallback
    (cached per graph, equal graphs alike). Options as in `solve` (mip_gap does not apply: kept for symmetry)."""
    limits = make_limits(time_limit_s, max_nodes, mip_gap, threads)
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    plan = lowest_peak_plan(graph, backend=backend, coarsen_to=coarsen_to, limits=limits, deadline=deadline)
    return (plan.predicted_peak_bytes, plan) if return_plan else plan.predicted_peak_bytes


def known_min_feasible_budget(graph: TrainingGraph, *, backend: str = "auto", max_nodes: int | None = None,
                              time_limit_s: float | None = None, coarsen_to: int | None = DEFAULT_COARSEN_TO,
                              threads: int | None = 1, mip_gap: float | None = 1e-4) -> int | None:
    """min_feasible_budget where it is cached for `graph` (an equal graph) and these options, else
    None: nothing is searched."""
    key = (graph, backend, coarsen_to, make_limits(time_limit_s, max_nodes, mip_gap, threads))
    with _LOWEST_LOCK:
        hit = _LOWEST.get(key)
    return None if hit is None else hit[0].predicted_peak_bytes


def _descend(graph: TrainingGraph, best: list[str], bound: int, search, steps: int = 4) -> tuple[list[str], int]:
    """Lower the best peak with `search(budget) -> (schedule or None, proven infeasible)` (the
    certified search, as `solve` runs it but ending at its first plan), one byte under the best peak
    at a time, so that `solve` with the same options finds nothing under the lowest peak this reports
    (the first plan ends only a search that found one); the bound rises to a budget the search proves
    infeasible."""
    peak = simulate(graph, best).peak_bytes
    for _ in range(steps):
        if peak - 1 < bound:
            break
        sched, proven = search(peak - 1)
        if sched is None:
            if proven:
                bound = peak
            break
        best, peak = sched, simulate(graph, sched).peak_bytes
    return best, bound
