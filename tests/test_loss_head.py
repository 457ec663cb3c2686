"""The chunked loss head (remat/loss_head/): the op against eager's linear + cross-entropy, the
router (what it routes, what it leaves alone and why), and the planner's choice of head.

Tolerances, and why: the op computes each row's logits and log-softmax with eager's kernels, and
dW/db of each vocabulary block in one reduction over the rows, as eager's linear backward does. What
changes order is (a) the loss's sums over the rows (per chunk, then over chunks) and (b) dh's sum over
the vocabulary (per block in float32, then over blocks), which eager does inside one matmul. In
float32 these are rounding-order differences of a few ulps of the terms summed, so their bound scales
with the gradient's magnitude, not each element's (an element that nearly cancels keeps the absolute
error of its terms): rtol 1e-5 and atol 1e-6 (the repository's float32 tolerance) times the tensor's
largest magnitude where that exceeds 1 (reduction "sum" makes gradients grow with the rows). With 16-bit logits (bf16 under autocast) the float32 sums are rounded once to
bf16 at the end, as eager rounds its matmul's float32 accumulator: where the two float32 sums differ
in their last bits, the rounded values can differ by one bf16 step: rtol = finfo(bfloat16).eps = 2**-7
(one step, relative to the smaller end of a binade), atol as in float32; the loss itself stays
float32 (rtol 1e-5).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.report import extra_cost_frac
from remat.core.plan import PlanMismatchError
from remat.loss_head.op import chunk_rows_for, chunked_linear_cross_entropy
from remat.loss_head.router import route_loss_head
from remat.head_choice import has_chunked_head

pytestmark = pytest.mark.filterwarnings("ignore:.*not a single loss:UserWarning")

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=torch.finfo(torch.bfloat16).eps, atol=1e-6)


def _close(got, ref, tol):
    """Each pair within `tol`, its atol scaled by the reference's largest magnitude (module doc)."""
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * scale)


# ---- the op ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("autocast", [False, True])
def test_op_matches_eager_on_random_shapes(seed, autocast):
    g = torch.Generator().manual_seed(seed)
    n, d, v = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((1, 70), (1, 40), (2, 300)))
    bias, eps = bool(seed % 2), (0.0, 0.1, 0.3)[seed % 3]
    reduction = ("mean", "sum")[(seed // 2) % 2]
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = torch.randn(v, d, generator=g).requires_grad_()
    b = torch.randn(v, generator=g).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.3] = -100
    t[0] = min(v - 1, 3)  # at least one row counted
    inputs = [h, w] + ([b] if bias else [])
    dt = torch.bfloat16 if autocast else torch.float32

    def eager():
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return F.cross_entropy(F.linear(h, w, b).float(), t, ignore_index=-100, label_smoothing=eps,
                                   reduction=reduction)

    def chunked():
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            rows = int(torch.randint(1, n + 1, (), generator=g))  # any chunking computes the same
            return chunked_linear_cross_entropy(h, w, b, t, -100, eps, reduction, compute_dtype=dt, chunk_rows=rows)

    ref = eager()
    got = chunked()
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got, ref, **FP32)
    _close(torch.autograd.grad(got, inputs), torch.autograd.grad(ref, inputs), BF16 if autocast else FP32)


def test_op_traces_on_fake_and_meta_tensors():
    h = torch.empty(10, 8, device="meta", requires_grad=True)
    w = torch.empty(50, 8, device="meta", requires_grad=True)
    t = torch.zeros(10, dtype=torch.long, device="meta")
    loss = chunked_linear_cross_entropy(h, w, None, t)
    assert loss.shape == () and loss.device.type == "meta"
    dh, dw = torch.autograd.grad(loss, [h, w])
    assert dh.shape == h.shape and dw.shape == w.shape
    assert chunk_rows_for(4096, 2048, 128256) * 128256 <= 4096 * 2048  # a chunk's logits <= the hidden states
    # whole GEMM tiles of rows where the rule gives more than one tile: 261 -> 256
    assert chunk_rows_for(16384, 2048, 128256) == 256 and chunk_rows_for(4096, 2048, 128256) == 65


def test_op_under_torch_compile():
    torch.manual_seed(0)
    h, w = torch.randn(12, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True)
    t = torch.randint(0, 40, (12,))
    f = torch.compile(lambda h, w: chunked_linear_cross_entropy(h, w, None, t), backend="aot_eager", fullgraph=True)
    got = f(h, w)
    ref = F.cross_entropy(F.linear(h, w), t)
    torch.testing.assert_close(got, ref, **FP32)
    _close(torch.autograd.grad(got, [h, w]), torch.autograd.grad(ref, [h, w]), FP32)


