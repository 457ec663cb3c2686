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

import numpy as np

from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.exchange import exchange
from remat.solver.checkmate.keep_more import keep_more
from remat.solver.refine import drop_recomputations, prune_unread
from remat.solver.checkmate.relaxation import SAFETY, Relaxation
from remat.solver.checkmate.sparse_lp import HotLP, Solution
from remat.core.simulator import simulate

__all__ = ["schedule_from_live", "drops_at", "recomputations_at", "threshold_search", "fit", "exchanged_plan", "best_guided", "lowest_peak_search", "BudgetProbe", "THRESHOLDS", "REFINED",
           "PROBE_MAX_VARIABLES", "PEAK_RESOLUTION", "COLD_MAX_ITERATIONS"]

THRESHOLDS = (0.9, 0.5)
# lowest_peak_search probes budgets only on relaxations up to this many variables: the first
# probe (the cost relaxation's LP at a budget, from nothing) takes 2-3 s at 36k variables
# (Qwen2-small), over two minutes at 180k (T5, 748 nodes: 130k simplex iterations at ~1 ms each)
PROBE_MAX_VARIABLES = 100_000
# lowest_peak_search stops once the best peak found (by a probe) is within this share of the
# highest budget at which no plan was found: Gemma-3 (840 nodes) went on to probe budgets 100 bytes
# apart on a 12 MB peak, 8 of its 15 probes after its best peak was within 0.1% (84 -> 50 s)
PEAK_RESOLUTION = 1e-3
# a work limit on the last probe's LP read again from nothing (`_cold_at`: a cheaper plan at the
# same peak, where there is one), in simplex iterations. At the smallest budgets of the 75 models of
# benchmarks/certificates.py it ran on 26, and gave the plan kept on three, in 10k-23k iterations
# (ALBERT, ResNet-50, DistilBERT); the three over this limit gave none and took the longest:
# Gemma-3 32k (6 s), DeepSeek-V3 40k (5 s), Mamba2 52k (24 s of its 98)
COLD_MAX_ITERATIONS = 30_000
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
    valid = [False] * len(nodes)
    again = [False] * len(nodes)  # computed again in the backward
    sched: list[str] = []
    backward = [False]

    def ensure(u: int) -> None:
        stack = [(u, False)]
        while stack:
            w, ready = stack.pop()
            if valid[w]:
                continue
            if ready:
                sched.append(nodes[w].name)
                valid[w] = True
                again[w] = backward[0]
                continue
            stack.append((w, True))
            stack.extend((i, False) for i in inputs[w] if not valid[i])

    for t, v in enumerate(nodes):
        backward[0] = sticky and v.is_backward
        for u in (before[t] if before else ()):
            if u < t:
                valid[u] = False  # a new instance, computed here as the relaxation does
                ensure(u)
        for i in inputs[t]:
            if not valid[i]:
                ensure(i)
        sched.append(v.name)
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
    from remat.core.simulator import last_reads

    nodes, idx = graph.nodes, graph.index
    inputs = [set(ins) for ins in graph.input_indices]
    own = [v.cost for v in nodes]
    recomputable = graph.recomputable_flags
    drops = [set(d) for d in drops]
    for _ in range(max_rounds):
        sched = schedule_from_live(graph, drops, prune=False, before=before, sticky=sticky)
        sim = simulate(graph, sched)
        if sim.peak_bytes <= budget:
            sched = prune_unread(graph, sched)
            return (drops, sched) if with_drops else sched
        frees = last_reads(graph, sched)
        live: set[int] = set()
        row, grew = -1, False
        chosen: dict[int, int] = {}  # row -> bytes already dropped there this round
        for s, name in enumerate(sched):
            v = idx[name]
            row = max(row, v)
            excess = sim.timeline[s] - budget - chosen.get(row, 0)
            if excess > 0:
                busy = inputs[v] | {v}
                cands = sorted((u for u in live if recomputable[u] and u not in drops[row] and u not in busy
                                and nodes[u].out_bytes > 0), key=lambda u: own[u] / nodes[u].out_bytes)
                if chains:
                    cands = _by_chain_cost(graph, cands, live, own)
                for u in cands:  # the cheapest per byte, until their bytes cover the excess
                    drops[row].add(u)
                    chosen[row] = chosen.get(row, 0) + nodes[u].out_bytes
                    excess -= nodes[u].out_bytes
                    grew = True
                    if excess <= 0:
                        break
            live.add(v)
            for f, _ in frees[s]:
                live.discard(idx[f])
        if not grew:
            return None
    return None


def _by_chain_cost(graph: TrainingGraph, cands: list[int], live: set[int], own: list[float]):
    """`cands` (in order of own cost per byte) in order of chain_cost per byte, each chain priced
    only when it may come next: a chain costs at least its value's own cost, so one is due once
    the cheapest chain priced costs less per byte than the next value's own cost."""
    nodes = graph.nodes
    heap: list[tuple[float, int]] = []
    i = 0
    while i < len(cands) or heap:
        while i < len(cands) and (not heap or own[cands[i]] / nodes[cands[i]].out_bytes < heap[0][0]):
            u = cands[i]
            heapq.heappush(heap, (chain_cost(graph, u, live) / nodes[u].out_bytes, u))
            i += 1
        yield heapq.heappop(heap)[1]


CHAIN_MAX_NODES = 64  # values one chain_cost visits, at most (a work limit: a recurrence's chain is its whole past)


