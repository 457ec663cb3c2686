"""The measured cost model (graph_capture/op_timing.py, `remat.capture(..., cost_model="measured")`):
the same graph with each node's cost its ops' measured nanoseconds. Structure and sanity only: no
assertion depends on how fast anything ran (the suite runs on a loaded machine)."""
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.pipeline import joint_info
from remat.graph_capture import op_timing
from remat.graph_capture.joint import capture_training_step
from remat.graph_capture.op_timing import (MIN_COST_NS, measured_cost_graph, recomputation_form, shared_signature,
                                           time_ops)
from remat.report import reference_step
from remat.solver.checkmate import min_feasible_budget
from remat.validate import RematArgumentError, RematArgumentTypeError


class Net(nn.Module):
    """Repeated identical blocks (identical op calls to share a timing), views, layer norm (an op
    with several outputs), dropout (a random op), BatchNorm (on the CPU remat::batch_norm_stats,
    which only runs on what remat::batch_norm returned)."""

    def __init__(self, width: int = 32, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                                  nn.Dropout(0.1)) for _ in range(blocks))
        self.bn = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x, y):
        for b in self.blocks:
            x = x + b(x)
        return F.cross_entropy(self.head(self.bn(x.view(-1, x.shape[-1]))), y)


def _net():
    torch.manual_seed(0)
    return Net(), (torch.randn(2, 8, 32), torch.randint(0, 4, (16,)))


def _joint_info(model, inputs):
    with capture_training_step(model, inputs, None) as captured, captured.graph_work():
        return joint_info(captured)


def _same_structure(a, b):
    strip = lambda n: dataclasses.replace(n, cost=1.0)  # noqa: E731
    assert [strip(n) for n in a.nodes] == [strip(n) for n in b.nodes]
    assert (a.resident_bytes, a.tangents, a.name) == (b.resident_bytes, b.tangents, b.name)


def test_measured_graph_is_the_same_graph_with_positive_costs():
    model, inputs = _net()
    flops = remat.capture(model, inputs, quiet=True)
    timed = remat.capture(model, inputs, quiet=True, cost_model="measured")
    assert len(timed.nodes) == len(flops.nodes)
    assert all(n.cost >= MIN_COST_NS > 0 for n in timed.nodes)
    _same_structure(flops, timed)
    assert timed.fingerprint() == flops.fingerprint()  # a plan made on either deploys on the other
    assert timed.meta["cost_model"] == "measured" and timed.meta["cost_unit"] == "ns"
    t = timed.meta["cost_timing"]
    assert t["device"] == "cpu" and t["estimated_nodes"] == [] and 0 < t["signatures"]  # every op ran
    assert any(n.op == "batch_norm_stats.default" for n in timed.nodes)
    assert t["first_computation_ns"] > 0 and set(t["recomputed_differently"]) == {
        n.name for n in timed.nodes if n.op in ("dropout.default", "batch_norm.default")}
    assert "cost_model" not in flops.meta  # the default graph is left as it was
    # the default stays deterministic: the same input gives the same costs
    assert [n.cost for n in remat.capture(model, inputs, quiet=True).nodes] == [n.cost for n in flops.nodes]
    assert remat.capture(model, inputs, quiet=True).to_json() == flops.to_json()


def test_identical_calls_share_one_timing():
    model, inputs = _net()
    info = _joint_info(model, inputs)
    per_node, by_sig = time_ops(info.gm, warmup=1, repeats=3)
    ops = [n for n in info.gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    assert set(per_node) == {n.name for n in ops}  # every op ran
    assert len(by_sig) < len(ops)  # the three blocks repeat their calls: each timed once
    for n in ops:
        assert per_node[n.name] == by_sig[shared_signature(n)] > 0
    # the three blocks' first linear layers are the same call (same shapes, strides, dtypes)
    addmms = [n for n in ops if n.target is torch.ops.aten.addmm.default and not info.graph.node(n.name).is_backward]
    assert len(addmms) == 4 and len({per_node[n.name] for n in addmms[:3]}) == 1
    # remat::dropout (mask replayed) and remat::batch_norm (statistics dropped) are recomputed by
    # another call than their first computation: those are timed again, as recomputed
    again, _ = time_ops(info.gm, warmup=1, repeats=3, recomputed=True)
    other = {n.name for n in ops if recomputation_form(n) is not None}
    assert set(again) == other and all(t > 0 for t in again.values())
    assert {str(n.target) for n in ops if n.name in other} == {"remat.dropout.default", "remat.batch_norm.default"}


def test_node_cost_is_the_sum_of_its_ops_times(monkeypatch):
    """Each node costs its fx members' times (getitems run nothing); an op that cannot be timed
    leaves its node priced by the FLOP model at the timed nodes' rate, and listed."""
    model, inputs = _net()
    info = _joint_info(model, inputs)
    ops = [n for n in info.gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    untimed = next(n for n in ops if n.target is torch.ops.aten.gelu.default)
    fake = {n.name: 1000.0 for n in ops if n is not untimed}
    monkeypatch.setattr(op_timing, "time_ops", lambda gm, device, **kw: (fake, {}))
    g = measured_cost_graph(info)
    owner = next(k for k, ms in info.groups.items() if untimed in ms)
    assert g.meta["cost_timing"]["estimated_nodes"] == [owner]
    timed = [n for n in g.nodes if n.name != owner]
    for n in timed:
        ran = [m for m in info.groups[n.name] if isinstance(m.target, torch._ops.OpOverload)]
        assert n.cost == max(1000.0 * len(ran), MIN_COST_NS), n.name
    rate = sum(n.cost for n in timed) / sum(info.graph.node(n.name).cost for n in timed)
    assert g.node(owner).cost == pytest.approx(info.graph.node(owner).cost * rate)


def test_measured_plans_deploy_and_match_the_model():
    """A plan solved on measured costs runs with the model's own loss and gradients, and deploys
    on a re-capture with the default cost model (costs are not part of the fingerprint)."""
    model, inputs = _net()
    ref_loss, ref_grads, _ = reference_step(model, inputs, seed=0)
    graph = remat.capture(model, inputs, quiet=True)
    keep = remat.solve(graph, None, solver="keep_all").predicted_peak_bytes
    budget = (keep + min_feasible_budget(graph)) // 2  # halfway down to the smallest feasible budget
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, solver="checkmate",
                         time_limit_s=20, cost_model="measured", quiet=True)
    assert opt.plan.context["solver_options"]["cost_model"] == "measured"
    assert opt.plan.fits and opt.plan.predicted_peak_bytes <= budget and opt.plan.recomputed
    for module in (opt, remat.optimize(model, example_inputs=inputs, plan=opt.plan, quiet=True)):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(0)
        loss = module(*inputs)
        loss.backward()
        assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for p, g in zip(model.parameters(), ref_grads):
            assert torch.allclose(p.grad, g, rtol=1e-5, atol=1e-6)


def test_unknown_cost_model_is_a_clear_error_before_tracing():
    model, inputs = _net()
    with pytest.raises(RematArgumentError, match=r"unknown cost_model 'time'; choose one of 'flops', 'measured'"):
        remat.capture(model, inputs, cost_model="time")
    with pytest.raises(RematArgumentError, match="unknown cost_model"):
        remat.optimize(model, budget_gb=1.0, example_inputs=inputs, cost_model="Measured")
    with pytest.raises(RematArgumentTypeError, match="cost_model must be a string"):
        remat.capture(model, inputs, cost_model=None)
