#!/usr/bin/env python
"""GPU check of the fused Triton FlashAttention-2 kernels (remat.attention: kernels, launch, op).

    python benchmarks/gpu_check.py --out DIR [--quick] [--max-seconds 280] [--skip-model]

On a CUDA GPU (sized for an H200, < 5 minutes):
  1. correctness at realistic sizes vs an fp32 torch SDPA reference (max abs error of out, dq, dk,
     dv), next to the error torch SDPA itself makes in the same low-precision dtype;
  2. TFLOP/s of the forward and of forward+backward, bf16, S in 1k/2k/4k/8k, d in 64/128,
     causal and not, against SDPA with the flash backend (triton.testing.do_bench);
     FLOPs: fwd = 4*B*H*S*S*D (halved when causal), bwd = 2.5 x fwd;
  3. check_default_model: remat.optimize on the default GPT at 50% of its keep-all peak with
     fused_attention="all" (its explicit attention, dropout included, runs the Triton kernels),
     measured torch.cuda.max_memory_allocated vs the plan's predicted peak.
Correctness also covers attention dropout: the kernels against an fp32 reference that applies the
same hashed mask (attention/dropout_hash.py).
Writes DIR/gpu_check.json and DIR/gpu_check.txt.  Without CUDA it exits with code 2.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

EXIT_NO_GPU = 2
REPO = Path(__file__).resolve().parent.parent


def _register_checkout_packages() -> None:
    """Make `import remat.attention` load this checkout's attention/ folder, for a GPU machine where
    the project is copied but not installed: a bare `remat` package (its __init__, which needs the
    solver's dependencies, is not run) whose path is this checkout's remat/ and root folders."""
    spec = importlib.machinery.ModuleSpec("remat", None, is_package=True)
    pkg = importlib.util.module_from_spec(spec)
    pkg.__path__ = [str(REPO / "remat"), str(REPO)]
    sys.modules["remat"] = pkg


def _load_attention_module():
    """The fused attention's public functions (remat.attention.op and .launch), from the installed
    package, else from this checkout."""
    try:
        import remat.attention  # noqa: F401
    except ImportError:
        _register_checkout_packages()
    from types import SimpleNamespace

    from remat.attention.launch import use_triton
    from remat.attention.op import flash_attention

    return SimpleNamespace(flash_attention=flash_attention, use_triton=use_triton)


class Report:
    def __init__(self):
        self.lines: list[str] = []
        self.data: dict = {}

    def log(self, msg: str = "") -> None:
        print(msg, flush=True)
        self.lines.append(msg)


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
        cases = cases[:3] + cases[-1:]
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

    seqs = [1024, 2048, 4096, 8192] if not quick else [2048, 8192]
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
                    del q, k, v, do, qg, kg, vg
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    rep.log(f"{S:5d} {D:4d} {str(causal):>6s} ERROR {row['error']}")
                    traceback.print_exc()
                rows.append(row)
                torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# 3. HOOK: the default model under a 50% budget
# ----------------------------------------------------------------------------------------------
def check_default_model(out_dir, time_limit_s: float = 45.0) -> dict:
    """End-to-end memory check: optimize remat.default_model.default_model() on CUDA at 50% of its
    keep-all peak (both with fused_attention="all", so its explicit attention with dropout runs the
    Triton kernels) and report torch.cuda.max_memory_allocated of one training step against the
    plan's predicted_peak_bytes.  Never raises: failures come back as {"status": "error"}."""
    import torch

    res: dict = {"status": "skipped"}
    try:
        import remat

        if not (hasattr(remat, "optimize") and hasattr(remat, "measure_peak")):
            return {"status": "skipped", "reason": "remat.optimize / remat.measure_peak not available"}
        from remat.default_model import default_inputs, default_model
        from remat.attention.router import route_attention

        model = default_model().cuda()
        inputs = default_inputs(device="cuda")

        def step(m):
            def run():
                model.zero_grad(set_to_none=True)
                m(*inputs).backward()
            return run

        with route_attention("all", model) as router:  # the model with its attention fused, eagerly
            step(model)()  # also warms up (cuBLAS workspaces, lazy inits, Triton compiles)
        fused_calls = router.routed
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        keep_opt = remat.optimize(model, example_inputs=inputs, solver="keep_all",
                                  fused_attention="all")
        step(keep_opt)()
        model.zero_grad(set_to_none=True)
        keep_all = int(remat.measure_peak(step(keep_opt), resident=[model, *inputs], device="cuda"))
        budget = keep_all // 2
        t0 = time.time()
        try:
            opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, time_limit_s=time_limit_s,
                                 fused_attention="all")
        except TypeError:  # an optimize() without time_limit_s / fused_attention
            opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs)
        solve_s = time.time() - t0
        step(opt)()  # warm up the optimized module
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        measured = int(remat.measure_peak(step(opt), resident=[model, *inputs], device="cuda"))
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(opt)()
        torch.cuda.synchronize()
        max_alloc = int(torch.cuda.max_memory_allocated())
        predicted = int(opt.plan.predicted_peak_bytes)
        res = {
            "status": "ok", "fused_attention_calls": fused_calls,
            "flash_nodes": sum(n.op.startswith("flash_attention") for n in opt.graph.nodes),
            "keep_all_predicted_bytes": int(keep_opt.plan.predicted_peak_bytes),
            "keep_all_peak_bytes": keep_all, "budget_bytes": budget,
            "predicted_peak_bytes": predicted, "measured_peak_bytes": measured,
            "max_memory_allocated_bytes": max_alloc,
            "measured_over_predicted": measured / predicted if predicted else None,
            "max_alloc_over_predicted": max_alloc / predicted if predicted else None,
            "fits_budget": measured <= budget, "optimize_wall_s": solve_s,
        }
    except Exception as exc:
        res = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "default_model_check.json").write_text(json.dumps(res, indent=2))
    except Exception:
        pass
    return res


# ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for gpu_check.json / gpu_check.txt")
    ap.add_argument("--quick", action="store_true", help="fewer correctness cases and sequence lengths")
    ap.add_argument("--max-seconds", type=float, default=270.0, help="stop benchmarking after this long")
    ap.add_argument("--skip-model", action="store_true", help="skip the check_default_model hook")
    args = ap.parse_args(argv)
    t_start = time.time()
    out = Path(args.out)

    try:
        import torch
    except Exception as exc:
        print(f"gpu_check: torch is not importable ({exc}); nothing was run.", file=sys.stderr)
        return EXIT_NO_GPU
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU available (torch.cuda.is_available() is False); this check only runs "
              "on an NVIDIA GPU. Nothing was run.", file=sys.stderr)
        return EXIT_NO_GPU
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("gpu_check: TRITON_INTERPRET=1 is set; unset it to run the compiled kernels.", file=sys.stderr)
        return EXIT_NO_GPU
    try:
        import triton
    except Exception as exc:
        print(f"gpu_check: triton is not importable ({exc}); install triton to run the kernels.", file=sys.stderr)
        return EXIT_NO_GPU

    ta = _load_attention_module()
    rep = Report()
    rep.data["env"] = {
        "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "autotune": os.environ.get("REMAT_FLASH_AUTOTUNE", "1") != "0",
    }
    rep.log(f"gpu_check on {rep.data['env']['gpu']} torch {torch.__version__} triton {triton.__version__}")
    out.mkdir(parents=True, exist_ok=True)

    def dump():
        rep.data["wall_s"] = time.time() - t_start
        (out / "gpu_check.json").write_text(json.dumps(rep.data, indent=2, default=str))
        (out / "gpu_check.txt").write_text("\n".join(rep.lines) + "\n")

    rep.data["correctness"] = check_correctness(ta, rep, args.quick)
    dump()
    rep.data["benchmark"] = benchmark(ta, rep, args.quick, t_start + args.max_seconds - (0 if args.skip_model else 60))
    dump()
    if not args.skip_model:
        rep.log("")
        rep.log("== default model at 50% of keep_all, fused_attention='all' ==")
        res = check_default_model(out)
        rep.data["default_model"] = res
        for key, val in res.items():
            if key != "traceback":
                rep.log(f"  {key}: {val}")
    rep.data["all_correct"] = all(r.get("pass") for r in rep.data["correctness"])
    rep.log("")
    rep.log(f"correctness: {'ALL PASS' if rep.data['all_correct'] else 'FAILURES'}; wall {time.time() - t_start:.0f}s; "
            f"results in {out}/gpu_check.json, gpu_check.txt")
    dump()
    return 0 if rep.data["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
