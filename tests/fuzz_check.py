"""The check the fuzz tests share: optimize a model at a budget (a refused budget retried at the
smallest feasible one the refusal names), then compare one step against the unmodified model's from
the same buffers and seed (loss, every gradient, every buffer) and the measured peak against the
plan's prediction and the budget."""
from __future__ import annotations

import torch
import torch.nn as nn

import remat

__all__ = ["optimize_and_compare"]


def _step(model: nn.Module, run, seed: int) -> tuple[torch.Tensor, list, list[torch.Tensor]]:
    """Loss, gradients and buffers after one step from the model's current buffers."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = run()
    loss.backward()
    return (loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            [b.clone() for b in model.buffers()])


def optimize_and_compare(model: nn.Module, args: tuple, frac: float, solver: str, seed: int, described: str,
                         exact: bool = True, rtol: float = 1e-5, atol: float = 1e-6, **options) -> remat.Plan:
    """Optimize `model` at `frac` of its eager step's measured peak and check the module against it.
    With `exact` False (masks drawn by remat's own generator) only memory is compared. Returns the plan."""
    eager_peak = remat.measure_peak(lambda: model(*args).backward(), resident=[model, *args])
    budget = max(1, int(frac * eager_peak))
    start = [b.clone() for b in model.buffers()]
    try:
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=args, solver=solver, time_limit_s=20,
                             quiet=True, **options)
    except remat.InfeasibleBudgetError as e:
        # a refusal names a smallest feasible budget above the one asked for, and that budget is accepted
        assert e.min_feasible_bytes > budget, described
        budget = e.min_feasible_bytes
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=args, solver=solver, time_limit_s=20,
                             quiet=True, **options)
    assert opt.plan.predicted_peak_bytes <= budget, described

    def reset():
        for b, s in zip(model.buffers(), start):
            b.copy_(s)

    reset()
    ref_loss, ref_grads, ref_buffers = _step(model, lambda: model(*args), seed=seed + 1)
    reset()
    loss, grads, buffers = _step(model, lambda: opt(*args), seed=seed + 1)
    if exact:
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=lambda m: f"{described}: loss {m}")
        for g, r in zip(grads, ref_grads):
            assert (g is None) == (r is None), described
            if g is not None:
                torch.testing.assert_close(g, r, rtol=rtol, atol=atol, msg=lambda m: f"{described}: gradient {m}")
        for b, r in zip(buffers, ref_buffers):  # e.g. BatchNorm's running statistics and its step counter
            torch.testing.assert_close(b, r, rtol=rtol, atol=atol, msg=lambda m: f"{described}: buffer {m}")
    model.zero_grad(set_to_none=True)
    peak = remat.measure_peak(lambda: opt(*args).backward(), resident=[model, *args])
    assert peak == opt.plan.predicted_peak_bytes, described  # the simulator is exact on CPU
    assert peak <= budget, described
    return opt.plan
