"""Route a linear head followed by cross-entropy to the chunked op while a training step is traced.

Inside `route_loss_head()`, a TorchFunctionMode follows what each linear's output becomes:

    logits = F.linear(h, W, b)            # nn.Linear (tied or not), or h @ W.t() / W.T / W.mT
    logits = logits.float()                # optional upcast: .float(), .to(float32/float64), .double()
    logits = logits[..., :-1, :]           # optional: indexing that keeps the vocabulary dim whole
    logits = logits.view(-1, V)            # optional: view / reshape / flatten / contiguous keeping V last
    loss = F.cross_entropy(logits, target, ignore_index=..., label_smoothing=..., reduction="mean"|"sum")
    # or: loss = F.nll_loss(F.log_softmax(logits, dim=-1), target, ignore_index=..., reduction=...)

(Hugging Face's ForCausalLMLoss is this chain: it shifts the labels, not the logits.) Each step tags
its result with the head's hidden states `h` transformed the same way (a linear is row-wise, so
`linear(h)[idx] == linear(h[idx])` for an index that keeps the last dim whole, and a reshape that keeps
the last dim keeps each row's place). At the loss, `torch.ops.remat.chunked_linear_cross_entropy`
computes it from `h`, `W` and `b` instead of from the logits.

Why this is the model's function:

* the op computes the logits as the linear did (`h`, `W`, `b` cast to the linear's output dtype, as
  autocast or the model cast them) and the loss in the dtype eager's cross-entropy computes it in
  (the upcast's, or float32 where autocast runs cross-entropy in float32);
* in-place ops: every tag remembers its tensor's version, and the chain remembers the versions of
  `h`, `W` and `b` at the linear; a tagged tensor modified since it was tagged ends its chain, and the
  loss is left to the model's code if `h`, `W` or `b` changed before it (the op reads them again);
* only cross-entropy without class weights, with reduction "mean" or "sum", on (N, V) logits and an
  (N,) int64 target, is routed; log_softmax only over the last dim, in float32 or float64.

The logits may be read elsewhere too (Hugging Face models return them as `.logits`). The linear the
model called is still in the traced graph: whatever reads the logits reads its output, the same
values as eager's. Where nothing else reads them, the linear and the [tokens, vocab] tensors after it
are dead code and vanish from the graph; where something does (a returned `.logits`), they stay, and
the step holds the logits besides the chunked loss. Whether that pays is decided when the step is
planned (remat/pipeline.py weighs the step with and without the chunked head under the budget).

Anything else passes through untouched, and the router records why in `passed`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import register_flop_formula
from torch.utils.weak import WeakIdKeyDictionary

from remat.attention.spellings import torch_callables
from remat.compat.torch_private import tensor_base
from remat.loss_head.op import REDUCTIONS, chunk_rows_for

__all__ = ["route_loss_head", "LossHeadRouter", "HeadChain", "chunked_loss_mode"]


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


# FLOPs of the op: the logits' matmul in the forward; the logits again, dh and dW in the backward
@register_flop_formula(torch.ops.remat.chunked_linear_cross_entropy)
def _forward_flops(h_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * h_shape[0] * h_shape[1] * w_shape[0]


@register_flop_formula(torch.ops.remat.chunked_linear_cross_entropy_backward)
def _backward_flops(dloss_shape, h_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 6 * h_shape[0] * h_shape[1] * w_shape[0]


LINEAR_OPS = frozenset({F.linear})
MATMUL_OPS = torch_callables("__matmul__", "matmul", funcs=(torch.matmul,))
TRANSPOSE_OPS = torch_callables("t", "transpose", funcs=(torch.t, torch.transpose)) | frozenset(
    {torch.Tensor.T.__get__, tensor_base.T.__get__, torch.Tensor.mT.__get__, tensor_base.mT.__get__})
TRANSPOSE_DIMS_OPS = torch_callables("transpose", funcs=(torch.transpose,))
FLOAT_OPS = torch_callables("float", "double")
TO_OPS = torch_callables("to", "type")
RESHAPE_OPS = torch_callables("view", "reshape", "flatten", "contiguous", funcs=(torch.reshape, torch.flatten))
GETITEM_OPS = torch_callables("__getitem__")
LOG_SOFTMAX_OPS = torch_callables("log_softmax", funcs=(F.log_softmax, torch.log_softmax))
CROSS_ENTROPY_OPS = frozenset({F.cross_entropy})
NLL_OPS = frozenset({F.nll_loss})


def _version(t) -> int | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t._version
    except Exception:  # inference tensors have no version counter
        return None


def _arg(args, kwargs, i: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


@dataclass(frozen=True)
class HeadChain:
    """What a tagged tensor is: the head's logits (or their log-softmax), as `h` @ `weight`.T + `bias`."""

    stage: str  # "logits" | "logp"
    h: torch.Tensor  # the hidden states, indexed and reshaped as the logits were (rows aligned)
    weight: torch.Tensor
    bias: torch.Tensor | None
    compute_dtype: torch.dtype  # the linear's output dtype
    version: int | None  # the tagged tensor's version when it was tagged
    reads: tuple = ()  # ((tensor, version, name), ...) at the linear: what the op reads again


