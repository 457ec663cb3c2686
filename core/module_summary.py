"""What a plan does, in terms a reader knows: per module, and step by step.

* `module_summary(graph, schedule)`: for each module path (the TrainingGraph nodes' `module_path`,
  e.g. "h.0.attn"), the bytes of its forward values the backward reads (what keep_all holds), how
  many of those bytes the plan keeps and which values it recomputes (bytes, recomputations, extra
  cost), and the module's cost in one plain step. Rows add up: a prefix's numbers are the sum of
  its rows (`rollup`), so a report can show "h.0" or "h.0.attn.c_attn" from the same summary.
* `step_timeline(graph, schedule)`: memory while each step runs (the simulator's), where each step
  starts and ends in compute (cumulative cost), which steps recompute, where the forward ends, and
  the peak: what `remat inspect` plots.

Plain data only (no torch), like the rest of the solver.
"""
from __future__ import annotations

from dataclasses import dataclass

from remat.core.training_graph import TrainingGraph
from remat.core.simulator import forward_end, simulate

__all__ = ["TOP_LEVEL", "module_summary", "rollup", "StepTimeline", "step_timeline"]

TOP_LEVEL = "(top level)"  # how nodes with no module path (the loss, the model's own ops) are named


def _path(p: str) -> str:
    return p or TOP_LEVEL


def module_summary(graph: TrainingGraph, schedule: list[str]) -> list[dict]:
    """One row per module path, in the order modules first appear in the graph:
    module, saved_bytes (forward values the backward reads: what keep_all keeps), kept_bytes (those
    the plan keeps from the forward to the backward), recomputed_values and recomputed_bytes
    (distinct values computed again, each counted once), recomputations (steps that recompute),
    extra_cost (their cost), cost (the module's nodes computed once: its share of a plain step)."""
    users = graph.users
    recompute_steps: dict[str, int] = {}
    seen: set[str] = set()
    for name in schedule:
        if name in seen:
            recompute_steps[name] = recompute_steps.get(name, 0) + 1
        seen.add(name)
    rows: dict[str, dict] = {}
    for n in graph.nodes:
        r = rows.setdefault(_path(n.module_path), {
            "module": _path(n.module_path), "saved_bytes": 0, "kept_bytes": 0, "recomputed_values": 0,
            "recomputed_bytes": 0, "recomputations": 0, "extra_cost": 0.0, "cost": 0.0})
        r["cost"] += n.cost
        if n.is_backward:
            continue
        saved = n.out_bytes > 0 and any(graph.node(u).is_backward for u in users[n.name])
        k = recompute_steps.get(n.name, 0)
        if saved:
            r["saved_bytes"] += n.out_bytes
            if not k:
                r["kept_bytes"] += n.out_bytes
        if k:
            r["recomputed_values"] += 1
            r["recomputed_bytes"] += n.out_bytes
            r["recomputations"] += k
            r["extra_cost"] += k * n.cost
    return list(rows.values())


def rollup(rows: list[dict], depth: int | None) -> list[dict]:
    """`rows` (from module_summary) summed over module paths cut to their first `depth` parts
    ("h.0.attn.c_attn" at depth 2 is "h.0"); None: as they are."""
    if depth is None:
        return [dict(r) for r in rows]
    out: dict[str, dict] = {}
    for r in rows:
        key = r["module"] if r["module"] == TOP_LEVEL else ".".join(r["module"].split(".")[:depth])
        acc = out.setdefault(key, {k: (key if k == "module" else 0) for k in r})
        for k, v in r.items():
            if k != "module":
                acc[k] += v
    return list(out.values())


@dataclass(frozen=True)
class StepTimeline:
    """A schedule replayed step by step (all lists have one entry per step)."""

    names: tuple[str, ...]  # the node each step computes
    memory: tuple[int, ...]  # bytes in use while the step runs (the simulator's timeline)
    start: tuple[float, ...]  # cumulative cost before the step
    end: tuple[float, ...]  # cumulative cost after it
    recompute: tuple[bool, ...]  # the step computes its node again
    backward: tuple[bool, ...]  # the step belongs to the backward pass
    modules: tuple[str, ...]  # the module path of each step's node
    forward_end: int | None  # index of the forward's last step (None: no backward)
    peak_bytes: int
    peak_step: int  # -1 when the peak is the resident memory before the first step
    resident_bytes: int  # parameters, buffers and inputs (live throughout)


def step_timeline(graph: TrainingGraph, schedule: list[str]) -> StepTimeline:
    """Replay `schedule` on `graph` (ScheduleError if it cannot run) and lay each step out in
    compute: step s runs from start[s] to end[s] in the graph's cost units."""
    sim = simulate(graph, schedule)
    starts, ends, rec, bwd, mods = [], [], [], [], []
    t = 0.0
    seen: set[str] = set()
    for name in schedule:
        v = graph.node(name)
        starts.append(t)
        t += v.cost
        ends.append(t)
        rec.append(name in seen)
        bwd.append(v.is_backward)
        mods.append(_path(v.module_path))
        seen.add(name)
    tangents = sum(b for b, _ in graph.tangents)
    return StepTimeline(names=tuple(schedule), memory=sim.timeline, start=tuple(starts), end=tuple(ends),
                        recompute=tuple(rec), backward=tuple(bwd), modules=tuple(mods),
                        forward_end=forward_end(graph, schedule), peak_bytes=sim.peak_bytes,
                        peak_step=sim.peak_step, resident_bytes=graph.resident_bytes - tangents)
