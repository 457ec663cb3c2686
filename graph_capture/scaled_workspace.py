"""Measuring op workspaces when an op is too large to run at its traced shapes, or cannot run here.

Used instead of workspace.py's `probe_ops` when a step is planned without its
memory (graph_capture/fake_capture.py): one op's inputs and outputs at the traced shapes may be too
large to allocate (a 1.3B-parameter GPT's logits are 3 GB), or no device of the kind planned for
may be here (a CUDA plan made on a CPU machine). Then:
* an op whose inputs and outputs fit the limits (`ProbeLimits`) is measured as workspace.py
  measures every op, exactly;
* a larger one is measured on smaller shapes of the same op: the largest dimension sizes of its
  tensors are shrunk (every occurrence of a size, in every tensor and integer argument, by the
  same factor, so the op's shapes stay consistent; checked first on fake tensors) until it fits,
  measured at up to three such sizes (each dimension halved from one to the next), and its
  workspace and output-storage excess extrapolated in the bytes the op reads and writes
  (`_extrapolate`: a line or a power law, whichever predicts the smallest probe better) ("scaled");
* with no device to run on: a known formula for the op on that device ("formula": the fused
  attention's backward keeps a float32 row statistic per query), else 0 ("unmeasured").
Ops that create no storage (views) are not run. Every estimated op is listed in
`OpProbe.estimated`, and from there in the graph's meta and the plan's details.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry

from remat.compat.torch_private import disable_current_modes, fake_tensor_mode
from remat.graph_capture.rng_replay import probe_callable
from remat.graph_capture.profiling import allocation_bytes, storage_bytes
from remat.graph_capture.workspace import (Case, OpProbe, default_min_bytes, op_groups, real_args, run_cases,
                                           tensors_in)

__all__ = ["ProbeLimits", "probe_within"]


@dataclass
class ProbeLimits:
    """How much running one op to measure it may cost: its inputs and outputs at most `max_bytes`
    (the probe allocates them for real, one op at a time) and at most `max_flops` FLOPs (matmul-like
    ops; the others are bounded by their bytes). An op over either limit is measured on smaller
    shapes and scaled (see the module doc)."""

    max_bytes: int = 256 * 2**20
    max_flops: float = 2e9


_MIN_SHRUNK = 16  # only dimension sizes this large are shrunk (never dims, counts or small sizes)


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor of this shape and strides spans (what the probe allocates for it)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))) * t.element_size()


def _scaling(n: fx.Node, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inputs whose size scales with the op's shapes: a replayable dropout's saved generator
    state (its first input, 5056 bytes at any shape) is left out, or it would skew the scaling."""
    return inputs[1:] if n.target is torch.ops.remat.dropout.default else inputs


