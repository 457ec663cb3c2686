"""Measure each op's internal temporaries (workspace) by running it once on real tensors.

Kernels allocate scratch memory the graph does not show: CPU `native_dropout` draws its mask as a
float tensor before converting it to bool, its backward converts the mask back, and so on. The
simulator must count these to predict the real peak, so we run every distinct op signature of
the joint graph once (random data of the traced shapes) and record how far its peak rises above
its inputs and outputs. On CPU the profiler's memory events give that peak, on CUDA the
allocator's counters. Ops on the meta device cannot be probed and count no workspace.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["probe_workspaces"]


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


def _out_bytes(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.untyped_storage().nbytes()
    if isinstance(out, (list, tuple)):
        seen, total = set(), 0
        for t in out:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total
    return 0


def probe_workspaces(gm: fx.GraphModule, device: torch.device, min_bytes: int = 4096) -> dict[str, int]:
    """fx node name -> bytes its op allocates beyond its outputs while it runs."""
    # AOTAutograd calls the partitioner with its fake-tensor mode active: step outside it
    with _disable_current_modes():
        return _probe(gm, device, min_bytes)


def _probe(gm: fx.GraphModule, device: torch.device, min_bytes: int) -> dict[str, int]:
    if device.type not in ("cpu", "cuda"):
        return {}
    todo: dict[tuple, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            todo.setdefault(_signature(n), []).append(n)
    result: dict[str, int] = {}
    cases = []
    for sig, nodes in todo.items():
        n = nodes[0]
        try:
            args = fx.node.map_arg(n.args, lambda a: _real(a.meta.get("val"), device))
            kwargs = fx.node.map_arg(n.kwargs, lambda a: _real(a.meta.get("val"), device))
        except Exception:
            continue
        cases.append((nodes, args, kwargs))
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
            extra = torch.cuda.max_memory_allocated() - base - _out_bytes(out)
            del out
            for m in nodes:
                result[m.name] = max(0, extra) if extra >= min_bytes else 0
        return result
    outs: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, (nodes, args, kwargs) in enumerate(cases):
            with record_function(f"remat_probe_{i}"):
                try:
                    out = nodes[0].target(*args, **kwargs)
                    outs.append(_out_bytes(out))
                    del out
                except Exception:
                    outs.append(-1)
    events = list(prof.profiler.kineto_results.events())
    ranges = {}
    for e in events:
        if e.name().startswith("remat_probe_"):
            ranges[int(e.name().rsplit("_", 1)[1])] = (e.start_ns(), e.start_ns() + e.duration_ns())
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    for i, (nodes, _, _) in enumerate(cases):
        if outs[i] < 0 or i not in ranges:
            continue
        lo, hi = ranges[i]
        live = peak = 0
        for t, b in mem:
            if lo <= t <= hi:
                live += b
                peak = max(peak, live)
        extra = peak - outs[i]
        for m in nodes:
            result[m.name] = extra if extra >= min_bytes else 0
    return result
