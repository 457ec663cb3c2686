"""Route attention to remat's fused flash-attention op while a training step is traced.

Inside `route_attention()`, every call of `F.scaled_dot_product_attention` that the fused op can
take (no explicit mask, no dropout, 4-D q/k/v, head dim <= 128) becomes one
`torch.ops.remat.flash_attention` node, whose autograd formula saves only the output and the
per-row log-sum-exp: no s x s tensor lives across the step. The op runs the Triton kernels on
CUDA and PyTorch code computing the same values on CPU, so a plan made on CPU describes the GPU
graph too. Anything else passes through untouched.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from remat.runtime import triton_attention
from remat.runtime.triton_attention import flash_attention

__all__ = ["route_attention", "AttentionRouter"]


# FLOPs of the fused op, counted as PyTorch counts SDPA (so FlopCounterMode and the cost model
# see the same numbers as for the attention it replaces)
@register_flop_formula(torch.ops.remat.flash_attention)
def _flash_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.remat.flash_attention_backward)
def _flash_bwd_flops(dout_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(dout_shape, q_shape, k_shape, v_shape)


class AttentionRouter(TorchFunctionMode):
    """Counts what it routed and what it let through (with the reason), for reports."""

    def __init__(self):
        super().__init__()
        self.routed = 0
        self.passed: list[str] = []

    def _reason(self, args, kwargs) -> str | None:
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        if mask is not None:
            return "explicit attn_mask"
        if dropout:
            return f"dropout_p={dropout}"
        if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (q, k, v)):
            return "q/k/v are not (B, H, S, D)"
        if q.shape[-1] > triton_attention.TRITON_MAX_HEAD_DIM or not q.dtype.is_floating_point:
            return f"head dim {q.shape[-1]} / dtype {q.dtype}"
        if q.shape[1] % k.shape[1] and not kwargs.get("enable_gqa", False):
            return "head counts"
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            reason = self._reason(args, kwargs)
            if reason is None:
                q, k, v = args[:3]
                causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
                scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
                self.routed += 1
                return flash_attention(q, k, v, causal=causal,
                                       scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
            self.passed.append(reason)
        return func(*args, **kwargs)


@contextmanager
def route_attention(enabled: bool = True):
    if not enabled:
        yield None
        return
    with AttentionRouter() as router:
        yield router
