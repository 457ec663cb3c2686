"""The row models: what any schedule must hold or recompute at a step where keeping everything
is over the budget (a row).

Keeping every value (the graph's order, nothing recomputed), memory at step t is the simulator's
timeline[t]. Take any schedule whose first computations follow the graph's order and that stays
within the budget, and look at the moment it first computes node t. Every output part live there
under keep-all and not read by t (an *item*) is read later by a node that comes after t, so the
schedule either holds that part at the moment or computes its node again after it; and every
computation after the moment needs the parts it reads, held at the moment or computed again after
it. The row model of t writes that down for the nodes before t, with h[p] = "part p is live at the
moment" and r[v] = "v is computed at least once after the moment":

    h[p] + r[u] >= 1                for each item part p of node u
    r[v] <= h[p] + r[i]             for each part p of input i that a computation of v reads
                                    (no r[i] when i may not be recomputed)
    fixed(t) + sum bytes(p) h[p] <= budget
    minimise sum cost(v) r[v]

fixed(t) is what every such schedule holds at that moment: resident memory and kept outputs, the
parts t reads and those that may not be recomputed, t's own allocation. Every schedule in scope is
a 0/1 point of the model at an objective no higher than its extra cost (each r[v] = 1 is at least
one recomputation of v; `point_of_schedule` builds that point, for the tests), so the model's LP
optimum, or its MILP's dual bound, is a lower bound on the extra cost of every schedule whose first
computations follow the graph's order. The model has a few variables per node before t, where the
relaxation of the whole step (solver/checkmate/relaxation.py) has some per node and step.

Several rows together (`rows_model`) share their nodes: between consecutive rows j and j + 1 a
node is computed again or not (s[j, v]), each row keeps its own constraints, and the objective
counts a computation in every interval, so one recomputation cannot pay for two rows that need it
at different times; a part live at a row was live at the one before or computed since (LeViT,
rows 724, 837, 840, 843: 1.124% -> 1.251%). solver/checkmate/peak_rows.py solves them.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from remat.core.simulator import last_reads, parts_read, simulate
from remat.core.training_graph import TrainingGraph
from remat.solver.schedule import keep_all_schedule
from remat.solver.checkmate.sparse_lp import SparseModel

__all__ = ["Row", "RowsModel", "keep_all_steps", "over_budget_rows", "part_readers", "rows_model", "point_of_schedule"]


@dataclass(frozen=True)
class Row:
    """Step `step` of keep-all, `excess` bytes over the budget; `live`: (node, part) -> bytes of
    every part live there; `items`: those a schedule may drop (recomputable, not read by the step).
    The others every schedule holds at that moment."""

    step: int
    excess: int
    live: dict
    items: frozenset

    @property
    def capacity(self) -> int:
        """The bytes the held parts may take: the items' bytes less the excess."""
        return sum(self.live[p] for p in self.items) - self.excess


def _part_bytes(v) -> list[int]:
    """The bytes of each output part of node v."""
    return [b for b, _ in v.out_parts] if v.out_parts else [v.out_bytes]


def keep_all_steps(graph: TrainingGraph):
    """Each step t of keep-all as (t, memory while it runs, the live parts as (node, part) ->
    bytes, the droppable ones among them). The live dict is the walk's own, changed after each
    step: copy what must outlive it."""
    order = keep_all_schedule(graph)
    timeline = simulate(graph, order).timeline
    nodes, idx = graph.nodes, graph.index
    frees = last_reads(graph, order)
    live: dict[tuple[int, int], int] = {}
    for t, v in enumerate(nodes):
        read = {(idx[i], k) for i in v.inputs for k in parts_read(graph.node(i), v.name)}
        items = [p for p, b in live.items() if b > 0 and p not in read and nodes[p[0]].recomputable]
        yield t, timeline[t], live, items
        for k, b in enumerate(_part_bytes(v)):
            live[t, k] = b
        for name, k in frees[t]:
            live.pop((idx[name], k), None)


def over_budget_rows(graph: TrainingGraph, budget: int, steps=None) -> list[Row]:
    """The steps of keep-all over `budget` (only those in `steps`, if given), each with the parts a
    schedule may drop there."""
    return [Row(t, mem - budget, dict(live), frozenset(items)) for t, mem, live, items in keep_all_steps(graph)
            if mem > budget and (steps is None or t in steps)]


@dataclass
class RowsModel:
    """The model of some rows (see the module docstring), `rows` in step order: `s[j, v]` is the
    column of "v is computed between row j and the next", `r[j, v]` of "v is computed after row
    j", `h[j, p]` of "part p is live at row j"; `cost_scale` turns the objective into cost units."""

    model: SparseModel
    rows: list
    s: dict
    r: dict
    h: dict
    cost_scale: float


def part_readers(graph: TrainingGraph) -> dict:
    """(node, part) -> the indices of the nodes that read it, in order."""
    idx = graph.index
    out: dict[tuple[int, int], list[int]] = {}
    for x, v in enumerate(graph.nodes):
        for name in v.inputs:
            for k in parts_read(graph.node(name), v.name):
                out.setdefault((idx[name], k), []).append(x)
    return out


