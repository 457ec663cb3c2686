"""How much slower remat's drop-in module runs a step than the unmodified model, where nothing is
recomputed (keep_all): the runtime's own cost per step.

    python benchmarks/step_overhead.py [--steps 30] [--out benchmarks/results/step_overhead_cpu.txt]

Models: a tiny GPT (2-wide heads, 8 tokens: its kernels take microseconds, so the step is mostly
Python and dispatch, as a small model's step on a GPU is), the default GPT, and remat.models' U-Net,
ResNet and MobileNet. Each model's eager step and keep_all step alternate in one process, after
warm-up; the table gives the medians and their ratio (keep_all / eager; 1.0 = no overhead).
Torch runs on one thread.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import remat
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.machine_info import machine
from remat.models import build_mobilenet, build_resnet, build_unet, mobilenet_inputs, resnet_inputs, unet_inputs

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16, batch_size=1)
MODELS = {
    "tiny GPT (launch-bound)": lambda: (default_model(TINY), default_inputs(TINY)),
    "default GPT": lambda: (default_model(), default_inputs()),
    "U-Net": lambda: (build_unet(), unet_inputs()),
    "ResNet": lambda: (build_resnet(), resnet_inputs()),
    "MobileNet": lambda: (build_mobilenet(), mobilenet_inputs()),
}


def _step_s(module, model, inputs) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    module(*inputs).backward()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="timed steps of each (alternating)")
    ap.add_argument("--out", default="benchmarks/results/step_overhead_cpu.txt")
    a = ap.parse_args()
    torch.set_num_threads(1)
    lines = [f"machine: {machine()}, torch threads 1",
             f"command: python benchmarks/step_overhead.py --steps {a.steps}",
             f"{'model':26s} {'eager ms':>9s} {'keep_all ms':>11s} {'keep_all / eager':>16s}"]
    print("\n".join(lines), flush=True)
    for name, build in MODELS.items():
        model, inputs = build()
        keep = remat.optimize(model, example_inputs=inputs, solver="keep_all", quiet=True)
        for _ in range(3):
            _step_s(model, model, inputs), _step_s(keep, model, inputs)
        eager, ours = [], []
        for _ in range(a.steps):
            eager.append(_step_s(model, model, inputs))
            ours.append(_step_s(keep, model, inputs))
        e, k = statistics.median(eager), statistics.median(ours)
        lines.append(f"{name:26s} {e * 1e3:9.3f} {k * 1e3:11.3f} {k / e:16.3f}")
        print(lines[-1], flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
