"""Checkmate's MILP against an exact brute force, the baselines, and the coarsening guarantee.

Why the brute force is the right reference: `brute_force` (tests/conftest.py) searches every flat
schedule of the simulator's model. The MILP searches frontier-advancing schedules (stage t ends
with the first computation of node t, each stage computes a node at most once, in topological
order). On the training chains below the topological order is unique (f1..fn, bn..b1 form a
Hamiltonian path), so every schedule's first computations are in that order and split into the
MILP's stages; within a stage, recomputations are forward runs from a kept value, and we check
that the restriction to one computation per node per stage, in index order, loses nothing on
these graphs: the two optima must be EQUAL. The test asserts it on every (n, seed, budget); if the
spaces ever differed on a chain, the MILP's optimum could only be higher, and the test would show it.
"""
from __future__ import annotations

import random

import pytest

from remat.solver import checkmate, equal_spacing
from remat.solver.checkmate.coarsen import coarsen, expand_schedule
from remat.core.plan import Plan
from remat.solver.schedule import keep_all_schedule, schedule_from_kept
from remat.core.simulator import simulate
from tests.conftest import brute_force, random_dag, training_chain, transformer_like, random_schedule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def peak(g, s):
    return simulate(g, s).peak_bytes


def budgets(g):
    lo, _ = brute_force(g, None, objective="peak")
    hi = peak(g, keep_all_schedule(g))
    return lo, hi


def check_plan(g, plan: Plan, budget):
    assert plan.strategy == "checkmate"
    sim = simulate(g, plan.schedule)
    assert sim.peak_bytes == plan.predicted_peak_bytes  # the fine simulator's number
    assert plan.extra_cost == pytest.approx(sim.extra_cost)
    if plan.status in ("optimal", "feasible"):
        assert plan.predicted_peak_bytes <= budget
    for key in ("coarse_nodes", "variables", "constraints", "coarse_peak_bytes"):
        assert key in plan.details


# n = 2..12, a few seeds and budgets each (tightest, near-tightest, middle, keep-all)
CASES = [(n, seed, which) for n in range(2, 10) for seed in range(2)
         for which in ("min", "min+", "mid", "max")]
CASES += [(n, 7, which) for n in (10, 11, 12) for which in ("mid", "max")] + [(10, 8, "min")]
CASES += [(n, 3, which) for n in (6, 8) for which in ("min", "mid")]  # with random nodes


