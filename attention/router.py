"""Route attention to remat's fused flash-attention op while a training step is traced.

Inside `route_attention()`, attention the fused op can take becomes one
`torch.ops.remat.flash_attention` node, whose autograd formula saves only the output and the
per-row log-sum-exp: no s x s tensor lives across the step. Two spellings are recognised:

* `F.scaled_dot_product_attention` without an explicit mask or dropout (`is_causal` only with as
  many queries as keys: SDPA aligns its causal mask top-left, the fused op bottom-right);
* the explicit softmax(Q K^T * scale [masked causal]) V chain (see `pattern`), without
  dropout on the probabilities, and only if nothing it relies on was modified in place before the
  closing `@ v` (version counters; the common in-place spellings `att /= s`, `att.masked_fill_`,
  `att += causal_mask` are understood exactly).

With `fuse_dropout=True` both spellings are also fused when their probabilities go through dropout:
the op then drops them with its own hashed mask (`dropout_hash`), drawn from a seed that
torch's generator provides. The distribution is the same as torch's dropout, the masks are not, so
this is opt-in: without it, attention with dropout is left to the model's own code and the module
draws exactly the model's random masks (fused attention without dropout computes the same
function, up to floating-point rounding).

q/k/v must be 4-D (B, H, S, D) with one dtype and head dim <= 128. The op runs the Triton kernels
on CUDA and PyTorch code computing the same values on CPU, so a plan made on CPU describes the GPU
graph too. Anything else passes through untouched, and the router records why.

Under autocast, in "exact" mode, attention stays unfused (`autocast_fusion_reason`): the
spelled-out chain under autocast rounds its scores to 16 bits after the matmul and again after the
scale, runs softmax on them (in 16 bits on CPU, in float32 on CUDA, where autocast lists softmax as
a float32 op) and rounds the probabilities to 16 bits before `@ v`;
SDPA under autocast runs its own 16-bit kernel. The fused op keeps scores and probabilities in
float32 and rounds once, at its output. Its results differ from eager autocast by 16-bit
roundings (the default GPT's gradients by up to 1e-4 after one step), far beyond the float32
tolerance (rtol 1e-5, atol 1e-6) that "exact" keeps, so attention stays unfused there.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
import torch.utils.flop_counter as flop_counter
from torch.utils.flop_counter import register_flop_formula

from remat.attention.dropout_hash import draw_seed
from remat.attention.launch import TRITON_MAX_HEAD_DIM
from remat.attention.op import flash_attention
from remat.attention.pattern import ExplicitAttentionTracker, version_of
import remat.compat.torch_private  # noqa: F401  (its grouped-query FLOP backport)

__all__ = ["route_attention", "AttentionRouter", "fused_attention_mode", "autocast_fusion_reason"]


# FLOPs of the fused op, counted as PyTorch counts SDPA (so FlopCounterMode and the cost model
# see the same numbers as for the attention it replaces); through the module's functions, which
# compat.count_grouped_query_attention (applied when compat is imported) makes count grouped-query
# shapes on torch < 2.13
@register_flop_formula(torch.ops.remat.flash_attention)
def _flash_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.remat.flash_attention_backward)
def _flash_bwd_flops(dout_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(dout_shape, q_shape, k_shape, v_shape)


def autocast_fusion_reason(t: torch.Tensor) -> str | None:
    """Why attention on `t`'s device, traced now, must stay unfused to keep the model's function
    (autocast is on there: see the module doc), or None."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        enabled = torch.is_autocast_enabled(t.device.type)
    except RuntimeError:  # a device type autocast does not know (meta, ...): never on there
        return None
    if not enabled:
        return None
    dtype = torch.get_autocast_dtype(t.device.type)
    return (f"autocast({t.device.type}, {dtype}) is on: eager autocast rounds the scores and "
            f"probabilities to {dtype}, the fused op does not (use fused_attention='all' to fuse anyway)")


def _heads_interleaved(q: torch.Tensor) -> bool:
    """q is (B, H, S, D) laid out as (B, S, H, D) in memory (heads split off one projection by
    `.view(B, S, H, D).transpose(1, 2)`): torch's SDPA then returns its output in that layout."""
    return q.dim() == 4 and not q.is_contiguous() and q.transpose(1, 2).is_contiguous()


def _shape_reason(q, k, v) -> str | None:
    """Why the fused op cannot take q/k/v, or None."""
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (q, k, v)):
        return "q/k/v are not (B, H, S, D)"
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}"
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]) or q.shape[-1] > TRITON_MAX_HEAD_DIM:
        return f"head dims {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1:3] != v.shape[1:3] \
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}"
    return None


