#!/usr/bin/env python
"""GPU check of remat on CUDA: the fused Triton attention kernels and the whole pipeline (issue #7).

    python benchmarks/gpu_check.py --out DIR [--quick] [--all-cases] [--max-seconds 270] [--skip-model]
    bash benchmarks/gpu_session.sh   # on the device machine: wheels, the package, this script -> $OUT

On a CUDA GPU (sized for an H200, < 5 minutes); parts 2 and 3 run first:
  1. attention correctness at realistic sizes vs an fp32 torch SDPA reference (max abs error of
     out, dq, dk, dv), next to the error torch SDPA itself makes in the same low-precision dtype;
     attention dropout against an fp32 reference applying the same hashed mask;
  2. the pipeline: remat.optimize on the default GPT (explicit attention, SDPA attention, and
     explicit with fused_attention="all") at 70% and 50% of keep_all's measured peak: loss and
     gradients against the unmodified model (fp32, dropout on), the peak remat.measure_peak
     measures (torch.cuda.max_memory_allocated, the device found by itself) against the budget and
     the plan's prediction (target: within 3%);
  3. the cost model: the default GPT at 50%, planned on FLOPs and on op times measured on the
     GPU; predicted vs measured extra step time (median of 20 steps);
  4. attention speed: TFLOP/s of the forward and of forward+backward, bf16, S in 1k..16k, d in
     64/128, causal and not, against SDPA's flash backend (triton.testing.do_bench);
     FLOPs: fwd = 4*B*H*S*S*D (halved when causal), fwd+bwd = 3.5 x fwd.
Writes DIR/gpu_check.json and DIR/gpu_check.txt after each part. Without CUDA it exits with code 2.
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


# ----------------------------------------------------------------------------------------------
# 3. the pipeline on CUDA: plans at 70% and 50% of keep_all's measured peak
# ----------------------------------------------------------------------------------------------
SOLVE_LIMIT_S = 10.0  # a wall-clock limit on each solve, so the whole check fits a 5-minute lease
PIPELINE_VARIANTS = [  # (label, GPTConfig.attention, fused_attention)
    ("GPT explicit attention", "explicit", "exact"),
    ("GPT SDPA attention", "sdpa", "exact"),
    ("GPT explicit attention, fused='all' (Triton)", "explicit", "all"),
]


def _clean_cuda() -> None:
    """Free what earlier modules and plans left (cycles hold CUDA tensors until collected), so the
    allocator holds only what the next step needs: max_memory_allocated counts everything."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _planned_step(model, inputs, strategy: str, budget, fused: str, ref_cpu) -> dict:
    """optimize(model) with `strategy` under `budget`, then one seeded step: its peak as
    remat.measure_peak measures it (no device given), what was allocated before it, and its loss
    and gradients against the unmodified model's (kept on the CPU, so they add nothing here)."""
    import torch

    import remat
    from remat.core.plan import InfeasibleBudgetError

    row: dict = {"strategy": strategy, "budget_bytes": budget}
    try:
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, solver=strategy,
                             fused_attention=fused, quiet=True, time_limit_s=SOLVE_LIMIT_S)
    except InfeasibleBudgetError as exc:
        row.update(status="infeasible", min_feasible_bytes=exc.min_feasible_bytes, message=str(exc))
        return row
    plan, graph = opt.plan, opt.graph
    params = list(model.parameters())

    losses = []

    def seeded_step():
        for p in params:
            p.grad = None
        torch.manual_seed(0)
        loss = opt(*inputs)
        loss.backward()
        losses.append(loss.detach())

    # Two steps, each measured: the first after optimize() is not a training loop's steady state.
    # Capture released the cuBLAS workspaces (graph_capture/cuda_library.py measures one thread's
    # share), and only this thread's came back there: the autograd thread allocates its own at its
    # first backward matmul, in the middle of the first step, so a step that peaks before that
    # point peaks lower than the plan, which counts both as resident. From the second step on both
    # are held from the start: that step is the one compared with the prediction.
    _clean_cuda()
    first_before = torch.cuda.memory_allocated()
    first_peak = remat.measure_peak(seeded_step, resident=[model, *inputs])
    _clean_cuda()
    before = torch.cuda.memory_allocated()
    peak = remat.measure_peak(seeded_step, resident=[model, *inputs])
    ref_loss, ref_grads = ref_cpu
    pairs = [(losses[-1].cpu(), ref_loss)] + [(p.grad.cpu() if p.grad is not None else None, g)
                                             for p, g in zip(params, ref_grads)]
    grads_ok = all(a is not None and torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
    err = max(float((a - b).abs().max()) if a is not None else float("inf") for a, b in pairs)
    resident = graph.resident_bytes
    row.update(status=plan.status, predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=peak,
               first_step_peak_bytes=first_peak, first_step_allocated_before_bytes=first_before,
               allocated_before_bytes=before, plan_resident_bytes=resident,
               library_workspace_bytes=graph.meta.get("library_workspace_bytes", 0),
               # the step's own memory: measured above what was allocated before it, predicted above
               # the plan's resident bytes (parameters, inputs, cuBLAS workspaces)
               step_measured_bytes=peak - before, step_predicted_bytes=plan.predicted_peak_bytes - resident,
               grads_match=grads_ok, max_grad_err=err, solve_time_s=plan.solve_time_s,
               extra_cost_frac=plan.extra_cost / graph.total_cost)
    for p in params:
        p.grad = None
    return row


def check_pipeline(rep: Report, deadline: float, fracs=(0.7, 0.5)) -> list[dict]:
    """remat.optimize on the default GPT on CUDA (fp32, dropout on): keep_all, then checkmate at
    `fracs` of keep_all's measured peak (at the smallest feasible budget instead where a fraction is
    below it). Each row: loss and gradients against the unmodified model (allclose rtol 1e-5,
    atol 1e-6), the peak remat.measure_peak measures without being told the device
    (torch.cuda.max_memory_allocated), the plan's predicted peak, whether the measured peak is
    within the budget and within 3% of the prediction, and the step's own memory (measured above
    what was allocated before the step, predicted above the plan's resident bytes). The measured
    step is the second after optimize(); the first's peak is shown beside it ("1st step")."""
    from remat.default_model import GPTConfig, default_inputs, default_model
    from remat.report import reference_step

    rep.log("")
    rep.log("== the pipeline on CUDA: default GPT (fp32, dropout 0.1), keep_all and checkmate ==")
    rep.log(f"{'variant':40s} {'strategy':9s} {'budget':>14s} {'pred MiB':>9s} {'meas MiB':>9s} {'meas/pred':>9s} "
            f"{'fits':>5s} {'grads':>5s} {'max err':>8s} {'step pred':>9s} {'step meas':>9s} {'solve s':>7s} {'1st step':>9s}")
    rows = []
    for label, attention, fused in PIPELINE_VARIANTS:
        if time.time() > deadline:
            rep.log(f"(time budget reached: skipping {label} and later)")
            break
        try:
            cfg = GPTConfig(attention=attention)
            model = default_model(cfg).cuda()
            inputs = default_inputs(cfg, device="cuda")
            ref_loss, ref_grads, _ = reference_step(model, inputs, seed=0, fused_attention=fused)
            ref_cpu = (ref_loss.cpu(), [g.cpu() for g in ref_grads])
            del ref_loss, ref_grads
            keep = _planned_step(model, inputs, "keep_all", None, fused, ref_cpu)
            K = keep["measured_peak_bytes"]
            results = [(None, keep)]
            for frac in fracs:
                budget = int(frac * K)
                r = _planned_step(model, inputs, "checkmate", budget, fused, ref_cpu)
                if r["status"] == "infeasible" and r.get("min_feasible_bytes"):
                    rep.log(f"  ({label}: {frac:.0%} of keep_all = {budget / 2**20:.2f} MiB is infeasible; the smallest "
                            f"feasible budget is {r['min_feasible_bytes'] / 2**20:.2f} MiB = "
                            f"{r['min_feasible_bytes'] / K:.1%}: planned there instead)")
                    r = _planned_step(model, inputs, "checkmate", r["min_feasible_bytes"], fused, ref_cpu)
                    r["infeasible_frac"] = frac
                results.append((frac, r))
            for frac, r in results:
                row = {"variant": label, "attention": attention, "fused_attention": fused, "keep_all_peak_bytes": K, **r}
                if r.get("status") == "infeasible":
                    row["pass"] = False
                    rows.append(row)
                    rep.log(f"{label:40s} {r['strategy']:9s} infeasible: {r['message']}")
                    continue
                ratio = r["measured_peak_bytes"] / r["predicted_peak_bytes"]
                budget = r["budget_bytes"]
                row.update(budget_frac=None if budget is None else budget / K, measured_over_predicted=ratio,
                           within_3pct=abs(ratio - 1) <= 0.03,
                           fits_budget=None if budget is None else r["measured_peak_bytes"] <= budget)
                row["pass"] = bool(r["grads_match"]) and row["within_3pct"] and row["fits_budget"] is not False
                rows.append(row)
                btxt = "-" if budget is None else f"{budget / 2**20:.2f} ({budget / K:.0%})"
                rep.log(f"{label:40s} {r['strategy']:9s} {btxt:>14s} {r['predicted_peak_bytes'] / 2**20:9.2f} "
                        f"{r['measured_peak_bytes'] / 2**20:9.2f} {ratio:9.4f} "
                        f"{'-' if budget is None else str(row['fits_budget']):>5s} {str(r['grads_match']):>5s} "
                        f"{r['max_grad_err']:8.1e} {r['step_predicted_bytes'] / 2**20:9.2f} "
                        f"{r['step_measured_bytes'] / 2**20:9.2f} {r['solve_time_s']:7.1f} "
                        f"{r['first_step_peak_bytes'] / 2**20:9.2f}")
            rep.log(f"{'':40s} (plan's resident bytes {keep['plan_resident_bytes'] / 2**20:.2f} MiB, of which cuBLAS "
                    f"workspaces {keep['library_workspace_bytes'] / 2**20:.2f} MiB; allocated before keep_all's step "
                    f"{keep['allocated_before_bytes'] / 2**20:.2f} MiB, before its first step "
                    f"{keep['first_step_allocated_before_bytes'] / 2**20:.2f} MiB)")
            del model, inputs
        except Exception as exc:
            rows.append({"variant": label, "pass": False, "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()})
            rep.log(f"{label:40s} ERROR {type(exc).__name__}: {exc}")
            traceback.print_exc()
        _clean_cuda()
    return rows


# ----------------------------------------------------------------------------------------------
# 4. the cost model on CUDA: predicted vs measured extra step time at 50%
# ----------------------------------------------------------------------------------------------
def _median_step_s(module, model, inputs, steps: int = 20, warmup: int = 3) -> float:
    import statistics

    import torch

    times = []
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        module(*inputs).backward()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def check_cost_model(rep: Report, frac: float = 0.5) -> dict:
    """The default GPT on CUDA at `frac` of keep_all's measured peak, planned with the FLOP model
    and with measured op times (cost_model="measured", each op timed on this GPU): the extra step
    time each plan predicts against the measured one (median of 20 steps, keep_all's in the same
    run)."""
    import torch

    import remat
    from remat.default_model import default_inputs, default_model

    rep.log("")
    rep.log(f"== the cost model on CUDA: default GPT at {frac:.0%} of keep_all, median of 20 steps ==")
    res: dict = {}
    try:
        model = default_model().cuda()
        inputs = default_inputs(device="cuda")
        keep = remat.optimize(model, example_inputs=inputs, solver="keep_all", quiet=True)

        def step():
            model.zero_grad(set_to_none=True)
            keep(*inputs).backward()

        step()
        keep_peak = remat.measure_peak(step, resident=[model, *inputs])
        budget = int(frac * keep_peak)
        eager_s = _median_step_s(model, model, inputs)
        keep_s = _median_step_s(keep, model, inputs)
        res.update(budget_bytes=budget, keep_all_peak_bytes=keep_peak, eager_step_ms=eager_s * 1e3,
                   keep_all_step_ms=keep_s * 1e3, plans={})
        rep.log(f"eager step {eager_s * 1e3:.3f} ms, keep_all step {keep_s * 1e3:.3f} ms; budget {budget / 2**20:.2f} MiB")
        rep.log(f"{'cost model':10s} {'extra cost':>12s} {'pred extra ms':>13s} {'meas extra ms':>13s} "
                f"{'pred ratio':>10s} {'meas ratio':>10s} {'meas/pred extra':>15s} {'solve s':>7s}")
        for cost_model in ("flops", "measured"):
            try:
                opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, cost_model=cost_model,
                                     quiet=True, time_limit_s=SOLVE_LIMIT_S)
            except remat.InfeasibleBudgetError as e:  # the cuBLAS workspaces can put 50% below the smallest
                budget = e.min_feasible_bytes
                res.update(budget_bytes=budget)
                rep.log(f"  ({frac:.0%} of keep_all is infeasible: planned at the smallest feasible budget, "
                        f"{budget / 2**20:.2f} MiB = {budget / keep_peak:.1%})")
                opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, cost_model=cost_model,
                                     quiet=True, time_limit_s=SOLVE_LIMIT_S)
            plan, graph = opt.plan, opt.graph
            meas_s = _median_step_s(opt, model, inputs)
            if cost_model == "measured":
                step_ns = graph.meta["cost_timing"].get("first_computation_ns", graph.total_cost)
                pred_extra_ms = plan.extra_cost / 1e6
                pred_ratio = 1 + plan.extra_cost / step_ns
            else:  # FLOP-equivalents: the extra as a fraction of the step, applied to keep_all's time
                pred_ratio = 1 + plan.extra_cost / graph.total_cost
                pred_extra_ms = (pred_ratio - 1) * keep_s * 1e3
            meas_extra_ms = (meas_s - keep_s) * 1e3
            row = {"extra_cost": plan.extra_cost, "predicted_extra_ms": pred_extra_ms,
                   "measured_extra_ms": meas_extra_ms, "predicted_ratio": pred_ratio,
                   "measured_ratio": meas_s / keep_s, "step_ms": meas_s * 1e3,
                   "predicted_peak_bytes": plan.predicted_peak_bytes, "solve_time_s": plan.solve_time_s,
                   "status": plan.status}
            if cost_model == "measured":
                row["step_ns_predicted"] = step_ns
            res["plans"][cost_model] = row
            ratio = meas_extra_ms / pred_extra_ms if pred_extra_ms else float("nan")
            rep.log(f"{cost_model:10s} {plan.extra_cost:12.4g} {pred_extra_ms:13.3f} {meas_extra_ms:13.3f} "
                    f"{pred_ratio:10.4f} {meas_s / keep_s:10.4f} {ratio:15.3f} {plan.solve_time_s:7.1f}")
            if cost_model == "measured":
                rep.log(f"  (measured-cost model: a keep_all step predicted at {step_ns / 1e6:.3f} ms, measured "
                        f"{keep_s * 1e3:.3f} ms)")
            del opt
        res["status"] = "ok"
    except Exception as exc:
        res.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        rep.log(f"ERROR {type(exc).__name__}: {exc}")
        traceback.print_exc()
    torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for gpu_check.json / gpu_check.txt")
    ap.add_argument("--quick", action="store_true", help="fewer sequence lengths in the speed part")
    ap.add_argument("--all-cases", action="store_true",
                    help="all 8 attention correctness cases (default: the 6 that fit a 5-minute lease with the rest)")
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
    cap = "".join(map(str, rep.data["env"]["capability"]))
    rep.log(f"machine: {rep.data['env']['gpu']} (sm_{cap}), {os.cpu_count()} CPU cores; torch {torch.__version__}, "
            f"triton {triton.__version__}, Python {platform.python_version()}")
    rep.log(f"command: python benchmarks/gpu_check.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    out.mkdir(parents=True, exist_ok=True)

    def dump():
        rep.data["wall_s"] = time.time() - t_start
        (out / "gpu_check.json").write_text(json.dumps(rep.data, indent=2, default=str))
        (out / "gpu_check.txt").write_text("\n".join(rep.lines) + "\n")

    # the pipeline first: it needs no autotuning (fp32 runs fixed kernel configs), the attention
    # parts compile and tune the bf16/fp16 kernels
    if not args.skip_model:
        rep.data["pipeline"] = check_pipeline(rep, deadline=t_start + args.max_seconds * 0.4)
        dump()
        rep.data["cost_model"] = check_cost_model(rep)
        dump()
    rep.data["correctness"] = check_correctness(ta, rep, quick=not args.all_cases)
    dump()
    rep.data["benchmark"] = benchmark(ta, rep, args.quick, t_start + args.max_seconds)
    dump()
    rep.data["all_correct"] = all(r.get("pass") for r in rep.data["correctness"] + rep.data.get("pipeline", []))
    rep.log("")
    rep.log(f"correctness: {'ALL PASS' if rep.data['all_correct'] else 'FAILURES'}; wall {time.time() - t_start:.0f}s; "
            f"results in {out}/gpu_check.json, gpu_check.txt")
    dump()
    return 0 if rep.data["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
