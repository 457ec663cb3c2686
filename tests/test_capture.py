import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.graph_capture.rng_replay import CPU_STATE_BYTES
from remat.graph_capture import TrainingGraph
from remat.measure import count_flops, resident_bytes
from tests.models import DataDependent, KwargsNet, small_gpt


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, t):
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))), t)


def test_capture_tiny_mlp_node_by_node():
    """Every node of a model small enough to write down: one per allocation, forward then backward,
    its inputs, and bytes equal to the real tensors' (activations, gradients kept to the end)."""
    torch.manual_seed(0)
    model, x, t = TinyMLP(), torch.randn(32, 8), torch.randn(32, 4)
    g = remat.capture(model, (x, t))
    f4 = 4  # bytes per float32
    loss = F.mse_loss(model.fc2(torch.relu(model.fc1(x))), t)  # CPU: a view of the elementwise buffer
    expected = [  # name, op, inputs, out_bytes, kept_bytes, is_backward, module_path
        ("addmm", "addmm.default", (), 32 * 16 * f4, 0, False, "fc1"),
        ("relu", "relu.default", ("addmm",), 32 * 16 * f4, 0, False, ""),
        ("addmm_1", "addmm.default", ("relu",), 32 * 4 * f4, 0, False, "fc2"),
        ("mse_loss", "mse_loss.default", ("addmm_1",), 0, loss.untyped_storage().nbytes(), False, ""),
        ("mse_loss_backward", "mse_loss_backward.default", ("addmm_1",), 32 * 4 * f4, 0, True, ""),
        ("mm", "mm.default", ("mse_loss_backward",), 32 * 16 * f4, 0, True, "fc2"),  # grad of relu's output
        ("mm_1", "mm.default", ("mse_loss_backward", "relu"), 0, model.fc2.weight.nbytes, True, "fc2"),
        ("sum_1", "sum.dim_IntList", ("mse_loss_backward",), 0, model.fc2.bias.nbytes, True, "fc2"),
        ("threshold_backward", "threshold_backward.default", ("mm", "relu"), 32 * 16 * f4, 0, True, ""),
        ("mm_2", "mm.default", ("threshold_backward",), 0, model.fc1.weight.nbytes, True, "fc1"),
        ("sum_2", "sum.dim_IntList", ("threshold_backward",), 0, model.fc1.bias.nbytes, True, "fc1"),
    ]
    got = [(n.name, n.op, n.inputs, n.out_bytes, n.kept_bytes, n.is_backward, n.module_path) for n in g.nodes]
    assert got == expected
    assert [n.name for n in g.forward_nodes] == [e[0] for e in expected[:4]]
    # the model, its inputs and the loss's seed gradient (4 bytes, from the start of the backward)
    assert g.tangents == ((f4, ()),)
    assert g.resident_bytes == resident_bytes([model, x, t]) + f4


def test_capture_gpt_structure():
    model, inputs = small_gpt()
    g = remat.capture(model, inputs)
    fwd, bwd = g.forward_nodes, g.backward_nodes
    # a topological order with the whole forward first, ending with the loss
    assert [n.is_backward for n in g.nodes] == [False] * len(fwd) + [True] * len(bwd)
    assert fwd[-1].op == "nll_loss_forward.default" and bwd[0].op == "nll_loss_backward.default"
    # the two blocks are the same code: the same nodes in the same order, forward and backward
    # (ln_1, attention, ln_2, MLP: 31 forward nodes, 3 of them the generator states saved before
    # the block's three dropouts, and 29 backward nodes each)
    def block(i, backward):
        return [n.op for n in g.nodes if f"{n.module_path}.".startswith(f"h.{i}.") and n.is_backward == backward]
    for backward, count in ((False, 31), (True, 29)):
        assert block(0, backward) == block(1, backward) and len(block(0, backward)) == count
    # outside the blocks: embeddings, dropout (and its state), ln_f, lm_head, loss; 145 nodes in all
    assert (len(fwd), len(bwd)) == (74, 71)
    # parameters, buffers, inputs and the scalar loss's seed gradient are resident
    assert g.tangents == ((4, ()),)
    assert g.resident_bytes == resident_bytes([model, *inputs]) + 4
    # views allocate nothing, so none of them is a node of its own
    assert not any(n.op in ("view.default", "t.default", "transpose.int", "expand.default") for n in g.nodes)
    # kept to the end of the step: the loss, and in the backward exactly the parameters' gradients
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert [(n.name, n.kept_bytes) for n in fwd if n.kept_bytes] == [(fwd[-1].name, 4)]
    assert sum(n.kept_bytes for n in bwd) == param_bytes
    assert all(n.cost > 0 for n in g.nodes)


