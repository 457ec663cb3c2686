"""The exchange search (solver/checkmate/exchange.py): keep a dropped value, repair the memory with
the drops the simulator prices lowest."""
import pytest

from remat.core.simulator import simulate
from remat.solver import equal_spacing
from remat.solver.checkmate import exchange as exchange_module
from remat.solver.checkmate.exchange import exchange
from remat.solver.checkmate.guided import best_guided, exchanged_plan, fit, schedule_from_live
from remat.solver.checkmate.relaxation import Relaxation
from remat.solver.schedule import keep_all_schedule
from tests.conftest import random_dag, transformer_like

CASES = [("transformer", s, f) for s in range(3) for f in (0.2, 0.5)] + [("dag", s, f) for s in range(4) for f in (0.2, 0.5)]


def _start(kind: str, seed: int, frac: float):
    g = transformer_like(3, seed=seed) if kind == "transformer" else random_dag(40, seed=seed)
    full = simulate(g, keep_all_schedule(g)).peak_bytes
    low = equal_spacing.solve(g, 0).predicted_peak_bytes
    budget = int(low + frac * (full - low))
    drops, _ = fit(g, [set() for _ in g.nodes], budget, with_drops=True)
    return g, budget, drops


def _build(g):
    return lambda d: schedule_from_live(g, d)


@pytest.mark.parametrize("kind,seed,frac", CASES)
def test_exchange_fits_and_beats_the_greedy_repair(kind, seed, frac):
    """The plan it returns is its drops' schedule, runs, fits, and costs less than the plan of the
    cheapest-per-byte fit it starts from."""
    g, budget, drops = _start(kind, seed, frac)
    start = simulate(g, schedule_from_live(g, drops))
    assert start.peak_bytes <= budget
    new_drops, sched = exchange(g, drops, budget, _build(g))
    assert sched == schedule_from_live(g, new_drops)
    sim = simulate(g, sched)  # raises if it could not run
    assert sim.peak_bytes <= budget
    assert sim.extra_cost < start.extra_cost


def test_exchange_stops_at_its_evaluation_limit_and_refuses_a_start_over_budget(monkeypatch):
    g, budget, drops = _start("transformer", 0, 0.2)
    calls = []
    real = exchange_module.simulate
    monkeypatch.setattr(exchange_module, "simulate", lambda *a: calls.append(1) or real(*a))
    _, sched = exchange(g, drops, budget, _build(g), max_evaluations=1)  # the start's schedule only
    assert len(calls) == 1 and sched == schedule_from_live(g, drops)
    calls.clear()
    exchange(g, drops, budget, _build(g), max_evaluations=40)
    assert len(calls) <= 40
    with pytest.raises(ValueError):
        exchange(g, [set() for _ in g.nodes], budget, _build(g))  # keeping everything peaks over it


def test_a_read_asked_to_improve_offers_the_exchanged_plan():
    """best_guided asked to improve (the certified search's last reads) offers exchanged_plan: the
    first threshold's plan made to fit, improved by the exchange search and refined, no dearer
    than that plan made to fit alone; its plan is no dearer than the exchanged one."""
    g, budget, _ = _start("transformer", 1, 0.2)
    rel = Relaxation(g, budget)
    x = rel.model.solve().x
    sched, record = best_guided(g, rel, x, budget, search=True, improve=True)
    exchanged = exchanged_plan(g, rel, x, budget)
    assert simulate(g, exchanged).peak_bytes <= budget
    assert record["exchanged"] == simulate(g, exchanged).extra_cost <= record["0.9"]
    assert simulate(g, sched).extra_cost <= record["exchanged"] + 1e-9
    assert simulate(g, sched).peak_bytes <= budget
    _, plain = best_guided(g, rel, x, budget, search=True)
    assert "exchanged" not in plain
