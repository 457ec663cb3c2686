"""The simulator: the single judge of a plan.

A schedule is a flat list of node names in execution order. The first occurrence of a name
computes it; a later occurrence recomputes it, making a new instance. Every read goes to the
latest instance. An instance is freed right after its last read (or right after it is computed
when nothing reads it), exactly as fx-generated code drops a value after its last use.

At the moment node v runs, memory is
    resident + kept outputs so far + live instances + v.out_bytes + v.kept_bytes + v.workspace_bytes
and the peak is the maximum of that over the schedule.

The step is split where the runtime splits it: the forward ends at the first computation of the
last forward node. The graph's tangents (part of resident) only exist from the start of the
backward (autograd creates the loss's seed gradient when backward() is called, AOTAutograd the
zeros for outputs that get none, freed after their last reader), and the nodes' `forward_kept`
outputs (new values of mutated buffers) are freed when the forward ends, or after their last
reader if that is later. These make the prediction equal the measured CPU peak to the byte.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.core.errors import RematError
from remat.core.training_graph import TrainingGraph

__all__ = ["SimResult", "ScheduleError", "simulate", "last_reads", "last_read_nodes", "unread_steps", "dead_steps",
           "forward_end", "parts_read"]


class ScheduleError(RematError, ValueError):
    """The schedule cannot run: a read of a value that was never computed, a node computed twice
    that may not be, or a node of the graph that never runs."""


@dataclass(frozen=True)
class SimResult:
    """What replaying a schedule gives: its peak, its cost and FLOPs, and memory at every step."""

    peak_bytes: int  # the step's peak, resident memory included
    peak_step: int  # index into the schedule where the peak happens
    total_cost: float  # sum of the costs of every step, recomputations included
    extra_cost: float  # total_cost minus the cost of computing every node once
    total_flops: int
    extra_flops: int
    recomputations: int  # steps that recompute a node
    timeline: tuple[int, ...]  # memory at each step (while the step runs)


def _parts(v) -> list[tuple[int, tuple[str, ...] | None]]:
    """A node's outputs as (bytes, readers); readers None: every reader."""
    return list(v.out_parts) if v.out_parts else [(v.out_bytes, None)]


def parts_read(u, reader: str) -> list[int]:
    """Which of u's parts a read by `reader` touches (all of them if it is named in none)."""
    parts = _parts(u)
    hit = [k for k, (_, readers) in enumerate(parts) if readers is None or reader in readers]
    return hit or list(range(len(parts)))


class _Tables:
    """A graph's structure as integers, built once per graph (the simulator runs thousands of
    times on the same graph while a plan is searched for): every output part of every node has a
    key, `first[v]` + k, and each node lists the keys of the parts it reads."""

    def __init__(self, graph: TrainingGraph):
        nodes, idx = graph.nodes, graph.index
        self.first: list[int] = []
        self.part_bytes: list[int] = []
        for v in nodes:
            self.first.append(len(self.part_bytes))
            self.part_bytes.extend(b for b, _ in _parts(v))
        self.own = [list(range(self.first[i], self.first[i] + len(_parts(v)))) for i, v in enumerate(nodes)]
        self.reads = [[(idx[i], [self.first[idx[i]] + k for k in parts_read(nodes[idx[i]], v.name)])
                       for i in v.inputs] for v in nodes]
        self.key_node = [i for i, v in enumerate(nodes) for _ in _parts(v)]
        self.key_part = [k for v in nodes for k in range(len(_parts(v)))]
        self.forward_kept = [v for v in nodes if v.forward_kept]  # the nodes with forward-kept outputs
        self.kept = [bool(v.kept_bytes) for v in nodes]
        self.last: tuple | None = None  # (schedule as node indices, its _last_read_keys)
        # per node, what simulate's loop reads of it, as plain values (no attribute lookups there):
        # the keys it reads, what it adds while it runs, what it adds after, cost, FLOPs, whether
        # it may be recomputed
        self.per_node = [([key for _, keys in self.reads[i] for key in keys],
                          v.out_bytes + v.kept_bytes + v.workspace_bytes, v.out_bytes + v.kept_bytes,
                          v.cost, v.flops, v.recomputable) for i, v in enumerate(nodes)]
        # what _releases frees, entry by entry: bytes, the node whose first step bounds it from
        # below (-1: a tangent, bounded by the forward's end), its readers in the graph
        entries = [(b, -1, readers) for b, readers in graph.tangents if readers]
        entries += [(b, idx[v.name], readers) for v in self.forward_kept for b, readers in v.forward_kept]
        self.release_entries = [(b, v, [idx[r] for r in readers if r in idx]) for b, v, readers in entries]
        self._arrays: _Arrays | None = None  # (no reference to the graph: it holds these tables)

    @property
    def arrays(self) -> "_Arrays":
        if self._arrays is None:
            self._arrays = _Arrays(self)
        return self._arrays


