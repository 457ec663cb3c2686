"""Trace library models (Hugging Face transformers) the way torch.compile traces them.

Hugging Face's mask code (`transformers.masking_utils`) takes shortcuts that read the *values* of
the padding mask: "is every token visible? then drop the mask and let SDPA use is_causal"
(`_ignore_causal_mask_sdpa`, `_ignore_bidirectional_mask_sdpa`, `padding_mask.all()`). remat traces
on fake tensors, which have no values, so such a read fails
(`DataDependentOutputException: aten._local_scalar_dense`). Answering it from the example inputs
would be worse: the graph remat plans is run for every later batch, whose masks differ, so a mask
dropped because the example happened to have no padding would silently be missing for the next one.

Hugging Face skips these shortcuts whenever `torch.compiler.is_compiling()` is true (through
`is_tracing` / `is_torchdynamo_compiling`) and then always builds the mask from the tensor, which is
right for every mask value. torch.compile holds that flag for its whole compile session, including
while AOTAutograd traces (`torch.compiler._compile_session_context`); `traced_as_compiled()` holds
it the same way while remat traces, so library code takes the path it takes under torch.compile.

One shortcut is taken as eager takes it, because its answer cannot change between calls: whether
`position_ids` hold one sequence per row or several packed ones
(`masking_utils.find_packed_sequence_indices`, consulted when no `attention_mask` is passed). Under
the flag Hugging Face never reads them and always builds a packed-sequence mask, so a causal LM
called without `attention_mask` would trace a materialized (B, 1, S, S) mask where eager passes
SDPA `is_causal=True`, and with the mask SDPA without grouped-query support (`repeat_kv` copies K
and V in every layer, and SDPA turns the mask into a float one per layer): the traced step held more
memory than the model run as it is (tiny LLaMA, 2 layers: 96 KiB). When the model makes its
position ids itself (`arange(seq)`, when the caller passes none), their values depend on no input,
parameter or buffer and are the same in every call, so reading them specializes on nothing:
`traced_as_compiled()` keeps a real copy of each tensor computed from constants alone by
deterministic ops (`_Constants`, each copy valid only at the version counter it was made at) and
answers the packing question as eager does for position ids that have one. Position ids the caller
passes, or that a model computes from the mask, have none: the graph keeps the packed-sequence
mask, right for any values.

The mask shortcuts themselves are answered as eager for a call without a padding mask: with
`padding_mask` None, whether SDPA can run `is_causal=True` (or no mask, bidirectionally) instead of a
materialized mask depends on the query and key lengths alone. Hugging Face up to 5.17 skipped the
shortcut whenever it was tracing (`if is_tracing(padding_mask): return False`, with is_tracing(None)
true under the compile flag), so a causal LM called without `attention_mask` traced a (B, 1, S, S)
mask: SDPA with it stays unfused (remat's router fuses no explicit mask) and its cuDNN backward ran
2.8x slower than eager's causal one on an H200 (Llama-3.2-1B-shaped, benchmarks/results/
gpu_speed_h200.txt). `_mask_skips_as_eager()` calls those two shortcuts with `is_tracing(None)`
false; a padding mask, or a tensor offset, is still answered as under torch.compile. (5.25 answers so
itself: `padding_mask is not None and is_tracing(padding_mask)`.)

Not matched, by design: a batch whose `attention_mask` is all ones. Eager reads the mask, drops it
and runs SDPA with `is_causal=True`; the graph must serve later batches with padding, so it keeps
the mask (and `repeat_kv`) and holds what eager holds for a padded batch. Callers whose batches
never pad can leave `attention_mask` out.

What users pass (see also the README): the model in train() mode with its usual keyword arguments
(`input_ids`, `attention_mask`, `labels` so that the model returns its loss, `pixel_values`, ...),
and `use_cache=False` for decoders (LLaMA, GPT-2, T5): a key/value cache returned by the step is not
a tensor remat can plan for. The outputs (a ModelOutput with `loss`, `logits`, ...) come back with
the same structure.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from remat.attention.spellings import torch_callables
from remat.compat.torch_private import (compile_session, disable_current_modes, disable_torch_function, pytree)

__all__ = ["traced_as_compiled"]

_MAX_NUMEL = 1 << 22  # real copies are kept of index-sized tensors only


# deterministic, not in place, the result a function of the tensor arguments' values and the python
# arguments alone: what models build position ids with (arange(seq) + offset, unsqueeze, expand)
_CONSTANT_OPS = torch_callables(
    "__add__", "__radd__", "add", "__sub__", "__rsub__", "sub", "__mul__", "__rmul__", "mul", "__neg__", "neg",
    "unsqueeze", "squeeze", "expand", "expand_as", "view", "reshape", "flatten", "__getitem__", "to", "long",
    "int", "clone", "contiguous", "repeat", "t", "transpose", funcs=(torch.arange, torch.zeros, torch.ones,
    torch.full, torch.add, torch.sub, torch.mul, torch.unsqueeze, torch.cat, torch.stack))


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except Exception:  # inference tensors have no version counter
        return None


class _Constants(TorchFunctionMode):
    """While a step is traced: a real CPU copy of each tensor that `_CONSTANT_OPS` compute from python
    values and other such tensors only (never from an input, parameter or buffer), i.e. of a value
    that is the same in every call of the step. A copy counts only while its tensor is at the
    version it was made at: an in-place op on the tensor, or on a view of it, makes it unknown."""

    def __init__(self):
        super().__init__()
        self._real = WeakIdKeyDictionary()  # traced tensor -> (real CPU tensor, version)

    def value(self, t) -> torch.Tensor | None:
        """The real value of traced tensor `t`, or None if it is not known to be a constant."""
        entry = self._real.get(t) if isinstance(t, torch.Tensor) else None
        if entry is None or _version(t) != entry[1]:
            return None
        return entry[0]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CONSTANT_OPS and isinstance(out, torch.Tensor):
            self._replay(func, args, kwargs, out)
        return out

    def _replay(self, func, args, kwargs, out: torch.Tensor) -> None:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        real = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                r = self.value(x)
                if r is None:  # computed from something else: not a constant
                    return
                real.append(r)
            elif isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return  # a dynamic size: no single value
            elif isinstance(x, torch.device) or (isinstance(x, str) and x.split(":")[0] in ("cuda", "xpu", "mps")):
                real.append(torch.device("cpu"))  # the copies live on the CPU
            else:
                real.append(x)
        r_args, r_kwargs = pytree.tree_unflatten(real, spec)
        if "device" in r_kwargs:
            r_kwargs["device"] = "cpu"
        try:
            with disable_torch_function(), disable_current_modes(), torch.no_grad():
                r = func(*r_args, **r_kwargs)
                if not isinstance(r, torch.Tensor) or r.numel() > _MAX_NUMEL \
                        or tuple(r.shape) != tuple(out.shape) or r.dtype != out.dtype:
                    return
                r = r.cpu()
        except Exception:  # what cannot be replayed is simply not known
            return
        version = _version(out)
        if version is not None:
            self._real[out] = (r, version)


def _packing_as_eager(find_packed: Callable, constants: _Constants) -> Callable:
    """`masking_utils.find_packed_sequence_indices`, answering as eager does (None: one sequence per
    row, so no packed-sequence mask) for position ids that are the same in every call; for any
    other position ids the traced computation, as under torch.compile."""

    def find_packed_sequence_indices(position_ids):
        real = constants.value(position_ids)
        if real is not None:
            with disable_torch_function(), disable_current_modes(), torch.no_grad():
                packed = find_packed(real)  # under the compile flag always the tensor
                single = packed is None or bool((packed[:, -1] == 0).all())  # eager's own test
            if single:
                return None
        return find_packed(position_ids)

    return find_packed_sequence_indices


@contextmanager
def traced_as_compiled() -> Iterator[None]:
    """Make `torch.compiler.is_compiling()` true while a step is traced (as torch.compile does
    during its compile session), so that libraries skip data-dependent shortcuts; Hugging Face's
    packed-sequence test still answers as eager for position ids that no input determines."""
    with compile_session(), _packing_from_constants(), _mask_skips_as_eager():
        yield


# the shortcuts whose answer for padding_mask None depends on lengths alone (module docstring)
_MASK_SKIPS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


@contextmanager
def _mask_skips_as_eager() -> Iterator[None]:
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not callable(getattr(masking, "is_tracing", None)):
        yield
        return
    tracing = masking.is_tracing

    def tracing_a_tensor(tensor=None) -> bool:
        return tensor is not None and tracing(tensor)  # None: no values read, no tracing to guard

    def as_eager(original: Callable) -> Callable:
        def skip(*args, **kwargs):
            padding_mask = args[0] if args else kwargs.get("padding_mask")
            if padding_mask is not None:
                return original(*args, **kwargs)
            masking.is_tracing = tracing_a_tensor
            try:
                return original(*args, **kwargs)
            finally:
                masking.is_tracing = tracing
        return skip

    originals = {name: getattr(masking, name) for name in _MASK_SKIPS if callable(getattr(masking, name, None))}
    for name, original in originals.items():
        setattr(masking, name, as_eager(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)


@contextmanager
def _packing_from_constants() -> Iterator[None]:
    masking = sys.modules.get("transformers.masking_utils")  # imported by every model that uses it
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    constants = _Constants()
    masking.find_packed_sequence_indices = _packing_as_eager(original, constants)
    try:
        with constants:
            yield
    finally:
        masking.find_packed_sequence_indices = original
