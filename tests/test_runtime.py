"""The optimized module against the unmodified model: same loss and gradients (dropout on), real
peak close to the simulator's, extra FLOPs as planned, a drop-in for training code."""
import pytest
import torch

import remat
from remat.default_model import default_model
from remat.report import reference_step, run_strategy
from remat.runtime.module import OutsideBudgetWarning
from remat.core.plan import PlanMismatchError
from remat.core.plan import Plan
from tests.models import SMALL, ConvNet, DataDependent, KwargsNet, small_gpt


@pytest.fixture(scope="module")
def gpt():
    model, inputs = small_gpt()
    return model, inputs, reference_step(model, inputs, seed=0)


def test_keep_all_matches_eager_and_simulator(gpt):
    model, inputs, ref = gpt
    row = run_strategy(model, inputs, "keep_all", None, reference=ref)
    assert row.grads_match, row.max_grad_err
    assert row.extra_flops_measured == 0 == row.extra_flops_predicted
    assert abs(row.measured_over_predicted - 1) <= 0.05, row


@pytest.mark.parametrize("frac", [0.8, 0.7])
def test_equal_spacing_recomputes_exactly_as_planned(gpt, frac):
    model, inputs, ref = gpt
    keep = run_strategy(model, inputs, "keep_all", None).measured_peak_bytes
    row = run_strategy(model, inputs, "equal_spacing", int(frac * keep), reference=ref)
    assert row.grads_match, row.max_grad_err  # dropout masks are never redrawn
    assert row.measured_peak_bytes <= row.budget_bytes
    assert abs(row.measured_over_predicted - 1) <= 0.05, row
    assert row.extra_flops_predicted > 0
    assert row.extra_flops_measured == row.extra_flops_predicted


def test_drop_in_training():
    model, inputs = small_gpt()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)  # built before optimize()
    keys = list(model.state_dict())
    opt = remat.optimize(model, budget_bytes=2**40, example_inputs=inputs, solver="equal_spacing")
    assert list(opt.state_dict()) == keys
    assert {id(p) for p in opt.parameters()} == {id(p) for p in model.parameters()}
    before = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(3):
        optim.zero_grad(set_to_none=True)
        loss = opt(*inputs)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert losses[-1] < losses[0]
    # load_state_dict goes to the user's model under the same keys, in place (the optimizer's
    # parameters stay the ones trained), and the optimized module computes with the loaded values:
    # its loss and gradients are those of an eager model initialised with them
    other = default_model(SMALL, seed=7)
    assert not any(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    ids = [id(p) for p in model.parameters()]
    opt.load_state_dict({k: v.clone() for k, v in other.state_dict().items()})
    assert [id(p) for p in opt.parameters()] == ids
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())
    results = []
    for module in (opt, other):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)  # the same dropout masks
        loss = module(*inputs)
        loss.backward()
        params = model.parameters() if module is opt else other.parameters()
        results.append([loss.detach()] + [p.grad.clone() for p in params])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # eval mode and no_grad run the model as it is (tests/test_outputs_and_state.py: eval with grad)
    opt.eval()
    other.eval()
    with torch.no_grad():
        assert torch.equal(opt(*inputs), model(*inputs))
        assert torch.allclose(opt(*inputs), other(*inputs), rtol=1e-5, atol=1e-6)
    opt.train()


def test_kwargs_outputs_and_buffers_match_eager():
    torch.manual_seed(0)
    ref_model, model = KwargsNet(), KwargsNet()
    model.load_state_dict(ref_model.state_dict())
    x, t = torch.randn(16, 32), torch.randn(16, 32)
    with pytest.warns(OutsideBudgetWarning, match="dict with 2 tensors"):  # y is the caller's memory
        opt = remat.optimize(model, budget_bytes=2**40, example_inputs=(x,),
                             example_kwargs={"target": t, "scale": 0.5}, solver="equal_spacing")
    torch.manual_seed(3)
    out_ref = ref_model(x, target=t, scale=0.5)
    out_ref["loss"].backward()
    torch.manual_seed(3)
    out = opt(x, target=t, scale=0.5)
    out["loss"].backward()
    assert set(out) == {"loss", "y"}
    assert torch.allclose(out["y"], out_ref["y"], rtol=1e-5, atol=1e-6)
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), n
    # BatchNorm's running statistics were updated as in eager
    assert torch.allclose(ref_model.bn.running_mean, model.bn.running_mean)
    assert model.bn.num_batches_tracked.item() == 1
    torch.manual_seed(4)
    out = opt(x, target=t, scale=2.0)  # another constant: another graph, planned for it
    torch.manual_seed(4)
    assert torch.allclose(out["y"], ref_model(x, target=t, scale=2.0)["y"], rtol=1e-5, atol=1e-6)
    assert len(opt.plans) == 2