def _io_bytes(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """Bytes an op reads and writes: its inputs' extents and its new outputs' storages."""
    held = {StorageWeakRef(t.untyped_storage()) for t in inputs}
    seen: set[StorageWeakRef] = set()
    total = sum(_extent_bytes(t) for t in inputs)
    for t in outputs:
        key = StorageWeakRef(t.untyped_storage())
        if key not in held and key not in seen:
            seen.add(key)
            total += _extent_bytes(t)
    return total


def _aliases_only(n: fx.Node) -> bool:
    """The op creates no storage: every output views an input (view, transpose, split, ...)."""
    outs = tensors_in(n.meta.get("val"))
    held = {StorageWeakRef(t.untyped_storage()) for a in n.all_input_nodes for t in tensors_in(a.meta.get("val"))}
    return bool(outs) and all(StorageWeakRef(t.untyped_storage()) in held for t in outs)


def _flops_of(target, args, kwargs, out) -> int:
    """FLOPs torch.utils.flop_counter counts for the op on these arguments (0: none, or unknown)."""
    packet = getattr(target, "overloadpacket", None)
    if packet not in flop_registry:
        return 0
    try:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    except Exception:
        return 0


def _restride(shape, stride, new_shape) -> tuple[int, ...]:
    """Strides for `new_shape` laid out as (shape, stride) is: the same order of dimensions, the
    same gaps between them (a slice of a wider tensor stays one), broadcast dimensions kept."""
    if tuple(shape) == tuple(new_shape):
        return tuple(stride)
    order = sorted(range(len(shape)), key=lambda i: (abs(stride[i]), shape[i]))  # innermost first
    out = [0] * len(shape)
    acc_old = acc_new = 1
    for i in order:
        if stride[i] == 0:
            continue  # broadcast (expanded) dimension
        ratio = stride[i] // acc_old if acc_old and stride[i] % acc_old == 0 and stride[i] >= acc_old else 1
        out[i] = acc_new * ratio
        acc_old = stride[i] * max(shape[i], 1)
        acc_new = out[i] * max(new_shape[i], 1)
    return tuple(out)


def _shrink_int(x, mapping: dict[int, int]):
    if isinstance(x, bool) or not isinstance(x, int):
        return x
    return mapping.get(x, x)


def _shrunk(v, mapping: dict[int, int], make: Callable):
    """`v` (a node's value, or a constant argument) with every dimension size (and integer) in
    `mapping` replaced, each tensor made by `make(shape, stride, dtype)`."""
    if isinstance(v, torch.Tensor):
        shape = tuple(mapping.get(s, s) for s in v.shape)
        return make(shape, _restride(v.shape, v.stride(), shape), v.dtype)
    if isinstance(v, (list, tuple)):
        return type(v)(_shrunk(x, mapping, make) for x in v)
    return _shrink_int(v, mapping)


def _args_at(n: fx.Node, mapping: dict[int, int], make: Callable) -> tuple[tuple, dict]:
    def conv(a):
        if isinstance(a, fx.Node):
            return _shrunk(a.meta.get("val"), mapping, make)
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        return _shrink_int(a, mapping)

    return tuple(conv(a) for a in n.args), {k: conv(a) for k, a in n.kwargs.items()}


def _fill(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.normal_(0, 0.1)
    return t.fill_(True) if t.dtype == torch.bool else t.zero_()


@dataclass
class _Shrink:
    mapping: dict[int, int]
    io: int  # bytes read and written at the shrunk shapes
    flops: int
    out_fake_bytes: tuple[int, ...]  # fake storage bytes of each output at the shrunk shapes


def _try_shrink(n: fx.Node, mapping: dict[int, int], fake_mode) -> _Shrink | None:
    """The op at the shrunk shapes, run on fake tensors: None if it fails or its outputs are not the
    traced ones shrunk the same way (a size that is not a dimension of the same thing)."""
    def make(shape, stride, dtype):
        return torch.empty_strided(shape, stride, dtype=dtype, device="cpu")

    try:
        with fake_mode:
            args, kwargs = _args_at(n, mapping, make)
            out = probe_callable(n.target)(*args, **kwargs)
    except Exception:
        return None
    want = [tuple(mapping.get(s, s) for s in t.shape) for t in tensors_in(n.meta.get("val"))]
    got = tensors_in(out)
    if [tuple(t.shape) for t in got] != want:
        return None
    ins = _scaling(n, tensors_in((args, list(kwargs.values()))))
    return _Shrink(mapping, _io_bytes(ins, got), _flops_of(n.target, args, kwargs, out),
                   tuple(storage_bytes(t) for t in got))


def _plan_shrink(n: fx.Node, limits: ProbeLimits, fake_mode) -> list[_Shrink]:
    """Up to three shrunk versions of the op, each dimension halved from one to the next, the
    largest fitting the limits (the larger first); [] if none does."""
    tensors = tensors_in([a.meta.get("val") for a in n.all_input_nodes]) + tensors_in(n.meta.get("val"))
    values = sorted({s for t in tensors for s in t.shape if s >= _MIN_SHRUNK}, reverse=True)
    sets = [values[:k] for k in range(1, len(values) + 1)] + [[v] for v in values[1:]]
    for chosen in sets:
        for j in range(1, 40):
            mapping = {v: v >> j for v in chosen}
            if min(mapping.values()) < 2:
                break  # this set cannot shrink further: shrink more sizes
            io = sum(_extent_bytes_at(t, mapping) for t in tensors)
            if io > limits.max_bytes:
                continue
            hi = _try_shrink(n, mapping, fake_mode)
            if hi is None:
                break  # these sizes do not shrink consistently: try others
            if hi.io > limits.max_bytes or hi.flops > limits.max_flops:
                continue
            shrinks = [hi]
            for k in (1, 2):
                smaller = {v: v >> (j + k) for v in chosen}
                s = _try_shrink(n, smaller, fake_mode) if min(smaller.values()) >= 2 else None
                if s is None or s.io == shrinks[-1].io:
                    break
                shrinks.append(s)
            return shrinks
    return []


def _extent_bytes_at(t: torch.Tensor, mapping: dict[int, int]) -> int:
    shape = tuple(mapping.get(s, s) for s in t.shape)
    if 0 in shape:
        return 0
    stride = _restride(t.shape, t.stride(), shape)
    return (1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride))) * t.element_size()