class _Arrays:
    """The same tables as numpy arrays, for _simulate_arrays and dead_steps: per node, its first key, how many
    parts it has, the keys it reads (concatenated: read_keys[read_start[v]:][:read_count[v]]),
    bytes while it runs and after, whether it may be recomputed and whether it has kept outputs;
    per key, its bytes and its node; the release entries."""

    def __init__(self, tab: _Tables):
        reads = [r[0] for r in tab.per_node]
        self.first = np.array(tab.first, dtype=np.int64)
        self.part_count = np.array([len(o) for o in tab.own], dtype=np.int64)
        self.read_count = np.array([len(r) for r in reads], dtype=np.int64)
        self.read_start = np.cumsum(self.read_count) - self.read_count
        self.read_keys = np.array([k for r in reads for k in r], dtype=np.int64)
        self.part_bytes = np.array(tab.part_bytes, dtype=np.int64)
        self.running = np.array([r[1] for r in tab.per_node], dtype=np.int64)
        self.added = np.array([r[2] for r in tab.per_node], dtype=np.int64)
        self.recomputable = np.array([r[5] for r in tab.per_node], dtype=bool)
        self.key_node = np.array(tab.key_node, dtype=np.int64)
        self.kept = np.array(tab.kept, dtype=bool)  # per node: whether it has kept outputs
        entries = tab.release_entries  # (their readers concatenated, as the reads above)
        self.release_bytes = np.array([e[0] for e in entries], dtype=np.int64)
        self.release_node = np.array([e[1] for e in entries], dtype=np.int64)
        self.release_count = np.array([len(e[2]) for e in entries], dtype=np.int64)
        self.release_start = np.cumsum(self.release_count) - self.release_count
        self.release_readers = np.array([r for e in entries for r in e[2]], dtype=np.int64)


def _tables(graph: TrainingGraph) -> _Tables:
    """The graph's _Tables, cached on the graph object (frozen, so they never go stale)."""
    t = graph.__dict__.get("_simulator_tables")
    if t is None:
        t = graph.__dict__["_simulator_tables"] = _Tables(graph)
    return t


def _last_read_keys(tab: _Tables, steps: list[int]) -> list[list[int]]:
    """last_reads, as part keys of a schedule given as node indices (the last schedule's answer is
    kept: the plan searches prune a schedule, then simulate the same one)."""
    key = tuple(steps)
    last = tab.last  # read once: another thread may replace it
    if last is not None and last[0] == key:
        return last[1]
    frees = _scan_last_reads(tab, steps)
    tab.last = (key, frees)
    return frees


def _scan_last_reads(tab: _Tables, steps: list[int]) -> list[list[int]]:
    frees: list[list[int]] = [[] for _ in steps]
    pending = bytearray(len(tab.part_bytes))  # parts already read by a later step, same instance
    own, per_node = tab.own, tab.per_node
    for s in range(len(steps) - 1, -1, -1):
        v = steps[s]
        f = frees[s]
        for key in own[v]:
            if not pending[key]:
                f.append(key)  # this instance's part is never read
            pending[key] = 0  # earlier instances are a different story
        for key in per_node[v][0]:  # the keys v reads, input by input
            if not pending[key]:
                f.append(key)
                pending[key] = 1
    return frees


def _steps(graph: TrainingGraph, schedule: list[str]) -> list[int]:
    idx = graph.index
    try:
        return [idx[s] for s in schedule]
    except KeyError:
        unknown = [s for s in schedule if s not in idx]
        raise ScheduleError(f"schedule names nodes not in the graph: {unknown[:5]}") from None


