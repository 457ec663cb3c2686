"""Measuring what a training step really does: peak memory and FLOPs."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from remat.compat.torch_private import profiler_events
# quiet_profile is re-exported: the profiler without Kineto's USDT lines on stderr
from remat.graph_capture.profiling import distinct_storage_bytes, memory_peak, quiet_profile

__all__ = ["measure_peak", "resident_bytes", "count_flops", "quiet_profile"]


def _tensors_of(things: Iterable) -> list[torch.Tensor]:
    """The given tensors and the given modules' parameters and buffers."""
    tensors = []
    for x in things:
        tensors += list(x.parameters()) + list(x.buffers()) if isinstance(x, nn.Module) else [x]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def resident_bytes(things: Iterable) -> int:
    """Bytes of the distinct storages of the given tensors and modules' parameters and buffers."""
    return distinct_storage_bytes(_tensors_of(things))


def _work_device(resident: list) -> torch.device | None:
    """Where the step's work is: the GPU any resident tensor is on; with no resident tensors, the
    current GPU if CUDA holds memory in this process (the work was put there); else None (CPU)."""
    tensors = _tensors_of(resident)
    for t in tensors:
        if t.device.type == "cuda":
            return t.device
    if not tensors and torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.memory_allocated():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def measure_peak(fn: Callable[[], object], resident: Iterable = (), device: str | torch.device | None = None) -> int:
    """Peak bytes while `fn()` runs.

    CUDA: `torch.cuda.max_memory_allocated` (everything the allocator holds, so what is already
    on the device counts by itself). CPU: the bytes of `resident` (modules and tensors live before
    the call, e.g. the model and its inputs) plus the highest running sum of the profiler's
    allocation and free events during the call, i.e. live tensor bytes the way an allocator
    without caching would count them.

    `device` None: measured where the work is, CUDA when any of `resident` is on a GPU (or, with
    nothing resident given, when CUDA holds memory in this process), else CPU."""
    resident = list(resident)
    device = torch.device(device) if device is not None else _work_device(resident)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.profiler import ProfilerActivity

    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    return resident_bytes(resident) + memory_peak(profiler_events(prof))


class _FlopCounter(TorchDispatchMode):
    """Sums torch.utils.flop_counter's formulas over every op run (works where FlopCounterMode's
    module hooks do not, e.g. inside AOTAutograd's compiled functions)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in flop_registry:
            self.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
        return out


def count_flops(fn: Callable[[], object]) -> int:
    """Matmul-like FLOPs performed while `fn()` runs, forward and backward."""
    with _FlopCounter() as c:
        fn()
    return c.flops