def rows_model(graph: TrainingGraph, rows: list[Row], readers: dict | None = None) -> RowsModel:
    """The model of `rows` together (see the module docstring). Between consecutive rows j and
    j + 1 a node may be computed again (s[j, v]); r[j, v] = s[j, v] or r[j + 1, v] is "computed at
    least once after row j". Each row's constraints are its own model's with r[j, .] (so the
    bound is at least each row's alone), plus: a computation between rows j and j + 1 reads parts
    live at row j or computed since; an item whose next read comes before row j' is live at row j
    or computed between rows j and j'; the objective counts a computation in each interval."""
    nodes, idx = graph.nodes, graph.index
    readers = part_readers(graph) if readers is None else readers
    rows = sorted(rows, key=lambda w: w.step)
    steps = [w.step for w in rows]
    n_rows = len(rows)
    m = SparseModel()
    cost_scale = max(graph.total_cost, 1e-12) / 100  # the objective in percent of the step's cost
    r: dict[tuple[int, int], int] = {}
    s: dict[tuple[int, int], int] = {}
    h: dict[tuple[int, tuple[int, int]], int] = {}
    pending: list[tuple[int, int]] = []

    def r_of(j: int, v: int) -> int | None:
        if j == n_rows:
            return None  # never computed after the last row's interval ends: the step's end
        if (j, v) not in r:
            r[j, v] = m.var(integral=True)
            s[j, v] = m.var(cost=nodes[v].cost / cost_scale, integral=True)
            nxt = r_of(j + 1, v)
            # r[j, v] = s[j, v] or r[j + 1, v]
            m.row([(r[j, v], 1.0), (s[j, v], -1.0)] + ([(nxt, -1.0)] if nxt is not None else []), hi=0.0)
            m.row([(r[j, v], 1.0), (s[j, v], -1.0)], lo=0.0)
            if nxt is not None:
                m.row([(r[j, v], 1.0), (nxt, -1.0)], lo=0.0)
            pending.append((j, v))
        return r[j, v]

    def h_of(j: int, p: tuple[int, int]) -> int:
        if (j, p) not in h:
            h[j, p] = m.var(integral=True)
        return h[j, p]

    for j, w in enumerate(rows):
        for p in sorted(w.items):
            u = p[0]
            later = [x for x in readers.get(p, ()) if x > w.step]
            until = bisect.bisect_left(steps, later[0]) if later else n_rows  # rows before its next read
            r_of(j, u)  # (its s[j', u] for every later row j', too)
            # the instance its next read reads: live at row j, or computed between row j and that read
            m.row([(h_of(j, p), 1.0)] + [(s[jj, u], 1.0) for jj in range(j, max(until, j + 1))], lo=1.0)
            m.row([(h_of(j, p), 1.0), (r[j, u], 1.0)], lo=1.0)
    while pending:
        j, v = pending.pop()
        w = rows[j]
        for name in nodes[v].inputs:
            i = idx[name]
            rec = nodes[i].recomputable
            for k in parts_read(nodes[i], nodes[v].name):
                if (i, k) in w.live and (i, k) not in w.items:
                    continue  # held at row j by every schedule
                hp = h_of(j, (i, k))
                m.row([(r[j, v], 1.0), (hp, -1.0)] + ([(r_of(j, i), -1.0)] if rec else []), hi=0.0)
                m.row([(s[j, v], 1.0), (hp, -1.0)] + ([(s[j, i], -1.0)] if rec else []), hi=0.0)
    _keep_rows(m, rows, s, h)
    for j, w in enumerate(rows):
        scale = max(w.capacity, 1)
        held = [(col, _part_bytes(nodes[p[0]])[p[1]] / scale) for (jj, p), col in h.items() if jj == j]
        m.row(held, hi=w.capacity / scale)
    return RowsModel(m, rows, s, r, h, cost_scale)


def _keep_rows(m: SparseModel, rows: list[Row], s: dict, h: dict) -> None:
    """h[j2, p] <= h[j, p] + s[j, u] + ... + s[j2 - 1, u] for consecutive rows j < j2 modelling part
    p of node u (live at j2: live at j or computed between), where u precedes row j's node (its later
    computations fall in those intervals) and each interval has its s."""
    by_part: dict = {}
    for (j, p), col in h.items():
        by_part.setdefault(p, []).append((j, col))
    for p, cols in by_part.items():
        u = p[0]
        cols.sort()
        for (j, at_j), (j2, at_j2) in zip(cols, cols[1:]):
            between = [s.get((jj, u)) for jj in range(j, j2)]
            if u < rows[j].step and None not in between:
                m.row([(at_j2, 1.0), (at_j, -1.0)] + [(col, -1.0) for col in between], hi=0.0)


def point_of_schedule(rm: RowsModel, graph: TrainingGraph, schedule: list[str]):
    """The model's variables for a real schedule whose first computations follow the graph's
    order: h[j, p] = part p live while row j's node is first computed, s[j, v] = v computed
    between that moment and the next row's, r[j, v] = computed after it. A schedule within the
    budget satisfies every row at an objective no higher than its extra cost (the tests' check
    that the model is a relaxation)."""
    import numpy as np

    idx = graph.index
    first: dict[str, int] = {}
    comps: dict[int, list[int]] = {}
    for pos, name in enumerate(schedule):
        first.setdefault(name, pos)
        comps.setdefault(idx[name], []).append(pos)
    moments = [first[graph.nodes[w.step].name] for w in rm.rows] + [len(schedule)]
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}  # part -> [(computed at, freed after)]
    made: dict[tuple[int, int], int] = {}
    for pos, frees in enumerate(last_reads(graph, schedule)):
        u = idx[schedule[pos]]
        for k in range(len(_part_bytes(graph.nodes[u]))):
            made[u, k] = pos
        for name, k in frees:
            spans.setdefault((idx[name], k), []).append((made[idx[name], k], pos))
    x = np.zeros(rm.model.num_vars)
    for (j, p), col in rm.h.items():
        x[col] = float(any(c < moments[j] <= f for c, f in spans.get(p, ())))
    for (j, v), col in rm.s.items():
        x[col] = float(any(moments[j] < c < moments[j + 1] for c in comps[v]))
    for (j, v), col in rm.r.items():
        x[col] = float(any(moments[j] < c for c in comps[v]))
    return x
