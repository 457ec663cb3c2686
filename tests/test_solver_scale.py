"""The certified solver (checkmate's relaxation, its branch and bound and its plans).

* The relaxation is one: every real schedule, mapped onto its variables
  (bounds.point_of_schedule), satisfies every row at an objective no higher than its extra cost
  (so its optimum is a lower bound on any plan's), on chains, random DAGs, transformers, an
  encoder-decoder whose decoder reads the encoder's output in every block, and a captured ConvNet
  (multi-output BatchNorm, forward-kept running statistics), in every variant of the model.
* On the training chains of tests/test_checkmate.py checkmate equals the brute-force optimum and
  proves it: its lower bound equals that optimum.
* On graphs of 50 to 150 nodes its cost is at most the flat MILP's (Checkmate's MILP on the fine
  graph, no coarsening) and its lower bound at most the flat MILP's proven optimum.
* Determinism, a wall-clock limit, and the proven floor under the smallest feasible budget.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from remat.core.training_graph import Node
from remat.solver import checkmate, equal_spacing
from remat.solver.checkmate.bounds import lower_bound, peak_lower_bound, point_of_schedule
from remat.solver.checkmate.guided import THRESHOLDS, drops_at
from remat.solver.checkmate.relaxation import Relaxation, groups_of, long_lived
from remat.solver.schedule import keep_all_schedule, schedule_from_kept
from remat.core.simulator import simulate
from tests.conftest import brute_force, random_dag, training_chain, transformer_like, with_backward, random_schedule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def encoder_decoder(enc: int = 2, dec: int = 2, seed: int = 0):
    """Not a chain: every decoder block reads the encoder's output (cross attention)."""
    rng = random.Random(seed)
    fwd: list[Node] = []

    def add(name, inputs, out, cost, rand=False, kept=0):
        fwd.append(Node(name=name, op=name.split("_")[0], inputs=tuple(inputs), out_bytes=out, cost=float(cost),
                        is_random=rand, kept_bytes=kept, workspace_bytes=rng.choice([0, 0, out // 2])))
        return name

    x = add("src", (), 16, 1)
    for b in range(enc):
        h = add(f"mm_e{b}", [x], 48, 8 + rng.randint(0, 3))
        a = add(f"act_e{b}", [h], 48, 2)
        d = add(f"drop_e{b}", [a], 12, 1, rand=True)
        x = add(f"add_e{b}", [x, d], 16, 1)
    mem = x
    y = add("tgt", (), 16, 1)
    for b in range(dec):
        h = add(f"mm_d{b}", [y], 48, 8 + rng.randint(0, 3))
        c = add(f"cross_d{b}", [h, mem], 64, 10 + rng.randint(0, 3))
        a = add(f"act_d{b}", [c], 48, 2)
        y = add(f"add_d{b}", [y, a], 16, 1)
    add("loss", [y], 0, 2, kept=4)
    return with_backward(fwd, resident=20, name=f"encdec{enc}x{dec}_s{seed}", rng=rng)


def long_blocks(blocks: int = 3, body: int = 12, seed: int = 0, adds: int = 1):
    """Residual blocks longer than the long-lived span of group_target 5 (10 forward nodes): the
    stream's value before a block is read by its first node and by the residual add after it (with
    adds=2 by two adds in a row, as BEiT's layer-scaled block reads it); and a table (positions ->
    cos, two nodes) that every block reads, as rotary tables are."""
    rng = random.Random(seed)
    fwd: list[Node] = []

    def add(name, inputs, out, cost, kept=0):
        fwd.append(Node(name=name, op=name.split("_")[0], inputs=tuple(inputs), out_bytes=out, cost=float(cost),
                        kept_bytes=kept))
        return name

    x = add("embed", (), 16, 1)
    cos = add("cos", [add("pos", (), 4, 1)], 8, 1)
    for b in range(blocks):
        h = add(f"norm_{b}", [x], 16, 1)
        for k in range(body):
            h = add(f"mm_{b}_{k}", [h, cos] if k == 0 else [h], rng.choice([16, 32, 48]), 2 + rng.randint(0, 6))
        if adds == 2:
            h = add(f"add_{b}_scaled", [x, h], 16, 1)
        x = add(f"add_{b}", [x, h], 16, 1)
    add("loss", [x], 0, 2, kept=4)
    return with_backward(fwd, resident=20, name=f"blocks{blocks}x{body}_s{seed}_a{adds}", rng=rng)


@pytest.mark.parametrize("adds", [1, 2])
def test_long_lived_values_are_tables_not_the_residual_stream(adds):
    """The stream's value before a long block is read far only by the residual add (or two adds in
    a row), and the whole block feeds only those: it stays in its own group (in the long-lived
    group with its feeders it would be modelled over every row the stream lives); a table read by
    every block joins the long-lived group with what computes it."""
    g = long_blocks(adds=adds)
    names = [[g.nodes[i].name for i in members] for members in groups_of(g, target=5)]
    hubs = names[-1]
    assert {"pos", "cos"} <= set(hubs)
    assert not [n for n in hubs if n.startswith(("norm_", "mm_", "add_"))]  # the embedding, fed by nothing, may join
    assert all(len(m) <= 20 for m in names[:-1])
    assert long_lived(g, 10) >= {"embed", "add_0", "add_1", "cos"}  # all read 10 or more nodes on


def violations(rel, x) -> list[str]:
    """Rows and bounds the point breaks (with a relative tolerance)."""
    return rel.model.violations(x)


def _convnet():
    import torch

    import remat
    from tests.models import ConvNet

    torch.manual_seed(0)
    return remat.capture(ConvNet(), (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))))


GRAPHS = [training_chain(6, 1, random_at=(2,)), training_chain(10, 2), random_dag(18, 0), random_dag(40, 3),
          transformer_like(2, seed=1), encoder_decoder(2, 3, seed=4), long_blocks()]
OPTIONS = [{"dense": True}, {"dense": False, "group_target": 5, "fwd_reads_only": False},
           {"dense": False, "group_target": 12, "fwd_reads_only": True}]


@pytest.mark.parametrize("g", GRAPHS + ["convnet"], ids=lambda g: getattr(g, "name", str(g)))
def test_every_schedule_is_a_point_of_the_relaxation(g):
    if g == "convnet":
        g = _convnet()
    rng = random.Random(len(g.nodes))
    cands = equal_spacing.checkpoint_candidates(g)
    scheds = [random_schedule(g, rng, p) for p in (0.0, 0.15, 0.4)]
    scheds += [schedule_from_kept(g, cands[k - 1::k]) for k in (1, 3)]
    for sched in scheds:
        sim = simulate(g, sched)
        for opts in OPTIONS:
            for budget in (sim.peak_bytes, None):  # the cost model at the schedule's peak; the peak's model
                rel = Relaxation(g, budget, **opts)
                assert rel.infeasible_at is None
                x = point_of_schedule(rel, sched)
                assert violations(rel, x) == [], (g.name, opts, budget)
                objective = float(np.dot(rel.model.cost, x))
                if budget is None:
                    assert objective * rel.mem_scale == pytest.approx(sim.peak_bytes)
                else:
                    assert objective * rel.cost_scale <= sim.extra_cost * (1 + 1e-9) + 1e-9
            # built at twice the peak, then moved to it (the lowest-peak search's probes)
            moved = Relaxation(g, 2 * sim.peak_bytes, **opts)
            moved.set_budget(sim.peak_bytes)
            assert moved.infeasible_at is None
            assert violations(moved, point_of_schedule(moved, sched)) == [], (g.name, opts, "moved")


@pytest.mark.parametrize("g", GRAPHS[2:], ids=lambda g: g.name)
def test_leaving_small_values_out_keeps_every_schedule_a_point(g, monkeypatch):
    """The relaxation without its small values (treated as live whenever read, holding no memory)
    still has every schedule as a point, at no higher objective; its bound is no higher than the
    whole model's, and its plans never drop a value it left out."""
    from remat.solver.checkmate import small_values

    monkeypatch.setattr(small_values, "SMALL_RATIO", 1.0)
    monkeypatch.setattr(small_values, "SMALL_SHARE", 0.3)
    monkeypatch.setattr(small_values, "SMALL_MIN_COUNT", 1)
    rng = random.Random(len(g.nodes))
    cands = equal_spacing.checkpoint_candidates(g)
    scheds = [random_schedule(g, rng, p) for p in (0.15, 0.4)] + [schedule_from_kept(g, cands[2::3])]
    for sched in scheds:
        sim = simulate(g, sched)
        for opts in OPTIONS[1:]:
            for budget in (sim.peak_bytes, None):
                rel = Relaxation(g, budget, small_from_nodes=0, **opts)
                assert rel.unmodelled and all(not rel.recomputable[u] for u in rel.unmodelled)
                x = point_of_schedule(rel, sched)
                assert violations(rel, x) == [], (g.name, opts, budget)
                if budget is not None:
                    assert float(np.dot(rel.model.cost, x)) * rel.cost_scale <= sim.extra_cost * (1 + 1e-9) + 1e-9
                    whole = Relaxation(g, budget, small_from_nodes=10 ** 9, **opts)
                    assert not whole.unmodelled
                    sol = rel.model.solve()
                    assert sol.bound <= whole.model.solve().bound * (1 + 1e-9) + 1e-9
                    for th in THRESHOLDS:
                        assert not set().union(*drops_at(rel, sol.x, th)) & rel.unmodelled


CHAINS = [(4, 1, "min"), (5, 0, "min"), (7, 1, "min+"), (8, 1, "min"), (9, 0, "mid"), (10, 7, "mid"), (6, 3, "min")]


@pytest.mark.parametrize("n, seed, which", CHAINS)
def test_proves_the_brute_force_optimum(n, seed, which):
    g = training_chain(n, seed, random_at=(2, n - 1) if seed == 3 else ())
    lo, _ = brute_force(g, None, objective="peak")
    hi = simulate(g, keep_all_schedule(g)).peak_bytes
    budget = {"min": lo, "min+": lo + 2, "mid": (lo + hi) // 2}[which]
    best, _ = brute_force(g, budget)
    extra = best - g.total_cost
    plan = checkmate.solve(g, budget)
    assert plan.status == "optimal" and plan.total_cost == pytest.approx(best)
    assert plan.lower_bound <= extra + 1e-9 and plan.lower_bound == pytest.approx(extra, rel=1e-6, abs=1e-6)
    assert plan.gap == pytest.approx((plan.extra_cost - plan.lower_bound) / plan.extra_cost if extra else 0, abs=1e-12)
    milp = lower_bound(g, budget, integral=True)  # the relaxation's MILP: the same optimum
    assert milp.bound == pytest.approx(extra, rel=1e-6, abs=1e-6)


def test_the_relaxation_milp_closes_the_gap_class_branching_leaves(monkeypatch):
    """Where the branch and bound on class sums stalls short of its gap (here: after one LP that
    does not raise the bound, as it stalls on CNNs), HiGHS's MILP of the relaxation runs from the
    incumbent plan: it closes the gap the LPs left, and its bound never exceeds the brute-force
    optimum. Stopped by its work limit instead, the branch and bound is not followed by the MILP."""
    from remat.solver.checkmate import branch_and_bound, certified_search

    g = training_chain(10, 7)
    budget = brute_force(g, None, objective="peak")[0] + 2
    # milp="never": the certified search's plans alone (Checkmate's MILP took 4 s of each solve)
    with monkeypatch.context() as m:
        m.setattr(certified_search, "MAX_LPS", 1)
        plan = checkmate.solve(g, budget, milp="never")
        assert plan.details["certify"]["stopped_by"] == "work limit" and "relaxation_milp" not in plan.details
    monkeypatch.setattr(branch_and_bound, "STALL", 1)
    for n, seed, above, closes in ((10, 7, 2, True), (12, 3, 0, False)):
        g = training_chain(n, seed)
        budget = brute_force(g, None, objective="peak")[0] + above
        extra = brute_force(g, budget)[0] - g.total_cost
        plan = checkmate.solve(g, budget, milp="never")
        assert plan.details["certify"]["stopped_by"] == "stalled" and plan.details["relaxation_milp"]["status"] == "optimal"
        assert plan.details["relaxation_milp"]["bound"] >= plan.details["certify"]["bound"]
        assert plan.lower_bound <= extra + 1e-9 and plan.extra_cost == pytest.approx(extra)
        assert (plan.status == "optimal") == closes, g.name


def test_highs_root_node_raises_the_bound_a_stalled_search_leaves(monkeypatch):
    """Where the class-sum branching stalls on a relaxation too large for HiGHS's MILP, with a gap
    over ROOT_CUTS_GAP, HiGHS's root node on the relaxation (the plan's cost as cutoff) raises the
    bound: never above the brute-force optimum, and the plan stays the one found without it."""
    from remat.solver.checkmate import branch_and_bound, certified_search

    monkeypatch.setattr(branch_and_bound, "STALL", 1)
    monkeypatch.setattr(certified_search, "MIP_MAX_VARIABLES", 0)
    # the first: nothing under the cutoff (the plan is the relaxation's optimum); the second: the
    # root stops, its bound flat, between the stalled search's bound and the optimum
    for n, seed, above in ((10, 7, 2), (10, 4, 0)):
        g = training_chain(n, seed)
        budget = brute_force(g, None, objective="peak")[0] + above
        extra = brute_force(g, budget)[0] - g.total_cost
        with monkeypatch.context() as m:
            m.setattr(certified_search, "ROOT_CUTS_GAP", 1.0)  # never: the plan and bound without it
            without = certified_search.certified_search(g, budget)
        assert without.details["certify"]["stopped_by"] == "stalled" and "root_cuts" not in without.details
        monkeypatch.setattr(certified_search, "ROOT_CUTS_GAP", 0.0)
        res = certified_search.certified_search(g, budget)
        cuts = res.details["root_cuts"]
        assert cuts["reports"] >= 1 or cuts["status"] == "Infeasible"  # (nothing under the cutoff)
        assert res.schedule == without.schedule and res.extra_cost >= extra - 1e-9
        assert without.bound < res.bound <= extra + 1e-9, g.name
        assert res.details["bound_source"].startswith("HiGHS's root node")


def test_no_branching_where_the_root_lp_is_far_under_a_bound_proved_otherwise(monkeypatch):
    """Given a bound (the peak rows') more than ROOT_UNDER_OTHER_BOUND over the root LP's value,
    the certified search of a relaxation over MIP_MAX_VARIABLES reads the root's plans and stops
    without branching: its plan fits, its bound is the root LP's. On a relaxation under
    MIP_MAX_VARIABLES it branches; a bound at the plan's cost proves the plan there (the gap the
    search stops at counts the bound proved otherwise)."""
    from remat.solver.checkmate import certified_search

    g = transformer_like(1, 1)
    budget = (simulate(g, keep_all_schedule(g)).peak_bytes + equal_spacing.solve(g, 0).predicted_peak_bytes) // 2
    free = certified_search.certified_search(g, budget)
    assert free.details["certify"]["lps"] > 1  # it branches without one
    root = free.details["certify"]["root_bound"]
    proved = certified_search.certified_search(g, budget, other_bound=free.extra_cost)
    assert proved.details["certify"]["stopped_by"] == "gap"
    assert proved.details["certify"]["lps"] < free.details["certify"]["lps"]
    assert proved.extra_cost - free.extra_cost <= 1e-4 * proved.extra_cost
    monkeypatch.setattr(certified_search, "MIP_MAX_VARIABLES", 0)  # as if the relaxation were large
    far = certified_search.certified_search(g, budget, other_bound=root * 1.5 + 1.0)
    assert far.details["certify"]["stopped_by"] == "under the floor" and far.details["certify"]["lps"] == 1
    assert far.bound <= root * (1 + 1e-9) + 1e-9
    assert far.schedule is not None and simulate(g, far.schedule).peak_bytes <= budget
    large = certified_search.certified_search(g, budget)
    near = certified_search.certified_search(g, budget, other_bound=root * 1.01)
    assert near.details["certify"]["lps"] == large.details["certify"]["lps"] > 1 and near.bound == large.bound



def test_no_branching_where_no_plan_read_off_the_root_fits(monkeypatch):
    """Where no plan read off the root's solution fits (here: the reads made to find none), the
    certified search of a relaxation over MIP_MAX_VARIABLES does not branch: its plan is the start
    it was given, its bound the root LP's, within the brute-force optimum. On a smaller relaxation,
    where the root's read gives a plan, and where no start fits, it branches."""
    from remat.solver.checkmate import certified_search

    g = training_chain(10, 4)
    budget = brute_force(g, None, objective="peak")[0] + 1
    optimum = brute_force(g, budget)[0] - g.total_cost
    start = [("lowest peak", brute_force(g, None, objective="peak")[1])]
    reads = {"n": 0}
    real = certified_search.best_guided

    def none_at_the_root(*args, **kwargs):
        reads["n"] += 1
        return None if reads["n"] == 1 else real(*args, **kwargs)

    for large in (True, False):
        reads["n"] = 0
        with monkeypatch.context() as m:
            m.setattr(certified_search, "best_guided", none_at_the_root)
            m.setattr(certified_search, "exchanged_plan", lambda *a, **k: None)
            if large:
                m.setattr(certified_search, "MIP_MAX_VARIABLES", 0)
            res = certified_search.certified_search(g, budget, starts=start)
        cert = res.details["certify"]
        if large:
            assert cert["stopped_by"] == certified_search.NO_PLAN_AT_ROOT and cert["lps"] == 1
            assert res.schedule == start[0][1] and reads["n"] == 1
        else:
            assert cert["stopped_by"] != certified_search.NO_PLAN_AT_ROOT and cert["lps"] > 1
        assert simulate(g, res.schedule).peak_bytes <= budget and res.bound <= optimum + 1e-9
    with monkeypatch.context() as m:  # the root's read gives a plan: it branches
        m.setattr(certified_search, "MIP_MAX_VARIABLES", 0)
        res = certified_search.certified_search(g, budget, starts=start)
        assert res.details["certify"]["stopped_by"] != certified_search.NO_PLAN_AT_ROOT
        reads["n"] = 0  # no start: branching is the only way to a plan
        m.setattr(certified_search, "best_guided", none_at_the_root)
        alone = certified_search.certified_search(g, budget)
    assert alone.details["certify"]["lps"] > 1 and alone.bound <= optimum + 1e-9


def test_branching_stops_once_its_reads_are_spent_under_the_rounds_bound(monkeypatch):
    """On a relaxation over MIP_MAX_VARIABLES, given the bound the rows' rounds proved before it
    (rounds_bound), the certified search stops branching once its plan reads after the root's are
    spent (PLAN_ATTEMPTS), where none gave a plan cheaper than its starts and its bound is still
    under that one (READS_SPENT): it keeps the start, proves less than its full search. Not where a
    read gave a cheaper plan, nor where its bound is over the rounds', nor without rounds."""
    from remat.solver.checkmate import certified_search

    g = training_chain(10, 4)
    lo = equal_spacing.solve(g, 0).predicted_peak_bytes
    budget = (lo + simulate(g, keep_all_schedule(g)).peak_bytes) // 2
    optimum, best = brute_force(g, budget)
    optimum -= g.total_cost
    monkeypatch.setattr(certified_search, "MIP_MAX_VARIABLES", 0)  # as if the relaxation were large
    full = certified_search.certified_search(g, budget, starts=[("best", best)])
    assert full.details["certify"]["lps"] > certified_search.PLAN_ATTEMPTS + 1
    assert abs(full.bound - optimum) <= 1e-6 * optimum  # it proves the start optimal
    cut = certified_search.certified_search(g, budget, starts=[("best", best)], rounds_bound=optimum)
    cert = cut.details["certify"]
    assert cert["stopped_by"] == certified_search.READS_SPENT
    assert certified_search.PLAN_ATTEMPTS < cert["lps"] < full.details["certify"]["lps"]
    assert cut.schedule == best and cut.details["plan_source"] == "best" and cut.bound < full.bound
    for starts, rounds in (([("best", best)], 0.0),  # no rounds ran
                           ([("best", best)], full.details["certify"]["root_bound"] * 0.5),  # the root is over theirs
                           ([("keep nothing", equal_spacing.solve(g, 0).schedule)], optimum)):  # a read is cheaper
        res = certified_search.certified_search(g, budget, starts=starts, rounds_bound=rounds)
        assert res.details["certify"]["stopped_by"] != certified_search.READS_SPENT
        assert res.extra_cost <= optimum + 1e-9 and res.bound <= optimum + 1e-9
        assert (res.details["plan_source"] == "relaxation") == (starts[0][0] == "keep nothing")


def test_branching_stops_once_its_reads_are_spent_with_its_bound_flat(monkeypatch):
    """On a relaxation over MIP_MAX_VARIABLES, once the plan reads after the root's are spent
    (PLAN_ATTEMPTS) with the search's bound risen by less than STALL_RISE of the gap the root left,
    the branching stops (BOUND_FLAT): here at its 7th LP, where it would stall at its 21st, with
    the same plan and the bound as flat as it was."""
    from remat.solver.checkmate import certified_search

    g, budget = transformer_like(1, 2), 2237572
    monkeypatch.setattr(certified_search, "MIP_MAX_VARIABLES", 0)  # as if the relaxation were large
    cut = checkmate.solve(g, budget)
    cert = cut.details["certify"]
    assert cert["stopped_by"] == certified_search.BOUND_FLAT and cert["lps"] == certified_search.PLAN_ATTEMPTS + 1
    monkeypatch.setattr(certified_search, "STALL_RISE", -1.0)  # never flat: the search as it was
    full = checkmate.solve(g, budget)
    whole = full.details["certify"]
    assert whole["stopped_by"] != certified_search.BOUND_FLAT and whole["lps"] > cert["lps"]
    assert cut.schedule == full.schedule and cut.fits
    rise = cert["bound"] - cert["root_bound"]
    assert -1e-9 <= rise <= 0.01 * (cut.extra_cost - cert["root_bound"]) and whole["bound"] >= cert["bound"] - 1e-9


FLAT = [random_dag(25, 1), random_dag(35, 2), transformer_like(1, 2), random_dag(60, 4), encoder_decoder(3, 4, seed=2)]


@pytest.mark.parametrize("g", FLAT, ids=lambda g: g.name)
def test_never_worse_than_the_flat_milp(g):
    assert 50 <= len(g.nodes) <= 300
    lo = equal_spacing.solve(g, 0).predicted_peak_bytes
    hi = simulate(g, keep_all_schedule(g)).peak_bytes
    for frac in (0.3, 0.7):
        budget = int(lo + frac * (hi - lo))
        flat = checkmate.solve(g, budget, coarsen_to=None, milp="always", certify=False, max_nodes=3000)
        ours = checkmate.solve(g, budget)
        assert ours.fits and simulate(g, ours.schedule).peak_bytes <= budget
        assert ours.extra_cost <= flat.details["milp_plan"]["extra_cost"] + 1e-9
        assert ours.extra_cost <= flat.extra_cost + 1e-9
        if flat.details["milp_status"] == "optimal":  # its proven optimum (in its own, conservative model)
            assert ours.lower_bound <= flat.details["objective"] + 1e-6
        assert 0 <= ours.lower_bound <= ours.extra_cost and ours.gap >= 0


def test_same_plan_every_time_and_a_time_limit_keeps_the_best_plan():
    def budget_of(g):
        lo = equal_spacing.solve(g, 0).predicted_peak_bytes
        return int(lo + 0.3 * (simulate(g, keep_all_schedule(g)).peak_bytes - lo))

    # under a work limit that stops the certified search short of its gap (95 LPs, 22.6k simplex
    # iterations without it): where it stops must not depend on the machine either
    first = checkmate.solve(transformer_like(2, seed=3), budget_of(transformer_like(2, seed=3)), max_iterations=5_000)
    again = checkmate.solve(transformer_like(2, seed=3), budget_of(transformer_like(2, seed=3)),  # a fresh graph
                            max_iterations=5_000)
    assert first.details["certify"]["stopped_by"] == "work limit"
    assert again.schedule == first.schedule and again.lower_bound == first.lower_bound
    g = encoder_decoder(3, 3, seed=1)
    plan = checkmate.solve(g, budget_of(g), time_limit_s=0.5)
    es = equal_spacing.solve(g, budget_of(g))
    assert plan.fits and plan.status in ("optimal", "feasible") and plan.lower_bound is not None
    assert plan.extra_cost <= es.extra_cost + 1e-9


@pytest.mark.parametrize("g", [training_chain(7, 1), random_dag(20, 5), transformer_like(1)], ids=lambda g: g.name)
def test_no_plan_below_the_peak_floor(g):
    m, low = checkmate.min_feasible_budget(g, return_plan=True)
    floor = low.details["peak_lower_bound"]
    assert floor <= m == low.predicted_peak_bytes
    assert peak_lower_bound(g)[0] <= floor
    if len(g.nodes) <= 16:  # the exact smallest peak (schedules in the graph's order: a chain)
        assert brute_force(g, None, objective="peak")[0] >= floor
    below = checkmate.solve(g, floor - 1)
    assert below.status == "infeasible" and below.details["reason"] == "proven infeasible"
    assert checkmate.solve(g, m).fits


def test_good_gap_stops_the_branching_once_no_better_plan_comes():
    """With `good_gap`, the branch and bound stops once its gap is within it and `patience` LPs have
    passed without a better plan; without, it goes on (solver/checkmate/certified_search.py
    GOOD_GAP)."""
    from remat.solver.checkmate.branch_and_bound import certify
    from remat.solver.checkmate.certified_search import certified_search
    from remat.solver.checkmate.relaxation import Relaxation

    g = transformer_like(1, 1)
    budget = (simulate(g, keep_all_schedule(g)).peak_bytes + equal_spacing.solve(g, 0).predicted_peak_bytes) // 2
    plan = certified_search(g, budget)
    rel = Relaxation(g, budget)
    incumbent = plan.extra_cost / rel.cost_scale
    full = certify(rel, incumbent=incumbent, max_lps=40)
    assert full.lps > 3 and full.stopped_by != "good gap"
    gap = (incumbent - full.bound) / incumbent
    good = certify(rel, incumbent=incumbent, max_lps=40, good_gap=1.0, patience=2)
    assert good.stopped_by == "good gap" and good.lps == 3
    tight = certify(rel, incumbent=incumbent, max_lps=40, good_gap=gap / 10, patience=2)
    assert tight.lps == full.lps and tight.stopped_by == full.stopped_by


def test_the_relaxation_milp_stops_where_its_bound_stays_under_the_rows(monkeypatch):
    """HiGHS's MILP of the relaxation stops where its dual bound is still at or under the rows'
    bound (here: just under the optimum, a bound its first check cannot have passed) after
    MIP_UNDER_ROWS_CHECKS of its interrupt checks: FSMT's decoder block spent 14 s there without
    lifting it. Its bound stays a bound; without a rows' bound it runs to its optimum as before."""
    from remat.solver.checkmate import branch_and_bound, certified_search as search

    monkeypatch.setattr(branch_and_bound, "STALL", 1)  # the search stalls into the MILP
    g = training_chain(10, 7)
    budget = brute_force(g, None, objective="peak")[0] + 2
    extra = brute_force(g, budget)[0] - g.total_cost
    free = search.certified_search(g, budget)
    assert free.details["relaxation_milp"]["status"] == "optimal"
    assert "stopped_by" not in free.details["relaxation_milp"]
    monkeypatch.setattr(search, "MIP_UNDER_ROWS_CHECKS", 1)
    res = search.certified_search(g, budget, other_bound=0.999 * extra)
    milp = res.details["relaxation_milp"]
    assert milp["stopped_by"] == "under the rows' bound" and milp["status"] == "limit"
    assert res.bound <= extra + 1e-9 and res.extra_cost >= extra - 1e-9


def test_no_certified_search_where_the_rows_prove_the_plan_within_the_good_gap(monkeypatch):
    """On a relaxation over MIP_MAX_VARIABLES (lowered here), where the rows' bound proves the best
    candidate within GOOD_GAP the certified search does not run (LiLT at half its activation memory:
    52 s for the same plan), and plan.details says why; where it does not, the search runs."""
    from remat.solver.checkmate import certify

    g = transformer_like(2, 0, d=1 << 10)
    budget = (checkmate.min_feasible_budget(g) + simulate(g, keep_all_schedule(g)).peak_bytes) // 2
    monkeypatch.setattr(certify, "MIP_MAX_VARIABLES", 0)
    monkeypatch.setattr(certify, "ROUNDS_FIRST_MAX_ITERATIONS", -1)  # (the rounds after the search, if it runs)
    searched = []
    real = certify.certified_search
    monkeypatch.setattr(certify, "certified_search", lambda *a, **k: searched.append(1) or real(*a, **k))
    monkeypatch.setattr(certify, "GOOD_GAP", 0.0)
    plan = checkmate.solve(g, budget)
    if not searched:
        pytest.skip("the rows prove this plan optimal: nothing for the rule to decide")
    monkeypatch.setattr(certify, "GOOD_GAP", 1.0)  # every plan the rows bound is within it
    searched.clear()
    skipped = checkmate.solve(g, budget)
    assert not searched and "the rows prove the plan within" in skipped.details["certify_skipped"]
    assert skipped.fits and skipped.extra_cost >= plan.extra_cost - 1e-9
    assert skipped.lower_bound <= plan.extra_cost + 1e-9



def test_on_the_largest_relaxations_the_rows_proof_within_a_wider_gap_spares_the_search(monkeypatch):
    """On a relaxation of HUGE_SKIP_MIN_VARIABLES or more (lowered here), the rows' proof of the best
    candidate within HUGE_SKIP_GAP, not GOOD_GAP, spares the certified search (LARA-mini at half its
    activation memory: 9.7 s of search for the same plan); on a smaller relaxation GOOD_GAP holds."""
    from remat.solver.checkmate import certify

    g = transformer_like(2, 0, d=1 << 10)
    budget = (checkmate.min_feasible_budget(g) + simulate(g, keep_all_schedule(g)).peak_bytes) // 2
    monkeypatch.setattr(certify, "MIP_MAX_VARIABLES", 0)
    monkeypatch.setattr(certify, "ROUNDS_FIRST_MAX_ITERATIONS", -1)
    monkeypatch.setattr(certify, "GOOD_GAP", 0.0)
    monkeypatch.setattr(certify, "HUGE_SKIP_GAP", 1.0)  # every plan the rows bound is within it
    searched = []
    real = certify.certified_search
    monkeypatch.setattr(certify, "certified_search", lambda *a, **k: searched.append(1) or real(*a, **k))
    plan = checkmate.solve(g, budget)  # (a relaxation under HUGE_SKIP_MIN_VARIABLES: GOOD_GAP)
    if not searched:
        pytest.skip("the rows prove this plan optimal: nothing for the rule to decide")
    monkeypatch.setattr(certify, "HUGE_SKIP_MIN_VARIABLES", 0)
    searched.clear()
    skipped = checkmate.solve(g, budget)
    assert not searched and "the rows prove the plan within 100%" in skipped.details["certify_skipped"]
    assert skipped.fits and skipped.extra_cost >= plan.extra_cost - 1e-9
    assert skipped.lower_bound <= plan.extra_cost + 1e-9
    monkeypatch.setattr(certify, "HUGE_SKIP_GAP", 0.0)
    searched.clear()
    # (that the search runs is what is asked, not its plan: a work limit ends it early, 6 s -> 1 s)
    assert checkmate.solve(g, budget, max_iterations=2_000).fits and searched


def test_no_certified_search_near_the_peak_floor_on_a_large_relaxation(monkeypatch):
    """Within NEAR_FLOOR of the rows' floor on the peak, on a relaxation of NEAR_FLOOR_MIN_VARIABLES or
    more (lowered here), the certified search does not run (Zaya at its smallest budget: a root LP of
    12 s under the rows' bound), and plan.details says why; a byte further above the floor it runs."""
    from remat.solver.checkmate import certify
    from remat.solver.checkmate.peak_rows import peak_floor

    monkeypatch.setattr(certify, "NEAR_FLOOR_MIN_VARIABLES", 0)
    searched = []
    real = certify.certified_search
    monkeypatch.setattr(certify, "certified_search", lambda *a, **k: searched.append(1) or real(*a, **k))
    g = transformer_like(3, 0, d=1 << 10)
    near = int((1 + certify.NEAR_FLOOR) * peak_floor(g))
    assert near >= checkmate.min_feasible_budget(g)
    plan = checkmate.solve(g, near)
    assert not searched and "rows' floor" in plan.details["certify_skipped"]
    assert plan.fits and 0 <= plan.lower_bound <= plan.extra_cost + 1e-9
    above = checkmate.solve(g, near + 1)
    assert searched and "certify" in above.details and above.fits
