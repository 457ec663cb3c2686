"""A planned step that fits its budget under torch.compile: measured, and re-planned until it does.

Inductor's code decides when buffers are freed and which temporaries exist, so a plan solved for
remat's fx code can peak above its budget once compiled (benchmarks/compile_budget.py: up to about
12% on the U-Net). The simulator does not model Inductor's generated code; instead
`remat.optimize(..., compiled=True)` measures it:

  1. plan at budget b (first the user's budget), switch the plan's graphs to Inductor, run one step
     on the example inputs (it compiles), then measure the peak of a second step (`measure_peak`:
     the profiler's memory events on the CPU, `torch.cuda.max_memory_allocated` on CUDA);
  2. if that peak is within the budget, return the module; else plan again at b minus the excess
     (the compiled step overshot the plan by about that much, and lowering the plan's budget lowers
     the activations the compiled step holds), at most MAX_ROUNDS plans in all.

The measured steps leave no trace on the model: gradients, buffers (BatchNorm's running statistics)
and the random number generators are as they were before. When no plan's compiled step fits (the
lowered budget is infeasible, or the rounds run out), InfeasibleBudgetError says what each round
measured (its `min_feasible_bytes` is None: what budget a compiled step fits is not known).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from remat.measure import measure_peak
from remat.runtime.compile import CompiledPeakWarning
from remat.solver.plan import InfeasibleBudgetError

__all__ = ["MAX_ROUNDS", "fit_compiled", "measure_compiled_peak"]

MAX_ROUNDS = 4  # plans solved and compiled at most; each costs an Inductor compilation
MIB = 2 ** 20


@contextmanager
def _untouched(model: nn.Module, device: torch.device | None):
    """Run steps on `model` and leave it as it was: its gradients (moved off the GPU meanwhile, so
    they are not counted in the measured peak), its buffers and the random generators' states."""
    params = [p for p in model.parameters()]
    grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in params]
    for p in params:
        p.grad = None
    buffers = [(b, b.detach().to("cpu", copy=True)) for b in model.buffers()]
    cuda = [device] if device is not None and device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.to(p.device)


def measure_compiled_peak(module, model: nn.Module, args: Sequence, kwargs: dict) -> int:
    """Peak bytes of a step of `module` (a RematModule whose graphs use Inductor) on the example
    inputs, after one step that compiles; the model is left as it was."""
    resident = [model, *args, *kwargs.values()]
    devices = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    device = next((d for d in devices if d.type == "cuda"), None)

    def step():
        module(*args, **kwargs).backward()
        for p in model.parameters():
            p.grad = None

    with _untouched(model, device):
        step()  # compiles both graphs
        return measure_peak(step, resident=resident, device=device)


def fit_compiled(build: Callable[[int], object], budget: int, model: nn.Module, args: Sequence, kwargs: dict):
    """The module `build(b)` plans at the largest b <= `budget` tried whose compiled step's measured
    peak is within `budget` (see the module docstring). The returned module's `compiled_fit` lists
    each round as (the plan's budget, the compiled step's measured peak)."""
    rounds: list[tuple[int, int]] = []
    b = budget
    for _ in range(MAX_ROUNDS):
        try:
            module = build(b)
        except InfeasibleBudgetError as exc:
            low = exc.min_feasible_bytes
            if rounds and low is not None and b < low < rounds[-1][0]:
                b = low  # the excess took the budget below what any plan reaches: try the lowest plan
                continue
            if not rounds:
                raise
            raise InfeasibleBudgetError(
                f"no plan's compiled step fits {budget / MIB:.2f} MiB: {_said(rounds)}; planning at "
                f"{b / MIB:.2f} MiB is infeasible ({exc})") from exc  # min_feasible_bytes: unknown compiled
        if not module._signature.outputs.single_scalar:
            raise ValueError("compiled=True measures a training step on the example inputs: the model must "
                             f"return a single loss, not {module._signature.outputs.describe()}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompiledPeakWarning)  # the peak is measured here, not assumed
            module.planned_graphs.use_inductor()
        peak = measure_compiled_peak(module, model, args, kwargs)
        rounds.append((b, peak))
        if peak <= budget:
            module.__dict__["compiled_fit"] = rounds
            return module
        b = max(1, b - (peak - budget))  # a budget, however small: the solver says how low plans go
    raise InfeasibleBudgetError(f"no plan's compiled step fitted {budget / MIB:.2f} MiB in {MAX_ROUNDS} rounds: "
                                f"{_said(rounds)}")


def _said(rounds: list[tuple[int, int]]) -> str:
    return "; ".join(f"planned at {b / MIB:.2f} MiB, the compiled step peaked at {p / MIB:.2f} MiB"
                     for b, p in rounds)
