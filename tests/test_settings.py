"""optimize's settings in groups (remat/settings.py): remat.Solver and remat.CaptureOptions say the
same as the flat keywords, are checked when made, and a setting given both ways is refused."""
from __future__ import annotations

import pytest
import torch

import remat
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.settings import CaptureOptions, Solver, settle

CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32, batch_size=2)


@pytest.fixture(scope="module")
def model_and_budget():
    torch.manual_seed(0)
    model, inputs = default_model(CFG), default_inputs(CFG)
    keep = remat.optimize(model, example_inputs=inputs, solver="keep_all", quiet=True)
    return model, inputs, int(0.95 * keep.plan.predicted_peak_bytes)


def _context(plan) -> dict:
    """What a plan was made for, less the machine line (it carries the load average)."""
    return {k: v for k, v in plan.context.items() if k != "machine"}


def test_the_groups_plan_what_the_keywords_plan(model_and_budget):
    model, inputs, budget = model_and_budget
    grouped = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, quiet=True,
                             solver=remat.Solver("equal_spacing"),
                             capture=remat.CaptureOptions(fused_attention=False))
    flat = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, quiet=True, solver="equal_spacing",
                          fused_attention=False)
    assert grouped.plan.schedule == flat.plan.schedule and _context(grouped.plan) == _context(flat.plan)
    default = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, quiet=True, solver="equal_spacing")
    assert _context(grouped.plan) != _context(default.plan)  # the capture setting reached the plan
    torch.manual_seed(1)
    loss = grouped(*inputs)
    loss.backward()
    assert torch.isfinite(loss)


def test_settle_keeps_each_setting_in_one_place():
    solver, capture = settle("checkmate", 30.0, {"mip_gap": 1e-3}, None, fused_attention="all", cost_model="flops")
    assert solver == Solver("checkmate", time_limit_s=30.0, mip_gap=1e-3) and solver.kwargs == {"mip_gap": 1e-3}
    assert capture == CaptureOptions(fused_attention="all")
    given = Solver("equal_spacing")
    assert settle(given, None, {}, None, fused_attention=True, cost_model="flops")[0] is given
    with pytest.raises(remat.RematArgumentError, match="time_limit_s, mip_gap given as keywords too"):
        settle(Solver("checkmate"), 5.0, {"mip_gap": 1e-3}, None, fused_attention=True, cost_model="flops")
    with pytest.raises(remat.RematArgumentError, match="cost_model given as keywords too"):
        settle("checkmate", None, {}, CaptureOptions(), fused_attention=True, cost_model="measured")
    with pytest.raises(remat.RematArgumentError, match="chunked_loss given as keywords too"):
        settle("checkmate", None, {}, CaptureOptions(), chunked_loss=False)
    assert settle("checkmate", None, {}, None, chunked_loss="on")[1] == CaptureOptions(chunked_loss="on")


@pytest.mark.parametrize("make, error, text", [
    (lambda: Solver("magic"), remat.RematArgumentError, "unknown solver 'magic'"),
    (lambda: Solver("checkmate", mipgap=1e-3), remat.RematArgumentError, "takes no option mipgap"),
    (lambda: Solver("checkmate", time_limit_s=-1), remat.RematArgumentError, "time_limit_s must be a positive number"),
    (lambda: CaptureOptions(fused_attention="some"), remat.RematArgumentError, "fused_attention must be"),
    (lambda: CaptureOptions(cost_model="wallclock"), remat.RematArgumentError, "unknown cost_model 'wallclock'"),
    (lambda: CaptureOptions(chunked_loss="sometimes"), remat.RematArgumentError, "chunked_loss must be"),
    (lambda: settle(3, None, {}, None), remat.RematArgumentTypeError, "solver must be a string"),
    (lambda: settle("checkmate", None, {}, {"fused_attention": False}), remat.RematArgumentTypeError,
     "capture must be a remat.CaptureOptions"),
])
def test_a_bad_group_is_refused_when_made(make, error, text):
    with pytest.raises(error, match=text):
        make()


def test_remat_plan_takes_the_groups(model_and_budget):
    model, inputs, budget = model_and_budget
    grouped = remat.plan(model, inputs, budget_bytes=budget, solver=remat.Solver("equal_spacing"),
                         capture=remat.CaptureOptions(fused_attention=False), quiet=True)
    flat = remat.plan(model, inputs, budget_bytes=budget, solver="equal_spacing", fused_attention=False, quiet=True)
    assert grouped.schedule == flat.schedule
    with pytest.raises(remat.RematArgumentError, match="cost_model='flops' only"):
        remat.plan(model, inputs, budget_bytes=budget, capture=remat.CaptureOptions(cost_model="measured"))


def test_the_loss_head_setting_reaches_the_plan_from_the_group(model_and_budget):
    model, inputs, budget = model_and_budget
    for chunked, head in ((True, "chunked"), (False, "unchunked")):
        grouped = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, quiet=True,
                                 solver="equal_spacing", capture=remat.CaptureOptions(chunked_loss=chunked))
        flat = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, quiet=True, solver="equal_spacing",
                              chunked_loss=chunked)
        assert grouped.plan.context["loss_head"] == flat.plan.context["loss_head"] == head
        assert grouped.plan.schedule == flat.plan.schedule
