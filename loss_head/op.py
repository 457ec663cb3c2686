"""Chunked linear cross-entropy: `cross_entropy(upcast(h @ W.T [+ b]), target)` with no
[tokens, vocab] tensor alive whole, as a PyTorch custom op.

    torch.ops.remat.chunked_linear_cross_entropy(h, weight, bias, target, ignore_index, label_smoothing,
        reduction, compute_dtype, math_dtype, chunk_rows) -> (loss, lse)
    torch.ops.remat.chunked_linear_cross_entropy_backward(dloss, h, weight, bias, target, lse, ignore_index,
        label_smoothing, reduction, compute_dtype, math_dtype, block_cols) -> (dh, dweight, dbias)

`h` is (N, d), `weight` (V, d), `bias` (V,) or None, `target` (N,) int64. The logits are computed in
`compute_dtype` (the dtype the model's linear produced them in: h, weight and bias are cast to it
first, as autocast does), then cast to `math_dtype` (float32 for 16-bit logits: the `.float()` of
Hugging Face's loss, or autocast's float32 cross-entropy), where log-softmax, the loss and its
gradient are computed. reduction is "mean" (over the rows whose target is not ignore_index, as
torch's) or "sum"; label smoothing as torch's.

Forward: over chunks of `chunk_rows` rows, each chunk's logits are computed and give the loss terms
(loss_head/kernels.py: its rows' log-softmax, torch's kernel, so each row's values are eager's; on the
GPU one Triton pass); only the per-row log-sum-exp (N,) is kept. Backward: over
blocks of `block_cols` vocabulary columns, each block's logits are recomputed for all rows, their
gradient `softmax * s - s * ((1 - eps) onehot + eps / V)` formed (loss_head/kernels.py: one
Triton pass on the GPU, the PyTorch ops elsewhere), and `dW[block] = dz.T @ h`,
`db[block] = dz.sum(0)` computed in one matmul over all rows, as eager's linear backward does
(each column's reduction over the rows is eager's); `dh` is summed over the blocks in float32
(float64 for float64) and rounded once. What can differ from eager on the CPU is therefore only
(a) the sums over rows of the loss (per chunk, then over chunks) and (b) dh's sum over vocabulary
blocks, a reduction eager does inside one matmul: float32 rounding-order differences (relative
~1e-6), and for 16-bit logits at most one rounding of the final 16-bit value; on the GPU the
kernels' exp, log and sums add differences of the same order (loss_head/kernels.py).

Memory: one chunk's logits (chunk_rows x V) in the forward, one block's (N x block_cols) in the
backward, plus dh's float32 accumulator (N x d). Costs: forward 2NdV FLOPs, backward 6NdV (the logits
again, dh and dW), one logits matmul more than eager's 4NdV.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from remat.core.errors import RematError
from remat.loss_head.kernels import chunk_loss_terms, softmax_grad

__all__ = ["ChunkedLossError", "chunked_linear_cross_entropy", "chunked_linear_cross_entropy_op",
           "chunked_linear_cross_entropy_backward_op", "chunk_rows_for", "block_cols_for", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum")


class ChunkedLossError(RematError, ValueError):
    """The chunked loss op was called with arguments it does not take (the message says which)."""


# GEMM tiles are 64-256 rows: a chunk just over a multiple of 128 rows (Llama-3.2-1B at 16k tokens:
# 261) pays a whole tile of rows for its last few
CHUNK_ROWS_MULTIPLE = 128


def chunk_rows_for(n: int, d: int, v: int) -> int:
    """Rows per forward chunk: a chunk's logits (rows x V) hold no more elements than the hidden
    states (N x d), Liger-Kernel's rule, rounded down to a multiple of CHUNK_ROWS_MULTIPLE where
    that leaves one, at least one row."""
    rows = max(1, (n * d) // max(1, v))
    return rows - rows % CHUNK_ROWS_MULTIPLE if rows >= CHUNK_ROWS_MULTIPLE else rows


def block_cols_for(n: int, d: int, v: int) -> int:
    """Vocabulary columns per backward block: a block's logits (N x cols) hold no more elements
    than the hidden states (N x d)."""
    return max(1, min(v, d))


def _check(h, weight, bias, target, reduction: str, rows: int) -> None:
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ChunkedLossError(f"chunked_linear_cross_entropy: h (N, d) and weight (V, d), got {tuple(h.shape)} "
                         f"and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ChunkedLossError(f"bias must be (V,), got {tuple(bias.shape)}")
    if target.dim() != 1 or target.shape[0] != h.shape[0] or target.dtype != torch.int64:
        raise ChunkedLossError(f"target must be int64 (N,), got {target.dtype} {tuple(target.shape)}")
    if reduction not in REDUCTIONS:
        raise ChunkedLossError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if rows < 1:
        raise ChunkedLossError(f"chunk_rows must be >= 1, got {rows}")


@torch.library.custom_op("remat::chunked_linear_cross_entropy", mutates_args=())
def chunked_linear_cross_entropy_op(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                    target: torch.Tensor, ignore_index: int, label_smoothing: float,
                                    reduction: str, compute_dtype: torch.dtype, math_dtype: torch.dtype,
                                    chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check(h, weight, bias, target, reduction, chunk_rows)
    n, v = h.shape[0], weight.shape[0]
    # the casts are the model's (autocast's, or its .float()), applied to the operands here:
    # autocast must not cast anything again inside the op
    with torch.autocast(h.device.type, enabled=False):
        lse = torch.empty(n, dtype=math_dtype, device=h.device)
        nll = torch.zeros((), dtype=math_dtype, device=h.device)
        smooth = torch.zeros((), dtype=math_dtype, device=h.device)
        hc, wc = h.to(compute_dtype), weight.to(compute_dtype)
        bc = None if bias is None else bias.to(compute_dtype)
        for r0 in range(0, n, chunk_rows):
            r1 = min(n, r0 + chunk_rows)
            z = F.linear(hc[r0:r1], wc, bc)  # the logits in the model's dtype
            t = target[r0:r1]
            valid = t != ignore_index
            chunk_nll, chunk_smooth, lse[r0:r1] = chunk_loss_terms(z, torch.where(valid, t, 0), valid, math_dtype,
                                                                   label_smoothing > 0)
            nll = nll + chunk_nll
            if label_smoothing > 0:
                smooth = smooth + chunk_smooth
            del z
        if reduction == "mean":  # torch's: the sums over the rows not ignored, over their count
            count = (target != ignore_index).sum().to(math_dtype)
            nll = nll / count
            smooth = smooth / count
        loss = (1 - label_smoothing) * nll + smooth * (label_smoothing / v) if label_smoothing > 0 else nll
    return loss, lse


@chunked_linear_cross_entropy_op.register_fake
def _forward_fake(h, weight, bias, target, ignore_index, label_smoothing, reduction, compute_dtype, math_dtype,
                  chunk_rows):
    _check(h, weight, bias, target, reduction, chunk_rows)
    return h.new_empty((), dtype=math_dtype), h.new_empty((h.shape[0],), dtype=math_dtype)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_MM_OUT_DTYPE = [True]  # torch.addmm(..., out_dtype=) works here (CUDA, torch >= 2.8); False once refused


def _add_dh_block(dh: torch.Tensor, dzc: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """dh + dzc @ wb, dh in its float32 (or float64) accumulation dtype. On CUDA with 16-bit operands: one tensor-core GEMM
    that adds its float32 products to dh in its epilogue (torch.addmm's out_dtype), the same exact
    products summed in float32 as the GEMM of the upcast operands, which ran at float32's
    non-tensor-core rate instead (171 ms of a 641 ms step on an H200, Llama-3.2-1B-shaped at 16k
    tokens: benchmarks/results/gpu_speed_h200.txt), and without a separate float32 add pass over dh
    per vocabulary block. Elsewhere, or where torch refuses out_dtype, the upcast GEMM."""
    if _MM_OUT_DTYPE[0] and dzc.is_cuda and dh.dtype == torch.float32 \
            and dzc.dtype in (torch.bfloat16, torch.float16) and wb.dtype == dzc.dtype:
        try:
            return torch.addmm(dh, dzc, wb, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[0] = False
    return dh.add_(dzc.to(dh.dtype) @ wb.to(dh.dtype))


@torch.library.custom_op("remat::chunked_linear_cross_entropy_backward", mutates_args=())
def chunked_linear_cross_entropy_backward_op(dloss: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                                             bias: Optional[torch.Tensor], target: torch.Tensor, lse: torch.Tensor,
                                             ignore_index: int, label_smoothing: float, reduction: str,
                                             compute_dtype: torch.dtype, math_dtype: torch.dtype,
                                             block_cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, v = h.shape[0], weight.shape[0]
    with torch.autocast(h.device.type, enabled=False):
        valid = target != ignore_index
        scale = dloss.to(math_dtype)
        if reduction == "mean":
            scale = scale / valid.sum().to(math_dtype)
        # per-row factor of the gradient; ignored rows get none (eager's are exactly zero)
        s = torch.where(valid, scale, torch.zeros((), dtype=math_dtype, device=h.device))
        safe_t = torch.where(valid, target, 0)
        hc = h.to(compute_dtype)
        acc = _acc_dtype(compute_dtype)
        dh = torch.zeros((n, h.shape[1]), dtype=acc, device=h.device)
        dw = torch.empty(weight.shape, dtype=compute_dtype, device=h.device)
        db = torch.empty((v if bias is not None else 0,), dtype=compute_dtype, device=h.device)
        for c0 in range(0, v, block_cols):
            c1 = min(v, c0 + block_cols)
            wb = weight[c0:c1].to(compute_dtype)
            z = F.linear(hc, wb, None if bias is None else bias[c0:c1].to(compute_dtype))
            # softmax * s - s * ((1 - eps) onehot + eps / V), in the math dtype, rounded to the logits'
            # dtype: eager's linear backward gets the gradient in the logits' dtype
            dzc = softmax_grad(z, lse, s, safe_t, c0, label_smoothing / v, -(1 - label_smoothing), compute_dtype)
            del z
            # dW and db of the block: one reduction over all rows, as eager's; dh: summed over blocks
            dw[c0:c1] = dzc.t() @ hc
            if bias is not None:
                db[c0:c1] = dzc.sum(0)
            dh = _add_dh_block(dh, dzc, wb)
            del dzc
    return dh.to(compute_dtype).to(h.dtype), dw.to(weight.dtype), db.to(bias.dtype if bias is not None else weight.dtype)


@chunked_linear_cross_entropy_backward_op.register_fake
def _backward_fake(dloss, h, weight, bias, target, lse, ignore_index, label_smoothing, reduction, compute_dtype,
                   math_dtype, block_cols):
    db = h.new_empty((weight.shape[0] if bias is not None else 0,),
                     dtype=bias.dtype if bias is not None else weight.dtype)
    return h.new_empty(h.shape), weight.new_empty(weight.shape), db


def _setup_context(ctx, inputs, output):
    h, weight, bias, target, ignore_index, label_smoothing, reduction, compute_dtype, math_dtype, rows = inputs
    _, lse = output
    ctx.save_for_backward(h, weight, bias, target, lse)
    ctx.args = (ignore_index, label_smoothing, reduction, compute_dtype, math_dtype,
                block_cols_for(h.shape[0], h.shape[1], weight.shape[0]))
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dloss, _dlse):
    h, weight, bias, target, lse = ctx.saved_tensors
    dh, dw, db = torch.ops.remat.chunked_linear_cross_entropy_backward(dloss, h, weight, bias, target, lse,
                                                                       *ctx.args)
    return dh, dw, (db if bias is not None else None), None, None, None, None, None, None, None


chunked_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def chunked_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                 target: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
                                 reduction: str = "mean", compute_dtype: torch.dtype | None = None,
                                 math_dtype: torch.dtype | None = None, chunk_rows: int | None = None
                                 ) -> torch.Tensor:
    """The loss `F.cross_entropy(linear(h, weight, bias).to(math_dtype), target, ...)` computed by
    chunks (see the module doc). h is (..., d), flattened to rows; target has h's leading shape.
    compute_dtype defaults to h's dtype; math_dtype to float32 for 16-bit logits, else
    compute_dtype; chunk_rows to `chunk_rows_for`."""
    h2 = h.reshape(-1, h.shape[-1])
    t = target.reshape(-1)
    cd = compute_dtype or h.dtype
    md = math_dtype or (torch.float32 if torch.finfo(cd).bits < 32 else cd)
    rows = chunk_rows or chunk_rows_for(h2.shape[0], h2.shape[1], weight.shape[0])
    return torch.ops.remat.chunked_linear_cross_entropy(h2, weight, bias, t, int(ignore_index),
                                                        float(label_smoothing), reduction, cd, md, int(rows))[0]
