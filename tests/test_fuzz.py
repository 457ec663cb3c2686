"""Fuzz: small random models under random budgets. Every `optimize` call either raises one of
remat's documented errors (InfeasibleBudgetError, consistent with the budget asked for) or returns a
module whose loss and gradients equal the unmodified model's (same seed, dropout included) and whose
measured peak stays within the budget."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import remat  # noqa: E402
from tests.fuzz_scale import fuzz_count  # noqa: E402


class FuzzNet(nn.Module):
    """An MLP whose depth, widths, normalisation, residuals and dropout are drawn by hypothesis."""

    def __init__(self, widths: list[int], norm: bool, residual: bool, dropout: float, act: str):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.norms = nn.ModuleList(nn.LayerNorm(b) if norm else nn.Identity() for b in widths[1:])
        self.residual = residual
        self.drop = nn.Dropout(dropout)
        self.act = {"relu": torch.relu, "gelu": F.gelu, "tanh": torch.tanh}[act]

    def forward(self, x, y):
        h = x
        for i, (lin, norm) in enumerate(zip(self.layers, self.norms)):
            z = norm(lin(h))
            if i < len(self.layers) - 1:
                z = self.drop(self.act(z))
            h = z + h if self.residual and z.shape == h.shape else z
        return F.mse_loss(h, y)


def _grads(model: nn.Module, step, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = step()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@st.composite
def cases(draw):
    depth = draw(st.integers(2, 6))
    width = draw(st.sampled_from([16, 32, 48]))
    widths = [width] * (depth + 1) if draw(st.booleans()) else \
        [draw(st.sampled_from([8, 16, 32, 64])) for _ in range(depth + 1)]
    return dict(widths=widths, norm=draw(st.booleans()), residual=draw(st.booleans()),
                dropout=draw(st.sampled_from([0.0, 0.1, 0.5])), act=draw(st.sampled_from(["relu", "gelu", "tanh"])),
                batch=draw(st.sampled_from([4, 16, 32])), frac=draw(st.floats(0.05, 1.3)),
                solver=draw(st.sampled_from(["checkmate", "checkmate", "equal_spacing", "keep_all"])),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=fuzz_count(36), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_random_models_and_budgets(case):
    torch.manual_seed(case["seed"])
    model = FuzzNet(case["widths"], case["norm"], case["residual"], case["dropout"], case["act"])
    x = torch.randn(case["batch"], case["widths"][0])
    y = torch.randn(case["batch"], case["widths"][-1])
    eager_peak = remat.measure_peak(lambda: model(x, y).backward(), resident=[model, x, y])
    model.zero_grad(set_to_none=True)
    budget = max(1, int(case["frac"] * eager_peak))
    try:
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=(x, y), solver=case["solver"],
                             time_limit_s=20)
    except remat.InfeasibleBudgetError as e:
        # a refusal names a smallest feasible budget above the one asked for
        assert e.min_feasible_bytes > budget
        event(f"{case['solver']}: infeasible")
        return
    event(f"{case['solver']}: planned")
    assert opt.plan.predicted_peak_bytes <= budget
    ref_loss, ref_grads = _grads(model, lambda: model(x, y), seed=case["seed"] + 1)
    loss, grads = _grads(model, lambda: opt(x, y), seed=case["seed"] + 1)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    model.zero_grad(set_to_none=True)
    peak = remat.measure_peak(lambda: opt(x, y).backward(), resident=[model, x, y])
    assert peak == opt.plan.predicted_peak_bytes  # the simulator is exact on CPU
    assert peak <= budget