# ---- the router ------------------------------------------------------------------------------
def _routed(fn):
    """fn() run eagerly and under the router: (value, routed count, reasons) with the router."""
    with route_loss_head(True) as r:
        out = fn()
    return out, r.routed, r.passed


def _head():
    torch.manual_seed(0)
    return nn.Linear(8, 30), torch.randn(2, 5, 8), torch.randint(0, 30, (2, 5))


def test_router_takes_the_hugging_face_spelling():
    lin, x, labels = _head()

    def hf():
        logits = lin(x[:, slice(0, None), :]).float()
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        return F.cross_entropy(logits.view(-1, 30), shift.view(-1), ignore_index=-100)

    out, routed, _ = _routed(hf)
    assert routed == 1
    torch.testing.assert_close(out, hf(), **FP32)


def test_router_takes_shifted_logits_and_log_softmax_nll():
    lin, x, labels = _head()

    def shifted():
        logits = lin(x)[:, :-1, :].contiguous()
        return F.nll_loss(F.log_softmax(logits.reshape(-1, 30), dim=-1), labels[:, 1:].reshape(-1), reduction="sum")

    out, routed, _ = _routed(shifted)
    assert routed == 1
    torch.testing.assert_close(out, shifted(), **FP32)


@pytest.mark.parametrize("case", ["inplace_logits", "inplace_hidden", "class_weights", "reduction_none",
                                  "3d_input", "bf16_without_autocast", "softcap", "lossy_cast"])
def test_router_leaves_alone_what_it_cannot_prove(case):
    lin, x, labels = _head()
    t = labels.view(-1)

    def fn():
        h = x * 1.0
        logits = lin(h)
        if case == "inplace_logits":
            logits.div_(2.0)
        if case == "inplace_hidden":
            h.mul_(2.0)
        if case == "class_weights":
            return F.cross_entropy(logits.view(-1, 30), t, weight=torch.ones(30))
        if case == "reduction_none":
            return F.cross_entropy(logits.view(-1, 30), t, reduction="none").sum()
        if case == "3d_input":
            return F.cross_entropy(logits, labels[:, :1].expand(2, 30) % 5)  # classes on dim 1: not the head's
        if case == "bf16_without_autocast":
            return F.cross_entropy(logits.view(-1, 30).bfloat16(), t).float()
        if case == "lossy_cast":  # through 16 bits and back: not the linear's values
            return F.cross_entropy(logits.view(-1, 30).half().float(), t)
        if case == "softcap":
            return F.cross_entropy(30 * torch.tanh(logits.view(-1, 30) / 30), t)
        return F.cross_entropy(logits.view(-1, 30), t)

    out, routed, passed = _routed(fn)
    assert routed == 0
    assert out.equal(fn())  # the model's own code ran
    if case not in ("softcap", "bf16_without_autocast", "lossy_cast"):  # no longer the head's logits
        assert passed, "the reason is recorded"


def test_logits_read_elsewhere_keep_their_eager_values():
    lin, x, labels = _head()
    params = list(lin.parameters())

    def fn():
        logits = lin(x)
        loss = F.cross_entropy(logits.view(-1, 30), labels.view(-1))
        return loss + logits.square().mean()  # the logits read after the loss: the linear stays

    out, routed, _ = _routed(fn)
    ref = fn()
    assert routed == 1
    torch.testing.assert_close(out, ref, **FP32)
    with route_loss_head(True):
        got = torch.autograd.grad(fn(), params)
    _close(got, torch.autograd.grad(fn(), params), FP32)


# ---- models, traced and planned ------------------------------------------------------------------
class LM(nn.Module):
    """A tiny language model with the head spelled as `spelling` says."""

    def __init__(self, v=300, d=16, tied=False, bias=False, spelling="linear", eps=0.0, reduction="mean"):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.mix = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(d, v, bias=bias)
        if tied:
            self.head.weight = self.emb.weight
        self.v, self.spelling, self.eps, self.reduction = v, spelling, eps, reduction

    def hidden(self, ids):
        return torch.tanh(self.drop(self.mix(self.emb(ids))))

    def forward(self, ids, labels, extra=None):
        h = self.hidden(ids)
        if extra is not None:
            h = h + extra
        if self.spelling == "matmul":
            logits = h @ self.head.weight.T
        else:
            logits = self.head(h)
        if self.spelling == "hf":
            logits = logits.float()
            labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        return F.cross_entropy(logits.view(-1, self.v), labels.reshape(-1), ignore_index=-100,
                               label_smoothing=self.eps, reduction=self.reduction)


