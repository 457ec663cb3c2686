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

from remat.graph_capture.training_graph import TrainingGraph

__all__ = ["SimResult", "ScheduleError", "simulate", "last_reads", "forward_end"]


class ScheduleError(ValueError):
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


def _parts_read(u, reader: str) -> list[int]:
    """Which of u's parts a read by `reader` touches (all of them if it is named in none)."""
    parts = _parts(u)
    hit = [k for k, (_, readers) in enumerate(parts) if readers is None or reader in readers]
    return hit or list(range(len(parts)))


def last_reads(graph: TrainingGraph, schedule: list[str]) -> list[list[tuple[str, int]]]:
    """For each step, the (name, part) outputs whose current instance is read for the last time
    at that step, including the step's own outputs that no later step reads."""
    nodes = [graph.node(s) for s in schedule]
    frees: list[list[tuple[str, int]]] = [[] for _ in schedule]
    pending: set[tuple[str, int]] = set()  # parts already read by a later step, same instance
    # walk backwards: a read at step s is the last read of its instance if no later step read the
    # same part before a later recomputation of it
    for s in range(len(schedule) - 1, -1, -1):
        v = nodes[s]
        for k in range(len(_parts(v))):
            if (v.name, k) not in pending:
                frees[s].append((v.name, k))  # this instance's part is never read
            pending.discard((v.name, k))  # earlier instances are a different story
        for i in v.inputs:
            for k in _parts_read(graph.node(i), v.name):
                if (i, k) not in pending:
                    frees[s].append((i, k))
                    pending.add((i, k))
    return frees


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
    steps: dict[str, list[int]] = {}
    for s, name in enumerate(schedule):
        steps.setdefault(name, []).append(s)

    def last_read(readers: tuple[str, ...], default: int) -> int:
        return max([s for r in readers for s in steps.get(r, ())] + [default])

    for b, readers in graph.tangents:
        if readers:  # zeros AOTAutograd made: the backward graph drops them after their last read
            s = last_read(readers, end + 1)
            out[s] = out.get(s, 0) + b
    for v in graph.nodes:
        if v.forward_kept and v.name in steps:
            for b, readers in v.forward_kept:  # not before it is computed, should that be later
                s = last_read(readers, max(end, steps[v.name][0]))
                out[s] = out.get(s, 0) + b
    return out


def simulate(graph: TrainingGraph, schedule: list[str]) -> SimResult:
    """Replay `schedule` over `graph`; raise ScheduleError if it cannot run."""
    idx = graph.index
    computed: set[str] = set()
    unknown = [s for s in schedule if s not in idx]
    if unknown:
        raise ScheduleError(f"schedule names nodes not in the graph: {unknown[:5]}")
    frees = last_reads(graph, schedule)
    live: dict[str, dict[int, int]] = {}  # name -> {part: bytes} of its current instance
    end = forward_end(graph, schedule)
    tangent_bytes = sum(b for b, _ in graph.tangents) if end is not None else 0
    releases = _releases(graph, schedule, end)
    mem = graph.resident_bytes - tangent_bytes  # the tangents come with the backward
    peak, peak_step = mem, -1
    timeline = []
    total_cost, total_flops, recomputes = 0.0, 0, 0
    for s, name in enumerate(schedule):
        v = graph.nodes[idx[name]]
        for i in v.inputs:
            if i not in live or any(k not in live[i] for k in _parts_read(graph.nodes[idx[i]], name)):
                raise ScheduleError(f"step {s} ({name}) reads {i}, which is not live "
                                    f"({'freed' if i in computed else 'never computed'})")
        if name in computed:
            if not v.recomputable:
                raise ScheduleError(f"step {s} recomputes {name}, which may not be recomputed")
            recomputes += 1
            if name in live:  # an older instance still pending reads would be shadowed
                raise ScheduleError(f"step {s} recomputes {name} while its earlier instance is live")
        if end is not None and s == end + 1:
            mem += tangent_bytes
        now = mem + v.out_bytes + v.kept_bytes + v.workspace_bytes
        timeline.append(now)
        if now > peak:
            peak, peak_step = now, s
        mem += v.out_bytes + v.kept_bytes  # kept bytes leave only with `releases` (forward_kept)
        live[name] = {k: b for k, (b, _) in enumerate(_parts(v))}
        computed.add(name)
        total_cost += v.cost
        total_flops += v.flops
        for f, k in frees[s]:
            mem -= live[f].pop(k)
            if not live[f]:
                del live[f]
        mem -= releases.get(s, 0)
    missing = [n.name for n in graph.nodes if n.name not in computed]
    if missing:
        raise ScheduleError(f"schedule never computes {len(missing)} node(s), e.g. {missing[:5]}")
    return SimResult(peak_bytes=peak, peak_step=peak_step, total_cost=total_cost,
                     extra_cost=total_cost - graph.total_cost, total_flops=total_flops,
                     extra_flops=total_flops - graph.total_flops, recomputations=recomputes,
                     timeline=tuple(timeline))
