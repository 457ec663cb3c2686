"""Fused FlashAttention-2 (forward and backward), exposed as a PyTorch custom op.

Layout: ``q`` is ``(B, Hq, Sq, D)``, ``k`` and ``v`` are ``(B, Hkv, Sk, D)`` (any strides);
``Hkv`` must divide ``Hq`` (grouped-query attention: query head ``h`` reads kv head
``h // (Hq // Hkv)``, and dK/dV are summed over the query heads of a group).

Causal masking uses the *bottom-right* alignment of FlashAttention-2: query row ``i`` may see key
``j`` iff ``j <= i + (Sk - Sq)``.  For ``Sq == Sk`` this is the usual lower-triangular mask (the
same as ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``).  Rows that can see no
key at all (``Sq > Sk`` with causal) produce a zero output, ``lse = -inf`` and zero gradients.

Only tiles that cross the causal diagonal or the ends of ``Sq``/``Sk`` compute an element mask; the
loops skip key (query) tiles no query (key) of the block can see.

The op saves only ``q, k, v, out, lse`` for backward (``lse`` is the per-row log-sum-exp of the
scaled scores, ``(B, Hq, Sq)``, fp32 -- fp64 for fp64 inputs); no ``Sq x Sk`` tensor is kept.

Dispatch: on GPUs where torch's SDPA runs cuDNN's attention (Hopper and newer), CUDA tensors run
cuDNN's kernels when `attention.cudnn.cudnn_runs_on` accepts them (no dropout, no gradient into lse,
see that module); float32 and float64 CPU tensors run torch's CPU flash kernel under the same conditions
(`attention.cpu_flash`); else (`attention.launch.use_triton`) CUDA tensors run the Triton kernels (`attention.kernels`,
launched by `attention.launch`) when Triton is importable; CPU tensors run a chunked PyTorch
reference with the same math and the same outputs/saved tensors (`attention.reference`), unless
``TRITON_INTERPRET=1`` is set and Triton is importable, in which case the Triton kernels run in the
Triton interpreter (that is how the tests exercise them).  Triton is imported lazily; this module
imports and works (reference path only) without it.

Public API::

    flash_attention(q, k, v, causal=False, scale=None, dropout_p=0.0, seed=None) -> out
    flash_attention_with_lse(q, k, v, causal=False, scale=None, dropout_p=0.0, seed=None) -> (out, lse)
    torch.ops.remat.flash_attention(q, k, v, causal: bool, scale: float, dropout_p=0.0, seed: Tensor?=None)
        -> (out, lse)
    torch.ops.remat.flash_attention_backward(dout, q, k, v, out, lse, dlse: Tensor?, causal, scale,
        dropout_p=0.0, seed: Tensor?=None) -> (dq, dk, dv)

Attention dropout (``dropout_p > 0``) drops the probabilities with a counter-based hash of
``(seed, head, row, column)`` (``attention.dropout_hash``), so the backward regenerates the forward's
mask tile by tile and nothing of size ``Sq x Sk`` is stored; the CPU path uses the same hash.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from remat.attention.cpu_flash import cpu_flash_backward, cpu_flash_forward, cpu_flash_runs_on
from remat.attention.cudnn import cudnn_backward, cudnn_forward, cudnn_runs_on
from remat.attention.dropout_hash import draw_seed, dropout_threshold
from remat.attention.launch import triton_backward, triton_forward, use_triton
from remat.attention.reference import (lse_dtype, new_attention_output, reference_attention_backward,
                                       reference_attention_forward)

__all__ = ["flash_attention", "flash_attention_with_lse", "flash_attention_op", "flash_attention_backward_op"]


def _check(q, k, v, dropout_p: float = 0.0, seed=None):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("flash_attention expects 4-d tensors q (B,Hq,Sq,D), k/v (B,Hkv,Sk,D)")
    B, H, SQ, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] == 0 or H % k.shape[1] != 0:
        raise ValueError(f"kv heads ({k.shape[1]}) must divide query heads ({H})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"dtype mismatch: {q.dtype}, {k.dtype}, {v.dtype}")
    dropout_threshold(dropout_p)  # raises for p outside [0, 1)
    if dropout_p > 0.0 and (seed is None or seed.numel() != 1 or seed.dtype != torch.int64):
        raise ValueError("attention dropout needs a 1-element int64 seed tensor")


def _use_triton_for(q, k) -> bool:
    return q.numel() > 0 and k.shape[2] > 0 and use_triton(q)


@torch.library.custom_op("remat::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                       dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None, sdpa_layout: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, v, dropout_p, seed)
    if cudnn_runs_on(q, k, v, causal, dropout_p):
        return cudnn_forward(q, k, v, causal, scale, sdpa_layout)
    if _use_triton_for(q, k):
        return triton_forward(q, k, v, causal, scale, dropout_p, seed, sdpa_layout)
    if cpu_flash_runs_on(q, k, causal, dropout_p):
        return cpu_flash_forward(q, k, v, causal, scale, sdpa_layout)
    return reference_attention_forward(q, k, v, causal, scale, dropout_p, seed, sdpa_layout)


@flash_attention_op.register_fake
def _flash_attention_fake(q, k, v, causal, scale, dropout_p=0.0, seed=None, sdpa_layout=False):
    _check(q, k, v, dropout_p, seed)
    B, H, SQ, D = q.shape
    return new_attention_output(q, sdpa_layout), q.new_empty((B, H, SQ), dtype=lse_dtype(q.dtype))


@torch.library.custom_op("remat::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                                causal: bool, scale: float, dropout_p: float = 0.0,
                                seed: Optional[torch.Tensor] = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if dlse is None and lse.dtype == torch.float32 and cudnn_runs_on(q, k, v, causal, dropout_p):
        return cudnn_backward(dout, q, k, v, out, lse, causal, scale)
    if _use_triton_for(q, k) and lse.dtype == torch.float32:
        return triton_backward(dout, q, k, v, out, lse, dlse, causal, scale, dropout_p, seed)
    if dlse is None and cpu_flash_runs_on(q, k, causal, dropout_p):
        return cpu_flash_backward(dout, q, k, v, out, lse, causal, scale)
    return reference_attention_backward(dout, q, k, v, out, lse, dlse, causal, scale, dropout_p, seed)


@flash_attention_backward_op.register_fake
def _flash_attention_backward_fake(dout, q, k, v, out, lse, dlse, causal, scale, dropout_p=0.0, seed=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, dropout_p, seed, _sdpa_layout = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed)
    # An unused lse gets no gradient (None, not zeros): the backward then needs no lse term, which
    # is what lets it run cuDNN's kernels (attention.cudnn).
    ctx.set_materialize_grads(False)
    ctx.causal = causal
    ctx.scale = scale
    ctx.dropout_p = dropout_p


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, seed = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.remat.flash_attention_backward(dout, q, k, v, out, lse, dlse, ctx.causal, ctx.scale,
                                                          ctx.dropout_p, seed)
    return dq, dk, dv, None, None, None, None, None


flash_attention_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public Python entry points
# --------------------------------------------------------------------------------------------
def flash_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                             scale: Optional[float] = None, dropout_p: float = 0.0,
                             seed: Optional[torch.Tensor] = None, sdpa_layout: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale [+ causal mask]) [dropped out] v and the per-row log-sum-exp of the
    scores (differentiable). With ``dropout_p > 0`` the probabilities are dropped with the hashed
    mask of ``seed`` (see ``attention.dropout_hash``); a seed is drawn from torch's generator if none
    is given. ``sdpa_layout`` lays the output out in memory as torch's SDPA does, (B, Sq, H, D)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if dropout_p > 0.0 and seed is None:
        seed = draw_seed(q.device)
    return torch.ops.remat.flash_attention(q, k, v, bool(causal), float(scale), float(dropout_p),
                                           seed if dropout_p > 0.0 else None, bool(sdpa_layout))


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: Optional[float] = None, dropout_p: float = 0.0,
                    seed: Optional[torch.Tensor] = None, sdpa_layout: bool = False) -> torch.Tensor:
    """Fused attention ``dropout(softmax(q k^T * scale)) v``; q (B,Hq,Sq,D), k/v (B,Hkv,Sk,D) ->
    (B,Hq,Sq,D). ``scale`` defaults to ``1/sqrt(D)``; ``causal`` uses bottom-right alignment (see
    module doc); ``dropout_p``/``seed``/``sdpa_layout`` as in :func:`flash_attention_with_lse`.
    """
    return flash_attention_with_lse(q, k, v, causal, scale, dropout_p, seed, sdpa_layout)[0]
