"""The optimized module called the ways training loops call it, each against eager: inputs that
require grad (per-block use inside a bigger model), other batch shapes, a cache that stays bounded,
retain_graph and double backward, copies. Each test names the failure it reproduces (issue 23)."""
import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.solver import keep_all
from tests.models import small_gpt


def _grads(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def _zero(*modules):
    for m in modules:
        for p in m.parameters():
            p.grad = None


def _pair(dropout=0.1, layers=2):
    torch.manual_seed(0)
    model, inputs = small_gpt(dropout=dropout)
    if layers != 2:
        from remat.default_model import GPTConfig, default_inputs, default_model
        from tests.models import SMALL

        cfg = GPTConfig(**{**SMALL.__dict__, "dropout": dropout, "n_layer": layers})
        model, inputs = default_model(cfg), default_inputs(cfg)
    return model, copy.deepcopy(model), inputs


def _keep_all_peak(model, inputs):
    return keep_all.solve(remat.capture(model, inputs, quiet=True)).predicted_peak_bytes


def _step(module, inputs, seed=3):
    torch.manual_seed(seed)
    loss = module(*inputs)
    loss.backward()
    return loss.detach()


def _assert_same(model, ref, loss, ref_loss, rtol=1e-5, atol=1e-6):
    assert torch.allclose(loss, ref_loss, rtol=rtol, atol=atol)
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            assert torch.allclose(a.grad, b.grad, rtol=rtol, atol=atol), n


class Head(nn.Module):
    """A block whose input is an activation (a float tensor that may require grad)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, h, y):
        return F.cross_entropy(self.fc2(torch.tanh(self.fc1(h))), y)


def test_an_input_that_requires_grad_gets_its_gradient():
    """Optimized with an input that did not require grad, then called with one that does: x.grad
    stayed None (the traced graph had no gradient for it), silently."""
    torch.manual_seed(0)
    model, ref = Head(), None
    ref = copy.deepcopy(model)
    h, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt = remat.optimize(model, budget_bytes=2**30, example_inputs=(h, y), quiet=True)
    x = h.clone().requires_grad_()
    xr = h.clone().requires_grad_()
    _assert_same(model, ref, _step(opt, (x, y)), _step(ref, (xr, y)))
    assert x.grad is not None and torch.allclose(x.grad, xr.grad, rtol=1e-5, atol=1e-7)
    # and back: the first plan (no input gradient) serves again, from the cache
    _zero(model, ref)
    _assert_same(model, ref, _step(opt, (h, y)), _step(ref, (h, y)))
    assert len(opt.plans) == 2


def test_blocks_optimized_one_by_one_inside_a_bigger_model_train_as_eager():
    """`model.h[i] = remat.optimize(block, example_inputs=(h.detach(),))`: the gradient stopped at
    every block, the embeddings got none and every block but the last was off by 1e-3."""
    model, ref, inputs = _pair(dropout=0.1, layers=3)
    with torch.no_grad():
        h = model.drop(model.wte(inputs[0]) + model.wpe(torch.arange(inputs[0].shape[1])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.OutsideBudgetWarning)  # a block returns an activation
        for i in range(len(model.h)):
            model.h[i] = remat.optimize(model.h[i], budget_bytes=2**30, example_inputs=(h.detach(),), quiet=True)
    for seed in (1, 2):  # dropout everywhere: the same masks as eager, step after step
        _zero(model, ref)
        _assert_same(model, ref, _step(model, inputs, seed), _step(ref, inputs, seed))
    assert model.wte.weight.grad is not None and model.wte.weight.grad.abs().sum() > 0


def test_freezing_and_unfreezing_parameters_plans_each_pattern():
    """Fine-tuning schedules freeze layers mid-training: the step traced with every parameter
    requiring grad would compute (and the frozen parameter would receive) a gradient eager does
    not; each pattern is planned for, and the first comes back from the cache."""
    model, ref, inputs = _pair(dropout=0.0)
    opt = remat.optimize(model, budget_bytes=2**30, example_inputs=inputs, quiet=True, solver="keep_all")
    for frozen in (("wte.weight", "h.0.attn.c_attn.weight"), ()):
        for m in (model, ref):
            for n, p in m.named_parameters():
                p.requires_grad_(n not in frozen)
        _zero(model, ref)
        _assert_same(model, ref, _step(opt, inputs), _step(ref, inputs))
        assert all((p.grad is None) == (n in frozen) for n, p in model.named_parameters())
    assert len(opt.plans) == 2 and "2 parameters frozen" in opt.plan_log[1].call


def test_the_last_smaller_batch_and_a_shorter_sequence_train_under_the_budget():
    """Batch 3 after 4 and sequence 48 after 64 raised "call remat.optimize again"."""
    model, ref, inputs = _pair(dropout=0.1)
    budget = int(0.7 * _keep_all_peak(model, inputs))
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, quiet=True)
    idx, tgt = inputs
    for b, t in [(3, 64), (4, 48), (4, 64), (3, 64)]:
        call = (idx[:b, :t].contiguous(), tgt[:b, :t].contiguous())
        _zero(model, ref)
        _assert_same(model, ref, _step(opt, call), _step(ref, call))
        peak = remat.measure_peak(lambda: opt(*call).backward(), resident=[model, *call])
        _zero(model)
        assert peak <= budget and peak == opt.plan.predicted_peak_bytes, (b, t, peak, opt.plan.predicted_peak_bytes)
    assert len(opt.plans) == 3  # (4, 64) and (3, 64) came back from the cache
    assert [r.how for r in opt.plan_log][0] == "solved"
    for r in opt.plan_log:
        assert r.trace_s > 0 and r.plan_s >= 0 and r.predicted_peak_bytes <= budget


def test_a_shape_the_budget_cannot_hold_is_refused_naming_its_smallest_budget():
    model, _, inputs = _pair(dropout=0.0)
    small = (inputs[0][:1, :16].contiguous(), inputs[1][:1, :16].contiguous())
    budget = int(1.02 * _keep_all_peak(model, small))  # fits the small batch
    # equal_spacing: its smallest feasible budget is found in milliseconds (checkmate's: tests/test_checkmate.py)
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=small, quiet=True, solver="equal_spacing")
    with pytest.raises(remat.InfeasibleBudgetError, match=r"inputs \(4, 64\) int64.*smallest budget") as e:
        opt.plan_for(*inputs)  # planned ahead: the largest shape of the run
    assert e.value.min_feasible_bytes > budget
    # a budget that holds the large shape too, planned ahead, then trained on without a trace
    opt = remat.optimize(model, budget_bytes=e.value.min_feasible_bytes, example_inputs=small, quiet=True,
                         solver="equal_spacing")
    plan = opt.plan_for(*inputs)
    assert plan.fits and len(opt.plans) == 2
    _step(opt, inputs)
    assert len(opt.plan_log) == 2


def test_the_cache_is_bounded_warns_once_and_keeps_the_plans():
    torch.manual_seed(0)
    model = Head()
    opt = remat.optimize(model, budget_bytes=2**30, example_inputs=(torch.randn(2, 16), torch.randint(0, 4, (2,))),
                         quiet=True, cache_limit=2)
    calls = [(torch.randn(b, 16), torch.randint(0, 4, (b,))) for b in (3, 4, 5)]
    with pytest.warns(remat.PlanCacheLimitWarning, match="cache_limit=2") as seen:
        for call in calls:
            _step(opt, call)
    assert len(seen) == 1 and len(opt._steps) == 2 and len(opt.plans) == 4
    solved = len(opt.plan_log)
    with warnings.catch_warnings():
        warnings.simplefilter("error", remat.PlanCacheLimitWarning)  # said once
        _step(opt, (torch.randn(2, 16), torch.randint(0, 4, (2,))))  # dropped: traced again, its plan kept
    assert opt.plan_log[-1].how == "saved plan" and len(opt.plan_log) == solved + 1


def test_a_non_tensor_argument_that_changes_is_planned_per_value_and_then_cached():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, scale: float, flag: bool = False):
            h = self.fc(x) * scale
            return (h.relu() if flag else h).pow(2).mean()

    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    opt = remat.optimize(model, budget_bytes=2**30, example_inputs=(x, 0.5), quiet=True)
    for scale, flag in [(2.0, False), (0.5, True), (2.0, False), (0.5, False)]:
        _zero(model, ref)
        _assert_same(model, ref, _step(opt, (x, scale, flag)), _step(ref, (x, scale, flag)))
    assert len(opt.plans) == 4  # (0.5), (2.0, False), (0.5, True), (0.5, False): each traced once


def test_a_python_number_that_changes_every_step_costs_a_trace_not_a_solve(monkeypatch):
    """A step counter or a loss scale passed as a Python float: every value is another graph (the
    number is built in), the same nodes at the same sizes, so the solved schedule serves again,
    with no solve of either loss head (chunked_loss="auto" weighed both on the first call)."""
    from remat import pipeline
    class Scaled(nn.Module):
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, idx, targets, scale: float):
            return self.gpt(idx, targets) * scale

    gpt, ref_gpt, inputs = _pair(dropout=0.1)
    model, ref = Scaled(gpt), Scaled(ref_gpt)
    budget = int(0.75 * _keep_all_peak(model, (*inputs, 1.0)))
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=(*inputs, 1.0), quiet=True)
    assert opt.plan.recomputed
    solvers = []  # the strategies run after the first call's plan
    real_get, real_solve = pipeline.get_solver, pipeline.solve
    monkeypatch.setattr(pipeline, "get_solver", lambda name: solvers.append(name) or real_get(name))
    monkeypatch.setattr(pipeline, "solve", lambda *a, **k: solvers.append(k.get("solver")) or real_solve(*a, **k))
    for scale in (0.5, 2.0):
        _zero(model, ref)
        _assert_same(model, ref, _step(opt, (*inputs, scale)), _step(ref, (*inputs, scale)))
    assert [r.how.split(" of ")[0] for r in opt.plan_log] == ["solved"] + ["reused the schedule"] * 2
    assert "checkmate" not in solvers, solvers


def test_retain_graph_after_an_ordinary_step_works_as_in_eager():
    """After one ordinary step, backward(retain_graph=True) raised torch's "compiled with non-empty
    donated buffers ... set torch._functorch.config.donated_buffer=False"."""
    model, ref, inputs = _pair(dropout=0.1)
    opt = remat.optimize(model, budget_bytes=2**30, example_inputs=inputs, quiet=True, solver="equal_spacing")
    assert opt.plan.recomputed  # the retained backward recomputes, twice
    _step(opt, inputs)
    _zero(model, ref)
    torch.manual_seed(5)
    loss = opt(*inputs)
    with pytest.warns(remat.RetainedGraphWarning, match="retain_graph"):
        loss.backward(retain_graph=True)
    (2 * loss).backward()  # a second loss through the same graph: gradients add up as in eager
    torch.manual_seed(5)
    ref_loss = ref(*inputs)
    ref_loss.backward(retain_graph=True)
    (2 * ref_loss).backward()
    _assert_same(model, ref, loss.detach(), ref_loss.detach())


def test_double_backward_is_refused_before_the_step_with_remats_own_error():
    torch.manual_seed(0)
    model = Head()
    h, y = torch.randn(8, 16, requires_grad=True), torch.randint(0, 4, (8,))
    opt = remat.optimize(model, budget_bytes=2**30, example_inputs=(h, y), quiet=True)
    loss = opt(h, y)
    with pytest.raises(remat.DoubleBackwardError, match="create_graph=True.*opt.module"):
        torch.autograd.grad(loss, h, create_graph=True)
    _zero(model)
    opt(h, y).backward()  # an ordinary step still runs
    assert all(p.grad is not None for p in model.parameters())


def _copies(opt):
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return {"deepcopy": copy.deepcopy(opt), "pickle": pickle.loads(pickle.dumps(opt)),
            "torch.save": torch.load(buf, weights_only=False)}


def test_copies_train_their_own_parameters_with_the_same_plan():
    """copy.deepcopy(opt) raised "cannot pickle '_thread.lock' object" and torch.save(opt)
    "Can't pickle local object 'guard_autocast.<locals>.guarded'"."""
    model, ref, inputs = _pair(dropout=0.1)
    opt = remat.optimize(model, budget_bytes=2**30, example_inputs=inputs, quiet=True, solver="equal_spacing")
    assert opt.plan.recomputed  # a plan that recomputes, copied with the module
    _step(opt, inputs)
    for how, twin in _copies(opt).items():
        assert twin.module is not model
        own = list(twin.module.parameters())
        assert all(a is not b and torch.equal(a, b) for a, b in zip(own, model.parameters()))
        _zero(twin, ref, model)
        _assert_same(twin.module, ref, _step(twin, inputs), _step(ref, inputs))
        assert all(p.grad is None for p in model.parameters()), how  # the original is untouched
        assert twin.plan.schedule == opt.plan.schedule, how
        assert twin.plan_log[-1].how == "saved plan", how  # traced again, not solved


def test_the_module_presents_the_models_forward_signature():
    import inspect

    model, _, inputs = _pair(dropout=0.0)
    opt = remat.optimize(model, budget_bytes=2**30, example_inputs=inputs, quiet=True, solver="keep_all")
    assert list(inspect.signature(opt.forward).parameters) == ["idx", "targets"]
    with pytest.raises(TypeError, match="targets"):
        opt(inputs[0])


def test_a_step_counted_under_flop_counter_mode_trains_as_eager_and_counts_the_recomputations():
    """A training loop measuring its FLOPs wraps the step in FlopCounterMode: its ModuleTracker's
    global forward hooks fired on the step's own graph modules and failed ("Expected gradient
    function to be set"). The step now runs as eager's, and the count includes the plan's
    recomputations (the plan's extra FLOPs over keep_all's step)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, ref, inputs = _pair(dropout=0.0)
    keep = keep_all.solve(remat.capture(model, inputs, fused_attention=False, quiet=True)).predicted_peak_bytes
    # the model's own attention and loss head: the fused ones count their own FLOPs (the flash
    # backward computes the scores again; the chunked head adds a logits matmul)
    opt = remat.optimize(model, budget_bytes=int(0.75 * keep), example_inputs=inputs, quiet=True,
                         fused_attention=False, chunked_loss=False)
    assert opt.plan.extra_flops > 0
    with FlopCounterMode(display=False) as counted:
        loss = _step(opt, inputs)
    with FlopCounterMode(display=False) as eager:
        ref_loss = _step(ref, inputs)
    _assert_same(model, ref, loss, ref_loss)
    assert counted.get_total_flops() == eager.get_total_flops() + opt.plan.extra_flops
