#!/usr/bin/env python
"""Can remat's fused attention op run cuDNN's kernels on the GPUs where torch's SDPA picks them
(issue #27)? One GPU run answers the facts that idea rests on, each step on its own (an exception is
recorded and the next step runs):

    python benchmarks/gpu_attention_backends.py --out DIR

On an H200 (gpu_speed_h200_run3_profile.txt) remat's Triton backward took 53.9 ms for the 16
attention calls of a Llama-3.2-1B-shaped step (d 64, GQA 32/8, S 4096, causal, bf16) where cuDNN's,
which eager's SDPA ran, took 32.6 ms, and its bf16 gradients were further from eager's. Swapping
backends inside the op keeps the graph (the same node, saving the same out and log-sum-exp) if:
  1. aten._scaled_dot_product_cudnn_attention takes grouped-query k/v as they are (or only expanded);
  2. its logsumexp is the op's lse (natural log of the scaled scores' row sums; shape, dtype);
  3. its backward accepts the op's out and lse (computed by either kernel) and gives the op's gradients;
  4. it is faster, forward and backward, at the shapes measured.
Per shape: those answers, max errors against a float32 reference, and the times (CUDA events,
median of 20) of remat's Triton op, cuDNN's aten ops and SDPA as torch picks it; then the op itself
as attention/cudnn.py runs it (built on these answers) against its Triton kernels, on q/k/v laid
out as a model's, with and without a gradient into lse. On an H200 all four held
(benchmarks/results/gpu_attention_backends_h200_run1_failed.txt: the op on Triton's kernels, the
backward steps failing on this script's own call; gpu_attention_backends_h200.txt: the call fixed,
the op by then on cuDNN's kernels, so its "remat" columns are cuDNN's there).
Writes DIR/gpu_attention_backends.{json,txt}.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_common import Report

SHAPES = [  # (B, Hq, Hkv, S, D): the Llama-3.2-1B step's, the same without GQA, a d-128 one
    (4, 32, 8, 4096, 64),
    (4, 32, 32, 4096, 64),
    (2, 16, 8, 4096, 128),
]


def _time(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _err(a, b) -> float | None:
    """Max abs difference (None where a side is missing: a step before failed)."""
    return None if a is None or b is None else float((a.float() - b.float()).abs().max())


def check_shape(shape, log) -> dict:
    from remat.attention.op import flash_attention_with_lse

    B, H, HKV, S, D = shape
    scale = D ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    ke, ve = (k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)) if H != HKV else (k, v)
    row: dict = {"shape": list(shape)}

    def step(name, fn):
        try:
            row[name] = fn()
        except Exception as exc:  # record the fact and go on
            row[name] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            traceback.print_exc()
        log(f"  {name}: {row[name]}")

    refs: dict = {}

    def reference():  # float32 SDPA on expanded heads, and the causal rows' log-sum-exp
        qf, kf, vf = (t.float().requires_grad_() for t in (q, ke, ve))
        out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
        out.backward(do.float())
        with torch.no_grad():
            scores = (qf @ kf.transpose(-1, -2) * scale).masked_fill_(
                torch.ones(S, S, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
            refs.update(out=out.detach(), dq=qf.grad, lse=torch.logsumexp(scores, dim=-1))
        return "ok"

    step("reference", reference)
    ref = refs.get("out")
    ref_lse = refs.get("lse")

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_r, lse_r = flash_attention_with_lse(qr, kr, vr, causal=True, scale=scale)
    out_r.backward(do)
    step("remat_out_err", lambda: _err(out_r, ref))
    step("remat_lse_err", lambda: _err(lse_r, ref_lse))
    step("remat_dq_err", lambda: _err(qr.grad, refs["dq"]))

    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    cudnn_bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
    res = {}

    def forward(kk, vv, key):
        o = cudnn(q, kk, vv, None, True, 0.0, True, False, scale=scale)
        res[key] = o
        return {"out": [list(o[0].shape), list(o[0].stride()), str(o[0].dtype)],
                "lse": [list(o[1].shape), list(o[1].stride()), str(o[1].dtype)],
                "max_q": int(o[4]), "out_err": _err(o[0], ref),
                "lse_err_vs_reference": _err(o[1].reshape(B, H, S), ref_lse),
                "lse_err_vs_remat": _err(o[1].reshape(B, H, S), lse_r)}

    step("cudnn_forward_gqa_as_is", lambda: forward(k, v, "gqa"))
    step("cudnn_forward_expanded", lambda: forward(ke, ve, "expanded"))

    def backward(key, kk, vv, out, lse):
        o = res[key]
        dq, dk, dv = cudnn_bwd(do, q, kk, vv, out, lse, o[6], o[7], None, None, None,
                               o[4], o[5], 0.0, True, scale=scale)
        if dk.shape[1] != HKV:  # expanded heads: sum each group's
            dk = dk.unflatten(1, (HKV, H // HKV)).sum(2)
            dv = dv.unflatten(1, (HKV, H // HKV)).sum(2)
        return {"dq_err": _err(dq, refs["dq"]), "dk_err_vs_remat": _err(dk, kr.grad), "dv_err_vs_remat": _err(dv, vr.grad)}

    key = "gqa" if isinstance(row.get("cudnn_forward_gqa_as_is"), dict) else "expanded"
    kk, vv = (k, v) if key == "gqa" else (ke, ve)
    step("cudnn_backward_own_out_lse", lambda: backward(key, kk, vv, res[key][0], res[key][1]))
    # the op's out as it lays it out, and its lse in cuDNN's shape
    step("cudnn_backward_remat_out_lse",
         lambda: backward(key, kk, vv, out_r.detach(), lse_r.reshape(res[key][1].shape)))

    def times():
        t = {}
        qq, kk2, vv2 = (x.clone().requires_grad_() for x in (q, k, v))

        def remat_fb():
            o, _ = flash_attention_with_lse(qq, kk2, vv2, causal=True, scale=scale)
            o.backward(do)

        def sdpa_fb():
            o = F.scaled_dot_product_attention(qq, kk2, vv2, is_causal=True, scale=scale, enable_gqa=H != HKV)
            o.backward(do)

        t["remat_fwd_ms"] = _time(lambda: flash_attention_with_lse(q, k, v, causal=True, scale=scale))
        t["remat_fwd_bwd_ms"] = _time(remat_fb)
        t["sdpa_fwd_bwd_ms"] = _time(sdpa_fb)
        o = res[key]
        t["cudnn_fwd_ms"] = _time(lambda: cudnn(q, kk, vv, None, True, 0.0, True, False, scale=scale))
        t["cudnn_bwd_ms"] = _time(lambda: cudnn_bwd(do, q, kk, vv, o[0], o[1], o[6], o[7], None, None, None,
                                                    o[4], o[5], 0.0, True, scale=scale))
        return t

    step("times", times)

    def op_backends():
        """The op itself, on q/k/v laid out as a model's (B, S, H, D) projections transposed, with
        SDPA's output layout: cuDNN (the default where it runs) against Triton; a loss reading lse
        (a gradient into lse) must take the Triton backward and still be right."""
        from remat.attention import cudnn as cudnn_mod
        from remat.attention.op import flash_attention_op

        def model_layout(t):
            return t.transpose(1, 2).contiguous().transpose(1, 2)

        r = {"cudnn_runs_on": cudnn_mod.cudnn_runs_on(model_layout(q), model_layout(k), model_layout(v), True, 0.0)}
        w = torch.randn(B, H, S, device="cuda", generator=g)
        for name, enabled in (("cudnn", True), ("triton", False)):
            cudnn_mod.set_cudnn_attention(enabled)
            try:
                for use_lse in (False, True):
                    qq, kk2, vv2 = (model_layout(x).detach().requires_grad_() for x in (q, k, v))
                    o, lse = flash_attention_op(qq, kk2, vv2, True, scale, 0.0, None, True)
                    loss = (o.float() * do.float()).sum() + ((lse * w).sum() if use_lse else 0.0)
                    loss.backward()
                    key = f"{name}{'_lse_loss' if use_lse else ''}"
                    r[key] = {"out_stride": list(o.stride()), "out_err": _err(o, ref), "lse_err": _err(lse, ref_lse),
                              "dq_stride": list(qq.grad.stride()),
                              "dk_err_vs_remat": _err(kk2.grad, kr.grad) if not use_lse else None}
                    if not use_lse:
                        r[key]["dq_err"] = _err(qq.grad, refs["dq"])
                    else:
                        r[key]["dq"] = qq.grad
                qq, kk2, vv2 = (model_layout(x).detach().requires_grad_() for x in (q, k, v))

                def fb():
                    o, _ = flash_attention_op(qq, kk2, vv2, True, scale, 0.0, None, True)
                    o.backward(do.transpose(1, 2).contiguous().transpose(1, 2))
                r[f"{name}_fwd_bwd_ms"] = _time(fb)
            finally:
                cudnn_mod.set_cudnn_attention(True)
        r["lse_loss_dq_cudnn_vs_triton"] = _err(r["cudnn_lse_loss"].pop("dq"), r["triton_lse_loss"].pop("dq"))
        return r

    step("op_backends", op_backends)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    rep = Report()
    log = rep.log

    if not torch.cuda.is_available():
        log("no CUDA device: nothing to check")
        return 2
    log(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; cudnn {torch.backends.cudnn.version()}")
    log(f"command: python benchmarks/gpu_attention_backends.py {' '.join(argv or sys.argv[1:])}")
    rows = []
    for shape in SHAPES:
        log(f"shape (B, Hq, Hkv, S, D) = {shape}")
        rows.append(check_shape(shape, log))
        torch.cuda.empty_cache()
    rep.data = {"rows": rows}
    rep.save(out, "gpu_attention_backends")
    return 0


if __name__ == "__main__":
    sys.exit(main())