def chain_cost(graph: TrainingGraph, u: int, live: set[int]) -> float:
    """What computing value u again costs where the values in `live` are held: its cost and that
    of every value it is computed from that is neither live nor kept (recomputable), each once,
    visiting at most CHAIN_MAX_NODES values."""
    nodes, inputs, recomputable = graph.nodes, graph.input_indices, graph.recomputable_flags
    seen, stack, total = {u}, [u], 0.0
    while stack and len(seen) <= CHAIN_MAX_NODES:
        w = stack.pop()
        total += nodes[w].cost
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


class BudgetProbe:
    """The cost relaxation's LP at budgets up to `top`, as lowest_peak_search probes them: one
    relaxation built once, at `top` (its structure does not depend on the budget), moved to each
    probe's budget (Relaxation.set_budget) and solved from the last probe's basis (HotLP) instead
    of built and solved from nothing each time. `rel` is the relaxation at the last budget solved."""

    def __init__(self, graph: TrainingGraph, top: int):
        self.rel = Relaxation(graph, top)
        self.lp = HotLP(self.rel.model)
        self.rows = [r for r, _, _ in self.rel.budget_rows]
        self.cols = self.rel.budget_columns

    def solve(self, budget: int) -> Solution | None:
        """The LP at `budget`; None where some row's fixed bytes alone are over it (nothing fits)."""
        self.rel.set_budget(budget)
        if self.rel.infeasible_at is not None:
            return None
        return self.lp.solve(self.rows, self.cols)


def lowest_peak_search(graph: TrainingGraph, probes: int | None = None, floor: int = 0,
                       fitted: list | None = None) -> tuple[list[str], int]:
    """A low-peak schedule, and a proven lower bound on every schedule's peak (bytes).

    Start: the schedule read off the relaxation of the smallest peak (Relaxation with budget None:
    recomputation free), whose optimum is the first bound (or `floor`, a bound known, where that
    is higher). Then bisect between the bound and the best peak found: a probe budget is first
    tried with `fit` on that schedule's drops, then with the cost relaxation at that budget (its
    plans, `best_guided`; one BudgetProbe for all probes, each LP hot-started from the last);
    when that relaxation's LP is infeasible no schedule fits the probe budget, and the bound
    rises to it; once a probe's plan fitted, the bisection stops where the best peak is within
    PEAK_RESOLUTION of that bound or of the last probe that found no plan. The last probe whose
    plan fitted is also solved from nothing (`_cold_at`, within COLD_MAX_ITERATIONS). probes: how
    many budgets are probed (None: 16, and none on relaxations over PROBE_MAX_VARIABLES). fitted:
    where given, every probe's plan that fitted is appended to it (cheaper at higher peaks)."""
    rel = Relaxation(graph, None)
    sol = rel.model.solve()
    if sol.x is None:
        return [v.name for v in graph.nodes], floor
    bound = max(floor, int(sol.bound * rel.mem_scale * (1 - SAFETY)) - 1)
    best, best_peak, best_drops = None, None, None
    for th in (0.9, 0.5):
        drops = drops_at(rel, sol.x, th)
        sched = schedule_from_live(graph, drops)
        peak = simulate(graph, sched).peak_bytes
        if best_peak is None or peak < best_peak:
            best, best_peak, best_drops = sched, peak, drops
    if probes is None:
        probes = 0 if rel.model.num_vars > PROBE_MAX_VARIABLES else 16
    lo, probe, last = bound, None, None  # last: the last probe whose plan fitted, and its LP
    for _ in range(probes):
        # within the resolution only once a probe's plan fitted: a probe's plan prices recomputation
        # (and is read again in full, _cold_at); the first schedule, read off the smallest peak's
        # relaxation, does not (RoBERTa's lowest-peak plan, stopped before any fitted: 65.5% -> 92.0%)
        if best_peak - lo <= (1 if last is None else max(1, PEAK_RESOLUTION * best_peak)):
            break
        mid = (lo + best_peak) // 2
        sched, lp = fit(graph, best_drops, mid, max_rounds=30), None
        if sched is None:
            probe = probe or BudgetProbe(graph, best_peak)
            lp = probe.solve(mid)
            if lp is None or lp.status == "infeasible":
                lo = bound = mid + 1  # proven: nothing fits `mid`
                continue
            # a probe asks whether anything fits `mid`: the thresholds' plans first, the threshold
            # searches (most of a probe's time) only where none of those fits; the plan of the
            # last probe is read in full again below (_cold_at)
            found = None
            for search in (False, True) if lp.x is not None else ():
                found = best_guided(graph, probe.rel, lp.x, mid, search=search)
                if found is not None:
                    break
            sched = found[0] if found else None
        if sched is None:
            lo = mid
        else:
            best, best_peak, last = sched, simulate(graph, sched).peak_bytes, (mid, lp)
            if fitted is not None:
                fitted.append(sched)
    if last is not None and last[1] is not None:
        best = _cold_at(graph, best, best_peak, last[0])
    return best, bound


def _cold_at(graph: TrainingGraph, best: list[str], peak: int, budget: int) -> list[str]:
    """`best` (read off the hot-started LP at `budget`), or the plan read off the same LP solved
    from nothing, where that one is cheaper and peaks no higher: a hot start can end at another
    optimum of the same LP, whose plans differ (ResNet-50's at its smallest budget cost 1.3% more).
    `best` where that LP takes more than COLD_MAX_ITERATIONS simplex iterations."""
    rel = Relaxation(graph, budget)
    lp = rel.model.solve(max_iterations=COLD_MAX_ITERATIONS) if rel.infeasible_at is None else None
    found = best_guided(graph, rel, lp.x, budget) if lp is not None and lp.x is not None else None
    if found is None:
        return best
    sim, old = simulate(graph, found[0]), simulate(graph, best)
    return found[0] if sim.peak_bytes <= peak and sim.extra_cost < old.extra_cost else best

