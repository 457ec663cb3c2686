"""The FlashAttention-2 kernel bodies, as plain Python functions for `triton.jit`.

Nothing here imports Triton: the bodies name `tl` (triton.language) and `dropout_keep_tl` (the hashed
dropout mask, `dropout_hash.dropout_keep_tl`) as free globals, and `launch.jit_kernels` jits a copy of
each function whose globals bind those two names for the mode it builds (compiled or interpreted).
So this module imports without Triton, and no module state is patched to switch modes.

Only Triton *builtins* are called inside the kernels (tl.full instead of tl.zeros, tl.reduce with the
standard combine functions instead of tl.max / tl.sum): the standard-library helpers are @triton.jit
functions decorated when triton is imported, so if triton was imported before TRITON_INTERPRET=1 was
set (torch imports it) they cannot run in the interpreter, while builtins are patched by the
interpreter at launch. Compiled code is the same either way.

Layout and masking conventions: see `attention.op`. Kernels:
* `attn_fwd_kernel`: one program per (query block, batch x head); online softmax over key tiles,
  writes out and the per-row log-sum-exp; causal tiles past the diagonal are skipped;
* `attn_bwd_preprocess_kernel`: delta = rowsum(dO * O);
* `attn_bwd_dkdv_kernel`: one program per (key block, batch x kv head), dK and dV summed over the
  query heads of the group;
* `attn_bwd_dq_kernel`: one program per (query block, batch x head), dQ.
"""
# `tl` and `dropout_keep_tl` are bound per mode by launch.jit_kernels (see the module doc)
# ruff: noqa: F821
from __future__ import annotations  # the `tl.constexpr` annotations stay strings until Triton reads them

__all__ = ["attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]


def attn_fwd_kernel(
    Q, K, V, O, LSE, SEED,
    s_qz, s_qh, s_qm, s_qd,
    s_kz, s_kh, s_kn, s_kd,
    s_vz, s_vh, s_vn, s_vd,
    s_oz, s_oh, s_om, s_od,
    H, GROUP, SQ, SK, qk_scale_log2, DROP_THRESH, DROP_SCALE,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
    PREC: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Forward: one program per (query block, batch x head); online softmax over key tiles,
    writes out and the per-row log-sum-exp (natural log) of the scaled scores."""
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


def attn_bwd_preprocess_kernel(
    O, DO, DELTA,
    s_oz, s_oh, s_om, s_od,
    s_dz, s_dh, s_dm, s_dd,
    H, SQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) per query row, read by the dK/dV and dQ kernels."""
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


def attn_bwd_dkdv_kernel(
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


def attn_bwd_dq_kernel(
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
