"""The rows' model (solver/checkmate/row_models.py) is a relaxation, and what the rows' search
(peak_rows.py) proves from it holds.

Every schedule whose first computations follow the graph's order and that fits the budget must be
a point of the model of the rows keep-all puts over that budget, at an objective no higher than
its extra cost (checked on random schedules of chains, random DAGs, transformer-like stacks and
graphs with multi-output nodes); so the bound never exceeds the brute-force optimum, the plans
fit, and a budget the rows call infeasible is one the brute force finds nothing for.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from remat.core.simulator import simulate
from remat.core.training_graph import Node, TrainingGraph
from remat.solver import checkmate
from remat.solver.checkmate.peak_rows import peak_rows_search
from remat.solver.checkmate.row_models import over_budget_rows, point_of_schedule, rows_model
from remat.solver.schedule import keep_all_schedule
from tests.conftest import brute_force, random_dag, random_schedule, training_chain, transformer_like


def _multi_output(seed: int) -> TrainingGraph:
    """A chain whose middle node has two outputs read by different backward nodes (out_parts)."""
    rng = random.Random(seed)
    f = [Node("a", "op", (), out_bytes=rng.randint(4, 20), cost=3.0),
         Node("b", "op", ("a",), out_bytes=30, cost=5.0, out_parts=((10, ("c", "db")), (20, ("da",)))),
         Node("c", "op", ("b",), out_bytes=rng.randint(4, 20), cost=2.0),
         Node("d", "op", ("c",), out_bytes=rng.randint(4, 20), cost=4.0, kept_bytes=1)]
    b = [Node("dd", "bwd", ("d",), out_bytes=8, cost=4.0, is_backward=True),
         Node("dc", "bwd", ("dd", "c"), out_bytes=8, cost=4.0, is_backward=True),
         Node("db", "bwd", ("dc", "b"), out_bytes=8, cost=4.0, is_backward=True),
         Node("da", "bwd", ("db", "b", "a"), out_bytes=8, cost=4.0, is_backward=True)]
    return TrainingGraph(nodes=tuple(f + b), resident_bytes=5, name=f"multi_output_s{seed}")


GRAPHS = [training_chain(6, 1, random_at=(2,)), training_chain(9, 2), random_dag(14, 0), random_dag(30, 3),
          transformer_like(2, seed=1), _multi_output(0), _multi_output(1)]


@pytest.mark.parametrize("g", GRAPHS, ids=lambda g: g.name)
def test_every_fitting_schedule_is_a_point_of_the_rows_model(g):
    rng = random.Random(len(g.nodes))
    checked = 0
    for p in (0.0, 0.1, 0.25, 0.4, 0.6):
        for _ in range(3):
            sched = random_schedule(g, rng, p)
            sim = simulate(g, sched)
            rows = over_budget_rows(g, sim.peak_bytes)  # the schedule fits its own peak
            if not rows:
                continue
            assert all(w.capacity >= 0 for w in rows)
            for chosen in (rows, rows[:1], rows[-1:], rows[::2]):
                rm = rows_model(g, chosen)
                x = point_of_schedule(rm, g, sched)
                assert rm.model.violations(x) == [], (g.name, p, len(chosen))
                assert float(np.dot(rm.model.cost, x)) * rm.cost_scale <= sim.extra_cost * (1 + 1e-9) + 1e-9
            res = peak_rows_search(g, sim.peak_bytes)
            assert res.bound <= sim.extra_cost + 1e-9
            checked += 1
    assert checked >= 3  # the random schedules did put some rows over their own peaks


# chains: one topological order, so the brute force's optimum is in the bound's scope (first
# computations in the graph's order; on a DAG it may reorder them and cost less than the bound),
# and single-output nodes (the brute force frees a node's outputs together, not part by part)
@pytest.mark.parametrize("g", [training_chain(6, 1, random_at=(2,)), training_chain(8, 2), training_chain(7, 4)],
                         ids=lambda g: g.name)
def test_bound_and_plans_against_brute_force(g):
    lo, _ = brute_force(g, None, objective="peak")
    hi = simulate(g, keep_all_schedule(g)).peak_bytes
    for budget in sorted({lo, lo + 1, (lo + hi) // 2, hi - 1}):
        best, _ = brute_force(g, budget)
        res = peak_rows_search(g, budget)
        if best is None:
            assert res.schedule is None
            continue
        assert res.bound <= best - g.total_cost + 1e-9
        if res.schedule is not None:
            sim = simulate(g, res.schedule)
            assert sim.peak_bytes <= budget and sim.extra_cost == pytest.approx(res.extra_cost)
            assert res.extra_cost >= best - g.total_cost - 1e-9
    # a budget the rows prove infeasible has no schedule at all
    res = peak_rows_search(g, lo - 1)
    assert brute_force(g, lo - 1)[0] is None
    assert res.schedule is None


@pytest.mark.parametrize("g", [training_chain(6, 1, random_at=(2,)), training_chain(8, 2), training_chain(7, 4)],
                         ids=lambda g: g.name)
def test_the_bound_alone_is_a_bound_and_stops_at_the_incumbent(g, monkeypatch):
    """bound_only: no plan is made (guided.fit never runs), the bound is still under the brute
    force's optimum and at least the full search's, and with an incumbent its first model's bound
    reaches, the search stops there."""
    import remat.solver.checkmate.peak_rows as peak_rows

    lo, _ = brute_force(g, None, objective="peak")
    hi = simulate(g, keep_all_schedule(g)).peak_bytes
    checked = 0
    for budget in sorted({lo, lo + 1, (lo + hi) // 2, hi - 1}):
        best, _ = brute_force(g, budget)
        full = peak_rows_search(g, budget)
        monkeypatch.setattr(peak_rows, "fit", lambda *a, **k: pytest.fail("a plan was made"))
        alone = peak_rows_search(g, budget, bound_only=True)
        monkeypatch.undo()
        assert alone.schedule is None
        if best is None:
            continue
        assert full.bound - 1e-9 <= alone.bound <= best - g.total_cost + 1e-9
        first = alone.details["solves"][0].get("bound", 0.0)
        if first > 0 and len(alone.details["solves"]) > 1:
            early = peak_rows_search(g, budget, incumbent=first, bound_only=True)
            assert len(early.details["solves"]) == 1 and early.bound == pytest.approx(first)
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("g", GRAPHS, ids=lambda g: g.name)
def test_the_bound_alone_answers_whether_it_reaches_the_incumbent_as_in_full(g, monkeypatch):
    """bound_only with an incumbent: each MILP is given the incumbent as its target (a solution
    under it proves that MILP's bound never reaches it), and whether the bound reaches the incumbent
    is what the search without an incumbent says, for incumbents under, at and over that bound."""
    from remat.solver.checkmate.peak_rows import peak_floor
    from remat.solver.checkmate.sparse_lp import SparseModel

    lo, hi = peak_floor(g), simulate(g, keep_all_schedule(g)).peak_bytes
    real_solve = SparseModel.solve
    targets = []

    def spy(self, **kw):
        if kw.get("integral"):
            targets.append(kw.get("target"))
        return real_solve(self, **kw)

    compared = 0
    for budget in sorted({lo, (lo + hi) // 2, hi - 1}):
        alone = peak_rows_search(g, budget, bound_only=True)
        if not math.isfinite(alone.bound) or alone.bound <= 0:
            continue
        for incumbent in (alone.bound * 0.5, alone.bound * 0.999, alone.bound * 1.001, alone.bound * 2):
            targets.clear()
            with monkeypatch.context() as m:
                m.setattr(SparseModel, "solve", spy)
                got = peak_rows_search(g, budget, incumbent=incumbent, bound_only=True)
            assert (got.bound < incumbent) == (alone.bound < incumbent)
            assert all(t is not None for t in targets)
            compared += 1
    assert compared >= 4


def test_a_dominant_loss_head_is_proved_optimal_by_its_row():
    # a language model's shape: many layers of cheap, large activations and one huge head at the
    # end of the forward; the budget only bites at the head, so its row decides the plan
    fwd = [Node("x0", "op", (), out_bytes=100, cost=10.0)]
    for i in range(1, 9):
        fwd.append(Node(f"n{i}", "norm", (f"x{i - 1}",), out_bytes=100, cost=1.0))
        fwd.append(Node(f"x{i}", "mm", (f"n{i}",), out_bytes=100, cost=50.0))
    fwd.append(Node("logits", "mm", ("x8",), out_bytes=2000, cost=200.0))
    fwd.append(Node("loss", "ce", ("logits",), out_bytes=4, cost=20.0, kept_bytes=4))
    bwd = [Node("dlogits", "bwd", ("loss", "logits"), out_bytes=2000, cost=40.0, is_backward=True),
           Node("dx8", "bwd", ("dlogits", "x8"), out_bytes=100, cost=400.0, is_backward=True)]
    for i in range(8, 0, -1):
        bwd.append(Node(f"dn{i}", "bwd", (f"dx{i}", f"n{i}"), out_bytes=100, cost=100.0, is_backward=True))
        bwd.append(Node(f"dx{i - 1}", "bwd", (f"dn{i}", f"x{i - 1}"), out_bytes=100, cost=2.0, is_backward=True))
    g = TrainingGraph(nodes=tuple(fwd + bwd), resident_bytes=0, name="lm_head")
    keep = simulate(g, keep_all_schedule(g)).peak_bytes
    budget = keep - 500
    plan = checkmate.solve(g, budget)
    assert plan.fits and plan.status == "optimal"
    assert plan.details["bound_source"].startswith("peak rows")
    assert "certify" not in plan.details  # the whole step's relaxation was not needed
    assert plan.extra_cost == pytest.approx(5.0)  # five norms recomputed, the cheapest 500 bytes
    assert plan.lower_bound == pytest.approx(5.0, rel=1e-6)


def test_several_rows_keep_a_dropped_part_dropped_until_it_is_computed_again(monkeypatch):
    """Rows together: a part live at a row was live at the row before or computed in between
    (row_models._keep_rows). Without it a value dropped before one row could be live at the next
    for free; with it the MILP of every row over the budget reaches the brute-force optimum on
    these chains, and never exceeds it."""
    import remat.solver.checkmate.peak_rows as peak_rows
    import remat.solver.checkmate.row_models as row_models

    def bound(g, rows):
        rm = rows_model(g, rows)
        sol = rm.model.solve(integral=True)
        return peak_rows._bound(sol.bound, rm, g, peak_rows.MILP_SAFETY)

    raised = 0
    for g, budget in ((training_chain(8, 3), 69), (training_chain(9, 5), 70), (training_chain(8, 0), 63),
                      (training_chain(7, 4), 64)):
        best, _ = brute_force(g, budget)
        rows = over_budget_rows(g, budget)
        with_keep = bound(g, rows)
        with monkeypatch.context() as m:
            m.setattr(row_models, "_keep_rows", lambda *args: None)
            without = bound(g, rows)
        assert without <= with_keep + 1e-9 and with_keep <= best - g.total_cost + 1e-9, g.name
        assert with_keep == pytest.approx(best - g.total_cost, rel=1e-5), g.name
        raised += with_keep > without + 1e-6
    assert raised == 3


@pytest.mark.parametrize("n, seed, budget", [(8, 8, 69), (9, 2, 86), (10, 1, 86)])
def test_the_rows_of_each_binding_stretch_together_prove_what_single_rows_cannot(n, seed, budget, monkeypatch):
    """Two runs of over-budget steps: no single row's MILP proves the optimum; the MILP of a row
    per run proves it and reads a plan at it (the brute force's optimum)."""
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(n, seed)
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    res = peak_rows_search(g, budget, mip_gap=1e-4)
    together = [s for s in res.details["solves"] if s["rows"] > 1]
    assert len(together) == 1 and together[0]["integral"]
    assert res.extra_cost == pytest.approx(optimum)
    assert simulate(g, res.schedule).peak_bytes <= budget
    assert optimum * (1 - 1e-4) <= res.bound <= optimum + 1e-9
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 1)  # single rows only
    alone = peak_rows_search(g, budget, mip_gap=1e-4)
    assert alone.bound < optimum * (1 - 1e-3)


@pytest.mark.parametrize("n, seed, budget", [(8, 1, 63), (9, 0, 86), (9, 3, 99)])
def test_the_rows_a_plan_misses_added_prove_what_the_rows_together_could_not(n, seed, budget, monkeypatch):
    """With two rows together at most, their MILP's plan is over the budget at a third run of steps:
    going on from it (more_rows_from), the rows there are added and the MILP proves the brute
    force's optimum; over GENERATION_MAX_VARIABLES the round is not solved and says why."""
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(n, seed)
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    first = peak_rows_search(g, budget, mip_gap=1e-4)
    assert first.together is not None and first.bound < optimum * (1 - 1e-3)
    more = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first)
    assert [s["rows"] for s in more.details["solves"]] == [len(first.together[0]) + 1]
    assert optimum * (1 - 1e-4) <= more.bound <= optimum + 1e-9
    if more.schedule is not None:
        assert simulate(g, more.schedule).peak_bytes <= budget and more.extra_cost >= optimum - 1e-9
    # started from the incumbent's plan (a point of the model: HiGHS takes it), the same proof
    started = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first,
                               incumbent_schedule=first.schedule)
    assert optimum * (1 - 1e-4) <= started.bound <= optimum + 1e-9
    monkeypatch.setattr(peak_rows, "GENERATION_MAX_VARIABLES", 10)
    monkeypatch.setattr(peak_rows, "GENERATION_PLAN_MAX_VARIABLES", 10)
    capped = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first)
    assert "variables > 10" in capped.details["not_solved"] and not capped.details["solves"]