def _batch(v, b=3, t=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, (b, t), generator=g)
    labels = ids.clone()
    labels[1, -2:] = -100
    return ids, labels


def _loss_grads(module, params, args, seed=0, autocast=False):
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = module(*args)
    loss.backward()
    out = [loss.detach()] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


@pytest.mark.parametrize("tied,bias,spelling,eps,reduction,autocast", [
    (False, False, "linear", 0.0, "mean", False),
    (True, False, "hf", 0.1, "mean", False),
    (False, True, "hf", 0.0, "sum", False),
    (True, False, "matmul", 0.2, "sum", False),
    (False, True, "linear", 0.1, "mean", True),
    (True, False, "hf", 0.0, "mean", True),
])
def test_optimized_models_match_eager(tied, bias, spelling, eps, reduction, autocast):
    model = LM(tied=tied, bias=bias, spelling=spelling, eps=eps, reduction=reduction)
    params = list(model.parameters())
    args = _batch(model.v)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        opt = remat.optimize(model, example_inputs=args, solver="keep_all", chunked_loss="on", quiet=True)
    assert opt.plan.details["loss_head"] == "chunked" and has_chunked_head(opt.plan.graph)
    got, ref = _loss_grads(opt, params, args, autocast=autocast), _loss_grads(model, params, args, autocast=autocast)
    torch.testing.assert_close(got[0], ref[0], **FP32)
    _close(got[1:], ref[1:], BF16 if autocast else FP32)


def test_every_call_pattern_of_a_training_loop():
    model = LM(spelling="hf", tied=True)
    params = list(model.parameters())
    args = _batch(model.v)
    opt = remat.optimize(model, example_inputs=args, solver="keep_all", chunked_loss="on", quiet=True)
    # another batch shape
    other = _batch(model.v, b=2, t=11, seed=5)
    _close(_loss_grads(opt, params, other), _loss_grads(model, params, other), FP32)
    # an input that requires grad
    extra = torch.randn(3, 7, 16, requires_grad=True)
    got = _loss_grads(opt, params + [extra], (*args, extra))
    ref = _loss_grads(model, params + [extra], (*args, extra))
    _close(got, ref, FP32)
    # eval mode
    model.eval()
    _close(_loss_grads(opt, params, args), _loss_grads(model, params, args), FP32)
    model.train()
    assert len(opt.plans) == 4 and all(p.details["loss_head"] == "chunked" for p in opt.plans)


def test_auto_chunks_only_where_it_pays():
    model = LM(v=2000, d=16, spelling="hf")
    args = _batch(model.v, b=4, t=16)
    params = list(model.parameters())
    graph = remat.capture(model, args)
    keep = remat.solve(graph, None, solver="keep_all").predicted_peak_bytes
    roomy = remat.optimize(model, budget_bytes=keep, example_inputs=args, quiet=True)
    assert roomy.plan.details["loss_head"] == "unchunked"  # keep_all fits: nothing to gain
    tight = remat.optimize(model, budget_bytes=int(0.4 * keep), example_inputs=args, quiet=True)
    assert tight.plan.details["loss_head"] == "chunked"
    assert tight.plan.predicted_peak_bytes <= 0.4 * keep
    # reports count what the chunked head itself adds to the model's step (in the cost model: more
    # FLOPs, less memory traffic) beside the recomputations, against the model's own step
    added = remat.capture(model, args, chunked_loss=True).total_cost - graph.total_cost
    assert added != 0 and tight.plan.details["loss_head_cost"] == pytest.approx(added)
    assert extra_cost_frac(tight.plan, tight.graph) == pytest.approx((tight.plan.extra_cost + added) / graph.total_cost)
    _close(_loss_grads(tight, params, args), _loss_grads(model, params, args), FP32)
    measured = remat.measure_peak(lambda: tight(*args).backward(), resident=[model, *args])
    assert measured == tight.plan.predicted_peak_bytes  # the simulator is exact on the CPU, the op included


def test_saved_plan_deploys_its_head(tmp_path):
    model = LM(spelling="hf")
    args = _batch(model.v)
    opt = remat.optimize(model, example_inputs=args, solver="keep_all", chunked_loss="on", quiet=True)
    path = tmp_path / "plan.json"
    opt.plan.save(path)
    assert remat.load_plan(path).context["loss_head"] == "chunked"
    with pytest.raises(PlanMismatchError, match="loss head"):
        remat.optimize(model, example_inputs=args, plan=path, chunked_loss="off")
    again = remat.optimize(model, example_inputs=args, plan=path, quiet=True)  # "auto": the plan's head
    assert again.plan.details["loss_head"] == "chunked"
    params = list(model.parameters())
    _close(_loss_grads(again, params, args), _loss_grads(model, params, args), FP32)


