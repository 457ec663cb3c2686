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
import os
import platform
import sys
import time
import traceback
from pathlib import Path

# benchmarks/ (this script's folder) is on sys.path
from gpu_attention import benchmark, check_correctness
from gpu_common import EXIT_NO_GPU, Report, load_attention_module


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

    ta = load_attention_module()
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
        rep.save(out, "gpu_check")

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