@pytest.mark.parametrize("n, seed, budget", [(8, 1, 63), (9, 0, 86), (9, 3, 99)])
def test_a_round_over_its_variable_limit_searches_a_plan_below_the_incumbent(n, seed, budget, monkeypatch):
    """Between GENERATION_MAX_VARIABLES and GENERATION_PLAN_MAX_VARIABLES the round's MILP is solved
    for a plan only (stopped at its first solution, with the incumbent as a cutoff). Under a cutoff far
    above every plan it gives one; under any cutoff (at the brute force's optimum, under the rows' own
    bound: HiGHS may then find nothing), what it gives fits and costs no less than that optimum, and
    its bound is no more."""
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(n, seed)
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    first = peak_rows_search(g, budget, mip_gap=1e-4)
    monkeypatch.setattr(peak_rows, "GENERATION_MAX_VARIABLES", 10)
    for incumbent in (10 * g.total_cost, optimum, first.bound / 2):
        res = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=incumbent, more_rows_from=first)
        (solve,) = res.details["solves"]
        assert solve["plan_only"] and solve["integral"]
        if incumbent > g.total_cost:
            assert res.schedule is not None
        if res.schedule is not None:
            assert simulate(g, res.schedule).peak_bytes <= budget and res.extra_cost >= optimum - 1e-9
        assert res.bound <= optimum + 1e-9


