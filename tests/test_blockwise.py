"""A step that cannot be traced whole (a data-dependent branch, an `.item()`, DeBERTa-v2's
`.nonzero()` in its loss) raised TraceError and got no plan at all; now its repeated blocks are
planned one by one and the rest runs as it is (remat/blockwise.py). Each case trains with eager's
gradients, on both sides of its branch, and its measured peak stays under the budget."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.blockwise import BlockwiseModule, repeated_blocks


class Block(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.ln, self.fc1, self.fc2, self.drop = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, h):
        return h + self.drop(self.fc2(F.gelu(self.fc1(self.ln(h)))))


class Net(nn.Module):
    """Repeated blocks, and between them Python control flow on the data (`kind`)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 5)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x, y):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            h = b(h)
            if self.kind == "branch" and i == 1:
                h = h * 2 if h.mean() > 0 else h - 1  # both sides are taken below
        if self.kind == "item":
            h = h / h.abs().max().item()
        return F.cross_entropy(self.out(h), y)


def _train_both(opt, model, ref, calls, budget):
    for seed, call in enumerate(calls):
        for m in (model, ref):
            for p in m.parameters():
                p.grad = None
        torch.manual_seed(seed)
        loss = opt(*call)
        loss.backward()
        torch.manual_seed(seed)
        ref_loss = ref(*call)
        ref_loss.backward()
        assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            if a.grad is None:  # a block the step skipped (LayerDrop): in both
                assert b.grad is None, n
                continue
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), n
        for p in model.parameters():
            p.grad = None
        peak = remat.measure_peak(lambda: opt(*call).backward(), resident=[model, *call])
        assert peak <= budget, (seed, peak, budget)


def _tight(model, inputs, loss=lambda out: out):
    """A budget between the blocks' lowest-memory step and the eager step: (calibrated + eager) / 2."""
    eager = remat.measure_peak(lambda: loss(model(*inputs)).backward(), resident=[model, *inputs])
    for p in model.parameters():
        p.grad = None
    with pytest.warns(remat.BlockwisePlanWarning):
        low = remat.optimize(model, budget_bytes=eager, example_inputs=inputs, quiet=True).fit.calibrated_bytes
    return (low + eager) // 2


def _planned_tight(make, make_inputs, match: str = ""):
    """`make()`'s model (made after seeding 0, its inputs after it) planned block by block at `_tight`'s
    budget: (the BlockwiseModule, the model, an eager copy of it, the inputs, the budget)."""
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    inputs = make_inputs()
    budget = _tight(model, inputs)
    with pytest.warns(remat.BlockwisePlanWarning, match=match):
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, quiet=True)
    return opt, model, ref, inputs, budget


@pytest.mark.parametrize("kind", ["branch", "item"])
def test_a_step_with_data_dependent_python_is_planned_block_by_block(kind):
    opt, model, ref, (x, y), budget = _planned_tight(
        lambda: Net(kind), lambda: (torch.randn(64, 16), torch.randint(0, 5, (64,))),
        "cannot be traced whole.*3 repeated blocks")
    assert isinstance(opt, BlockwiseModule) and opt.fit.measured_bytes <= budget
    assert opt.fit.blocks == ["blocks.0", "blocks.1", "blocks.2"]
    _train_both(opt, model, ref, [(x, y), (-x, y), (x[:48], y[:48])], budget)
    assert not any("forward" in b.__dict__ for b in model.blocks)  # the model is left as it was


