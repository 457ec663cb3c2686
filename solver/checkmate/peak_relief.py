"""Lower a schedule's peak by local moves: recompute a value after the peak instead of holding it
across it.

The relaxation's low-peak schedules drop values only where its LP solution says so, and `fit`
only drops whole values after a row of the graph; neither tries the move that often lowers the
peak of a transformer's backward: at the peak step, a value that is live but not read there (the
attention's softmax output, held over the attention dropout's backward) is instead computed again
right before its next read, with those of its own inputs that are no longer live at that point
(the scores, the masked scores) recomputed first. Each round tries that move for the largest values
live at the peak, simulates each result exactly, and takes the one that lowers
(peak, steps at the peak) the most; identical layers each reach the same peak, so the second key
lets the search lower them one at a time. The simulator judges every move: the result is always a
valid schedule whose peak is at most the input's.
"""
from __future__ import annotations

import time

from remat.core.training_graph import TrainingGraph
from remat.solver.refine import prune_unread
from remat.core.simulator import ScheduleError, SimResult, simulate

__all__ = ["relieve_peak", "CANDIDATES", "MAX_ROUNDS"]

CANDIDATES = 12  # values tried per round: the largest live at the peak
MAX_ROUNDS = 200


def _score(sim: SimResult) -> tuple[int, int, float]:
    return sim.peak_bytes, sum(1 for m in sim.timeline if m == sim.peak_bytes), sim.extra_cost


def _instances(graph: TrainingGraph, sched: list[str]):
    """For each step: the step that computed the instance each input read comes from; and for each
    computing step, the steps that read its instance."""
    latest: dict[str, int] = {}
    reads: dict[int, list[int]] = {}
    source: list[dict[str, int]] = []
    for s, name in enumerate(sched):
        src = {i: latest[i] for i in graph.node(name).inputs}
        for c in src.values():
            reads.setdefault(c, []).append(s)
        source.append(src)
        latest[name] = s
        reads.setdefault(s, [])
    return source, reads


def _move(graph: TrainingGraph, sched: list[str], reads: dict[int, list[int]], c: int, p: int) -> list[str] | None:
    """`sched` with the instance computed at step c no longer held across step p: computed again
    right before its first read after p, with its inputs that are not live there recomputed first
    (recursively, where they may be); None when the move is not possible."""
    later = [r for r in reads[c] if r > p]
    if not later:
        return None
    q = later[0]
    latest: dict[str, int] = {}
    for s in range(q):
        latest[sched[s]] = s
    pre: list[str] = []
    fresh: set[str] = set()

    def ensure(name: str) -> bool:
        v = graph.node(name)
        for i in v.inputs:
            if i in fresh:
                continue
            ci = latest.get(i)
            if ci is not None and max(reads[ci], default=ci) >= q:
                continue  # live at q anyway
            if graph.node(i).recomputable and len(pre) < 64:
                if not ensure(i):
                    return False
            # else: its instance lives on to q (a longer life, judged by the simulator)
        pre.append(name)
        fresh.add(name)
        return True

    if not ensure(sched[c]):
        return None
    return prune_unread(graph, sched[:q] + pre + sched[q:])


def relieve_peak(graph: TrainingGraph, schedule: list[str], *, max_rounds: int = MAX_ROUNDS,
                 deadline: float | None = None) -> list[str]:
    """`schedule`, or one with a lower peak (or as high, at fewer steps) found by moving values
    held across the peak to a recomputation after it. Stops when a round improves nothing, after
    `max_rounds`, or at `deadline` (time.perf_counter())."""
    best = list(schedule)
    best_sim = simulate(graph, best)
    score = _score(best_sim)
    for _ in range(max_rounds):
        if deadline is not None and time.perf_counter() > deadline:
            break
        p = best_sim.peak_step
        if p < 0:
            break
        source, reads = _instances(graph, best)
        read_here = set(source[p].values())
        live = [c for c, rs in reads.items()
                if c < p and c not in read_here and rs and rs[-1] > p
                and graph.node(best[c]).recomputable]
        live.sort(key=lambda c: -graph.node(best[c]).out_bytes)
        found = None
        for c in live[:CANDIDATES]:
            cand = _move(graph, best, reads, c, p)
            if cand is None:
                continue
            try:
                sim = simulate(graph, cand)
            except ScheduleError:
                continue
            s = _score(sim)
            if s[:2] < score[:2] and (found is None or s < found[0]):
                found = (s, cand, sim)
        if found is None:
            break
        score, best, best_sim = found
    return best
