"""A measured cost model: each TrainingGraph node costs the time its ops take on the capture device.

The default cost model (graph_capture/build.py) counts FLOP-equivalents: matmul-like FLOPs plus a
weight per byte read or written. It is deterministic (the same input gives the same plan) but can
misjudge ops whose speed is not proportional to either (small kernels dominated by dispatch,
convolutions with odd shapes, reductions). Checkmate profiles its ops instead; this module does the
same, opt-in (`remat.capture(..., cost_model="measured")`):

  * every distinct call of the joint graph (op, argument shapes, strides, dtypes and non-tensor
    arguments: workspace.py's `op_groups`) is timed once, on random real tensors of the traced
    shapes on the capture device, and the time is shared by every fx node making that call;
  * each call runs `warmup` times untimed, then `repeats` times, each timed alone with
    `time.perf_counter_ns`; its time is the median. On CUDA a timed run is CUDA_BATCH calls queued
    back to back between two synchronisations (the op's cost in a stream of launches). An op
    that cannot run on made-up arguments (remat::batch_norm_stats reads what remat::batch_norm
    attached to its output) is timed on arguments its producers computed, made before each run;
  * a TrainingGraph node costs the sum of its fx members' times (its allocating op, and the views
    and getitems that alias it: getitems run nothing and cost 0), at least MIN_COST_NS, timed as
    the runtime *recomputes* it: cost only matters for recomputations (every node runs once
    whatever the plan), and remat::dropout / remat::batch_norm recompute with another call than
    their first computation (the mask replayed by a private generator's bernoulli_; the output
    without its statistics), listed in `meta["cost_timing"]["recomputed_differently"]`. The
    first computations' total is kept in
    `meta["cost_timing"]["first_computation_ns"]`: the step's own time, for 1 + extra / step;
  * a node with an op that cannot run on made-up data (none of the models here has one) is
    priced by the FLOP model, converted to nanoseconds at the rate the timed nodes show overall;
    such nodes are listed in `meta["cost_timing"]["estimated_nodes"]`.

The returned graph has `meta["cost_model"] = "measured"` and `meta["cost_unit"] = "ns"`; only
costs change, so its fingerprint (which hashes names, edges, bytes and flags, not costs) is the
FLOP-model graph's, and a plan saved from one deploys on a re-capture with either model.
Measured times vary from run to run (the machine's load, caches): plans solved on them can differ
between captures, which is why the FLOP model stays the default.
"""
from __future__ import annotations

import dataclasses
import operator
import statistics
import time

import torch
import torch.fx as fx

from remat.core.errors import RematError
from remat.compat.torch_private import disable_current_modes
from remat.graph_capture.bn_replay import is_recomputable_batch_norm, recomputation_args
from remat.graph_capture.build import JointGraphInfo
from remat.core.progress import stage
from remat.graph_capture.rng_replay import is_replayable_dropout, probe_callable
from remat.core.training_graph import TrainingGraph
from remat.graph_capture.workspace import op_groups, op_signature, real_args, real_like, tensors_in

__all__ = ["COST_MODELS", "MIN_COST_NS", "OpTimingError", "time_ops", "measured_cost_graph", "shared_signature",
           "recomputation_form"]

COST_MODELS = ("flops", "measured")
MIN_COST_NS = 1.0  # every node costs > 0, so no recomputation is free
CUDA_BATCH = 10  # calls per timed run on CUDA (see _time_call)


