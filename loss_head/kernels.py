"""The chunked loss head's elementwise work, one pass over the logits each way on the GPU.

Forward, per row chunk (`chunk_loss_terms`): from the chunk's logits z (rows x V, the logits' dtype)
the sums the loss needs, over the rows whose target is not ignored: sum(lse - z[target]) (the
negative log-likelihood) and, with label smoothing, sum(V * lse - sum(z)) (minus the sum of the
log-probabilities), and each row's log-sum-exp lse, kept for the backward. In PyTorch ops that is
log-softmax on the upcast chunk (an upcast copy and a float32 pass) and gathers; `row_terms_kernel`
reads each row once in its dtype, with an online maximum and sum of exponentials in float32.

Backward, per vocabulary block (`softmax_grad`):

    dz = cast(exp(z - lse) * s [- s * smooth] [+ hit_scale * s at the target's column], out_dtype)

z is one vocabulary block of the logits (N x C), lse (N,) and s (N,) the rows' log-sum-exp and
gradient factor in the math dtype (float32 for 16-bit logits), target (N,) the rows' targets, c0 the
block's first column. In PyTorch ops this is five or six passes over an N x C float32 tensor (the
upcast, the subtraction, exp, the product, the target's term, the downcast): on an H200 with a
Llama-3.2-1B-shaped head at 16k tokens they took about a quarter of the head's backward
(benchmarks/results/gpu_speed_h200_run3_profile.txt). `softmax_grad_kernel` reads z once and writes
dz once, in the same float32 operations in the same order.

Both kernels compute in float32 what the PyTorch ops compute (Triton's exp and log, not torch's,
and other summation orders: results within float32 rounding of the PyTorch path's). They run where
remat's Triton kernels run (`attention.launch.triton_runs_on`: CUDA, or the interpreter on CPU in
the tests) and the math dtype is float32; elsewhere the PyTorch ops compute it. A target outside
[0, V) that is not ignored makes the loss NaN on the kernel path (PyTorch's gather raises). Nothing
here imports Triton at import time: the kernel bodies name `tl` as a free global, bound when they
are jitted (as `attention.kernels`); they call only Triton builtins (see there why).
"""
# `tl` is bound by _jitted (see the module doc)
# ruff: noqa: F821
from __future__ import annotations  # the `tl.constexpr` annotations stay strings until Triton reads them

import builtins
import functools

import torch

from remat.attention.launch import bind_globals, device_context, import_triton, interpret_mode, triton_runs_on

__all__ = ["chunk_loss_terms", "chunk_loss_terms_torch", "row_terms_kernel", "softmax_grad", "softmax_grad_torch",
           "softmax_grad_kernel", "SOFTMAX_GRAD_BLOCKS", "ROW_TERMS_BLOCK"]

# (rows, columns) per program: GPU, interpreter (small and unequal, so the edge masks are exercised)
SOFTMAX_GRAD_BLOCKS = {"gpu": (16, 512), "interpret": (8, 32)}
# columns per step of a row's scan: GPU, interpreter
ROW_TERMS_BLOCK = {"gpu": 4096, "interpret": 32}


