"""The certified search of the checkmate strategy: plans read off the relaxation, and a bound.

On the fine graph: build the relaxation (solver/checkmate/relaxation.py), then branch and bound on its LP
(solver/checkmate/branch_and_bound.py). Every LP solution the search visits (the root, then a few more nodes below
the incumbent) is turned into plans (solver/checkmate/guided.py: thresholds, made to fit, refined), and the
cheapest plan that fits is the incumbent, which prunes the search. The search stops when the
bound is within `mip_gap` of the incumbent, when its deterministic work limits are spent (simplex
iterations: at most WORK_FACTOR root LPs' worth and WORK_ROWS / rows; and MAX_LPS LPs), or at the
wall-clock deadline if one is given; it does not branch where no plan read off the root's solution
fits (NO_PLAN_AT_ROOT, on large relaxations), and stops once its plan reads are spent without a
cheaper plan where its bound is under one the rows' rounds proved (READS_SPENT), or with its bound
still about the root's (BOUND_FLAT). The plans given
as `starts` (the other strategies' plans, refined) are incumbents from the start. Where that
search stops short of its gap on a small relaxation (MIP_MAX_VARIABLES), HiGHS solves the
relaxation as a MILP from the incumbent's point: its dual bound and the plans read off its solution
(stopped early where its bound stays under the rows', MIP_UNDER_ROWS_CHECKS).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from remat.core.progress import stage
from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.bounds import point_of_schedule, safe_bound
from remat.solver.checkmate.branch_and_bound import STALL_RISE, certify
from remat.solver.checkmate.guided import best_guided, exchanged_plan
from remat.solver.checkmate.relaxation import Relaxation
from remat.solver.checkmate.sparse_lp import MipCheck, interrupt_with
from remat.core.simulator import simulate

__all__ = ["CertifiedResult", "certified_search", "PLAN_ATTEMPTS", "ROOT_UNDER_OTHER_BOUND", "MAX_LPS", "WORK_FACTOR", "WORK_ROWS",
           "ROOT_WORK_ROWS", "ROOT_MIN_ITERATIONS", "ROOT_EXCHANGE_GAP", "RELAXATION_MAX_NODES", "RELAXATION_MAX_VARIABLES",
           "MIP_MAX_VARIABLES", "MIP_MAX_NODES", "MIP_UNDER_ROWS_CHECKS", "ROOT_CUTS_GAP", "ROOT_CUTS_MAX_VARIABLES", "ROOT_CUTS_STALL",
           "ROOT_CUTS_MAX_S", "ROOT_CUTS_MIP_GAP", "GOOD_GAP", "GOOD_GAP_PATIENCE", "NO_PLAN_AT_ROOT",
           "READS_SPENT", "BOUND_FLAT"]

PLAN_ATTEMPTS = 6  # LP solutions (after the root's) turned into plans, at most
# Where the root LP's value is this far (relative) under a bound proved otherwise (the peak rows'),
# branching would have to raise the relaxation's bound that far before the certificate gained
# anything, and its LPs' plans seldom beat the root's there. At half the activation memory of the
# 66 models of benchmarks/certificates.py and unseen_models.py this stops 7: the same plans, 10-30 s
# sooner (BEiT 28-35 -> 14 s, Funnel 46 -> 12 s, OLMo, Phi, StarCoder2, GPT-Neo under 8 s);
# gaps: OLMo 1.4% -> 2.4%, StarCoder2 0.3% -> 0.7% (their branching did climb past the rows'), Phi
# 3.2% -> 0% (the rows a plan misses, certify.py, prove it), the others unchanged. Closer, branching
# pays: Gemma-2's root (2.9% under) is raised past the rows' with a plan 4% cheaper, BART's (2.4%)
# gives a plan 0.3% cheaper, DINOv2's (3.0%) stalls into the relaxation's MILP. Only on relaxations
# over MIP_MAX_VARIABLES: on smaller ones branching is cheap, and where it stalls HiGHS's MILP can
# close the gap (the brute-force chains of tests/test_solver_scale.py are proved optimal so).
ROOT_UNDER_OTHER_BOUND = 0.035
# Where no plan read off the root's solution fits (the thresholds' and the exchange search's) but a
# plan given as a start does, there is no branching. On relaxations over MIP_MAX_VARIABLES at the
# smallest feasible budgets of the 79 models of benchmarks/certificates.py and unseen_models.py,
# that happened on Mamba and Falcon-Mamba only, whose branching then read no plan off any of its LPs
# either (10 and 28 s at its work limit) and raised the bound by a point of a ~50% gap (through
# `remat.optimize` at those budgets: 47 -> 29 s and 97 -> 56 s); at half the activation memory
# every root read of the 79 gave a plan. On smaller relaxations branching is cheap and HiGHS's
# MILP may follow (U-Net at its smallest budget: no plan at the root, two from later LPs)
NO_PLAN_AT_ROOT = "no plan at the root"
# Where the rows' rounds ran before the search (certify.py) and proved a bound above the root LP's,
# branching gains in two ways only: its plan reads (the root's, PLAN_ATTEMPTS more, and the last
# one) and its bound, once that climbs past the rounds'. Where the reads after the root's are spent,
# none of them (the root's included) gave a plan cheaper than the starts, and the search's bound is
# still under the rounds', the branching stops (its last read is still made). At half the
# activation memory of the 85 saved graphs of benchmarks/certificates.py and unseen_models.py it
# stops two (the same plans and gaps): GraniteMoE-Hybrid 24.0 -> 11.4 s (its bound had reached
# 5.60% of the rounds' 5.78% at its work limit, 39 LPs), MPNet 14.7 -> 10.1 s. Where a read did
# give a cheaper plan, branching goes on: ResNet-50's root read (its last read then gives 3.565%
# extra, the root's 3.680%), Llama's and ELECTRA's third and fifth LPs (5.653% -> 5.550%,
# 7.992% -> 7.979%). At 30% of it, nine (872 -> 824 s in all, two at a time): the same plans and
# gaps (ResNet-50 19.5 -> 10.7 s, Gemma-3 35.6 -> 25.0 s, DistilBERT, Gemma-2, the default GPT, Granite,
# MPNet, DeepSeek-V3), BEiT's cheaper (16.768% -> 16.627% extra, its last read at another node,
# 21.6 -> 14.9 s); at 70% of it, none
READS_SPENT = "reads spent under the rounds' bound"
# ... and, with or without the rounds' bound, once the reads after the root's are spent where the
# search's bound has risen by less than STALL_RISE of the gap the root left (to the best plan): the
# STALL rule's, decided as soon as branching can give no more plans but its last read (unlike a
# stall, no HiGHS root cuts follow: on dots.llm1 its work limit came first anyway). At the smallest
# feasible budget of dots.llm1 (611 nodes) the bound rose 0.03 points of a 9.7-point gap in 15 LPs
# (the work limit): 28 -> 18 s, the same plan. Of the graphs of benchmarks/certificates.py and
# unseen_models.py that branch past their reads (28 at half their activation memory, 37 at 30%),
# it stops two, at 30%: Hiera 7.6 -> 4.1 s, MobileNetV2 8.5 -> 4.8 s, the same plans (MobileNetV2's
# gap 4.20% -> 4.33%, its bound had crept up until its stall)
BOUND_FLAT = "reads spent, the bound flat"
MAX_LPS = 150  # LPs the branch and bound solves, at most (a deterministic limit)
# The exchange search (solver/checkmate/exchange.py) improves a plan of the last reads; of the
# root's read too where its best plan is this far above the root LP's value, relative to the plan:
# BEiT's 23% (the root's plan improved: from 8.210% to 7.891% extra, the plan it ends with). On
# every root read it changed no other plan of the 12 models of benchmarks/certificates.py it ran on,
# at 0.5-1.5 s each
ROOT_EXCHANGE_GAP = 0.05
# The branch and bound stops short of `mip_gap` once the gap it proves (its own bound or the peak
# rows', whichever is higher) is within GOOD_GAP and GOOD_GAP_PATIENCE LPs have passed without a
# better plan: proving the last percent took most of the search's time and seldom changed the plan.
# Only on relaxations over MIP_MAX_VARIABLES: smaller ones are proved optimal (mip_gap), by
# branching or by HiGHS's MILP (the brute-force chains of tests/test_checkmate.py).
# At half the activation memory of the 59 graphs of benchmarks/certificates.py it stops 18 early
# (gaps 0.03-1.0%, were 0.03-0.99%): on the 23 models it touches or might, 330 -> 232 s in all
# (two solves at a time on 2 cores; MobileViT 34.9 -> 9.6 s, CvT 23.4 -> 15.2, SegFormer 20.4 ->
# 8.1, Gemma 13.5 -> 6.3), the same plans but CvT's (2.5191% -> 2.5207% extra)
GOOD_GAP = 0.01
GOOD_GAP_PATIENCE = 4


# the branch and bound's simplex iterations, at most, in root LPs' worth: on the transformers of
# benchmarks/compare.py most of what branching proves comes in the first root LP's worth (HF
# Llama, 564 nodes: gap 6.6% at the root, 1.5% at twice its iterations, 0.9% at 3.4 times; BERT:
# 3.6%, 0.4%), and each LP costs seconds there
WORK_FACTOR = 2
WORK_ROWS = 6e9  # ... and at most WORK_ROWS / rows iterations (an iteration's cost grows with the rows)
# Graphs over this size never get the whole step's relaxation (this search, and the lowest peak's):
# it grows with nodes times the steps they live (Llama-3.2-1B's 1,825 nodes: 2.1M variables and
# minutes; Mistral-7B's 3,601 at its smallest budget: over 16 GB before its first LP). The rows'
# bound and plans (solver/checkmate/peak_rows.py) answer there, with the gap they prove.
RELAXATION_MAX_NODES = 1000
# ... and a relaxation built over this many variables is not solved: its root LP alone would take
# many minutes on one core. Below it the root LP can take tens of seconds already (T5, 748 nodes:
# 180k variables, 82k simplex iterations, 22 s), and it pays there: T5's plan 6.49% extra where
# the rows' is 10.40%
RELAXATION_MAX_VARIABLES = 250_000
ROOT_WORK_ROWS = 3e10  # the root LP's simplex iterations, at most ROOT_WORK_ROWS / rows ...
ROOT_MIN_ITERATIONS = 100_000  # ... and never fewer than this (a root LP stopped so gives no bound)


# Where the branch and bound on class sums stops short of its gap (it stalls on CNNs: the
# fraction moves to another value of another class at the same LP cost), HiGHS's own MIP solves the
# relaxation with integral L and R, cuts and all, on relaxations up to this many variables: the
# compare.py ResNet (5.7k variables) is proved optimal in 7 nodes, MobileNet (7.1k) in 1 with a
# plan 14% cheaper than the LP solutions gave; ResNet-50's (24.7k) did not close in 300 nodes.
# Only after a stall: where the branch and bound stops at its work limit it was still raising the
# bound, and HiGHS's root cuts on such relaxations cost more than the whole search (a 140-node
# GPT with the chunked loss head: 36 s in the root node, gap 4.9% either way)
MIP_MAX_VARIABLES = 12_000
MIP_MAX_NODES = 200  # ... under a deterministic node limit
# ... and stopped where its dual bound is still at or under the rows' bound after this many of
# HiGHS's interrupt checks (deterministic on one thread; the first come every ~0.05-0.1 s here):
# there its root cuts did not lift it past a bound already proven, and what it could add would
# come from branching, 200 nodes at most. On the compare.py ResNet and MobileNet at each peer's
# budget its bound passed the rows' within 2-11 checks; on FSMT's decoder block at its smallest
# budget (109 nodes, 4.4k variables) it stayed at the relaxation's LP bound, 3% under the rows',
# for all of its 642 checks (14 s, its root node 13 s; the 20th at 1.8 s), its plans no cheaper
# than the rows' (FSMT at 0.8 of its eager peak, block by block: 20.8 -> 8.6 s, the same plans).
# Every plan and gap of benchmarks/compare.py's four models at the peers' budgets (47 solves) is
# the same with and without the stop
MIP_UNDER_ROWS_CHECKS = 20
# Above that size, where the stalled search leaves a gap over ROOT_CUTS_GAP, HiGHS's root node
# alone (its presolve, reduced-cost fixing and cuts, with the plan's cost as cutoff and no
# heuristics: only its bound is read) on relaxations up to ROOT_CUTS_MAX_VARIABLES: RegNet's (53k
# variables) from 1.119% to 1.1695% extra (the plan's 1.183%: gap 5.5% -> 1.2%) in ~8 s; the
# stalled search had spent ~20 LPs without a rise. It stops once the gap is within ROOT_CUTS_GAP,
# or when its bound has not risen (by STALL_RISE of the gap left) in ROOT_CUTS_STALL of its
# progress reports in a row (points of its single-threaded run, the same on every machine;
# RegNet's rose at its 3rd, to 1.1230%, just short, and 6th), or at
# ROOT_CUTS_MAX_S of wall clock, a safety net no model of benchmarks/certificates.py reaches
# (the bound, never the plan, would then depend on the machine's load)
ROOT_CUTS_GAP = 0.05
ROOT_CUTS_MAX_VARIABLES = 100_000
ROOT_CUTS_STALL = 3
ROOT_CUTS_MAX_S = 20.0
ROOT_CUTS_MIP_GAP = 1e-6  # HiGHS's relative gap there


@dataclass
class CertifiedResult:
    """The best plan found (None: none fits), its extra cost, and the proven lower bound (math.inf:
    the relaxation proves that no schedule fits)."""

    schedule: list[str] | None
    extra_cost: float
    bound: float
    details: dict = field(default_factory=dict)


def certified_search(graph: TrainingGraph, budget: int, *, starts: list[tuple[str, list[str]]] = (),
                     mip_gap: float = 1e-4, max_iterations: int | None = None,
                     time_limit_s: float | None = None, relaxation: Relaxation | None = None,
                     other_bound: float = 0.0, rounds_bound: float = 0.0) -> CertifiedResult:
    """Plans and a lower bound for `graph` under `budget` (see the module docstring). starts:
    (name, schedule) plans to begin with (those over the budget are ignored). other_bound: a bound
    proved otherwise (cost units, the peak rows'): where the root LP is far under it
    (ROOT_UNDER_OTHER_BOUND), the root's plans are read and there is no branching. rounds_bound: the
    bound the rows' rounds proved before this search (cost units; 0: none ran): under it, branching
    stops once its reads are spent without a cheaper plan (READS_SPENT). relaxation: the
    relaxation of `graph` under `budget` where the caller built it (else it is built here)."""
    with stage(f"checkmate: certified search ({len(graph.nodes)} nodes)", unit="LP") as progress:
        return _search(graph, budget, starts, mip_gap, max_iterations, time_limit_s, relaxation, progress, other_bound,
                       rounds_bound)


def _search(graph, budget, starts, mip_gap, max_iterations, time_limit_s, relaxation, progress,
            other_bound=0.0, rounds_bound=0.0) -> CertifiedResult:
    t0 = time.perf_counter()
    rel = relaxation if relaxation is not None else Relaxation(graph, budget)
    built_s = None if relaxation is not None else round(time.perf_counter() - t0, 3)  # the caller's to say
    progress.note(vars=rel.model.num_vars, rows=rel.model.num_rows)
    details = {"relaxation": {"variables": rel.model.num_vars, "rows": rel.model.num_rows, "dense": rel.dense,
                              "groups": len(rel.groups), "build_s": built_s}}
    best: list = [None, math.inf, None]  # schedule, extra cost, source
    for name, sched in starts:
        sim = simulate(graph, sched)
        if sim.peak_bytes <= budget and sim.extra_cost < best[1]:
            best[:] = [sched, sim.extra_cost, name]
    if rel.infeasible_at is not None:
        details["infeasible_row"] = graph.nodes[rel.infeasible_at].name
        return CertifiedResult(None, math.inf, math.inf, details)
    if rel.model.num_vars > RELAXATION_MAX_VARIABLES:
        details["certify_skipped"] = (f"the relaxation has {rel.model.num_vars} variables > {RELAXATION_MAX_VARIABLES}: "
                                      "its root LP alone would take many minutes")
        details["bound_source"] = "none: the whole step's relaxation was too large to solve"
        return CertifiedResult(best[0], best[1], 0.0, details)
    cs = rel.cost_scale
    attempts = {"n": 0}
    plans_log: list = []
    searched: list = []  # the solutions read with the threshold search: reading one again gives the same plans
    improved: list = []  # ... and those whose plan the exchange search improved

    def seen(xs: list, x) -> bool:
        return any(np.array_equal(x, y) for y in xs)

    def on_solution(x, value, force: bool = False) -> float:
        if attempts["n"] > PLAN_ATTEMPTS and not force:
            return best[1] / cs
        root = attempts["n"] == 0
        search = root or force
        if search and seen(searched, x):  # the root's solution again, where the branch and bound
            # stopped at the root (T5): its plans are known, but for the exchanged one
            if force and not seen(improved, x):
                improve(x, value)
            return best[1] / cs
        attempts["n"] += 1
        if search:
            searched.append(np.array(x, copy=True))
        # the last reads (force) also improve a plan by the exchange search: the plan the search
        # ends with (on ResNet-50 the root's, improved, costs 3.68% extra; the last one's 3.565%)
        if force:
            improved.append(np.array(x, copy=True))
        found = best_guided(graph, rel, x, budget, search=search, improve=force)
        if found is not None:
            offer(found[0], {"lp_value": value * cs, "thresholds": found[1]})
        if root and not force and best[1] - value * cs > ROOT_EXCHANGE_GAP * best[1]:
            improve(x, value)
        return best[1] / cs

    def improve(x, value) -> None:
        improved.append(np.array(x, copy=True))
        offer(exchanged_plan(graph, rel, x, budget), {"lp_value": value * cs, "exchanged": True})

    def offer(sched, record) -> None:
        if sched is None:
            return
        plans_log.append(record)
        cost = simulate(graph, sched).extra_cost
        if cost < best[1]:
            best[:] = [sched, cost, "relaxation"]

    left = None if time_limit_s is None else max(0.1, time_limit_s - (time.perf_counter() - t0))
    if max_iterations is None:
        max_iterations = int(max(20_000, WORK_ROWS / max(rel.model.num_rows, 1)))
    total = max(graph.total_cost, 1e-12)

    def on_lp(lps, bound, incumbent, work) -> None:
        progress.advance(lps - progress_lps[0])
        progress_lps[0] = lps
        facts = {"bound": f"{100 * bound * cs / total:.3f}%"}
        if work is not None:  # the search stops by the time this reaches 100% (or sooner: gap, stall)
            facts["work"] = f"{100 * min(work, 1):.0f}% of its limit"
        if math.isfinite(incumbent):
            facts.update(incumbent=f"{100 * incumbent * cs / total:.3f}%",
                         gap=f"{100 * (incumbent - bound) / max(incumbent, 1e-12):.2f}%")
        progress.note(**facts)

    progress_lps = [0]
    root_iterations = int(max(ROOT_MIN_ITERATIONS, ROOT_WORK_ROWS / max(rel.model.num_rows, 1)))

    def on_simplex(iterations: int) -> None:  # within one LP: its simplex iterations so far
        if progress_lps[0] == 0:
            progress.note(root_lp_iterations=f"{iterations}/{root_iterations} max")
        else:
            progress.note(lp_iterations=iterations)

    large = rel.model.num_vars > MIP_MAX_VARIABLES
    floor = other_bound * (1 - ROOT_UNDER_OTHER_BOUND) / cs if other_bound > 0 and large else None

    def root_stop(root: float) -> str | None:  # no branching where (ROOT_UNDER_OTHER_BOUND, NO_PLAN_AT_ROOT)
        if floor is not None and root < floor:
            return "under the floor"
        # (without a plan to start from, branching is the only way to one: the lowest peak's descent)
        return NO_PLAN_AT_ROOT if large and not plans_log and math.isfinite(best[1]) else None

    def reads_spent(bound: float, root: float) -> str | None:  # READS_SPENT, BOUND_FLAT
        if not large or attempts["n"] <= PLAN_ATTEMPTS:
            return None
        if bound * cs < rounds_bound and best[2] != "relaxation":  # (no read gave a plan cheaper than the starts)
            return READS_SPENT
        if math.isfinite(best[1]) and bound - root <= STALL_RISE * (best[1] / cs - root):
            return BOUND_FLAT
        return None

    cert = certify(rel, incumbent=best[1] / cs, target_gap=mip_gap, max_iterations=max_iterations,
                   stop_check=reads_spent,
                   work_factor=WORK_FACTOR, max_lps=MAX_LPS, time_limit_s=left, on_solution=on_solution,
                   on_lp=on_lp, root_iterations=root_iterations, on_simplex=on_simplex, root_stop=root_stop,
                   known_bound=other_bound / cs if other_bound > 0 else -math.inf,
                   good_gap=GOOD_GAP if large else 0.0, patience=GOOD_GAP_PATIENCE)
    if cert.infeasible:
        details["infeasible_row"] = None
        return CertifiedResult(None, math.inf, math.inf, details)
    if cert.x is not None and cert.bound * cs < best[1]:  # the best open node's solution, always
        on_solution(cert.x, cert.bound, force=True)
    bound = safe_bound(rel, cert.bound)
    details["certify"] = {"root_bound": safe_bound(rel, cert.root), "bound": bound, "lps": cert.lps,
                          "iterations": cert.iterations, "stopped_by": cert.stopped_by,
                          "s": round(cert.seconds, 3)}
    if cert.stopped_by == "root LP limit":
        details["bound_source"] = (f"none: the root LP of the relaxation stopped at its limit ({cert.iterations} "
                                   "simplex iterations) before its optimum, so no bound is proven")
    else:
        details["bound_source"] = (f"LP relaxation of the fine graph ({len(rel.groups)} groups, sitting states "
                                   f"between their active rows), branch and bound on class sums ({cert.lps} LPs)")
    if (cert.stopped_by == "stalled" and rel.model.num_vars <= MIP_MAX_VARIABLES
            and best[1] - bound > mip_gap * best[1]):
        left = None if time_limit_s is None else time_limit_s - (time.perf_counter() - t0)
        if left is None or left > 0:
            bound = max(bound, _mip(graph, rel, best[0], mip_gap, left, on_solution, details, other_bound))
    elif (cert.stopped_by == "stalled" and rel.model.num_vars <= ROOT_CUTS_MAX_VARIABLES
          and best[1] - bound > ROOT_CUTS_GAP * best[1]):
        left = ROOT_CUTS_MAX_S
        if time_limit_s is not None:
            left = min(left, time_limit_s - (time.perf_counter() - t0))
        if left > 0:
            bound = max(bound, _root_cuts(rel, best[1], left, details, progress))
    details["guided_plans"] = plans_log
    details["plan_source"] = best[2]
    details["certified_s"] = round(time.perf_counter() - t0, 3)
    return CertifiedResult(best[0], best[1], min(bound, best[1]), details)


def _mip(graph, rel, incumbent, mip_gap, time_limit_s, on_solution, details, other_bound: float = 0.0) -> float:
    """The relaxation solved as a MILP by HiGHS (L and R integral: every schedule in scope is one of
    its points, so its dual bound is a lower bound too), started from the incumbent plan's point;
    its solution read into plans; stopped where its bound is still under `other_bound` (the rows',
    cost units) after MIP_UNDER_ROWS_CHECKS of its interrupt checks. Returns its bound in cost
    units (0: none)."""
    start = None
    if incumbent is not None:
        try:
            start = point_of_schedule(rel, incumbent)
        except ValueError:  # the plan reorders first computations: not a point of the relaxation
            pass
    under = [False]

    def under_rows(check: MipCheck) -> bool:
        under[0] = check.checks >= MIP_UNDER_ROWS_CHECKS and not check.dual_bound > other_bound / rel.cost_scale
        return under[0]

    sol = rel.model.solve(integral=True, max_nodes=MIP_MAX_NODES, time_limit_s=time_limit_s, mip_gap=mip_gap,
                          start=start, interrupt=under_rows if other_bound > 0 else None)
    if sol.x is not None:
        on_solution(sol.x, sol.objective, force=True)
    bound = safe_bound(rel, sol.bound) if sol.bound is not None and math.isfinite(sol.bound) else 0.0
    details["relaxation_milp"] = {"status": sol.status, "nodes": sol.nodes, "bound": bound, "s": round(sol.seconds, 3)}
    if under[0]:
        details["relaxation_milp"]["stopped_by"] = "under the rows' bound"
    if bound > details["certify"]["bound"]:
        details["bound_source"] = (f"MILP of the fine graph's relaxation ({len(rel.groups)} groups, HiGHS, "
                                   f"{sol.nodes} nodes)")
    return bound


def _root_cuts(rel, incumbent: float, time_limit_s: float, details, progress) -> float:
    """HiGHS's root node on the relaxation as a MILP (see ROOT_CUTS_GAP): its dual bound in cost
    units, 0 where it gives none. `incumbent`: the best plan's extra cost (the cutoff); it stops
    once its bound is within ROOT_CUTS_GAP of it (what it runs for), or flat (ROOT_CUTS_STALL)."""
    import highspy

    cs = rel.cost_scale
    t0 = time.perf_counter()
    # nothing above the plan is of interest
    h = rel.model.highs(integral=True, time_limit_s=time_limit_s, mip_gap=ROOT_CUTS_MIP_GAP, cutoff=incumbent / cs)
    h.setOptionValue("mip_heuristic_effort", 0.0)  # only the bound is read
    seen = {"bound": -math.inf, "reports": 0, "flat": 0}
    total = max(rel.graph.total_cost, 1e-12)

    def report(check: MipCheck) -> bool:
        seen["reports"], b = check.checks, check.dual_bound
        rise = STALL_RISE * (incumbent / cs - seen["bound"]) if math.isfinite(seen["bound"]) else 0.0
        if math.isfinite(b) and (not math.isfinite(seen["bound"]) or b > seen["bound"] + rise):
            seen["flat"] = 0
        else:
            seen["flat"] += 1
        seen["bound"] = max(seen["bound"], b)
        if math.isfinite(seen["bound"]):  # the search's line: HiGHS's root node, its bound and gap so far
            progress.note(highs_root=f"{seen['reports']} reports", bound=f"{100 * seen['bound'] * cs / total:.3f}%",
                          gap=f"{100 * (1 - seen['bound'] * cs / incumbent):.2f}%")
        return seen["flat"] >= ROOT_CUTS_STALL or seen["bound"] >= (1 - ROOT_CUTS_GAP) * incumbent / cs

    interrupt_with(h, report)
    h.run()
    status = h.getModelStatus()
    final = h.getInfo().mip_dual_bound
    if status == highspy.HighsModelStatus.kInfeasible:
        # nothing under the cutoff: no point of the relaxation is cheaper than the plan, up to the
        # relative gap HiGHS prunes nodes with (taken off, ten times over)
        value = incumbent / cs * (1 - 10 * ROOT_CUTS_MIP_GAP)
    else:
        value = max(seen["bound"], final if math.isfinite(final) else -math.inf)
    bound = safe_bound(rel, value) if math.isfinite(value) else 0.0
    details["root_cuts"] = {"status": str(status).rsplit(".", 1)[-1][1:], "reports": seen["reports"], "bound": bound,
                            "s": round(time.perf_counter() - t0, 3)}
    if bound > details["certify"]["bound"]:
        details["bound_source"] = f"HiGHS's root node (cuts) on the fine graph's relaxation ({len(rel.groups)} groups)"
    return bound
