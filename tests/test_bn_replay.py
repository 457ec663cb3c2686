"""BatchNorm's output recomputed (graph_capture/bn_replay.py): a recomputation is bit-identical to
the first computation with the same allocations, a plan that recomputes BatchNorm outputs trains
exactly as the unmodified model (loss, gradients, running statistics, over two steps) and peaks as
predicted to the byte, the statistics can never be paired with another computation, and eval mode,
BatchNorm without running statistics and non-CPU steps keep the graph as it was."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import remat
import remat.graph_capture.rewrites as rewrites
from remat.compat.torch_private import fake_tensor_mode
from remat.graph_capture.bn_replay import (BATCH_NORM_OP, BATCH_NORM_STATS_OP, BatchNormOrderError, batch_norm,
                                          batch_norm_stats, make_batch_norm_recomputable)
from remat.models import build_unet, unet_inputs
from remat.solver.checkmate import min_feasible_budget
from remat.core.plan import plan_from_schedule
from remat.solver.schedule import schedule_from_kept

aten = torch.ops.aten


@pytest.mark.parametrize("dtype, stats_dtype, channels_last, affine", [
    (torch.float32, torch.float32, False, True), (torch.float32, torch.float32, True, True),
    (torch.float32, torch.float32, False, False), (torch.bfloat16, torch.float32, False, True),
    (torch.bfloat16, torch.bfloat16, True, True), (torch.float64, torch.float64, False, True)])
def test_a_recomputation_is_the_first_computation_bit_for_bit_with_its_allocations(dtype, stats_dtype,
                                                                                    channels_last, affine):
    c = 12
    x = torch.randn(4, c, 7, 9).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = (torch.randn(c, dtype=stats_dtype), torch.randn(c, dtype=stats_dtype)) if affine else (None, None)
    rm, rv = torch.randn(c, dtype=stats_dtype), torch.rand(c, dtype=stats_dtype)
    before = (rm.clone(), rv.clone())
    resident = [x, rm, rv, *([w, b] if affine else [])]
    first, again = [], []
    first_peak = remat.measure_peak(lambda: first.append(batch_norm(x, w, b, rm, rv, 0.1, 1e-5, False, stats_dtype)),
                                    resident=resident)
    stats = batch_norm_stats(first[0], rm, rv)
    again_peak = remat.measure_peak(lambda: again.append(batch_norm(x, w, b, None, None, 0.1, 1e-5, True,
                                                                    stats_dtype)), resident=resident)
    ref = aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5)
    assert torch.equal(first[0], ref[0]) and torch.equal(again[0], ref[0])  # the output, bit for bit
    assert first[0].stride() == again[0].stride()
    assert all(torch.equal(s, r) and s.dtype == r.dtype for s, r in zip(stats, ref[1:]))  # eager's statistics
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])  # the running buffers untouched
    assert first_peak == again_peak  # the same allocations: the node's one workspace holds for both


def test_statistics_are_taken_once_from_the_first_computation_only():
    x, rm, rv = torch.randn(4, 3, 5), torch.zeros(3), torch.ones(3)
    x2 = torch.randn(4, 3, 5)
    o1 = batch_norm(x, None, None, rm, rv, 0.1, 1e-5, False, torch.float32)
    o2 = batch_norm(x2, None, None, rm, rv, 0.1, 1e-5, False, torch.float32)
    # two first computations before either's statistics are taken (a reordering): each output
    # carries its own, so the pairs cannot be crossed
    s2, s1 = batch_norm_stats(o2, rm, rv), batch_norm_stats(o1, rm, rv)
    for xi, si in ((x, s1), (x2, s2)):
        ref = aten._native_batch_norm_legit_functional(xi, None, None, rm, rv, True, 0.1, 1e-5)[1:]
        assert all(torch.equal(a, b) for a, b in zip(si, ref))
    with pytest.raises(BatchNormOrderError, match="not the first computation"):
        batch_norm_stats(o1, rm, rv)  # taken already
    again = batch_norm(x, None, None, None, None, 0.1, 1e-5, True, torch.float32)
    with pytest.raises(BatchNormOrderError):
        batch_norm_stats(again, rm, rv)  # a recomputation carries none
    o3 = batch_norm(x, None, None, rm, rv, 0.1, 1e-5, False, torch.float32)
    with pytest.raises(BatchNormOrderError):
        batch_norm_stats(o3.clone(), rm, rv)  # a copy of the first computation is not it
    with fake_tensor_mode() as mode:  # fake kernels: remat plans on fake tensors too
        fx_, frm = mode.from_tensor(x), mode.from_tensor(rm)
        fo = batch_norm(fx_, None, None, frm, frm, 0.1, 1e-5, False, torch.float32)
        fs = batch_norm_stats(fo, frm, frm)
        assert fo.shape == x.shape and [s.shape for s in fs] == [(3,)] * 4


class ConvBN(nn.Module):
    def __init__(self, c: int = 8, blocks: int = 3, track: bool = True):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.BatchNorm2d(c, track_running_stats=track), nn.ReLU(),
                                                  nn.Conv2d(c, c, 3, padding=1)) for _ in range(blocks))
        self.head = nn.Linear(c, 10)

    def forward(self, x, y):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


def _batches(n=2, shape=(4, 3, 12, 12), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)) for _ in range(n)]


def _train(module, params, batches, autocast=None):
    """Loss and gradients of each step (the gradients of one step set to None before the next)."""
    out = []
    for x, y in batches:
        for p in params:
            p.grad = None
        with torch.autocast(**autocast) if autocast else torch.autocast("cpu", enabled=False):
            loss = module(x, y)
        loss.backward()
        out.append([loss.detach().clone()] + [p.grad.clone() for p in params])
    return out


def _same_training(model, opt, reference, batches, autocast=None):
    got = _train(opt, list(model.parameters()), batches, autocast)
    ref = _train(reference, list(reference.parameters()), batches, autocast)
    for g_step, r_step in zip(got, ref):
        assert all(torch.equal(a, b) for a, b in zip(g_step, r_step))  # loss and every gradient
    bufs, ref_bufs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert bufs and all(torch.equal(bufs[k], ref_bufs[k]) for k in bufs)  # running stats, num_batches_tracked


def _recomputed_bn(plan, graph) -> list[str]:
    """The BatchNorm outputs `plan` recomputes, after checking each stats node runs right after
    its output's first computation (what the memory model assumes)."""
    for s in graph.nodes:
        if s.op == BATCH_NORM_STATS_OP:
            assert plan.schedule.index(s.name) == plan.schedule.index(s.inputs[0]) + 1
    return [n for n in plan.recomputed if graph.node(n).op == BATCH_NORM_OP]


