import random

from remat.solver import checkmate, equal_spacing
from remat.solver.refine import drop_recomputations, prune_unread
from remat.solver.schedule import keep_all_schedule
from remat.core.simulator import simulate
from tests.conftest import training_chain, transformer_like


def test_dropping_recomputations_keeps_schedules_valid_and_within_budget():
    g = transformer_like(3, seed=4)
    full = simulate(g, keep_all_schedule(g)).peak_bytes
    lowest = equal_spacing.solve(g, 0).predicted_peak_bytes
    for frac in (0.1, 0.5, 0.9):
        budget = int(lowest + (full - lowest) * frac)
        es = equal_spacing.solve(g, budget)
        assert es.fits
        refined = drop_recomputations(g, es.schedule, budget)
        sim = simulate(g, refined)  # raises if the schedule were invalid
        assert sim.peak_bytes <= budget
        assert sim.extra_cost <= es.extra_cost
    # with the keep_all peak as budget every recomputation goes
    es = equal_spacing.solve(g, lowest)
    assert simulate(g, drop_recomputations(g, es.schedule, full)).extra_cost == 0


def test_prune_removes_unread_recomputations_only():
    g = transformer_like(2, seed=1)
    sched = keep_all_schedule(g)
    rng = random.Random(0)
    fwd = [v.name for v in g.forward_nodes if v.recomputable]
    # recomputations after the last step: nothing reads them, so all of them go, and only them
    noisy = sched + [rng.choice(fwd) for _ in range(10)]
    simulate(g, noisy)
    assert prune_unread(g, noisy) == sched


def test_a_dead_first_instance_is_pruned_as_the_runtime_drops_it():
    """An instance nobody reads before the node's next instance is dead code at run time, the
    first one too (Checkmate's stages compute node t in stage t even when it is recomputed
    before any read); the plan must not count its cost."""
    g = training_chain(3, seed=1)
    plain = [n.name for n in g.nodes]
    dead_first = ["f1", "f1", *plain[1:]]  # f1 computed, then again before f2 reads it
    assert prune_unread(g, dead_first) == plain
    read_twice = ["f1", "f2", "f1", *plain[2:]]  # both instances read (f2, then b1): nothing to drop
    assert prune_unread(g, read_twice) == read_twice
    dead_last = [*plain[:-1], "f2", plain[-1]]  # f2 again after b2, its last reader: never read
    assert prune_unread(g, dead_last) == plain


def test_checkmate_plans_hold_no_unread_recomputation():
    """The plans that skip the fine refinement are pruned all the same: the min-peak MILP's plan
    (min_feasible_budget's, deployed as is) and an "infeasible" answer. The min-peak MILP does not
    price compute and leaves recomputations nobody reads, which the runtime drops: the plan's
    predicted cost and FLOPs must not count them."""
    g = transformer_like(1)
    _, low = checkmate.min_feasible_budget(g, coarsen_to=None, return_plan=True)
    assert low.schedule == prune_unread(g, low.schedule)
    assert low.extra_cost == simulate(g, prune_unread(g, low.schedule)).extra_cost
    below = checkmate.solve(g, low.predicted_peak_bytes - 1, coarsen_to=12)
    assert below.status == "infeasible" and below.schedule == prune_unread(g, below.schedule)