class ChunkBlock(nn.Module):
    """Writes into slices of a sliced buffer, as Longformer's sliding-window chunks do: the fake
    tensors' dispatch cache gave such a block's first trace in a process other bytes than its later
    ones, and the plan made on one refused the other (PlanMismatchError at deployment)."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h):
        y = self.fc2(F.gelu(self.fc1(h)))  # (B, 8, d)
        buf = y.new_zeros(y.shape[0], 9, y.shape[2] + 1)[:, 1:]
        buf[:, :, 1:] = y
        buf[:, :4, :3] = y[:, :4, :3] * 2
        return h + torch.tanh(buf[:, :, :-1])


class ChunkNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ChunkBlock() for _ in range(3)])

    def forward(self, x):
        x = x / x.abs().max().item()  # .item() before the blocks: the step cannot be traced whole
        for b in self.blocks:
            x = b(x)
        return (x * x).mean()


def test_blocks_traced_twice_deploy_the_plans_made_on_their_first_trace():
    torch.manual_seed(0)
    model = ChunkNet()
    ref = copy.deepcopy(model)
    x = torch.randn(64, 8, 32)
    budget = _tight(model, (x,))
    with pytest.warns(remat.BlockwisePlanWarning, match="3 repeated blocks"):
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=(x,), quiet=True)
    assert opt.fit.blocks == ["blocks.0", "blocks.1", "blocks.2"]
    _train_both(lambda x: opt(x), model, ref, [(x,), (x * 0.5,)], budget)


def test_without_repeated_blocks_the_trace_error_stays():
    from tests.models import DataDependent

    assert repeated_blocks(DataDependent()) == []
    with pytest.raises(remat.TraceError, match="h.sum\\(\\) > 0"):
        remat.optimize(DataDependent(), budget_bytes=2**30, example_inputs=(torch.randn(4, 8),), quiet=True)


def test_deberta_v2_with_labels_trains_block_by_block():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=32, num_labels=3,
                                       hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = transformers.DebertaV2ForSequenceClassification(cfg).train()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (4, 16), generator=g)
    labels = torch.randint(0, 3, (4,), generator=g)

    class Loss(nn.Module):  # the call a loop makes: ids and labels in, the model's loss out
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, labels):
            return self.m(input_ids=ids, labels=labels).loss

    wrapped, ref_wrapped = Loss(model), Loss(ref)
    with pytest.raises(remat.TraceError):  # the whole step: nonzero() in the loss
        remat.capture(wrapped, (ids, labels), quiet=True)
    budget = remat.measure_peak(lambda: wrapped(ids, labels).backward(), resident=[wrapped, ids, labels])
    for p in model.parameters():
        p.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.BlockwisePlanWarning)
        opt = remat.optimize(wrapped, budget_bytes=budget, example_inputs=(ids, labels), quiet=True)
    assert opt.fit.blocks == ["m.deberta.encoder.layer.0", "m.deberta.encoder.layer.1"]
    assert opt.fit.measured_bytes <= budget
    _train_both(opt, wrapped, ref_wrapped, [(ids, labels), (ids[:3], labels[:3])], budget)


class StridedHeads(nn.Module):
    """Repeated heads called on a non-contiguous slice (Autoformer's decoder output), after an
    `.item()` that keeps the step from being traced whole."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 32)
        self.heads = nn.ModuleList(nn.Linear(32, 1) for _ in range(3))

    def forward(self, x):
        h = torch.tanh(self.body(x))[:, -16:]  # strides (26 * 32, 32, 1)
        scale = 1.0 + float(x.abs().mean().item() > 0)
        return sum(head(h).pow(2).mean() for head in self.heads) * scale


def test_blocks_called_on_a_strided_slice():
    # a block's recorded call was copied contiguous, so the real (strided) call was another key,
    # planned under the recorded call's budget share and refused (InfeasibleBudgetError)
    torch.manual_seed(0)
    model = StridedHeads()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 26, 32)
    peak = remat.measure_peak(lambda: eager(x).backward(), resident=[eager, x])
    eager.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = remat.optimize(model, budget_bytes=2 * peak, example_inputs=(x,), quiet=True)
    assert isinstance(opt, BlockwiseModule)
    loss = opt(x)
    loss.backward()
    want = eager(x)
    want.backward()
    assert torch.allclose(loss, want)
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)


class ExpandedArgs(nn.Module):
    """Blocks called with an expanded tensor (ProphetNet passes its relative positions as a broadcast
    view, strides (0, 0, 32, 1)), and an `.item()` between them: planned block by block."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 8, 32))
        self.blocks = nn.ModuleList([PosBlock() for _ in range(3)])
        self.head = nn.Linear(32, 5)

    def forward(self, x, y):
        pos = self.pos.expand(x.shape[0], -1, -1)
        h = x
        for b in self.blocks:
            h = b(h, pos)
        h = h / h.abs().max().item()
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class PosBlock(Block):
    def forward(self, h, pos):
        return super().forward(h + pos)


def test_blocks_called_with_an_expanded_tensor_keep_the_plan_made_for_that_call():
    # a block's recorded call copied the expanded tensor contiguous: the real call was another key,
    # planned again inside the calibration's measurement, whose profiler that planning ended (the
    # step measured at its parameters alone: ProphetNet's plan went 4.6% over its budget)
    opt, model, ref, (x, y), budget = _planned_tight(
        ExpandedArgs, lambda: (torch.randn(4, 8, 32), torch.randint(0, 5, (4, 8))))
    _train_both(opt, model, ref, [(x, y)], budget)
    planned = [m for m in opt.blocks if m is not None]
    assert planned and all(len(m._steps) == 1 for m in planned), [len(m._steps) for m in planned]


class BiasBlock(Block):
    """Returns a bias beside its output, as T5's attention returns its position bias: the first
    block's are zeros, made from no parameter (no grad), the later blocks' from theirs."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        self.rel = nn.Parameter(torch.randn(32))

    def forward(self, h, bias=None):
        if bias is None:
            bias = h.new_zeros(h.shape[-1]) if self.first else self.rel * 1.0
        return super().forward(h + bias), bias


class BiasNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([BiasBlock(i == 0) for i in range(3)])
        self.head = nn.Linear(32, 5)

    def forward(self, x, y):
        h, bias = x, None
        for b in self.blocks:
            h, bias = b(h, bias)
        h = h / h.abs().max().item()
        return F.cross_entropy(self.head(h), y)


def test_blocks_are_recorded_with_the_grad_their_inputs_have_in_training():
    # the recording ran blocks under no_grad and passed every floating output on as requiring grad:
    # the first block's zero bias then reached the next blocks as requiring grad, unlike training's,
    # so their calls in the calibration step were other keys, traced and solved again there
    # (SwitchTransformers' cross-attentions: 14 s of its 21.6 s)
    opt, model, ref, (x, y), budget = _planned_tight(
        BiasNet, lambda: (torch.randn(64, 32), torch.randint(0, 5, (64,))), "3 repeated blocks")
    _train_both(opt, model, ref, [(x, y), (x[:32], y[:32])], budget)
    assert [len(m.plan_log) for m in opt.blocks] == [2, 2, 2], [m.plan_log for m in opt.blocks]
    # no block solved again: the first two deployed with their plans, the third runs the second's step
    assert [r.how for m in opt.blocks for r in m.plan_log[:1]] == ["saved plan"] * 2 + ["the step of an equal module"]


class AlphaBlock(nn.Module):
    def __init__(self, alpha: float):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.alpha = alpha

    def forward(self, h):
        return torch.tanh(self.lin(h)) * self.alpha + h


class Stacked(nn.Module):
    """`blocks` between an input and a head, with an `.item()` that keeps the step from tracing whole."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.inp, self.head = nn.Linear(16, 32), nn.Linear(32, 5)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        h = h / h.abs().max().item()
        return F.cross_entropy(self.head(h), y)


def test_blocks_share_a_compiled_step_only_where_their_traced_steps_are_equal():
    # blocks of one structure whose steps differ only in a Python scalar, which the planner's graph
    # does not see
    opt, model, ref, (x, y), budget = _planned_tight(
        lambda: Stacked([AlphaBlock(a) for a in (0.5, 2.0, 2.0, 0.5)]),
        lambda: (torch.randn(64, 16), torch.randint(0, 5, (64,))), "4 repeated blocks")
    assert len({p.graph.fingerprint() for p in opt.fit.plans}) == 1  # one graph for the planner
    # the second 2.0 block runs the first one's step, the second 0.5 block the first one's
    assert [m.plan_log[0].how for m in opt.blocks] == ["saved plan"] * 2 + ["the step of an equal module"] * 2
    _train_both(opt, model, ref, [(x, y), (-x, y), (x[:48], y[:48])], budget)


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Dropout(0.1)

    def forward(self, h):
        return h + self.drop(torch.relu(self.bn(self.lin(h))))


def test_a_shared_step_updates_each_blocks_own_buffers_as_eager_does():
    # equal blocks whose step updates buffers in place (BatchNorm's running statistics) and draws
    # dropout masks
    torch.manual_seed(0)
    model = Stacked([BNBlock() for _ in range(3)])
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    budget = int(0.8 * remat.measure_peak(lambda: model(x, y).backward(), resident=[model, x, y]))
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    with pytest.warns(remat.BlockwisePlanWarning):
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=(x, y), quiet=True)
    assert [m.plan_log[0].how for m in opt.blocks] == ["saved plan"] + ["the step of an equal module"] * 2
    for seed in range(3):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = opt(x, y)
        loss.backward()
        torch.manual_seed(seed)
        ref_loss = ref(x, y)
        ref_loss.backward()
        assert torch.equal(loss, ref_loss)
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), n
        for (n, a), b in zip(ref.named_buffers(), model.buffers()):
            assert torch.equal(a, b), n  # each block's running statistics, updated once per step


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, h):
        return h * self.scale


class MixedNet(nn.Module):
    """Blocks whose plans differ from level to level, and one-op blocks planned alike at every level."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 5)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.scales = nn.ModuleList([Scale() for _ in range(2)])

    def forward(self, x, y):
        h = self.inp(x)
        for b, s in zip(self.blocks, self.scales):
            h = s(b(h))
        h = h / h.abs().max().item()
        return F.cross_entropy(self.out(h), y)


