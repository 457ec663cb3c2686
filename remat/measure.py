"""Measuring what a training step really does: peak memory and FLOPs."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
from torch.utils.flop_counter import flop_registry

from remat.compat.torch_private import profiler_allocations
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
    without caching would count them (a free counts only where the call allocated the block:
    see `remat.graph_capture.profiling.memory_peak`).

    `device` None: measured where the work is, CUDA when any of `resident` is on a GPU (or, with
    nothing resident given, when CUDA holds memory in this process), else CPU. On the CPU it
    raises ProfilerBusyError inside another profiler's recording (torch keeps one at a time)."""
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
    return resident_bytes(resident) + memory_peak(profiler_allocations(prof))


# Where each convolution op keeps (stride, padding, dilation, transposed, output_padding), by argument
# position (None: the op's fixed value); its output shape is not recorded by the profiler, and
# torch.utils.flop_counter's formula for a convolution needs it.
_CONV_ARGS = {
    "aten::convolution": (3, 4, 5, 6, 7), "aten::_convolution": (3, 4, 5, 6, 7),
    "aten::convolution_overrideable": (3, 4, 5, 6, 7), "aten::cudnn_convolution": (3, 2, 4, None, None),
    "aten::_slow_conv2d_forward": (4, 5, None, None, None),
}


def _formulas() -> dict[str, tuple[Callable, int]]:
    """Profiler op name ("aten::mm") -> (torch.utils.flop_counter's formula, its positional arguments)."""
    out = {}
    for packet, formula in flop_registry.items():
        if isinstance(packet, torch._ops.OpOverloadPacket):
            schema = packet.default._schema
            out[packet._qualified_op_name] = (formula, sum(not a.kwarg_only for a in schema.arguments))
    return out


def _conv_out_shape(name: str, args: list) -> list[int]:
    """The output shape of convolution op `name` called with `args` (input and weight as shapes)."""
    x, w = args[0], args[1]
    at = [None if i is None else args[i] for i in _CONV_ARGS[name]]
    spatial = len(x) - 2
    stride, padding, dilation = ([1] * spatial if v is None else list(v) for v in at[:3])
    transposed, output_padding = bool(at[3]), [0] * spatial if at[4] is None else list(at[4])
    k = list(w[2:])
    if transposed:  # weight is (in, out / groups, *k); output channels taken from the formula's view
        dims = [(x[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (k[i] - 1) + output_padding[i] + 1
                for i in range(spatial)]
        return [x[0], w[1], *dims]
    dims = [(x[2 + i] + 2 * padding[i] - dilation[i] * (k[i] - 1) - 1) // stride[i] + 1 for i in range(spatial)]
    return [x[0], w[0], *dims]


def _event_flops(event, formula: Callable, positional: int) -> int:
    """FLOPs of one profiled op call, from its recorded input shapes and scalar arguments."""
    shapes = list(event.input_shapes or [])
    concrete = list(getattr(event, "concrete_inputs", None) or [])
    args = []
    for i in range(positional):
        c = concrete[i] if i < len(concrete) else None
        shape = shapes[i] if i < len(shapes) else []
        args.append(c if c not in (None, "") else (torch.Size(shape) if shape else None))
    out = None
    if event.name in _CONV_ARGS:
        out = torch.Size(_conv_out_shape(event.name, args))
    elif event.name == "aten::convolution_backward":  # (grad of input, of weight): their shapes
        out = (args[1], args[2], None)
    return int(formula(*args, out_val=out))


def count_flops(fn: Callable[[], object]) -> int:
    """Matmul-like FLOPs performed while `fn()` runs, forward and backward: torch.utils.flop_counter's
    formulas applied to the ops the profiler records with their shapes, the outermost where one such
    op calls another (aten::convolution calls aten::_convolution).

    The profiler rather than a dispatch mode (FlopCounterMode): under a TorchDispatchMode, Dynamo
    runs a torch.compile'd model eagerly, and keeps running it eagerly afterwards, so the
    recomputations its partitioner put in the compiled backward would go uncounted; the profiler
    records the ops the compiled code calls (Inductor calls matmuls and convolutions as ATen ops).
    It starts a profiler of its own, so it cannot run inside another profiler's recording
    (ProfilerBusyError)."""
    from torch.profiler import ProfilerActivity

    formulas = _formulas()
    with quiet_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    total = 0
    for event in prof.events():
        if event.name not in formulas:
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None and not nested:
            nested, parent = parent.name in formulas, parent.cpu_parent
        if not nested:
            total += _event_flops(event, *formulas[event.name])
    return total
