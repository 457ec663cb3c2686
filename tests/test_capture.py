import torch

import remat
from remat.graph_capture import TrainingGraph
from remat.measure import count_flops, resident_bytes
from tests.models import DataDependent, KwargsNet, small_gpt


def test_capture_gpt_structure():
    model, inputs = small_gpt()
    g = remat.capture(model, inputs)
    fwd, bwd = g.forward_nodes, g.backward_nodes
    assert len(fwd) > 20 and len(bwd) > 20
    # a topological order with the whole forward first
    assert [n.is_backward for n in g.nodes] == sorted(n.is_backward for n in g.nodes)
    # parameters, buffers, inputs (and the scalar loss tangent) are resident
    expected = resident_bytes([model, *inputs])
    assert expected <= g.resident_bytes <= expected + 16
    # views allocate nothing, so none of them is a node of its own
    assert not any(n.op in ("view.default", "t.default", "transpose.int", "expand.default") for n in g.nodes)
    # the gradients of all parameters are kept outputs of the backward
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(n.kept_bytes for n in bwd) >= param_bytes
    assert all(n.cost > 0 for n in g.nodes)


def test_capture_marks_dropout_masks_random_and_small():
    model, inputs = small_gpt()
    g = remat.capture(model, inputs)
    random = [n for n in g.nodes if n.is_random]
    assert random and all(n.op.startswith("native_dropout") for n in random)
    assert all(not n.recomputable for n in random)
    # the mask is bool: 1 byte per element of the (B, T, C) residual stream or (B, h, T, T) probs
    B, T = inputs[0].shape
    sizes = {n.out_bytes for n in random}
    assert sizes <= {B * T * 64, B * 4 * T * T}


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
    model = KwargsNet()
    x, t = torch.randn(16, 32), torch.randn(16, 32)
    g = remat.capture(model, (x,), {"target": t, "scale": 0.5})
    assert len(g.nodes) > 5


def test_untraceable_model_names_the_source_line():
    model = DataDependent()
    try:
        remat.capture(model, (torch.randn(4, 8),))
    except remat.TraceError as e:
        assert "models.py" in str(e) and "h.sum() > 0" in str(e)
    else:
        raise AssertionError("tracing data-dependent control flow should fail")


def test_nothing_requires_grad_is_an_error():
    model = KwargsNet().requires_grad_(False)
    try:
        remat.capture(model, (torch.randn(4, 32),), {"target": torch.randn(4, 32)})
    except remat.TraceError as e:
        assert "requires grad" in str(e)
    else:
        raise AssertionError("expected TraceError")