def chunk_loss_terms_torch(z: torch.Tensor, safe_t: torch.Tensor, valid: torch.Tensor, math_dtype: torch.dtype,
                           smoothing: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The PyTorch ops: (the rows' summed -log p[target], their summed -sum(log p) or None, each
    row's lse), from log-softmax on the upcast chunk (torch's kernel: each row's values are eager's)."""
    logp = torch.log_softmax(z, dim=-1, dtype=math_dtype)
    picked = logp.gather(1, safe_t.unsqueeze(1)).squeeze(1)
    nll = torch.where(valid, -picked, 0).sum()
    smooth = torch.where(valid, -logp.sum(-1), 0).sum() if smoothing else None
    # the log-sum-exp from the row's largest logit, where log-softmax is -log(sum(exp(z - max))):
    # max + log(sum), as torch.logsumexp, without its four more passes over the chunk
    zmax, at = z.max(dim=-1, keepdim=True)
    lse = (zmax.to(math_dtype) - logp.gather(1, at)).squeeze(1)
    return nll, smooth, lse


def row_terms_kernel(Z, T, LSE, ZT, ZSUM, V, stride_z, BLOCK: tl.constexpr):
    """One program per row: its lse, its target's logit (NaN for a target outside [0, V)) and the
    sum of its logits, in one scan of the row with an online maximum (per lane, then across)."""
    row = tl.program_id(0)
    t = tl.load(T + row)
    base = Z + row.to(tl.int64) * stride_z
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    zt = tl.full([BLOCK], 0.0, tl.float32)
    zsum = tl.full([BLOCK], 0.0, tl.float32)
    for c0 in range(0, V, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < V
        z = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        # lanes that have seen only -inf keep m = -inf and acc = 0 (exp(-inf - -inf) would be NaN)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        acc = acc * tl.exp(m - m_safe) + tl.exp(z - m_safe)
        m = m_new
        zt = zt + tl.where(cols == t, z, 0.0)
        zsum = zsum + tl.where(inside, z, 0.0)
    mx = tl.reduce(m, 0, tl.standard._elementwise_max)
    mx_safe = tl.where(mx > float("-inf"), mx, 0.0)
    total = tl.reduce(acc * tl.exp(m - mx_safe), 0, tl.standard._sum_combine)
    tl.store(LSE + row, mx + tl.log(total))
    in_range = (t >= 0) & (t < V)
    tl.store(ZT + row, tl.where(in_range, tl.reduce(zt, 0, tl.standard._sum_combine), float("nan")))
    tl.store(ZSUM + row, tl.reduce(zsum, 0, tl.standard._sum_combine))


def chunk_loss_terms(z: torch.Tensor, safe_t: torch.Tensor, valid: torch.Tensor, math_dtype: torch.dtype,
                     smoothing: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(summed -log p[target], summed -sum(log p) or None, each row's lse) over the chunk's rows
    whose target is not ignored (`valid`; `safe_t` holds 0 for the others): the kernel where it runs
    and the math dtype is float32, else the PyTorch ops."""
    if not (math_dtype == torch.float32 and triton_runs_on(z.device) and z.dim() == 2 and z.stride(1) == 1
            and z.shape[0] > 0 and z.shape[1] > 0):
        return chunk_loss_terms_torch(z, safe_t, valid, math_dtype, smoothing)
    n, v = z.shape
    lse = torch.empty(n, dtype=torch.float32, device=z.device)
    zt, zsum = torch.empty_like(lse), torch.empty_like(lse)
    interpret = interpret_mode()
    with device_context(z):
        _jitted("rows", interpret)[(n,)](z, safe_t.contiguous(), lse, zt, zsum, v, z.stride(0),
                                         BLOCK=ROW_TERMS_BLOCK["interpret" if interpret else "gpu"],
                                         **({} if interpret else {"num_warps": 8}))
    nll = torch.where(valid, lse - zt, 0).sum()
    smooth = torch.where(valid, v * lse - zsum, 0).sum() if smoothing else None
    return nll, smooth, lse


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
def _jitted(name: str, interpret: bool):
    """A kernel ("rows", "grad") jitted once per mode (compiled or interpreted, as TRITON_INTERPRET
    says now)."""
    triton = import_triton()
    namespace = {"__builtins__": builtins, "__name__": __name__, "tl": triton.language}
    body, ints = {"rows": (row_terms_kernel, ["V"]), "grad": (softmax_grad_kernel, ["N", "C", "c0"])}[name]
    return triton.jit(bind_globals(body, namespace), do_not_specialize=ints)


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
    with device_context(z):
        _jitted("grad", interpret)[grid](z, lse.contiguous(), s.contiguous(), target.contiguous(), dz, n, c,
                                         z.stride(0), dz.stride(0), c0, float(smooth), float(hit_scale),
                                         SMOOTH=smooth > 0, BLOCK_R=br, BLOCK_C=bc,
                                         **({} if interpret else {"num_warps": 4}))
    return dz