def test_capture_marks_dropout_masks_small_and_replayable():
    """Each dropout reads the generator state saved just before it (the only random node: never
    recomputed, 5056 bytes), so the dropout itself is recomputable (graph_capture/rng_replay.py)."""
    model, inputs = small_gpt()
    g = remat.capture(model, inputs)
    random = [n for n in g.nodes if n.is_random]
    assert all(n.op == "rng_state.default" and not n.recomputable and n.out_bytes == CPU_STATE_BYTES for n in random)
    drops = [n for n in g.nodes if n.op == "dropout.default"]
    assert len(drops) == len(random) and all(d.recomputable and d.inputs[0] == s.name for s, d in zip(random, drops))
    # one mask per dropout call of the step, bool: 1 byte per element. The embeddings' dropout and
    # each block's residual and MLP dropouts on the (B, T, C) stream, each block's attention
    # dropout on the (B, heads, T, T) probabilities
    B, T = inputs[0].shape
    C, heads, layers = 64, 4, 2
    assert sorted(n.out_bytes for n in drops) == sorted([B * T * C] * (1 + 2 * layers) + [B * heads * T * T] * layers)


def test_capture_flops_match_eager_step():
    model, inputs = small_gpt()
    g = remat.capture(model, inputs)

    def step():
        model(*inputs).backward()

    assert g.total_flops == count_flops(step)


def test_module_paths_name_submodules():
    model, inputs = small_gpt()
    g = remat.capture(model, inputs)
    paths = {n.module_path for n in g.nodes}
    assert "h.0.attn" in paths and "h.1.mlp.c_fc" in paths


def test_training_graph_json_roundtrip():
    model, inputs = small_gpt()
    g = remat.capture(model, inputs)
    g2 = TrainingGraph.from_json(g.to_json())
    assert g2.nodes == g.nodes and g2.fingerprint() == g.fingerprint()


def test_capture_kwargs_and_several_outputs():
    """Keyword tensors are inputs like the others, every tensor the step returns is kept to its
    end, and BatchNorm's new running statistics live only until the forward ends."""
    torch.manual_seed(0)
    model = KwargsNet()
    x, t = torch.randn(16, 32), torch.randn(16, 32)
    g = remat.capture(model, (x,), {"target": t, "scale": 0.5})
    by_op = {}
    for n in g.nodes:
        by_op.setdefault(n.op, []).append(n)
    # the dropout and its saved state; BatchNorm's output and its statistics
    assert (len(g.forward_nodes), len(g.backward_nodes)) == (12, 11)
    # `target=` is resident, as are the model and `x`; so are the tangents: 4 bytes for the loss's
    # seed, and y's gradient (zeros, y is not differentiated), freed after its one reader
    assert g.resident_bytes == resident_bytes([model, x, t]) + sum(b for b, _ in g.tangents)
    y_bytes = 16 * 32 * 4
    assert g.tangents == ((4, ()), (y_bytes, (by_op["add.Tensor"][1].name,)))
    # both outputs are kept: y (fc2's output times `scale`) and the loss, which on CPU holds the
    # elementwise squared error it is a view of
    fc2 = next(n for n in g.forward_nodes if n.module_path == "fc2")
    y = next(n for n in g.forward_nodes if n.inputs == (fc2.name,))
    assert (y.op, y.out_bytes, y.kept_bytes) == ("mul.Tensor", 0, y_bytes)
    (loss,) = by_op["mse_loss.default"]
    assert loss.inputs == (y.name,) and loss.kept_bytes == y_bytes
    # BatchNorm: its output (recomputable, graph_capture/bn_replay.py) dies with its reader; its
    # statistics node holds the saved mean and invstd for the backward, and the new running mean
    # and variance and the incremented num_batches_tracked are forward_kept (dropped when the
    # forward ends)
    (bn,) = by_op["batch_norm.default"]
    (bn_stats,) = by_op["batch_norm_stats.default"]
    stats = model.bn.running_mean.nbytes
    assert (bn.out_bytes, bn.kept_bytes, bn.recomputable) == (16 * 64 * 4, 0, True)
    assert bn_stats.inputs == (bn.name,) and not bn_stats.recomputable
    assert bn_stats.forward_kept == ((stats, ("native_batch_norm_backward",)),) * 2
    assert [b for b, _ in bn_stats.out_parts] == [stats, stats]
    (count,) = [n for n in g.forward_nodes if n.module_path == "fc1" and n.op == "add.Tensor"]
    assert count.forward_kept == ((model.bn.num_batches_tracked.nbytes, ()),)
    # the dropout mask: 1 byte per element of its (16, 64) input, replayable from the generator
    # state saved before it (the one random node)
    assert [(n.op, n.out_bytes) for n in g.nodes if n.is_random] == [("rng_state.default", CPU_STATE_BYTES)]
    assert [(n.op, n.out_bytes, n.recomputable) for n in by_op["dropout.default"]] == [("dropout.default", 16 * 64, True)]


