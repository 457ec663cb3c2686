"""Measuring memory for real: the profiler without Kineto's noise, the peak of its memory events,
and the bytes tensors' storages hold.

Shared by workspace probing (graph_capture/workspace.py, one op at a time) and by measuring a whole
training step (remat/measure.py), which must count bytes the same way for the simulator's
predictions to equal the measurements: a storage counts once however many tensors view it, and the
profiler's allocations (+ bytes) and frees (- bytes) are summed in time order.
"""
from __future__ import annotations

import bisect
import itertools
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from remat.compat.torch_private import profiler_enabled
from remat.core.errors import RematError

__all__ = ["quiet_profile", "profiler_recording", "ProfilerBusyError", "memory_peak", "memory_peaks", "storage_bytes",
           "distinct_storage_bytes", "ALLOCATORS", "CUDA_BLOCK_BYTES", "allocation_bytes"]

# How each device's allocator counts an allocation of n bytes (the memory model a graph is built
# with): "cpu" exactly n (the profiler's memory events, what remat.measure_peak sums); "cuda" n
# rounded up to the caching allocator's 512-byte blocks (what torch.cuda.max_memory_allocated
# counts). The CUDA allocator can hand a large request a whole cached or new segment (up to 1 MiB
# more, when the rest is too small to split off); that depends on the allocator's history and is
# not modelled.
ALLOCATORS = ("cpu", "cuda")
CUDA_BLOCK_BYTES = 512


def allocation_bytes(nbytes: int, allocator: str = "cpu") -> int:
    """What `allocator` ("cpu" or "cuda", see ALLOCATORS) counts for a storage of `nbytes` bytes."""
    if allocator == "cuda":
        return -(-int(nbytes) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    if allocator != "cpu":
        raise ValueError(f"unknown allocator {allocator!r}: one of {ALLOCATORS}")
    return int(nbytes)


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage `t` views (the whole storage, not only the part `t` covers); for a
    tensor without a storage (sparse, some subclasses), its dense size."""
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 - any tensor type that has no storage to ask
        return t.numel() * t.element_size()


def distinct_storage_bytes(tensors: Iterable[torch.Tensor], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages of `tensors` (a storage counts once however many of them
    view it), leaving out the storages of `exclude`."""
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    total = 0
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += storage_bytes(t)
    return total


def memory_peak(allocations: Iterable, start_ns: int | None = None, end_ns: int | None = None) -> int:
    """The highest running sum, in time order, of the CPU allocations and frees among `allocations`
    (a profile's, `remat.compat.torch_private.profiler_allocations`) that happen within
    [start_ns, end_ns] (None: unbounded): the most bytes the window allocated on top of what was
    live when it began, as an allocator without caching would hold them.

    A free counts only where the profile saw its block allocated, at that allocation's size. The
    profiler's CPU memory reporter remembers the size of every block allocated while it profiles,
    and forgets it only when the block is freed while it profiles: a block that outlives one profile
    leaves its size behind, and a later block at the same address, allocated outside any profile
    and freed inside one, is reported freed at that stale size. Counted, such frees (of memory the
    profiled code never allocated) would lower the peak by a different amount on every run."""
    return memory_peaks(allocations, [(start_ns, end_ns)])[0]


def memory_peaks(allocations: Iterable, windows: Iterable[tuple[int | None, int | None]]) -> list[int]:
    """`memory_peak` of each (start_ns, end_ns) window of one profile's `allocations`: the
    allocations are put in time order and paired with their frees once, not once per window (a
    trace probes hundreds of ops in one profile)."""
    cpu = sorted((a for a in allocations if a.device == "cpu"), key=lambda a: a.time_ns)  # stable
    blocks: dict[int, int] = {}  # address -> bytes of the block allocated there, while it lives
    times: list[int] = []
    changes: list[int] = []  # each counted allocation's bytes, each counted free's minus its block's
    for a in cpu:
        if a.nbytes > 0:
            blocks[a.ptr] = change = a.nbytes
        elif a.ptr in blocks:
            change = -blocks.pop(a.ptr)
        else:
            continue
        times.append(a.time_ns)
        changes.append(change)
    peaks = []
    for start_ns, end_ns in windows:
        first = 0 if start_ns is None else bisect.bisect_left(times, start_ns)
        stop = len(times) if end_ns is None else bisect.bisect_right(times, end_ns)
        peaks.append(max(itertools.accumulate(changes[first:stop], initial=0)))
    return peaks


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


class ProfilerBusyError(RematError, RuntimeError):
    """Another profiler is already recording in this process: a second one would end its
    recording (torch keeps one profiling session at a time), so nothing it measured would count."""


def profiler_recording() -> bool:
    """Whether a profiler (torch.profiler.profile, remat.measure_peak, ...) is recording now."""
    return profiler_enabled()


@contextmanager
def quiet_profile(**kwargs) -> Iterator[torch.profiler.profile]:
    """`torch.profiler.profile(**kwargs)` without the "USDT ... profiler_start/stop" lines Kineto
    prints on stderr when it starts and stops. Only the start and the stop are filtered, not the
    code profiled, and every other line is passed through. Raises ProfilerBusyError where a
    profiler is recording already: torch would end that one's session when this one stops, and it
    would measure nothing (a planned module planning a new call inside remat.measure_peak did)."""
    from torch.profiler import profile

    if profiler_recording():
        raise ProfilerBusyError("another profiler is already recording in this process (torch.profiler.profile, "
                                "remat.measure_peak or remat.count_flops): starting a second one would end its "
                                "recording; run this outside it")
    prof = profile(**kwargs)
    with _without_usdt_lines():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _without_usdt_lines():
            prof.__exit__(None, None, None)