class AttentionRouter(TorchFunctionMode):
    """Counts what it routed and what it let through (with the reason), for reports."""

    def __init__(self, model: torch.nn.Module | None = None, fuse_dropout: bool = False):
        super().__init__()
        self.routed = 0
        self.passed: list[str] = []
        self.fuse_dropout = fuse_dropout
        self.explicit = ExplicitAttentionTracker(fuse_dropout)
        if model is not None:
            self.explicit.watch_buffers(model)

    def _sdpa_reason(self, args, kwargs) -> str | None:
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        if mask is not None:
            return "explicit attn_mask"
        if dropout and not self.fuse_dropout:
            return f"dropout_p={dropout} (fuse_dropout is off)"
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4 \
                and q.shape[1] != k.shape[1] and not kwargs.get("enable_gqa", False):
            return "head counts"
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        if causal and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4 \
                and q.shape[-2] != k.shape[-2]:
            # SDPA aligns its causal mask top-left, the fused op bottom-right: equal only for Sq == Sk
            return f"is_causal with {q.shape[-2]} queries and {k.shape[-2]} keys (top-left aligned)"
        return _shape_reason(q, k, v) or self._autocast_reason(q)

    def _autocast_reason(self, q) -> str | None:
        # in "exact" mode attention traced under autocast stays unfused: eager
        # autocast rounds scores and probabilities to 16 bits, the fused op does not (see
        # remat.graph_capture.autocast_state); "all" opts into the fused op's function anyway
        return None if self.fuse_dropout else autocast_fusion_reason(q)

    def _route(self, q, k, v, causal: bool, scale: float, dropout_p: float = 0.0, seed=None,
               sdpa_layout: bool = False) -> torch.Tensor:
        self.routed += 1
        # the output is laid out in memory as what it replaces returns it (SDPA: like its query, so
        # (B, S, H, D) for heads split off a (B, S, H*D) projection; `probs @ v`: contiguous), so the
        # model's later views and copies behave, and cost, as in eager
        return flash_attention(q, k, v, causal=causal, scale=scale, dropout_p=dropout_p, seed=seed,
                               sdpa_layout=sdpa_layout)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            reason = self._sdpa_reason(args, kwargs)
            if reason is None:
                q, k, v = args[:3]
                causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
                scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
                dropout = float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0))
                return self._route(q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
                                   dropout, draw_seed(q.device) if dropout > 0 else None,
                                   sdpa_layout=_heads_interleaved(q))
            self.passed.append(f"scaled_dot_product_attention: {reason}")
            return func(*args, **kwargs)
        closing = self.explicit.final(func, args, kwargs)
        if closing is not None:
            chain, v, reason = closing  # reason: an in-place op changed what the chain computes
            reason = reason or (f"dropout p={chain.dropout_p} on the probabilities (fuse_dropout is off)"
                                if chain.dropout_p > 0 and chain.seed is None
                                else _shape_reason(chain.q, chain.k, v) or self._autocast_reason(chain.q))
            if reason is None:
                # the scores/softmax chain traced so far is now unused: dead code in the graph
                return self._route(chain.q, chain.k, v, chain.causal, chain.scale, chain.dropout_p, chain.seed)
            self.passed.append(f"explicit attention: {reason}")
        replaced = self.explicit.replace_dropout(func, args, kwargs)
        if replaced is not None:
            return replaced
        # args[0]'s version before the op: tells the tracker whether an in-place op (att /= s) was
        # applied to an untouched chain value
        pre_version = version_of(args[0]) if args else None
        out = func(*args, **kwargs)
        self.explicit.replay_mask_op(func, args, kwargs, out)
        reason = self.explicit.step(func, args, kwargs, out, pre_version)
        if reason is not None:
            self.passed.append(reason)
        return out


def fused_attention_mode(value: bool | str) -> str:
    """Normalise the `fused_attention` option to "off", "exact" or "all"."""
    modes = {False: "off", True: "exact", "off": "off", "exact": "exact", "all": "all"}
    if not isinstance(value, (bool, str)) or value not in modes:
        raise ValueError(f"fused_attention must be True, False, 'exact', 'all' or 'off', got {value!r}")
    return modes[value]


@contextmanager
def route_attention(enabled: bool | str = True, model: torch.nn.Module | None = None):
    """Route attention while tracing. `enabled`: True (or "exact") fuses attention without dropout
    on its probabilities, "all" fuses attention with dropout too (see the module doc), False
    nothing. Pass the `model` so that causal-mask buffers it holds are recognised."""
    mode = fused_attention_mode(enabled)
    if mode == "off":
        yield None
        return
    router = AttentionRouter(model, fuse_dropout=mode == "all")
    try:
        with router:
            yield router
    finally:
        router.explicit.close()