def test_bad_chunked_loss_values_are_refused():
    model = LM()
    args = _batch(model.v)
    with pytest.raises(remat.RematError, match="chunked_loss"):
        remat.optimize(model, budget_gb=1.0, example_inputs=args, chunked_loss="yes")
    with pytest.raises(remat.RematError, match="chunked_loss"):
        remat.capture(model, args, chunked_loss="auto")


# ---- Hugging Face causal LMs with labels= ------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_hugging_face_takes_the_chunked_head_where_it_pays(name):
    pytest.importorskip("transformers")
    from tests.hf_models import hf_batch, hf_model

    vocab = 2048
    model = hf_model(name, dropout=0.1, width=32, layers=1, vocab=vocab)
    batch = hf_batch(name, vocab=vocab)  # rows padded, labels -100 there
    params = [p for p in model.parameters() if p.requires_grad]
    graph = remat.capture(model, (), batch)
    keep = remat.solve(graph, None, solver="keep_all").predicted_peak_bytes
    budget = int(0.75 * keep)
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=(), example_kwargs=batch, quiet=True)
    assert opt.plan.details["loss_head"] == "chunked"
    assert opt.plan.predicted_peak_bytes <= budget

    def run(module):
        for p in params:
            p.grad = None
        torch.manual_seed(0)
        out = module(**batch)
        out.loss.backward()
        return [out.loss.detach()] + [p.grad.clone() for p in params], out.logits.detach()

    (got, logits), (ref, ref_logits) = run(opt), run(model)
    _close(got, ref, FP32)
    assert torch.equal(logits, ref_logits)  # the returned logits are the model's linear's, as in eager


def test_a_plan_made_on_fake_tensors_deploys_its_head_on_the_real_model():
    """remat.plan (meta model, "auto") chooses the chunked head where it pays; the real model of the
    same shapes deploys that plan on the same graph (fingerprint) and trains as eager."""
    model = LM(v=2000, d=16, spelling="hf")
    args = _batch(model.v, b=4, t=16)
    with torch.device("meta"):
        meta = LM(v=2000, d=16, spelling="hf")
    meta_args = tuple(a.to("meta") for a in args)
    keep = remat.solve(remat.capture(model, args, quiet=True), None, solver="keep_all").predicted_peak_bytes
    plan = remat.plan(meta, meta_args, budget_bytes=int(0.4 * keep), quiet=True)
    assert plan.details["loss_head"] == "chunked" and plan.details["loss_head_flops"] > 0
    opt = remat.optimize(model, example_inputs=args, plan=plan, quiet=True)
    assert opt.plan.details["loss_head"] == "chunked"
    params = list(model.parameters())
    _close(_loss_grads(opt, params, args), _loss_grads(model, params, args), FP32)


def test_the_op_refuses_what_it_does_not_take():
    from remat.loss_head.op import ChunkedLossError

    h, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ChunkedLossError, match="weight"):
        chunked_linear_cross_entropy(h, torch.randn(5, 3), None, t)
    with pytest.raises(ChunkedLossError, match="reduction"):
        chunked_linear_cross_entropy(h, w, None, t, reduction="none")
    with pytest.raises(ChunkedLossError, match="target"):
        chunked_linear_cross_entropy(h, w, None, t.int())


class Wide(nn.Module):
    """Six wide tanh layers (big activations) under a linear head of `classes` classes and a
    cross-entropy."""

    def __init__(self, classes: int, width: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64 if i == 0 else width, width) for i in range(6))
        self.head = nn.Linear(width, classes)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.cross_entropy(self.head(x), y)


def test_auto_traces_once_where_the_head_is_too_small_to_matter(monkeypatch):
    """A plan that recomputes but whose log-softmax is under HEAD_SHARE of the budget: no second trace."""
    import remat.pipeline as pipeline

    torch.manual_seed(0)
    model, args = Wide(3), (torch.randn(256, 64), torch.randint(0, 3, (256,)))
    keep = remat.solve(remat.capture(model, args, quiet=True), None, solver="keep_all").predicted_peak_bytes
    heads = []
    real = pipeline.planned_step
    monkeypatch.setattr(pipeline, "planned_step", lambda *a, chunked=False, **k: heads.append(chunked) or real(
        *a, chunked=chunked, **k))
    opt = remat.optimize(model, budget_bytes=int(0.8 * keep), example_inputs=args, quiet=True)
    assert opt.plan.extra_cost > 0 and heads == [False] and opt.plan.details["loss_head"] == "unchunked"


