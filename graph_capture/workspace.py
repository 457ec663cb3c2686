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
not 4). The graph must count what the real output holds. That size can depend on the storage an
input views, not only on the part it covers: the functional forms of in-place writes into views
(`copy`, `select_scatter`, `slice_scatter`, ...) copy the whole storage of their first input, so
`select_scatter(row_of_a_65x65_int64_table, ...)` returns a 65-element row on a 33,800-byte
storage (where the fake tensor says 520). So an argument that views a larger storage is made on a
storage of that size (`real_like`), and that size is part of the op's signature.

Planning without the memory, `probe_ops(..., limits=...)`: ops too large to run at their traced
shapes are measured on smaller ones and scaled, ops that cannot run here get formulas
(graph_capture/scaled_workspace.py). Each op's arguments are made just before it runs and dropped
after it, so the probe holds one op's tensors at a time.
"""
from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, record_function

from remat.core.progress import stage
from remat.graph_capture.rng_replay import probe_callable
from remat.compat.torch_private import disable_current_modes, profiler_allocations, profiler_events
from remat.core.errors import RematWarning
from remat.graph_capture.profiling import (allocation_bytes, distinct_storage_bytes, memory_peaks, profiler_recording,
                                           quiet_profile, storage_bytes)

__all__ = ["OpProbe", "Case", "WorkspaceNotMeasuredWarning", "Layout", "probe_ops", "default_min_bytes", "tensors_in",
           "MEASURED_MAX_ENTRIES",
           "run_cases", "real_args", "real_like", "layout_of", "op_groups", "op_signature"]


class WorkspaceNotMeasuredWarning(RematWarning):
    """A call was planned on the CPU while another profiler was recording: its ops' scratch memory
    and real output storages were not measured, so its predicted peak can fall short."""


@dataclass(frozen=True)
class Layout:
    """Where a real tensor's elements lie in its storage (strides, offset). A real kernel can lay
    its output out otherwise than its fake tensor says (CPU native_dropout_backward follows its
    gradient's transposed strides, the fake one is contiguous), and the next op's scratch memory
    can depend on it (a convolution backward copies a transposed gradient to a contiguous one)."""

    stride: tuple[int, ...]
    offset: int


# A view's whole storage is made for a probe up to this size (above it, only the part it covers): a
# larger one (a row of a huge embedding table) would cost the probe more memory than it may use.
WHOLE_STORAGE_MAX_BYTES = 256 * 2**20


def _covered_elements(shape, stride, offset: int) -> int:
    """Elements of a storage up to the last one a tensor of this placement covers."""
    return 0 if 0 in shape else offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def _storage_elements(v: torch.Tensor, covered: int) -> int:
    """Elements of the storage a real tensor like the fake `v` is made on: the whole storage `v`
    views where that is larger than the `covered` elements its placement reaches, up to
    WHOLE_STORAGE_MAX_BYTES (the functional in-place ops copy their input's whole storage)."""
    whole = storage_bytes(v) // max(1, v.element_size())
    if whole > covered and whole * v.element_size() <= WHOLE_STORAGE_MAX_BYTES:
        return whole
    return covered


def real_like(v, device: torch.device, layout=None):
    """A real tensor like the fake value `v` (shape, strides, offset, dtype) on `device` (on the CPU
    where `v` is): random floats, integers 0 (a valid index for every gather/embedding/loss target),
    bools True. Built on a flat storage and viewed with `v`'s strides (or `layout`'s: a Layout, or
    for a list or tuple value a matching sequence of them, None where unknown), so an expanded
    value (stride 0, whose elements share memory and cannot be filled through the view) is made too.
    The flat storage is as large as the one `v` views (`_storage_elements`), zeros beyond the part
    the view reaches."""
    if isinstance(v, torch.Tensor):
        shape = tuple(v.shape)
        stride, offset = _placement(v, layout)
        size = _covered_elements(shape, stride, offset)
        # a value the trace put on the CPU (a scalar beside a GPU step) stays on the CPU
        on = v.device if v.device.type == "cpu" else device
        flat = torch.empty(_storage_elements(v, size), dtype=v.dtype, device=on)
        flat[size:].zero_()
        covered = flat[:size]
        if v.dtype.is_floating_point or v.dtype.is_complex:
            covered.normal_(0, 0.1)
        elif v.dtype == torch.bool:
            covered.fill_(True)
        else:
            covered.zero_()
        return flat.as_strided(shape, stride, offset)
    if isinstance(v, (list, tuple)):
        parts = layout if isinstance(layout, (list, tuple)) and len(layout) == len(v) else [None] * len(v)
        return type(v)(real_like(x, device, lay) for x, lay in zip(v, parts))
    return v


def _placement(v: torch.Tensor, layout) -> tuple[tuple[int, ...], int]:
    """The strides and offset a real tensor like the fake `v` gets: `layout`'s where it is a Layout
    of as many dimensions, else `v`'s own."""
    if isinstance(layout, Layout) and len(layout.stride) == v.dim():
        return layout.stride, layout.offset
    return tuple(v.stride()), int(v.storage_offset())


def layout_of(value):
    """The Layout of a real op result (a sequence of them for a list or tuple; None: no tensor)."""
    if isinstance(value, torch.Tensor):
        return Layout(tuple(value.stride()), int(value.storage_offset()))
    if isinstance(value, (list, tuple)):
        return tuple(layout_of(x) for x in value)
    return None


def op_signature(n: fx.Node, layouts: dict | None = None) -> tuple:
    """What identifies an op call for probing: its target and each argument's shape, strides and
    dtype (or value), so calls with the same one are measured once. `layouts`: fx node -> the
    Layout its real value was seen to have, whose strides replace the fake value's."""
    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                stride, offset = _placement(v, (layouts or {}).get(a))
                covered = _covered_elements(v.shape, stride, offset)
                whole = _storage_elements(v, covered)  # the larger storage it views, if any
                return ("T", tuple(v.shape), stride, v.dtype, whole if whole > covered else None)
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


def _storages(out, inputs, allocator: str = "cpu") -> tuple[int | None, ...]:
    """Real storage bytes of each output tensor; None where it is an input's storage (a view)."""
    held = {t.untyped_storage().data_ptr() for t in tensors_in(inputs)}
    return tuple(None if t.untyped_storage().data_ptr() in held else allocation_bytes(storage_bytes(t), allocator)
                 for t in tensors_in(out))


def _out_bytes(out, inputs, allocator: str = "cpu") -> int:
    """Bytes of the distinct storages the op's result holds that are not its inputs'."""
    if allocator == "cpu":
        return distinct_storage_bytes(tensors_in(out), exclude=tensors_in(inputs))
    seen = {t.untyped_storage().data_ptr() for t in tensors_in(inputs)}
    total = 0
    for t in tensors_in(out):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += allocation_bytes(storage_bytes(t), allocator)
    return total


@dataclass
class OpProbe:
    """What running each op once showed, by fx node name (nodes that could not run are absent)."""

    workspace: dict[str, int] = field(default_factory=dict)  # bytes beyond the outputs while it runs
    # real storage bytes of each tensor output, in `tensors_in` order; None: an input's storage
    out_storages: dict[str, tuple[int | None, ...]] = field(default_factory=dict)
    # ops not measured at their traced shapes, one entry per op signature: {"op", "nodes", "method"
    # ("scaled", "formula" or "unmeasured"), "workspace_bytes" (each node's), ...}
    estimated: list[dict] = field(default_factory=list)
    # (view node, the real strides of its input): views that failed on the layout the real ops gave
    # their input, other than its fake tensor's (graph_capture/traced_layout.py)
    misfit_views: list = field(default_factory=list)


def default_min_bytes(allocator: str) -> int:
    """Workspaces under this count as 0: none on CPU, where the profiler counts every byte exactly
    and the simulator is meant to match it, and 4 KiB on CUDA, whose allocator rounds each block up
    (512 bytes and more), so small differences there are rounding, not scratch memory."""
    return 0 if allocator == "cpu" else 4096


def probe_ops(gm: fx.GraphModule, device: torch.device | None, min_bytes: int | None = None,
              allocator: str | None = None) -> OpProbe:
    """Run every distinct op signature of `gm` once on `device`, at its traced shapes. Workspaces
    under `min_bytes` (default: `default_min_bytes`) count as 0. `allocator` ("cpu", "cuda";
    default: the device's type) is how storage bytes are counted. Planning without the memory
    measures within limits instead (graph_capture/scaled_workspace.py's `probe_within`)."""
    allocator = allocator or (device.type if device is not None else "cpu")
    if min_bytes is None:
        min_bytes = default_min_bytes(allocator)
    # AOTAutograd calls the partitioner with its fake-tensor mode active: step outside it
    with disable_current_modes():
        return _probe(gm, device, min_bytes, allocator)


def op_groups(gm: fx.GraphModule) -> dict[tuple, list[fx.Node]]:
    """The graph's ATen op nodes grouped by signature (op, argument shapes, strides, dtypes, constants):
    each group is measured once."""
    todo: dict[tuple, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            todo.setdefault(op_signature(n), []).append(n)
    return todo


# A case: run `target` on what `make_args()` returns; its result lands in the dict under `key`
Case = tuple[object, Callable, Callable[[], tuple[tuple, dict]]]


def run_cases(cases: Iterable[Case], device: torch.device, allocator: str,
              on_result: Callable[[object, object], None] | None = None) -> dict[object, tuple[int, tuple]]:
    """key -> (bytes the op's peak rose above its inputs beyond its outputs, real output storages),
    for each case that ran. Each case's arguments are made just before it runs and dropped after,
    so the probe holds one op's tensors at a time. `cases` may be a generator: the next case is
    taken after the last one ran and `on_result(key, its result)` was called."""
    total = len(cases) if isinstance(cases, Sized) else None
    with stage("probing op workspaces", total=total, unit="op") as progress:
        return _run_cases(cases, device, allocator, progress, on_result or (lambda key, out: None))


def _run_cases(cases: Iterable[Case], device: torch.device, allocator: str, progress, on_result) -> dict:
    results: dict[object, tuple[int, tuple]] = {}
    if device.type == "cuda":
        for key, target, make_args in cases:
            progress.advance()
            try:
                args, kwargs = make_args()
            except Exception:
                continue
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            try:
                out = target(*args, **kwargs)
            except Exception:
                continue
            torch.cuda.synchronize()
            inputs = (args, list(kwargs.values()))
            results[key] = (torch.cuda.max_memory_allocated() - base - _out_bytes(out, inputs, allocator),
                            _storages(out, inputs, allocator))
            on_result(key, out)
            del out, args, kwargs
        return results
    if device.type != "cpu":
        return results
    if profiler_recording():  # a second profiler would end that one's recording (profiling.quiet_profile)
        warnings.warn(WorkspaceNotMeasuredWarning(
            "a call was planned while another profiler was recording (torch.profiler.profile, remat.measure_peak): "
            "its ops' scratch memory was not measured, since a second profiler would end that one's recording, so "
            "its predicted peak can fall short of the measured one; make the call with these shapes once before "
            "profiling"), stacklevel=2)
        return results
    ran: list[tuple[object, int, tuple]] = []  # (key, output bytes, storages) of each case that ran
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for key, target, make_args in cases:
            progress.advance()
            try:
                args, kwargs = make_args()  # outside the range: the inputs are not the op's
            except Exception:
                continue
            with record_function(f"remat_probe_{len(ran)}"):
                try:
                    out = target(*args, **kwargs)
                except Exception:
                    continue
            inputs = (args, list(kwargs.values()))
            ran.append((key, _out_bytes(out, inputs), _storages(out, inputs)))
            on_result(key, out)
            del out, args, kwargs  # outside the range: their frees are not part of the op
    events, allocations = profiler_events(prof), profiler_allocations(prof)
    ranges = {}
    for e in events:
        if e.name().startswith("remat_probe_"):
            ranges[int(e.name().rsplit("_", 1)[1])] = (e.start_ns(), e.start_ns() + e.duration_ns())
    measured = [i for i in range(len(ran)) if i in ranges]
    for i, peak in zip(measured, memory_peaks(allocations, [ranges[i] for i in measured])):
        key, out_bytes, storages = ran[i]
        results[key] = (peak - out_bytes, storages)
    return results


def real_args(n: fx.Node, device: torch.device, layouts: dict | None = None) -> Callable[[], tuple[tuple, dict]]:
    """A function making real (random) arguments of `n`'s traced shapes on `device` (laid out as
    `layouts` says, fx node -> Layout, where it has the node). On CUDA, the integer tensors `n`
    takes from another op's outputs (an attention backward's RNG seed and offset) are that op's
    real outputs, run on made-up arguments: made-up ones can crash a kernel."""
    def make():
        produced = _integer_outputs_of_producers(n, device) if device.type == "cuda" else {}

        def value(a: fx.Node):
            return produced[a] if a in produced else real_like(a.meta.get("val"), device, (layouts or {}).get(a))

        return fx.node.map_arg(n.args, value), fx.node.map_arg(n.kwargs, value)

    return make


def _integer_outputs_of_producers(n: fx.Node, device: torch.device) -> dict[fx.Node, torch.Tensor]:
    """The integer-tensor arguments of `n` that are outputs of another ATen op (`getitem(op, i)`),
    computed by running that op once on made-up arguments."""
    produced: dict[fx.Node, torch.Tensor] = {}
    outputs: dict[fx.Node, object] = {}
    for a in n.all_input_nodes:
        v = a.meta.get("val")
        if not (isinstance(v, torch.Tensor) and not v.dtype.is_floating_point and not v.dtype.is_complex
                and v.dtype != torch.bool and a.target is operator.getitem):
            continue
        src = a.args[0]
        if not (isinstance(src, fx.Node) and isinstance(src.target, torch._ops.OpOverload)):
            continue
        if src not in outputs:
            sargs = fx.node.map_arg(src.args, lambda b: real_like(b.meta.get("val"), device))
            skwargs = fx.node.map_arg(src.kwargs, lambda b: real_like(b.meta.get("val"), device))
            outputs[src] = src.target(*sargs, **skwargs)
        out = outputs[src][a.args[1]]
        if isinstance(out, torch.Tensor):
            produced[a] = out
    return produced


# What each op signature's probe measured in this process: (where, signature) -> (bytes over its
# inputs and outputs, real output storages, the Layout of its result). A signature (op, argument
# shapes, strides, storages, dtypes, constants) measures the same each time, and most graphs are
# traced more than once (the other loss head, a budget asked again after a refusal, the blocks of a
# blockwise plan deployed at each level): Mamba2's 888 nodes probe 376 signatures, ~1 s a trace.
_MEASURED: dict[tuple, tuple] = {}
MEASURED_MAX_ENTRIES = 200_000  # cleared past this (a long run of ever-new shapes)


def _probe(gm: fx.GraphModule, device: torch.device | None, min_bytes: int, allocator: str) -> OpProbe:
    """Every op at its traced shapes (capture of real tensors), in graph order, each on arguments
    laid out as the real ops before it laid out their results (`Layout`): a signature (op,
    shapes, those strides, dtypes, constants) is measured once."""
    result = OpProbe()
    if device is None or device.type not in ("cpu", "cuda"):
        return result
    layouts: dict[fx.Node, object] = {}  # node -> the Layout its probe's result had
    out_layout: dict[tuple, object] = {}  # signature -> the Layout of its probe's result
    todo: dict[tuple, list[fx.Node]] = {}
    where = (str(device), allocator, torch.get_num_threads())  # (a CPU kernel's scratch can depend on its threads)
    known: dict[tuple, tuple[int, tuple]] = {}  # signature -> what an earlier probe in this process measured

    def cases():
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
                lay = layouts.get(n.args[0])
                if isinstance(lay, tuple) and isinstance(n.args[1], int) and n.args[1] < len(lay):
                    layouts[n] = lay[n.args[1]]
                continue
            if not isinstance(n.target, torch._ops.OpOverload):
                continue
            sig = op_signature(n, layouts)
            if sig not in todo:
                todo[sig] = []
                earlier = _MEASURED.get((where, sig))
                if earlier is not None:
                    known[sig], out_layout[sig] = earlier[:2], earlier[2]
                else:
                    yield sig, probe_callable(n.target), real_args(n, device, layouts)
            todo[sig].append(n)
            if sig in out_layout:
                layouts[n] = out_layout[sig]

    def seen(sig, out):
        out_layout[sig] = layout_of(out)

    measured = run_cases(cases(), device, allocator, seen)
    if len(_MEASURED) > MEASURED_MAX_ENTRIES:
        _MEASURED.clear()
    for sig, value in measured.items():
        _MEASURED[where, sig] = (*value, out_layout.get(sig))
    measured.update(known)
    for sig, (extra, storages) in measured.items():
        for m in todo[sig]:
            result.workspace[m.name] = max(0, extra) if extra >= min_bytes else 0
            result.out_storages[m.name] = storages
    result.misfit_views = _misfit_views([n for sig, nodes in todo.items() if sig not in measured for n in nodes],
                                        layouts)
    return result


def _misfit_views(failed: list[fx.Node], layouts: dict) -> list[tuple[fx.Node, tuple[int, ...]]]:
    """(view, the real strides of its input) for each `view` among `failed` (nodes whose probe
    failed) whose input the real ops laid out with other strides than its fake tensor has."""
    out = []
    for n in failed:
        if n.target is torch.ops.aten.view.default and isinstance(n.args[0], fx.Node):
            lay, v = layouts.get(n.args[0]), n.args[0].meta.get("val")
            if isinstance(lay, Layout) and isinstance(v, torch.Tensor) and lay.stride != tuple(v.stride()):
                out.append((n, lay.stride))
    return out
