"""How far a planned step's peak moves when torch.compile runs it: Inductor's generated code decides
when buffers are freed (and decomposes ops into other temporaries), so the compiled step's peak is
measured here, not simulated.

    python benchmarks/compile_budget.py [--out benchmarks/results/compile_budget_cpu.txt]

For the default GPT and remat.models' U-Net and MobileNet, at 70% and 55% of keep_all's predicted
peak: the plan's predicted peak, the measured peak of the module run as it is (remat's fx code: the
simulator's prediction, to the byte on the CPU) and of `torch.compile(module)` (measured after a
warm-up step that compiles), each as a ratio to the budget; then `remat.optimize(..., compiled=True)`
(remat/compiled_fit.py), which measures the compiled step and plans again lower until it fits: how
many plans it made ("rounds"), the budget its last plan was solved for, that module's compiled peak
measured again here ("fitted") and the seconds the search took ("fit s"), or why no plan fitted. CPU, torch on one thread; peaks from the
profiler's memory events (`remat.measure_peak`).
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

import remat
from remat.default_model import default_inputs, default_model
from remat.machine_info import machine
from remat.models import build_mobilenet, build_unet, mobilenet_inputs, unet_inputs

MODELS = {
    "default GPT": lambda: (default_model(), tuple(default_inputs())),
    "U-Net": lambda: (build_unet(), tuple(unet_inputs())),
    "MobileNet": lambda: (build_mobilenet(), tuple(mobilenet_inputs())),
}
FRACTIONS = (0.7, 0.55)
MIB = 2 ** 20


def _peak(module, model, inputs) -> int:
    model.zero_grad(set_to_none=True)
    return remat.measure_peak(lambda: module(*inputs).backward(), resident=[model, *inputs])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/compile_budget_cpu.txt")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    lines = [f"machine: {machine()}, torch threads 1", "command: python benchmarks/compile_budget.py",
             f"{'model':12s} {'fraction':>8s} {'budget MiB':>10s} {'pred MiB':>9s} {'fx MiB':>9s} "
             f"{'compiled MiB':>12s} {'fx/budget':>9s} {'compiled/budget':>15s} {'rounds':>6s} "
             f"{'last plan MiB':>13s} {'fitted MiB':>10s} {'fitted/budget':>13s} {'fit s':>6s}"]
    print("\n".join(lines), flush=True)
    for name, build in MODELS.items():
        for frac in FRACTIONS:
            torch.manual_seed(0)
            model, inputs = build()
            keep = remat.optimize(model, example_inputs=inputs, solver="keep_all", quiet=True)
            budget = int(frac * keep.plan.predicted_peak_bytes)
            opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, time_limit_s=60, quiet=True)
            fx_peak = _peak(opt, model, inputs)  # before compiling: torch.compile switches opt's graphs too
            compiled = torch.compile(opt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the compiled-peak warning this benchmark measures
                _peak(compiled, model, inputs)  # the warm-up step compiles
                compiled_peak = _peak(compiled, model, inputs)
            line = (f"{name:12s} {frac:8.0%} {budget / MIB:10.2f} {opt.plan.predicted_peak_bytes / MIB:9.2f} "
                    f"{fx_peak / MIB:9.2f} {compiled_peak / MIB:12.2f} {fx_peak / budget:9.3f} "
                    f"{compiled_peak / budget:15.3f}")
            t_fit = time.perf_counter()
            try:
                fitted = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, time_limit_s=60,
                                        quiet=True, compiled=True)
            except remat.InfeasibleBudgetError as exc:
                line += f"  no fit ({time.perf_counter() - t_fit:.0f} s): {exc}"
            else:
                fit_s = time.perf_counter() - t_fit  # tracing, solving, compiling and measuring, every round
                peak = _peak(fitted, model, inputs)  # measured again, apart from the search's own measurement
                line += (f" {len(fitted.compiled_fit):6d} {fitted.plan.budget_bytes / MIB:13.2f} {peak / MIB:10.2f} "
                         f"{peak / budget:13.3f} {fit_s:6.0f}")
            lines.append(line)
            print(lines[-1], flush=True)
            torch._dynamo.reset()
    lines.append(f"wall time: {time.perf_counter() - t0:.0f} s")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
