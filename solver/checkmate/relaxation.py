"""A relaxation of the planning problem: every schedule is a point of it, so its optimum (or any
MILP bound on it) is a proven lower bound on the extra cost of every plan under the budget.

The problem (what "optimal" means in remat): among the schedules the simulator accepts whose nodes
are *first* computed in the graph's order (recomputations anywhere in between), one whose
simulated peak is within the budget at the least extra cost. Every strategy's plans, Checkmate's
among them, are such schedules, and on a graph with one topological order (a chain) they are all
schedules. A *row* t is the step that first computes node t. For a forward value u and a row t:

  L[u,k,t]  part k of u's current instance is live after row t
  C[u,t]    u is computed again after row t and before row D[u,t] (its deadline)
  R[u,I]    u is computed in the interval I between two consecutive states of u's chain

Facts every schedule satisfies (so the model relaxes the problem):
  need       a part a later first computation reads is live after t, or C (deadline: that read)
  closure    if C[v,t], each input part v reads is live after t or its node has C (deadline at
             least v's); a part that may not be recomputed must then be live
  keep       L[u,k,b] <= L[u,k,a] + R[u,(a,b)]     (live after b: live after a, or computed in
                                                    between)
  count      C[u,a] <= R[u,(a,b)] + C[u,b]          (C[u,b] only when the deadline is past b)
  dependency R[v,(a,b)] <= L[u,k,a] + R[u,(a,b)]   (Checkmate's: an input is live from before, or
                                                    computed in the same interval)
  memory     during row t: resident (tangents from the backward's first step until their last
             reader), kept outputs so far (forward-kept ones released no later than the simulator
             releases them), the step's own bytes, every part it reads, every non-recomputable
             part a later first computation reads, and the modelled parts live after t: at most
             the budget;
  transient  while v is recomputed in the interval before row t: the parts carried through it
             (live at t and not computed in it), v's own bytes and workspace, and its inputs
             computed in the same interval, within the budget.
The extra cost is at least sum c_u R. So the LP of the model, and any MILP bound of it, is a lower
bound on the optimum, on the fine graph (no coarsening is involved). tests/test_solver_scale.py
maps real schedules onto the model (bounds.point_of_schedule) and checks every row holds.

Scaling (a model that grows linearly with depth): forward values are split into groups:
contiguous runs of the forward order ending after a `forward_cuts` value (the only value the rest
of the forward reads: the residual stream between blocks), and apart, the long-lived values
(`long_lived`: rotary tables, masks, long skips, read by every block) with what only they read,
which would otherwise tie every group's chain to theirs. A group is modelled row by row only
around the rows that compute or read it (its *runs*: its own rows, and for each read the row
before and the row itself). In each gap between runs no first computation reads it, and it is
modelled by *sitting* states, each counted at every row it spans, with only its own closure; every
group's gaps are split at the same rows (where the backward starts, where each group's part of the
backward begins and ends), so that a recomputation in one group's sitting interval reads another
group's state over the same rows (its "twin"). That is exact for the relaxation that drops, at
sitting rows, the closure between groups: with the needs constant over the gap, any solution can
replace the group's states there by the state of its row of least memory (no row gets more
memory, no recomputation is added); bounds.point_of_schedule does exactly that, one row for the
twins together. Llama-3.2-1B-like (1,825 nodes): 148k variables, where one state per node and
row it lives would be 2.1M. Large graphs leave their small values out (solver/checkmate/small_values.py:
live whenever read, no memory, never recomputed); bounds.point_of_schedule maps them as live.
"""
from __future__ import annotations

import bisect
import math

from remat.core.training_graph import TrainingGraph
from remat.solver.checkmate.relaxation_rows import build_rows, rhs_of
from remat.solver.checkmate.small_values import small_values
from remat.solver.checkmate.sparse_lp import SparseModel

__all__ = ["Relaxation", "group_ranges", "forward_cuts", "long_lived", "groups_of", "SAFETY", "MIN_SIT"]

SAFETY = 1e-7  # relative margin taken off every bound: HiGHS's tolerances


def _parts(v) -> list[int]:
    return [b for b, _ in v.out_parts] if v.out_parts else [v.out_bytes]


def _parts_read(u, reader: str) -> list[int]:
    if not u.out_parts:
        return [0]
    hit = [k for k, (_, rd) in enumerate(u.out_parts) if reader in rd]
    return hit or list(range(len(u.out_parts)))