def test_untraceable_model_names_the_source_line():
    model = DataDependent()
    try:
        remat.capture(model, (torch.randn(4, 8),))
    except remat.TraceError as e:
        assert "models.py" in str(e) and "h.sum() > 0" in str(e)
    else:
        raise AssertionError("tracing data-dependent control flow should fail")


class PlainTensorAttribute(nn.Module):
    """A sinusoidal table held as a plain attribute, neither a parameter nor a buffer (VideoMAE's)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = torch.randn(1, 8)

    def forward(self, x):
        return (self.lin(x) + self.table.detach()).sum()


def test_a_plain_tensor_attribute_is_named_with_the_way_to_make_it_a_buffer():
    model = PlainTensorAttribute()
    with pytest.raises(remat.TraceError, match=r"plain module attributes.*table \(1, 8\).*register_buffer"):
        remat.capture(model, (torch.randn(4, 8),))
    t = model.table
    del model.table
    model.register_buffer("table", t, persistent=False)
    x = torch.randn(4, 8)
    opt = remat.optimize(model, example_inputs=(x,), solver="keep_all", quiet=True)
    opt(x).backward()
    got = model.lin.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    model(x).backward()
    assert torch.equal(got, model.lin.weight.grad)


def test_nothing_requires_grad_is_an_error():
    model = KwargsNet().requires_grad_(False)
    try:
        remat.capture(model, (torch.randn(4, 32),), {"target": torch.randn(4, 32)})
    except remat.TraceError as e:
        assert "requires grad" in str(e)
    else:
        raise AssertionError("expected TraceError")


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
def test_optimizing_with_grad_disabled_says_so(grad_off):
    """remat.optimize called under torch.no_grad() or torch.inference_mode() (an evaluation loop's
    habit) traces no backward: the TraceError says grad was disabled, and with grad on it plans."""
    model, x = KwargsNet(), torch.randn(4, 32)
    with grad_off(), pytest.raises(remat.TraceError, match="grad is disabled where remat was called"):
        remat.optimize(model, example_inputs=(x,), example_kwargs={"target": torch.randn(4, 32)}, solver="keep_all",
                       quiet=True)
    assert remat.optimize(model, example_inputs=(x,), example_kwargs={"target": torch.randn(4, 32)},
                          solver="keep_all", quiet=True).plan.fits


def test_the_pipeline_stages_run_as_plain_calls():
    """Capture, decide and lower are plain calls between AOTAutograd's two stages (remat/pipeline.py):
    a plan that recomputes, made outside any callback, compiled and run, gives eager's loss and
    gradients (inputs that require grad included)."""
    from remat.core.simulator import simulate
    from remat.graph_capture.joint import capture_training_step
    from remat.pipeline import joint_info
    from remat.runtime.partition import partition_with_plan
    from remat.solver import get_solver

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)], nn.Linear(32, 1))
    x = torch.randn(64, 32, requires_grad=True)
    with capture_training_step(model, (x,), None) as captured:
        with captured.graph_work():
            info = joint_info(captured)
            keep = get_solver("keep_all")(info.graph, None).predicted_peak_bytes
            plan = get_solver("equal_spacing")(info.graph, int(0.9 * keep))
            assert plan.fits and simulate(info.graph, plan.schedule).recomputations > 0
            forward_gm, backward_gm = partition_with_plan(info, plan)
        step = captured.compile(forward_gm, backward_gm)
    xr = x.detach().clone().requires_grad_()
    out = captured.sig.rebuild_outputs(step(*captured.sig.flatten((xr,), {})))
    out.pow(2).mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = model(x)
    ref.pow(2).mean().backward()
    assert torch.equal(out, ref) and torch.allclose(xr.grad, x.grad, rtol=1e-5, atol=1e-7)
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-5, atol=1e-7), n


def test_a_module_traced_again_gives_the_same_graph():
    """Tracing is deterministic within a process: a module that writes into slices of a sliced
    buffer (fake ops whose cached outputs once had other storages than computed ones) gives the
    same graph, bytes and fingerprint on every trace."""
    class Chunks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(13, 13)

        def forward(self, x):
            y = self.fc(x)
            buf = y.new_zeros(y.shape[0], y.shape[1] + 1, 14)[:, 1:]
            buf[:, :, 1:] = y
            buf[:, :3, :5] = y[:, :3, :5] * 2
            return torch.tanh(buf).sum()

    m, x = Chunks(), torch.randn(3, 7, 13)
    graphs = [remat.capture(m, (x,), quiet=True) for _ in range(3)]
    assert len({g.fingerprint() for g in graphs}) == 1
    assert all([v.out_bytes for v in g.nodes] == [v.out_bytes for v in graphs[0].nodes] for g in graphs)


class ReentrantCheckpointed(nn.Module):
    """Blocks the model checkpoints itself, with torch.utils.checkpoint's reentrant variant."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.embed = nn.Linear(8, 8)  # the checkpointed blocks' input requires grad, as an embedding's output
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return x.sum()