@pytest.mark.parametrize("n, seed, which", CASES)
def test_optimal_cost_equals_brute_force(n, seed, which):
    g = training_chain(n, seed, random_at=(2, n - 1) if seed == 3 else ())
    lo, hi = budgets(g)
    budget = {"min": lo, "min+": lo + 2, "mid": (lo + hi) // 2, "max": hi}[which]
    best, sched = brute_force(g, budget)
    assert best is not None and peak(g, sched) <= budget
    plan = checkmate.solve(g, budget, threads=1)
    check_plan(g, plan, budget)
    assert plan.status == "optimal"
    assert plan.total_cost == pytest.approx(best)
    assert plan.gap is not None and plan.gap <= 1e-4
    if which == "min":  # one byte less: nothing fits, and the MILP proves it
        assert brute_force(g, budget - 1)[0] is None
        assert checkmate.solve(g, budget - 1, threads=1).status == "infeasible"


@pytest.mark.parametrize("n, seed", [(3, 0), (5, 1), (7, 2), (9, 4)])
def test_min_feasible_budget_matches_brute_force(n, seed):
    g = training_chain(n, seed)
    lo, _ = budgets(g)
    mfb, plan = checkmate.min_feasible_budget(g, threads=1, return_plan=True)
    assert mfb == lo == plan.predicted_peak_bytes
    assert checkmate.solve(g, mfb, threads=1).status == "optimal"
    assert checkmate.solve(g, mfb - 1, threads=1).status == "infeasible"


def test_infeasible_budget_status():
    g = training_chain(5, 0)
    plan = checkmate.solve(g, g.resident_bytes, threads=1)  # below any step's memory
    assert plan.status == "infeasible" and plan.details["reason"] == "proven infeasible"
    assert plan.schedule  # the lowest-peak baseline, for information


@pytest.mark.parametrize("g, coarsen_to", [
    (random_dag(14, 1), None), (random_dag(30, 2), None), (training_chain(12, 5), None),
    (transformer_like(2), 40), (random_dag(40, 3), 30)], ids=lambda x: getattr(x, "name", str(x)))
def test_fits_and_never_worse_than_equal_spacing(g, coarsen_to):
    full = peak(g, keep_all_schedule(g))
    lowest = equal_spacing.solve(g, 0).predicted_peak_bytes
    for frac in (0.25, 0.6, 1.0):
        budget = int(lowest + (full - lowest) * frac)
        plan = checkmate.solve(g, budget, coarsen_to=coarsen_to, milp="always")  # the MILP's promise is tested
        check_plan(g, plan, budget)
        assert plan.status in ("optimal", "feasible"), plan.details
        es = equal_spacing.solve(g, budget)
        if es.fits:
            assert plan.extra_cost <= es.extra_cost + 1e-9
        # the MILP's plan, mapped back to the fine graph, peaks no higher than the coarse model
        # promised (the fine-level refinement then spends the slack, staying within the budget)
        assert plan.details["coarse_peak_bytes"] >= plan.details["milp_plan"]["peak_bytes"]
        assert plan.details["milp_peak_bytes"] >= plan.details["coarse_peak_bytes"]
        assert plan.extra_cost <= plan.details["milp_plan"]["extra_cost"] + 1e-9


def test_coarsening_guarantee(capsys):
    rng = random.Random(0)
    equal = total = 0
    graphs = [random_dag(n, s) for n, s in ((20, 0), (40, 1), (60, 2), (80, 3))]
    graphs += [transformer_like(2), training_chain(12, 1, random_at=(4,))]
    for g in graphs:
        for target in (len(g.nodes) // 2, len(g.nodes) // 4, 8):
            c = coarsen(g, target)
            assert len(c.nodes) <= max(target, 2)  # phases never mix: at least 2 runs
            assert [m for v in c.nodes for m in v.members] == [v.name for v in g.nodes]
            for v in c.nodes:
                fine = [g.node(m) for m in v.members]
                assert len({f.is_backward for f in fine}) == 1
                assert v.recomputable == all(f.recomputable for f in fine)
                assert v.cost == pytest.approx(sum(f.cost for f in fine))
            scheds = [random_schedule(c, rng, p) for p in (0.0, 0.2, 0.5) for _ in range(4)]
            cands = equal_spacing.checkpoint_candidates(c)
            scheds += [schedule_from_kept(c, cands[k - 1::k]) for k in (1, 2, 3)]
            for s in scheds:
                cs, fs = simulate(c, s), simulate(g, expand_schedule(c, s))
                assert fs.peak_bytes <= cs.peak_bytes
                assert fs.total_cost == pytest.approx(cs.total_cost)
                total += 1
                equal += fs.peak_bytes == cs.peak_bytes
    with capsys.disabled():
        print(f"\ncoarsening: fine peak == coarse peak in {equal}/{total} schedules")
    assert total > 100


def test_coarsening_guarantee_with_multi_output_nodes():
    """Captured graphs carry per-output lifetimes (out_parts); coarse nodes do not. The fine
    simulation of an expanded schedule must still peak no higher than the coarse one."""
    import torch

    import remat
    from tests.models import ConvNet

    torch.manual_seed(0)
    g = remat.capture(ConvNet(), (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))))
    assert any(len(v.out_parts) > 1 for v in g.nodes)
    rng = random.Random(1)
    for target in (len(g.nodes) // 2, 12):
        c = coarsen(g, target)
        for s in [random_schedule(c, rng, p) for p in (0.0, 0.3) for _ in range(3)]:
            cs, fs = simulate(c, s), simulate(g, expand_schedule(c, s))
            assert fs.peak_bytes <= cs.peak_bytes
            assert fs.total_cost == pytest.approx(cs.total_cost)


def test_coarsen_folds_views_and_keeps_targets():
    g = transformer_like(2)
    c = coarsen(g, 30)
    assert len(c.nodes) <= 30
    views = [v.name for v in g.nodes if v.op in ("view", "transpose")]
    owner = {m: v for v in c.nodes for m in v.members}
    assert all(len(owner[x].members) > 1 for x in views)  # no view stands alone
    same = coarsen(g, 10_000)  # no merge needed: one run per node, same simulation
    assert [v.members for v in same.nodes] == [(v.name,) for v in g.nodes]
    s = keep_all_schedule(g)
    assert simulate(same, s).timeline == simulate(g, s).timeline


def test_transformer_plan_details():
    g = transformer_like(3)
    full = peak(g, keep_all_schedule(g))
    # the coarse MILP's details; the certified search (its own tests: test_plan_details.py) would
    # add 9 s here and nothing this test reads
    plan = checkmate.solve(g, full // 2, coarsen_to=60, max_nodes=20, certify=False)
    check_plan(g, plan, full // 2)
    assert plan.status in ("optimal", "feasible")
    assert plan.details["coarse_nodes"] <= 60 and plan.details["fine_nodes"] == len(g.nodes)
    assert plan.details["baseline"]["warm_start"] is True
    assert plan.extra_cost <= plan.details["baseline"]["extra_cost"] + 1e-9
    if plan.status == "feasible":
        assert plan.gap is not None and plan.gap > 0
    assert Plan.from_json(plan.to_json()).schedule == plan.schedule


def test_under_auto_the_milp_runs_only_where_the_rows_do_not_prove_the_best_plan_first():
    """milp="auto" on a small coarse graph searches the rows over the budget first: where they prove
    the best plan found within mip_gap of every plan in the MILP's scope, the MILP does not run and
    the plan costs no more than the MILP's would (milp="always"); elsewhere it runs as before and
    the plan is the same. A chain at its smallest feasible budget (the rows prove nothing there)
    and at half its activation memory (they do); under every step's memory the rows prove that no
    plan fits, and the MILP does not run either."""
    g = training_chain(11, 2)
    low, full = checkmate.min_feasible_budget(g), peak(g, keep_all_schedule(g))
    seen = set()
    for budget in (low, (low + full) // 2):
        auto, always = checkmate.solve(g, budget), checkmate.solve(g, budget, milp="always")
        check_plan(g, auto, budget)
        skipped = "rows over the budget" in str(auto.details.get("milp"))
        seen.add(skipped)
        if skipped:
            assert "attempts" not in auto.details and auto.status == "optimal"
            assert auto.extra_cost <= always.extra_cost * (1 + 1e-4) + 1e-9
        else:
            assert auto.details["attempts"] and auto.schedule == always.schedule
    assert seen == {True, False}
    none = checkmate.solve(g, g.resident_bytes)
    assert none.status == "infeasible" and none.details["reason"] == "proven infeasible"
    assert "attempts" not in none.details and "no plan fits" in none.details["milp"]


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_each_backend_matches_brute_force(backend):
    from remat.solver.checkmate import backends

    if not backends.available(backend):
        pytest.skip(f"backend {backend!r} is not installed here")
    for n, seed in ((4, 0), (7, 1), (9, 2)):
        g = training_chain(n, seed)
        lo, hi = budgets(g)
        for budget in (lo, (lo + hi) // 2):
            a = checkmate.solve(g, budget, backend=backend, milp="always")
            assert a.details["backend"] == backend and a.details["attempts"][0]["backend"] == backend
            assert a.status == "optimal" and a.total_cost == pytest.approx(brute_force(g, budget)[0])
        assert checkmate.solve(g, lo - 1, backend=backend).status == "infeasible"
        assert checkmate.min_feasible_budget(g, backend=backend) == lo


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        checkmate.solve(training_chain(3, 0), 10_000, backend="gurobi")


@pytest.mark.parametrize("n, seed, which", [(4, 0, "min"), (6, 1, "mid"), (7, 2, "min+"), (8, 0, "max")])
def test_checkmate_milp_alone_is_the_brute_force_optimum_on_the_fine_graph(n, seed, which):
    # the coarse MILP as its own strategy (solver/checkmate/milp.py): on a chain of the fine graph
    # (coarsen_to=None) its optimum is exact, as the module docstring above argues
    from remat.solver import get_solver

    g = training_chain(n, seed)
    lo, hi = budgets(g)
    budget = {"min": lo, "min+": lo + 2, "mid": (lo + hi) // 2, "max": hi}[which]
    best, _ = brute_force(g, budget)
    plan = get_solver("checkmate_milp")(g, budget, coarsen_to=None)
    assert plan.strategy == "checkmate_milp" and plan.status == "optimal"
    assert plan.predicted_peak_bytes <= budget and plan.total_cost == pytest.approx(best)
    assert plan.details["milp_status"] == "optimal" and plan.details["coarse_nodes"] == len(g.nodes)
    # below every plan: the min-peak MILP's plan, marked infeasible, peaking at the brute force's lowest
    low = get_solver("checkmate_milp")(g, lo - 1, coarsen_to=None)
    assert low.status == "infeasible" and low.predicted_peak_bytes == lo


def test_the_milp_gate_is_stated_once():
    from remat.solver.checkmate.milp import MILP_MAX_COARSE_NODES, milp_gate

    assert milp_gate(MILP_MAX_COARSE_NODES, "auto") is None and milp_gate(3, "always") is None
    assert "milp='always'" in milp_gate(MILP_MAX_COARSE_NODES + 1, "auto")
    assert milp_gate(3, "never") is not None
    g = transformer_like(4)  # more coarse nodes than the gate lets through at coarsen_to=None
    assert len(g.nodes) > MILP_MAX_COARSE_NODES
    plan = checkmate.solve(g, int(0.7 * peak(g, keep_all_schedule(g))), coarsen_to=None)
    assert plan.details["milp"] == milp_gate(len(g.nodes), "auto") and "milp_status" not in plan.details


PULP_SCRIPT = """
import sys
from remat.solver import checkmate, get_solver
from remat.core.simulator import simulate
from remat.solver.schedule import keep_all_schedule
from tests.conftest import transformer_like, training_chain
g = transformer_like(4)
checkmate.solve(g, int(0.7 * simulate(g, keep_all_schedule(g)).peak_bytes), coarsen_to=None)
print("after checkmate", "pulp" in sys.modules)
c = training_chain(5, 0)
get_solver("checkmate_milp")(c, simulate(c, keep_all_schedule(c)).peak_bytes, coarsen_to=None)
print("after the MILP", "pulp" in sys.modules)
"""


def test_pulp_is_imported_only_where_the_milp_runs():
    # a fresh interpreter: nothing has imported PuLP yet
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", PULP_SCRIPT], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "after checkmate False" in out.stdout and "after the MILP True" in out.stdout, out.stdout