def _measured(opt, model, x, y):
    peak = remat.measure_peak(lambda: opt(x, y).backward(), resident=[model, x, y])
    for p in model.parameters():
        p.grad = None
    return peak


def _keep_none(model, inputs, autocast=None):
    """The module whose plan recomputes every recomputable forward value the backward reads."""
    with torch.autocast(**autocast) if autocast else torch.autocast("cpu", enabled=False):
        graph = remat.capture(model, inputs, quiet=True)
        plan = plan_from_schedule(graph, schedule_from_kept(graph, []), strategy="keep_none", budget_bytes=None,
                                  status="heuristic")
        return remat.optimize(model, example_inputs=inputs, plan=plan, quiet=True), graph


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_conv_net_recomputing_batch_norm_trains_exactly_and_peaks_as_predicted(channels_last):
    torch.manual_seed(0)
    model = ConvBN()
    batches = _batches()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    reference = copy.deepcopy(model)
    opt, graph = _keep_none(model, batches[0])
    bns = [n for n in graph.forward_nodes if n.op == BATCH_NORM_OP]
    stats = [n for n in graph.forward_nodes if n.op == BATCH_NORM_STATS_OP]
    assert len(bns) == len(stats) == 3
    assert all(n.recomputable for n in bns) and not any(n.recomputable for n in stats)
    assert not any("_native_batch_norm_legit_functional" in n.op for n in graph.nodes)
    assert _recomputed_bn(opt.plan, graph)
    assert _measured(opt, model, *batches[0]) == opt.plan.predicted_peak_bytes
    model.load_state_dict(reference.state_dict())  # the measured step moved the running statistics
    _same_training(model, opt, reference, batches)