def _heads_traced_and_solved(monkeypatch, model, args, budget):
    """remat.optimize under `budget`, recording each trace's head (chunked or not) and whether each
    graph solved has the chunked head."""
    import remat.pipeline as pipeline

    heads, solved = [], []
    real_step, real_get = pipeline.planned_step, pipeline.get_solver
    monkeypatch.setattr(pipeline, "planned_step", lambda *a, chunked=False, **k: heads.append(chunked) or real_step(
        *a, chunked=chunked, **k))
    monkeypatch.setattr(pipeline, "get_solver", lambda name: lambda graph, *a, **k: solved.append(
        has_chunked_head(graph)) or real_get(name)(graph, *a, **k))
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=args, quiet=True)
    monkeypatch.undo()
    return opt, heads, solved


def test_the_chunked_head_is_not_solved_where_its_rows_bound_says_it_cannot_cost_less(monkeypatch):
    """Where the model's head has a plan that fits, the chunked head's graph is traced but solved
    only if the rows' bound on its recomputations leaves it room to cost less in all; here it does
    not (a 64-class head over wide layers), and solving it in full confirms it would have lost."""
    torch.manual_seed(0)
    model, args = Wide(64), (torch.randn(256, 64), torch.randint(0, 64, (256,)))
    keep = remat.solve(remat.capture(model, args, quiet=True), None, solver="keep_all").predicted_peak_bytes
    budget = int(0.8 * keep)
    opt, heads, solved = _heads_traced_and_solved(monkeypatch, model, args, budget)
    assert heads == [False, True] and solved == [False] and opt.plan.details["loss_head"] == "unchunked"
    chunked = remat.capture(model, args, chunked_loss=True, quiet=True)
    assert has_chunked_head(chunked)
    full = remat.solve(chunked, budget, quiet=True)
    assert full.fits and chunked.total_cost + full.extra_cost >= opt.plan.total_cost


@pytest.mark.parametrize("classes, head", [(64, "unchunked"), (512, "chunked")])
def test_at_the_smallest_budget_found_both_heads_are_solved_at_once(classes, head, monkeypatch):
    """At the smallest budget found for the model's head's graph (as a refusal names it), the
    chunked head is traced before either head is solved, the two graphs are solved at once inside
    that trace, and the head whose plan fits with the lower total cost is lowered with that plan,
    the chunked head in that very trace, the model's head on a trace of its own: the plan each
    graph gets solved alone, the cheaper (64 classes over wide layers: the chunked
    head does not fit there, its peak's floor is over the budget, so it is refused unsolved; 512:
    it costs less), with eager's gradients."""
    import remat.pipeline as pipeline
    from remat.solving import smallest_feasible

    torch.manual_seed(0)
    model, args = Wide(classes), (torch.randn(256, 64), torch.randint(0, classes, (256,)))
    plain = remat.capture(model, args, quiet=True)
    chunked = remat.capture(model, args, chunked_loss=True, quiet=True)
    assert has_chunked_head(chunked)
    budget = smallest_feasible(plain, "checkmate")  # found (cached for the graph), as a refusal names it
    alone = {}
    for c, g in ((False, plain), (True, chunked)):
        try:
            alone[c] = remat.solve(g, budget, quiet=True)
        except remat.InfeasibleBudgetError:
            pass
    at_once, real = [], pipeline.at_once
    monkeypatch.setattr(pipeline, "at_once", lambda calls, *a, **k: at_once.append(sorted(calls)) or real(calls, *a, **k))
    opt, heads, solved = _heads_traced_and_solved(monkeypatch, model, args, budget)
    want = min(alone, key=lambda c: (alone[c].total_cost, c))
    assert at_once == [[False, True]] and heads == [False, True] + ([] if want else [False])
    assert sorted(solved) == sorted(alone)
    assert opt.plan.details["loss_head"] == head == ("chunked" if want else "unchunked")
    assert opt.plan.schedule == alone[want].schedule and opt.plan.predicted_peak_bytes <= budget
    params = list(model.parameters())
    _close(_loss_grads(opt, params, args), _loss_grads(model, params, args), FP32)


