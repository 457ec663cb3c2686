"""Dropout on attention probabilities that a fused kernel can regenerate instead of storing.

The fused op never materialises the s x s probabilities, so it cannot keep a dropout mask either:
the backward must regenerate exactly the forward's mask, tile by tile. The mask is therefore a
pure function of (seed, query head, query row, key column), a counter-based hash:

    r    = hash32(seed + (b * H + h) * Sq + i)        one per query row
    x    = hash32(r + j * 0x9E3779B9)                 one per (row, key)
    keep = (x >> 8) >= round(p * 2^24)                P(keep) = 1 - p to within 2^-24

`hash32` is the "lowbias32" integer finaliser (x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15;
x *= 0x846ca68b; x ^= x >> 16). Everything is computed in int64 with the values masked to 32 bits,
so the PyTorch code here, the Triton kernels (`dropout_keep_tl`, same arithmetic) and the Triton
interpreter give the same bits on any device: a plan made on CPU runs the same masks on GPU.

The seed is a 0-d int64 tensor drawn from torch's generator once per attention call, so the op
stays deterministic given its inputs and can be recomputed by a checkpointing plan.
"""
# `tl` in dropout_keep_tl is bound when attention.launch jits it (see attention.kernels)
# ruff: noqa: F821
from __future__ import annotations

import torch

__all__ = ["dropout_threshold", "dropout_keep_mask", "dropout_keep_tl", "draw_seed", "hashed_dropout"]

M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_H1 = 0x7FEB352D
_H2 = 0x846CA68B


def dropout_threshold(p: float) -> int:
    """The integer a 24-bit draw must reach to be kept."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attention dropout p must be in [0, 1), got {p}")
    return int(round(p * (1 << 24)))


def _hash32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 `x` holding 32-bit values, in place (one temporary at a time: the CPU
    path builds a chunk's mask with it, and its scratch memory is part of the plan)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_H1).bitwise_and_(M32)  # int64 products wrap, but their low 32 bits are exact
    x.bitwise_xor_(x >> 15)
    x.mul_(_H2).bitwise_and_(M32)
    return x.bitwise_xor_(x >> 16)


def dropout_keep_mask(seed: torch.Tensor | int, b_h: tuple[int, int], sq: int, rows: tuple[int, int], sk: int,
                      p: float, device=None) -> torch.Tensor:
    """Bool keep mask of shape (B, H, rows[1] - rows[0], Sk) for query rows [rows[0], rows[1])."""
    B, H = b_h
    dev = seed.device if isinstance(seed, torch.Tensor) and device is None else device
    bh = torch.arange(B * H, device=dev, dtype=torch.int64).view(B, H, 1, 1)
    i = torch.arange(rows[0], rows[1], device=dev, dtype=torch.int64).view(1, 1, -1, 1)
    j = torch.arange(sk, device=dev, dtype=torch.int64).view(1, 1, 1, sk)
    seed = seed.to(device=dev, dtype=torch.int64) if isinstance(seed, torch.Tensor) else seed
    r = _hash32_((seed + bh * sq + i).bitwise_and_(M32))  # (B, H, rows, 1)
    x = _hash32_((r + j * _GOLDEN).bitwise_and_(M32))  # (B, H, rows, Sk)
    return x.bitwise_right_shift_(8) >= dropout_threshold(p)


def dropout_keep_tl(seed, bh, offs_m, offs_n, SQ, THRESH):
    """The same mask inside a Triton kernel: `offs_m` and `offs_n` broadcast against each other
    ([M, 1] and [1, N], or transposed). A plain function naming `tl` as a free global, jitted per
    mode by `attention.launch` like the kernel bodies (see `attention.kernels`)."""
    x = (seed + bh * SQ + offs_m.to(tl.int64)) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x + offs_n.to(tl.int64) * 0x9E3779B9) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return (x >> 8) >= THRESH


def draw_seed(device) -> torch.Tensor:
    """A fresh seed from torch's generator (so torch.manual_seed makes runs repeatable)."""
    return torch.randint(0, 2**31 - 1, (), device=device, dtype=torch.int64)


def hashed_dropout(probs: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """probs (B, H, Sq, Sk) with the hashed mask applied and scaled by 1/(1-p): what the fused
    op computes inside, spelled out (used where the attention chain is not fused after all)."""
    B, H, sq, sk = probs.shape
    keep = dropout_keep_mask(seed, (B, H), sq, (0, sq), sk, p, device=probs.device)
    return probs * keep * (1.0 / (1.0 - p))
