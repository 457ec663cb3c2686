"""keep_all, schedule_from_kept and equal_spacing against hand numbers and invariants."""
import random

import pytest

from tests.conftest import random_dag, training_chain, transformer_like
from remat.core.training_graph import Node, TrainingGraph
from remat.solver import equal_spacing, keep_all
from remat.solver.schedule import keep_all_schedule, schedule_from_kept
from remat.core.simulator import simulate


def hand_chain():
    # f1 -> f2 -> b2 -> b1, with f1 -> b1 and f2 -> b2
    return TrainingGraph(nodes=(
        Node("f1", "op", (), 10), Node("f2", "op", ("f1",), 20),
        Node("b2", "op", ("f2",), 5, is_backward=True),
        Node("b1", "op", ("b2", "f1"), 3, kept_bytes=2, is_backward=True)), resident_bytes=100)


def test_keep_all_peak_by_hand():
    g = hand_chain()
    plan = keep_all.solve(g)
    # f1: 110; f2: 130 (f1 still needed by b1); b2: 135 -> f2 freed: 115; b1: 115+3+2 = 120
    assert simulate(g, plan.schedule).timeline == (110, 130, 135, 120)
    assert plan.predicted_peak_bytes == 135 and plan.extra_cost == 0 and plan.status == "heuristic"
    assert keep_all.solve(g, 134).status == "infeasible"


def test_schedule_from_kept_by_hand():
    g = hand_chain()
    # keeping only f2: the forward's f1 dies after f2, b1 recomputes it
    s = schedule_from_kept(g, ["f2"])
    assert s == ["f1", "f2", "b2", "f1", "b1"]
    r = simulate(g, s)
    # f1: 110; f2: 130 -> f1 freed: 120; b2: 125 -> f2 freed: 105; f1: 115; b1: 115+3+2 = 120
    assert r.timeline == (110, 130, 125, 115, 120) and r.extra_cost == 1.0


@pytest.mark.parametrize("seed", range(6))
def test_schedule_from_kept_is_valid(seed):
    rng = random.Random(seed)
    g = random_dag(14, seed) if seed % 2 else training_chain(8, seed, random_at=(3,))
    fwd = [n.name for n in g.forward_nodes]
    for _ in range(10):
        kept = rng.sample(fwd, rng.randint(0, len(fwd)))
        sched = schedule_from_kept(g, kept)
        r = simulate(g, sched)  # raises if invalid
        assert sched[:len(fwd)] == fwd  # the forward runs once, in order
        firsts = list(dict.fromkeys(sched))
        assert firsts == [n.name for n in g.nodes]
        for name in set(sched):  # only recomputable forward nodes repeat
            assert sched.count(name) == 1 or g.node(name).recomputable
        assert r.peak_bytes >= g.resident_bytes
    assert schedule_from_kept(g, fwd) == keep_all_schedule(g)


@pytest.mark.parametrize("g", [training_chain(12, 3), transformer_like(2)], ids=["chain", "transformer"])
def test_equal_spacing_fits_and_lowers_peak(g):
    full = simulate(g, keep_all_schedule(g)).peak_bytes
    lowest = equal_spacing.solve(g, 0)  # nothing fits: the lowest-peak k, flagged
    assert lowest.status == "infeasible" and lowest.predicted_peak_bytes < full
    budget = (lowest.predicted_peak_bytes + full) // 2
    plan = equal_spacing.solve(g, budget)
    assert plan.status == "heuristic" and plan.fits
    assert plan.predicted_peak_bytes <= budget < full
    assert simulate(g, plan.schedule).peak_bytes == plan.predicted_peak_bytes
    assert 1 <= plan.details["k"] <= plan.details["candidates"] + 1
