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

Scaling (a model that grows linearly with depth): forward values are split into groups (contiguous
runs of the forward order, ending at articulation points). A group is modelled row by row only
while the forward computes and reads it and around the backward rows that read it (its *runs*).
In between (its *sitting* period) no first computation reads it, and it is modelled by one state S
counted at every sitting row, with only its own closure. That is exact for the relaxation that
drops, at sitting rows, the closure between groups: with the needs constant over the period, any
solution can replace the group's states there by the state of its row of least memory (no row gets
more memory, no recomputation is added). bounds.point_of_schedule does exactly that.
"""
from __future__ import annotations

import bisect
import math

from remat.core.training_graph import TrainingGraph
from remat.solver.relaxation_rows import build_rows
from remat.solver.sparse_lp import SparseModel

__all__ = ["Relaxation", "group_ranges", "SAFETY"]

SAFETY = 1e-7  # relative margin taken off every bound: HiGHS's tolerances


def _parts(v) -> list[int]:
    return [b for b, _ in v.out_parts] if v.out_parts else [v.out_bytes]


def _parts_read(u, reader: str) -> list[int]:
    if not u.out_parts:
        return [0]
    hit = [k for k, (_, rd) in enumerate(u.out_parts) if reader in rd]
    return hit or list(range(len(u.out_parts)))


def group_ranges(graph: TrainingGraph, target: int = 20) -> list[tuple[int, int]]:
    """Contiguous ranges [lo, hi) of node indices covering the forward: split after articulation
    points of the forward graph (values the rest of the forward reads only through), once a range
    holds at least `target` nodes."""
    from remat.solver.equal_spacing import checkpoint_candidates

    fwd = [i for i, v in enumerate(graph.nodes) if not v.is_backward]
    if not fwd:
        return []
    cut = {graph.index[c] for c in checkpoint_candidates(graph)}
    out, lo = [], fwd[0]
    for i in fwd:
        if i in cut and i + 1 - lo >= target:
            out.append((lo, i + 1))
            lo = i + 1
    if lo <= fwd[-1]:
        out.append((lo, fwd[-1] + 1))
    return out


class Relaxation:
    """The relaxation of one graph under one budget (see the module docstring). States are rows
    0..n-1 and one sitting state n + g per group g; L, C, D are keyed by state, R by the state that
    ends its interval (-1: after the last state); `interval[(u, b)]` is that interval (a, b)."""

    def __init__(self, graph: TrainingGraph, budget: int | None, *, dense: bool | None = None, group_target: int = 20,
                 fwd_reads_only: bool | None = None, transients: bool = True):
        """budget None: the model of the smallest peak (every memory row at most a variable P, the
        objective; recomputation is free), for a lower bound on any schedule's peak."""
        self.g = graph
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
        self.L: dict = {}
        self.C: dict = {}
        self.D: dict = {}
        self.R: dict = {}
        self.interval: dict = {}
        self.sitting: dict = {}  # group -> (first sitting row, last sitting row, M column, [(col, bytes)])
        self.W: dict = {}  # row -> (W column, [(y column or None, u, k, read at t)])
        self._prep(group_target)
        build_rows(self)

    # ---- data -------------------------------------------------------------------------------------
    def _prep(self, group_target: int) -> None:
        g = self.g
        nodes, idx, n = g.nodes, g.index, self.n
        self.P = [_parts(v) for v in nodes]
        self.rec = [v.recomputable for v in nodes]
        self.reads = [[] for _ in range(n)]  # v -> [(u, k)]: the parts it reads
        self.rd = [[[] for _ in p] for p in self.P]  # (u, k) -> rows reading it, ascending
        for v, node in enumerate(nodes):
            for i in node.inputs:
                u = idx[i]
                for k in _parts_read(nodes[u], node.name):
                    self.reads[v].append((u, k))
                    self.rd[u][k].append(v)
        self.lastrd = [[max(r) if r else -1 for r in rs] for rs in self.rd]
        fwd = [i for i, v in enumerate(nodes) if not v.is_backward]
        self.E = fwd[-1] if fwd and len(fwd) < n else n - 1  # the forward's last row
        ranges = [(0, self.E + 1)] if self.dense else group_ranges(g, group_target)
        self.grp = [-1] * n
        for gi, (lo, hi) in enumerate(ranges):
            for v in range(lo, hi):
                if not nodes[v].is_backward:
                    self.grp[v] = gi
        self.groups = ranges
        self.members = [[v for v in range(lo, hi) if self.grp[v] == gi] for gi, (lo, hi) in enumerate(ranges)]
        self.runs: list[list[tuple[int, int]]] = []
        self.sit: list[tuple[int, int] | None] = []  # group -> its sitting rows [a, b], if any
        for gi, (lo, hi) in enumerate(ranges):
            reads = [r for u in self.members[gi] for rs in self.rd[u] for r in rs]
            fr = [r for r in reads if not nodes[r].is_backward]
            br = [r for r in reads if nodes[r].is_backward]
            runs = [(lo, max([hi - 1] + fr))]
            if br:
                runs.append((max(min(br) - 1, lo), max(br)))
            if self.dense or len(runs) == 2 and runs[1][0] <= runs[0][1] + 1:
                runs = [(lo, max([hi - 1] + fr + br))]
            self.runs.append(runs)
            self.sit.append((runs[0][1] + 1, runs[1][0] - 1) if len(runs) == 2 else None)
        self.run_at = [[] for _ in range(n)]  # row -> groups modelled in detail there
        for gi, runs in enumerate(self.runs):
            for a, b in runs:
                for t in range(a, b + 1):
                    self.run_at[t].append(gi)
        self.chain_prev: dict = {}  # (group, state) -> previous state in the group's chain
        self.chain_next: dict = {}
        self.chain_last: dict = {}
        for gi, runs in enumerate(self.runs):
            states = list(range(runs[0][0], runs[0][1] + 1))
            if self.sit[gi] is not None:
                states.append(n + gi)
            if len(runs) == 2:
                states += list(range(runs[1][0], runs[1][1] + 1))
            for a, b in zip(states, states[1:]):
                self.chain_prev[gi, b] = a
                self.chain_next[gi, a] = b
            self.chain_last[gi] = states[-1]

    def _next_read(self, u: int, k: int, t: int) -> int:
        """The first row after t that reads part k of u."""
        rs = self.rd[u][k]
        return rs[bisect.bisect_right(rs, t)]

    def _start(self, s: int) -> int:
        """The row a state stands for, as an interval start (a sitting state: its first row)."""
        return s if s < self.n else self.sit[s - self.n][0]

    def _bases(self) -> list[int]:
        """Per row: resident (tangents from the backward on, until their last reader), and kept
        outputs computed before the row (forward-kept ones gone once the simulator frees them at
        the latest)."""
        g, nodes, n, E = self.g, self.g.nodes, self.n, self.E
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
