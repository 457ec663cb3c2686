"""Hugging Face models as people train them, optimized under budgets and measured for real.

    python benchmarks/huggingface.py [--models llama gpt2 bert t5 vit] [--fracs 0.7 0.5]
                                     [--solver checkmate] [--time-limit S] [--out benchmarks/results]

LLaMA, GPT-2, BERT, T5 and ViT (small configs built in code, random weights, nothing downloaded;
see tests/hf_models.py), dropout 0.1, one padded batch with its `attention_mask` and `labels=`
(ViT: images and labels). For each model: keep_all's measured peak, then for each fraction of it a
budget (the smallest feasible budget instead, when the fraction is below it), the plan's predicted
peak, the measured peak of a real step (CPU: profiler memory events; CUDA: max_memory_allocated),
the recomputation cost, and the largest difference of loss and gradients from the eager model run
with the same seed ("ok": all allclose(rtol=1e-5, atol=1e-6)). Writes huggingface_<device>.txt.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.hf_models, from the repository root

import remat  # noqa: E402
from remat.machine_info import MiB, machine  # noqa: E402
from remat.core.plan import InfeasibleBudgetError  # noqa: E402
from tests.hf_models import HF_MODELS, hf_batch, hf_model, hf_step  # noqa: E402


def _transformers() -> str:
    import transformers

    return f"transformers {transformers.__version__}"


def loss_and_grads(module, params, batch, seed: int = 0) -> list[torch.Tensor]:
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = hf_step(module, batch)()
    out = [loss.detach()] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def peak_of(module, model, batch, device) -> int:
    for p in model.parameters():
        p.grad = None
    peak = remat.measure_peak(hf_step(module, batch), device=device,
                              resident=[model, *[v for v in batch.values() if isinstance(v, torch.Tensor)]])
    for p in model.parameters():
        p.grad = None
    return peak


def bench_model(name: str, a, device) -> list[dict]:
    model = hf_model(name, dropout=0.1, width=a.width, layers=a.layers, seq=a.seq, image=a.image).to(device)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
             for k, v in hf_batch(name, batch=a.batch, seq=a.seq, image=a.image).items()}
    params = list(model.parameters())
    ref = loss_and_grads(model, params, batch)
    keep = remat.optimize(model, example_inputs=(), example_kwargs=batch, solver="keep_all")
    K = peak_of(keep, model, batch, device)
    rows = []
    for frac in [None, *a.fracs]:
        budget, target = (None, "keep_all") if frac is None else (int(frac * K), f"{frac:.0%}")
        t0 = time.perf_counter()
        try:
            opt = keep if frac is None else remat.optimize(
                model, budget_bytes=budget, example_inputs=(), example_kwargs=batch, solver=a.solver,
                time_limit_s=a.time_limit)
        except InfeasibleBudgetError as e:  # below the smallest feasible budget: plan at that one
            budget, target = e.min_feasible_bytes, f"{target}->min"
            opt = remat.optimize(model, budget_bytes=budget, example_inputs=(), example_kwargs=batch,
                                 solver=a.solver, time_limit_s=a.time_limit)
        solve_s = time.perf_counter() - t0
        got = loss_and_grads(opt, params, batch)
        ok = all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(got, ref))
        err = max(float((x - y).abs().max()) for x, y in zip(got, ref))
        peak = peak_of(opt, model, batch, device)
        p = opt.plan
        rows.append(dict(model=name, nodes=len(opt.graph.nodes), keep=K, target=target, budget=budget,
                         status=p.status, pred=p.predicted_peak_bytes, meas=peak,
                         fits=budget is None or peak <= budget, extra=p.extra_cost / opt.graph.total_cost,
                         err=err, ok=ok, solve_s=solve_s))
        print(format_row(rows[-1]), flush=True)
    return rows


HEAD = (f"{'model':<6} {'nodes':>5} {'target':<10} {'budget MiB':>10} {'status':<10} {'pred MiB':>9} "
        f"{'meas MiB':>9} {'meas/keep':>9} {'fits':>5} {'extra':>7} {'max grad err':>12} {'grads':>5} {'solve s':>8}")


def format_row(r: dict) -> str:
    budget = "-" if r["budget"] is None else f"{r['budget'] / MiB:.3f}"
    return (f"{r['model']:<6} {r['nodes']:>5} {r['target']:<10} {budget:>10} {r['status']:<10} "
            f"{r['pred'] / MiB:>9.3f} {r['meas'] / MiB:>9.3f} {r['meas'] / r['keep']:>9.3f} "
            f"{'yes' if r['fits'] else 'NO':>5} {r['extra']:>6.1%} {r['err']:>12.2e} "
            f"{'ok' if r['ok'] else 'DIFF':>5} {r['solve_s']:>8.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(HF_MODELS), choices=HF_MODELS)
    ap.add_argument("--fracs", type=float, nargs="+", default=[0.7, 0.5])
    ap.add_argument("--solver", default="checkmate")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="optional wall-clock limit on the MILP (default: deterministic work limits only)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warnings.filterwarnings("ignore", message=".*not a single loss")  # the models return loss and logits
    header = [f"machine: {machine(_transformers())}",
              f"models: width {a.width}, {a.layers} layers (T5: {max(1, a.layers // 2)} + {max(1, a.layers // 2)}), "
              f"4 heads, dropout 0.1, batch {a.batch}, sequence {a.seq} with 2 rows padded (ViT: {a.image}x{a.image} "
              f"images, {(a.image // 4) ** 2} patches), labels= so the model computes its loss; solver {a.solver} "
              f"({'deterministic work limits' if a.time_limit is None else f'time limit {a.time_limit:g} s'}); grads: loss and every gradient allclose(rtol=1e-5, atol=1e-6) "
              f"to the eager model with the same seed"]
    print("\n".join(header))
    print(HEAD)
    rows = []
    for name in a.models:
        rows += bench_model(name, a, device)
    text = "\n".join([*header, HEAD, "-" * len(HEAD), *map(format_row, rows)])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"huggingface_{device.type}.txt"
    path.write_text(text + "\n")
    print(f"wrote {path}")
    return 0 if all(r["ok"] and r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
