"""A planned step that fits its budget under torch.compile: measured, and re-planned until it does.

Inductor's code decides when buffers are freed and which temporaries exist, so a plan solved for
remat's fx code can peak above its budget once compiled (benchmarks/compile_budget.py: up to about
12% on the U-Net), or well below it (Inductor fuses pointwise chains, whose intermediates the plan
counts). The simulator does not model Inductor's generated code; instead
`remat.optimize(..., compiled=True)` measures it:

  1. plan at budget b (first the user's budget), switch the plan's graphs to Inductor, run one step
     on the example inputs (it compiles), then measure the peak of a second step (`measure_peak`:
     the profiler's memory events on the CPU, `torch.cuda.max_memory_allocated` on CUDA);
  2. if that peak exceeds the budget, plan again at b minus the excess (the compiled step overshot
     the plan by about that much, and lowering the plan's budget lowers the activations the
     compiled step holds); after a lowering that still overshot, by at least twice that lowering
     (a plan a little lower can compile to the same peak);
  3. if it fits, but more than FIT_WITHIN below the budget while the plan recomputes something,
     plan again at b plus the room left (a higher plan recomputes less), never at or above a
     plan budget that overshot (then halfway between the highest that fitted and it);
  4. at most MAX_ROUNDS plans in all; the module returned is the fitting one that recomputes least.

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
from remat.runtime.module import PlannedStep
from remat.core.plan import InfeasibleBudgetError

__all__ = ["FIT_WITHIN", "MAX_ROUNDS", "fit_compiled", "measure_compiled_peak", "untouched"]

MAX_ROUNDS = 4  # plans solved and compiled at most; each costs an Inductor compilation
FIT_WITHIN = 0.01  # a compiled peak this close below the budget (a fraction of it) ends the search
MIB = 2 ** 20


@contextmanager
def untouched(model: nn.Module, device: torch.device | None):
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
    """Peak bytes of a step of `module` (a RematModule or PlannedStep whose graphs use Inductor) on
    the example inputs, after one step that compiles; the model is left as it was."""
    resident = [model, *args, *kwargs.values()]
    devices = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    device = next((d for d in devices if d.type == "cuda"), None)

    def step():
        module(*args, **kwargs).backward()
        for p in model.parameters():
            p.grad = None

    with untouched(model, device):
        step()  # compiles both graphs
        return measure_peak(step, resident=resident, device=device)


def fit_compiled(build: Callable[[int], PlannedStep], budget: int, model: nn.Module, args: Sequence,
                 kwargs: dict) -> PlannedStep:
    """The planned step `build(b)` makes, over the plan budgets b tried (see the module docstring),
    whose compiled step's measured peak is within `budget` and whose plan recomputes least. The
    returned step's `compiled_fit` lists each round as (the plan's budget, the compiled step's
    measured peak)."""
    rounds: list[tuple[int, int]] = []
    best = None  # the fitting module whose plan recomputes least
    fitted, overshot = None, None  # the highest plan budget that fitted, the lowest that overshot
    drop = 0  # how far the last overshoot lowered the plan's budget
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
        if not module.signature.outputs.single_scalar:
            raise ValueError("compiled=True measures a training step on the example inputs: the model must "
                             f"return a single loss, not {module.signature.outputs.describe()}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompiledPeakWarning)  # the peak is measured here, not assumed
            module.graphs.use_inductor()
        peak = measure_compiled_peak(module, model, args, kwargs)
        rounds.append((b, peak))
        if peak > budget:
            overshot = b if overshot is None else min(overshot, b)
            if fitted is None:  # below by the excess, or twice the last drop, which did not suffice
                drop = max(peak - budget, 2 * drop)
                b = max(1, b - drop)
            else:  # halfway to the plan that fitted
                b = (fitted + overshot) // 2
        else:
            fitted = b if fitted is None else max(fitted, b)
            if best is None or module.plan.extra_cost < best.plan.extra_cost:
                best = module
            if module.plan.extra_cost == 0 or budget - peak <= FIT_WITHIN * budget:
                break  # nothing left to recompute less of, or the budget is used
            b = b + (budget - peak) if overshot is None else min(b + (budget - peak), (fitted + overshot) // 2)
        if any(b == tried for tried, _ in rounds):
            break  # the search has closed in on a plan budget already measured
    if best is not None:
        best.compiled_fit = rounds
        return best
    raise InfeasibleBudgetError(f"no plan's compiled step fitted {budget / MIB:.2f} MiB in {len(rounds)} rounds: "
                                f"{_said(rounds)}")


def _said(rounds: list[tuple[int, int]]) -> str:
    return "; ".join(f"planned at {b / MIB:.2f} MiB, the compiled step peaked at {p / MIB:.2f} MiB"
                     for b, p in rounds)
