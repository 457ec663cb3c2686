"""Fused FlashAttention-2 (forward and backward) in Triton, exposed as a PyTorch custom op.

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

Dispatch (see :func:`use_triton`): CUDA tensors run the Triton kernels when Triton is importable;
CPU tensors run a chunked PyTorch reference with the same math and the same outputs/saved tensors,
unless ``TRITON_INTERPRET=1`` is set and Triton is importable, in which case the Triton kernels run
in the Triton interpreter (that is how the tests exercise them).  Triton is imported lazily; this
module imports and works (reference path only) without it.

Public API::

    flash_attention(q, k, v, causal=False, scale=None, dropout_p=0.0, seed=None) -> out
    flash_attention_with_lse(q, k, v, causal=False, scale=None, dropout_p=0.0, seed=None) -> (out, lse)
    torch.ops.remat.flash_attention(q, k, v, causal: bool, scale: float, dropout_p=0.0, seed: Tensor?=None)
        -> (out, lse)
    torch.ops.remat.flash_attention_backward(dout, q, k, v, out, lse, dlse: Tensor?, causal, scale,
        dropout_p=0.0, seed: Tensor?=None) -> (dq, dk, dv)

Attention dropout (``dropout_p > 0``) drops the probabilities with a counter-based hash of
``(seed, head, row, column)`` (``attention_dropout``), so the backward regenerates the forward's
mask tile by tile and nothing of size ``Sq x Sk`` is stored; the CPU path uses the same hash.
    reference_attention_forward / reference_attention_backward  (the PyTorch fallback)
    use_triton(t) -> bool, set_triton_mode("auto" | "never" | "always"), triton_available()
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from remat.runtime import attention_dropout
from remat.runtime.attention_dropout import dropout_keep_mask, dropout_threshold

__all__ = [
    "flash_attention",
    "flash_attention_with_lse",
    "flash_attention_op",
    "flash_attention_backward_op",
    "reference_attention_forward",
    "reference_attention_backward",
    "use_triton",
    "set_triton_mode",
    "get_triton_mode",
    "triton_available",
    "interpret_mode",
    "TRITON_MAX_HEAD_DIM",
]

# Largest head dim the Triton kernels take; bigger ones use the reference path.
TRITON_MAX_HEAD_DIM = 128
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634

# --------------------------------------------------------------------------------------------
# Optional, lazy Triton import
# --------------------------------------------------------------------------------------------
triton = None  # bound to the triton module on first successful import
tl = None  # bound to triton.language (the kernel bodies below resolve `tl` from module globals)
_TRITON_IMPORT_STATE: Optional[bool] = None
_MODE = "auto"  # "auto" | "never" | "always"


def triton_available() -> bool:
    """True when ``import triton`` works (imported once, lazily)."""
    global triton, tl, _TRITON_IMPORT_STATE
    if _TRITON_IMPORT_STATE is None:
        try:
            import triton as _triton
            import triton.language as _tl

            triton, tl = _triton, _tl
            _TRITON_IMPORT_STATE = True
        except Exception:  # ImportError, or a broken install
            _TRITON_IMPORT_STATE = False
    return _TRITON_IMPORT_STATE


def interpret_mode() -> bool:
    """True when the Triton interpreter is requested (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def set_triton_mode(mode: str) -> None:
    """``"auto"`` (default): Triton on CUDA, and on CPU only under ``TRITON_INTERPRET=1``;
    ``"never"``: always the PyTorch reference; ``"always"``: like auto but raise instead of
    falling back when the Triton path cannot be used for a supported dtype/device."""
    global _MODE
    if mode not in ("auto", "never", "always"):
        raise ValueError(f"mode must be 'auto', 'never' or 'always', got {mode!r}")
    _MODE = mode


def get_triton_mode() -> str:
    return _MODE


def use_triton(t: torch.Tensor) -> bool:
    """Whether attention on tensors like ``t`` (the query) runs the Triton kernels."""
    if _MODE == "never":
        return False
    ok = (
        t.dtype in _TRITON_DTYPES
        and t.dim() == 4
        and 1 <= t.shape[-1] <= TRITON_MAX_HEAD_DIM
        and ((t.device.type == "cuda" and not interpret_mode()) or (t.device.type == "cpu" and interpret_mode()))
        and triton_available()
    )
    if not ok and _MODE == "always":
        raise RuntimeError(
            f"remat flash attention: Triton path unavailable for dtype={t.dtype} device={t.device} "
            f"shape={tuple(t.shape)} (triton importable: {triton_available()}, interpret: {interpret_mode()})"
        )
    return ok


# --------------------------------------------------------------------------------------------
# Triton kernels (plain Python functions; decorated with triton.jit lazily in _get_kernels)
#
# Only Triton *builtins* are called inside the kernels (tl.full instead of tl.zeros, tl.reduce with
# the standard combine functions instead of tl.max / tl.sum): the standard-library helpers are
# @triton.jit functions decorated when triton is imported, so if triton was imported before
# TRITON_INTERPRET=1 was set (torch imports it) they cannot run in the interpreter, while builtins
# are patched by the interpreter at launch.  Compiled code is the same either way.
# --------------------------------------------------------------------------------------------
def _attn_fwd_kernel(
    Q, K, V, O, LSE, SEED,
    s_qz, s_qh, s_qm, s_qd,
    s_kz, s_kh, s_kn, s_kd,
    s_vz, s_vh, s_vn, s_vd,
    s_oz, s_oh, s_om, s_od,
    H, GROUP, SQ, SK, qk_scale_log2, DROP_THRESH, DROP_SCALE,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
    PREC: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    start_m = pid_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < SQ
    d_valid = offs_d < HEAD_DIM

    q_base = Q + b * s_qz + h * s_qh + start_m.to(tl.int64) * s_qm
    k_base = K + b * s_kz + hk * s_kh
    v_base = V + b * s_vz + hk * s_vh

    q_ptrs = q_base + tl.arange(0, BLOCK_M)[:, None] * s_qm + offs_d[None, :] * s_qd
    q = tl.load(q_ptrs, mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    # K^T tile [BLOCK_D, BLOCK_N] and V tile [BLOCK_N, BLOCK_D]
    kt_ptrs = k_base + offs_n0[None, :] * s_kn + offs_d[:, None] * s_kd
    v_ptrs = v_base + offs_n0[:, None] * s_vn + offs_d[None, :] * s_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

    if DROPOUT:
        seed = tl.load(SEED)
    diag = SK - SQ  # key j visible to query i iff j <= i + diag (causal)
    if CAUSAL:
        hi = tl.minimum(SK, start_m + BLOCK_M + diag)
        full = tl.minimum(SK, start_m + diag + 1)  # keys below this are visible to every row
    else:
        hi = SK
        full = SK
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_valid = offs_n < SK
        kt = tl.load(kt_ptrs + start_n * s_kn, mask=d_valid[:, None] & n_valid[None, :], other=0.0)
        if DOT_FP32:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale_log2
        if start_n + BLOCK_N > full:  # only tiles on the diagonal or past Sk need a mask
            if CAUSAL:
                s = tl.where(n_valid[None, :] & (offs_n[None, :] <= offs_m[:, None] + diag), s, float("-inf"))
            else:
                s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: avoid inf - inf
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs + start_n * s_vn, mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        if DROPOUT:  # the row sum l_i keeps the undropped p: dropout acts after the softmax
            p = tl.where(dropout_keep_tl(seed, pid_bh, offs_m[:, None], offs_n[None, :], SQ, DROP_THRESH), p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = out * DROP_SCALE
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)

    o_ptrs = O + b * s_oz + h * s_oh + start_m.to(tl.int64) * s_om \
        + tl.arange(0, BLOCK_M)[:, None] * s_om + offs_d[None, :] * s_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
    tl.store(LSE + pid_bh * SQ + offs_m, lse, mask=m_valid)


def _attn_bwd_preprocess_kernel(
    O, DO, DELTA,
    s_oz, s_oh, s_om, s_od,
    s_dz, s_dh, s_dm, s_dd,
    H, SQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < SQ)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = tl.arange(0, BLOCK_M)[:, None]
    o = tl.load(O + b * s_oz + h * s_oh + start_m.to(tl.int64) * s_om + rows * s_om + offs_d[None, :] * s_od,
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * s_dz + h * s_dh + start_m.to(tl.int64) * s_dm + rows * s_dm + offs_d[None, :] * s_dd,
                 mask=mask, other=0.0).to(tl.float32)
    delta = tl.reduce(o * do, 1, tl.standard._sum_combine)
    tl.store(DELTA + pid_bh * SQ + offs_m, delta, mask=offs_m < SQ)


def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, SEED,
    s_qz, s_qh, s_qm, s_qd,
    s_kz, s_kh, s_kn, s_kd,
    s_vz, s_vh, s_vn, s_vd,
    s_dz, s_dh, s_dm, s_dd,
    s_dkz, s_dkh, s_dkn, s_dkd,
    s_dvz, s_dvh, s_dvn, s_dvd,
    H, HKV, GROUP, SQ, SK, sm_scale, qk_scale_log2, DROP_THRESH, DROP_SCALE,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
    PREC: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (key block, batch, kv head): loops over the query heads of the group and
    over query blocks, accumulating dK and dV in fp32 registers (no atomics)."""
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1).to(tl.int64)
    b = pid_bhk // HKV
    hk = pid_bhk % HKV
    start_n = pid_n * BLOCK_N

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_valid = offs_n < SK
    d_valid = offs_d < HEAD_DIM
    nd_mask = n_valid[:, None] & d_valid[None, :]
    rows_n = tl.arange(0, BLOCK_N)[:, None]

    k = tl.load(K + b * s_kz + hk * s_kh + start_n.to(tl.int64) * s_kn + rows_n * s_kn + offs_d[None, :] * s_kd,
                mask=nd_mask, other=0.0)
    v = tl.load(V + b * s_vz + hk * s_vh + start_n.to(tl.int64) * s_vn + rows_n * s_vn + offs_d[None, :] * s_vd,
                mask=nd_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float32)

    if DROPOUT:
        seed = tl.load(SEED)
    diag = SK - SQ
    if CAUSAL:
        lo = tl.maximum(start_n - diag, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_from = start_n + BLOCK_N - 1 - diag  # query rows from here on see the whole key block
    else:
        lo = 0
        full_from = 0
    ragged_n = start_n + BLOCK_N > SK

    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        # Q^T tile [BLOCK_D, BLOCK_M], dO tile [BLOCK_M, BLOCK_D]
        qt_ptrs = Q + b * s_qz + h * s_qh + offs_m0[None, :] * s_qm + offs_d[:, None] * s_qd
        do_ptrs = DO + b * s_dz + h * s_dh + offs_m0[:, None] * s_dm + offs_d[None, :] * s_dd
        lse_ptr = LSE + bh * SQ
        delta_ptr = DELTA + bh * SQ
        for start_m in range(lo, SQ, BLOCK_M):
            offs_m = start_m + offs_m0
            m_valid = offs_m < SQ
            qt = tl.load(qt_ptrs + start_m * s_qm, mask=d_valid[:, None] & m_valid[None, :], other=0.0)
            do = tl.load(do_ptrs + start_m * s_dm, mask=m_valid[:, None] & d_valid[None, :], other=0.0)
            if DOT_FP32:
                qt = qt.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(lse_ptr + offs_m, mask=m_valid, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
            delta = tl.load(delta_ptr + offs_m, mask=m_valid, other=0.0)

            st = tl.dot(k, qt, input_precision=PREC) * qk_scale_log2  # [BLOCK_N, BLOCK_M]
            pt = tl.math.exp2(st - lse[None, :])
            # a mask only where the tile crosses the diagonal or the ends of Sq / Sk
            if (start_m < full_from) | (start_m + BLOCK_M > SQ) | ragged_n:
                if CAUSAL:
                    mask = m_valid[None, :] & n_valid[:, None] & (offs_n[:, None] <= offs_m[None, :] + diag)
                else:
                    mask = m_valid[None, :] & n_valid[:, None]
                pt = tl.where(mask, pt, 0.0)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)  # [BLOCK_N, BLOCK_M]
            if DROPOUT:  # out = (keep * p / (1 - drop)) @ v: the same mask scales dV's p and dP
                keep = dropout_keep_tl(seed, bh, offs_m[None, :], offs_n[:, None], SQ, DROP_THRESH)
                dv = tl.dot((tl.where(keep, pt, 0.0) * DROP_SCALE).to(do.dtype), do, dv, input_precision=PREC)
                dpt = tl.where(keep, dpt * DROP_SCALE, 0.0)
            else:
                dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PREC)
            dst = pt * (dpt - delta[None, :])
            dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PREC)

    dk = dk * sm_scale
    tl.store(DK + b * s_dkz + hk * s_dkh + start_n.to(tl.int64) * s_dkn + rows_n * s_dkn + offs_d[None, :] * s_dkd,
             dk.to(DK.dtype.element_ty), mask=nd_mask)
    tl.store(DV + b * s_dvz + hk * s_dvh + start_n.to(tl.int64) * s_dvn + rows_n * s_dvn + offs_d[None, :] * s_dvd,
             dv.to(DV.dtype.element_ty), mask=nd_mask)


def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, SEED,
    s_qz, s_qh, s_qm, s_qd,
    s_kz, s_kh, s_kn, s_kd,
    s_vz, s_vh, s_vn, s_vd,
    s_dz, s_dh, s_dm, s_dd,
    s_dqz, s_dqh, s_dqm, s_dqd,
    H, GROUP, SQ, SK, sm_scale, qk_scale_log2, DROP_THRESH, DROP_SCALE,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
    PREC: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (query block, batch, query head): loops over key blocks."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    start_m = pid_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < SQ
    d_valid = offs_d < HEAD_DIM
    md_mask = m_valid[:, None] & d_valid[None, :]
    rows_m = tl.arange(0, BLOCK_M)[:, None]

    q = tl.load(Q + b * s_qz + h * s_qh + start_m.to(tl.int64) * s_qm + rows_m * s_qm + offs_d[None, :] * s_qd,
                mask=md_mask, other=0.0)
    do = tl.load(DO + b * s_dz + h * s_dh + start_m.to(tl.int64) * s_dm + rows_m * s_dm + offs_d[None, :] * s_dd,
                 mask=md_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + pid_bh * SQ + offs_m, mask=m_valid, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
    delta = tl.load(DELTA + pid_bh * SQ + offs_m, mask=m_valid, other=0.0)

    kt_ptrs = K + b * s_kz + hk * s_kh + offs_n0[None, :] * s_kn + offs_d[:, None] * s_kd
    vt_ptrs = V + b * s_vz + hk * s_vh + offs_n0[None, :] * s_vn + offs_d[:, None] * s_vd
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    if DROPOUT:
        seed = tl.load(SEED)

    diag = SK - SQ
    if CAUSAL:
        hi = tl.minimum(SK, start_m + BLOCK_M + diag)
        full = tl.minimum(SK, start_m + diag + 1)  # keys below this are visible to every row
    else:
        hi = SK
        full = SK
    ragged_m = start_m + BLOCK_M > SQ
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_valid = offs_n < SK
        kt = tl.load(kt_ptrs + start_n * s_kn, mask=d_valid[:, None] & n_valid[None, :], other=0.0)
        vt = tl.load(vt_ptrs + start_n * s_vn, mask=d_valid[:, None] & n_valid[None, :], other=0.0)
        if DOT_FP32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale_log2
        p = tl.math.exp2(s - lse[:, None])
        if (start_n + BLOCK_N > full) | ragged_m:  # only tiles on the diagonal or at the ends
            if CAUSAL:
                mask = m_valid[:, None] & n_valid[None, :] & (offs_n[None, :] <= offs_m[:, None] + diag)
            else:
                mask = m_valid[:, None] & n_valid[None, :]
            p = tl.where(mask, p, 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        if DROPOUT:
            keep = dropout_keep_tl(seed, pid_bh, offs_m[:, None], offs_n[None, :], SQ, DROP_THRESH)
            dp = tl.where(keep, dp * DROP_SCALE, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PREC)

    dq = dq * sm_scale
    tl.store(DQ + b * s_dqz + h * s_dqh + start_m.to(tl.int64) * s_dqm + rows_m * s_dqm + offs_d[None, :] * s_dqd,
             dq.to(DQ.dtype.element_ty), mask=md_mask)


# Block sizes used by the interpreter (deliberately unequal, so masks and the causal block
# arithmetic are exercised).  Tests may override them.
INTERPRET_BLOCKS = {"fwd": (64, 32), "dkdv": (32, 64), "dq": (64, 32), "pre": 64}

# GPU configs: (BLOCK_M, BLOCK_N, num_warps, num_stages) for fp16/bf16; the first is the default
# when autotuning is off (REMAT_FLASH_AUTOTUNE=0).  Autotuning is keyed on head dim, causal, group
# size and dtypes (not on sequence lengths).  Every config compiles for sm_90 without spilling
# registers at head dims 64 and 128, with and without dropout (`python benchmarks/compile_check.py`,
# which compiles them with Triton's ptxas, no GPU needed); earlier lists spilled up to 1.1 KB per
# thread in dK/dV at d = 128.
_GPU_CONFIGS = {
    "fwd": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (64, 32, 4, 4)],
    "dkdv": [(32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 8, 4), (16, 64, 4, 4)],
    "dq": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 4), (64, 32, 4, 4)],
}
# fp32 tiles are twice the bytes and fp32 dots (no TF32) run without tensor cores: one small config
# per kernel, no autotuning (fp32 is a correctness path). Chosen to spill nothing at head dims 32
# and 64 (the d = 128 forward spills 320 bytes per thread).
_GPU_FP32_CONFIG = {"fwd": (32, 32, 8, 2), "dkdv": (32, 32, 8, 2), "dq": (64, 32, 8, 2)}
# Integer args that vary with the problem and would otherwise trigger a recompile per value
# (Triton specializes ints on ==1 and %16==0); strides stay specialized (unit stride matters).
_NO_SPECIALIZE = {
    "fwd": ["H", "GROUP", "SQ", "SK"],
    "dkdv": ["H", "HKV", "GROUP", "SQ", "SK"],
    "dq": ["H", "GROUP", "SQ", "SK"],
    "pre": ["H", "SQ"],
}
_KERNEL_CACHE: dict = {}
_HELPER_CACHE: dict = {}  # interpret flag -> dropout_keep_tl jitted in that mode


def _autotune_enabled() -> bool:
    return os.environ.get("REMAT_FLASH_AUTOTUNE", "1") != "0"


def _get_kernels(interpret: bool, fp32: bool = False) -> dict:
    """triton.jit (and, on GPU for fp16/bf16, triton.autotune) the kernel functions once per mode.
    Whether triton.jit builds interpreted or compiled kernels follows TRITON_INTERPRET."""
    tune = _autotune_enabled() and not interpret and not fp32
    key = (interpret, tune, fp32)
    if not triton_available():
        raise RuntimeError("triton is not available")
    # The kernels call dropout_keep_tl through this module's globals: the interpreter looks it up
    # at each launch, compiled kernels when they compile (at their first launch), so it is set to
    # the helper of the mode about to launch, every time.
    if interpret not in _HELPER_CACHE:
        attention_dropout.tl = tl
        _HELPER_CACHE[interpret] = triton.jit(attention_dropout.dropout_keep_tl)
    globals()["dropout_keep_tl"] = _HELPER_CACHE[interpret]
    if key in _KERNEL_CACHE:
        return _KERNEL_CACHE[key]
    ks = {"pre": triton.jit(_attn_bwd_preprocess_kernel, do_not_specialize=_NO_SPECIALIZE["pre"])}
    for name, fn in (("fwd", _attn_fwd_kernel), ("dkdv", _attn_bwd_dkdv_kernel), ("dq", _attn_bwd_dq_kernel)):
        jitted = triton.jit(fn, do_not_specialize=_NO_SPECIALIZE[name])
        if tune:
            configs = [
                triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                for bm, bn, w, st in _GPU_CONFIGS[name]
            ]
            jitted = triton.autotune(configs=configs, key=["HEAD_DIM", "CAUSAL", "GROUP"])(jitted)
        ks[name] = jitted
    _KERNEL_CACHE[key] = ks
    return ks


def _launch(kern, name: str, interpret: bool, fp32: bool, grid_dim0_len: int, grid1: int, args: tuple,
            meta: dict):
    """Launch a kernel with BLOCK_M/BLOCK_N from autotune, a fixed config, or INTERPRET_BLOCKS.
    ``grid_dim0_len`` is the length split by BLOCK_M (fwd, dq) or BLOCK_N (dkdv)."""
    split_key = "BLOCK_N" if name == "dkdv" else "BLOCK_M"
    if interpret:
        bm, bn = INTERPRET_BLOCKS[name]
        blocks = {"BLOCK_M": bm, "BLOCK_N": bn}
        kern[(triton.cdiv(grid_dim0_len, blocks[split_key]), grid1)](*args, **meta, **blocks)
    elif isinstance(kern, triton.runtime.Autotuner):
        kern[lambda META: (triton.cdiv(grid_dim0_len, META[split_key]), grid1)](*args, **meta)
    else:
        bm, bn, w, st = _GPU_FP32_CONFIG[name] if fp32 else _GPU_CONFIGS[name][0]
        blocks = {"BLOCK_M": bm, "BLOCK_N": bn}
        kern[(triton.cdiv(grid_dim0_len, blocks[split_key]), grid1)](
            *args, **meta, **blocks, num_warps=w, num_stages=st
        )


def _prec(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


class _DeviceCtx:
    def __init__(self, t: torch.Tensor):
        self.ctx = torch.cuda.device(t.device) if t.device.type == "cuda" else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            return self.ctx.__exit__(*exc)
        return False


def _dropout_args(dropout_p: float, seed: Optional[torch.Tensor], dummy: torch.Tensor) -> tuple:
    """(SEED pointer, DROP_THRESH, DROP_SCALE) kernel args and the DROPOUT flag."""
    if dropout_p > 0.0:
        return (seed.to(device=dummy.device, dtype=torch.int64).reshape(()), dropout_threshold(dropout_p),
                1.0 / (1.0 - dropout_p)), True
    return (dummy, 0, 1.0), False


def _triton_forward(q, k, v, causal: bool, scale: float, dropout_p: float = 0.0, seed=None):
    interpret = interpret_mode()
    fp32 = q.dtype == torch.float32
    kern = _get_kernels(interpret, fp32)
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    out = torch.empty((B, H, SQ, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, SQ), dtype=torch.float32, device=q.device)
    dot_fp32 = interpret and q.dtype == torch.bfloat16
    (seed_t, thresh, drop_scale), dropout = _dropout_args(dropout_p, seed, lse)
    meta = dict(HEAD_DIM=D, BLOCK_D=_block_d(D), CAUSAL=bool(causal), DOT_FP32=dot_fp32, PREC=_prec(q.dtype),
                DROPOUT=dropout)
    args = (q, k, v, out, lse, seed_t, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            H, H // HKV, SQ, SK, scale * _LOG2E, thresh, drop_scale)
    with _DeviceCtx(q):
        _launch(kern["fwd"], "fwd", interpret, fp32, SQ, B * H, args, meta)
    return out, lse


def _triton_backward(dout, q, k, v, out, lse, dlse, causal: bool, scale: float, dropout_p: float = 0.0,
                     seed=None):
    interpret = interpret_mode()
    fp32 = q.dtype == torch.float32
    kern = _get_kernels(interpret, fp32)
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    BLOCK_D = _block_d(D)
    dot_fp32 = interpret and q.dtype == torch.bfloat16
    lse = lse.contiguous()
    delta = torch.empty((B, H, SQ), dtype=torch.float32, device=q.device)
    dq = torch.empty((B, H, SQ, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, HKV, SK, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, HKV, SK, D), dtype=v.dtype, device=v.device)
    with _DeviceCtx(q):
        bm = INTERPRET_BLOCKS["pre"] if interpret else 64
        kern["pre"][(triton.cdiv(SQ, bm), B * H)](
            out, dout, delta, *out.stride(), *dout.stride(), H, SQ,
            HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=bm, **({} if interpret else {"num_warps": 4}),
        )
        if dlse is not None:
            # d lse_i / d s_ij = p_ij, so a gradient flowing into lse shifts delta by -dlse.
            delta = delta - dlse.to(torch.float32)
        (seed_t, thresh, drop_scale), dropout = _dropout_args(dropout_p, seed, lse)
        meta = dict(HEAD_DIM=D, BLOCK_D=BLOCK_D, CAUSAL=bool(causal), DOT_FP32=dot_fp32, PREC=_prec(q.dtype),
                    DROPOUT=dropout)
        common = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
        _launch(kern["dkdv"], "dkdv", interpret, fp32, SK, B * HKV,
                (q, k, v, dout, lse, delta, dk, dv, seed_t, *common, *dk.stride(), *dv.stride(),
                 H, HKV, H // HKV, SQ, SK, scale, scale * _LOG2E, thresh, drop_scale), meta)
        _launch(kern["dq"], "dq", interpret, fp32, SQ, B * H,
                (q, k, v, dout, lse, delta, dq, seed_t, *common, *dq.stride(),
                 H, H // HKV, SQ, SK, scale, scale * _LOG2E, thresh, drop_scale), meta)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# PyTorch reference (the CPU / no-Triton path): same outputs, same saved tensors
# --------------------------------------------------------------------------------------------
_REF_CHUNK = None  # query rows per chunk (None: adaptive, see _chunk_rows)


def _chunk_rows(sq: int, sk: int, d: int) -> int:
    """Query rows per chunk of the PyTorch path. Adaptive: a chunk's scores (rows x Sk) hold
    about as many elements as q itself (Sq x D), so the path's temporaries grow linearly in
    the sequence length, as the kernel's do, and the CPU graph's memory matches the GPU's."""
    if _REF_CHUNK is not None:
        return _REF_CHUNK
    return max(16, min(sq, (sq * d) // max(sk, 1)))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _causal_mask(i0: int, i1: int, sq: int, sk: int, device) -> torch.Tensor:
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(sk, device=device)[None, :]
    return cols <= rows + (sk - sq)


def _keep_chunk(seed, B: int, H: int, HKV: int, SQ: int, i0: int, i1: int, SK: int, dropout_p: float, acc):
    """The dropout keep mask of query rows [i0, i1), scaled by 1/(1-p), as (B, HKV, G, c, SK).
    The int64 hash runs over a quarter of the rows at a time, so its scratch memory stays below
    the chunk's scores (it is part of the op's measured workspace, hence of the plan)."""
    keep = torch.empty((B, H, i1 - i0, SK), dtype=acc, device=seed.device)
    step = max(1, (i1 - i0) // 4)
    for r0 in range(i0, i1, step):
        r1 = min(i1, r0 + step)
        keep[:, :, r0 - i0:r1 - i0].copy_(dropout_keep_mask(seed, (B, H), SQ, (r0, r1), SK, dropout_p))
    return keep.mul_(1.0 / (1.0 - dropout_p)).view(B, HKV, H // HKV, i1 - i0, SK)


def reference_attention_forward(q, k, v, causal: bool, scale: float, dropout_p: float = 0.0, seed=None):
    """Chunked PyTorch forward: ``(out like q, lse (B, Hq, Sq) fp32, fp64 for fp64 inputs)``."""
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    G = H // HKV
    acc = _acc_dtype(q.dtype)
    qf = q.to(acc).reshape(B, HKV, G, SQ, D)
    kf = k.to(acc)[:, :, None]  # (B, HKV, 1, SK, D)
    vf = v.to(acc)[:, :, None]
    out = torch.empty((B, H, SQ, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, SQ), dtype=_lse_dtype(q.dtype), device=q.device)
    out5 = out.view(B, HKV, G, SQ, D)
    lse4 = lse.view(B, HKV, G, SQ)
    chunk = _chunk_rows(SQ, SK, D)
    for i0 in range(0, SQ, chunk):
        i1 = min(SQ, i0 + chunk)
        # the mask first, while no score-sized tensor is alive (its hash needs scratch memory)
        keep = _keep_chunk(seed, B, H, HKV, SQ, i0, i1, SK, dropout_p, acc) if dropout_p > 0.0 else None
        s = torch.matmul(qf[..., i0:i1, :], kf.transpose(-1, -2)) * scale  # (B,HKV,G,c,SK)
        if causal:
            s = s.masked_fill(~_causal_mask(i0, i1, SQ, SK, q.device), float("-inf"))
        m = torch.logsumexp(s, dim=-1)  # -inf for rows that see nothing
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe[..., None])
        del s
        if keep is not None:
            p.mul_(keep)
        out5[..., i0:i1, :] = torch.matmul(p, vf).to(q.dtype)
        lse4[..., i0:i1] = m.to(lse.dtype)
    return out, lse


def reference_attention_backward(dout, q, k, v, out, lse, dlse, causal: bool, scale: float,
                                 dropout_p: float = 0.0, seed=None):
    """Chunked PyTorch backward from ``q, k, v, out, lse, dout`` (scores recomputed)."""
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    G = H // HKV
    acc = _acc_dtype(q.dtype)
    qf = q.to(acc).reshape(B, HKV, G, SQ, D)
    kf = k.to(acc)[:, :, None]
    vf = v.to(acc)[:, :, None]
    dof = dout.to(acc).reshape(B, HKV, G, SQ, D)
    delta = (dof * out.to(acc).reshape(B, HKV, G, SQ, D)).sum(-1)  # (B,HKV,G,SQ)
    if dlse is not None:
        delta = delta - dlse.to(acc).reshape(B, HKV, G, SQ)
    lsef = lse.to(acc).reshape(B, HKV, G, SQ)
    lsef = torch.where(torch.isinf(lsef), torch.zeros_like(lsef), lsef)
    dq = torch.empty((B, H, SQ, D), dtype=q.dtype, device=q.device)
    dq5 = dq.view(B, HKV, G, SQ, D)
    dk = torch.zeros((B, HKV, SK, D), dtype=acc, device=q.device)
    dv = torch.zeros((B, HKV, SK, D), dtype=acc, device=q.device)
    chunk = _chunk_rows(SQ, SK, D)
    for i0 in range(0, SQ, chunk):
        i1 = min(SQ, i0 + chunk)
        qc, doc = qf[..., i0:i1, :], dof[..., i0:i1, :]
        keep = _keep_chunk(seed, B, H, HKV, SQ, i0, i1, SK, dropout_p, acc) if dropout_p > 0.0 else None
        s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~_causal_mask(i0, i1, SQ, SK, q.device), float("-inf"))
        p = torch.exp(s - lsef[..., i0:i1, None])  # masked entries: exp(-inf) = 0
        del s
        dp = torch.matmul(doc, vf.transpose(-1, -2))
        if keep is not None:  # out = (keep * p / (1 - drop)) @ v
            dv += torch.matmul((p * keep).transpose(-1, -2), doc).sum(2)
            dp.mul_(keep)
            del keep
        else:
            dv += torch.matmul(p.transpose(-1, -2), doc).sum(2)
        ds = p * (dp - delta[..., i0:i1, None])
        dq5[..., i0:i1, :] = (torch.matmul(ds, kf) * scale).to(q.dtype)
        dk += torch.matmul(ds.transpose(-1, -2), qc).sum(2) * scale
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------
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
                       dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, v, dropout_p, seed)
    if _use_triton_for(q, k):
        return _triton_forward(q, k, v, causal, scale, dropout_p, seed)
    return reference_attention_forward(q, k, v, causal, scale, dropout_p, seed)


@flash_attention_op.register_fake
def _flash_attention_fake(q, k, v, causal, scale, dropout_p=0.0, seed=None):
    _check(q, k, v, dropout_p, seed)
    B, H, SQ, D = q.shape
    return q.new_empty((B, H, SQ, D)), q.new_empty((B, H, SQ), dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("remat::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                                causal: bool, scale: float, dropout_p: float = 0.0,
                                seed: Optional[torch.Tensor] = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_triton_for(q, k) and lse.dtype == torch.float32:
        return _triton_backward(dout, q, k, v, out, lse, dlse, causal, scale, dropout_p, seed)
    return reference_attention_backward(dout, q, k, v, out, lse, dlse, causal, scale, dropout_p, seed)


@flash_attention_backward_op.register_fake
def _flash_attention_backward_fake(dout, q, k, v, out, lse, dlse, causal, scale, dropout_p=0.0, seed=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, dropout_p, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed)
    ctx.causal = causal
    ctx.scale = scale
    ctx.dropout_p = dropout_p


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, seed = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.remat.flash_attention_backward(dout, q, k, v, out, lse, dlse, ctx.causal, ctx.scale,
                                                          ctx.dropout_p, seed)
    return dq, dk, dv, None, None, None, None


flash_attention_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public Python entry points
# --------------------------------------------------------------------------------------------
def flash_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                             scale: Optional[float] = None, dropout_p: float = 0.0,
                             seed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale [+ causal mask]) [dropped out] v and the per-row log-sum-exp of the
    scores (differentiable). With ``dropout_p > 0`` the probabilities are dropped with the hashed
    mask of ``seed`` (see ``attention_dropout``); a seed is drawn from torch's generator if none
    is given."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if dropout_p > 0.0 and seed is None:
        seed = attention_dropout.draw_seed(q.device)
    return torch.ops.remat.flash_attention(q, k, v, bool(causal), float(scale), float(dropout_p),
                                           seed if dropout_p > 0.0 else None)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: Optional[float] = None, dropout_p: float = 0.0,
                    seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Fused attention ``dropout(softmax(q k^T * scale)) v``; q (B,Hq,Sq,D), k/v (B,Hkv,Sk,D) ->
    (B,Hq,Sq,D). ``scale`` defaults to ``1/sqrt(D)``; ``causal`` uses bottom-right alignment (see
    module doc); ``dropout_p``/``seed`` as in :func:`flash_attention_with_lse`.
    """
    return flash_attention_with_lse(q, k, v, causal, scale, dropout_p, seed)[0]
