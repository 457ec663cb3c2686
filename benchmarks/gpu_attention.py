"""gpu_check.py's attention parts, on a CUDA GPU: the fused Triton kernels' correctness at realistic
sizes against an fp32 SDPA reference (with attention dropout against the same hashed mask), and
their speed (TFLOP/s of the forward and forward+backward against SDPA's flash backend)."""
from __future__ import annotations

import math
import time
import traceback

from gpu_common import Report  # benchmarks/ (this script's folder) is on sys.path

__all__ = ["check_correctness", "benchmark"]


# ----------------------------------------------------------------------------------------------
# 1. correctness
# ----------------------------------------------------------------------------------------------
def _sdpa(q, k, v, causal, backend=None):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def _dropout_reference(q, k, v, causal, p, seed):
    """softmax attention with the op's hashed dropout mask, in the inputs' dtype (GQA expanded)."""
    import torch

    from remat.attention.dropout_hash import dropout_keep_mask

    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        S = q.shape[2]
        s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    B, H, SQ, SK = s.shape
    keep = dropout_keep_mask(seed, (B, H), SQ, (0, SQ), SK, p)
    return (s.softmax(-1) * keep * (1.0 / (1.0 - p))).to(v.dtype) @ v


def _fwd_bwd(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def check_correctness(ta, rep: Report, quick: bool) -> list[dict]:
    import torch
    from torch.nn.attention import SDPBackend

    cases = [  # (name, dtype, B, Hq, Hkv, S, D, causal)
        ("bf16 d128 non-causal", torch.bfloat16, 2, 16, 16, 2048, 128, False),
        ("bf16 d128 causal", torch.bfloat16, 2, 16, 16, 2048, 128, True),
        ("bf16 d128 causal GQA 16/4", torch.bfloat16, 2, 16, 4, 2048, 128, True),
        ("fp16 d64 causal S=1000 (ragged)", torch.float16, 2, 8, 8, 1000, 64, True),
        ("bf16 d64 non-causal S=777 GQA 8/2", torch.bfloat16, 1, 8, 2, 777, 64, False),
        ("fp32 d64 causal S=513", torch.float32, 1, 4, 4, 513, 64, True),
        ("bf16 d128 causal dropout 0.1", torch.bfloat16, 1, 8, 8, 1024, 128, True),
        ("fp16 d64 non-causal dropout 0.2 GQA 8/2", torch.float16, 1, 8, 2, 777, 64, False),
    ]
    if quick:
        cases = cases[:3] + cases[5:]
    results = []
    rep.log("== correctness vs fp32 SDPA (max abs error) ==")
    rep.log(f"{'case':38s} {'tensor':6s} {'remat':>10s} {'sdpa-same-dtype':>16s}  verdict")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, dtype, B, H, HK, S, D, causal in cases:
        row = {"case": name, "dtype": str(dtype), "B": B, "Hq": H, "Hkv": HK, "S": S, "D": D, "causal": causal}
        try:
            q = torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g)
            k = torch.randn(B, HK, S, D, device="cuda", dtype=dtype, generator=g)
            v = torch.randn(B, HK, S, D, device="cuda", dtype=dtype, generator=g)
            do = torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g)
            assert ta.use_triton(q), "use_triton() is False on this CUDA tensor"
            pdrop = float(name.split("dropout ")[1].split()[0]) if "dropout" in name else 0.0
            seed = torch.tensor(20261129, dtype=torch.int64, device="cuda")
            ours = _fwd_bwd(lambda q, k, v: ta.flash_attention(q, k, v, causal=causal, dropout_p=pdrop, seed=seed),
                            q, k, v, do)
            if pdrop > 0:  # the same mask spelled out: in fp32 (reference) and the inputs' dtype
                def reference(q, k, v):
                    return _dropout_reference(q, k, v, causal, pdrop, seed)

                baseline = reference
            else:
                def reference(q, k, v):
                    return _sdpa(q, k, v, causal, SDPBackend.MATH)

                def baseline(q, k, v):
                    return _sdpa(q, k, v, causal)
            tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            try:  # fp32 leaves, so the reference gradients are fp32 too
                ref = _fwd_bwd(reference, q.float(), k.float(), v.float(), do.float())
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32
            base = _fwd_bwd(baseline, q, k, v, do)
            ok = True
            for tname, a, r, b in zip(("out", "dq", "dk", "dv"), ours, ref, base):
                e = (a.float() - r.float()).abs().max().item()
                eb = (b.float() - r.float()).abs().max().item()
                finite = math.isfinite(e)
                good = finite and e <= 3 * eb + (1e-3 if dtype != torch.float32 else 1e-4)
                ok &= good
                row[f"err_{tname}"] = e
                row[f"sdpa_err_{tname}"] = eb
                rep.log(f"{name:38s} {tname:6s} {e:10.3e} {eb:16.3e}  {'ok' if good else 'FAIL'}")
            row["pass"] = bool(ok)
        except Exception as exc:  # keep going: report the failure
            row["pass"] = False
            row["error"] = f"{type(exc).__name__}: {exc}"
            rep.log(f"{name:38s} ERROR {row['error']}")
            traceback.print_exc()
        results.append(row)
        torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------------------------
