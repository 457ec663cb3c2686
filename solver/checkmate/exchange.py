"""Local search on a plan read off the relaxation: keep a value the plan drops, and pay for its
memory with the drops the simulator prices lowest.

A plan here is in the form the relaxation's plans are read in (solver/checkmate/guided.py: the
values dropped after each row, each recomputed right before its next read). Dropping a cheap value
(a residual add) can cost an expensive recomputation (the matmul or convolution it is computed
from), so one move keeps a dropped value everywhere (never drops it); where the schedule then goes
over the budget, the repair drops one more value at the first step over it, then the next, up to
ROUNDS. Which value: of the CANDIDATES live values cheapest per byte there, the one whose drop the
simulator prices lowest. Cost per byte alone (`guided.fit`'s greedy) misses what a drop really
costs: the values a recomputation reads may have to be recomputed too, and a value dropped in the
forward may be read there again. A move is kept when the repaired plan costs less. Values are
tried most expensive recomputation chain first, each once; the search stops after EVALUATIONS
simulated schedules, fewer on graphs over EVALUATED_NODES / EVALUATIONS nodes (a deterministic
limit: a schedule costs time with its length).

On ResNet-50 at half its activation memory (benchmarks/certificates.py), plans read off the
certified search's LP solutions and made to fit by `guided.fit` cost 4.4-6.8% extra; after this
search 3.6-4.1%, and the solver's plan 3.565% where it was 3.738% with the greedy repair alone.
"""
from __future__ import annotations

from remat.core.simulator import SimResult, last_read_nodes, simulate
from remat.core.training_graph import TrainingGraph

__all__ = ["exchange", "keep_dropped", "chain_costs", "evaluations", "EVALUATIONS", "EVALUATED_NODES", "CANDIDATES", "ROUNDS"]

EVALUATIONS = 300  # schedules simulated, at most, in one search (on ResNet-50, 460 nodes: 0.5 s)
EVALUATED_NODES = 150_000  # ... and at most this many nodes' worth of schedules (RegNet, 945 nodes: 158)
CANDIDATES = 12  # values the repair prices at a step over the budget: the cheapest per byte there
ROUNDS = 6  # values the repair of one move may drop


def chain_costs(graph: TrainingGraph, sched: list[str]) -> dict[int, float]:
    """Per recomputed value: its recomputations' cost plus that of the recomputed values it
    reads in the same run of recomputations (what keeping it would save at most)."""
    idx, nodes = graph.index, graph.nodes
    seen: set[int] = set()
    out: dict[int, float] = {}
    burst: dict[int, float] = {}  # recomputed in the current run -> its chain cost
    for name in sched:
        v = idx[name]
        if v not in seen:
            seen.add(v)
            burst = {}
            continue
        c = nodes[v].cost + sum(burst.get(idx[i], 0.0) for i in nodes[v].inputs)
        burst[v] = c
        out[v] = out.get(v, 0.0) + c
    return out


