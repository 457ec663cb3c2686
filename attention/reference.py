"""The PyTorch reference of the fused attention op: the CPU path (and the path without Triton).

It computes what the Triton kernels compute, chunk by chunk of query rows, and returns the same
outputs and saved tensors (``out``, ``lse``); no ``Sq x Sk`` tensor outlives a chunk. Chunks are
sized so that their temporaries grow linearly in the sequence length, as the kernels' do, so a plan
made on the CPU graph describes the GPU graph too. Dropout uses the same hashed mask
(`dropout_hash`), so CPU and GPU drop the same entries.
"""
from __future__ import annotations

import torch

from remat.attention.dropout_hash import dropout_keep_mask

__all__ = ["reference_attention_forward", "reference_attention_backward", "lse_dtype", "new_attention_output",
           "in_layout"]

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


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the saved log-sum-exp: fp32, fp64 for fp64 inputs."""
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


def new_attention_output(q: torch.Tensor, sdpa_layout: bool) -> torch.Tensor:
    """An empty (B, H, Sq, D) output like q. With `sdpa_layout` it is (B, Sq, H, D) in memory, as
    torch's SDPA returns it for queries laid out that way, so the usual `out.transpose(1, 2)
    .contiguous()` that merges the heads is a view, as after SDPA; else contiguous, as `probs @ v`
    returns it (a model may `.view` that one)."""
    B, H, SQ, D = q.shape
    if sdpa_layout:
        return torch.empty((B, SQ, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    return torch.empty((B, H, SQ, D), dtype=q.dtype, device=q.device)


def _same_layout(t: torch.Tensor, like_strides: tuple[int, ...]) -> bool:
    return all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), like_strides))


def in_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it laid out as `like` (a tensor of the same shape) where the strides differ:
    the op's fake kernels promise those layouts, and compiled graphs rely on them. `like` may be a
    meta tensor: nothing is allocated unless a copy is needed."""
    if _same_layout(t, like.stride()):
        return t
    return torch.empty_strided(like.shape, like.stride(), dtype=t.dtype, device=t.device).copy_(t)


def reference_attention_forward(q, k, v, causal: bool, scale: float, dropout_p: float = 0.0, seed=None,
                                sdpa_layout: bool = False):
    """Chunked PyTorch forward: ``(out like q, lse (B, Hq, Sq) fp32, fp64 for fp64 inputs)``."""
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    G = H // HKV
    acc = _acc_dtype(q.dtype)
    qf = q.to(acc).reshape(B, HKV, G, SQ, D)
    kf = k.to(acc)[:, :, None]  # (B, HKV, 1, SK, D)
    vf = v.to(acc)[:, :, None]
    out = new_attention_output(q, sdpa_layout)
    lse = torch.empty((B, H, SQ), dtype=lse_dtype(q.dtype), device=q.device)
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
