"""The chunked loss head's per-block gradient of the logits, one pass over the block on the GPU.

    dz = cast(exp(z - lse) * s [- s * smooth] [+ hit_scale * s at the target's column], out_dtype)

z is one vocabulary block of the logits (N x C, in the logits' dtype), lse (N,) and s (N,) the rows'
log-sum-exp and gradient factor in the math dtype (float32 for 16-bit logits), target (N,) the rows'
targets, c0 the block's first column. In PyTorch ops this is five or six passes over an N x C
float32 tensor (the upcast, the subtraction, exp, the product, the target's term, the downcast): on
an H200 with a Llama-3.2-1B-shaped head at 16k tokens they took about a quarter of the head's
backward (benchmarks/results/gpu_speed_h200.txt). `softmax_grad_kernel` reads z once and writes dz
once, in the same float32 operations in the same order (Triton's exp, not torch's: results within
float32 rounding of the PyTorch path's, then rounded to out_dtype).

The kernel runs where remat's Triton kernels run (`attention.launch.triton_runs_on`: CUDA, or the
interpreter on CPU in the tests); elsewhere the PyTorch ops compute it. Nothing here imports Triton
at import time: the kernel body names `tl` as a free global, bound when it is jitted (as
`attention.kernels`).
"""
# `tl` is bound by _jitted (see the module doc)
# ruff: noqa: F821
from __future__ import annotations  # the `tl.constexpr` annotations stay strings until Triton reads them

import builtins
import contextlib
import functools

import torch

from remat.attention.launch import bind_globals, import_triton, interpret_mode, triton_runs_on

__all__ = ["softmax_grad", "softmax_grad_torch", "softmax_grad_kernel", "SOFTMAX_GRAD_BLOCKS"]

# (rows, columns) per program: GPU, interpreter (small and unequal, so the edge masks are exercised)
SOFTMAX_GRAD_BLOCKS = {"gpu": (16, 512), "interpret": (8, 32)}


def softmax_grad_torch(z: torch.Tensor, lse: torch.Tensor, s: torch.Tensor, target: torch.Tensor, c0: int,
                       smooth: float, hit_scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch ops: z (N, C), lse/s (N,) in the math dtype, target (N,) int64 (ignored rows
    carry any column and s = 0)."""
    dz = torch.exp(z.to(lse.dtype) - lse.unsqueeze(1)) * s.unsqueeze(1)  # softmax * s
    if smooth > 0:
        dz = dz - s.unsqueeze(1) * smooth
    # the target's term, for the rows whose target is in this block (others add 0 exactly);
    # allocations of fixed size, whatever the targets, so the measured workspace is the op's
    c1 = c0 + z.shape[1]
    hit = ((target >= c0) & (target < c1)).unsqueeze(1)
    col = (target - c0).clamp(0, z.shape[1] - 1).unsqueeze(1)
    dz.scatter_add_(1, col, torch.where(hit, s.unsqueeze(1) * hit_scale, 0.0))
    return dz.to(out_dtype)


def softmax_grad_kernel(Z, LSE, S, T, DZ, N, C, stride_z, stride_dz, c0, smooth, hit_scale,
                        SMOOTH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program per (row tile, column tile): dz of its elements, read and written once."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < N
    mask = rmask[:, None] & (cols < C)[None, :]
    rows64 = rows.to(tl.int64)
    z = tl.load(Z + rows64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    s = tl.load(S + rows, mask=rmask, other=0.0)
    t = tl.load(T + rows, mask=rmask, other=-1)
    dz = tl.exp(z.to(lse.dtype) - lse[:, None]) * s[:, None]
    if SMOOTH:
        dz = dz - s[:, None] * smooth
    hit = (t[:, None] - c0) == cols[None, :]
    dz = tl.where(hit, dz + s[:, None] * hit_scale, dz)
    tl.store(DZ + rows64[:, None] * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask)


@functools.cache
def _jitted(interpret: bool):
    """The kernel jitted once per mode (compiled or interpreted, as TRITON_INTERPRET says now)."""
    triton = import_triton()
    namespace = {"__builtins__": builtins, "__name__": __name__, "tl": triton.language}
    return triton.jit(bind_globals(softmax_grad_kernel, namespace), do_not_specialize=["N", "C", "c0"])


def softmax_grad(z: torch.Tensor, lse: torch.Tensor, s: torch.Tensor, target: torch.Tensor, c0: int,
                 smooth: float, hit_scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """dz of one vocabulary block (module doc): the Triton kernel where it runs and the math dtype
    is float32, else the PyTorch ops."""
    if not (triton_runs_on(z.device) and lse.dtype == torch.float32 and z.dim() == 2 and z.stride(1) == 1):
        return softmax_grad_torch(z, lse, s, target, c0, smooth, hit_scale, out_dtype)
    n, c = z.shape
    dz = torch.empty((n, c), dtype=out_dtype, device=z.device)
    if n == 0 or c == 0:
        return dz
    interpret = interpret_mode()
    br, bc = SOFTMAX_GRAD_BLOCKS["interpret" if interpret else "gpu"]
    triton = import_triton()
    grid = (triton.cdiv(n, br), triton.cdiv(c, bc))
    with torch.cuda.device(z.device) if z.is_cuda else contextlib.nullcontext():
        _jitted(interpret)[grid](z, lse.contiguous(), s.contiguous(), target.contiguous(), dz, n, c, z.stride(0),
                                 dz.stride(0), c0, float(smooth), float(hit_scale), SMOOTH=smooth > 0,
                                 BLOCK_R=br, BLOCK_C=bc, **({} if interpret else {"num_warps": 4}))
    return dz