def test_a_milp_with_a_target_stops_at_its_first_solution_at_or_under_it():
    """HiGHS's objective target: with one above every solution the MILP stops at its first
    (status "limit", its dual bound still under its optimum); with one under the optimum it is
    solved in full, as without."""
    from remat.solver.checkmate.sparse_lp import SparseModel

    rng = random.Random(0)
    m = SparseModel()
    xs = [m.var(0, 1, cost=rng.randint(1, 20), integral=True) for _ in range(40)]
    for _ in range(60):  # a set cover
        m.row([(j, 1.0) for j in rng.sample(xs, 5)], lo=1)
    full = m.solve(integral=True, mip_gap=0)
    assert full.status == "optimal" and full.bound == pytest.approx(full.objective)
    first = m.solve(integral=True, mip_gap=0, target=1e9)
    assert first.status == "limit" and first.x is not None and first.bound < full.objective <= first.objective
    under = m.solve(integral=True, mip_gap=0, target=full.objective - 1)
    assert under.status == "optimal" and under.objective == pytest.approx(full.objective)


def test_a_milps_interrupt_checks_see_its_nodes_and_best_solution():
    """The interrupt checks hand over HiGHS's nodes so far and its best solution's objective: a
    MILP that branches, stopped once past its root node with a solution, returns that solution
    (no cheaper than the optimum) and a bound no higher, after fewer nodes than in full."""
    from remat.solver.checkmate.sparse_lp import SparseModel

    rng = random.Random(0)
    m = SparseModel()
    xs = [m.var(0, 3, cost=-rng.randint(1, 30), integral=True) for _ in range(30)]
    for _ in range(20):  # a multidimensional knapsack: HiGHS branches (34 nodes)
        w = [rng.randint(1, 20) for _ in xs]
        m.row([(x, float(a)) for x, a in zip(xs, w)], hi=sum(w) / 4)
    full = m.solve(integral=True, mip_gap=0)
    assert full.status == "optimal" and full.nodes > 1
    seen = []

    def past_root(check) -> bool:
        seen.append(check)
        return check.nodes >= 1 and check.primal_bound < float("inf")

    stopped = m.solve(integral=True, mip_gap=0, interrupt=past_root)
    assert stopped.status == "limit" and stopped.nodes < full.nodes
    assert stopped.bound <= full.objective + 1e-9 <= stopped.objective + 1e-9
    assert [c.checks for c in seen] == list(range(1, len(seen) + 1))
    assert all(c.dual_bound <= full.objective + 1e-9 for c in seen)
    found = [c.primal_bound for c in seen if c.primal_bound < float("inf")]
    assert found and found == sorted(found, reverse=True) and found[-1] >= full.objective - 1e-9


