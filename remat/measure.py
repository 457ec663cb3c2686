"""Measuring what a training step really does: peak memory and FLOPs."""
from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["measure_peak", "resident_bytes", "count_flops", "quiet_profile"]


def resident_bytes(things: Iterable) -> int:
    """Bytes of the distinct storages of the given tensors and modules' parameters and buffers."""
    seen: set[int] = set()
    total = 0
    for x in things:
        tensors = list(x.parameters()) + list(x.buffers()) if isinstance(x, nn.Module) else [x]
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            if s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def measure_peak(fn: Callable[[], object], resident: Iterable = (), device: str | torch.device | None = None) -> int:
    """Peak bytes while `fn()` runs.

    CUDA: `torch.cuda.max_memory_allocated` (everything the allocator holds, so what is already
    on the device counts by itself). CPU: the bytes of `resident` (modules and tensors live before
    the call, e.g. the model and its inputs) plus the highest running sum of the profiler's
    allocation and free events during the call, i.e. live tensor bytes the way an allocator
    without caching would count them."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.profiler import ProfilerActivity

    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        if e.device_type() != torch.autograd.DeviceType.CPU:
            continue
        live += e.nbytes()
        peak = max(peak, live)
    return resident_bytes(resident) + peak


# Kineto (the profiler's C++ side) writes these two lines to fd 2 at every start and stop, whatever
# KINETO_LOG_LEVEL says short of also hiding its errors:
#   USDT:2026-11-30 03:14:35 4681:4681 SyncActivityProfilerHandler.cpp:52] profiler_start
_USDT_LINE = re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$")


@contextmanager
def _without_usdt_lines() -> Iterator[None]:
    """Run the body with fd 2 sent to a temporary file, then write back to fd 2 every line except
    Kineto's USDT start/stop markers: warnings and errors printed meanwhile stay visible."""
    saved = None
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (closed): nothing to filter
        pass
    if saved is None:
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            try:
                if sys.stderr is not None:
                    sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode("utf-8", "replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not _USDT_LINE.match(line))
            data = kept.encode("utf-8")
            while data:  # os.write may write less than asked
                data = data[os.write(2, data):]


@contextmanager
def quiet_profile(**kwargs) -> Iterator["torch.profiler.profile"]:
    """`torch.profiler.profile(**kwargs)` without the "USDT ... profiler_start/stop" lines Kineto
    prints on stderr when it starts and stops. Only the start and the stop are filtered, not the
    code profiled, and every other line is passed through."""
    from torch.profiler import profile

    prof = profile(**kwargs)
    with _without_usdt_lines():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _without_usdt_lines():
            prof.__exit__(None, None, None)


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