def last_reads(graph: TrainingGraph, schedule: list[str]) -> list[list[tuple[str, int]]]:
    """For each step, the (name, part) outputs whose current instance is read for the last time
    at that step, including the step's own outputs that no later step reads."""
    tab, nodes = _tables(graph), graph.nodes
    return [[(nodes[tab.key_node[key]].name, tab.key_part[key]) for key in f]
            for f in _last_read_keys(tab, _steps(graph, schedule))]


def last_read_nodes(graph: TrainingGraph, schedule: list[str]) -> list[list[int]]:
    """last_reads as node indices, a node once for each of its parts freed (for the plan searches)."""
    tab = _tables(graph)
    return [[tab.key_node[key] for key in f] for f in _last_read_keys(tab, _steps(graph, schedule))]


def unread_steps(graph: TrainingGraph, schedule: list[str]) -> list[int]:
    """The steps whose every output is freed at the step itself (no later step reads that
    instance), of nodes with no kept output: instances the runtime drops as dead code."""
    tab, nodes = _tables(graph), graph.nodes
    steps = _steps(graph, schedule)
    own, key_node = tab.own, tab.key_node
    out = []
    for s, f in enumerate(_last_read_keys(tab, steps)):
        v = steps[s]
        n_own = len(own[v])
        if len(f) < n_own or nodes[v].kept_bytes:
            continue
        if sum(key_node[key] == v for key in f) == n_own:  # every own part freed here
            out.append(s)
    return out


def dead_steps(graph: TrainingGraph, schedule: list[str]) -> set[int]:
    """The steps that removing unread instances round by round removes: each round takes the
    `unread_steps`, in order, while another instance of the same node remains, and removing them can
    leave the instances they read unread for the next round. Which instance each step reads does not
    change (a removed instance had no reader), so it is found once for all reads, on arrays as in
    _simulate_arrays (the plan searches prune thousands of schedules); then round by round only over
    the instances whose last reader a round removed."""
    tab, steps = _tables(graph), _steps(graph, schedule)
    length, a = len(steps), tab.arrays
    if not length:
        return set()
    at, step = np.array(steps, dtype=np.int64), np.arange(length)
    deg = a.read_count[at]
    read_step = np.repeat(step, deg)
    read_key = a.read_keys[np.repeat(a.read_start[at] - np.cumsum(deg) + deg, deg) + np.arange(read_step.size)]
    read_node = a.key_node[read_key]
    # each read's instance: the step that last computed its node before the read (none: never computed)
    code = at * length + step
    order = np.argsort(code, kind="stable")
    pos = np.searchsorted(code[order], read_node * length + read_step) - 1
    source = order[np.maximum(pos, 0)]
    hit = (pos >= 0) & (at[source] == read_node)
    read_step, source = read_step[hit], source[hit]
    readers = np.bincount(source, minlength=length)  # per step: reads of its instance's parts by later steps
    unread = np.flatnonzero((readers == 0) & ~a.kept[at]).tolist()
    if not unread:
        return set()
    count, kept, readers = np.bincount(at, minlength=len(graph.nodes)).tolist(), a.kept.tolist(), readers.tolist()
    starts = np.searchsorted(read_step, np.arange(length + 1)).tolist()  # step s's reads: starts[s]:starts[s + 1]
    source, dead = source.tolist(), set()
    while unread:
        removed = []
        for s in unread:
            v = steps[s]
            if count[v] > 1:
                count[v] -= 1
                removed.append(s)
        dead.update(removed)
        freed = set()
        for s in removed:
            for t in source[starts[s]:starts[s + 1]]:
                readers[t] -= 1
                if not readers[t] and t not in dead and not kept[steps[t]]:
                    freed.add(t)
        # an unread instance left standing was its node's only one, and stays so
        unread = sorted(freed)
    return dead


def forward_end(graph: TrainingGraph, schedule: list[str]) -> int | None:
    """Index of the schedule's last forward step (the first computation of the graph's last
    forward node, where runtime/partition.py splits the step); None without a backward."""
    fwd = graph.forward_nodes
    if len(fwd) == len(graph.nodes) or not fwd or fwd[-1].name not in schedule:
        return None
    return schedule.index(fwd[-1].name)


