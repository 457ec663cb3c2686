"""A view that cannot run on the layout a real kernel gives its input (the fake kernel the trace ran
laid it out otherwise) reads a copy in the traced layout: graph_capture/traced_layout.py."""
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.graph_capture.clones import aliases_of
from remat.graph_capture.traced_layout import copy_into_traced_layouts, refuse_misfit_views
from remat.solver import keep_all


class DynamicMask(nn.Module):
    """Hugging Face Doge's pattern: softplus of a projection, transposed. On the CPU the real
    `softplus_backward` follows its gradient's transposed strides, its fake kernel is contiguous,
    and the linear's backward views that gradient: before, `remat.capture` raised TraceError."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.dt = nn.Linear(width, heads)
        self.A = nn.Parameter(torch.linspace(0.5, 1.5, heads))
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        d = torch.exp(self.A * F.softplus(self.dt(x))).transpose(-1, -2)  # (B, heads, S)
        h = torch.tanh(self.v(x)) * d.mean(1)[..., None]
        return self.out(h).square().mean()


class NormOnTransposed(nn.Module):
    """PatchTST's BatchNorm over (batch, channels, patches), transposed back before a linear: the
    real CPU kernel returns a contiguous output where its fake kernel says transposed, and the
    linear views it (before, TraceError naming the BatchNorm)."""

    def __init__(self):
        super().__init__()
        self.bn, self.lin = nn.BatchNorm1d(16), nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(self.bn(x.transpose(1, 2)).transpose(1, 2)).pow(2).mean()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_a_view_of_a_kernel_laid_out_otherwise_reads_a_copy_and_trains_as_eager():
    torch.manual_seed(0)
    model, x = DynamicMask(), torch.randn(4, 64, 16, requires_grad=True)
    eager = copy.deepcopy(model)
    ex = x.detach().clone().requires_grad_(True)
    loss = eager(ex)
    loss.backward()
    g = remat.capture(model, (x,))  # TraceError before
    clones = [v for v in g.nodes if v.op == "clone.default"]
    assert clones, "the view reads a copy in the traced layout"
    keep = keep_all.solve(g).predicted_peak_bytes
    floor = g.resident_bytes + sum(v.kept_bytes for v in g.nodes)
    opt = remat.optimize(model, budget_bytes=int(floor + 0.7 * (keep - floor)), example_inputs=(x,))
    assert opt.plan.extra_cost > 0  # it recomputes
    peak = remat.measure_peak(lambda: opt(x).backward(), resident=[model, x])
    assert peak == opt.plan.predicted_peak_bytes  # the copy counted where it is made
    for batch in (x, torch.randn(2, 32, 16, requires_grad=True)):  # the example and another shape
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        xb = batch.detach().clone().requires_grad_(True)
        xe = batch.detach().clone().requires_grad_(True)
        got = opt(xb)
        got.backward()
        want = eager(xe)
        want.backward()
        assert torch.equal(got, want)
        for a, b in zip(_grads(model), _grads(eager)):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
        assert torch.allclose(xb.grad, xe.grad, rtol=1e-6, atol=1e-7)


def test_a_copy_into_a_strided_traced_layout_is_made_with_empty_strided():
    """Where the traced layout is not contiguous, the copy is `empty_strided` in that layout and
    `copy` into it; the view and its own views read it (their fake values alias it)."""

    def f(a):
        t = a.transpose(0, 1)  # strides (1, 3): not contiguous
        return t.view(3, 2, 2).select(1, 0).sum()

    gm = fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.randn(4, 3))
    view = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default)
    assert not view.args[0].meta["val"].is_contiguous()
    refuse_misfit_views([])  # nothing left that fails: nothing to say
    with pytest.raises(remat.TraceError, match="is laid out with other strides by the real kernel"):
        refuse_misfit_views([(view, (3, 1))])  # one left: the planned step would fail
    assert copy_into_traced_layouts(gm, [view]) == 1
    made = view.args[0]
    assert made.target is torch.ops.aten.copy.default
    assert made.args[0].target is torch.ops.aten.empty_strided.default
    assert made.meta["val"].stride() == made.args[1].meta["val"].stride()
    assert aliases_of(made)[:2] == [view, next(iter(view.users))]  # both views alias the copy now
    a = torch.randn(4, 3)
    assert torch.equal(gm(a), f(a))


def test_a_batchnorm_laid_out_otherwise_before_a_view_trains_as_eager():
    torch.manual_seed(0)
    model, x = NormOnTransposed(), torch.randn(24, 4, 16)
    eager = copy.deepcopy(model)
    opt = remat.optimize(model, example_inputs=(x,), solver="keep_all", quiet=True)
    for _ in range(2):  # the running statistics move as eager's
        got, want = opt(x), eager(x)
        got.backward()
        want.backward()
        assert torch.equal(got, want)
        for a, b in zip(_grads(model), _grads(eager)):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
        assert torch.equal(model.bn.running_mean, eager.bn.running_mean)
        assert torch.equal(model.bn.running_var, eager.bn.running_var)