def long_lived(graph: TrainingGraph, span: int) -> set[str]:
    """Forward values whose forward readers reach at least `span` forward nodes past them: tables
    every block reads (rotary cos/sin, an attention mask, positions), long skip connections."""
    fwd = {v.name: i for i, v in enumerate(graph.forward_nodes)}
    out = set()
    for name, i in fwd.items():
        last = max((fwd[r] for r in graph.users[name] if r in fwd), default=i)
        if last - i >= span:
            out.add(name)
    return out


def forward_cuts(graph: TrainingGraph, span: int = 40) -> list[str]:
    """Recomputable forward values v that are the only value crossing the forward order after v
    (every value computed up to v that a later forward node reads is v itself), long-lived values
    set aside: the residual stream between blocks, also where every block reads the same rotary
    tables or mask (which leave the graph with no such point otherwise). A value that only some
    leaf reads (BatchNorm's statistics read its output) does not make it one."""
    fwd = graph.forward_nodes
    pos = {v.name: i for i, v in enumerate(fwd)}
    hubs = long_lived(graph, span)
    last = [i for i in range(len(fwd))]  # last forward reader of each forward value
    for i, v in enumerate(fwd):
        if v.name in hubs:
            continue
        for r in graph.users[v.name]:
            if r in pos:
                last[i] = max(last[i], pos[r])
    out, reach = [], -1  # reach: the furthest forward read of any value before i
    for i, v in enumerate(fwd):
        if reach <= i and v.recomputable:
            out.append(v.name)
        reach = max(reach, last[i])
    return out


def _with_feeders(graph: TrainingGraph, span: int, limit: int) -> set[int]:
    """The long-lived values at `span` (indices) with the forward nodes that feed only them (a
    table's own computation: positions -> cos/sin, a mask's comparisons). A value with more than
    `limit` such feeders whose far readers (`span` or more past it) lie within `span` of one another is
    a block's residual stream (its value before the block, read by the residual adds after it), not
    a table: it is left out, else the whole block feeding only the adds would join the long-lived
    group, modelled over all its rows, a size growing with their square (Gemma-2's 3 layers: 166 of
    242 forward nodes, 152k variables; BEiT's 4, each computing its position bias again: 304 of
    413, 244k). Read far by nodes `span` or more apart (an encoder's output, read by every decoder
    layer) it stays, with its feeders: modelled together, the bound is tighter (T5 at half its
    activation memory: gap 3.6%; 14.3% with the encoder in its own groups)."""
    idx = graph.index
    fwd = graph.forward_nodes
    at = {v.name: i for i, v in enumerate(fwd)}
    pos = sorted(idx[v.name] for v in fwd)
    users = {i: [idx[r] for r in graph.users[graph.nodes[i].name] if r in at] for i in pos}

    def feeders(held: set[int]) -> set[int]:
        out = set(held)
        for i in reversed(pos):
            if i not in out and users[i] and all(r in out for r in users[i]):
                out.add(i)
        return out - held

    hubs = set()
    for h in long_lived(graph, span):
        far = [at[r] for r in graph.users[h] if r in at and at[r] - at[h] >= span]
        if max(far) - min(far) >= span or len(feeders({idx[h]})) <= limit:
            hubs.add(idx[h])
    return hubs | feeders(hubs)


def group_ranges(graph: TrainingGraph, target: int = 20) -> list[tuple[int, int]]:
    """Contiguous ranges [lo, hi) of node indices covering the forward: split after the values
    of `forward_cuts` (values the rest of the forward reads only through, besides long-lived
    ones), once a range holds at least `target` nodes; a stretch of 4 * target forward nodes
    without one is split anyway (any split is sound: the cuts only make the bound tighter)."""
    fwd = [i for i, v in enumerate(graph.nodes) if not v.is_backward]
    if not fwd:
        return []
    cut = {graph.index[c] for c in forward_cuts(graph, 2 * target)}
    out, lo = [], fwd[0]
    for i in fwd:
        # of consecutive cuts (an add, then its ReLU) the last: the value the backward reads
        if i in cut and i + 1 not in cut and i + 1 - lo >= target or i + 1 - lo >= 4 * target:
            out.append((lo, i + 1))
            lo = i + 1
    if lo <= fwd[-1]:
        out.append((lo, fwd[-1] + 1))
    return out


