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
measured again here ("fitted") and the seconds the search took ("fit s"), or why no plan fitted.

Second table, both sides compiled: PyTorch's own answer under torch.compile, Inductor with
`torch._functorch.config.activation_memory_budget` (amb) at 0.7, 0.5 and 0.3, measured (peak, and
matmul FLOPs beyond the eager model's: "xGFLOP"), against `remat.optimize(..., compiled=True)` at
that measured peak: its compiled step's peak and extra matmul FLOPs, measured the same way.
CPU, torch on one thread; peaks from the profiler's memory events (`remat.measure_peak`), FLOPs
from `remat.count_flops`.
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
AMBS = (0.7, 0.5, 0.3)
MIB = 2 ** 20


def _peak(module, model, inputs) -> int:
    model.zero_grad(set_to_none=True)
    return remat.measure_peak(lambda: module(*inputs).backward(), resident=[model, *inputs])


def _step_flops(module, model, inputs) -> int:
    model.zero_grad(set_to_none=True)
    return remat.count_flops(lambda: module(*inputs).backward())


def _against_amb(name: str, build, amb: float) -> str:
    """One row: torch.compile at activation_memory_budget `amb` (Inductor's own partitioner),
    measured, against remat.optimize(..., compiled=True) at the peak it measured."""
    import torch._functorch.config as functorch_config

    torch.manual_seed(0)
    model, inputs = build()
    eager_flops = _step_flops(model, model, inputs)
    torch._dynamo.reset()
    with functorch_config.patch(activation_memory_budget=amb):
        peer = torch.compile(model)
        _peak(peer, model, inputs)  # the warm-up step compiles
        peer_peak = _peak(peer, model, inputs)
        peer_x = _step_flops(peer, model, inputs) - eager_flops
    torch._dynamo.reset()
    row = f"{name:12s} {amb:4g} {peer_peak / MIB:8.2f} {peer_x / 1e9:11.3f}"
    t_fit = time.perf_counter()
    try:
        fitted = remat.optimize(model, budget_bytes=peer_peak, example_inputs=inputs, time_limit_s=60,
                                quiet=True, compiled=True)
    except remat.InfeasibleBudgetError as exc:
        return row + f"  remat: no fit ({time.perf_counter() - t_fit:.0f} s): {exc}"
    fit_s = time.perf_counter() - t_fit
    peak = _peak(fitted, model, inputs)
    x = _step_flops(fitted, model, inputs) - eager_flops
    torch._dynamo.reset()
    dx = peer_x - x
    verdict = ("beats it" if dx > 0 and peak <= peer_peak else "ties" if dx == 0 and peak <= peer_peak else
               "does not beat it")
    return (row + f" {peak / MIB:9.2f} {x / 1e9:12.3f} {len(fitted.compiled_fit):6d} {fit_s:6.0f}  {verdict}: "
            f"{abs(dx) / 1e9:.3f} GFLOP {'fewer' if dx >= 0 else 'more'}, peak {(peak - peer_peak) / MIB:+.2f} MiB")


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
    lines += ["", "both compiled: torch.compile with activation_memory_budget (amb) against remat.optimize(..., "
              "compiled=True) at the peer's measured peak",
              f"{'model':12s} {'amb':>4s} {'peer MiB':>8s} {'peer xGFLOP':>11s} {'remat MiB':>9s} "
              f"{'remat xGFLOP':>12s} {'rounds':>6s} {'fit s':>6s}  verdict"]
    print("\n".join(lines[-3:]), flush=True)
    for name, build in MODELS.items():
        for amb in AMBS:
            lines.append(_against_amb(name, build, amb))
            print(lines[-1], flush=True)
    lines.append(f"wall time: {time.perf_counter() - t0:.0f} s")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
