import random
from collections import Counter

from remat.solver import checkmate, equal_spacing
from remat.solver.refine import drop_recomputations, prune_unread
from remat.solver.schedule import keep_all_schedule
from remat.core.simulator import simulate, unread_steps
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


def _prune_round_by_round(g, schedule):
    """The definition prune_unread computes in one pass: remove the unread instances (while another
    instance of the node remains), then again on what is left, until nothing goes. Returns the
    schedule left and how many rounds removed something."""
    sched, rounds = list(schedule), 0
    while True:
        count, dead = Counter(sched), set()
        for s in unread_steps(g, sched):
            if count[sched[s]] > 1:
                dead.add(s)
                count[sched[s]] -= 1
        if not dead:
            return sched, rounds
        sched, rounds = [n for s, n in enumerate(sched) if s not in dead], rounds + 1


def test_prune_in_one_pass_is_the_round_by_round_removal():
    """Chains of recomputations nothing reads in the end (an instance read only by an unread one)
    go in rounds; the one-pass pruning removes exactly what the rounds remove."""
    rng = random.Random(3)
    several_rounds = 0
    for g in (transformer_like(3, seed=2), training_chain(8, seed=5)):
        base = keep_all_schedule(g)
        for _ in range(60):
            s = list(base)
            for _ in range(rng.randint(1, 40)):  # copies of nodes already computed, anywhere later
                pos = rng.randrange(1, len(s))
                s.insert(pos, rng.choice(s[:pos]))
            want, rounds = _prune_round_by_round(g, s)
            assert prune_unread(g, s) == want
            several_rounds += rounds > 1
    assert several_rounds > 10  # the case where the rounds matter was exercised