@pytest.mark.parametrize("make, share", [(lambda: training_chain(16, 3), 0.5), (lambda: random_dag(40, 0), 0.4)])
def test_a_round_stops_at_its_root_lp_where_its_solutions_are_far_under_the_best_plan(make, share, monkeypatch):
    """A round's MILP is handed a check that stops it once its root LP is solved (a finite dual
    bound) with a solution more than ROUND_HOPELESS_GAP under the best plan (the round's bound cannot
    then prove it), and runs GENERATION_MAX_NODE_VARIABLES over its variables nodes at most
    (AFTER_HOPELESS_MAX_NODES after a round so stopped). With an incumbent ten times the step's cost
    every solution is that far under: rounds stop so, at their roots. With no plan known yet there is
    no such check."""
    import remat.solver.checkmate.peak_rows as peak_rows
    from remat.solver.checkmate.sparse_lp import MipCheck, SparseModel

    g = make()
    keep = simulate(g, keep_all_schedule(g)).peak_bytes
    budget = int(g.resident_bytes + share * (keep - g.resident_bytes))
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    first = peak_rows_search(g, budget, mip_gap=1e-4)
    calls = []
    real_solve = SparseModel.solve

    def spy(self, **kw):
        calls.append((self.num_vars, kw.get("max_nodes"), kw.get("interrupt")))
        return real_solve(self, **kw)

    monkeypatch.setattr(SparseModel, "solve", spy)
    monkeypatch.setattr(peak_rows, "GENERATION_MAX_NODE_VARIABLES", 5000)
    monkeypatch.setattr(peak_rows, "AFTER_HOPELESS_MAX_NODES", 1)
    res = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=10 * g.total_cost, more_rows_from=first)
    solves = res.details["solves"]
    assert len(calls) == len(solves) and any(s.get("stopped") == peak_rows.HOPELESS for s in solves)
    assert all(s["nodes"] <= 1 for s in solves if s.get("stopped"))  # at its root
    for i, (variables, max_nodes, stop) in enumerate(calls):
        after_hopeless = any(s.get("stopped") == peak_rows.HOPELESS for s in solves[:i])
        assert max_nodes == (1 if after_hopeless else max(1, min(peak_rows.ROWS_MAX_NODES, 5000 // variables)))
        assert stop(MipCheck(3, 0.0, 0.0, 0))
        assert not stop(MipCheck(1, -math.inf, 0.0, 0))  # the root LP not solved yet
        assert not stop(MipCheck(2, 0.0, math.inf, 5))  # no solution yet
    calls.clear()
    peak_rows_search(g, budget, mip_gap=1e-4, more_rows_from=first)
    assert calls and calls[0][2] is None  # the first round's: no plan known yet


def test_a_rows_milps_node_limit_shrinks_with_its_variables(monkeypatch):
    """Each rows' MILP runs at most ROWS_MAX_NODES branch-and-bound nodes, and at most
    ROWS_MAX_NODE_VARIABLES over its variables (at least one): with that product set near these
    MILPs' sizes (21-40 variables), HiGHS is given limits of one and two nodes by that rule, and the
    bound stays a bound (within the brute force's optimum)."""
    import remat.solver.checkmate.peak_rows as peak_rows
    from remat.solver.checkmate.sparse_lp import SparseModel

    g, budget = training_chain(11, 6), 78
    best, _ = brute_force(g, budget)
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    limits = []
    real_solve = SparseModel.solve

    def spy(self, **kw):
        if kw.get("integral"):
            limits.append((self.num_vars, kw.get("max_nodes")))
        return real_solve(self, **kw)

    monkeypatch.setattr(SparseModel, "solve", spy)
    monkeypatch.setattr(peak_rows, "ROWS_MAX_NODE_VARIABLES", 50)
    got = peak_rows_search(g, budget, mip_gap=0.0)
    assert {m for _, m in limits} == {1, 2}
    assert all(m == max(1, min(peak_rows.ROWS_MAX_NODES, 50 // n)) for n, m in limits)
    assert got.bound <= best - g.total_cost + 1e-9


@pytest.mark.parametrize("n, seed, budget", [(10, 1, 70), (11, 6, 78)])
def test_a_round_stops_at_a_solution_under_the_bound_already_known(n, seed, budget, monkeypatch):
    """A round's MILP whose bound could not rise above the one already proven (`known_bound`) stops
    at its first solution at or under it: each round's MILP is given that bound (in its own units)
    as HiGHS's target; with a bound between the rows' own and the brute force's optimum as that
    bound (the optimum itself would leave no round to run), the bound the rounds report stays
    within the optimum and the plan fits, never cheaper than it."""
    import remat.solver.checkmate.peak_rows as peak_rows
    from remat.solver.checkmate.sparse_lp import SparseModel

    g = training_chain(n, seed)
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    first = peak_rows_search(g, budget, mip_gap=1e-4)
    targets = []
    real_solve = SparseModel.solve

    def spy(self, **kw):
        targets.append(kw.get("target"))
        return real_solve(self, **kw)

    monkeypatch.setattr(SparseModel, "solve", spy)
    known = (first.bound + optimum) / 2
    assert first.extra_cost - known > 1e-4 * first.extra_cost  # the rounds have a gap to close
    more = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first,
                            known_bound=known)
    assert targets and all(t is not None and t > 0 for t in targets)
    assert more.bound <= optimum + 1e-9
    if more.schedule is not None:
        assert simulate(g, more.schedule).peak_bytes <= budget and more.extra_cost >= optimum - 1e-9
    targets.clear()
    peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first)
    assert targets and targets[0] is None  # nothing known yet (0): the first round has no target


@pytest.mark.parametrize("n, seed, budget", [(10, 1, 70), (11, 6, 78)])
def test_the_rows_a_plan_misses_are_added_a_row_a_round_until_the_gap_is_within_the_goal(n, seed, budget,
                                                                                         monkeypatch):
    """One row a round: where the first round's MILP leaves a gap, the row its plan misses is added
    and the MILP solved again, until it proves the brute force's optimum; with a gap goal its first
    round is within (`rounds_gap`), it stops there."""
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(n, seed)
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    first = peak_rows_search(g, budget, mip_gap=1e-4)
    more = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first)
    rows = [s["rows"] for s in more.details["solves"]]
    assert len(rows) >= 2 and rows == list(range(len(first.together[0]) + 1, len(first.together[0]) + 1 + len(rows)))
    assert more.details["solves"][0]["bound"] < optimum * (1 - 1e-3)  # the first round alone does not prove it
    assert optimum * (1 - 1e-4) <= more.bound <= optimum + 1e-9
    assert more.extra_cost == pytest.approx(optimum) and simulate(g, more.schedule).peak_bytes <= budget
    goal = 1.01 * (1 - more.details["solves"][0]["bound"] / first.extra_cost)  # at least the first round's gap
    once = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first, rounds_gap=goal)
    assert [s["rows"] for s in once.details["solves"]] == rows[:1]
    assert once.extra_cost - once.bound <= goal * once.extra_cost
    # the rounds' work limit (simplex iterations; these chains' MILPs may take none): none left, no second round
    monkeypatch.setattr(peak_rows, "GENERATION_MAX_ITERATIONS", 0)
    capped = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first)
    assert [s["rows"] for s in capped.details["solves"]] == rows[:1] and "iterations" in capped.details["rounds_stopped"]
    # ... and the next round is taken as GENERATION_GROWTH times the last: a second round runs only
    # where the first round's iterations and that prediction stay under the limit
    spent = more.details["solves"][0]["iterations"]
    predicted = spent + peak_rows.GENERATION_GROWTH * spent
    for limit, second in ((predicted, False), (predicted + 1, True)):
        monkeypatch.setattr(peak_rows, "GENERATION_MAX_ITERATIONS", limit)
        got = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first)
        got_rows = [s["rows"] for s in got.details["solves"]]
        assert got_rows[:2] == rows[:2] if second else got_rows == rows[:1]
    # a caller's own limit (certify's on the largest relaxations) holds instead of GENERATION_MAX_ITERATIONS
    for limit, second in ((predicted + 1, False), (predicted, True)):
        monkeypatch.setattr(peak_rows, "GENERATION_MAX_ITERATIONS", limit)
        got = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first,
                               rounds_max_iterations=2 * predicted + 1 - limit)
        got_rows = [s["rows"] for s in got.details["solves"]]
        assert got_rows[:2] == rows[:2] if second else got_rows == rows[:1]