class OpTimingError(RematError, RuntimeError):
    """The graph's ops cannot be timed here (tensors on the meta device, or on several devices)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_call(fn, make_args, device: torch.device, warmup: int, repeats: int, fresh: bool = False) -> float:
    """Median nanoseconds of fn(*args, **kwargs) over `repeats` runs after `warmup` untimed ones;
    (args, kwargs) = make_args(), once, or before every run with `fresh` (not timed).

    On CUDA a run is CUDA_BATCH back-to-back calls between two synchronisations, divided by
    CUDA_BATCH: in a step, kernels are queued while earlier ones run, so an op costs its kernel's
    time or its launch's host time, whichever is longer, not both plus a synchronisation (a single
    synchronised call priced the H200 GPT's 10.2 ms keep_all step at 11.2 ms, and its
    recomputations at 1.7x what they added). `fresh` arguments are made between calls: one call a run."""
    args, kwargs = make_args()
    batch = CUDA_BATCH if device.type == "cuda" and not fresh else 1
    times = []
    for k in range(warmup + repeats):
        if fresh and k:
            args = kwargs = None
            args, kwargs = make_args()
        _sync(device)
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            out = fn(*args, **kwargs)
            del out  # freed before the next call: the caching allocator hands the same block back
        _sync(device)
        if k >= warmup:
            times.append((time.perf_counter_ns() - t0) / batch)
    return float(statistics.median(times))


def _run(n: fx.Node, device: torch.device):
    """`n`'s value computed from random arguments (a getitem: of its source's value)."""
    if n.op == "call_function" and n.target is operator.getitem:
        return _run(n.args[0], device)[n.args[1]]
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        args, kwargs = real_args(n, device)()
        return probe_callable(n.target)(*args, **kwargs)
    return real_like(n.meta.get("val"), device)


def _args_from_producers(n: fx.Node, device: torch.device) -> tuple[tuple, dict]:
    """`n`'s arguments computed by their own ops from random data: for an op that only runs on
    what its producer really returned (remat::batch_norm_stats takes the statistics
    remat::batch_norm attached to its output)."""
    env = {a: _run(a, device) for a in n.all_input_nodes}
    return fx.node.map_arg(n.args, env.__getitem__), fx.node.map_arg(n.kwargs, env.__getitem__)


def recomputation_form(n: fx.Node):
    """How the runtime changes `n`'s arguments when it recomputes it (runtime/partition.py), or
    None when a recomputation is the same call: remat::dropout replays its mask from the saved
    state (replay=True), remat::batch_norm drops its statistics (recompute=True)."""
    if is_replayable_dropout(n):
        return lambda args: (*args[:3], True)
    if is_recomputable_batch_norm(n):
        return recomputation_args
    return None


def _time_op(n: fx.Node, device: torch.device, warmup: int, repeats: int, recomputed: bool = False) -> float:
    """Median nanoseconds of `n`'s op on random arguments of its traced shapes; if it cannot run on
    those, on arguments its producers computed (fresh ones for each run, made untimed). With
    `recomputed`, the call as the runtime emits a recomputation of `n`."""
    form = recomputation_form(n) if recomputed else None
    fn = n.target if form is not None else probe_callable(n.target)

    def made(make):
        def make_args():
            args, kwargs = make()
            return (form(args) if form is not None else args), kwargs
        return make_args

    try:
        return _time_call(fn, made(real_args(n, device)), device, warmup, repeats)
    except Exception:
        return _time_call(fn, made(lambda: _args_from_producers(n, device)), device, warmup, repeats, fresh=True)


def _device_of(gm: fx.GraphModule) -> torch.device:
    devices = {t.device for n in gm.graph.nodes if n.op == "placeholder" for t in tensors_in(n.meta.get("val"))}
    if len(devices) != 1:
        raise OpTimingError(f"cost_model='measured' times the step's ops on its device, but its tensors are on "
                            f"{', '.join(sorted(map(str, devices))) or 'no device'}; use cost_model='flops'")
    device = next(iter(devices))
    if device.type not in ("cpu", "cuda"):
        raise OpTimingError(f"cost_model='measured' cannot time ops on the {device.type} device (no data to run "
                            f"them on); use cost_model='flops'")
    return device


def time_ops(gm: fx.GraphModule, device: torch.device | None = None, *, warmup: int = 2,
             repeats: int = 5, recomputed: bool = False) -> tuple[dict[str, float], dict[tuple, float]]:
    """(fx node name -> median nanoseconds of its op, signature -> the same) for every ATen op
    node of `gm`, each distinct signature timed once on random tensors of the traced shapes on
    `device` (default: where the graph's inputs are). Ops that fail to run are absent. The global
    RNG states are restored afterwards (random ops draw while being timed). With `recomputed`,
    only the ops whose recomputation is another call (`recomputation_form`), as recomputed."""
    device = device or _device_of(gm)
    groups = op_groups(gm)
    if recomputed:
        groups = {sig: nodes for sig, nodes in groups.items() if recomputation_form(nodes[0]) is not None}
    by_sig: dict[tuple, float] = {}
    rng_devices = [device] if device.type == "cuda" else []
    # AOTAutograd calls the partitioner with its fake-tensor mode active: step outside it
    with disable_current_modes(), torch.no_grad(), torch.random.fork_rng(devices=rng_devices), \
            stage("timing ops", total=len(groups), unit="op") as progress:
        for sig, nodes in groups.items():
            progress.advance()
            try:
                by_sig[sig] = _time_op(nodes[0], device, warmup, repeats, recomputed)
            except Exception:  # cannot run on made-up data: priced by the FLOP model (see the caller)
                continue
    per_node = {n.name: by_sig[sig] for sig, nodes in groups.items() if sig in by_sig for n in nodes}
    return per_node, by_sig


def _runs_nothing(n: fx.Node) -> bool:
    return n.op != "call_function" or n.target is operator.getitem


def measured_cost_graph(info: JointGraphInfo, device: torch.device | None = None, *, warmup: int = 2,
                        repeats: int = 5) -> TrainingGraph:
    """`info.graph` with each node's cost the measured nanoseconds of its fx ops (see the module
    docstring); structure, bytes and flags unchanged."""
    device = device or _device_of(info.gm)
    t0 = time.perf_counter()
    per_node, by_sig = time_ops(info.gm, device, warmup=warmup, repeats=repeats)
    again, _ = time_ops(info.gm, device, warmup=warmup, repeats=repeats, recomputed=True)
    first: dict[str, float] = {}  # node -> ns of its first computation
    timed: dict[str, float] = {}  # node -> ns of a recomputation (its cost)
    for name, members in info.groups.items():
        total = recompute = 0.0
        ok = True
        for m in members:
            if _runs_nothing(m):
                continue
            if m.name not in per_node:
                ok = False
                break
            total += per_node[m.name]
            recompute += again.get(m.name, per_node[m.name])
        if ok:
            first[name] = max(total, MIN_COST_NS)
            timed[name] = max(recompute, MIN_COST_NS)
    g = info.graph
    # untimed nodes: the FLOP model's cost at the rate (ns per FLOP-equivalent) the timed ones show
    flop_cost = sum(n.cost for n in g.nodes if n.name in timed)
    rate = sum(first.values()) / flop_cost if flop_cost > 0 else 1.0
    estimated = [n.name for n in g.nodes if n.name not in timed]
    for n in g.nodes:
        if n.name not in timed:
            first[n.name] = timed[n.name] = max(n.cost * rate, MIN_COST_NS)
    nodes = tuple(dataclasses.replace(n, cost=timed[n.name]) for n in g.nodes)
    meta = {**g.meta, "cost_model": "measured", "cost_unit": "ns",
            "cost_timing": {"device": str(device), "warmup": warmup, "repeats": repeats,
                            "signatures": len(by_sig), "torch_threads": torch.get_num_threads(),
                            "first_computation_ns": sum(first.values()),
                            "recomputed_differently": [k for k, ms in info.groups.items()
                                                       if any(m.name in again for m in ms)],
                            "seconds": round(time.perf_counter() - t0, 3), "estimated_nodes": estimated}}
    return dataclasses.replace(g, nodes=nodes, meta=meta)


def shared_signature(n: fx.Node) -> tuple:
    """The key under which `n`'s timing is shared (workspace.py's op signature)."""
    return op_signature(n)
