"""Plans read off the relaxation's solution (solver/checkmate/relaxation.py), then made to fit and refined.

The relaxation says, at each row where it models a value, whether the value is live after that
row. `schedule_from_live` turns that into a schedule: the graph's nodes in order, a value dropped
after every row where the relaxation keeps it live below a threshold, and any input that is not
live recomputed (recursively) right before the step that reads it. LP solutions are fractional, so
several thresholds give several plans. `fit` drops more values where the simulated peak is over
the budget (the cheapest per byte first), the exchange search (solver/checkmate/exchange.py)
improves one of them where the certified search asks (`exchanged_plan`), and `best_guided`
refines the cheapest plans (solver/refine.py) and keeps the best.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.exchange import exchange
from remat.solver.checkmate.keep_more import keep_more
from remat.solver.refine import drop_recomputations, prune_unread
from remat.solver.checkmate.relaxation import Relaxation
from remat.core.simulator import simulate

__all__ = ["schedule_from_live", "drops_at", "recomputations_at", "threshold_search", "fit", "exchanged_plan", "best_guided",
           "THRESHOLDS", "REFINED"]

THRESHOLDS = (0.9, 0.5)
REFINED = 2  # candidate schedules of one LP solution that best_guided refines: the cheapest


def schedule_from_live(graph: TrainingGraph, drops: list[set[int]], prune: bool = True,
                       before: list[list[int]] | None = None, sticky: bool = False) -> list[str]:
    """The schedule that computes the nodes in order, forgets after row t every value in
    drops[t] (index of a recomputable node), recomputes before row t the values in before[t]
    (if given), and recomputes a forgotten input right before the step that reads it (its own
    forgotten inputs first); unread instances pruned if `prune`. sticky: a value computed again
    in the backward is not forgotten again (it lives to its last read: recomputing it once per
    read would cost more than the memory it holds where memory is plentiful)."""
    nodes = graph.nodes
    inputs = graph.input_indices
    names = [v.name for v in nodes]
    valid = [False] * len(nodes)
    again = [False] * len(nodes)  # computed again in the backward
    sched: list[str] = []
    backward = False

    is_valid = valid.__getitem__

    def ensure(u: int) -> None:
        # (a node whose inputs are all valid, the common case, without the stack)
        if not valid[u] and all(map(is_valid, inputs[u])):
            sched.append(names[u])
            valid[u] = True
            again[u] = backward
            return
        stack = [(u, False)]
        while stack:
            w, ready = stack.pop()
            if valid[w]:
                continue
            if ready:
                sched.append(names[w])
                valid[w] = True
                again[w] = backward
                continue
            stack.append((w, True))
            stack.extend([(i, False) for i in inputs[w] if not valid[i]])

    for t, v in enumerate(nodes):
        backward = sticky and v.is_backward
        if before:
            for u in before[t]:
                if u < t:
                    valid[u] = False  # a new instance, computed here as the relaxation does
                    ensure(u)
        for i in inputs[t]:
            if not valid[i]:
                ensure(i)
        sched.append(names[t])
        valid[t] = True
        for u in drops[t]:
            if not again[u]:
                valid[u] = False
    return prune_unread(graph, sched) if prune else sched


def recomputations_at(rel: Relaxation, x: np.ndarray, threshold: float) -> list[list[int]]:
    """before[t]: the values the relaxation computes again in an interval that ends at row t
    (above `threshold`), in graph order; one that ends at a sitting state: at the start of its
    rows (its values are live over them)."""
    before: list[set[int]] = [set() for _ in range(rel.n)]
    for (u, b), col in rel.computed.items():
        if b >= 0 and x[col] > threshold:
            row = b if b < rel.n else rel.sitting_spans[b - rel.n][1]
            before[row].add(u)
    return [sorted(s) for s in before]


def drops_at(rel: Relaxation, x: np.ndarray, threshold: float) -> list[set[int]]:
    """drops[t]: the recomputable values the relaxation keeps live after row t below `threshold`
    and computes again later above 1 - threshold (a value is dropped when any of its parts is)."""
    drops: list[set[int]] = [set() for _ in range(rel.n)]
    for (u, k, t), col in rel.live.items():
        if not rel.recomputable[u] or x[col] >= threshold:
            continue
        row = t if t < rel.n else rel.sitting_spans[t - rel.n][1] - 1  # a sitting state: from its start
        c = rel.again.get((u, t))  # needed later, not live: computed again (a forward row need not keep
        # what only the backward reads, so without C it stays); read by no first computation: gone
        if c is not None and x[c] > 1 - threshold or rel.last_read[u][k] <= row:
            drops[row].add(u)
    return drops


def threshold_search(graph: TrainingGraph, rel: Relaxation, x: np.ndarray, budget: int, with_r: bool,
                     steps: int = 12, sticky: bool = False, keep_trials: int = 60) -> list[str] | None:
    """The schedule of drops_at at the least threshold whose schedule fits `budget`, found by
    bisection (a lower threshold drops less: cheaper, more memory). Values the relaxation keeps
    equally (identical blocks keep the same fraction of the same tensor) are told apart by their
    recomputation cost per byte, so that the threshold passes through them one class at a time
    instead of dropping or keeping a tensor in every block at once."""
    g = graph.nodes
    density = sorted({g[u].cost / max(g[u].out_bytes, 1) for u in range(rel.n) if rel.recomputable[u]})
    rank = {d: i / max(len(density) - 1, 1) for i, d in enumerate(density)}
    entries = []
    for (u, k, t), col in rel.live.items():
        if not rel.recomputable[u]:
            continue
        row = t if t < rel.n else rel.sitting_spans[t - rel.n][1] - 1
        c = rel.again.get((u, t))
        score = float(x[col]) + 1e-3 * rank[g[u].cost / max(g[u].out_bytes, 1)]
        entries.append((score, u, row, None if c is None else float(x[c]), rel.last_read[u][k] <= row))

    def drops_for(th: float) -> tuple[list[set[int]], list[list[int]] | None]:
        drops: list[set[int]] = [set() for _ in range(rel.n)]
        for score, u, row, c, unread in entries:
            if score < th and (unread or c is not None and c > 1 - th):
                drops[row].add(u)
        return drops, (recomputations_at(rel, x, min(th, 0.5)) if with_r else None)

    best = None
    lo, hi = 0.0, 1.0 + 2e-3
    for _ in range(steps):
        mid = (lo + hi) / 2
        drops, before = drops_for(mid)
        sched = schedule_from_live(graph, drops, before=before, sticky=sticky)
        sim = simulate(graph, sched)
        if sim.peak_bytes <= budget:
            if best is None or sim.extra_cost < best[2]:
                best = (drops, before, sim.extra_cost)
            hi = mid
        else:
            lo = mid
    if best is None:
        return None
    drops, before, _ = best
    _, sched = keep_more(graph, drops, budget,
                         lambda d: schedule_from_live(graph, d, before=before, sticky=sticky),
                         lambda d: fit(graph, d, budget, max_rounds=20, before=before, sticky=sticky, with_drops=True),
                         max_trials=keep_trials)
    return sched


def fit(graph: TrainingGraph, drops: list[set[int]], budget: int, max_rounds: int = 60,
        before: list[list[int]] | None = None, sticky: bool = False, with_drops: bool = False,
        chains: bool = False):
    """Drop more values until the schedule fits `budget`. Each round simulates the schedule once
    and, at every step over the budget, forgets the live forward values with the least
    recomputation cost per byte, enough of them to cover that step's excess, after the last first
    computation before the step. None when nothing more can be dropped. chains: a value's
    recomputation cost counts the values it is computed from that are not live there either
    (`chain_cost`), not its own cost alone."""
    from remat.core.simulator import last_read_nodes

    nodes, idx = graph.nodes, graph.index
    inputs = [set(ins) for ins in graph.input_indices]
    own = [v.cost for v in nodes]
    # the values a round may drop, and their recomputation cost per byte (the order they go in)
    droppable = [r and v.out_bytes > 0 for r, v in zip(graph.recomputable_flags, nodes)]
    per_byte = [v.cost / v.out_bytes if v.out_bytes > 0 else 0.0 for v in nodes]
    drops = [set(d) for d in drops]
    for _ in range(max_rounds):
        sched = schedule_from_live(graph, drops, prune=False, before=before, sticky=sticky)
        sim = simulate(graph, sched)
        if sim.peak_bytes <= budget:
            sched = prune_unread(graph, sched)
            return (drops, sched) if with_drops else sched
        frees = last_read_nodes(graph, sched)
        live: set[int] = set()
        prices = _ChainPrices(graph, live) if chains else None
        row, grew = -1, False
        chosen: dict[int, int] = {}  # row -> bytes already dropped there this round
        for s, name in enumerate(sched):
            v = idx[name]
            row = max(row, v)
            excess = sim.timeline[s] - budget - chosen.get(row, 0)
            if excess > 0:
                busy = inputs[v] | {v}
                cands = sorted((u for u in live if droppable[u] and u not in drops[row] and u not in busy),
                               key=per_byte.__getitem__)
                if prices is not None:
                    cands = _by_chain_cost(graph, cands, live, own, prices)
                for u in cands:  # the cheapest per byte, until their bytes cover the excess
                    drops[row].add(u)
                    chosen[row] = chosen.get(row, 0) + nodes[u].out_bytes
                    excess -= nodes[u].out_bytes
                    grew = True
                    if excess <= 0:
                        break
            if prices is not None and v not in live:
                prices.changed(v)
            live.add(v)
            for u in frees[s]:  # (one by one: a set's bulk removal may resize it, which reorders ties)
                if prices is not None and u in live:
                    prices.changed(u)
                live.discard(u)
        if not grew:
            return None
    return None


class _ChainPrices:
    """chain_cost of values where the values in `live` (one set, changing as a round of `fit` goes
    through its schedule) are held, each price kept until a value its search examined changes
    whether it is live (`changed`). On a recurrence's unrolled graph every live value is priced at
    every step over the budget, and a step changes the live values by a few: a bidirectional GRU
    over 64 steps (4,119 nodes) priced 1.4M chains in one `fit` (6k kept so), and on RWKV's CPU path
    (20,542 nodes) pricing took 197 s of a 280 s solve (85 s kept so)."""

    def __init__(self, graph: TrainingGraph, live: set[int]):
        self.graph, self.live = graph, live
        self.prices: dict[int, float] = {}
        self.watchers: dict[int, list[int]] = {}  # value -> the values whose price examined it

    def __call__(self, u: int) -> float:
        price = self.prices.get(u)
        if price is None:
            examined: list[int] = []
            price = self.prices[u] = chain_cost(self.graph, u, self.live, examined)
            for w in examined:
                self.watchers.setdefault(w, []).append(u)
        return price

    def changed(self, w: int) -> None:
        """Value w is about to become live, or to stop being live: the prices that examined it go."""
        for u in self.watchers.pop(w, ()):
            self.prices.pop(u, None)


def _by_chain_cost(graph: TrainingGraph, cands: list[int], live: set[int], own: list[float],
                   price: Callable[[int], float] | None = None):
    """`cands` (in order of own cost per byte) in order of chain_cost per byte, each chain priced
    only when it may come next: a chain costs at least its value's own cost, so one is due once
    the cheapest chain priced costs less per byte than the next value's own cost. `price(u)`: u's
    chain_cost where `live` is held (a _ChainPrices; default: searched anew)."""
    nodes = graph.nodes
    if price is None:
        def price(u: int) -> float:
            return chain_cost(graph, u, live)
    heap: list[tuple[float, int]] = []
    i = 0
    while i < len(cands) or heap:
        while i < len(cands) and (not heap or own[cands[i]] / nodes[cands[i]].out_bytes < heap[0][0]):
            u = cands[i]
            heapq.heappush(heap, (price(u) / nodes[u].out_bytes, u))
            i += 1
        yield heapq.heappop(heap)[1]


CHAIN_MAX_NODES = 64  # values one chain_cost visits, at most (a work limit: a recurrence's chain is its whole past)


def chain_cost(graph: TrainingGraph, u: int, live: set[int], examined: list[int] | None = None) -> float:
    """What computing value u again costs where the values in `live` are held: its cost and that
    of every value it is computed from that is neither live nor kept (recomputable), each once,
    visiting at most CHAIN_MAX_NODES values. `examined`, where given, gets the values whose being
    live was looked at: the price holds while none of them changes that."""
    nodes, inputs, recomputable = graph.nodes, graph.input_indices, graph.recomputable_flags
    seen, stack, total = {u}, [u], 0.0
    while stack and len(seen) <= CHAIN_MAX_NODES:
        w = stack.pop()
        total += nodes[w].cost
        if examined is not None:
            examined.extend(inputs[w])
        for i in inputs[w]:
            if i not in seen and i not in live and recomputable[i]:
                seen.add(i)
                stack.append(i)
    return total


def exchanged_plan(graph: TrainingGraph, rel: Relaxation, x: np.ndarray, budget: int,
                   threshold: float = THRESHOLDS[0]) -> list[str] | None:
    """The plan of drops_at(x, threshold) made to fit (`fit`), improved by the exchange search
    (solver/checkmate/exchange.py) and refined; None where it cannot be made to fit. The exchange
    starts from the first threshold's plan: the lower thresholds', improved, were no better on the
    captured models of benchmarks/certificates.py, at 0.5-1.4 s each on 500-750 nodes."""
    got = fit(graph, drops_at(rel, x, threshold), budget, with_drops=True)
    if got is None:
        return None
    _, sched = exchange(graph, got[0], budget, lambda d: schedule_from_live(graph, d))
    return drop_recomputations(graph, sched, budget)


def best_guided(graph: TrainingGraph, rel: Relaxation, x: np.ndarray, budget: int,
                thresholds=THRESHOLDS, search: bool = True, improve: bool = False) -> tuple[list[str], dict] | None:
    """The cheapest refined plan over the thresholds (each made to fit first), with a record of
    what each gave before refining; None when none could be made to fit. search: also the
    schedules of threshold_search (the slower part: the caller asks for it on its first and last
    solutions). improve: also `exchanged_plan` (the caller asks for it on its last solutions).
    Only the REFINED cheapest distinct schedules are refined: refining is most of the time here
    (seven candidates per solution), and it seldom reorders them.
    """
    record, cands = {}, {}
    for with_r, sticky in ((True, False), (False, False), (False, True)) if search else ():
        sched = threshold_search(graph, rel, x, budget, with_r, sticky=sticky)
        if sched is not None:
            cost = record[f"bisect{'R' if with_r else ''}{'S' if sticky else ''}"] = simulate(graph, sched).extra_cost
            cands.setdefault(tuple(sched), cost)
    seen = set()
    for th, with_r in [(th, w) for th in thresholds for w in (True, False)]:
        drops = drops_at(rel, x, th)
        before = recomputations_at(rel, x, th) if with_r else None
        key = (tuple(frozenset(d) for d in drops), None if before is None else tuple(map(tuple, before)))
        if key in seen:
            continue
        seen.add(key)
        sched = fit(graph, drops, budget, before=before)
        label = f"{th}{'R' if with_r else ''}"
        record[label] = None if sched is None else simulate(graph, sched).extra_cost
        if sched is not None:
            cands.setdefault(tuple(sched), record[label])
    best = None
    for sched, _ in sorted(cands.items(), key=lambda kv: kv[1])[:REFINED]:
        sched = drop_recomputations(graph, list(sched), budget)
        cost = simulate(graph, sched).extra_cost
        if best is None or cost < best[1]:
            best = (sched, cost)
    sched = exchanged_plan(graph, rel, x, budget, thresholds[0]) if improve else None
    if sched is not None:  # refined already: compared after refining, as the others
        cost = record["exchanged"] = simulate(graph, sched).extra_cost
        if best is None or cost < best[1]:
            best = (sched, cost)
    if best is not None:
        record["refined"] = best[1]
    return (best[0], record) if best else None