@pytest.mark.parametrize("n, seed, budget", [(10, 1, 70), (11, 6, 78)])
def test_no_round_runs_where_the_bound_known_from_before_already_meets_the_gap_goal(n, seed, budget, monkeypatch):
    """The rounds stop once the gap is within `rounds_gap`, counting the bound proven before them
    (`known_bound`: the certified search's) and not only their own: with the brute force's optimum
    as that bound and a goal the incumbent's gap to it meets, no round runs; with none known, they do."""
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(n, seed)
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    first = peak_rows_search(g, budget, mip_gap=1e-4)
    goal = 1.01 * (first.extra_cost - optimum) / first.extra_cost + 1e-6
    assert first.extra_cost - first.bound > goal * first.extra_cost  # the rows alone leave more than the goal
    rounds = dict(incumbent=first.extra_cost, more_rows_from=first, rounds_gap=goal, mip_gap=1e-4)
    assert peak_rows_search(g, budget, **rounds).details["solves"]
    assert peak_rows_search(g, budget, known_bound=optimum, **rounds).details["solves"] == []


def test_no_further_round_runs_where_the_last_rounds_plan_refined_meets_the_gap_goal(monkeypatch):
    """Before each round after the first, the best plan so far is refined and the gap checked
    again: where refining makes it meet `rounds_gap`, no further round runs. On a chain whose first
    round's plan costs more than the optimum, from an incumbent as dear: refinement stood in by one
    that changes nothing, a second round runs; by one that answers the brute force's optimal
    schedule (it fits and costs no more), it does not, and that plan is the answer."""
    import remat.solver.checkmate.peak_rows as peak_rows

    g, budget = training_chain(11, 6), 78
    best, optimal = brute_force(g, budget)
    optimum = best - g.total_cost
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    first = peak_rows_search(g, budget, mip_gap=1e-4)
    real = peak_rows_search(g, budget, incumbent=first.extra_cost, more_rows_from=first, mip_gap=1e-4)
    round_one = real.details["solves"][0]
    dear, bound = round_one["plan_extra_cost"], round_one["bound"]
    goal = 1.01 * (optimum - bound) / optimum + 1e-6
    assert dear - bound > goal * dear  # the first round's plan as fitted leaves more than the goal
    rounds = dict(incumbent=dear, more_rows_from=first, mip_gap=1e-4, rounds_gap=goal)

    def solved(refine) -> list[int]:
        monkeypatch.setattr(peak_rows, "drop_recomputations", refine)
        got = peak_rows_search(g, budget, **rounds)
        assert got.bound <= optimum + 1e-9 and simulate(g, got.schedule).peak_bytes <= budget
        return [s["rows"] for s in got.details["solves"]], got.extra_cost

    unchanged, _ = solved(lambda graph, sched, b: list(sched))
    assert len(unchanged) >= 2
    once, cost = solved(lambda graph, sched, b: list(optimal))
    assert once == unchanged[:1] and cost == pytest.approx(optimum)


