"""Issue #8 item 1: planning without the memory (`remat.plan` on meta/fake tensors).

    python benchmarks/plan_without_memory.py [--solver checkmate] [--big-solver checkmate] [--skip-big]

(a) The default GPT (4 layers, sequence 256, dropout 0.1) built on the meta device, with meta
    inputs, planned for the CPU at 50% of its keep_all peak; the plan deployed on the real model
    with `remat.optimize(..., plan=plan)`: the fake plan's prediction, the prediction judged again
    on the real graph, the measured peak, and whether the loss and every gradient equal the
    unmodified model's bit for bit (same seed).
(b) A 1.3B-parameter GPT (24 layers, d=2048, 16 heads, vocabulary 50257 tied with the LM head,
    sequence 2048, batch 8, SDPA attention fused, dropout 0.1) built on the meta device and
    planned with budget_gb=40 for "cuda" (512-byte allocator blocks), in a subprocess whose peak
    RSS (resource.getrusage) is reported, with its time and node count.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import remat
from remat.default_model import GPT, GPTConfig, default_inputs, default_model
from remat.machine_info import machine
from remat.measure import measure_peak
from remat.report import training_step

__all__ = ["default_model_row", "big_model_row", "main"]

BIG = """
import json, resource, sys, time
import torch, remat
from remat.default_model import GPT, GPTConfig
cfg = GPTConfig(vocab_size=50257, block_size=2048, n_layer=24, n_head=16, n_embd=2048, batch_size=8,
                dropout=0.1, attn_dropout=0.0, attention="sdpa")
with torch.device("meta"):
    model = GPT(cfg)
model.lm_head.weight = model.wte.weight
idx = torch.empty(cfg.batch_size, cfg.block_size, dtype=torch.long, device="meta")
t0 = time.perf_counter()
plan = remat.plan(model, (idx, idx.clone()), budget_gb=40, device="cuda", solver=sys.argv[1])
print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "nodes": plan.details["graph_nodes"],
                  "capture_s": plan.details["capture_s"], "solve_s": plan.solve_time_s,
                  "total_s": time.perf_counter() - t0, "predicted_gb": plan.predicted_peak_bytes / 1e9,
                  "status": plan.status, "recomputed": len(plan.recomputed),
                  "extra_cost": plan.extra_cost / plan.total_cost,
                  "multiple_of_512": plan.predicted_peak_bytes % 512 == 0,
                  "estimated": sorted({e["method"] for e in plan.details["estimated_workspaces"]}),
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def default_model_row(solver: str) -> dict:
    """(a): plan the meta default model at 50% of keep_all, deploy on the real one, measure."""
    cfg = GPTConfig(n_layer=4, block_size=256, dropout=0.1)
    with torch.device("meta"):
        meta_model = GPT(cfg)
    fake = tuple(torch.empty(cfg.batch_size, cfg.block_size, dtype=torch.long, device="meta") for _ in range(2))
    keep = remat.plan(meta_model, fake, solver="keep_all")
    budget = keep.predicted_peak_bytes // 2
    t0 = time.perf_counter()
    plan = remat.plan(meta_model, fake, budget_bytes=budget, solver=solver)
    plan_s = time.perf_counter() - t0
    model, inputs = default_model(cfg), default_inputs(cfg)
    params = list(model.parameters())
    eager = training_step(model, params, inputs)
    eager.fresh()
    torch.manual_seed(0)
    loss = eager().detach().clone()
    grads = [p.grad.clone() for p in params]
    eager.fresh()
    opt = remat.optimize(model, example_inputs=inputs, plan=plan)
    step = training_step(opt, params, inputs)
    step.fresh()
    peak = measure_peak(step, resident=[model, *inputs])
    step.fresh()
    torch.manual_seed(0)
    same = torch.equal(step().detach(), loss) and all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    return {"solver": solver, "keep_all": keep.predicted_peak_bytes, "budget": budget,
            "predicted_fake": plan.predicted_peak_bytes, "predicted_real": opt.plan.predicted_peak_bytes,
            "measured": peak, "same_fingerprint": plan.graph_fingerprint == opt.graph.fingerprint(),
            "bit_identical": same, "plan_s": plan_s, "estimated": len(plan.details["estimated_workspaces"])}


def big_model_row(solver: str) -> dict:
    """(b): the 1.3B GPT planned for CUDA in a subprocess; its peak RSS."""
    out = subprocess.run([sys.executable, "-c", BIG, solver], capture_output=True, text=True, check=True)
    return {"solver": solver, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    """Run (a) and (b), print them and write benchmarks/results/plan_without_memory.txt."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--solver", default="checkmate", help="solver for (a)")
    ap.add_argument("--big-solver", default="checkmate", help="solver for (b)")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    mib = 2**20
    r = default_model_row(a.solver)
    lines = [f"machine: {machine()}",
             "(a) default GPT planned on the meta device (CPU), deployed on the real model",
             f"  {r['solver']}: keep_all {r['keep_all'] / mib:.2f} MiB, budget {r['budget'] / mib:.2f} MiB, "
             f"predicted on fake {r['predicted_fake']} B, judged on real {r['predicted_real']} B, "
             f"measured {r['measured']} B (measured/predicted {r['measured'] / r['predicted_fake']:.4f}), "
             f"same fingerprint {r['same_fingerprint']}, gradients bit-identical {r['bit_identical']}, "
             f"plan {r['plan_s']:.1f} s, estimated workspaces {r['estimated']}"]
    if not a.skip_big:
        b = big_model_row(a.big_solver)
        lines += ["(b) 1.3B GPT (24 x 2048, seq 2048, batch 8) planned on the meta device for cuda, budget_gb=40",
                  f"  {b['solver']}: {b['params'] / 1e9:.3f}B parameters, {b['nodes']} nodes, capture "
                  f"{b['capture_s']:.1f} s, solve {b['solve_s']:.1f} s, total {b['total_s']:.1f} s, "
                  f"predicted {b['predicted_gb']:.2f} GB ({b['status']}, {b['recomputed']} recomputed, extra "
                  f"cost {b['extra_cost']:.1%}), multiple of 512 B {b['multiple_of_512']}, workspaces "
                  f"{'/'.join(b['estimated'])}, peak RSS {b['peak_rss_mib']:.0f} MiB"]
    text = "\n".join(lines)
    print(text)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "plan_without_memory.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
