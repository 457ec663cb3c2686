"""A lower bound and plans from the steps where keeping everything is over the budget (the rows).

Each row's model (solver/checkmate/row_models.py) bounds the extra cost of every schedule whose
first computations follow the graph's order, and the largest over the rows is a bound too.
`peak_rows_search` solves them in stages of growing cost, stopping once a plan is within the gap
asked for: the LPs of single rows (up to MAX_ROWS), the MILPs of the SINGLE_MILPS rows of largest
LP bound, then the MILP of one row per run of consecutive over-budget steps together; rounds then
add the rows a plan misses (`more_rows_from`).

A plan: a row MILP's solution read as drops (before each row, every node it computes again after
the row and every item it does not hold forgotten, each computed again where it is next read:
guided.py's schedule_from_live), made to fit at the other steps (guided.fit, pricing a drop by its
own cost and by its recomputation chain's: `_fitted`), improved by the exchange search
(solver/checkmate/exchange.py) and refined (refine.drop_recomputations).
Where one row decides the plan, as a language model's loss head does, that plan often costs the
row's bound; where a few stretches of the step bind, the rows of those stretches together do that
(LeViT, SwinV2, RegNet at half their activation memory): a proof of optimality from a model of a
few thousand variables. `peak_floor` is what every schedule holds at its worst step (a lower bound
on any peak); `lowest_peak_by_rows` searches down to it with guided.fit, for graphs too large for
the relaxation.

Why this file is long: the search's stages (single rows, their MILPs, the runs together, the
rounds) share one state, the bound and the plans found so far, and each stage's work limit
carries the measurements that set it.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

from remat.core.progress import stage
from remat.core.simulator import simulate
from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.exchange import evaluations, exchange
from remat.solver.checkmate.guided import fit, schedule_from_live
from remat.solver.checkmate.relaxation import SAFETY
from remat.solver.checkmate.sparse_lp import MipCheck
from remat.solver.checkmate.row_models import (Row, RowsModel, keep_all_steps, over_budget_rows, part_readers,
                                              point_of_schedule, rows_model)
from remat.solver.refine import drop_recomputations
from remat.solver.schedule import keep_all_schedule

__all__ = ["PeakRowsResult", "peak_rows_search", "MAX_ROWS", "SINGLE_MILPS", "MULTI_MAX_ROWS", "GENERATION_ROUNDS",
           "GENERATION_NEW_ROWS", "GENERATION_MAX_ITERATIONS", "GENERATION_GROWTH", "GENERATION_MAX_VARIABLES",
           "GENERATION_PLAN_MAX_VARIABLES", "MULTI_MAX_VARIABLES", "PLAN_SOLUTIONS", "PLAN_MAX_NODES",
           "ROWS_MAX_NODES", "ROWS_MAX_NODE_VARIABLES", "MILP_SAFETY", "PLAN_EXCHANGE_SHARE", "ALL_PLANS_MAX_NODES",
           "ROUND_HOPELESS_GAP", "HOPELESS", "AFTER_HOPELESS_MAX_NODES", "GENERATION_MAX_NODE_VARIABLES",
           "peak_floor", "lowest_peak_by_rows"]

MAX_ROWS = 24  # rows whose LP is solved, at most: those of largest excess, and others spread over the step
MILP_SAFETY = 5e-7  # relative margin taken off a MILP's dual bound (HiGHS's tolerances); the bound never exceeds the rows' own plan either
SINGLE_MILPS = 3  # rows of largest LP bound whose own MILP is solved and made a plan
# Then, where no plan is within the gap, the MILP of one row per run of consecutive over-budget
# steps together (the run's row of largest LP bound), at most this many: one plan that fits every
# binding stretch of the step. At half the activation memory of the 59 models of
# benchmarks/certificates.py (2-9 runs, 240-10.7k variables, 0.0-5.3 s) its plan meets its own bound
# on 13 of them, three of them gaps the whole step's relaxation had left (LeViT 14.1%, SwinV2 2.2%,
# RegNet 1.2%). Not
# every row: 48 rows together raised the bound 1-3% (relative) over the best single row on the
# compare.py transformers for 10 s of LP, and their MILP (16 rows) took 90 s on a 269-node GPT.
MULTI_MAX_ROWS = 12
# ... and with at most this many variables (a work limit: the runs of smallest LP bound left out
# until it fits; one run left: not solved). A bidirectional GRU over 64 steps (4,119 nodes, 2,005
# rows at half its activation memory): 12 runs made 49,016 variables and 127,926 constraints, and
# HiGHS's root LP alone had not finished after 120 s (the solve sat there for over 20 minutes).
MULTI_MAX_VARIABLES = 12_000
# Where the certified search leaves a large gap (solver/checkmate/certify.py), the rows' search goes on
# from its several rows' MILP (where none was built, one run of over-budget steps or every run but one
# left out over MULTI_MAX_VARIABLES, from the single row's MILP of largest bound: Jamba at half its
# activation memory, 1,216 nodes in one run of 686 steps, 7.007% extra with a gap of 11.2% -> 6.340%,
# optimal, 0.7 -> 1.9 s; ALBERT, RemBERT, StableLM gaps 0.8-2.5% -> 0.0%, DeBERTa-v2 1.5% -> 0.9%;
# benchmarks/results/certificates.txt): the row where that MILP's plan, as read, is furthest over the budget is
# added (GENERATION_NEW_ROWS), and the MILP solved again, up to GENERATION_ROUNDS times while the gap
# is over the caller's `rounds_gap`, where it has GENERATION_MAX_VARIABLES variables or fewer (a work
# limit: HiGHS's root alone, not its branching, takes the time). One row a round, not three: at half the
# activation memory MPNet's round (3 rows, 1.6k variables) proves the same bound as with 5 rows (2.7k)
# in 4.7 s instead of 13.4 s (gap 12.4% -> 2.7%, 19 s in all), DINOv2's the same optimum in 0.5 s
# instead of 4.9 s; Data2Vec-Vision 24.2% -> 3.2% and Mamba 8.8% -> 2.0% as with three; BEiT (plan
# only, below) 3.8% and a plan 0.1% cheaper; Funnel 10.7% -> 1.7% in one round (with three rows: 0%,
# its plan 0.2% cheaper; its second round would prove that, but 1.7% is within certify's 5%).
GENERATION_ROUNDS = 3
GENERATION_NEW_ROWS = 1
# ... and a round after the first only while the rounds so far plus the next, taken as GENERATION_GROWTH times
# the last (each took 2.1-11.6 times the one before; HiGHS cannot stop a MILP at an iteration count), stay under
# this many simplex iterations. DPT at half its activation memory: its second round (predicted 48.1k after
# 12.0k; 24.9k, 6.6 s) takes the gap from 5.87% to 0.003%; at 20k it did not run. ConvBERT's third round
# at its smallest budget, 90.3k in 20.8 s (gap 9.7% -> 7.8%), stays out.
GENERATION_MAX_ITERATIONS = 50_000
GENERATION_GROWTH = 3
GENERATION_MAX_VARIABLES = 5000
# Over GENERATION_MAX_VARIABLES and up to this, the round's MILP is solved for a plan only: solutions
# below the best plan's cost (a cutoff), stopped at the PLAN_SOLUTIONS-th of them or after
# PLAN_MAX_NODES nodes; its dual bound (HiGHS's root's) still counts. BEiT at half its activation
# memory (8.4k variables with three rows a round, 6.0k with one): a plan 7% cheaper (7.891% -> 7.323%
# extra, gap 10.9% -> 4.0%) for ~3 s more, where solving it (2,000 nodes) took 27 s more and its
# root's bound stays under the rows'.
# RegNet at its smallest feasible budget (5.9k): 1.850% -> 1.810%, gap 13.9% -> 4.2% (its root's
# bound over the rows'), ~2 s more. No other plan of benchmarks/certificates.py's 59 models changes
# at their smallest feasible budgets.
GENERATION_PLAN_MAX_VARIABLES = 12000
# A round's MILP runs at most this many branch-and-bound nodes over its variables (a third of
# ROWS_MAX_NODE_VARIABLES; the rounds' GENERATION_MAX_ITERATIONS is checked before a round only, from
# a prediction a round's branching can overrun eightfold: dots1's second round, 11.5k -> 92.9k).
# T5 at half its activation memory, 4,027 variables: 1,078 nodes in full (106k simplex iterations,
# 33 s) for a plan 8.088% extra, gap 0.8%; at 496 nodes 20 s, 8.061%, gap 1.8%
GENERATION_MAX_NODE_VARIABLES = 2_000_000
# A round's MILP is stopped once its root LP is solved where a solution of it is more than this
# share under the best plan: the round's bound (at most that solution's value) cannot then prove the
# plan within the rounds' gap, and rows that far under the plan are a loose model of the step (their
# plans cost far more than their values): the root's cuts and the branching would only prove the
# rows' own optimum, where the next round's added row lifts the bound more. dots1 (610 nodes) at its
# smallest budget: its second round, 6 rows, ran 650 nodes (92.9k simplex iterations, 38 s) for a
# bound 5.8% over the first round's and no cheaper plan; stopped at its root LP, three rounds take
# 2.4 s and end at a bound 7.2% over it (gap 28.3% -> 27.3%, the same plan). ProphetNet's 198-node
# block at its smallest budget: 5.1 -> 2.0 s, a plan 54.0% -> 45.9% extra. Rounds whose solutions
# stay within it (T5 at half its activation memory, 5.5% under) run as before
ROUND_HOPELESS_GAP = 0.2
HOPELESS = "at its root LP: a solution more than ROUND_HOPELESS_GAP under the best plan"
# After a round stopped that way, a round branches on this many nodes at most: the rows were a loose
# model of the step, and the branching near the root reads the plans (GLM-MoE-DSA at its smallest
# budget, after two rounds stopped at their roots: a third of 442 nodes, 50.9k simplex iterations, 24
# s; at 50 nodes 12.6 s, the same plan, gap 9.48% -> 9.49%). MixtralMoE's at half its activation
# memory, after one: 27 and 22 nodes, its plan 12% cheaper (gap 0)
AFTER_HOPELESS_MAX_NODES = 50
PLAN_SOLUTIONS = 1
PLAN_MAX_NODES = 20
# branch-and-bound nodes of a rows' MILP (a work limit: the plan must not depend on the machine's load),
# and at most ROWS_MAX_NODE_VARIABLES over its variables (a node's LPs grow with them): xLSTM at its
# smallest budget, 9 rows together (10,220 variables), ran 2,000 nodes (149k simplex iterations, 70 s)
# for no plan and a bound 0.7% higher; at half their activation memory and at their smallest budgets,
# the 82 graphs of benchmarks/certificates.py and unseen_models.py solve their rows' MILPs within
# 4.5M (Zamba2: 1,658 nodes of 2,687 variables, to its optimum)
ROWS_MAX_NODES = 2000
ROWS_MAX_NODE_VARIABLES = 6_000_000
# Every distinct plan made to fit (each MILP's, by each price) is improved by the exchange search
# before it is refined, each with this share of that search's usual limit (exchange.evaluations: a
# search's six plans, three MILPs by two prices, cost twice one search). The cheapest before is
# seldom the cheapest after: mT5 at half its activation memory, its three MILPs' plans by chains
# 6.195%, 6.549%, 6.634% extra, refined 5.988%, 6.184%, 6.026%; exchanged, then refined, the last
# 5.972% (gap 5.1% -> 4.8%); the full limit on each plan found no cheaper one there. Also
# MobileNetV2 2.510% -> 2.490%, MobileViT 2.153% -> 2.143%, MarianMT 8.735% -> 8.662%, Mamba2
# 5.035% -> 4.982% (half their activation memory); ~0.5 s on mT5 (842 nodes)
PLAN_EXCHANGE_SHARE = 3
# ... on graphs up to this many nodes; above it, only the cheapest plan of each price is refined, as
# each refinement takes seconds there (a bidirectional GRU over 64 steps, 4,119 nodes: 75 -> 99 s
# with every plan exchanged and refined, the same plan)
ALL_PLANS_MAX_NODES = 1000


@dataclass
class PeakRowsResult:
    """The bound (cost units; math.inf: some row proves that no schedule fits), the best plan
    read off the rows (None: none), its extra cost, and what was solved."""

    bound: float
    schedule: list[str] | None
    extra_cost: float
    details: dict = field(default_factory=dict)
    # the MILP the rounds go on from (rows' steps, drops, simplex iterations): the last several rows', or where
    # none was built, the single row's of largest bound
    together: tuple | None = None


def _chosen_rows(rows: list[Row], limit: int) -> list[Row]:
    """At most `limit` rows: half of them those of largest excess, the rest spread evenly over
    the others (any subset gives a valid bound; these are where it is likely to be largest)."""
    if len(rows) <= limit:
        return rows
    by_excess = sorted(rows, key=lambda w: -w.excess)
    top = by_excess[:limit // 2]
    rest = sorted(by_excess[limit // 2:], key=lambda w: w.step)
    stride = len(rest) / (limit - len(top))
    return sorted(top + [rest[int(j * stride)] for j in range(limit - len(top))], key=lambda w: w.step)


def _row_per_run(rows: list[Row], lp_bound: dict) -> list[Row]:
    """A row of each run of consecutive over-budget steps (its largest LP bound in `lp_bound`, step
    -> bound, else its largest excess), at most MULTI_MAX_ROWS of them (the runs of largest bound)."""
    runs: list[list[Row]] = []
    for w in rows:
        if runs and w.step == runs[-1][-1].step + 1:
            runs[-1].append(w)
        else:
            runs.append([w])
    best = [max(run, key=lambda w: (lp_bound.get(w.step, -1.0), w.excess)) for run in runs]
    best = sorted(best, key=lambda w: (-lp_bound.get(w.step, -1.0), -w.excess))[:MULTI_MAX_ROWS]
    return sorted(best, key=lambda w: w.step)


def _bound(value: float, rm: RowsModel, graph: TrainingGraph, margin: float = SAFETY) -> float:
    """A model's optimum in cost units, less a margin for the solver's tolerances (`margin`
    relative; a MILP's dual bound is only as exact as its feasibility tolerance, MILP_SAFETY)."""
    return max(0.0, value * rm.cost_scale * (1 - margin) - SAFETY * 1e-3 * graph.total_cost)


def _drops(graph: TrainingGraph, rm: RowsModel, x) -> list[set[int]]:
    """A MILP solution as drops: before each row, every node it computes again after the row and
    every item it does not hold there (each is computed again where it is next read)."""
    drops: list[set[int]] = [set() for _ in graph.nodes]
    for (j, v), col in rm.s.items():
        if x[col] > 0.5:
            drops[max(rm.rows[j].step - 1, 0)].add(v)
    for (j, p), col in rm.h.items():
        if p in rm.rows[j].items and x[col] < 0.5:
            drops[max(rm.rows[j].step - 1, 0)].add(p[0])
    return drops


def _rows_it_misses(graph: TrainingGraph, drops: list[set[int]], modelled: set[int], budget: int,
                    by_step: dict[int, Row]) -> list[Row]:
    """The rows where a MILP solution's schedule (its `drops`), as read and before it is made to
    fit, is over the budget and that its model (of the rows at steps `modelled`) does not have: for
    each step of that schedule over the budget, the over-budget keep-all row at or after the node
    last first computed; the GENERATION_NEW_ROWS of largest excess."""
    sched = schedule_from_live(graph, drops, prune=False)
    idx, seen = graph.index, set()
    steps = sorted(by_step)
    excess: dict[int, int] = {}
    last = -1
    for name, mem in zip(sched, simulate(graph, sched).timeline):
        if name not in seen:
            seen.add(name)
            last = idx[name]
        if mem > budget:
            at = bisect.bisect_left(steps, last)
            if at < len(steps) and steps[at] not in modelled:
                excess[steps[at]] = max(excess.get(steps[at], 0), mem - budget)
    return [by_step[t] for t in sorted(excess, key=lambda t: (-excess[t], t))[:GENERATION_NEW_ROWS]]


def _fitted(graph: TrainingGraph, drops: list[set[int]], budget: int) -> dict[bool, tuple[float, list[str], list]]:
    """The drops made to fit by guided.fit with each of its two prices of a drop, a value's own cost per
    byte and with the values it is computed from that are not live (`chains`): chains -> (extra cost,
    schedule, the drops that fit) for each that fits. The own cost alone misleads on recurrences: a
    bidirectional GRU's gate pre-activation (4 KB a step) is as cheap per byte as the input projection
    it reads (196 KB, 1.2M FLOPs), whose recomputation needs the 4.7M FLOP matmul before it; dropped for
    one step, it is computed again for each step's read. At half its activation memory (64 steps) the
    rows' plans cost 519-1189% extra that way, 11-81% priced by chains (143.7% -> 10.4% after
    refinement); a 2-layer LSTM without dropout 5.3% -> 2.9% (its rows' bound 2.4%)."""
    out = {}
    for chains in (False, True):
        got = fit(graph, drops, budget, chains=chains, with_drops=True)
        if got is not None:
            out[chains] = (simulate(graph, got[1]).extra_cost, got[1], got[0])
    return out


def peak_rows_search(graph: TrainingGraph, budget: int, *, incumbent: float = math.inf,
                     mip_gap: float = 0.0, time_limit_s: float | None = None,
                     more_rows_from: PeakRowsResult | None = None,
                     incumbent_schedule: list[str] | None = None, rounds_gap: float = 0.0,
                     bound_only: bool = False, known_bound: float = 0.0,
                     rounds_max_iterations: int | None = None) -> PeakRowsResult:
    """The rows' bound and plans for `graph` under `budget` (see the module docstring), in stages
    of growing cost, stopping once the best plan (or `incumbent`, a known plan's extra cost) is
    within `mip_gap` of the bound: the LPs of up to MAX_ROWS rows, the MILPs of the SINGLE_MILPS
    rows of largest LP bound, then the MILP of a row per run together. `more_rows_from`: instead,
    go on from that search's last several rows' MILP, adding the rows its plan misses
    (GENERATION_ROUNDS times at most, until the gap is within `rounds_gap` or `mip_gap`), its MILP
    started from `incumbent_schedule` (the incumbent's plan; HiGHS ignores it where it is not a
    point of the model), each of them stopped at its first solution at or under `known_bound` (a
    bound already proven, cost units: that MILP's own bound can no longer rise above it). bound_only:
    no plans are made (their fitting and refinement are most of the search's time on recurrent
    graphs), only the bound; it stops once that reaches `incumbent`, and each MILP stops at its first
    solution under `incumbent` (whether the bound reaches it is all that is asked).
    rounds_max_iterations: the rounds' simplex iterations, at most, with the next round's predicted
    (None: GENERATION_MAX_ITERATIONS)."""
    with stage(f"checkmate: rows over the budget ({len(graph.nodes)} nodes)", unit="model") as progress:
        return _search(graph, budget, incumbent, mip_gap, time_limit_s, progress, more_rows_from, incumbent_schedule,
                       rounds_gap, bound_only, known_bound, rounds_max_iterations)


def _search(graph, budget, incumbent, mip_gap, time_limit_s, progress, more_rows_from,
            incumbent_schedule, rounds_gap, bound_only=False, known_bound=0.0,
            rounds_max_iterations=None) -> PeakRowsResult:
    t0 = time.perf_counter()
    rows = over_budget_rows(graph, budget)
    details: dict = {"rows_over_budget": len(rows)}
    if not rows:
        return PeakRowsResult(0.0, keep_all_schedule(graph), 0.0, details)
    names = graph.nodes
    for w in rows:
        if w.capacity < 0:  # even dropping every item leaves the step over the budget
            details["infeasible_row"] = names[w.step].name
            return PeakRowsResult(math.inf, None, math.inf, details)
    readers = part_readers(graph)
    found = {"bound": 0.0, "schedule": None, "cost": math.inf}
    # every distinct plan made to fit: schedule -> (extra cost, drops, the prices that gave it)
    fitted: dict[tuple, tuple[float, list, set]] = {}
    solves: list = []
    details["solves"] = solves

    def left() -> float | None:
        return None if time_limit_s is None else max(0.1, time_limit_s - (time.perf_counter() - t0))

    def run(rows_: list[Row], integral: bool, rm: RowsModel | None = None,
            plan_only: bool = False, target: float | None = None,
            in_round: bool = False) -> tuple[float, list | None] | None:
        """Solve the model of rows_ (`rm`, where already built), keep its bound and plan (the MILP
        solution's drops, made to fit, not yet refined); (bound, drops or None), or None when it
        proves no fit. plan_only: the MILP searched for a plan below the best one (PLAN_SOLUTIONS).
        target: the MILP stops at its first solution at or under this (cost units).
        in_round: a round's MILP, GENERATION_MAX_NODE_VARIABLES over its variables nodes at most
        (AFTER_HOPELESS_MAX_NODES after a round stopped as hopeless), stopped once its root LP is
        solved with a solution over ROUND_HOPELESS_GAP under the best plan."""
        rm = rm or rows_model(graph, rows_, readers)
        nodes_limit = None
        if integral:
            nodes_limit = PLAN_MAX_NODES if plan_only else ROWS_MAX_NODES
            per_node = GENERATION_MAX_NODE_VARIABLES if in_round else ROWS_MAX_NODE_VARIABLES
            nodes_limit = max(1, min(nodes_limit, per_node // max(rm.model.num_vars, 1)))
            if in_round and any(s.get("stopped") == HOPELESS for s in solves):
                nodes_limit = min(nodes_limit, AFTER_HOPELESS_MAX_NODES)
        best = min(found["cost"], incumbent)
        cutoff = best / rm.cost_scale if plan_only and math.isfinite(best) else None
        start = point_of_schedule(rm, graph, incumbent_schedule) if integral and incumbent_schedule else None
        if bound_only and math.isfinite(incumbent):
            # only whether the bound reaches the incumbent is asked: a solution under it proves this
            # MILP's bound never will (the chunked head of a 2-layer LSTM over 8 steps: 3.9 -> 0.4 s);
            # a solution under either value proves the MILP's bound cannot count
            target = max(target or 0.0, incumbent)

        stopped = []
        hopeless_under = (1 - ROUND_HOPELESS_GAP) * best if in_round and math.isfinite(best) else None

        def hopeless(check: MipCheck) -> bool:
            out = math.isfinite(check.dual_bound) and check.primal_bound * rm.cost_scale < hopeless_under
            if out:
                stopped.append(check)
            return out

        sol = rm.model.solve(integral=integral, max_nodes=nodes_limit, time_limit_s=left(), mip_gap=max(mip_gap, 1e-6),
                             cutoff=cutoff, max_improving=PLAN_SOLUTIONS if plan_only else None, start=start,
                             target=target / rm.cost_scale if integral and target else None,
                             interrupt=hopeless if integral and hopeless_under is not None else None)
        entry = {"rows": len(rm.rows), "integral": integral, "status": sol.status, "variables": rm.model.num_vars,
                 "constraints": rm.model.num_rows, "iterations": sol.iterations, "nodes": sol.nodes,
                 "s": round(sol.seconds, 3)}
        if plan_only:
            entry["plan_only"] = True
        if stopped:
            entry["stopped"] = HOPELESS
        solves.append(entry)
        progress.advance(1)
        if sol.status == "infeasible" and cutoff is not None:
            return 0.0, None  # no solution below the cutoff: no plan, and no bound taken from it
        if sol.status == "infeasible":
            details["infeasible_row"] = ", ".join(names[w.step].name for w in rm.rows[:3])
            return None
        margin = MILP_SAFETY if integral else SAFETY
        bound = _bound(sol.bound, rm, graph, margin) if sol.bound is not None and math.isfinite(sol.bound) else 0.0
        entry["bound"] = bound
        found["bound"] = max(found["bound"], bound)
        drops = _drops(graph, rm, sol.x) if integral and sol.x is not None and not bound_only else None
        if drops is not None:
            for chains, (cost, sched, fit_drops) in _fitted(graph, drops, budget).items():
                entry["plan_extra_cost"] = min(cost, entry.get("plan_extra_cost", math.inf))
                if cost < found["cost"]:
                    found.update(schedule=sched, cost=cost)
                fitted.setdefault(tuple(sched), (cost, fit_drops, set()))[2].add(chains)
        total = max(graph.total_cost, 1e-12)
        facts = {"rows": f"{len(rows)} over", "bound": f"{100 * found['bound'] / total:.3f}%"}
        best = min(found["cost"], incumbent)
        if math.isfinite(best):
            facts.update(plan=f"{100 * best / total:.3f}%", gap=f"{100 * (best - found['bound']) / max(best, 1e-12):.2f}%")
        progress.note(**facts)
        if drops is not None and len(rm.rows) > 1:
            found["together"] = (tuple(w.step for w in rm.rows), drops, sol.iterations)
        return bound, drops

    def done(gap: float = mip_gap) -> bool:
        best = min(found["cost"], incumbent)  # no plan yet (inf): not done, whatever the bound
        # the bound known from before counts too: where it already meets the gap asked for, no
        # round is needed to prove it (their own bounds start from nothing)
        proven = max(found["bound"], known_bound)
        return (math.isfinite(best) and best - proven <= gap * best + 1e-12
                or time_limit_s is not None and left() <= 0.1)

    def result() -> PeakRowsResult:
        # each plan improved and refined (PLAN_EXCHANGE_SHARE, ALL_PLANS_MAX_NODES), only when the
        # bound leaves room for one to get cheaper
        if found["schedule"] is not None and found["cost"] - found["bound"] > mip_gap * found["cost"] + 1e-12:
            keys = sorted(fitted, key=lambda k: fitted[k][0])  # by cost, ties in the order found
            small = len(graph.nodes) <= ALL_PLANS_MAX_NODES
            if not small:  # the cheapest of each price (once where both prices gave it)
                cheapest: dict[bool, tuple] = {}
                for key in keys:
                    for chains in fitted[key][2]:
                        cheapest.setdefault(chains, key)
                keys = list(dict.fromkeys(cheapest[c] for c in (False, True) if c in cheapest))
            limit = max(1, evaluations(graph) // PLAN_EXCHANGE_SHARE)
            for key in keys:
                sched = list(key)
                if small:
                    _, sched = exchange(graph, fitted[key][1], budget, lambda d: schedule_from_live(graph, d),
                                        max_evaluations=limit)
                sched = drop_recomputations(graph, sched, budget)
                cost = simulate(graph, sched).extra_cost
                if cost < found["cost"]:
                    found.update(schedule=sched, cost=cost)
        # a bound over the plan found: the tolerances', or a plan outside the bound's scope (a
        # value read by the backward alone, dropped before any row, is computed first where it is
        # read: random_dag(20, 2) at 399 bytes, plan 3.0 under the rows' 5.0)
        found["bound"] = min(found["bound"], found["cost"])
        details.update(bound=found["bound"], s=round(time.perf_counter() - t0, 3))
        return PeakRowsResult(found["bound"], found["schedule"], found["cost"], details, found.get("together"))

    if more_rows_from is not None and more_rows_from.together is not None:
        by_step = {w.step: w for w in rows}
        steps, drops, _ = more_rows_from.together
        together = [by_step[t] for t in steps]
        for _ in range(GENERATION_ROUNDS):
            missed = _rows_it_misses(graph, drops, {w.step for w in together}, budget, by_step)
            if not missed or done(max(mip_gap, rounds_gap)):
                break
            if solves and found["schedule"] is not None:
                # the last round's plan, before another round: refined, it may already meet the gap
                # (T5Gemma at half its activation memory: 4.1% after refinement, where a second round
                # took 64k simplex iterations, 17 s)
                sched = drop_recomputations(graph, found["schedule"], budget)
                cost = simulate(graph, sched).extra_cost
                if cost < found["cost"]:
                    found.update(schedule=sched, cost=cost)
                if done(max(mip_gap, rounds_gap)):
                    break
            spent = sum(s["iterations"] for s in solves)
            predicted = spent + GENERATION_GROWTH * solves[-1]["iterations"] if solves else 0
            limit = GENERATION_MAX_ITERATIONS if rounds_max_iterations is None else rounds_max_iterations
            if solves and predicted >= limit:  # the first round always runs
                details["rounds_stopped"] = f"{spent} simplex iterations, {predicted} with the next round's predicted"
                break
            together = sorted(together + missed, key=lambda w: w.step)
            rm = rows_model(graph, together, readers)
            if rm.model.num_vars > GENERATION_PLAN_MAX_VARIABLES:
                details["not_solved"] = (f"{len(together)} rows: {rm.model.num_vars} variables > "
                                         f"{GENERATION_PLAN_MAX_VARIABLES}")
                break
            # its bound counts only above the one known: a solution at or under that one proves it
            # never will be, and is a plan (a bidirectional GRU over 8 steps at half its activation
            # memory: 23 -> 9 s, where the MILP's optimum, 7.273% extra, is under the best row's bound)
            out = run(together, True, rm, plan_only=rm.model.num_vars > GENERATION_MAX_VARIABLES,
                      target=max(found["bound"], known_bound), in_round=True)
            if out is None:
                return PeakRowsResult(math.inf, None, math.inf, details)
            if out[1] is None:
                break
            drops = out[1]
        return result()

    chosen = _chosen_rows(rows, MAX_ROWS)
    single = []
    for w in chosen:
        out = run([w], False)
        if out is None:
            return PeakRowsResult(math.inf, None, math.inf, details)
        single.append((out[0], w))
        if bound_only and done():  # the bound reached the incumbent: nothing more to prove
            return result()
    seed = None  # the single row's MILP of largest bound with a plan: the rounds go on from it where no
    # MILP of several rows is built below
    for _, w in sorted(single, key=lambda bw: -bw[0])[:SINGLE_MILPS]:
        out = run([w], True)
        if out is None:
            return PeakRowsResult(math.inf, None, math.inf, details)
        if out[1] is not None and (seed is None or out[0] > seed[0]):
            seed = (out[0], (w.step,), out[1], solves[-1]["iterations"])
        if done():
            return result()
    lp_bound = {w.step: b for b, w in single}
    per_run = _row_per_run(rows, lp_bound)
    rm = rows_model(graph, per_run, readers) if len(per_run) > 1 else None
    if rm is not None and rm.model.num_vars > MULTI_MAX_VARIABLES:
        over = f"{len(per_run)} runs: {rm.model.num_vars} variables > {MULTI_MAX_VARIABLES}"
        while rm is not None and rm.model.num_vars > MULTI_MAX_VARIABLES:
            per_run = sorted(per_run, key=lambda w: (lp_bound.get(w.step, -1.0), w.excess))[1:]
            per_run.sort(key=lambda w: w.step)
            rm = rows_model(graph, per_run, readers) if len(per_run) > 1 else None
        details["runs_left_out"] = f"{over}: {len(per_run) if rm is not None else 'none'} solved together"
    if rm is not None and run(per_run, True, rm) is None:
        return PeakRowsResult(math.inf, None, math.inf, details)
    if "together" not in found and seed is not None:
        found["together"] = seed[1:]
    return result()


def peak_floor(graph: TrainingGraph) -> int:
    """A proven lower bound on the peak of every schedule whose first computations follow the
    graph's order: at each step, what every such schedule holds there (the step's memory under
    keep-all less every part it could drop), the largest over the steps."""
    return max((mem - sum(live[p] for p in items) for _, mem, live, items in keep_all_steps(graph)), default=0)


def lowest_peak_by_rows(graph: TrainingGraph, probes: int = 10) -> tuple[list[str], int]:
    """A low-peak schedule without the whole step's relaxation, and the proven floor of
    `peak_floor`: the floor itself, then bisection between it and keep-all's peak (to within
    0.1%), each probe budget tried by guided.fit from nothing (the cheapest values per byte
    dropped at each step over it)."""
    floor = peak_floor(graph)
    best = keep_all_schedule(graph)
    lo, hi = floor - 1, simulate(graph, best).peak_bytes
    for probe in range(probes):
        if hi - lo <= max(1, hi // 1000):
            break
        mid = floor if probe == 0 else (lo + hi) // 2  # the floor first: often it fits
        # by its own cost per byte only: by chains too where that does not fit, the 2-layer LSTM with
        # dropout found a peak 8% lower, in 292 s instead of 145 s
        sched = fit(graph, [set() for _ in graph.nodes], mid)
        if sched is None:
            lo = mid
        else:
            best, hi = sched, simulate(graph, sched).peak_bytes
    return best, floor