def _releases(graph: TrainingGraph, schedule: list[str], end: int | None) -> dict[int, int]:
    """Bytes freed after each step besides the values' own last reads: the tangents that are not
    held to the end, and the forward-kept outputs (never recomputed: they are kept outputs)."""
    out: dict[int, int] = {}
    if end is None:
        return out
    last = {name: s for s, name in enumerate(schedule)}  # each node's last step
    first = {name: s for s, name in reversed(list(enumerate(schedule)))}  # ... and its first

    def last_read(readers: tuple[str, ...], default: int) -> int:
        return max([last[r] for r in readers if r in last] + [default])

    for b, readers in graph.tangents:
        if readers:  # zeros AOTAutograd made: the backward graph drops them after their last read
            s = last_read(readers, end + 1)
            out[s] = out.get(s, 0) + b
    for v in _tables(graph).forward_kept:
        if v.name in first:
            for b, readers in v.forward_kept:  # not before it is computed, should that be later
                s = last_read(readers, max(end, first[v.name]))
                out[s] = out.get(s, 0) + b
    return out


def _not_live(nodes, tab: _Tables, live: list[int], computed: bytearray, s: int, vi: int) -> None:
    """Raise the ScheduleError of step s, which reads a part that is not live."""
    for i, keys in tab.reads[vi]:
        if any(live[key] < 0 for key in keys):
            raise ScheduleError(f"step {s} ({nodes[vi].name}) reads {nodes[i].name}, which is not live "
                                f"({'freed' if computed[i] else 'never computed'})")


def simulate(graph: TrainingGraph, schedule: list[str]) -> SimResult:
    """Replay `schedule` over `graph`; raise ScheduleError if it cannot run."""
    tab = _tables(graph)
    steps = _steps(graph, schedule)
    end = forward_end(graph, schedule)
    found = _simulate_arrays(graph, tab, steps, end)
    return found if found is not None else _replay(graph, tab, steps, end, _releases(graph, schedule, end))


def _simulate_arrays(graph: TrainingGraph, tab: _Tables, steps: list[int], end: int | None) -> SimResult | None:
    """simulate's result computed on arrays (the plan searches simulate thousands of schedules:
    this is several times faster than the step-by-step replay, and equal to it), or None where the
    schedule cannot run (then `_replay` raises the error, naming the step). Every read goes to the
    latest instance of the part before it, and an instance is freed after its last read (after its
    own step when nothing reads it): memory after each step is a running sum."""
    n, length = len(graph.nodes), len(steps)
    a = tab.arrays
    if not length:
        return None
    at = np.array(steps, dtype=np.int64)
    step = np.arange(length)
    count = np.bincount(at, minlength=n)
    if (count == 0).any() or ((count > 1) & ~a.recomputable).any():
        return None  # a node never computed, or one computed again that may not be
    # every read (step, key) and every computed part (step, key) of the schedule
    deg = a.read_count[at]
    read_step = np.repeat(step, deg)
    read_key = a.read_keys[np.repeat(a.read_start[at] - np.cumsum(deg) + deg, deg) + np.arange(read_step.size)]
    parts = a.part_count[at]
    made_step = np.repeat(step, parts)
    made_key = np.repeat(a.first[at] - np.cumsum(parts) + parts, parts) + np.arange(made_step.size)
    # each read's instance: the key's latest computation before the read
    made_code = made_key * length + made_step
    order = np.argsort(made_code, kind="stable")
    pos = np.searchsorted(made_code[order], read_key * length + read_step) - 1
    if read_step.size and ((pos < 0).any() or (made_key[order[np.maximum(pos, 0)]] != read_key).any()):
        return None  # a read of a part never computed before it
    freed = made_step.copy()  # the step after which each instance is freed
    np.maximum.at(freed, order[pos], read_step)
    # bytes after each step: its outputs and kept bytes, less what is freed then (sums of byte
    # counts below 2**53: exact in float64), less the tangents and forward-kept outputs released
    delta = a.added[at] - np.bincount(freed, weights=a.part_bytes[made_key], minlength=length).astype(np.int64)
    tangent_bytes = sum(b for b, _ in graph.tangents) if end is not None else 0
    if end is not None and a.release_bytes.size:  # _releases, on the same arrays
        last = np.full(n, -1, dtype=np.int64)
        np.maximum.at(last, at, step)
        first = np.full(n, length, dtype=np.int64)
        np.minimum.at(first, at, step)
        release_at = np.where(a.release_node < 0, end + 1, np.maximum(end, first[np.maximum(a.release_node, 0)]))
        read = a.release_count > 0
        if read.any():
            latest = np.maximum.reduceat(last[a.release_readers], a.release_start[read])
            release_at[read] = np.maximum(release_at[read], latest)
        delta -= np.bincount(release_at, weights=a.release_bytes, minlength=length + 1)[:length].astype(np.int64)
    base = graph.resident_bytes - tangent_bytes  # the tangents come with the backward
    before = np.cumsum(delta) - delta  # what earlier steps left allocated
    now = base + before + a.running[at]
    if end is not None and end + 1 < length:
        now[end + 1:] += tangent_bytes
    top = int(now.max())
    peak, peak_step = (top, int(np.argmax(now))) if top > base else (base, -1)
    per_node = tab.per_node
    total_cost = sum([per_node[v][3] for v in steps], 0.0)  # in schedule order, as the replay adds them
    total_flops = sum([per_node[v][4] for v in steps], 0)
    return SimResult(peak_bytes=peak, peak_step=peak_step, total_cost=total_cost,
                     extra_cost=total_cost - graph.total_cost, total_flops=total_flops,
                     extra_flops=total_flops - graph.total_flops, recomputations=length - n,
                     timeline=tuple(now.tolist()))