def test_a_block_planned_alike_at_the_level_chosen_is_not_traced_again(monkeypatch):
    import remat.blockwise as blockwise
    import remat.pipeline as pipeline

    torch.manual_seed(0)
    model = MixedNet()
    ref = copy.deepcopy(model)
    x, y = torch.randn(64, 16), torch.randint(0, 5, (64,))
    eager = remat.measure_peak(lambda: model(x, y).backward(), resident=[model, x, y])
    for p in model.parameters():
        p.grad = None
    budget = int(1.1 * eager)  # room for the MLP blocks' plans above level 0
    deployed, levels = [], []
    deployed_module, plans_at_levels = pipeline.deployed_module, blockwise.plans_at_levels

    def recorded(graphs, *a, **k):  # each distinct graph's plans, by level
        by_graph = plans_at_levels(graphs, *a, **k)
        levels.extend(by_graph.values())
        return by_graph

    monkeypatch.setattr(pipeline, "deployed_module", lambda b, *a, **k: deployed.append(b) or deployed_module(b, *a, **k))
    monkeypatch.setattr(blockwise, "plans_at_levels", recorded)
    with pytest.warns(remat.BlockwisePlanWarning, match="4 repeated blocks"):
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=(x, y), quiet=True)
    level = opt.fit.level
    assert level > 0 and len(levels) == 2  # the MLP block's graph and the scale's
    alike = [ps for ps in levels if ps[level].schedule == ps[0].schedule]
    assert len(alike) == 1 and len(alike[0][0].graph.nodes) < 10  # the scale's
    # deployed at level 0, then at the level chosen only the blocks whose schedule differs there; the
    # second block of each kind traces to the first one's step and runs it, at every level
    assert [id(b) for b in deployed] == [id(b) for b in (model.blocks[0], model.scales[0], model.blocks[0])]
    assert [m.plan_log[0].how for m in opt.blocks] == ["saved plan", "the step of an equal module"] * 2
    _train_both(opt, model, ref, [(x, y), (x[:48], y[:48])], budget)


class WithLogits(Net):
    """Net returning its logits beside the loss, as Hugging Face models do."""

    def __init__(self):
        super().__init__("item")
        self.out = nn.Linear(32, 512)  # logits larger than a block's activations

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        h = h / h.abs().max().item()
        logits = self.out(h)
        return {"loss": F.cross_entropy(logits, y), "logits": logits}


def test_the_calibration_holds_the_outputs_through_the_backward():
    # a training loop holds what the model returns through the backward, and the whole-graph plans
    # count it; the calibration measured the step with the outputs dropped first (ViLT's held MLM
    # logits took its step 131,072 B over the budget)
    torch.manual_seed(0)
    model = WithLogits()
    x, y = torch.randn(64, 16), torch.randint(0, 512, (64,))

    def held(module):
        def step():
            out = module(x, y)
            out["loss"].backward()
        peak = remat.measure_peak(step, resident=[model, x, y])
        model.zero_grad(set_to_none=True)
        return peak

    eager = held(model)
    with pytest.warns(remat.BlockwisePlanWarning):
        low = remat.optimize(model, budget_bytes=eager, example_inputs=(x, y), quiet=True).fit.calibrated_bytes
    budget = (low + eager) // 2
    with pytest.warns(remat.BlockwisePlanWarning):
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=(x, y), quiet=True)
    assert opt.fit.measured_bytes == held(opt) <= budget


class DeepBlock(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, 8 * d), nn.Linear(8 * d, 8 * d), nn.Linear(8 * d, d)

    def forward(self, h):
        return h + self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(h)))))


