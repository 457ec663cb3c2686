"""A training loop over batches of every shape, against eager: what a new shape costs and whether
the budget holds at each.

    python benchmarks/shapes_loop.py [--steps 20] [--frac 0.5] [--seed 0] [--out benchmarks/results]

The default GPT (remat.default_model: 4 layers, width 128, dropout 0.1), optimized once at
`--frac` of keep_all's predicted peak at the largest shape (batch 8, sequence 256: planned up front),
then trained `--steps` steps on batches of random batch size in [1, 8] and random sequence length in
[16, 256] (SGD). For every step: how its call was planned (a cache hit, or traced and then: keep_all
fits, a schedule reused from another shape, or solved), the trace and plan seconds, the step's time
(its planning included), its peak measured by `remat.measure_peak` in a second step on the same batch,
the plan's predicted peak, and the largest difference of its loss and gradients from the unmodified
model's at the same parameters (the eager copy is given the remat model's parameters before each
step). Then the same loop at one fixed shape (8 x 256) and the eager model's loop at the random
shapes, for the time ratios. Writes `shapes_loop.txt` under --out.
"""
from __future__ import annotations

import argparse
import copy
import random
import time
from pathlib import Path

import torch

import remat
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.machine_info import machine
from remat.solver import keep_all


def _shapes(steps: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 8), rng.randint(16, 256)) for _ in range(steps)]


def _batch(cfg: GPTConfig, b: int, t: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, cfg.vocab_size, (b, t), generator=g), torch.randint(0, cfg.vocab_size, (b, t), generator=g))


def _timed_step(module, params, call, optim, seed: int) -> tuple[float, float]:
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    loss = module(*call)
    loss.backward()
    optim.step()
    return time.perf_counter() - t0, loss.item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--frac", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: step times that other work on the "
                                                             "machine disturbs least)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = default_model(cfg)
    ref = copy.deepcopy(model)
    largest = default_inputs(cfg)  # (8, 256)
    keep = keep_all.solve(remat.capture(model, largest, quiet=True)).predicted_peak_bytes
    budget = int(a.frac * keep)
    t0 = time.perf_counter()
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=largest, quiet=True)
    optimize_s = time.perf_counter() - t0
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    lines = [f"machine: {machine()}, torch {torch.__version__}, torch threads {torch.get_num_threads()}",
             f"command: python benchmarks/shapes_loop.py --steps {a.steps} --frac {a.frac} --seed {a.seed}",
             f"default GPT ({cfg.n_layer} layers, width {cfg.n_embd}, dropout {cfg.dropout}); budget {a.frac:.0%} of "
             f"keep_all at 8 x 256 = {budget / 2**20:.2f} MiB; remat.optimize at 8 x 256: {optimize_s:.1f} s",
             "step  batch  seq  planned                        trace s  plan s  step s  meas MiB  pred MiB  "
             "meas<=budget  meas=pred  loss diff  grad diff"]
    shapes = _shapes(a.steps, a.seed)
    remat_s, worst, all_fit, all_exact = 0.0, 0.0, True, True
    for i, (b, t) in enumerate(shapes):
        call = _batch(cfg, b, t, i)
        with torch.no_grad():
            for p, q in zip(ref.parameters(), model.parameters()):
                p.copy_(q)
        logged = len(opt.plan_log)
        t0 = time.perf_counter()
        opt.plan_for(*call)  # a new shape is traced and planned here (a cached one costs nothing)
        plan_s = time.perf_counter() - t0
        for p in model.parameters():
            p.grad = None
        # the step's peak (a step of its own), its loss and gradients
        torch.manual_seed(i)
        losses = []
        peak = remat.measure_peak(lambda: losses.append(opt(*call)) or losses[-1].backward(),
                                  resident=[model, *call])
        loss = losses[-1].detach()
        grads = [p.grad.clone() for p in model.parameters()]
        for p in ref.parameters():
            p.grad = None
        torch.manual_seed(i)
        ref_loss = ref(*call)
        ref_loss.backward()
        grad_diff = max((g - p.grad).abs().max().item() for g, p in zip(grads, ref.parameters()))
        loss_diff = abs(loss.item() - ref_loss.item())
        step_s, _ = _timed_step(opt, list(model.parameters()), call, optim, i)
        step_s += plan_s
        remat_s += step_s
        rec = opt.plan_log[-1] if len(opt.plan_log) > logged else None
        how = "cached" if rec is None else rec.how.replace("reused the schedule of inputs ", "reused ")[:30]
        pred = opt.plan.predicted_peak_bytes
        all_fit &= peak <= budget
        all_exact &= peak == pred
        worst = max(worst, grad_diff)
        lines.append(f"{i:4d}  {b:5d}  {t:3d}  {how:30s}  {rec.trace_s if rec else 0:7.1f}  "
                     f"{rec.plan_s if rec else 0:6.1f}  {step_s:6.2f}  {peak / 2**20:8.2f}  {pred / 2**20:8.2f}  "
                     f"{str(peak <= budget):12s}  {str(peak == pred):9s}  {loss_diff:9.1e}  {grad_diff:9.1e}")
    hows = [r.how for r in opt.plan_log[1:]]
    fixed = copy.deepcopy(model)
    fixed_opt = remat.optimize(fixed, budget_bytes=budget, example_inputs=largest, quiet=True)
    fixed_optim = torch.optim.SGD(fixed.parameters(), lr=1e-3)
    fixed_s = sum(_timed_step(fixed_opt, list(fixed.parameters()), largest, fixed_optim, i)[0] for i in range(a.steps))
    ref_optim = torch.optim.SGD(ref.parameters(), lr=1e-3)
    eager_s = sum(_timed_step(ref, list(ref.parameters()), _batch(cfg, b, t, i), ref_optim, i)[0]
                  for i, (b, t) in enumerate(shapes))
    tokens = sum(b * t for b, t in shapes)
    lines += [
        f"calls planned after optimize: {len(hows)} of {a.steps} steps (traces); of them solved "
        f"{sum(h == 'solved' for h in hows)}, keep_all fits {sum(h == 'keep_all fits' for h in hows)}, reused "
        f"{sum(h.startswith('reused') for h in hows)}; trace s {sum(r.trace_s for r in opt.plan_log[1:]):.1f}, "
        f"plan s {sum(r.plan_s for r in opt.plan_log[1:]):.1f}",
        f"every step's measured peak <= budget: {all_fit}; measured == predicted: {all_exact}; largest gradient "
        f"difference from eager: {worst:.1e}",
        f"loop time, random shapes ({tokens} tokens): remat {remat_s:.1f} s (planning included), eager {eager_s:.1f} s",
        f"loop time, fixed 8 x 256 ({a.steps * 8 * 256} tokens): remat {fixed_s:.1f} s; random-shape loop / fixed "
        f"loop = {remat_s / fixed_s:.2f}"]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shapes_loop.txt").write_text(text)


if __name__ == "__main__":
    main()
