"""A lower bound and plans from the steps where keeping everything is over the budget (the rows).

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
one recomputation of v), so the model's LP optimum, or its MILP's dual bound, is a lower bound on
the extra cost of every schedule whose first computations follow the graph's order, and the
largest over the rows is one too. The model has a few variables per node before t, where the
relaxation of the whole step (solver/checkmate/relaxation.py) has some per node and step.

Several rows together (`rows_model`) share their nodes: between consecutive rows j and j + 1 a
node is computed again or not (s[j, v]), each row keeps its own constraints, and the objective
counts a computation in every interval, so one recomputation cannot pay for two rows that need it
at different times; a part live at a row was live at the one before or computed since (LeViT,
rows 724, 837, 840, 843: 1.124% -> 1.251%). `peak_rows_search` solves single rows, cheapest
first: the LPs of up to MAX_ROWS rows, then the MILPs of the rows of largest LP bound (the
plans), stopping once a plan is within the gap asked for.

A plan: a row MILP's solution read as drops (before the row, every node it computes again and
every item it does not hold forgotten, each computed again where it is next read: guided.py's
schedule_from_live), made to fit at the other steps (guided.fit) and refined
(refine.drop_recomputations). Where one row decides the plan, as a language model's loss head
does, that plan often costs the row's bound: a proof of optimality from a model of a few thousand
variables. `peak_floor` is what every schedule holds at its worst step (a lower bound on any
peak); `lowest_peak_by_rows` searches down to it with guided.fit, for graphs too large for the
relaxation.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

from remat.core.progress import stage
from remat.core.simulator import last_reads, parts_read, simulate
from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.guided import fit
from remat.solver.refine import drop_recomputations
from remat.solver.checkmate.relaxation import SAFETY
from remat.solver.schedule import keep_all_schedule
from remat.solver.checkmate.sparse_lp import SparseModel

__all__ = ["Row", "RowsModel", "PeakRowsResult", "over_budget_rows", "rows_model", "peak_rows_search", "MAX_ROWS",
           "SINGLE_MILPS", "SINGLE_MAX_NODES", "MILP_SAFETY", "point_of_schedule", "peak_floor", "lowest_peak_by_rows"]

MAX_ROWS = 24  # rows whose LP is solved, at most: those of largest excess, and others spread over the step
MILP_SAFETY = 5e-7  # relative margin taken off a MILP's dual bound (HiGHS's tolerances); the bound never exceeds the rows' own plan either
SINGLE_MILPS = 3  # rows of largest LP bound whose own MILP is solved and made a plan
# branch-and-bound nodes of a single row's MILP (a work limit: the plan must not depend on the
# machine's load). The search solves single rows only: the model of 48 rows together raised the
# bound by 1-3% (relative) over the best single row on the compare.py transformers, for 10 s of
# LP on a 269-node GPT, and its MILP (16 rows) took 90 s there for a plan the certified search
# beats sooner; `rows_model` takes several rows for the tests and for callers that want them.
SINGLE_MAX_NODES = 2000


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


@dataclass
class PeakRowsResult:
    """The bound (cost units; math.inf: some row proves that no schedule fits), the best plan
    read off the rows (None: none), its extra cost, and what was solved."""

    bound: float
    schedule: list[str] | None
    extra_cost: float
    details: dict = field(default_factory=dict)


def _part_bytes(v) -> list[int]:
    return [b for b, _ in v.out_parts] if v.out_parts else [v.out_bytes]


def _keep_all_steps(graph: TrainingGraph):
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
    return [Row(t, mem - budget, dict(live), frozenset(items)) for t, mem, live, items in _keep_all_steps(graph)
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


def _readers(graph: TrainingGraph) -> dict:
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
    readers = _readers(graph) if readers is None else readers
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


def _chosen_rows(rows: list[Row], limit: int) -> list[Row]:
    """At most `limit` rows: half of them those of largest excess, the rest spread evenly over
    the others (any subset gives a valid bound; these are where it is likely to be largest)."""
    if len(rows) <= limit:
        return rows
    by_excess = sorted(rows, key=lambda w: -w.excess)
    top = by_excess[:limit // 2]
    rest = sorted(by_excess[limit // 2:], key=lambda w: w.step)
    stride = len(rest) / (limit - len(top))
    return sorted(top + [rest[int(j * stride)] for j in range(limit - len(top))], key=lambda w: w.step)


def _bound(value: float, rm: RowsModel, graph: TrainingGraph, margin: float = SAFETY) -> float:
    """A model's optimum in cost units, less a margin for the solver's tolerances (`margin`
    relative; a MILP's dual bound is only as exact as its feasibility tolerance, MILP_SAFETY)."""
    return max(0.0, value * rm.cost_scale * (1 - margin) - SAFETY * 1e-3 * graph.total_cost)


def _plan(graph: TrainingGraph, rm: RowsModel, x, budget: int) -> list[str] | None:
    """The schedule of a MILP solution: before each row, every node it computes again after the
    row and every item it does not hold there forgotten (each is computed again where it is next
    read), made to fit (not yet refined); None when it cannot be made to fit."""
    drops: list[set[int]] = [set() for _ in graph.nodes]
    for (j, v), col in rm.s.items():
        if x[col] > 0.5:
            drops[max(rm.rows[j].step - 1, 0)].add(v)
    for (j, p), col in rm.h.items():
        if p in rm.rows[j].items and x[col] < 0.5:
            drops[max(rm.rows[j].step - 1, 0)].add(p[0])
    return fit(graph, drops, budget)


def peak_rows_search(graph: TrainingGraph, budget: int, *, incumbent: float = math.inf,
                     mip_gap: float = 0.0, time_limit_s: float | None = None) -> PeakRowsResult:
    """The rows' bound and plans for `graph` under `budget` (see the module docstring), in stages
    of growing cost, stopping once the best plan (or `incumbent`, a known plan's extra cost) is
    within `mip_gap` of the bound: the LPs of up to MAX_ROWS rows, then the MILPs of the
    SINGLE_MILPS rows of largest LP bound (their plans and bounds)."""
    with stage(f"checkmate: rows over the budget ({len(graph.nodes)} nodes)", unit="model") as progress:
        return _search(graph, budget, incumbent, mip_gap, time_limit_s, progress)


def _search(graph, budget, incumbent, mip_gap, time_limit_s, progress) -> PeakRowsResult:
    t0 = time.perf_counter()
    rows = over_budget_rows(graph, budget)
    details: dict = {"rows_over_budget": len(rows)}
    if not rows:
        return PeakRowsResult(0.0, keep_all_schedule(graph), 0.0, details)
    names = graph.nodes
    for w in rows:
        if w.capacity < 0:  # even dropping every item leaves the step over the budget
            details["infeasible_row"] = names[w.step].name
            return PeakRowsResult(math.inf, None, math.inf, details)
    readers = _readers(graph)
    found = {"bound": 0.0, "schedule": None, "cost": math.inf}
    solves: list = []
    details["solves"] = solves

    def left() -> float | None:
        return None if time_limit_s is None else max(0.1, time_limit_s - (time.perf_counter() - t0))

    def run(rows_: list[Row], integral: bool) -> tuple[float, RowsModel] | None:
        """Solve the model of rows_, keep its bound and plan; None when it proves no fit."""
        rm = rows_model(graph, rows_, readers)
        nodes_limit = SINGLE_MAX_NODES if integral else None
        sol = rm.model.solve(integral=integral, max_nodes=nodes_limit, time_limit_s=left(), mip_gap=max(mip_gap, 1e-6))
        entry = {"rows": len(rm.rows), "integral": integral, "status": sol.status, "variables": rm.model.num_vars,
                 "constraints": rm.model.num_rows, "s": round(sol.seconds, 3)}
        solves.append(entry)
        progress.advance(1)
        if sol.status == "infeasible":
            details["infeasible_row"] = ", ".join(names[w.step].name for w in rm.rows[:3])
            return None
        margin = MILP_SAFETY if integral else SAFETY
        bound = _bound(sol.bound, rm, graph, margin) if sol.bound is not None and math.isfinite(sol.bound) else 0.0
        entry["bound"] = bound
        found["bound"] = max(found["bound"], bound)
        if integral and sol.x is not None:
            sched = _plan(graph, rm, sol.x, budget)
            if sched is not None:
                cost = entry["plan_extra_cost"] = simulate(graph, sched).extra_cost
                if cost < found["cost"]:
                    found.update(schedule=sched, cost=cost)
        total = max(graph.total_cost, 1e-12)
        facts = {"rows": f"{len(rows)} over", "bound": f"{100 * found['bound'] / total:.3f}%"}
        best = min(found["cost"], incumbent)
        if math.isfinite(best):
            facts.update(plan=f"{100 * best / total:.3f}%", gap=f"{100 * (best - found['bound']) / max(best, 1e-12):.2f}%")
        progress.note(**facts)
        return bound, rm

    def done() -> bool:
        best = min(found["cost"], incumbent)
        return best - found["bound"] <= mip_gap * best + 1e-12 or time_limit_s is not None and left() <= 0.1

    def result() -> PeakRowsResult:
        # only the cheapest plan is refined (refining is most of the search's time), and only when
        # the bound leaves room for it to get cheaper
        sched = found["schedule"]
        if sched is not None and found["cost"] - found["bound"] > mip_gap * found["cost"] + 1e-12:
            sched = drop_recomputations(graph, sched, budget)
            found.update(schedule=sched, cost=simulate(graph, sched).extra_cost)
        # a bound over the plan found is the tolerances' doing (the plan is a schedule in scope)
        found["bound"] = min(found["bound"], found["cost"])
        details.update(bound=found["bound"], s=round(time.perf_counter() - t0, 3))
        return PeakRowsResult(found["bound"], found["schedule"], found["cost"], details)

    chosen = _chosen_rows(rows, MAX_ROWS)
    single = []
    for w in chosen:
        out = run([w], False)
        if out is None:
            return PeakRowsResult(math.inf, None, math.inf, details)
        single.append((out[0], w))
    for _, w in sorted(single, key=lambda bw: -bw[0])[:SINGLE_MILPS]:
        if run([w], True) is None:
            return PeakRowsResult(math.inf, None, math.inf, details)
        if done():
            return result()
    return result()


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


def peak_floor(graph: TrainingGraph) -> int:
    """A proven lower bound on the peak of every schedule whose first computations follow the
    graph's order: at each step, what every such schedule holds there (the step's memory under
    keep-all less every part it could drop), the largest over the steps."""
    return max((mem - sum(live[p] for p in items) for _, mem, live, items in _keep_all_steps(graph)), default=0)


def lowest_peak_by_rows(graph: TrainingGraph, probes: int = 10) -> tuple[list[str], int]:
    """A low-peak schedule without the whole step's relaxation, and the proven floor of
    `peak_floor`: the floor itself, then bisection between it and keep-all's peak (to within
    0.1%), each probe budget tried by guided.fit from nothing (the cheapest values per byte
    dropped at each step over it)."""
    floor = peak_floor(graph)
    best = keep_all_schedule(graph)
    lo, hi = floor - 1, simulate(graph, best).peak_bytes
    for probe in range(probes):
        if hi - lo <= max(1, hi // 1000):
            break
        mid = floor if probe == 0 else (lo + hi) // 2  # the floor first: often it fits
        sched = fit(graph, [set() for _ in graph.nodes], mid)
        if sched is None:
            lo = mid
        else:
            best, hi = sched, simulate(graph, sched).peak_bytes
    return best, floor