@pytest.mark.parametrize("n, seed, budget", [(10, 1, 70), (11, 6, 78)])
def test_a_graph_too_large_for_the_relaxation_goes_on_with_the_rows_a_plan_misses(n, seed, budget, monkeypatch):
    """Over RELAXATION_MAX_NODES there is no certified search; where the rows leave a gap over
    MORE_ROWS_GAP, the rows their plan misses are added there too: a bound no lower than the rows'
    first one and within the brute force's optimum, and a plan that fits, never cheaper than it."""
    import remat.solver.checkmate.certify as certify
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(n, seed)
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    monkeypatch.setattr(certify, "RELAXATION_MAX_NODES", 5)
    first = peak_rows_search(g, budget, mip_gap=1e-4)
    plan = checkmate.solve(g, budget, milp="never")
    d = plan.details
    assert "certify" not in d and "nodes > 5" in d["certify_skipped"]
    assert d["peak_rows"]["more_rows"]["solves"] and d["bound_source"].endswith("with the rows their plans miss")
    assert first.bound < plan.lower_bound <= optimum + 1e-9
    assert simulate(g, plan.schedule).peak_bytes <= budget and plan.extra_cost >= optimum - 1e-9


@pytest.mark.parametrize("n, seed, budget", [(10, 1, 70), (11, 6, 78)])
def test_the_rounds_run_before_the_certified_search_where_their_first_is_predicted_cheap(n, seed, budget,
                                                                                       monkeypatch):
    """On a relaxation over MIP_MAX_VARIABLES, where the rounds' first MILP is predicted within
    ROUNDS_FIRST_MAX_ITERATIONS they run before the certified search, and where they prove the plan
    within SKIP_SEARCH_GAP the search does not run; where they leave more, it runs after them (and
    they do not run again); where the first is predicted dearer, or the relaxation is small, the
    search runs first, as before. Each way the bound is within the brute force's optimum and the
    plan fits."""
    import remat.solver.checkmate.certify as certify
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(n, seed)
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    first = peak_rows_search(g, budget, mip_gap=1e-4)
    together = [s for s in first.details["solves"] if s["integral"] and s["rows"] > 1][-1]
    assert first.together[2] == together["iterations"]  # the MILP the rounds go on from
    predicted = peak_rows.GENERATION_GROWTH * together["iterations"]

    def solved(first_limit: int, gap: float, large: bool = True):
        monkeypatch.setattr(certify, "ROUNDS_FIRST_MAX_ITERATIONS", first_limit)
        monkeypatch.setattr(certify, "SKIP_SEARCH_GAP", gap)
        monkeypatch.setattr(certify, "MIP_MAX_VARIABLES", 0 if large else 10**9)
        plan = checkmate.solve(g, budget, milp="never")
        assert first.bound <= plan.lower_bound <= optimum + 1e-9 and plan.extra_cost >= optimum - 1e-9
        assert simulate(g, plan.schedule).peak_bytes <= budget
        return plan.details

    def rounds_of(d):  # what each round solved (not its seconds)
        return [(x["rows"], x["variables"], x["iterations"], x.get("bound")) for x in d["peak_rows"]["more_rows"]["solves"]]

    d = solved(predicted, 1.0)  # first, and within any gap: no certified search
    assert "certify" not in d and "rows' rounds prove the plan within" in d["certify_skipped"]
    rounds = rounds_of(d)
    assert rounds and d["bound_source"].endswith("with the rows their plans miss")
    d = solved(predicted, -1.0)  # first, and never within the gap: the search runs after them, they do not again
    assert "certify" in d and rounds_of(d) == rounds
    d = solved(predicted - 1, 1.0)  # predicted dearer: the search first, whatever the gap
    assert "certify" in d and "rows' rounds prove" not in str(d.get("certify_skipped"))
    d = solved(predicted, 1.0, large=False)  # a small relaxation: the search first, whatever the gap
    assert "certify" in d and "rows' rounds prove" not in str(d.get("certify_skipped"))


@pytest.mark.parametrize("n, seed, budget", [(10, 1, 70), (11, 6, 78)])
def test_on_the_largest_relaxations_the_rounds_go_further_and_their_proof_within_the_rounds_gap_spares_the_search(
        n, seed, budget, monkeypatch):
    """On a relaxation of HUGE_SKIP_MIN_VARIABLES or more (lowered here) the rounds that run first
    get HUGE_ROUNDS_MAX_ITERATIONS, and where they prove the plan within MORE_ROWS_GAP (their own
    goal; SKIP_SEARCH_GAP never met here) the certified search does not run (mT5 at half its
    activation memory); on a smaller relaxation it runs, the rounds under GENERATION_MAX_ITERATIONS."""
    import remat.solver.checkmate.certify as certify
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(n, seed)
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 2)
    monkeypatch.setattr(certify, "MIP_MAX_VARIABLES", 0)
    monkeypatch.setattr(certify, "ROUNDS_FIRST_MAX_ITERATIONS", 10**9)
    monkeypatch.setattr(certify, "SKIP_SEARCH_GAP", -1.0)
    monkeypatch.setattr(certify, "HUGE_SKIP_GAP", -1.0)  # (the rows alone never spare it)
    monkeypatch.setattr(certify, "MORE_ROWS_GAP", 1e-3)  # the first round alone does not prove it within this
    limits = []
    real = certify.peak_rows_search
    monkeypatch.setattr(certify, "peak_rows_search", lambda *a, **k: limits.append(k.get("rounds_max_iterations"))
                        or real(*a, **k))

    def solved(huge: bool):
        monkeypatch.setattr(certify, "HUGE_SKIP_MIN_VARIABLES", 0 if huge else 10**9)
        limits.clear()
        plan = checkmate.solve(g, budget, milp="never")
        assert plan.lower_bound <= optimum + 1e-9 and plan.extra_cost >= optimum - 1e-9
        assert simulate(g, plan.schedule).peak_bytes <= budget
        return plan.details

    d = solved(True)
    assert limits[-1] == certify.HUGE_ROUNDS_MAX_ITERATIONS and d["peak_rows"]["more_rows"]["solves"]
    assert "certify" not in d and "rows' rounds prove the plan within 0%" in d["certify_skipped"]
    d = solved(False)
    assert None in limits and certify.HUGE_ROUNDS_MAX_ITERATIONS not in limits
    assert "certify" in d and d["peak_rows"]["more_rows"]["solves"]