@pytest.mark.parametrize("classes, head", [(64, "unchunked"), (512, "chunked")])
def test_asked_again_at_that_budget_only_the_cheaper_head_is_traced(classes, head, monkeypatch):
    """remat.optimize asked again for the same call at the smallest budget found for the model's
    head (as after a refusal) weighs both heads on the graphs the last planning traced
    (remat/trace_memo.py), then traces only the cheaper head to lower it: the same plan as with
    nothing remembered, eager's gradients."""
    from remat import trace_memo
    from remat.solving import smallest_feasible

    torch.manual_seed(0)
    model, args = Wide(classes), (torch.randn(256, 64), torch.randint(0, classes, (256,)))
    budget = smallest_feasible(remat.capture(model, args, quiet=True), "checkmate")
    trace_memo.clear()
    first, heads, _ = _heads_traced_and_solved(monkeypatch, model, args, budget)  # remembers both heads
    assert heads[:2] == [False, True]
    again, heads, solved = _heads_traced_and_solved(monkeypatch, model, args, budget)
    want = head == "chunked"
    assert heads == [want] and sorted(solved) == sorted(set(solved)) and again.plan.details["loss_head"] == head
    assert again.plan.schedule == first.plan.schedule and again.plan.total_cost == first.plan.total_cost
    assert again.plan.predicted_peak_bytes <= budget
    params = list(model.parameters())
    _close(_loss_grads(again, params, args), _loss_grads(model, params, args), FP32)


class Switched(Wide):
    """Wide with one more tanh where the module-level switch says so: a change of what the model
    traces to that no call key sees (as an edited forward)."""

    deeper = False

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if Switched.deeper:
            x = torch.tanh(x)
        return F.cross_entropy(self.head(x), y)


def test_a_remembered_graph_the_model_no_longer_traces_to_plans_nothing(monkeypatch):
    """Where the model's step traces to another graph than the one remembered for its call (its
    code changed between two remat.optimize calls, which no call key sees), the plan solved on the
    remembered graph is not used: the call is traced again and planned as with nothing remembered."""
    from remat import trace_memo
    from remat.solving import smallest_feasible

    torch.manual_seed(0)
    model, args = Switched(64), (torch.randn(256, 64), torch.randint(0, 64, (256,)))
    old = remat.capture(model, args, quiet=True)
    budget = smallest_feasible(old, "checkmate")
    trace_memo.clear()
    _heads_traced_and_solved(monkeypatch, model, args, budget)  # remembers both heads' graphs
    Switched.deeper = True
    try:
        fresh = remat.capture(model, args, quiet=True)
        assert fresh != old and smallest_feasible(fresh, "checkmate") == budget
        opt, heads, _ = _heads_traced_and_solved(monkeypatch, model, args, budget)
        trace_memo.clear()
        alone, _, _ = _heads_traced_and_solved(monkeypatch, model, args, budget)
    finally:
        Switched.deeper = False
    # the model's head (the cheaper on the remembered graphs) traced, found other, then planned anew
    assert heads[0] is False and len(heads) >= 2
    assert opt.graph == fresh == alone.graph and opt.plan.schedule == alone.plan.schedule
    assert opt.plan.predicted_peak_bytes <= budget


class Softcapped(Wide):
    """Wide with its logits soft-capped (Gemma-2): a cross-entropy the chunked op cannot take."""

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.cross_entropy(30 * torch.tanh(self.head(x) / 30), y)


def test_a_head_whose_logits_no_linear_computed_is_not_traced_twice(monkeypatch):
    """Under "auto", a model whose cross-entropy reads logits no linear computed (soft-capped here,
    as Gemma-2's; DPT's upsampled convolution) has no head the router could take: the chunked head
    is neither traced nor solved (DPT at half its activation memory: ~3 s of trace)."""
    torch.manual_seed(0)
    model, args = Softcapped(512), (torch.randn(256, 64), torch.randint(0, 512, (256,)))
    keep = remat.solve(remat.capture(model, args, quiet=True), None, solver="keep_all").predicted_peak_bytes
    opt, heads, solved = _heads_traced_and_solved(monkeypatch, model, args, int(0.8 * keep))
    assert heads == [False] and solved == [False] and opt.plan.details["loss_head"] == "unchunked"
    assert opt.plan.extra_cost > 0
    assert not has_chunked_head(remat.capture(model, args, chunked_loss=True, quiet=True))  # the router takes none


class Weighted(Wide):
    """Wide with class weights in its cross-entropy: a linear's logits, but a loss the router leaves
    to the model (loss_head/router.py)."""

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.cross_entropy(self.head(x), y, weight=torch.linspace(0.5, 1.5, self.head.out_features))