def test_reentrant_checkpointing_is_named_with_what_to_do():
    """A model checkpointing its own blocks with use_reentrant=True cannot be traced: the error says
    to turn that off or use use_reentrant=False; with use_reentrant=False remat plans the step and
    trains it as eager does."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    with pytest.raises(remat.TraceError, match=r"use_reentrant=True\).*gradient_checkpointing_disable"):
        remat.optimize(ReentrantCheckpointed(True), example_inputs=(x,), solver="keep_all", quiet=True)
    model = ReentrantCheckpointed(False)
    opt = remat.optimize(model, example_inputs=(x,), solver="keep_all", quiet=True)
    opt(x).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))


class _RunsItsLayer(torch.autograd.Function):
    """A reversible layer's custom backward: it runs the layer again on its saved input."""

    @staticmethod
    def forward(ctx, x, layer, *params):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            grads = torch.autograd.grad(ctx.layer(x), [x, *ctx.layer.parameters()], g)
        return (grads[0], None, *grads[1:])


class Reversible(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))

    def forward(self, x):
        return _RunsItsLayer.apply(x, self.layer, *self.layer.parameters()).pow(2).mean()


def test_a_custom_function_running_a_submodule_is_named_as_the_cause():
    # torch's own message ("Please convert all Tensors to FakeTensors ... Parameter containing")
    # said nothing of the cause (Reformer's reversible layers)
    with pytest.raises(remat.TraceError, match="custom torch.autograd.Function"):
        remat.optimize(Reversible(), example_inputs=(torch.randn(4, 16),), solver="keep_all", quiet=True)