def test_the_rows_search_goes_on_while_it_has_no_plan(monkeypatch):
    """With no incumbent and a first MILP whose plan cannot be made to fit, the search is not done
    (an infinite best minus any bound is no gap within mip_gap): it goes on to the next rows'
    MILPs and ends with a plan that fits (LongT5 at half its activation memory stopped there with no
    plan of its own: 15.8% extra from equal spacing, 7.9% since)."""
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(10, 1)
    budget = 70
    calls = []
    real_fit = peak_rows.fit

    def first_fails(graph, drops, b, **kw):
        calls.append(1)  # the first MILP's plan, by both prices of a drop (peak_rows._fitted)
        return None if len(calls) <= 2 else real_fit(graph, drops, b, **kw)

    monkeypatch.setattr(peak_rows, "fit", first_fails)
    res = peak_rows_search(g, budget, mip_gap=1e-4)
    assert len(calls) >= 3 and sum(s["integral"] for s in res.details["solves"]) >= 2
    assert res.schedule is not None and simulate(g, res.schedule).peak_bytes <= budget


def test_the_runs_of_smallest_bound_are_left_out_over_the_variable_limit(monkeypatch):
    """The MILP of a row per run together is built with at most MULTI_MAX_VARIABLES variables: over
    it, runs are left out (those of smallest LP bound) until it fits, here down to one run, so no
    such MILP is solved (a bidirectional GRU's 12 runs: 49k variables, its root LP over 120 s), and
    details say so; the bound stays a bound."""
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(8, 8)
    budget = 69
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    full = peak_rows_search(g, budget, mip_gap=1e-4)
    together = [s for s in full.details["solves"] if s["rows"] > 1]
    assert len(together) == 1 and "runs_left_out" not in full.details
    size = together[0]["variables"]
    monkeypatch.setattr(peak_rows, "MULTI_MAX_VARIABLES", size - 1)
    capped = peak_rows_search(g, budget, mip_gap=1e-4)
    assert not [s for s in capped.details["solves"] if s["rows"] > 1]
    assert capped.details["runs_left_out"] == f"2 runs: {size} variables > {size - 1}: none solved together"
    assert capped.bound < full.bound and capped.bound <= optimum + 1e-9


@pytest.mark.parametrize("n, seed, budget", [(8, 8, 69), (9, 2, 86), (10, 1, 86)])
def test_where_no_rows_are_solved_together_the_rounds_go_on_from_the_single_rows_milp(n, seed, budget, monkeypatch):
    """Where no MILP of several rows is built (one run of over-budget steps: here MULTI_MAX_ROWS 1),
    the rounds go on from the single row's MILP of largest bound (Jamba at half its activation
    memory, one run of 686 steps: gap 11.2% -> 0.01%): the rows its plan misses are added, and the
    rounds prove the brute force's optimum where single rows cannot."""
    import remat.solver.checkmate.peak_rows as peak_rows

    g = training_chain(n, seed)
    best, _ = brute_force(g, budget)
    optimum = best - g.total_cost
    monkeypatch.setattr(peak_rows, "MULTI_MAX_ROWS", 1)
    first = peak_rows_search(g, budget, mip_gap=1e-4)
    assert first.bound < optimum * (1 - 1e-3)
    milps = [s for s in first.details["solves"] if s["integral"]]
    assert milps and all(s["rows"] == 1 for s in milps)
    seed_milp = max((s for s in milps if "plan_extra_cost" in s), key=lambda s: s["bound"])
    assert first.together is not None and len(first.together[0]) == 1
    assert first.together[2] == seed_milp["iterations"]
    more = peak_rows_search(g, budget, mip_gap=1e-4, incumbent=first.extra_cost, more_rows_from=first)
    assert more.details["solves"] and more.details["solves"][0]["rows"] == 2
    assert optimum * (1 - 1e-4) <= more.bound <= optimum + 1e-9
    if more.schedule is not None:
        assert simulate(g, more.schedule).peak_bytes <= budget and more.extra_cost >= optimum - 1e-9


def test_chain_cost_counts_the_values_a_recomputation_needs_that_are_not_live():
    from remat.solver.checkmate.guided import chain_cost

    f = [Node("x", "op", (), out_bytes=4, cost=1.0, is_random=True),
         Node("m", "op", ("x",), out_bytes=4, cost=100.0),
         Node("p", "op", ("m",), out_bytes=40, cost=4.0),
         Node("s", "op", ("p", "m"), out_bytes=4, cost=2.0)]
    g = TrainingGraph(nodes=tuple(f + [Node("ds", "bwd", ("s",), out_bytes=4, cost=1.0, is_backward=True)]),
                      resident_bytes=0, name="chain")
    assert chain_cost(g, 3, set()) == 106.0  # s, p and m (once, though both read it); never x (random)
    assert chain_cost(g, 3, {2}) == 102.0  # p held: s and m
    assert chain_cost(g, 3, {1, 2}) == 2.0
    assert chain_cost(g, 2, set()) == 104.0


def test_a_recurrence_is_made_to_fit_by_pricing_what_a_drop_recomputes():
    """A bidirectional GRU's training step (8 steps): made to fit half its activation memory from
    nothing by the cheapest drops per byte of their own cost, it does not fit (each step's gate
    pre-activation looks cheap, but computing it again needs the whole input projection and the
    matmul before it); priced with what they are computed from (`chains`), it does, and the rows'
    search has that plan to choose from (`_fitted`: the plans of both prices that fit)."""
    import torch

    import remat
    from remat.solver.checkmate import guided
    from remat.solver.checkmate.peak_rows import _fitted
    from remat.solver import keep_all

    class GRUNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.rnn = torch.nn.GRU(8, 8, batch_first=True, bidirectional=True)
            self.head = torch.nn.Linear(16, 16)

        def forward(self, ids):
            h, _ = self.rnn(self.emb(ids))
            return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())

    torch.manual_seed(0)
    ids = torch.randint(0, 16, (2, 8))
    g = remat.capture(GRUNet().train(), (ids,))
    keep = keep_all.solve(g).predicted_peak_bytes
    floor = g.resident_bytes + sum(v.kept_bytes for v in g.nodes)
    budget = int(floor + 0.5 * (keep - floor))
    empty = [set() for _ in g.nodes]
    assert guided.fit(g, empty, budget) is None
    chains = guided.fit(g, empty, budget, chains=True)
    assert chains is not None and simulate(g, chains).peak_bytes <= budget
    fitted = _fitted(g, empty, budget)
    assert list(fitted) == [True] and fitted[True][1] == chains


