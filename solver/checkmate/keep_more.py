"""Local improvement of a plan read off the relaxation: keep a dropped value when that is cheaper.

A plan read off an LP solution (solver/checkmate/guided.py) drops some values the LP kept only in part; the
schedule then recomputes them, and with them every dropped value they are computed from, right
before each read. Dropping a cheap value (a residual add) can so cost an expensive recomputation
(the matmul it adds). `keep_more` tries, most expensive recomputation chain first, to keep each
dropped value instead (never drop it), and keeps the change when the schedule still fits the
budget and costs less. The simulator judges every trial; the number of trials is bounded.
"""
from __future__ import annotations

from remat.core.training_graph import TrainingGraph
from remat.core.simulator import simulate
from remat.solver.checkmate.exchange import keep_dropped

__all__ = ["keep_more"]


def keep_more(graph: TrainingGraph, drops: list[set[int]], budget: int, build, refit, max_trials: int = 60):
    """(drops, schedule) after the improvements: `build(drops) -> schedule` makes a schedule
    from drops (guided.schedule_from_live with the caller's options) and `refit(drops) ->
    (drops, schedule) or None` one that fits, dropping more where it does not (guided.fit); the
    given drops' schedule must fit. Keeping a value may need others dropped instead (the
    cheapest per byte, where the peak is over): that swap is kept when it costs less. A value is
    tried once; the trials stop after `max_trials`."""

    def repair(trial: list[set[int]], _kept: int):
        s = build(trial)
        sim = simulate(graph, s)
        if sim.peak_bytes > budget:
            fitted = refit(trial)
            if fitted is None:
                return None
            trial, s = fitted
            sim = simulate(graph, s)
        return (trial, s, sim) if sim.peak_bytes <= budget else None

    trials = [max_trials]

    def go_on() -> bool:
        trials[0] -= 1
        return trials[0] >= 0

    drops = [set(d) for d in drops]
    sched = build(drops)
    return keep_dropped(graph, drops, sched, simulate(graph, sched), repair, go_on)