def _replay(graph: TrainingGraph, tab: _Tables, steps: list[int], end: int | None,
            releases: dict[int, int]) -> SimResult:
    """simulate's result, step by step; raises the ScheduleError of the first step that cannot run."""
    nodes = graph.nodes
    frees = _last_read_keys(tab, steps)
    live = [-1] * len(tab.part_bytes)  # bytes of each part's current instance; -1: not live
    live_parts = [0] * len(nodes)  # live parts of each node's current instance
    computed = bytearray(len(nodes))
    tangent_bytes = sum(b for b, _ in graph.tangents) if end is not None else 0
    mem = graph.resident_bytes - tangent_bytes  # the tangents come with the backward
    peak, peak_step = mem, -1
    timeline = []
    total_cost, total_flops, recomputes = 0.0, 0, 0
    own, part_bytes, key_node, per_node = tab.own, tab.part_bytes, tab.key_node, tab.per_node
    tangents_at = -1 if end is None else end + 1
    for s, vi in enumerate(steps):
        read_keys, running, added, cost, flops, recomputable = per_node[vi]
        for key in read_keys:
            if live[key] < 0:
                _not_live(nodes, tab, live, computed, s, vi)
        if computed[vi]:
            if not recomputable:
                raise ScheduleError(f"step {s} recomputes {nodes[vi].name}, which may not be recomputed")
            recomputes += 1
            if live_parts[vi]:  # an older instance still pending reads would be shadowed
                raise ScheduleError(f"step {s} recomputes {nodes[vi].name} while its earlier instance is live")
        if s == tangents_at:
            mem += tangent_bytes
        now = mem + running
        timeline.append(now)
        if now > peak:
            peak, peak_step = now, s
        mem += added  # kept bytes leave only with `releases` (forward_kept)
        keys = own[vi]
        for key in keys:
            live[key] = part_bytes[key]
        live_parts[vi] = len(keys)
        computed[vi] = 1
        total_cost += cost
        total_flops += flops
        for key in frees[s]:
            mem -= live[key]
            live[key] = -1
            live_parts[key_node[key]] -= 1
        if s in releases:
            mem -= releases[s]
    missing = [n.name for i, n in enumerate(nodes) if not computed[i]]
    if missing:
        raise ScheduleError(f"schedule never computes {len(missing)} node(s), e.g. {missing[:5]}")
    return SimResult(peak_bytes=peak, peak_step=peak_step, total_cost=total_cost,
                     extra_cost=total_cost - graph.total_cost, total_flops=total_flops,
                     extra_flops=total_flops - graph.total_flops, recomputations=recomputes,
                     timeline=tuple(timeline))