def groups_of(graph: TrainingGraph, target: int = 20, dense: bool = False) -> list[list[int]]:
    """The forward nodes (indices) of each group, ascending: the ranges of group_ranges, and
    apart the long-lived values with what only they read (rotary tables, masks: read by every
    block, they would tie every group's chain to theirs); dense: one group."""
    fwd = [i for i, v in enumerate(graph.nodes) if not v.is_backward]
    if dense or not fwd:
        return [fwd] if fwd else []
    hubs = _with_feeders(graph, 2 * target, target)
    pos = set(fwd)
    out = [[v for v in range(lo, hi) if v in pos and v not in hubs] for lo, hi in group_ranges(graph, target)]
    out = [m for m in out if m]
    if hubs:
        out.append(sorted(hubs))
    return out


MIN_SIT = 2  # a gap of fewer rows between a group's active rows is modelled row by row


def _active(lo: int, hi: int, reads: list[int]) -> set[int]:
    """A group's own rows lo..hi-1 and, for every row r reading one of its values, r - 1 and r
    (the interval in which a recomputation for that read runs)."""
    return {*range(lo, hi), *(r for r in reads if r >= lo), *(r - 1 for r in reads if r - 1 >= lo)}


def _runs(active: set[int]) -> list[tuple[int, int]]:
    """The rows of `active` as runs [a, b], gaps of fewer than MIN_SIT rows filled in."""
    rows = sorted(active)
    runs = [[rows[0], rows[0]]]
    for t in rows[1:]:
        if t - runs[-1][1] - 1 < MIN_SIT:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    return [tuple(r) for r in runs]