def _keeps_last_dim(idx, ndim: int) -> bool:
    """An index of ints and slices (and one Ellipsis) that leaves the last dim whole."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if not all(isinstance(i, (int, slice)) and not isinstance(i, bool) or i is Ellipsis for i in items):
        return False
    if sum(i is Ellipsis for i in items) > 1:
        return False
    if Ellipsis in items or len(items) >= ndim:  # the last item must then be the last dim, whole
        return len(items) > 0 and items[-1] == slice(None) and (Ellipsis in items or len(items) == ndim)
    return True  # fewer items than dims: the last dim is not indexed


class LossHeadRouter(TorchFunctionMode):
    """Counts what it routed and what it let through (with the reason), for reports."""

    def __init__(self):
        super().__init__()
        self.routed = 0
        self.passed: list[str] = []
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.transposed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # W.T -> (W, version of W.T)
        # what was computed from the head's logits after an in-place op broke the chain -> why
        self.stale: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _tag(self, t, chain: HeadChain) -> None:
        if isinstance(t, torch.Tensor):
            self.tags[t] = replace(chain, version=_version(t))

    def _chain(self, t) -> HeadChain | None:
        """t's chain if t is tagged and unchanged since."""
        if not isinstance(t, torch.Tensor):
            return None
        c = self.tags.get(t)
        if c is None or c.version is None or _version(t) != c.version:
            return None
        return c

    def _changed(self, chain: HeadChain) -> str | None:
        for t, v, name in chain.reads:
            if v is None or _version(t) != v:
                return f"in-place op on the head's {name} before the loss"
        return None

    def _linear(self, h, w, b, out) -> None:
        if not (isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor) and isinstance(out, torch.Tensor)):
            return
        if w.dim() != 2 or h.dim() < 1 or not out.dtype.is_floating_point or out.shape[-1] != w.shape[0]:
            return
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (w.shape[0],)):
            return
        reads = ((h, _version(h), "hidden states"), (w, _version(w), "weight")) + \
            (((b, _version(b), "bias"),) if b is not None else ())
        self._tag(out, HeadChain("logits", h, w, b, out.dtype, None, reads))

    def _step(self, func, args, kwargs, out) -> None:
        """Tag `out` if func is a step of the chain applied to a tagged tensor."""
        src = args[0] if args else None
        if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
            return
        chain = self._chain(src)
        why = self.stale.get(src) if src in self.stale else (
            "in-place op on the logits before the loss" if chain is None and src in self.tags
            else self._changed(chain) if chain is not None else None)
        if why is not None:  # a value the loss may still read: remembered, so its reason is told
            self.stale[out] = why
            return
        if chain is None:
            return
        if func in FLOAT_OPS or func in TO_OPS:
            if func in TO_OPS and not (len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs) \
                    and not (len(args) == 1 and set(kwargs) == {"dtype"}):
                return  # .to(device), .to(other), copy=..., non_blocking=...: not a plain cast
            # only exact casts: the same dtype, or up to float32/float64 from no more bits
            exact = out.dtype == src.dtype or (out.dtype in (torch.float32, torch.float64) and src.dtype.is_floating_point
                                               and torch.finfo(out.dtype).bits >= torch.finfo(src.dtype).bits)
            if out.shape != src.shape or not exact or out.device != src.device:
                return
            if chain.stage == "logp" and out.dtype != src.dtype:
                return
            self._tag(out, chain)
        elif func in RESHAPE_OPS:
            if out.dim() < 1 or src.dim() < 1 or out.shape[-1] != src.shape[-1] or out.numel() != src.numel() \
                    or out.dtype != src.dtype:  # view(dtype) reinterprets the bits
                return
            d = chain.h.shape[-1]
            self._tag(out, replace(chain, h=chain.h.reshape(tuple(out.shape[:-1]) + (d,))))
        elif func in GETITEM_OPS and len(args) == 2:
            idx = args[1]
            if src.dim() < 2 or not _keeps_last_dim(idx, src.dim()) or out.shape[-1] != src.shape[-1]:
                return
            h = chain.h[idx]
            if tuple(h.shape[:-1]) != tuple(out.shape[:-1]):
                return
            self._tag(out, replace(chain, h=h))
        elif func in LOG_SOFTMAX_OPS and chain.stage == "logits":
            dim = _arg(args, kwargs, 1, "dim")
            if dim is None or _arg(args, kwargs, 3 if func is F.log_softmax else 2, "dtype") is not None:
                return
            if not isinstance(dim, int) or dim % src.dim() != src.dim() - 1 or out.dtype != src.dtype \
                    or torch.finfo(src.dtype).bits < 32:
                return  # 16-bit log-softmax: eager's rounding is not the op's
            self._tag(out, replace(chain, stage="logp"))

    def _loss_reason(self, func, args, kwargs, chain: HeadChain | None, x) -> str | None:
        name = "cross_entropy" if func in CROSS_ENTROPY_OPS else "nll_loss"
        if chain is None:
            if isinstance(x, torch.Tensor) and x in self.stale:
                return f"{name}: {self.stale[x]}"
            if isinstance(x, torch.Tensor) and x in self.tags:
                return f"{name}: in-place op on its input after the head computed it"
            return f"{name}: its input is not a linear head's logits (through casts, indexing and reshapes)"
        if func in NLL_OPS and chain.stage != "logp":
            return "nll_loss on logits, not on their log_softmax"
        if func in CROSS_ENTROPY_OPS and chain.stage != "logits":
            return "cross_entropy on a log_softmax"
        target = _arg(args, kwargs, 1, "target")
        weight = _arg(args, kwargs, 2, "weight")
        reduction = _arg(args, kwargs, 6 if func in CROSS_ENTROPY_OPS else 6, "reduction", "mean")
        if weight is not None:
            return f"{name} with class weights"
        if _arg(args, kwargs, 3, "size_average") is not None or _arg(args, kwargs, 5, "reduce") is not None:
            return f"{name} with size_average/reduce"
        if reduction not in REDUCTIONS:
            return f"{name} with reduction={reduction!r}"
        if x.dim() != 2:
            return f"{name} on {x.dim()}-d logits (only (N, V) is routed)"
        if not isinstance(target, torch.Tensor) or target.dtype != torch.int64 or target.dim() != 1 \
                or target.shape[0] != x.shape[0] or target.device != x.device:
            return f"{name}: target is not (N,) int64 class indices"
        if func in CROSS_ENTROPY_OPS:
            eps = _arg(args, kwargs, 7, "label_smoothing", 0.0)
            if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0.0 <= float(eps) <= 1.0:
                return f"cross_entropy with label_smoothing={eps!r}"
        return self._changed(chain)

    def _route_loss(self, func, args, kwargs) -> tuple[bool, object]:
        x = args[0] if args else kwargs.get("input")
        chain = self._chain(x)
        reason = self._loss_reason(func, args, kwargs, chain, x)
        if reason is not None:
            if chain is not None or (isinstance(x, torch.Tensor) and (x in self.tags or x in self.stale)):
                self.passed.append(reason)
            return False, None
        eager = func(*args, **kwargs)  # traced, then unused: dead code; tells the dtype eager computes in
        math_dtype = eager.dtype
        if not math_dtype.is_floating_point or torch.finfo(math_dtype).bits < 32 \
                or torch.finfo(math_dtype).bits < torch.finfo(chain.compute_dtype).bits:
            self.passed.append(f"cross-entropy computed in {math_dtype} (the op computes in 32 bits or more)")
            return True, eager
        if func in CROSS_ENTROPY_OPS and x.dtype != math_dtype and not _autocast_upcasts(x):
            self.passed.append(f"cross-entropy on {x.dtype} logits computed in {math_dtype}")
            return True, eager
        target = _arg(args, kwargs, 1, "target")
        ignore_index = int(_arg(args, kwargs, 4, "ignore_index", -100))
        reduction = _arg(args, kwargs, 6, "reduction", "mean")
        eps = float(_arg(args, kwargs, 7, "label_smoothing", 0.0)) if func in CROSS_ENTROPY_OPS else 0.0
        h = chain.h.reshape(-1, chain.h.shape[-1])
        n, d, v = h.shape[0], h.shape[1], chain.weight.shape[0]
        self.routed += 1
        loss, _lse = torch.ops.remat.chunked_linear_cross_entropy(
            h, chain.weight, chain.bias, target, ignore_index, eps, reduction, chain.compute_dtype, math_dtype,
            chunk_rows_for(n, d, v))
        return True, loss

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CROSS_ENTROPY_OPS or func in NLL_OPS:
            done, out = self._route_loss(func, args, kwargs)
            if done:
                return out
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in LINEAR_OPS:
            self._linear(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"),
                         _arg(args, kwargs, 2, "bias"), out)
        elif func in MATMUL_OPS and len(args) == 2 and isinstance(args[1], torch.Tensor) and args[1] in self.transposed:
            w, v = self.transposed[args[1]]
            if _version(args[1]) == v and args[0] is not None and isinstance(args[0], torch.Tensor) \
                    and args[0].dim() >= 1:
                self._linear(args[0], w, None, out)
        elif func in TRANSPOSE_OPS and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 2 \
                and isinstance(out, torch.Tensor) and out.dim() == 2:
            if func in TRANSPOSE_DIMS_OPS:
                d0, d1 = _arg(args, kwargs, 1, "dim0"), _arg(args, kwargs, 2, "dim1")
                if not (isinstance(d0, int) and isinstance(d1, int) and {d0 % 2, d1 % 2} == {0, 1}):
                    return out
            self.transposed[out] = (args[0], _version(out))
        elif args:
            self._step(func, args, kwargs, out)
        return out


def _autocast_upcasts(x: torch.Tensor) -> bool:
    """Autocast is on for x's device: eager's cross-entropy then computes in float32."""
    try:
        return torch.is_autocast_enabled(x.device.type)
    except RuntimeError:
        return False


def chunked_loss_mode(value) -> str:
    """Normalise the `chunked_loss` option: "off", "on" (the chunked head wherever it is routed)
    or "auto" (where it makes the cheaper plan that fits: remat/pipeline.py)."""
    modes = {False: "off", True: "on", "off": "off", "on": "on", "auto": "auto"}
    if not isinstance(value, (bool, str)) or value not in modes:
        raise ValueError(f"chunked_loss must be True, False, 'on', 'off' or 'auto', got {value!r}")
    return modes[value]


@contextmanager
def route_loss_head(enabled: bool | str = True):
    """Route the loss head while tracing (see the module doc); yields the router, or None when off."""
    if chunked_loss_mode(enabled) == "off":
        yield None
        return
    router = LossHeadRouter()
    with router:
        yield router