class LayerDropNet(nn.Module):
    """LayerDrop as Hugging Face spells it (TimeSeriesTransformer, Informer, Wav2Vec2): each step
    skips every block with probability `layerdrop`, drawn from torch's RNG, and the `if` on that
    draw keeps the step from being traced whole."""

    def __init__(self, layerdrop: float = 0.5, blocks: int = 6):
        super().__init__()
        self.layerdrop = layerdrop
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 5)
        self.blocks = nn.ModuleList([DeepBlock() for _ in range(blocks)])

    def dropping(self, h, blocks):  # each block skipped with probability `layerdrop`
        for b in blocks:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            h = b(h)
        return h

    def forward(self, x, y):
        return F.cross_entropy(self.out(self.dropping(self.inp(x), self.blocks)), y)


def test_layerdrop_keeps_every_step_under_the_budget():
    """The blocks a step skips vary from step to step: blocks the recording's forwards skipped are
    planned (for a call of a block of the same structure), and blocks the calibration step still
    skipped are counted in the bound, so that a step running every block stays under the budget.
    Before, a block the recording skipped ran as it is in every later step, and the level was chosen
    on the calibration's draw alone (Hugging Face's TimeSeriesTransformer: 15% over its budget): a
    budget between the calibration's step and the step running every block was accepted and broken."""
    torch.manual_seed(0)
    model = LayerDropNet()
    ref = copy.deepcopy(model)
    x, y = torch.randn(256, 16), torch.randint(0, 5, (256,))
    model.layerdrop = 0.0  # the eager step that runs every block: the worst case
    every = remat.measure_peak(lambda: model(x, y).backward(), resident=[model, x, y])
    model.zero_grad(set_to_none=True)
    model.layerdrop = ref.layerdrop = 0.5
    torch.manual_seed(1)  # a draw that skips blocks in the recording's and the calibration's steps
    with pytest.raises(remat.InfeasibleBudgetError, match="did not run") as e:
        remat.optimize(model, budget_bytes=every - 1, example_inputs=(x, y), quiet=True)
    budget = e.value.min_feasible_bytes
    assert budget >= every
    torch.manual_seed(1)
    with pytest.warns(remat.BlockwisePlanWarning, match="not run by the calibration step"):
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=(x, y), quiet=True)
    assert opt.fit.blocks == [f"blocks.{i}" for i in range(6)] and opt.fit.skipped_blocks
    assert opt.fit.bound_bytes <= budget
    _train_both(opt, model, ref, [(x, y)] * 6, budget)  # six draws, each measured under the budget
    model.layerdrop = ref.layerdrop = 0.0  # every block run: the case the bound is for
    _train_both(opt, model, ref, [(x, y)], budget)


class ItemDeepBlock(DeepBlock):
    def forward(self, h):  # `.item()`: cannot be traced, so it runs as it is
        return h + self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(h))))) / (1 + 0 * h.abs().max().item())


class EagerDropNet(LayerDropNet):
    """Blocks that trace, then LayerDrop'd blocks that cannot (Hugging Face's Autoformer: its
    encoder and decoder layers run as they are, its distribution head's projections are planned)."""

    def __init__(self, layerdrop: float = 0.5):
        super().__init__(layerdrop, blocks=2)
        self.eager = nn.ModuleList([ItemDeepBlock() for _ in range(4)])

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.out(self.dropping(h, self.eager)), y)


def test_blocks_run_as_they_are_that_the_calibration_skipped_are_counted_in_the_bound():
    """A block that cannot be traced runs as it is; where LayerDrop skipped it in every calibration
    draw, what it adds to a step that runs it is measured alone and counted, so that such a step
    stays under the budget. Before, the draws counted planned blocks only, and the budget named was
    the calibration step's, under a step running every block (Autoformer: 25% over)."""
    torch.manual_seed(0)
    model = EagerDropNet()
    ref = copy.deepcopy(model)
    x, y = torch.randn(256, 16), torch.randint(0, 5, (256,))
    model.layerdrop = 0.0
    every = remat.measure_peak(lambda: model(x, y).backward(), resident=[model, x, y])
    model.zero_grad(set_to_none=True)
    model.layerdrop = ref.layerdrop = 0.5
    torch.manual_seed(0)  # a state whose four draws each skip some of the blocks run as they are
    with pytest.raises(remat.InfeasibleBudgetError, match="did not run") as e:
        remat.optimize(model, budget_bytes=every - 1, example_inputs=(x, y), quiet=True)
    budget = e.value.min_feasible_bytes
    assert budget >= every
    torch.manual_seed(0)
    with pytest.warns(remat.BlockwisePlanWarning, match=r"not run by the calibration step \(.*\): eager"):
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=(x, y), quiet=True)
    assert opt.fit.eager_blocks == [f"eager.{i}" for i in range(4)]
    assert opt.fit.skipped_blocks and all(n.startswith("eager.") for n in opt.fit.skipped_blocks)
    _train_both(opt, model, ref, [(x, y)] * 4, budget)
    model.layerdrop = ref.layerdrop = 0.0  # every block run: the case the bound is for
    _train_both(opt, model, ref, [(x, y)], budget)