def evaluations(graph: TrainingGraph) -> int:
    """The search's limit on `graph`: EVALUATIONS, fewer on large graphs (EVALUATED_NODES)."""
    return max(1, min(EVALUATIONS, EVALUATED_NODES // max(len(graph.nodes), 1)))


def keep_dropped(graph: TrainingGraph, drops: list[set[int]], sched: list[str], sim: SimResult, repair,
                 go_on) -> tuple[list[set[int]], list[str]]:
    """(drops, schedule) after keeping dropped values one at a time, the most expensive
    recomputation chain first, each once, while go_on() says so: repair(drops without u, u) ->
    (drops, schedule, sim) that fits the budget, or None; a move is kept when it costs less than
    the plan so far (sched, its simulation sim). The loop of `exchange` and of keep_more.py."""
    tried: set[int] = set()
    while go_on():
        dropped = {u for d in drops for u in d}
        cands = [(c, u) for u, c in chain_costs(graph, sched).items() if u in dropped and u not in tried]
        if not cands:
            break
        _, u = max(cands)
        tried.add(u)
        found = repair([d - {u} for d in drops], u)
        if found is not None and found[2].extra_cost < sim.extra_cost - 1e-12:
            drops, sched, sim = found
    return drops, sched


def exchange(graph: TrainingGraph, drops: list[set[int]], budget: int, build,
             max_evaluations: int | None = None) -> tuple[list[set[int]], list[str]]:
    """(drops, schedule) after the search (see the module docstring). build(drops) -> schedule
    makes the plan of drops (guided.schedule_from_live); the given drops' plan must fit `budget`.
    max_evaluations: schedules simulated, at most (None: evaluations(graph))."""
    search = _Search(graph, budget, evaluations(graph) if max_evaluations is None else max_evaluations, build)
    drops = [set(d) for d in drops]
    sched, sim = search.evaluate(drops)
    if sim.peak_bytes > budget:
        raise ValueError("exchange starts from a plan that fits the budget")
    return keep_dropped(graph, drops, sched, sim, search.repair, lambda: search.left > 0)


class _Search:
    """The plans of drops, counted against the search's limit, and the repair of a move."""

    def __init__(self, graph: TrainingGraph, budget: int, max_evaluations: int, build):
        self.graph, self.budget, self.left, self.build = graph, budget, max_evaluations, build
        self.inputs = [set(ins) for ins in graph.input_indices]

    def evaluate(self, drops: list[set[int]]) -> tuple[list[str], SimResult]:
        self.left -= 1
        sched = self.build(drops)
        return sched, simulate(self.graph, sched)

    def repair(self, drops: list[set[int]], kept: int):
        """(drops, schedule, sim) of `drops` made to fit by up to ROUNDS more drops (never of
        `kept`), or None."""
        nodes, idx, budget = self.graph.nodes, self.graph.index, self.budget
        recomputable = self.graph.recomputable_flags
        for _ in range(ROUNDS + 1):
            if self.left <= 0:
                return None
            sched, sim = self.evaluate(drops)
            if sim.peak_bytes <= budget:
                return drops, sched, sim
            over = next(s for s, m in enumerate(sim.timeline) if m > budget)
            row, live = self._live_at(sched, over)
            v = idx[sched[over]]
            busy = self.inputs[v] | {v, kept}
            cands = sorted((w for w in live if recomputable[w] and w not in busy and w not in drops[row]
                            and nodes[w].out_bytes > 0), key=lambda w: (nodes[w].cost / nodes[w].out_bytes, w))
            excess = sim.timeline[over] - budget
            best = None
            for w in cands[:CANDIDATES]:
                if self.left <= 0:
                    break
                trial = [set(d) for d in drops]
                trial[row].add(w)
                _, tsim = self.evaluate(trial)
                if tsim.peak_bytes <= budget:
                    key = (0, tsim.extra_cost)
                else:  # the cost it adds per byte of the excess it removes at that step (by index:
                    # the schedules agree up to the first recomputation the drop adds)
                    fell = sim.timeline[over] - (tsim.timeline[over] if over < len(tsim.timeline) else budget)
                    if fell <= 0:
                        continue
                    key = (1, (tsim.extra_cost - sim.extra_cost) / min(fell, excess))
                if best is None or key < best[0]:
                    best = (key, trial)
            if best is None:
                return None
            drops = best[1]
        return None

    def _live_at(self, sched: list[str], step: int) -> tuple[int, set[int]]:
        """The row of `step` (the last first computation at or before it) and the values live
        when it runs (computed, not yet freed)."""
        idx = self.graph.index
        frees = last_read_nodes(self.graph, sched)
        live: set[int] = set()
        row = -1
        for s in range(step):
            v = idx[sched[s]]
            row = max(row, v)
            live.add(v)
            for u in frees[s]:  # (one by one: a set's bulk removal may resize it, which reorders ties)
                live.discard(u)
        return max(row, idx[sched[step]]), live
