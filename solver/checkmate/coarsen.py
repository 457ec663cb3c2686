"""Coarsening: shrink a TrainingGraph to contiguous runs of its topological order.

Checkmate's MILP has O(n^2) binaries, so the solver works on a coarse graph whose nodes are runs
of consecutive fine nodes. A contiguous run of a topological order is convex, so the coarse graph
is again a DAG, and its node order is again topological. A run never mixes forward and backward
nodes. A coarse node is a TrainingGraph Node:

  inputs          the runs holding the fine values its members read from outside the run
  out_bytes       sum of out_bytes of members read outside the run (the rest are temporaries)
  kept_bytes      sum of members' kept_bytes
  workspace_bytes (peak of the run's own allocations while its members run, each member's
                  out + kept + workspace included, members freed after their last in-run read
                  unless read outside, minus the inputs already freed that die inside the run)
                  - out_bytes - kept_bytes. It can be negative: an input whose readers are all
                  never recomputed and whose last reader is a member is freed mid-run in every
                  schedule (the backward frees saved activations as it goes), and the run's step
                  is charged with what is left.
  cost, flops     sums; is_random: any member random; is_backward: the members'; members: names

So a run is recomputable only if every member is. Guarantee (tested): for any coarse schedule,
`expand_schedule` simulates on the fine graph with the same total cost and a peak no higher than
the coarse peak. Why: at any fine step inside a run, live values of other runs are a subset of
the coarse live set (a fine instance is read no later than its run's instance), inputs of the run
are freed no later, and the run's own bytes are bounded by its workspace definition.

How runs are chosen: greedily merge the adjacent pair (same phase) with the lowest score until
`target_nodes` remain. The score is the growth of the merged step's footprint (its inputs, out,
kept and workspace) over the larger of the two, in units of a typical footprint, plus the merged
cost in units of a typical cost (so runs stay balanced), plus a penalty when a recomputable
forward run would become non-recomputable. Backward scores are scaled by `backward_weight` (< 1:
backward nodes are never recomputed, they are only stages, so merging them loses little), and
zero-byte nodes (views) and single-use links (the second run is the only reader of the first's
values) get a discount, so they fold first.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from remat.core.training_graph import Node, TrainingGraph

__all__ = ["CoarseGraph", "coarsen", "expand_schedule", "group_node"]

# A coarse graph is a TrainingGraph whose nodes' `members` name the fine nodes they stand for.
CoarseGraph = TrainingGraph


@dataclass
class _Run:
    lo: int  # first fine index
    hi: int  # one past the last
    node: Node  # its coarse node (inputs still in fine names)
    inbytes: int  # bytes of the fine values it reads from outside
    alive: bool = True
    version: int = 0


def group_node(graph: TrainingGraph, lo: int, hi: int, name: str | None = None) -> tuple[Node, int]:
    """The coarse node for fine nodes lo..hi-1 (inputs as FINE names, to be mapped by the caller),
    and the bytes of its external inputs."""
    nodes = graph.nodes[lo:hi]
    idx = graph.index
    users = graph.users
    inside = {n.name for n in nodes}
    ext_inputs: dict[str, None] = {}
    for n in nodes:
        for i in n.inputs:
            if i not in inside:
                ext_inputs[i] = None
    read_outside = {n.name for n in nodes if any(u not in inside for u in users[n.name])}
    last_in = {}  # member -> position (relative) of its last in-run reader
    for pos, n in enumerate(nodes):
        for i in n.inputs:
            if i in inside:
                last_in[i] = pos
    out = sum(n.out_bytes for n in nodes if n.name in read_outside)
    kept = sum(n.kept_bytes for n in nodes)
    # inputs that die inside the run in every schedule: all their readers are never recomputed and
    # the last one is a member; the fine schedule frees them mid-run, so the run's workspace may be
    # credited with them (it can then be negative: the step's memory is still >= the fine one's)
    dying = {x: max(idx[u] for u in users[x]) - lo for x in ext_inputs
             if all(not graph.nodes[idx[u]].recomputable for u in users[x])
             and max(idx[u] for u in users[x]) < hi}
    own, peak = 0, None
    for pos, n in enumerate(nodes):
        now = own + n.out_bytes + n.kept_bytes + n.workspace_bytes
        peak = now if peak is None else max(peak, now)
        own += n.out_bytes + n.kept_bytes
        for x in set(n.inputs):
            if dying.get(x) == pos:
                own -= graph.nodes[idx[x]].out_bytes
        for i in set(n.inputs):  # inputs read here for the last time inside the run
            if i in inside and i not in read_outside and last_in[i] == pos:
                own -= graph.nodes[idx[i]].out_bytes
        if n.name not in read_outside and n.name not in last_in:  # never read: freed at once
            own -= n.out_bytes
    assert peak >= out + kept - sum(graph.nodes[idx[x]].out_bytes for x in dying)
    first, last = nodes[0], nodes[-1]
    if name is None:
        name = first.name if len(nodes) == 1 else f"{first.name}..{last.name}"
    paths = [n.module_path for n in nodes]
    common = paths[0]
    for p in paths[1:]:
        while common and not (p == common or p.startswith(common + ".")):
            common = common.rpartition(".")[0]
    node = Node(name=name, op=first.op if len(nodes) == 1 else f"group[{len(nodes)}]",
                inputs=tuple(ext_inputs), out_bytes=out, kept_bytes=kept,
                workspace_bytes=peak - out - kept, cost=sum(n.cost for n in nodes),
                flops=sum(n.flops for n in nodes), is_backward=first.is_backward,
                is_random=any(n.is_random for n in nodes), module_path=common,
                members=tuple(n.name for n in nodes))
    inbytes = sum(graph.nodes[idx[i]].out_bytes for i in ext_inputs)
    return node, inbytes


def _footprint(r: _Run) -> int:
    return r.inbytes + r.node.out_bytes + r.node.kept_bytes + r.node.workspace_bytes


def coarsen(graph: TrainingGraph, target_nodes: int = 90, *, backward_weight: float = 0.3,
            cost_weight: float = 1.0, small_bytes: int | None = None,
            max_run: int | None = None) -> CoarseGraph:
    """Merge contiguous same-phase runs of `graph.nodes` until at most `target_nodes` remain
    (or no merge is possible). `small_bytes`: nodes allocating at most this much fold for free
    (default: 1/64 of the median nonzero out_bytes). `max_run`: cap on fine nodes per run."""
    fine = graph.nodes
    n = len(fine)
    runs = []
    for k in range(n):
        node, inb = group_node(graph, k, k + 1)
        runs.append(_Run(k, k + 1, node, inb))
    if n > target_nodes:
        nz = sorted(v.out_bytes for v in fine if v.out_bytes > 0) or [1]
        median = nz[len(nz) // 2]
        small = median // 64 if small_bytes is None else small_bytes
        mem_scale = max(1.0, sorted(_footprint(r) for r in runs)[n // 2])
        costs = sorted(v.cost for v in fine)
        cost_scale = max(costs[n // 2], 1e-9)
        users = graph.users

        def score(a: _Run, b: _Run) -> float | None:
            if a.node.is_backward != b.node.is_backward:
                return None
            if max_run is not None and b.hi - a.lo > max_run:
                return None
            merged, inb = group_node(graph, a.lo, b.hi)
            m = _Run(a.lo, b.hi, merged, inb)
            growth = max(0, _footprint(m) - max(_footprint(a), _footprint(b))) / mem_scale
            s = growth + cost_weight * merged.cost / cost_scale / 8
            a_names = set(a.node.members)
            a_users = {u for x in a.node.members for u in users[x] if u not in a_names}
            if a_users and a_users <= set(b.node.members):
                s *= 0.5  # single-use link: a's values are read only by b
            if min(a.node.out_bytes + a.node.workspace_bytes,
                   b.node.out_bytes + b.node.workspace_bytes) <= small:
                s *= 0.25  # a zero/small-byte node folds almost for free
            if not a.node.is_backward:
                if a.node.recomputable != b.node.recomputable:
                    rec = a if a.node.recomputable else b
                    s += 4 * rec.node.out_bytes / mem_scale + 1  # would forbid recomputing it
            else:
                s *= backward_weight
            return s

        # runs live in a doubly linked list; the heap holds (score, left, right, versions)
        nxt = list(range(1, n)) + [-1]
        prv = [-1] + list(range(n - 1))
        heap = []
        for k in range(n - 1):
            sc = score(runs[k], runs[k + 1])
            if sc is not None:
                heap.append((sc, k, k + 1, 0, 0))
        heapq.heapify(heap)
        count = n
        while count > target_nodes and heap:
            sc, a, b, va, vb = heapq.heappop(heap)
            ra, rb = runs[a], runs[b]
            if not (ra.alive and rb.alive) or ra.version != va or rb.version != vb or nxt[a] != b:
                continue
            node, inb = group_node(graph, ra.lo, rb.hi)
            ra.hi, ra.node, ra.inbytes, ra.version = rb.hi, node, inb, ra.version + 1
            rb.alive = False
            nxt[a] = nxt[b]
            if nxt[b] != -1:
                prv[nxt[b]] = a
            count -= 1
            for left, right in ((prv[a], a), (a, nxt[a])):
                if left != -1 and right != -1:
                    s2 = score(runs[left], runs[right])
                    if s2 is not None:
                        heapq.heappush(heap, (s2, left, right, runs[left].version,
                                              runs[right].version))
    chosen = [r for r in runs if r.alive]
    owner = {}
    for r in chosen:
        for m in r.node.members:
            owner[m] = r.node.name
    names = [r.node.name for r in chosen]
    if len(set(names)) != len(names):
        raise ValueError("coarse node names collide; rename fine nodes containing '..'")
    nodes = []
    for r in chosen:
        ins = tuple(dict.fromkeys(owner[i] for i in r.node.inputs))
        nodes.append(Node(**{**r.node.__dict__, "inputs": ins}))
    meta = {"coarsened_from": graph.name, "fine_nodes": n, "coarse_nodes": len(nodes),
            "target_nodes": target_nodes, "fine_fingerprint": graph.fingerprint()}
    return TrainingGraph(nodes=tuple(nodes), resident_bytes=graph.resident_bytes,
                         name=f"{graph.name}/coarse{len(nodes)}", meta=meta)


def expand_schedule(coarse: CoarseGraph, schedule: list[str]) -> list[str]:
    """Replace each coarse name by its members, in order."""
    out: list[str] = []
    for s in schedule:
        out.extend(coarse.node(s).members or (s,))
    return out