def _extrapolate(points: list[tuple[int, int]], x: int) -> int:
    """Bytes measured at smaller sizes (io bytes, bytes), largest first, extrapolated to io bytes `x`
    (>= 0). Through the two largest points: a line (a constant plus a part proportional to the
    op's bytes: scratch copies, masks) or a power law (a part growing like one dimension, e.g.
    per-thread row buffers, which a line overestimates); with a third point, whichever of the two
    predicts it better (a tie: the larger estimate). One point: proportional."""
    if len(points) == 1:
        (x1, y1), = points
        return max(0, round(y1 * x / x1)) if x1 else max(0, y1)
    (x0, y0), (x1, y1) = points[:2]
    slope = (y0 - y1) / (x0 - x1)

    def line(at: float) -> float:
        return y0 + slope * (at - x0)

    power = None
    if y0 > 0 and y1 > 0 and x0 > 0 and x1 > 0:
        q = math.log(y0 / y1) / math.log(x0 / x1)

        def power(at: float) -> float:
            return y0 * (at / x0) ** q

    best = line(x)
    if power is not None and len(points) > 2:
        x2, y2 = points[2]
        err_line, err_power = abs(line(x2) - y2), abs(power(x2) - y2)
        if err_power < err_line or (err_power == err_line and power(x) > best):
            best = power(x)
    return max(0, round(best))


def _cuda_formula(n: fx.Node) -> int | None:
    """Bytes of CUDA scratch memory known from the kernel's code, or None if none is known."""
    target = str(n.target)
    if target.startswith("remat.flash_attention_backward"):
        # attention/launch.py triton_backward: delta (B, H, Sq) float32, and delta - dlse beside it
        q, dlse = n.args[1], n.args[6] if len(n.args) > 6 else None
        B, H, SQ = q.meta["val"].shape[:3]
        per = allocation_bytes(B * H * SQ * 4, "cuda")
        return per * (2 if isinstance(dlse, fx.Node) else 1)
    if target.startswith("remat.chunked_linear_cross_entropy"):
        return _chunked_loss_workspace(n, backward=target.startswith("remat.chunked_linear_cross_entropy_backward"))
    return None


def _chunked_loss_workspace(n: fx.Node, backward: bool) -> int:
    """loss_head/op.py's temporaries at their largest: forward, one row chunk's logits in the
    compute dtype and three float32 tensors of that size (the upcast, log-softmax, logsumexp's
    exponentials); backward, dh's float32 accumulator, one vocabulary block's logits in the compute
    dtype and four float32 tensors of that size, and the casts of h and W the compute dtype needs."""
    def val(i):
        a = n.args[i]
        return a.meta["val"] if isinstance(a, fx.Node) else None

    off = 1 if backward else 0
    h, w = val(off), val(off + 1)
    compute_dtype, last = n.args[7 + 2 * off], int(n.args[9 + 2 * off])  # the ops' argument positions
    rows, d, v = h.shape[0], h.shape[1], w.shape[0]
    cb = torch.tensor([], dtype=compute_dtype).element_size()
    casts = (h.numel() * cb if h.dtype != compute_dtype else 0) + (w.numel() * cb if w.dtype != compute_dtype else 0)
    if not backward:
        chunk = min(rows, last) * v
        parts = [chunk * cb, chunk * 4, chunk * 4, chunk * 4]
    else:
        block = rows * min(v, last)
        parts = [rows * d * 4, block * cb, block * 4, block * 4, block * 4, block * 4, rows * d * cb]
    return sum(allocation_bytes(p, "cuda") for p in parts) + allocation_bytes(casts, "cuda")


def probe_within(gm: fx.GraphModule, device: torch.device | None, limits: ProbeLimits, allocator: str,
                 min_bytes: int | None = None) -> OpProbe:
    """`probe_ops` within `limits` (see the module doc): each op signature measured on `device` at
    its traced shapes if it fits, else on smaller shapes and scaled; with `device` None (or one
    that cannot run ops), formulas for `allocator`'s device or 0. Estimates go to `estimated`.
    Workspaces under `min_bytes` (default: `default_min_bytes(allocator)`) count as 0."""
    if min_bytes is None:
        min_bytes = default_min_bytes(allocator)
    with disable_current_modes():  # AOTAutograd calls the partitioner with its fake-tensor mode active
        return _probe_within(gm, device, min_bytes, limits, allocator)


