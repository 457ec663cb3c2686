"""Measure each op's internal temporaries (workspace) and real output storages by running it once.

Kernels allocate scratch memory the graph does not show: CPU `native_dropout` draws its mask as a
float tensor before converting it to bool, its backward converts the mask back, `mse_loss` keeps
an elementwise buffer and a double accumulator while it reduces, and so on. The simulator must count
these to predict the real peak, so we run every distinct op signature of the joint graph once
(random data of the traced shapes) and record how far its peak rises above its inputs and outputs.
On CPU the profiler's memory events give that peak to the byte (every allocation counts, however
small); on CUDA the allocator's counters. Ops on the meta device cannot be probed and count no
workspace.

The same run records the real size of each output's storage: a kernel may return a view into a
larger buffer it allocated, which the trace's fake tensors do not show (CPU `mse_loss` returns its
0-d mean as a view of the elementwise squared error: the loss holds batch x features x 4 bytes,
not 4). The graph must count what the real output holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, record_function

from remat.compat.torch_private import disable_current_modes, profiler_events
from remat.graph_capture.profiling import distinct_storage_bytes, memory_peak, quiet_profile, storage_bytes

__all__ = ["OpProbe", "probe_ops", "tensors_in"]


def _real(v, device: torch.device):
    if isinstance(v, torch.Tensor):
        t = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=device)
        if v.dtype.is_floating_point or v.dtype.is_complex:
            t.normal_(0, 0.1)
        elif v.dtype == torch.bool:
            t.fill_(True)
        else:
            t.zero_()  # a valid index for every gather/embedding/loss target
        return t
    if isinstance(v, (list, tuple)):
        return type(v)(_real(x, device) for x in v)
    return v


def _signature(n: fx.Node) -> tuple:
    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(v.shape), tuple(v.stride()), v.dtype)
            return ("N", repr(v))
        if isinstance(a, (list, tuple)):
            return tuple(sig(x) for x in a)
        return repr(a)

    return (str(n.target), sig(n.args), sig(tuple(sorted(n.kwargs.items()))))


def tensors_in(out) -> list[torch.Tensor]:
    """The tensors of an op's result (or a node's value), flattened in order; the one definition
    that workspace probing, graph building and clone removal share."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in tensors_in(v)]
    return []


def _storages(out, inputs) -> tuple[int | None, ...]:
    """Real storage bytes of each output tensor; None where it is an input's storage (a view)."""
    held = {t.untyped_storage().data_ptr() for t in tensors_in(inputs)}
    return tuple(None if t.untyped_storage().data_ptr() in held else storage_bytes(t)
                 for t in tensors_in(out))


def _out_bytes(out, inputs) -> int:
    """Bytes of the distinct storages the op's result holds that are not its inputs'."""
    return distinct_storage_bytes(tensors_in(out), exclude=tensors_in(inputs))


@dataclass
class OpProbe:
    """What running each op once showed, by fx node name (nodes that could not run are absent)."""

    workspace: dict[str, int] = field(default_factory=dict)  # bytes beyond the outputs while it runs
    # real storage bytes of each tensor output, in `tensors_in` order; None: an input's storage
    out_storages: dict[str, tuple[int | None, ...]] = field(default_factory=dict)


def probe_ops(gm: fx.GraphModule, device: torch.device, min_bytes: int | None = None) -> OpProbe:
    """Run every distinct op signature of `gm` once on `device`. Workspaces under `min_bytes`
    count as 0: by default none on CPU, where the profiler counts every byte exactly and the
    simulator is meant to match it, and 4 KiB on CUDA, whose allocator rounds each block up (512
    bytes and more), so small differences there are rounding, not scratch memory."""
    if min_bytes is None:
        min_bytes = 0 if device.type == "cpu" else 4096
    # AOTAutograd calls the partitioner with its fake-tensor mode active: step outside it
    with disable_current_modes():
        return _probe(gm, device, min_bytes)


def _probe(gm: fx.GraphModule, device: torch.device, min_bytes: int) -> OpProbe:
    result = OpProbe()
    if device.type not in ("cpu", "cuda"):
        return result
    todo: dict[tuple, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            todo.setdefault(_signature(n), []).append(n)
    cases = []
    for sig, nodes in todo.items():
        n = nodes[0]
        try:
            args = fx.node.map_arg(n.args, lambda a: _real(a.meta.get("val"), device))
            kwargs = fx.node.map_arg(n.kwargs, lambda a: _real(a.meta.get("val"), device))
        except Exception:
            continue
        cases.append((nodes, args, kwargs))

    def record(nodes, extra: int, storages: tuple) -> None:
        for m in nodes:
            result.workspace[m.name] = max(0, extra) if extra >= min_bytes else 0
            result.out_storages[m.name] = storages

    if device.type == "cuda":
        for nodes, args, kwargs in cases:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            try:
                out = nodes[0].target(*args, **kwargs)
            except Exception:
                continue
            torch.cuda.synchronize()
            inputs = (args, list(kwargs.values()))
            record(nodes, torch.cuda.max_memory_allocated() - base - _out_bytes(out, inputs),
                   _storages(out, inputs))
            del out
        return result
    outs: list[tuple[int, tuple] | None] = []
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, (nodes, args, kwargs) in enumerate(cases):
            with record_function(f"remat_probe_{i}"):
                try:
                    out = nodes[0].target(*args, **kwargs)
                except Exception:
                    outs.append(None)
                    continue
            inputs = (args, list(kwargs.values()))
            outs.append((_out_bytes(out, inputs), _storages(out, inputs)))
            del out  # outside the range: its free is not part of the op
    events = profiler_events(prof)
    ranges = {}
    for e in events:
        if e.name().startswith("remat_probe_"):
            ranges[int(e.name().rsplit("_", 1)[1])] = (e.start_ns(), e.start_ns() + e.duration_ns())
    for i, (nodes, _, _) in enumerate(cases):
        if outs[i] is None or i not in ranges:
            continue
        record(nodes, memory_peak(events, *ranges[i]) - outs[i][0], outs[i][1])
    return result
