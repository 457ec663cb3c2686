"""Dropout recomputed from its saved generator state (graph_capture/rng_replay.py): the replay
draws the same mask with the same allocations as the first computation, a plan that recomputes
dropout gives the unmodified model's loss, gradients and random stream bit for bit, and the
rewrite stays off where it is not proven (devices other than the CPU and CUDA, another random op, a dropout output read as it
is); a first computation that would not draw from its saved state raises instead."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import remat
from remat.compat.torch_private import fake_tensor_mode
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.graph_capture.rng_replay import (CPU_STATE_BYTES, RngOrderError, dropout, make_dropout_replayable,
                                           rng_state)
from remat.solver import equal_spacing
from remat.solver.checkmate import min_feasible_budget
from remat.core.plan import LOWEST_PEAK

aten = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(3,), (7,), (100,), (64, 33, 17)])
def test_a_replay_draws_the_first_computations_mask_with_its_allocations(dtype, shape):
    x = torch.randn(shape).to(dtype)
    state = rng_state(x)
    held = []
    first_peak = remat.measure_peak(lambda: held.append(dropout(state, x, 0.3, False)), resident=[x, state])
    after = torch.get_rng_state()
    replays = []
    replay_peak = remat.measure_peak(lambda: replays.append(dropout(state, x, 0.3, True)), resident=[x, state])
    assert torch.equal(held[0][1], replays[0][1])  # the mask, bit for bit
    assert torch.equal(torch.get_rng_state(), after)  # the replay left the generator alone
    assert first_peak == replay_peak  # the same allocations: the simulator's one workspace holds
    assert state.numel() == CPU_STATE_BYTES


def _grads(f, params, inputs, seed=123):
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = f(*inputs)
    loss.backward()
    return [loss.detach().clone()] + [p.grad.clone() for p in params] + [torch.get_rng_state()]


@pytest.fixture(scope="module")
def gpt():
    """A small GPT with dropout, its graph and the smallest budget checkmate plans it in."""
    cfg = GPTConfig(n_layer=2, block_size=64, n_embd=64, n_head=4, batch_size=4, dropout=0.1)
    model, inputs = default_model(cfg), default_inputs(cfg)
    g = remat.capture(model, inputs, quiet=True)
    return model, inputs, g, min_feasible_budget(g)


def test_a_plan_that_recomputes_dropout_is_bit_identical_and_measured_as_predicted(gpt):
    model, inputs, g, lowest = gpt
    states = [n for n in g.nodes if n.op == "rng_state.default"]
    drops = [n for n in g.nodes if n.op == "dropout.default"]
    assert len(states) == len(drops) == 7 and all(s.is_random and not s.recomputable for s in states)
    assert all(d.recomputable and states[i].name in d.inputs for i, d in enumerate(drops))
    # the model's own loss head: this test is about dropout replay, which is bit-identical; the chunked
    # head ("auto" may choose it at this budget) sums the loss in another order (tests/test_loss_head.py)
    opt = remat.optimize(model, budget_bytes=lowest, example_inputs=inputs, quiet=True, chunked_loss=False)
    recomputed = [n for n in opt.plan.recomputed if g.node(n).op == "dropout.default"]
    assert recomputed, "the lowest-peak plan recomputes no dropout: nothing replayed here"
    params = list(model.parameters())
    ref, got = _grads(model, params, inputs), _grads(opt, params, inputs)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))  # loss, every gradient, the RNG state after
    torch.manual_seed(123)
    measured = remat.measure_peak(lambda: opt(*inputs).backward(), resident=[model, *inputs])
    assert measured == opt.plan.predicted_peak_bytes


def test_replay_lowers_the_smallest_feasible_budget(gpt, monkeypatch):
    model, inputs, _, replayed = gpt
    monkeypatch.setattr("remat.graph_capture.rewrites.make_dropout_replayable", lambda gm, device_type: 0)
    kept = remat.capture(model, inputs, quiet=True)
    assert not any(n.op == "dropout.default" for n in kept.nodes)
    assert replayed < min_feasible_budget(kept)


def _dropout_graph(read_output: bool, other_random: bool = False) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    if other_random:
        x = g.call_function(aten.rand_like.default, (x,))
    d = g.call_function(aten.native_dropout.default, (x, 0.5, True))
    outs = [g.call_function(operator.getitem, (d, 1))]
    if read_output:
        outs.append(g.call_function(operator.getitem, (d, 0)))
    g.output(tuple(outs))
    with fake_tensor_mode() as mode:
        for n in g.nodes:
            if n.op != "output":
                n.meta["val"] = mode.from_tensor(torch.randn(4))
    return fx.GraphModule(torch.nn.Module(), g)


def test_the_rewrite_stays_off_where_it_is_not_proven():
    assert make_dropout_replayable(_dropout_graph(False), "cpu") == 1
    assert make_dropout_replayable(_dropout_graph(True), "cpu") == 0  # its output is read as it is
    assert make_dropout_replayable(_dropout_graph(False), "cuda") == 1  # CUDA: replayed (benchmarks/gpu_dropout.py)
    assert make_dropout_replayable(_dropout_graph(False), "mps") == 0  # elsewhere: masks kept
    assert make_dropout_replayable(_dropout_graph(False), "mixed") == 0
    assert make_dropout_replayable(_dropout_graph(False, other_random=True), "cpu") == 0  # it could draw between


def test_a_first_draw_out_of_order_raises():
    """Two states saved before either dropout draws (what a reordering compiler could do): the
    first dropout's own state is no longer the last saved, and it refuses to draw."""
    x = torch.randn(8)
    s1 = rng_state(x)
    s2 = rng_state(x)
    with pytest.raises(RngOrderError, match="out of the graph's order"):
        dropout(s1, x, 0.5, False)
    dropout(s2, x, 0.5, False)  # its own state is the last saved: fine


