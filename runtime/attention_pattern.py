"""Recognise the explicit attention pattern, softmax(mask(Q K^T * scale)) V, while a step is traced.

Many models (nanoGPT, minGPT, the default model) spell attention out:

    att = (q @ k.transpose(-2, -1)) * scale          # or / sqrt(d)
    att = att.masked_fill(~causal_mask[..., :T, :T], float("-inf"))   # or + mask (0 / -inf); optional
    att = F.softmax(att, dim=-1)
    att = dropout(att)                                # optional
    y = att @ v

`ExplicitAttentionTracker` follows that chain op by op inside a TorchFunctionMode: each step tags
its result with what it has seen so far (q, k, scale, mask). When the chain ends in `att @ v`, the
router returns the fused op's output instead; the scores, mask and softmax it traced on the way
are then unused and dropped from the graph as dead code, so the s x s tensors never exist.

Dropout on the probabilities is fused only when the router is asked to (`fuse_dropout`): the
tracker then replaces it with the op's own hashed dropout (`attention_dropout.hashed_dropout`, same
distribution, masks from remat's generator rather than torch's), so that the fused op, given the
same seed, computes exactly what the spelled-out chain would.

The mask must be known to be causal (or empty). Masks are small deterministic tensors (a causal
buffer, or tril(ones(T, T)) built in forward), so the tracker keeps a real copy ("shadow") of
each one next to the traced value: it copies the model's small buffers before tracing, and
replays cheap mask-building ops (slicing, ~, tril, comparisons, ...) on the copies. Anything it
cannot prove causal is left alone, and the reason is reported.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from remat.runtime.attention_dropout import draw_seed, hashed_dropout

__all__ = ["ExplicitAttentionTracker", "AttentionChain"]

# masks bigger than this are not shadowed (a causal mask for S = 4096 has 16M entries)
_SHADOW_MAX_NUMEL = 1 << 26


def _ops(*names: str, funcs: tuple = ()) -> frozenset:
    """The callables a TorchFunctionMode sees for these Tensor methods (Tensor's own Python
    wrappers and TensorBase's C methods) plus the given functions."""
    found = set(funcs)
    for name in names:
        for cls in (torch.Tensor, torch._C.TensorBase):
            if hasattr(cls, name):
                found.add(getattr(cls, name))
    return frozenset(found)


# ops that build masks: replayed on the shadows, cheap and deterministic
_MASK_OPS = _ops("__getitem__", "__invert__", "logical_not", "bitwise_not", "__eq__", "__ne__", "__lt__",
                 "__le__", "__gt__", "__ge__", "eq", "ne", "lt", "le", "gt", "ge", "tril", "triu", "view",
                 "reshape", "unsqueeze", "expand", "bool", "to", "float", "__and__", "__or__", "logical_and",
                 "logical_or", "t", "transpose",
                 funcs=(torch.logical_not, torch.bitwise_not, torch.eq, torch.ne, torch.lt, torch.le, torch.gt,
                        torch.ge, torch.tril, torch.triu, torch.ones, torch.zeros, torch.ones_like,
                        torch.zeros_like, torch.full, torch.arange, torch.logical_and, torch.logical_or))
_TRANSPOSE_OPS = _ops("transpose", funcs=(torch.transpose,))
_MT_OPS = frozenset({torch.Tensor.mT.__get__, torch._C.TensorBase.mT.__get__})
_MATMUL_OPS = _ops("__matmul__", "matmul", funcs=(torch.matmul,))
_MUL_OPS = _ops("__mul__", "__rmul__", "mul", funcs=(torch.mul,))
_DIV_OPS = _ops("__truediv__", "div", funcs=(torch.div,))
_MASKED_FILL_OPS = _ops("masked_fill", funcs=(torch.masked_fill,))
_ADD_OPS = _ops("__add__", "__radd__", "add", funcs=(torch.add,))
_SOFTMAX_OPS = _ops("softmax", funcs=(F.softmax, torch.softmax))
_CAST_OPS = _ops("float", "to", "type_as")


@dataclass(frozen=True)
class AttentionChain:
    """What the value at one step of the pattern is made of."""

    stage: str  # "kT" | "scores" | "masked" | "probs"
    q: torch.Tensor | None
    k: torch.Tensor
    scale: float = 1.0
    causal: bool = False
    dropout_p: float = 0.0  # dropout applied to the probabilities
    seed: torch.Tensor | None = None  # the hashed dropout's seed, when dropout was replaced


def _arg(args, kwargs, i: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _is_last_two(d0: int, d1: int, ndim: int) -> bool:
    return {d0 % ndim, d1 % ndim} == {ndim - 2, ndim - 1}


class ExplicitAttentionTracker:
    """Tags traced tensors with their place in the explicit attention pattern (see module doc)."""

    def __init__(self, fuse_dropout: bool = False):
        self.fuse_dropout = fuse_dropout
        self.chains = WeakIdKeyDictionary()  # traced tensor -> AttentionChain
        self.shadows = WeakIdKeyDictionary()  # traced mask tensor -> real CPU copy
        self._handles = []

    # ---- mask shadows ------------------------------------------------------------------------
    def watch_buffers(self, model: nn.Module) -> None:
        """Copy the model's small buffers now; when a module runs during tracing, map the traced
        buffer it sees to that copy (AOTAutograd swaps buffers for traced values)."""
        for mod in model.modules():
            # masks are square in their last two dims; other buffers (running stats, rotary
            # caches) are not copied
            small = {n: b.detach().to("cpu", copy=True) for n, b in mod._buffers.items()
                     if b is not None and b.dim() >= 2 and b.shape[-1] == b.shape[-2]
                     and b.numel() <= _SHADOW_MAX_NUMEL and not b.dtype.is_complex}
            if not small:
                continue

            def pre(m, args, _small=small):
                for name, real in _small.items():
                    traced = m._buffers.get(name)
                    if isinstance(traced, torch.Tensor):
                        self.shadows[traced] = real

            self._handles.append(mod.register_forward_pre_hook(pre))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _shadow_of(self, x):
        if isinstance(x, torch.Tensor):
            return self.shadows.get(x)
        return x

    def replay_mask_op(self, func, args, kwargs, out) -> None:
        """If `func` builds a mask from shadowed (or no) tensors, compute its shadow too."""
        if func not in _MASK_OPS or not isinstance(out, torch.Tensor) or out.numel() > _SHADOW_MAX_NUMEL:
            return
        leaves, spec = pytree.tree_flatten((args, kwargs))
        real = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                s = self.shadows.get(x)
                if s is None:
                    return
                real.append(s)
            elif isinstance(x, torch.device):
                real.append(torch.device("cpu"))
            else:
                real.append(x)
        r_args, r_kwargs = pytree.tree_unflatten(real, spec)
        if "device" in r_kwargs:
            r_kwargs["device"] = "cpu"
        with _disable_current_modes():
            try:
                shadow = func(*r_args, **r_kwargs)
            except Exception:  # a mask we cannot replay is simply not known
                return
        if isinstance(shadow, torch.Tensor) and tuple(shadow.shape) == tuple(out.shape):
            self.shadows[out] = shadow

    def _mask_kind(self, mask, sq: int, sk: int) -> str | None:
        """'causal' (bottom-right aligned, as the fused op), 'none' (masks nothing), or None."""
        with _disable_current_modes():  # the shadows are real tensors: step outside fake mode
            return self._real_mask_kind(self._shadow_of(mask), sq, sk)

    def _additive_mask_kind(self, bias, sq: int, sk: int) -> str | None:
        """The same for an additive float mask: 0 where visible, -inf (or <= -1e4) where not."""
        with _disable_current_modes():
            real = self._shadow_of(bias)
            if not isinstance(real, torch.Tensor) or not real.dtype.is_floating_point:
                return None
            blocked = real <= -1e4
            if not bool((blocked | (real == 0)).all()):
                return None  # a real bias (ALiBi, relative positions): not the fused op's function
            return self._real_mask_kind(blocked, sq, sk)

    @staticmethod
    def _real_mask_kind(real, sq: int, sk: int) -> str | None:
        if not isinstance(real, torch.Tensor) or real.dtype != torch.bool or real.dim() < 2:
            return None
        if tuple(real.shape[-2:]) != (sq, sk):
            try:
                real = torch.broadcast_to(real, real.shape[:-2] + (sq, sk))
            except RuntimeError:
                return None
        flat = real.reshape(-1, sq, sk)
        if not flat.any():
            return "none"
        causal = torch.ones(sq, sk, dtype=torch.bool).triu(1 + sk - sq)
        return "causal" if bool((flat == causal).all()) else None

    # ---- the chain ---------------------------------------------------------------------------
    def step(self, func, args, kwargs, out) -> str | None:
        """Tag `out` if `func(*args, **kwargs)` extends a chain. Returns a reason when a chain is
        broken in a way the user may want to know about."""
        if not isinstance(out, torch.Tensor):
            return None
        x = args[0] if args else None
        if func in _TRANSPOSE_OPS or func in _MT_OPS:
            if isinstance(x, torch.Tensor) and x.dim() == 4:
                d0, d1 = (-2, -1) if func in _MT_OPS else (_arg(args, kwargs, 1, "dim0"), _arg(args, kwargs, 2, "dim1"))
                if _is_last_two(d0, d1, 4):
                    self.chains[out] = AttentionChain("kT", None, x)
            return None
        if func in _MATMUL_OPS and len(args) >= 2:
            a, b = args[0], args[1]
            cb = self.chains.get(b) if isinstance(b, torch.Tensor) else None
            if cb is not None and cb.stage == "kT" and isinstance(a, torch.Tensor) and a.dim() == 4:
                self.chains[out] = AttentionChain("scores", a, cb.k)
            return None
        if func in _ADD_OPS and len(args) > 1 and kwargs.get("alpha", 1) == 1:
            return self._add_mask(args[0], args[1], out)
        chain = self.chains.get(x) if isinstance(x, torch.Tensor) else None
        if chain is None or chain.stage == "kT":
            return None
        if func in _MUL_OPS or func in _DIV_OPS:
            other = args[1] if len(args) > 1 else kwargs.get("other")
            if chain.stage == "scores" and isinstance(other, (int, float)) and other != 0 and \
                    kwargs.get("rounding_mode") is None:
                factor = other if func in _MUL_OPS else 1.0 / other
                self.chains[out] = replace(chain, scale=chain.scale * factor)
            return None
        if func in _MASKED_FILL_OPS:
            mask, value = _arg(args, kwargs, 1, "mask"), _arg(args, kwargs, 2, "value")
            if chain.stage != "scores":
                return None
            kind = self._mask_kind(mask, out.shape[-2], out.shape[-1])
            if kind is None:
                return "explicit attention: mask not recognised as causal"
            if not (isinstance(value, (int, float)) and value <= -1e4):
                return f"explicit attention: masked_fill value {value!r}"
            self.chains[out] = replace(chain, stage="masked", causal=kind == "causal")
            return None
        if func in _SOFTMAX_OPS:
            dim = _arg(args, kwargs, 1, "dim")
            if chain.stage in ("scores", "masked") and dim in (-1, out.dim() - 1) \
                    and kwargs.get("dtype") is None:
                self.chains[out] = replace(chain, stage="probs")
            return None
        if func is F.dropout and chain.stage == "probs":
            p, training = _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", True)
            self.chains[out] = replace(chain, dropout_p=float(p) if training else 0.0)
            return None
        if func in _CAST_OPS and chain.stage in ("scores", "masked", "probs"):
            self.chains[out] = chain  # dtype casts around softmax do not change the pattern
        return None

    def _add_mask(self, a, b, out: torch.Tensor) -> str | None:
        """scores + mask (either order), the mask 0 where visible and -inf where not."""
        for scores, bias in ((a, b), (b, a)):
            chain = self.chains.get(scores) if isinstance(scores, torch.Tensor) else None
            if chain is None or chain.stage != "scores":
                continue
            kind = self._additive_mask_kind(bias, out.shape[-2], out.shape[-1]) \
                if isinstance(bias, torch.Tensor) else None
            if kind is None:
                return "explicit attention: the bias added to the scores is not a causal 0/-inf mask"
            self.chains[out] = replace(chain, stage="masked", causal=kind == "causal")
            return None
        return None

    def replace_dropout(self, func, args, kwargs) -> torch.Tensor | None:
        """With `fuse_dropout`, dropout on a chain's probabilities becomes the fused op's hashed
        dropout (returned here, instead of running torch's); otherwise None."""
        if not self.fuse_dropout or func is not F.dropout or not args:
            return None
        chain = self.chains.get(args[0]) if isinstance(args[0], torch.Tensor) else None
        p, training = _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", True)
        if chain is None or chain.stage != "probs" or not training or not 0.0 < p < 1.0 or args[0].dim() != 4:
            return None
        seed = draw_seed(args[0].device)
        out = hashed_dropout(args[0], float(p), seed)
        self.chains[out] = replace(chain, dropout_p=float(p), seed=seed)
        return out

    def final(self, func, args, kwargs) -> tuple[AttentionChain, torch.Tensor] | None:
        """(chain, v) if `func(*args)` is the closing `probs @ v` of a chain."""
        if func not in _MATMUL_OPS or len(args) < 2:
            return None
        p, v = args[0], args[1]
        chain = self.chains.get(p) if isinstance(p, torch.Tensor) else None
        if chain is None or chain.stage != "probs" or not isinstance(v, torch.Tensor) or v.dim() != 4:
            return None
        return chain, v