def _probe_within(gm: fx.GraphModule, device: torch.device | None, min_bytes: int, limits: ProbeLimits,
                  allocator: str) -> OpProbe:
    result = OpProbe()
    todo = {sig: nodes for sig, nodes in op_groups(gm).items() if not _aliases_only(nodes[0])}
    runnable = device is not None and device.type in ("cpu", "cuda")
    fake_mode = fake_tensor_mode()
    exact: list[Case] = []
    scaled: dict[tuple, tuple[list[_Shrink], int]] = {}  # sig -> (shrinks, io at the traced shapes)
    for sig, nodes in todo.items():
        n = nodes[0]
        name = str(n.target)
        if not runnable:
            formula = _cuda_formula(n) if allocator == "cuda" else None
            result.estimated.append({"op": name, "nodes": [m.name for m in nodes],
                                     "method": "formula" if formula is not None else "unmeasured",
                                     "workspace_bytes": formula or 0})
            for m in nodes:
                result.workspace[m.name] = formula or 0
            continue
        ins = _scaling(n, tensors_in([a.meta.get("val") for a in n.all_input_nodes]))
        outs = tensors_in(n.meta.get("val"))
        io = _io_bytes(ins, outs)
        flops = _flops_of(n.target, *fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val")),
                          n.meta.get("val"))
        if io <= limits.max_bytes and flops <= limits.max_flops:
            exact.append((sig, probe_callable(n.target), real_args(n, device)))
            continue
        shrinks = _plan_shrink(n, limits, fake_mode)
        if not shrinks:
            result.estimated.append({"op": name, "nodes": [m.name for m in nodes], "method": "unmeasured",
                                     "workspace_bytes": 0, "reason": "no smaller shape of it fits the probe limits"})
            continue
        scaled[sig] = (shrinks, io)
        for k, s in enumerate(shrinks):
            def make_args(n=n, mapping=s.mapping):
                def make(shape, stride, dtype):
                    return _fill(torch.empty_strided(shape, stride, dtype=dtype, device=device))

                return _args_at(n, mapping, make)

            exact.append(((sig, k), probe_callable(n.target), make_args))
    measured = run_cases(exact, device, allocator) if runnable and exact else {}

    def record(nodes, extra: int, storages: tuple) -> None:
        for m in nodes:
            result.workspace[m.name] = max(0, extra) if extra >= min_bytes else 0
            result.out_storages[m.name] = storages

    for sig, nodes in todo.items():
        if sig in measured:
            record(nodes, *measured[sig])
            continue
        if sig not in scaled:
            continue
        shrinks, io = scaled[sig]
        runs = [(s, measured[(sig, k)]) for k, s in enumerate(shrinks) if (sig, k) in measured]
        entry = {"op": str(nodes[0].target), "nodes": [m.name for m in nodes], "method": "scaled"}
        if not runs:
            result.estimated.append({**entry, "method": "unmeasured", "workspace_bytes": 0,
                                     "reason": "it failed to run on smaller shapes"})
            continue
        ws = _extrapolate([(s.io, extra if extra >= min_bytes else 0) for s, (extra, _) in runs], io)
        if allocator == "cuda" and ws:
            ws = allocation_bytes(ws, "cuda")
        # each output's real storage: the traced size plus what the real kernel adds beyond it
        # (scaled like the workspace); None where the kernel returned a view of an input
        storages: list[int | None] = []
        for j, t in enumerate(tensors_in(nodes[0].meta.get("val"))):
            real = [(s.io, st[j], s.out_fake_bytes[j]) for s, (_, st) in runs]
            if any(r is None for _, r, _ in real):
                storages.append(None)
                continue
            excess = [(x, r - allocation_bytes(f, allocator)) for x, r, f in real]
            more = _extrapolate(excess, io) if any(e for _, e in excess) else 0
            storages.append(allocation_bytes(storage_bytes(t), allocator) + allocation_bytes(more, allocator))
        for m in nodes:
            result.workspace[m.name] = ws
            result.out_storages[m.name] = tuple(storages)
        result.estimated.append({**entry, "workspace_bytes": ws,
                                 "probed_at": [{str(v): w for v, w in s.mapping.items()} for s, _ in runs],
                                 "io_fraction": round(max(s.io for s, _ in runs) / io, 6) if io else 1.0})
    return result