class _Spellings(torch.nn.Module):
    """Dropout as people write it: the module, in place, functional, alpha/feature variants left
    to torch, and a hand-made mask (another random op: the rewrite must then keep every mask)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
        self.drop = torch.nn.Dropout(0.25, inplace=spelling == "inplace")

    def _dropout(self, h):
        if self.spelling in ("module", "inplace"):
            return self.drop(h)
        if self.spelling == "functional":
            return torch.nn.functional.dropout(h, 0.25, training=self.training)
        if self.spelling == "tensor_method":
            return torch.dropout(h, 0.25, self.training)
        return h * (torch.rand_like(h) > 0.25) / 0.75  # "manual": its own random op

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(self._dropout(layer(x)))  # (in place on the linear's output: allowed)
        return x.pow(2).mean()


@pytest.mark.parametrize("spelling", ["module", "inplace", "functional", "tensor_method", "manual"])
def test_spellings_recompute_dropout_bit_identically(spelling):
    torch.manual_seed(0)
    model, x = _Spellings(spelling), torch.randn(256, 64)
    g = remat.capture(model, (x,), quiet=True)
    replayed = [n for n in g.nodes if n.op == "dropout.default"]
    # in place, the dropout's output is copied back into its input (read as it is: not replayable);
    # a hand-made mask is a foreign random op: every mask is kept in both
    assert len(replayed) == (0 if spelling in ("inplace", "manual") else 3)
    lowest = equal_spacing.solve(g, LOWEST_PEAK).predicted_peak_bytes  # recomputes all between checkpoints
    opt = remat.optimize(model, budget_bytes=lowest, example_inputs=(x,), solver="equal_spacing", quiet=True)
    if replayed:
        assert any(g.node(n).op == "dropout.default" for n in opt.plan.recomputed)
    params = list(model.parameters())
    ref, got = _grads(model, params, (x,)), _grads(opt, params, (x,))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