def test_under_bf16_autocast_recomputing_batch_norm_trains_exactly():
    torch.manual_seed(0)
    model = ConvBN()
    reference = copy.deepcopy(model)
    batches = _batches()
    bf16 = dict(device_type="cpu", dtype=torch.bfloat16)
    opt, graph = _keep_none(model, batches[0], bf16)
    assert _recomputed_bn(opt.plan, graph)
    _same_training(model, opt, reference, batches, bf16)


@pytest.fixture(scope="module")
def unet():
    model, inputs = build_unet(), unet_inputs()
    graph = remat.capture(model, inputs, quiet=True)
    return model, inputs, graph, min_feasible_budget(graph, return_plan=True)


def test_the_unets_lowest_peak_plan_recomputes_batch_norm_exactly(unet):
    model, inputs, graph, (_, lowest) = unet
    reference = copy.deepcopy(model)
    opt = remat.optimize(model, example_inputs=inputs, plan=lowest, quiet=True)  # checkmate's lowest-peak plan
    assert _recomputed_bn(opt.plan, graph), "the lowest-peak plan recomputes no BatchNorm output"
    torch.manual_seed(0)
    assert _measured(opt, model, *inputs) == opt.plan.predicted_peak_bytes
    model.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(5)
    second = (torch.randn(inputs[0].shape, generator=g), torch.randint(0, 4, inputs[1].shape, generator=g))
    torch.manual_seed(0)  # the U-Net has dropout: both runs draw the same masks
    got = _train(opt, list(model.parameters()), [inputs, second])
    torch.manual_seed(0)
    ref = _train(reference, list(reference.parameters()), [inputs, second])
    assert all(torch.equal(a, b) for gs, rs in zip(got, ref) for a, b in zip(gs, rs))
    bufs, ref_bufs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert all(torch.equal(bufs[k], ref_bufs[k]) for k in bufs)


def test_recomputing_batch_norm_lowers_the_unets_smallest_feasible_budget(unet, monkeypatch):
    model, inputs, _, (lowest, _) = unet
    monkeypatch.setattr(rewrites, "make_batch_norm_recomputable", lambda gm, device_type: 0)
    kept = remat.capture(model, inputs, quiet=True)
    assert not any(n.op == BATCH_NORM_OP for n in kept.nodes)
    assert lowest < min_feasible_budget(kept)


def test_eval_mode_and_batch_norm_without_running_stats_are_left_as_they_were():
    torch.manual_seed(0)
    batches = _batches()
    for model in (ConvBN().eval(), ConvBN(track=False)):
        reference = copy.deepcopy(model)
        opt, graph = _keep_none(model, batches[0])
        assert not any(n.op in (BATCH_NORM_OP, BATCH_NORM_STATS_OP) for n in graph.nodes)
        assert opt.plan.recomputed  # the plan still recomputes (these BatchNorms as before, whole)
        _same_grads(model, opt, reference, batches)


def _same_grads(model, opt, reference, batches):
    got = _train(opt, list(model.parameters()), batches)
    ref = _train(reference, list(reference.parameters()), batches)
    assert all(torch.equal(a, b) for gs, rs in zip(got, ref) for a, b in zip(gs, rs))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers()))


def _bn_graph() -> fx.GraphModule:
    import operator

    g = fx.Graph()
    x, rm, rv = g.placeholder("x"), g.placeholder("rm"), g.placeholder("rv")
    bn = g.call_function(aten._native_batch_norm_legit_functional.default, (x, None, None, rm, rv, True, 0.1, 1e-5))
    outs = [g.call_function(operator.getitem, (bn, i)) for i in range(5)]
    g.output(tuple(outs))
    with fake_tensor_mode() as mode:
        x.meta["val"] = mode.from_tensor(torch.randn(4, 3))
        rm.meta["val"], rv.meta["val"] = mode.from_tensor(torch.zeros(3)), mode.from_tensor(torch.ones(3))
        bn.meta["val"] = aten._native_batch_norm_legit_functional(x.meta["val"], None, None, rm.meta["val"],
                                                                  rv.meta["val"], True, 0.1, 1e-5)
    for i, o in enumerate(outs):
        o.meta["val"] = bn.meta["val"][i]
    return fx.GraphModule(torch.nn.Module(), g)