class InsideOnlyBlock(ItemDeepBlock):
    def forward(self, h):  # runs only inside its model's forward, which sets `inside`
        if not getattr(self, "inside", False):
            raise RuntimeError("called outside the model")
        return super().forward(h)


class InsideOnlyNet(EagerDropNet):
    def __init__(self):
        super().__init__()
        self.eager = nn.ModuleList([InsideOnlyBlock() for _ in range(4)])

    def forward(self, x, y):
        for b in self.eager:
            b.inside = True
        try:
            return super().forward(x, y)
        finally:
            for b in self.eager:
                b.inside = False


def test_a_skipped_block_that_cannot_run_alone_is_named_in_the_warning():
    """A block run as it is that the calibration skipped, and that raises when run alone on its
    recorded call, is not measured: the plan is still made, and the warning says that a step running
    it can go over the budget (rather than the call failing, or the bound silently leaving it out)."""
    torch.manual_seed(0)
    model = InsideOnlyNet()
    x, y = torch.randn(256, 16), torch.randint(0, 5, (256,))
    torch.manual_seed(0)  # as above: every draw skips some of the blocks run as they are
    with pytest.warns(remat.BlockwisePlanWarning, match="raised when run alone on their recorded calls") as w:
        opt = remat.optimize(model, budget_bytes=2 ** 30, example_inputs=(x, y), quiet=True)
    assert opt.fit.unmeasured_blocks and set(opt.fit.unmeasured_blocks) <= set(opt.fit.skipped_blocks)
    assert all(n in str(w[0].message) for n in opt.fit.unmeasured_blocks)


