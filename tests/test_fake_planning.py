"""Planning without the memory (`remat.plan`, graph_capture/fake_capture.py): a plan made on a model
on the meta device or of fake tensors, with fake inputs, is the plan of the real graph: the same
fingerprint and prediction, and deployed on the real model it peaks as predicted with the
unmodified model's gradients, bit for bit. A CUDA plan counts bytes as CUDA's allocator does (512-
byte blocks); workspaces that could not be measured at their real shapes are listed."""
import json

import pytest
import torch

import remat
from remat.compat.torch_private import fake_tensor_mode
from remat.default_model import GPT, GPTConfig, default_inputs, default_model
from remat.graph_capture.scaled_workspace import _extrapolate, _restride
from remat.measure import measure_peak
from remat.planning import capture_without_memory, plan_details
from remat.report import training_step

CFG = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1, batch_size=2)


def meta_gpt(cfg: GPTConfig = CFG):
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.empty(cfg.batch_size, cfg.block_size, dtype=torch.long, device="meta")
    return model, (idx, torch.empty_like(idx))


@pytest.fixture(scope="module")
def real_graph():
    return remat.capture(default_model(CFG), default_inputs(CFG))


def test_plan_on_meta_deploys_on_the_real_model(real_graph):
    model, inputs = meta_gpt()
    budget = int(0.8 * remat.solve(real_graph, None, solver="keep_all").predicted_peak_bytes)
    plan = remat.plan(model, inputs, budget_bytes=budget, solver="equal_spacing")
    assert plan.fits and plan.recomputed, plan  # a plan that recomputes, within its budget
    assert plan.graph_fingerprint == real_graph.fingerprint()
    assert plan.details["estimated_workspaces"] == []  # every op small enough to measure for real
    assert plan.details["planned_for"] == "cpu" and all(p.is_meta for p in model.parameters())

    real, real_inputs = default_model(CFG), default_inputs(CFG)
    params = list(real.parameters())
    eager = training_step(real, params, real_inputs)
    eager.fresh()
    torch.manual_seed(0)
    loss = eager().detach().clone()
    grads = [p.grad.clone() for p in params]
    eager.fresh()

    opt = remat.optimize(real, example_inputs=real_inputs, plan=plan)
    assert opt.plan.predicted_peak_bytes == plan.predicted_peak_bytes  # judged again: the same
    step = training_step(opt, params, real_inputs)
    step.fresh()
    assert measure_peak(step, resident=[real, *real_inputs]) == plan.predicted_peak_bytes
    step.fresh()
    torch.manual_seed(0)
    assert torch.equal(step().detach(), loss)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))


