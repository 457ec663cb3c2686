"""Mixed precision: a module planned under torch.autocast trains exactly as the model does under
eager autocast (bit for bit, dropout on), its plan is for the 16-bit activations, and a call under
another autocast state than the planned one is one clear error."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat import AutocastMismatchError
from remat.attention.router import route_attention
from remat.solver import get_solver
from tests.models import small_gpt

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


class MLP(nn.Module):
    """Linear layers (bf16 under autocast), GELU, dropout, cross-entropy (fp32 under autocast)."""

    def __init__(self, depth: int = 6, width: int = 128):
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.hidden = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.out = nn.Linear(width, 10)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, y):
        h = self.drop(F.gelu(self.inp(x)))
        for layer in self.hidden:
            h = self.drop(F.gelu(layer(h)))
        return F.cross_entropy(self.out(h), y)


def small_mlp():
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(512, 32, generator=g), torch.randint(0, 10, (512,), generator=g))


def _step(module, inputs, autocast: dict | None):
    """loss = module(*inputs) under `autocast` (None: none); loss.backward() outside it."""

    def step():
        if autocast is None:
            loss = module(*inputs)
        else:
            with torch.autocast(**autocast):
                loss = module(*inputs)
        loss.backward()
        return loss

    return step


def _loss_and_grads(module, params, inputs, autocast, seed=0):
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = _step(module, inputs, autocast)().detach()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return loss, grads


def _keep_all_peak(model, inputs):
    with torch.autocast(**BF16):
        keep = remat.optimize(model, budget_bytes=2**40, example_inputs=inputs, solver="keep_all")
    return remat.measure_peak(_step(keep, inputs, BF16), resident=[model, *inputs])


@pytest.mark.parametrize("which, solver", [("gpt", "equal_spacing"), ("mlp", "checkmate")])
def test_trains_under_autocast_bit_identical_to_eager_autocast(which, solver):
    model, inputs = small_gpt(dropout=0.1) if which == "gpt" else small_mlp()
    params = list(model.parameters())
    ref_loss, ref_grads = _loss_and_grads(model, params, inputs, BF16)
    keep_peak = _keep_all_peak(model, inputs)
    budget = int(0.7 * keep_peak)
    with torch.autocast(**BF16):
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, solver=solver, time_limit_s=5)
    assert opt.plan.extra_cost > 0  # the plan recomputes: the test runs a real rematerialization
    loss, grads = _loss_and_grads(opt, params, inputs, BF16)
    assert loss.dtype == ref_loss.dtype == torch.float32
    assert torch.equal(loss, ref_loss)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype and torch.equal(g, r), (g - r).abs().max()
    peak = remat.measure_peak(_step(opt, inputs, BF16), resident=[model, *inputs])
    for p in params:
        p.grad = None
    assert peak <= budget
    assert abs(peak / opt.plan.predicted_peak_bytes - 1) <= 0.05, (peak, opt.plan.predicted_peak_bytes)


class SDPADropout(nn.Module):
    """SDPA with dropout: on CPU it runs its math path in float32 inside a bfloat16 step, so its
    backward has float32 matmuls that autocast would cast, were the backward traced under it."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return y.float().pow(2).mean()


def test_backward_is_traced_without_autocast_as_eager_runs_it():
    """AOTAutograd traces the backward under the forward's autocast by default; eager autograd
    runs it (after loss.backward() outside the autocast block) without: SDPA-with-dropout's
    float32 backward matmuls were cast to bfloat16 (gradients off by up to 3e-2)."""
    torch.manual_seed(0)
    model, x = SDPADropout(), torch.randn(2, 16, 32)
    params = list(model.parameters())
    ref_loss, ref_grads = _loss_and_grads(model, params, (x,), BF16)
    with torch.autocast(**BF16):
        opt = remat.optimize(model, budget_bytes=2**40, example_inputs=(x,), solver="keep_all")
    loss, grads = _loss_and_grads(opt, params, (x,), BF16)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_backward_inside_the_autocast_block_is_a_clear_error():
    model, inputs = small_gpt(dropout=0.1)
    with torch.autocast(**BF16):
        opt = remat.optimize(model, budget_bytes=2**40, example_inputs=inputs, solver="keep_all")
        loss = opt(*inputs)
        with pytest.raises(AutocastMismatchError, match="Call loss.backward\\(\\) outside the autocast block"):
            loss.backward()