class Relaxation:
    """The relaxation of one graph under one budget (see the module docstring). States are rows
    0..n-1 and the sitting states n + j (`sitting_spans[j]`: its group and rows, one per gap
    between the rows a group is modelled at). The model's columns, named after the module
    docstring's letters: `live` L[u,k,t] (keyed (u, k, state)), `again` C[u,t] and `deadline`
    D[u,t] (keyed (u, state)), `computed` R[u,I] (keyed (u, the state that ends I), -1: after the
    last state; `interval[(u, b)]` is that interval (a, b)), `carried` per row the memory carried
    through a recomputation before it. `part_bytes[u][k]`, `readers[u][k]` (nodes reading part k of
    u), `last_read[u][k]`, `recomputable[u]`, `group_of[u]` (-1: not in a group), `forward_end` (the
    forward's last row)."""

    def __init__(self, graph: TrainingGraph, budget: int | None, *, dense: bool | None = None, group_target: int = 20,
                 fwd_reads_only: bool | None = None, transients: bool = True, small_from_nodes: int | None = None):
        """budget None: the model of the smallest peak (every memory row at most a variable P, the
        objective; recomputation is free), for a lower bound on any schedule's peak. small_from_nodes:
        from how many nodes small values are left out (None: SMALL_FROM_NODES)."""
        self.graph = graph
        self.budget_given = budget is not None
        if budget is None:
            from remat.solver.schedule import keep_all_schedule
            from remat.core.simulator import simulate

            budget = simulate(graph, keep_all_schedule(graph)).peak_bytes  # scale only
        self.budget = budget
        self.n = n = len(graph.nodes)
        self.dense = n <= 48 if dense is None else dense
        self.fwd_reads_only = (not self.dense) if fwd_reads_only is None else fwd_reads_only
        self.transients = transients
        self.model = SparseModel()
        self.peak = None if self.budget_given else self.model.var(0.0, math.inf, cost=1.0)
        self.cost_scale = max(graph.total_cost / 1e4, 1e-12)
        self.mem_scale = max(budget / 1e4, 1.0)
        self.infeasible_at: int | None = None
        self.live: dict = {}  # (u, k, state) -> L column
        self.again: dict = {}  # (u, state) -> C column
        self.deadline: dict = {}  # (u, state) -> D: the row of the read C is for
        self.computed: dict = {}  # (u, state ending the interval) -> R column
        self.interval: dict = {}
        self.sitting: dict = {}  # sitting id j -> (first row, last row, M column, [(col, bytes)])
        self.carried: dict = {}  # row -> (carried-memory column W, [(y column or None, u, k, read at t)])
        self.depends_done: set = set()  # R columns whose dependency rows are built
        self.R_of: dict = {}  # R column -> (u, b)
        self.pending: list = []  # R columns whose dependency rows are still to build
        self.memory_rows: list = []  # the memory row of each row t (model row indices)
        self.transient_rows: list = []  # the rows bounding memory while a value is recomputed
        # (row, fixed bytes, extra): the rows whose bound depends on the budget (rhs_of)
        self.budget_rows: list = []
        self.memory_fixed: list = []  # per row t: the bytes its memory row holds whatever the plan
        self.unmodelled = small_values(graph, budget, min_nodes=small_from_nodes)
        self._prep(group_target)
        build_rows(self)

    # ---- data -------------------------------------------------------------------------------------
    def _prep(self, group_target: int) -> None:
        g = self.graph
        nodes, idx, n = g.nodes, g.index, self.n
        self.part_bytes = [_parts(v) for v in nodes]
        self.recomputable = [v.recomputable for v in nodes]
        for u in self.unmodelled:  # as if never recomputed, holding no memory
            self.recomputable[u] = False
            self.part_bytes[u] = [0] * len(self.part_bytes[u])
        self.reads = [[] for _ in range(n)]  # v -> [(u, k)]: the parts it reads
        self.readers = [[[] for _ in p] for p in self.part_bytes]  # (u, k) -> rows reading it, ascending
        for v, node in enumerate(nodes):
            for i in node.inputs:
                u = idx[i]
                for k in _parts_read(nodes[u], node.name):
                    self.reads[v].append((u, k))
                    self.readers[u][k].append(v)
        self.last_read = [[max(r) if r else -1 for r in rs] for rs in self.readers]
        # a part is modelled (hold) until its last read or the last read of any value computed
        # from it (recomputable, in the forward): a reader recomputed later reads it then, and
        # its chain of states must say whether it was kept until then or computed again
        last_any = [max(lr, default=-1) for lr in self.last_read]
        desc = list(last_any)  # the latest read of u or of any recomputable value computed from u
        for u in range(n - 1, -1, -1):
            if self.recomputable[u]:
                for rs in self.readers[u]:
                    for v in rs:
                        if self.recomputable[v] and desc[v] > desc[u]:
                            desc[u] = desc[v]
        self.hold = [[max([lr] + [desc[v] for v in self.readers[u][k] if self.recomputable[v]]) if self.recomputable[u] else lr
                      for k, lr in enumerate(self.last_read[u])] for u in range(n)]
        fwd = [i for i, v in enumerate(nodes) if not v.is_backward]
        self.forward_end = fwd[-1] if fwd and len(fwd) < n else n - 1  # the forward's last row
        self.members = groups_of(g, group_target, self.dense)
        self.group_of = [-1] * n
        for gi, mem in enumerate(self.members):
            for v in mem:
                self.group_of[v] = gi
        self.groups = [(mem[0], mem[-1] + 1) for mem in self.members]
        self.runs: list[list[tuple[int, int]]] = []
        self.sitting_spans: list[tuple[int, int, int]] = []  # sitting state n + j -> (group, first row, last row)
        self.chain_prev: dict = {}  # (group, state) -> previous state in the group's chain
        self.chain_next: dict = {}
        self.chain_last: dict = {}
        for mem in self.members:
            reads = [r for u in mem for rs in self.readers[u] for r in rs]
            lo, hi = mem[0], mem[-1] + 1
            self.runs.append([(lo, max([hi - 1] + reads))] if self.dense else _runs(_active(lo, hi, reads)))
        # Every gap is split at the same rows: where the backward starts and where each group's
        # own part of the backward (its runs after the forward) begins and ends. A recomputation
        # of one group's value in a sitting interval of its chain reads another group's values;
        # with the same splits the other group sits over the same rows ("twins", standing for
        # the same row in point_of_schedule), so its dependency row reads the other group's
        # state there, and that state's memory counts over the rows before it.
        cuts = {self.forward_end + 1}
        for runs in self.runs:
            back = [(a, b) for a, b in runs if b > self.forward_end]
            if back:
                cuts |= {max(back[0][0], self.forward_end + 1), back[-1][1] + 1}
        splits = sorted(cuts)
        for gi, runs in enumerate(self.runs):
            states = list(range(runs[0][0], runs[0][1] + 1))
            for (_, end), (a, b) in zip(runs, runs[1:]):  # a gap: sitting states
                lo = end + 1
                for p in splits[bisect.bisect_right(splits, lo):bisect.bisect_right(splits, a - 1)]:
                    self.sitting_spans.append((gi, lo, p - 1))
                    states.append(n + len(self.sitting_spans) - 1)
                    lo = p
                self.sitting_spans.append((gi, lo, a - 1))
                states.append(n + len(self.sitting_spans) - 1)
                states += list(range(a, b + 1))
            for a, b in zip(states, states[1:]):
                self.chain_prev[gi, b] = a
                self.chain_next[gi, a] = b
            self.chain_last[gi] = states[-1]
        self.chain = []  # group -> its states in order
        for gi in range(len(self.members)):
            first = self.runs[gi][0][0]
            states = [first]
            while (gi, states[-1]) in self.chain_next:
                states.append(self.chain_next[gi, states[-1]])
            self.chain.append(states)
        self.twin: dict = {}  # (group, span) -> its sitting state over exactly those rows
        for j, (gi, a, b) in enumerate(self.sitting_spans):
            self.twin[gi, a, b] = n + j
        self.chain_pos = [{s: i for i, s in enumerate(ch)} for ch in self.chain]
        self.chain_lo = [[self.span(s)[0] for s in ch] for ch in self.chain]
        self.chain_hi = [[self.span(s)[1] for s in ch] for ch in self.chain]
        self.run_at = [[] for _ in range(n)]  # row -> groups modelled in detail there
        for gi, runs in enumerate(self.runs):
            for a, b in runs:
                for t in range(a, b + 1):
                    self.run_at[t].append(gi)

    def set_budget(self, budget: int) -> None:
        """The model at another budget, in place: only the budget rows' upper bounds and the
        carried-memory columns' upper bounds depend on it (the structure and mem_scale stay), so
        an LP solver holding the model can solve the new one from its last basis
        (`budget_rows`, `budget_columns` say what moved). Not for the peak's model."""
        if not self.budget_given:
            raise ValueError("the smallest peak's model has no budget")
        m, ms = self.model, self.mem_scale
        self.budget = budget
        self.infeasible_at = next((t for t, f in enumerate(self.memory_fixed) if f > budget), None)
        for r, fixed, extra in self.budget_rows:
            m.set_row_bounds(r, hi=rhs_of(budget, fixed, ms, extra))
        for W, _ in self.carried.values():
            m.ub[W] = budget / ms

    @property
    def budget_columns(self) -> list[int]:
        """The columns whose upper bound is the budget (the carried memory W of each row)."""
        return [W for W, _ in self.carried.values()]

    def span(self, s: int) -> tuple[int, int]:
        """The first and last row a state may stand for (a sitting state: any row of its gap)."""
        return (s, s) if s < self.n else self.sitting_spans[s - self.n][1:]

    def covering(self, gi: int, a: int, b: int):
        """(s0, [states after s0 up to s1]) of group gi's chain, so that a computation in the
        interval (a, b] of another group's chain falls in one of gi's intervals from s0 to s1:
        s0 is gi's sitting state over exactly a's rows if a is a sitting state and gi has one
        (both stand for the same row), else gi's last state standing for a row at or before any
        row a stands for; s1 likewise for b (gi's first state at or after b's rows). None if
        the chain has no such states."""
        chain = self.chain[gi]
        pos = self.chain_pos[gi]
        t0 = self.twin.get((gi, *self.span(a))) if a >= self.n else None
        i0 = pos[t0] if t0 is not None else bisect.bisect_right(self.chain_hi[gi], self.span(a)[0]) - 1
        t1 = self.twin.get((gi, *self.span(b))) if b >= self.n else None
        i1 = pos[t1] if t1 is not None else bisect.bisect_left(self.chain_lo[gi], self.span(b)[1])
        if i0 < 0 or i1 >= len(chain) or i1 <= i0:
            return None
        return chain[i0], chain[i0 + 1:i1 + 1]

    def next_read(self, u: int, k: int, t: int) -> int:
        """The first row after t that reads part k of u."""
        rs = self.readers[u][k]
        return rs[bisect.bisect_right(rs, t)]

    def row_of_state(self, s: int) -> int:
        """The row a state stands for, as an interval start (a sitting state: its first row)."""
        return s if s < self.n else self.sitting_spans[s - self.n][1]

    def base_bytes(self) -> list[int]:
        """Per row: resident (tangents from the backward on, until their last reader), and kept
        outputs computed before the row (forward-kept ones gone once the simulator frees them at
        the latest)."""
        g, nodes, n, E = self.graph, self.graph.nodes, self.n, self.forward_end
        delta = [0] * (n + 2)  # changes taking effect from row i on
        delta[0] += g.resident_bytes - sum(b for b, _ in g.tangents)
        for b, readers in g.tangents:
            if E + 1 <= n - 1:
                delta[E + 1] += b
                if readers:
                    delta[max(g.index[r] for r in readers) + 1] -= b
        for v, node in enumerate(nodes):
            delta[v + 1] += node.kept_bytes
            for b, readers in node.forward_kept:
                delta[max([g.index[r] for r in readers] + [max(E, v)]) + 1] -= b
        out, acc = [], 0
        for t in range(n):
            acc += delta[t]
            out.append(acc)
        return out