# 2. performance
# ----------------------------------------------------------------------------------------------
def benchmark(ta, rep: Report, quick: bool, deadline: float) -> list[dict]:
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seqs = [1024, 2048, 4096, 8192, 16384] if not quick else [2048, 8192]
    dims = [64, 128]
    tokens, width = 16384, 2048  # B*S tokens, H*D model width (the FlashAttention-2 paper's setup)
    dtype = torch.bfloat16
    rows = []
    rep.log("")
    rep.log("== performance, bf16, TFLOP/s (fwd = 4*B*H*S*S*D, /2 causal; fwd+bwd = 3.5 x fwd) ==")
    hdr = (f"{'S':>5s} {'D':>4s} {'causal':>6s} {'B':>3s} {'H':>3s} | {'fwd remat':>9s} {'fwd sdpa':>9s} "
           f"{'ratio':>6s} | {'f+b remat':>9s} {'f+b sdpa':>9s} {'ratio':>6s}")
    rep.log(hdr)
    rep.log("-" * len(hdr))
    for D in dims:
        for causal in (False, True):
            for S in seqs:
                if time.time() > deadline:
                    rep.log(f"(time budget reached: skipping S={S} D={D} causal={causal} and later)")
                    return rows
                B, H = max(1, tokens // S), width // D
                row = {"S": S, "D": D, "causal": causal, "B": B, "H": H}
                try:
                    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(4))
                    fl = 4.0 * B * H * S * S * D / (2 if causal else 1)

                    def tf(ms, mult=1.0):
                        return fl * mult / (ms * 1e-3) / 1e12

                    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

                    def ours_fb():
                        ta.flash_attention(qg, kg, vg, causal=causal).backward(do)

                    def sdpa_fb():
                        torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(do)

                    with torch.no_grad():
                        ms_ours_f = triton.testing.do_bench(lambda: ta.flash_attention(q, k, v, causal=causal))
                    ms_ours_fb = triton.testing.do_bench(ours_fb, grad_to_none=[qg, kg, vg])
                    row.update(ms_fwd_remat=ms_ours_f, ms_fb_remat=ms_ours_fb, tflops_fwd_remat=tf(ms_ours_f),
                               tflops_fb_remat=tf(ms_ours_fb, 3.5))
                    try:
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            with torch.no_grad():
                                ms_sdpa_f = triton.testing.do_bench(
                                    lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
                            ms_sdpa_fb = triton.testing.do_bench(sdpa_fb, grad_to_none=[qg, kg, vg])
                        row.update(ms_fwd_sdpa=ms_sdpa_f, ms_fb_sdpa=ms_sdpa_fb, tflops_fwd_sdpa=tf(ms_sdpa_f),
                                   tflops_fb_sdpa=tf(ms_sdpa_fb, 3.5))
                        row["ratio_fwd"] = row["tflops_fwd_remat"] / row["tflops_fwd_sdpa"]
                        row["ratio_fb"] = row["tflops_fb_remat"] / row["tflops_fb_sdpa"]
                    except Exception as exc:  # SDPA flash backend unavailable: still report ours
                        row["sdpa_error"] = f"{type(exc).__name__}: {exc}"
                        row.update(tflops_fwd_sdpa=float("nan"), tflops_fb_sdpa=float("nan"),
                                   ratio_fwd=float("nan"), ratio_fb=float("nan"))
                    rep.log(f"{S:5d} {D:4d} {str(causal):>6s} {B:3d} {H:3d} | {row['tflops_fwd_remat']:9.1f} "
                            f"{row['tflops_fwd_sdpa']:9.1f} {row['ratio_fwd']:6.2f} | {row['tflops_fb_remat']:9.1f} "
                            f"{row['tflops_fb_sdpa']:9.1f} {row['ratio_fb']:6.2f}")
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    rep.log(f"{S:5d} {D:4d} {str(causal):>6s} ERROR {row['error']}")
                    traceback.print_exc()
                rows.append(row)
                torch.cuda.empty_cache()
    return rows