class InPlaceNet(nn.Module):
    """Writes into each block's output in place (XLM and FlauBERT: `tensor *= mask.unsqueeze(-1)`),
    and cannot be traced whole (an `.item()`)."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 5)
        self.blocks = nn.ModuleList([DeepBlock() for _ in range(3)])

    def forward(self, x, y, mask):
        assert mask.sum().item() > 0
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
            h *= mask.unsqueeze(-1)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


def test_a_model_writing_into_a_blocks_output_in_place_is_planned_block_by_block():
    """The recording's forward marked each block's output as a leaf requiring grad, on which the
    model's in-place write raised: no block was planned and the step's own TraceError came back."""
    torch.manual_seed(0)
    model = InPlaceNet()
    ref = copy.deepcopy(model)
    x, y, mask = torch.randn(16, 8, 16), torch.randint(0, 5, (16, 8)), torch.ones(16, 8)
    mask[0, -3:] = 0
    budget = _tight(model, (x, y, mask))
    with pytest.warns(remat.BlockwisePlanWarning, match="3 repeated blocks"):
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=(x, y, mask), quiet=True)
    assert opt.fit.blocks == ["blocks.0", "blocks.1", "blocks.2"] and not opt.fit.eager_blocks
    _train_both(opt, model, ref, [(x, y, mask)], budget)


class ItemBlock(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)  # no parts: no child holds parameters

    def forward(self, h):
        return h @ self.weight / (1 + h.abs().max().item())  # `.item()`: the block cannot be traced either


class ItemPart(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h):
        return self.fc(h) / (1 + h.abs().max().item())  # this part cannot be traced either


class RoutedBlock(nn.Module):
    """A block whose routing reads a value back to Python (as an MoE's expert counts do): it cannot
    be traced, its MLP and its gate can."""

    def __init__(self, d: int = 32, part: type = Block):
        super().__init__()
        self.mlp, self.gate = part(d), nn.Linear(d, d)

    def forward(self, h):
        h = self.mlp(h)
        scale = 1 + h.detach().abs().max().item()
        return h + self.gate(h) / scale


class RoutedNet(nn.Module):
    def __init__(self, part: type = Block):
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 5)
        self.blocks = nn.ModuleList([RoutedBlock(part=part) for _ in range(3)])

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.out(h), y)


def test_where_no_block_traces_their_parts_are_planned_one_by_one():
    """A step whose every block reads a value back to Python (X-MOD's boolean index, an MoE's
    `.tolist()` of its expert counts): the parts every block has (here its MLP and its gate) are
    planned one by one instead, the rest of each block run as it is; before, the step raised
    TraceError. Trained against eager over calls of other data and sizes, within the budget."""
    opt, model, ref, (x, y), budget = _planned_tight(
        RoutedNet, lambda: (torch.randn(64, 16), torch.randint(0, 5, (64,))), "6 repeated blocks")
    assert opt.fit.blocks == [f"blocks.{i}.{p}" for i in range(3) for p in ("mlp", "gate")]
    assert opt.fit.measured_bytes <= budget
    _train_both(opt, model, ref, [(x, y), (-x, y), (x[:48], y[:48])], budget)
    assert not any("forward" in m.__dict__ for m in model.modules())  # the model is left as it was


class ItemBlocksNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ItemBlock() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def test_where_no_block_can_be_planned_the_error_says_why_in_a_note():
    """The whole step's TraceError is raised as it was (its message names the step's line), with a
    note on why its repeated blocks could not be planned one by one either: before, nothing said
    that they were tried (XLM's in-place write hid behind its `.item()`)."""
    with pytest.raises(remat.TraceError, match="item") as e:
        remat.optimize(ItemBlocksNet(), budget_bytes=2**30, example_inputs=(torch.randn(4, 32),), quiet=True)
    notes = getattr(e.value, "__notes__", [])
    assert len(notes) == 1 and "3 repeated blocks (blocks.0, blocks.1, blocks.2) one by one" in notes[0]
    assert "none could be traced either" in notes[0] and "item" in notes[0] and "parts" not in notes[0]
    # parts that cannot be traced either: the note names them too
    model = ItemBlocksNet()
    model.blocks = nn.ModuleList([nn.Sequential(ItemPart()) for _ in range(3)])
    with pytest.raises(remat.TraceError, match="item") as e:
        remat.optimize(model, budget_bytes=2**30, example_inputs=(torch.randn(4, 32),), quiet=True)
    notes = getattr(e.value, "__notes__", [])
    assert len(notes) == 1 and "nor their parts (blocks.0.0, blocks.1.0, blocks.2.0)" in notes[0]


class ItemUnlikeBlocksNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ItemBlock(), nn.Sequential(nn.Linear(32, 32), nn.Tanh())])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def test_where_no_blocks_repeat_the_error_says_so_in_a_note():
    """A step that cannot be traced whole and has no repeated blocks (NLLB-MoE with one dense and
    one sparse layer a stack): its TraceError as it was, with a note saying no repeated blocks were
    found to plan instead (before: the bare error, where the note of the test above came only once
    blocks were found)."""
    with pytest.raises(remat.TraceError, match="item") as e:
        remat.optimize(ItemUnlikeBlocksNet(), budget_bytes=2**30, example_inputs=(torch.randn(4, 32),), quiet=True)
    notes = getattr(e.value, "__notes__", [])
    assert len(notes) == 1 and "no repeated blocks" in notes[0]


def test_a_blocks_call_needing_more_than_its_share_is_planned_at_its_smallest_with_a_warning():
    # a block's budget is its share of the step's, set for its example call: a later call needing more
    # (here four times the batch) raised InfeasibleBudgetError mid-training, naming a budget the user
    # never gave (the share); so did a LayerDrop block the recording forwards skipped, handed the first
    # block's call (an input not requiring grad) and later called with one that does
    opt, model, ref, (x, y), budget = _planned_tight(
        lambda: Net("item"), lambda: (torch.randn(16, 16), torch.randint(0, 5, (16,))))
    share = opt.blocks[0].plan.budget_bytes
    big = (torch.randn(64, 16), torch.randint(0, 5, (64,)))
    with pytest.warns(remat.BlockBudgetWarning, match="smallest feasible budget"):
        _train_both(opt, model, ref, [big], budget=2**40)
    assert all(max(p.budget_bytes for p in b.plans) > share for b in opt.blocks)
    _train_both(opt, model, ref, [(x, y)], budget)  # the example's own plan still runs within the step's budget