def test_a_head_the_router_cannot_take_is_not_solved_twice(monkeypatch):
    """Under "auto", where the model's graph has a linear's log-softmax but the router takes no head
    (class weights), the chunked head's trace is the model's own step again: it is not solved a
    second time."""
    torch.manual_seed(0)
    model, args = Weighted(512), (torch.randn(256, 64), torch.randint(0, 512, (256,)))
    keep = remat.solve(remat.capture(model, args, quiet=True), None, solver="keep_all").predicted_peak_bytes
    opt, heads, solved = _heads_traced_and_solved(monkeypatch, model, args, int(0.9 * keep))
    assert heads == [False, True] and solved == [False] and opt.plan.details["loss_head"] == "unchunked"
    assert opt.plan.extra_cost > 0


def test_under_both_heads_smallest_budgets_each_head_is_traced_once_and_the_smaller_is_named(monkeypatch):
    """Under a budget neither head fits, `optimize` names the smaller of the two heads' smallest
    budgets (each head's lowest-peak search on the graph traced for it, not traced again), and
    that budget then plans."""
    import remat.pipeline as pipeline
    from remat.solving import smallest_feasible

    torch.manual_seed(0)
    model, args = Wide(512), (torch.randn(256, 64), torch.randint(0, 512, (256,)))
    plain = remat.capture(model, args, quiet=True)
    chunked = remat.capture(model, args, chunked_loss=True, quiet=True)
    assert has_chunked_head(chunked)
    want = min(smallest_feasible(plain, "checkmate"), smallest_feasible(chunked, "checkmate"))
    floor = plain.resident_bytes + sum(v.kept_bytes for v in plain.nodes)
    heads = []
    real_step = pipeline.planned_step
    monkeypatch.setattr(pipeline, "planned_step", lambda *a, chunked=False, **k: heads.append(chunked) or real_step(
        *a, chunked=chunked, **k))
    with pytest.raises(remat.InfeasibleBudgetError) as e:
        remat.optimize(model, budget_bytes=min(floor, want - 1), example_inputs=args, quiet=True)
    assert heads == [False, True] and e.value.min_feasible_bytes == want and f"{want} bytes" in str(e.value)
    # at that budget the model's head, whose smallest budget is over it, is not solved: only the
    # chunked head is
    solved = []
    real_get = pipeline.get_solver
    monkeypatch.setattr(pipeline, "get_solver", lambda name: lambda graph, *a, **k: solved.append(
        has_chunked_head(graph)) or real_get(name)(graph, *a, **k))
    assert smallest_feasible(plain, "checkmate") > want
    opt = remat.optimize(model, budget_bytes=want, example_inputs=args, quiet=True)
    assert opt.plan.predicted_peak_bytes <= want and solved == [True] and opt.plan.details["loss_head"] == "chunked"


def test_under_the_smallest_budget_a_head_too_small_to_lower_it_is_not_traced(monkeypatch):
    """Under a budget the model's head does not fit, a chunked head whose log-softmax is too small to
    lower the smallest budget (HEAD_BUFFERS times its bytes under SMALLEST_SHARE of the budget: a
    classifier's few labels) is neither traced nor searched: the model's head's smallest budget is
    named. With a vocabulary's head (the test above) both are."""
    import remat.pipeline as pipeline
    from remat.head_choice import HEAD_BUFFERS, SMALLEST_SHARE, routable_log_softmaxes
    from remat.solving import smallest_feasible

    torch.manual_seed(0)
    model, args = Wide(3, width=1024), (torch.randn(256, 64), torch.randint(0, 3, (256,)))
    plain = remat.capture(model, args, quiet=True)
    want = smallest_feasible(plain, "checkmate")
    floor = plain.resident_bytes + sum(v.kept_bytes for v in plain.nodes)
    budget = min(floor, want - 1)
    (log_softmax,) = routable_log_softmaxes(plain)
    assert HEAD_BUFFERS * log_softmax.out_bytes < SMALLEST_SHARE * budget
    heads = []
    real_step = pipeline.planned_step
    monkeypatch.setattr(pipeline, "planned_step", lambda *a, chunked=False, **k: heads.append(chunked) or real_step(
        *a, chunked=chunked, **k))
    with pytest.raises(remat.InfeasibleBudgetError) as e:
        remat.optimize(model, budget_bytes=budget, example_inputs=args, quiet=True)
    assert heads == [False] and e.value.min_feasible_bytes == want