class PythonLayerDrop(nn.Module):
    """LayerDrop written with Python's RNG: each layer but the first is skipped with probability 0.5."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        import random

        for i, layer in enumerate(self.layers):
            if i == 0 or random.random() >= 0.5:
                x = torch.tanh(layer(x))
        return x.pow(2).mean()


def test_a_forward_drawing_from_pythons_rng_is_not_frozen_into_the_plan():
    # traced whole, the trace's draws were replayed at every step: the same layers skipped forever
    import copy
    import random
    import warnings

    from remat.blockwise import BlockwiseModule

    torch.manual_seed(0)
    model = PythonLayerDrop()
    eager = copy.deepcopy(model)
    x = torch.randn(8, 16)
    with pytest.raises(remat.TraceError, match="random.*same at every step"):
        remat.optimize(model, example_inputs=(x,), solver="keep_all", quiet=True)
    # from this state the recording forwards skip layers.1, which then takes layers.0's call (an input
    # that does not require grad) and raised InfeasibleBudgetError when a step ran it (BlockBudgetWarning now)
    random.seed(3)
    with warnings.catch_warnings():  # BlockwisePlanWarning, said once per process
        warnings.simplefilter("ignore")
        opt = remat.optimize(model, budget_bytes=2**30, example_inputs=(x,), quiet=True)
    assert isinstance(opt, BlockwiseModule)
    losses = []
    for m, call in ((model, opt), (eager, eager)):
        random.seed(3)
        losses.append([call(x).item() for _ in range(6)])
    assert losses[0] == losses[1] and len(set(losses[0])) > 1


class _CheckedTokens(nn.Module):
    """Checks a fact about its input's values as library code does (torch._check_tensor_all: an
    image-token count, here that every mark is non-negative), then computes from it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, marks):
        torch._check_tensor_all((marks >= 0).all())
        h = torch.tanh(self.a(x)) * (marks.unsqueeze(-1) + 1)
        return torch.sigmoid(self.b(h)).sum()


def test_a_tensor_check_of_the_model_stays_in_the_traced_step_and_runs_every_call():
    """The check reads a value a fake tensor does not have: traced, it becomes an assert op of the
    graph (graph_capture/tensor_checks.py), so the whole step is planned with eager's loss and
    gradients, and a later batch that breaks it still fails, in the planned step."""
    torch.manual_seed(0)
    model = _CheckedTokens()
    x, marks = torch.randn(64, 16), torch.randint(0, 3, (64,)).float()
    opt = remat.optimize(model, budget_gb=1, example_inputs=(x, marks), quiet=True)
    assert isinstance(opt, remat.RematModule)
    assert any(n.op.startswith("_assert_async") for n in opt.graph.nodes)
    for batch in ((x, marks), (torch.randn(64, 16), torch.randint(0, 3, (64,)).float())):
        ref = model(*batch)
        ref.backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        got = opt(*batch)
        got.backward()
        assert torch.allclose(got, ref) and all(torch.allclose(p.grad, w) for p, w in zip(model.parameters(), want))
        model.zero_grad()
    bad = marks.clone()
    bad[5] = -1.0
    with pytest.raises(RuntimeError):
        model(x, bad)
    with pytest.raises(RuntimeError, match="tensor check of the model failed"):
        opt(x, bad)


class SquaredNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 37), nn.Dropout(0.1), nn.GELU(), nn.Linear(37, 3))

    def forward(self, x):
        return self.net(x).pow(2).mean()


def test_a_step_traced_again_is_not_probed_again(monkeypatch):
    """Each op signature's workspace is probed once per process (graph_capture/workspace.py
    `_MEASURED`): a step traced again (the other loss head, a budget asked again) runs no probe and
    gets the same workspace and real output storages, node by node."""
    import remat.graph_capture.workspace as workspace

    ran = []
    run_cases = workspace.run_cases

    def counting(cases, *args, **kwargs):
        def each():
            for case in cases:
                ran.append(case[0])
                yield case
        return run_cases(each(), *args, **kwargs)

    monkeypatch.setattr(workspace, "run_cases", counting)
    torch.manual_seed(0)
    # a width no other test uses: its first trace probes
    model = SquaredNet()
    x = torch.randn(19, 8)
    first = remat.capture(model, (x,), quiet=True)
    probed = len(ran)
    again = remat.capture(model, (x,), quiet=True)
    assert probed > 0 and len(ran) == probed
    assert any(n.workspace_bytes > 0 for n in first.nodes)  # the dropout's mask is drawn as floats on CPU
    assert ([(n.name, n.out_bytes, n.workspace_bytes) for n in first.nodes]
            == [(n.name, n.out_bytes, n.workspace_bytes) for n in again.nodes])