def test_plan_counts_bf16_activations():
    """The captured graph is the one autocast runs: the linear layers' outputs are 2 bytes an
    element, and the step's peak is lower than in float32."""
    model, inputs = small_mlp()
    fp32 = remat.capture(model, inputs)
    with torch.autocast(**BF16):
        bf16 = remat.capture(model, inputs)

    def addmm_bytes(graph):
        return [n.out_bytes for n in graph.nodes if n.op.startswith("aten.addmm") or n.op.startswith("addmm")]

    widths = [128] * 7 + [10]  # the linear layers' output widths, batch 512
    assert addmm_bytes(fp32) == [512 * w * 4 for w in widths]
    assert addmm_bytes(bf16) == [512 * w * 2 for w in widths]
    keep_all = get_solver("keep_all")
    assert keep_all(bf16, None).predicted_peak_bytes < keep_all(fp32, None).predicted_peak_bytes


def test_attention_stays_unfused_under_autocast_in_exact_mode():
    model, inputs = small_gpt(dropout=0.0)
    with route_attention(True, model) as router:  # float32: both blocks' attention is fused
        model(*inputs)
    assert router.routed == 2
    with torch.autocast(**BF16), route_attention(True, model) as router:
        model(*inputs)
    assert router.routed == 0 and len(router.passed) == 2
    assert all("autocast(cpu, torch.bfloat16) is on" in r for r in router.passed), router.passed
    with torch.autocast(**BF16), route_attention("all", model) as router:  # opted in: fused
        model(*inputs)
    assert router.routed == 2


def test_fused_attention_does_not_reproduce_eager_autocast():
    """Why "exact" leaves attention unfused under autocast: fused (mode "all"; no dropout, so the
    same function otherwise) the gradients leave the float32 tolerance of eager autocast, while the
    default module is bit-identical."""
    model, inputs = small_gpt(dropout=0.0)
    params = list(model.parameters())
    ref_loss, ref_grads = _loss_and_grads(model, params, inputs, BF16)
    results = {}
    for mode in (True, "all"):
        with torch.autocast(**BF16):
            opt = remat.optimize(model, budget_bytes=2**40, example_inputs=inputs, solver="keep_all",
                                 fused_attention=mode)
        loss, grads = _loss_and_grads(opt, params, inputs, BF16)
        results[mode] = [torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                         for a, b in zip([loss] + grads, [ref_loss] + ref_grads)]
    assert all(results[True])
    assert not all(results["all"])


def _close(got, ref, rtol=1e-5, atol=1e-6):
    for a, b in zip([got[0]] + got[1], [ref[0]] + ref[1]):
        assert torch.allclose(a, b, rtol=rtol, atol=atol)


def test_fp32_plan_called_under_autocast_is_planned_for_it():
    """A call under another autocast state was once refused (AutocastMismatchError); the graph has
    its casts built in, so it is now another kind of call, traced and planned under that autocast."""
    model, inputs = small_gpt(dropout=0.0)
    params = list(model.parameters())
    opt = remat.optimize(model, budget_bytes=2**40, example_inputs=inputs, solver="keep_all")
    _close(_loss_and_grads(opt, params, inputs, BF16), _loss_and_grads(model, params, inputs, BF16),
           rtol=2e-2, atol=2e-3)  # bfloat16: the fused attention rounds where eager's does not
    assert len(opt.plans) == 2 and "autocast" in opt.plan_log[-1].call
    # a backward under autocast after a forward without it: eager would cast the backward's ops
    loss = opt(*inputs)
    with pytest.raises(AutocastMismatchError, match="backward of a module planned under no autocast"), \
            torch.autocast(**BF16):
        loss.backward()
    # without autocast it still trains as the model (its attention fused: up to float32 rounding)
    _close(_loss_and_grads(opt, params, inputs, None), _loss_and_grads(model, params, inputs, None))
    assert len(opt.plans) == 2


def test_bf16_plan_called_without_or_under_other_autocast_is_planned_for_each():
    model, inputs = small_gpt(dropout=0.0)
    params = list(model.parameters())
    with torch.autocast(**BF16):
        opt = remat.optimize(model, budget_bytes=2**40, example_inputs=inputs, solver="keep_all")
    assert opt.plan.context["autocast"].startswith("torch.autocast('cpu', dtype=torch.bfloat16)")
    _close(_loss_and_grads(opt, params, inputs, None), _loss_and_grads(model, params, inputs, None))
    fp16 = dict(device_type="cpu", dtype=torch.float16)
    _close(_loss_and_grads(opt, params, inputs, fp16), _loss_and_grads(model, params, inputs, fp16),
           rtol=2e-2, atol=2e-3)
    assert len(opt.plans) == 3
    # no_grad runs the model itself: any autocast state is the model's business
    with torch.no_grad():
        assert torch.equal(opt(*inputs), model(*inputs))