def test_the_heads_smallest_budgets_are_searched_at_once_in_the_callers_context(monkeypatch):
    """smallest_feasible_of_each runs each graph's search in a thread of its own, at the same
    time (both wait for each other), in the caller's context (progress silenced there is silenced
    in them); its answers are smallest_feasible's; a search's error reaches the caller. With
    another HiGHS thread count than one, the searches run one after the other."""
    import threading
    from collections import OrderedDict

    import remat.solving as solving
    from remat.core import progress
    from remat.solver.checkmate import lowest_peak

    torch.manual_seed(0)
    model, args = Wide(512), (torch.randn(256, 64), torch.randint(0, 512, (256,)))
    graphs = {False: remat.capture(model, args, quiet=True), True: remat.capture(model, args, chunked_loss=True,
                                                                                   quiet=True)}
    alone = {c: solving.smallest_feasible(g, "checkmate") for c, g in graphs.items()}
    real, met, seen = solving.smallest_feasible, threading.Barrier(2, timeout=30), []

    def meeting(graph, *a, **k):
        met.wait()  # broken (an error) unless the other search is running too
        seen.append((threading.current_thread() is not threading.main_thread(), progress.is_quiet()))
        return real(graph, *a, **k)

    monkeypatch.setattr(solving, "smallest_feasible", meeting)
    monkeypatch.setattr(lowest_peak, "_LOWEST", OrderedDict())  # searched again, not read from the cache
    with progress.quiet(True):
        assert solving.smallest_feasible_of_each(graphs, "checkmate") == alone
    assert seen == [(True, True)] * 2

    def where(graph, *a, **k):
        seen.append(threading.current_thread() is threading.main_thread())
        return 0

    seen.clear()  # another HiGHS thread count than one: one after the other, here
    monkeypatch.setattr(solving, "smallest_feasible", where)
    assert solving.smallest_feasible_of_each(graphs, "checkmate", threads=2) == {False: 0, True: 0}
    assert seen == [True, True]

    def failing(graph, *a, **k):
        raise RuntimeError("no search")

    monkeypatch.setattr(solving, "smallest_feasible", failing)
    with pytest.raises(RuntimeError, match="no search"):
        solving.smallest_feasible_of_each(graphs, "checkmate")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dh_accumulation_on_cuda_equals_the_upcast_gemm():
    """The backward's dh, accumulated by a 16-bit GEMM adding float32 products in its epilogue,
    matches the float32 GEMM of the upcast operands."""
    from remat.loss_head.op import _add_dh_block

    g = torch.Generator(device="cuda").manual_seed(0)
    dh = torch.randn(300, 64, device="cuda", generator=g)
    dzc = torch.randn(300, 256, device="cuda", generator=g).to(torch.bfloat16)
    wb = torch.randn(256, 64, device="cuda", generator=g).to(torch.bfloat16)
    want = dh + dzc.float() @ wb.float()
    got = _add_dh_block(dh.clone(), dzc, wb)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_budget_under_the_smallest_found_for_the_same_graph_is_refused_without_solving(monkeypatch):
    """Where a head is tried at a budget (the other head may fit), a budget under the smallest one
    already found for an equal graph is refused at once: that is the smallest budget solve accepts
    (the lowest-peak search is cached per graph), so the solve is spared. Before that search ran,
    the head is solved."""
    import remat.pipeline as pipeline
    from remat.solver.checkmate.peak_rows import peak_floor
    from remat.solving import known_smallest_feasible, smallest_feasible

    torch.manual_seed(0)
    model, args = Wide(64), (torch.randn(256, 64), torch.randint(0, 64, (256,)))
    graph = remat.capture(model, args, quiet=True)
    again = remat.capture(model, args, quiet=True)  # traced again: an equal graph, another object
    assert again == graph and again is not graph
    planner = pipeline.StepPlanner(pipeline.PlanOptions(budget_bytes=None, quiet=True))
    solved = []
    real_get = pipeline.get_solver
    monkeypatch.setattr(pipeline, "get_solver", lambda name: lambda g, *a, **k: solved.append(1) or real_get(name)(
        g, *a, **k))
    assert known_smallest_feasible(graph, "checkmate") is None
    first = planner.choose(model, args, {}, known=None, others=[], budget=peak_floor(graph), smallest_on_failure=False)
    try:  # solved: nothing known yet (whether a plan fits at the floor is the solver's answer)
        first(graph)
    except remat.InfeasibleBudgetError:
        pass
    assert solved == [1]
    smallest = smallest_feasible(graph, "checkmate")
    assert known_smallest_feasible(again, "checkmate") == smallest and peak_floor(graph) < smallest
    choose = planner.choose(model, args, {}, known=None, others=[], budget=smallest - 1, smallest_on_failure=False)
    with pytest.raises(remat.InfeasibleBudgetError, match="smallest budget found"):
        choose(again)
    assert solved == [1]
    plan, _ = planner.choose(model, args, {}, known=None, others=[], budget=smallest, smallest_on_failure=False)(again)
    assert plan.fits and solved == [1, 1]