def test_cuda_plan_rounds_every_allocation_to_512_bytes(monkeypatch):
    model, inputs = meta_gpt()
    g = capture_without_memory(model, inputs, device="cuda")
    # dropout replayed from the CUDA generator's saved state: 16 bytes, one block
    states = [n for n in g.nodes if n.op == "rng_state.default"]
    assert states and all(n.out_bytes == 512 for n in states)
    # the rest against the CPU graph, both with every mask kept (the CPU's state is mt19937's)
    monkeypatch.setattr("remat.graph_capture.rewrites.make_dropout_replayable", lambda gm, device_type: 0)
    g = capture_without_memory(model, inputs, device="cuda")
    real_graph = remat.capture(default_model(CFG), default_inputs(CFG))
    assert g.fingerprint() == real_graph.fingerprint()  # the traced sizes are what is hashed
    sizes = [g.resident_bytes] + [b for b, _ in g.tangents]
    sizes += [b for n in g.nodes for b in (n.out_bytes, n.kept_bytes, n.workspace_bytes)]
    sizes += [b for n in g.nodes for b, _ in n.out_parts + n.forward_kept]
    assert all(b % 512 == 0 for b in sizes)
    # the same nodes as the CPU graph, none smaller, and the parameters each in its own blocks
    assert [n.name for n in g.nodes] == [n.name for n in real_graph.nodes]
    assert all(a.out_bytes >= b.out_bytes for a, b in zip(g.nodes, real_graph.nodes))
    assert g.meta["traced_resident_bytes"] == real_graph.resident_bytes  # the unrounded bytes, hashed
    params = sum(-(-p.numel() * 4 // 512) * 512 for p in model.parameters())  # each in its own blocks
    assert g.resident_bytes >= params + real_graph.resident_bytes - sum(p.numel() * 4 for p in model.parameters())
    plan = remat.solve(g, None, solver="keep_all")
    details = plan_details(g)
    assert plan.predicted_peak_bytes % 512 == 0 and details["memory_model"].startswith("cuda")
    if not torch.cuda.is_available():  # nothing to measure on: every op that allocates is listed
        est = details["estimated_workspaces"]
        listed = {name for e in est for name in e["nodes"]}
        assert {e["method"] for e in est} <= {"formula", "unmeasured"}
        assert all(n.name in listed for n in g.nodes)
        json.dumps(details)  # saved with the plan


def test_workspaces_too_large_to_probe_are_scaled_and_listed(real_graph):
    model, inputs = meta_gpt()
    g = capture_without_memory(model, inputs, limits=remat.planning.ProbeLimits(max_bytes=20_000))
    assert g.fingerprint() == real_graph.fingerprint()
    est = g.meta["estimated_workspaces"]
    scaled = [e for e in est if e["method"] == "scaled"]
    assert scaled and all(e["probed_at"] and 0 < e["io_fraction"] < 1 for e in scaled)
    # the estimates against the real measurements: dropout's float mask (4 bytes an element) and
    # CPU's small scratch buffers alike, within 64 bytes or 5%
    ws = {n.name: n.workspace_bytes for n in g.nodes}
    for n in real_graph.nodes:
        assert abs(ws[n.name] - n.workspace_bytes) <= max(64, 0.05 * n.workspace_bytes), n.name
    assert sum(n.workspace_bytes for n in real_graph.nodes) > 100_000  # the comparison is not vacuous
    assert [(n.out_bytes, n.kept_bytes) for n in g.nodes] == [(n.out_bytes, n.kept_bytes) for n in real_graph.nodes]


def test_a_model_of_fake_tensors_inside_a_fake_mode(real_graph):
    """A model built under the caller's FakeTensorMode, planned while that mode is active, with its
    own parameters given back afterwards."""
    mode = fake_tensor_mode()
    with mode:
        torch.manual_seed(0)
        model = GPT(CFG)
        idx = torch.zeros(CFG.batch_size, CFG.block_size, dtype=torch.long)
        before = list(model.parameters())
        g = capture_without_memory(model, (idx, idx.clone()))
    assert g.fingerprint() == real_graph.fingerprint()
    assert all(a is b for a, b in zip(model.parameters(), before))


def test_a_real_model_is_left_as_it_was_and_its_masks_are_read():
    """A real model planned for a larger batch: its tensors and the random generator are untouched,
    and the causal-mask buffer's values are read, so attention without dropout is fused as the
    real capture fuses it. On the meta device the mask has no values: attention stays unfused,
    and the plan is another graph's (remat.optimize refuses it: PlanMismatchError)."""
    cfg = GPTConfig(**{**CFG.__dict__, "dropout": 0.0, "batch_size": 8, "n_layer": 1})
    model = default_model(cfg)
    params = [p.clone() for p in model.parameters()]
    big = torch.empty(cfg.batch_size, cfg.block_size, dtype=torch.long, device="meta")
    state = torch.random.get_rng_state()
    plan = remat.plan(model, (big, big.clone()), solver="keep_all")
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    real = remat.capture(model, default_inputs(cfg))
    assert plan.graph_fingerprint == real.fingerprint()
    assert any(n.op.startswith("flash_attention") for n in real.nodes)

    meta_model, inputs = meta_gpt(cfg)
    unfused = remat.plan(meta_model, inputs, solver="keep_all")
    assert unfused.graph_fingerprint != real.fingerprint()
    assert unfused.details["buffers_without_data"] == ["h.0.attn.causal_mask"]
    assert plan.details["buffers_without_data"] == []


def test_tied_weights_and_bad_devices():
    cfg = GPTConfig(**{**CFG.__dict__, "n_layer": 1})
    model, inputs = meta_gpt(cfg)
    model.lm_head.weight = model.wte.weight
    real = default_model(cfg)
    real.lm_head.weight = real.wte.weight
    plan = remat.plan(model, inputs, solver="keep_all")
    assert plan.graph_fingerprint == remat.capture(real, default_inputs(cfg)).fingerprint()
    assert model.lm_head.weight is model.wte.weight
    for bad in ("tpu", "meta", 3):
        with pytest.raises(remat.RematArgumentError):
            remat.plan(model, inputs, budget_bytes=2**62, device=bad)


def test_extrapolation_and_strides():
    # a constant plus a proportional part (a line), a part growing like one dimension (a power law)
    line = [(x, 100 + 4 * x) for x in (4000, 2000, 1000)]
    assert _extrapolate(line, 64_000) == 100 + 4 * 64_000
    root = [(x, int(2 * x ** 0.5)) for x in (40_000, 10_000, 2_500)]  # e.g. rows x cols both shrunk
    assert _extrapolate(root, 640_000) == pytest.approx(2 * 800, rel=0.01)
    assert _extrapolate([(4000, 0), (2000, 0), (1000, 0)], 10**9) == 0
    assert _extrapolate([(1000, 40)], 4000) == 160
    # a slice of a wider tensor keeps its gap; a transposed one its order; a broadcast one its 0
    assert _restride((8, 64, 64), (64 * 192, 192, 1), (8, 16, 16)) == (16 * 48, 48, 1)
    assert _restride((64, 32), (1, 64), (16, 32)) == (1, 16)
    assert _restride((4, 64), (0, 1), (4, 16)) == (0, 1)


def test_a_large_model_is_planned_without_its_memory():
    """A GPT whose step peaks above 1 GB planned for CUDA: no real tensor memory is allocated while
    planning (the profiler's count of every CPU allocation), the model's parameters stay on meta."""
    cfg = GPTConfig(vocab_size=8192, block_size=512, n_layer=1, n_head=8, n_embd=1024, batch_size=16,
                    dropout=0.1, attn_dropout=0.0, attention="sdpa")
    model, inputs = meta_gpt(cfg)
    plans = []
    held = measure_peak(lambda: plans.append(remat.plan(model, inputs, solver="keep_all",
                                                        device="cuda")))
    assert plans[0].predicted_peak_bytes > 1e9 and held < 1e6, (plans[0].predicted_peak_bytes, held)
    assert all(p.is_meta for p in model.parameters())