@pytest.mark.parametrize("seed", range(4))
def test_chains_are_priced_lazily_in_the_order_a_full_sort_gives(seed):
    """guided._by_chain_cost yields the candidates by chain cost per byte, as sorting them all by it
    would (ties aside), pricing a chain only when it may come next."""
    from remat.solver.checkmate import guided

    g = random_dag(40, seed)
    rng = random.Random(seed)
    live = {u for u in range(len(g.nodes)) if rng.random() < 0.4}
    own = [v.cost for v in g.nodes]
    cands = sorted((u for u in range(len(g.nodes)) if g.nodes[u].recomputable and g.nodes[u].out_bytes > 0),
                   key=lambda u: own[u] / g.nodes[u].out_bytes)
    price = {u: guided.chain_cost(g, u, live) / g.nodes[u].out_bytes for u in cands}
    lazy = list(guided._by_chain_cost(g, cands, live, own))
    assert sorted(lazy) == sorted(cands)
    assert [price[u] for u in lazy] == sorted(price.values())
    assert any(price[u] > own[u] / g.nodes[u].out_bytes for u in cands)  # the chains do change the order


@pytest.mark.parametrize("seed", range(4))
def test_a_kept_chain_price_is_the_price_searched_anew_while_the_live_values_change(seed):
    """guided._ChainPrices keeps each chain's price until a value its search looked at becomes live
    or stops being live (as a round of guided.fit goes through its schedule): at every step, every
    price it gives is chain_cost's on the live values of that step, and most are not searched again."""
    from remat.solver.checkmate import guided

    g = random_dag(60, seed)
    rng = random.Random(seed)
    live: set[int] = set()
    prices = guided._ChainPrices(g, live)
    searched = [0]
    real = guided.chain_cost

    def counted(*a, **k):
        searched[0] += 1
        return real(*a, **k)

    values = [u for u in range(len(g.nodes)) if g.nodes[u].recomputable and g.nodes[u].out_bytes > 0]
    asked = 0
    try:
        guided.chain_cost = counted
        for _ in range(80):
            for w in rng.sample(range(len(g.nodes)), 2):  # a step: one value computed, one freed
                prices.changed(w)
                (live.discard if w in live else live.add)(w)
            for u in rng.sample(values, 10):
                asked += 1
                assert prices(u) == real(g, u, live), (u, sorted(live))
    finally:
        guided.chain_cost = real
    assert searched[0] < asked / 2


@pytest.mark.parametrize("all_plans", [True, False])
def test_every_plan_made_to_fit_is_exchanged_and_refined_on_graphs_up_to_the_limit(all_plans, monkeypatch):
    """On graphs up to ALL_PLANS_MAX_NODES every distinct plan the rows' MILPs gave, made to fit, is
    improved by the exchange search and refined, and the search ends with the cheapest of them (the
    cheapest before is not always the cheapest after: mT5); above it, only the cheapest plan of each
    price is refined, without the exchange search."""
    import remat.solver.checkmate.peak_rows as peak_rows
    from remat.solver.checkmate.exchange import evaluations
    from remat.solver.checkmate.guided import schedule_from_live

    g = training_chain(12, 2)
    budget = 85
    if not all_plans:
        monkeypatch.setattr(peak_rows, "ALL_PLANS_MAX_NODES", len(g.nodes) - 1)
    fitted, exchanged, refined = {}, [], []
    real_fitted, real_exchange, real_refine = peak_rows._fitted, peak_rows.exchange, peak_rows.drop_recomputations

    def spy_fitted(graph, drops, b):
        out = real_fitted(graph, drops, b)
        for chains, (cost, sched, fit_drops) in out.items():
            fitted.setdefault(tuple(sched), (cost, fit_drops, set()))[2].add(chains)
        return out

    def spy_exchange(*a, **kw):
        exchanged.append(1)
        return real_exchange(*a, **kw)

    def spy_refine(graph, sched, b):
        refined.append(tuple(sched))
        return real_refine(graph, sched, b)

    monkeypatch.setattr(peak_rows, "_fitted", spy_fitted)
    monkeypatch.setattr(peak_rows, "exchange", spy_exchange)
    monkeypatch.setattr(peak_rows, "drop_recomputations", spy_refine)
    res = peak_rows_search(g, budget, mip_gap=1e-4)
    assert len(fitted) >= 3 and res.schedule is not None and simulate(g, res.schedule).peak_bytes <= budget
    limit = max(1, evaluations(g) // peak_rows.PLAN_EXCHANGE_SHARE)
    if all_plans:
        assert len(exchanged) == len(refined) == len(fitted)
        costs = []
        for cost, fit_drops, _ in fitted.values():
            _, sched = real_exchange(g, fit_drops, budget, lambda d: schedule_from_live(g, d), max_evaluations=limit)
            costs.append(simulate(g, real_refine(g, sched, budget)).extra_cost)
        assert res.extra_cost == min(costs + [c for c, _, _ in fitted.values()])
    else:
        cheapest = {min((k for k, v in fitted.items() if price in v[2]), key=lambda k: fitted[k][0])
                    for price in (False, True) if any(price in v[2] for v in fitted.values())}
        assert not exchanged and set(refined) == cheapest
