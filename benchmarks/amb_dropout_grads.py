"""Are torch.compile's gradients right under `activation_memory_budget` with dropout on?

    python benchmarks/amb_dropout_grads.py [--models gpt unet resnet mobilenet] [--out benchmarks/results/amb_dropout_grads.txt]

benchmarks/compare.py checks a compile row's gradients against eager's, which Inductor's own dropout
generator makes differ anyway. This compares each budget with budget 1.0 (the partitioner saves
every mask, so its backward uses the forward's) at the same seed, both compiled by Inductor:
the loss (the forward: the same masks when equal) and the largest gradient difference, with
Inductor's generator (the default), with eager's (torch._inductor.config.fallback_random=True),
and with dropout off (model.eval(): a difference there is not the masks'). Gradients that differ
where the loss is the same and dropout off makes them equal mean the backward used other masks
than the forward: wrong gradients. CPU, torch on one thread.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config

from remat import models
from remat.default_model import default_inputs, default_model
from remat.machine_info import machine

AMBS = (0.7, 0.5, 0.3)


def _model(name: str):
    """The model and inputs compare.py runs (its defaults)."""
    if name == "gpt":
        return default_model(), tuple(default_inputs())
    return getattr(models, f"build_{name}")(), tuple(getattr(models, f"{name}_inputs")())


def _compiled_step(model, inputs, amb: float, fallback_random: bool, buffers: list) -> list[torch.Tensor]:
    """[loss, *gradients] of one step of torch.compile(model) at seed 0, from the buffers `buffers`
    (BatchNorm's running statistics, which each training step moves)."""
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    torch._dynamo.reset()
    try:
        with functorch_config.patch(activation_memory_budget=amb), \
                inductor_config.patch(fallback_random=fallback_random):
            compiled = torch.compile(model)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            loss = compiled(*inputs)
            loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    finally:
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()


def _largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a[1:], b[1:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt", "unet", "resnet", "mobilenet"],
                    choices=["gpt", "unet", "resnet", "mobilenet"])
    ap.add_argument("--out", default="benchmarks/results/amb_dropout_grads.txt")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    lines = [f"machine: {machine()}, torch threads 1",
             f"command: python benchmarks/amb_dropout_grads.py {' '.join(sys.argv[1:])}".rstrip(),
             "each budget against budget 1.0, both torch.compile (Inductor), seed 0; grad diff: largest |difference| "
             "of a gradient; |g|: largest gradient at budget 1.0",
             f"{'model':10s} {'amb':>4s} {'same loss':>9s} {'grad diff':>10s} {'grad diff eager RNG':>19s} "
             f"{'grad diff no dropout':>20s} {'|g|':>9s}  verdict"]
    print("\n".join(lines), flush=True)
    for name in a.models:
        torch.manual_seed(0)
        model, inputs = _model(name)
        buffers = [b.detach().clone() for b in model.buffers()]
        model.train()
        ref = {fb: _compiled_step(model, inputs, 1.0, fb, buffers) for fb in (False, True)}
        model.eval()
        ref_eval = _compiled_step(model, inputs, 1.0, False, buffers)
        for amb in AMBS:
            model.train()
            got = {fb: _compiled_step(model, inputs, amb, fb, buffers) for fb in (False, True)}
            model.eval()
            got_eval = _compiled_step(model, inputs, amb, False, buffers)
            same_loss = bool(torch.equal(got[False][0], ref[False][0]))
            diff, diff_eager, diff_eval = (_largest_difference(got[False], ref[False]),
                                           _largest_difference(got[True], ref[True]),
                                           _largest_difference(got_eval, ref_eval))
            scale = max(float(g.abs().max()) for g in ref[False][1:])
            close = all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(got[False], ref[False]))
            verdict = ("gradients as budget 1.0's" if close else
                       "WRONG gradients: the same forward, other masks in the backward"
                       if same_loss and diff_eval <= 1e-6 * max(scale, 1.0) else "gradients differ (not only masks)")
            lines.append(f"{name:10s} {amb:4g} {str(same_loss):>9s} {diff:10.2e} {diff_eager:19.2e} "
                         f"{diff_eval:20.2e} {scale:9.2e}  {verdict}")
            print(lines[-1], flush=True)
    lines.append(f"wall time: {time.perf_counter() - t0:.0f} s")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