def test_the_rewrite_is_on_the_cpu_only_and_computes_what_the_op_did():
    assert make_batch_norm_recomputable(_bn_graph(), "cuda") == 0  # untested there: the output is kept
    gm = _bn_graph()
    assert make_batch_norm_recomputable(gm, "cpu") == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][:2] == [
        torch.ops.remat.batch_norm.default, torch.ops.remat.batch_norm_stats.default]
    x, rm, rv = torch.randn(4, 3), torch.zeros(3), torch.ones(3)
    got = gm(x, rm, rv)
    ref = aten._native_batch_norm_legit_functional(x, None, None, rm, rv, True, 0.1, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_plan_made_on_the_meta_device_is_the_real_graphs():
    """remat.plan on a model without its memory (graph_capture/fake_capture.py) runs the same
    rewrite through the fake kernels: the same graph and prediction as the real model's."""
    torch.manual_seed(0)
    real = ConvBN()
    x, y = _batches(1)[0]
    graph = remat.capture(real, (x, y), quiet=True)
    with torch.device("meta"):
        meta = ConvBN()
    budget = int(0.8 * remat.solve(graph, None, solver="keep_all", quiet=True).predicted_peak_bytes)
    plan = remat.plan(meta, (x.to("meta"), y.to("meta")), budget_bytes=budget, solver="equal_spacing", quiet=True)
    assert plan.graph_fingerprint == graph.fingerprint() and plan.details["estimated_workspaces"] == []
    opt = remat.optimize(real, example_inputs=(x, y), plan=plan, quiet=True)
    assert opt.plan.predicted_peak_bytes == plan.predicted_peak_bytes and _recomputed_bn(plan, graph)


class OtherSpellings(nn.Module):
    """BatchNorm as users also write it: F.batch_norm on buffers of the module's own, BatchNorm1d on
    (N, C, L) with another momentum and eps, and BatchNorm2d without affine parameters."""

    def __init__(self, c: int = 6):
        super().__init__()
        self.stem = nn.Conv1d(3, c, 3, padding=1)
        self.w, self.b = nn.Parameter(torch.rand(c) + 0.5), nn.Parameter(torch.randn(c))
        self.register_buffer("rm", torch.zeros(c))
        self.register_buffer("rv", torch.ones(c))
        self.bn1d = nn.BatchNorm1d(c, momentum=0.3, eps=1e-3)
        self.mid = nn.Conv1d(c, c, 3, padding=1)
        self.bn2d = nn.BatchNorm2d(c, affine=False)
        self.head = nn.Linear(c, 10)

    def forward(self, x, y):
        h = torch.tanh(self.stem(x))
        h = F.batch_norm(h, self.rm, self.rv, self.w, self.b, training=True, momentum=0.05, eps=1e-4)
        h = self.mid(torch.relu(self.bn1d(torch.sin(h))))
        h = self.bn2d(h.unsqueeze(-1)).squeeze(-1)
        return F.cross_entropy(self.head(torch.cos(h).mean(2)), y)


def test_other_spellings_recompute_batch_norm_exactly_and_peak_as_predicted():
    torch.manual_seed(0)
    model = OtherSpellings()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 3, 16, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(2)]
    reference = copy.deepcopy(model)
    opt, graph = _keep_none(model, batches[0])
    assert sum(n.op == BATCH_NORM_OP for n in graph.forward_nodes) == 3
    assert len(_recomputed_bn(opt.plan, graph)) == 3
    assert _measured(opt, model, *batches[0]) == opt.plan.predicted_peak_bytes
    model.load_state_dict(reference.state_dict())
    _same_training(model, opt, reference, batches)