def test_other_shapes_and_argument_structures_are_planned(gpt):
    """Another shape and another argument structure were once refused ("call remat.optimize
    again"); each is now traced and planned at its first call, and runs the model's function."""
    model, inputs, _ = gpt
    opt = remat.optimize(model, budget_bytes=2**40, example_inputs=inputs, solver="keep_all")
    short = (inputs[0][:, :32].contiguous(), inputs[1][:, :32].contiguous())
    torch.manual_seed(0)
    loss = opt(*short)
    torch.manual_seed(0)
    assert torch.allclose(loss, model(*short), rtol=1e-5)
    assert len(opt.plans) == 2
    with pytest.raises(TypeError, match="targets"):  # the error the model's forward raises
        opt(inputs[0])


def test_bad_budgets_leave_the_model_untouched(gpt):
    model, inputs, _ = gpt
    for p in model.parameters():
        p.grad = None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="positive"):
        remat.optimize(model, budget_bytes=0, example_inputs=inputs)
    with pytest.raises(ValueError, match="positive"):
        remat.optimize(model, budget_gb=-1, example_inputs=inputs)
    with pytest.raises(remat.InfeasibleBudgetError) as e:
        remat.optimize(model, budget_bytes=1000, example_inputs=inputs, solver="equal_spacing")
    assert e.value.min_feasible_bytes > 1000 and f"{e.value.min_feasible_bytes} bytes" in str(e.value)
    with pytest.raises(remat.TraceError, match="h.sum"):
        remat.optimize(DataDependent(), budget_bytes=2**30, example_inputs=(torch.randn(2, 8),))
    with pytest.raises(remat.TraceError):  # example inputs that do not fit the model
        remat.optimize(model, budget_bytes=2**30, example_inputs=(inputs[0].float(),))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())


def test_saved_plan_deploys_without_solving(gpt, tmp_path):
    model, inputs, ref = gpt
    keep = run_strategy(model, inputs, "keep_all", None).measured_peak_bytes
    graph = remat.capture(model, inputs)
    plan = remat.solve(graph, int(0.75 * keep), solver="equal_spacing")
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    row = run_strategy(model, inputs, "equal_spacing", int(0.75 * keep), reference=ref, plan=loaded)
    assert row.grads_match and row.predicted_peak_bytes == plan.predicted_peak_bytes
    other, other_inputs = small_gpt(dropout=0.0)
    with pytest.raises(PlanMismatchError):
        remat.optimize(other, example_inputs=tuple(x[:, :32].contiguous() for x in other_inputs), plan=loaded)


def test_random_ops_run_once_and_rng_stream_matches_eager(gpt):
    """Dropout is never redrawn: a step draws exactly the masks eager draws, so the generator
    ends in the same state (a stray dropout in the backward once cost 5% extra memory)."""
    model, inputs, _ = gpt
    keep = run_strategy(model, inputs, "keep_all", None).measured_peak_bytes
    opt = remat.optimize(model, budget_bytes=int(0.7 * keep), example_inputs=inputs, solver="equal_spacing")
    assert opt.plan.extra_flops > 0
    states = []
    for module in (model, opt):
        torch.manual_seed(11)
        module(*inputs).backward()
        states.append(torch.get_rng_state())
        for p in model.parameters():
            p.grad = None
    assert torch.equal(states[0], states[1])


def test_conv_batchnorm_outputs_die_separately_and_predictions_hold():
    """BatchNorm returns its output and its saved statistics; the output dies long before the
    statistics, and the simulator must see that to predict the real peak."""
    torch.manual_seed(0)
    model = ConvNet()
    inputs = (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    ref = reference_step(model, inputs, seed=0)
    keep = run_strategy(model, inputs, "keep_all", None, reference=ref)
    assert keep.grads_match
    assert abs(keep.measured_over_predicted - 1) <= 0.05, keep
    graph = remat.capture(model, inputs)
    assert any(len(n.out_parts) > 1 for n in graph.nodes)
    row = run_strategy(model, inputs, "checkmate", int(0.75 * keep.measured_peak_bytes), reference=ref,
                       time_limit_s=10)
    assert row.grads_match and row.measured_peak_bytes <= row.budget_bytes
    assert abs(row.measured_over_predicted - 1) <= 0.05, row


def test_reference_flops_are_the_models_own_when_nothing_is_fused():
    """reference_step counts FLOPs on a keep_all module; where no attention is fused that must be
    exactly what the unmodified model runs."""
    from remat.measure import count_flops
    from remat.report import training_step

    model, inputs = small_gpt()  # explicit attention with dropout: the default "exact" fuses none
    eager = training_step(model, list(model.parameters()), inputs)
    eager.fresh()
    assert reference_step(model, inputs, seed=0)[2] == count_flops(eager) > 0