def test_the_levels_of_several_graphs_are_solved_in_one_queue_two_at_a_time(monkeypatch):
    """plans_at_levels gives each graph level_plans' plans, each budget solved once, with never more
    than two solves at once (one queue over every graph's budgets, not a queue per graph inside
    one over the graphs: four at once on two CPUs)."""
    import threading

    import remat.block_levels as block_levels
    from tests.conftest import training_chain

    graphs = {f"g{i}": training_chain(8, seed=i) for i in range(3)}
    alone = {k: block_levels.level_plans(g, 4, "equal_spacing", None, {}) for k, g in graphs.items()}
    block_levels.forget_level_plans()  # each graph's plans solved again below, not remembered
    solve, lock, running, most, solved = block_levels.solve, threading.Lock(), [0], [0], []

    def counted(g, b, **k):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            solved.append((g.name, b))
        try:
            return solve(g, b, **k)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(block_levels, "solve", counted)
    together = block_levels.plans_at_levels(graphs, 4, "equal_spacing", None, {})
    assert {k: [p.schedule for p in ps] for k, ps in together.items()} == \
        {k: [p.schedule for p in ps] for k, ps in alone.items()}
    assert sorted(solved) == sorted({(g.name, p.budget_bytes) for g, ps in zip(graphs.values(), alone.values())
                                     for p in ps})  # each budget once
    assert most[0] <= 2


def test_a_graph_equal_to_one_planned_before_gets_its_level_plans_without_a_solve(monkeypatch):
    """plans_at_levels remembers each graph's plans under its options: an equal graph (traced again,
    another object) gets them, tied to itself, with nothing solved; other options, another graph, or a
    wall-clock limit (the plans then depend on the machine's load) are solved."""
    import remat.block_levels as block_levels
    from tests.conftest import training_chain

    block_levels.forget_level_plans()
    solve, solved = block_levels.solve, []

    def counted(g, b, **k):
        solved.append((g.name, b))
        return solve(g, b, **k)

    monkeypatch.setattr(block_levels, "solve", counted)
    first = block_levels.plans_at_levels({"a": training_chain(8, seed=0)}, 4, "equal_spacing", None, {})["a"]
    assert len(solved) == 4
    again = training_chain(8, seed=0)  # an equal graph, another object
    got = block_levels.plans_at_levels({"b": again, "c": training_chain(8, seed=1)}, 4, "equal_spacing", None, {})
    assert len(solved) == 8  # the new graph's four, none of the equal one's
    assert [p.schedule for p in got["b"]] == [p.schedule for p in first]
    assert all(p.graph is again for p in got["b"])
    block_levels.plans_at_levels({"a": again}, 3, "equal_spacing", None, {})  # other options: solved
    assert len(solved) == 11
    block_levels.plans_at_levels({"a": again}, 4, "equal_spacing", 60.0, {})  # a wall-clock limit: solved
    assert len(solved) == 15
    block_levels.forget_level_plans()


@pytest.mark.parametrize("asked", [{}, {"mip_gap": 1e-3}])
def test_checkmate_proves_the_levels_above_the_smallest_budget_within_the_level_gap(monkeypatch, asked):
    """checkmate's level solves above each graph's smallest budget get LEVEL_GAP, the one at it the
    gap asked (none: the default), and a gap the caller asks for goes to every level (two graphs
    solved in one queue, each solve's options its own graph's)."""
    import remat.block_levels as block_levels
    from tests.conftest import training_chain

    block_levels.forget_level_plans()
    solve, gaps = block_levels.solve, {}

    def recorded(g, b, **k):
        gaps[g.name, b] = k.get("mip_gap")
        return solve(g, b, **k)

    monkeypatch.setattr(block_levels, "solve", recorded)
    graphs = {"a": training_chain(6, seed=0), "b": training_chain(7, seed=1)}
    by_graph = block_levels.plans_at_levels(graphs, 4, "checkmate", None, dict(asked))
    for key, plans in by_graph.items():
        budgets = [p.budget_bytes for p in plans]
        assert len(set(budgets)) == 4
        assert [gaps[graphs[key].name, b] for b in budgets] == \
            [asked.get("mip_gap")] + 3 * [asked.get("mip_gap", block_levels.LEVEL_GAP)]
        for p, b in zip(plans, budgets):
            assert p.predicted_peak_bytes <= b
    block_levels.forget_level_plans()
