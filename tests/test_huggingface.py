"""Hugging Face models as people train them: a padded batch with its `attention_mask` and
`labels=` (the model computes its loss), dropout on. LLaMA, GPT-2, BERT, T5 and ViT, tiny configs
built in code (nothing downloaded). Each traces, trains one step under a budget between keep_all's
peak and the lowest one, with the eager model's loss and gradients, and peaks within the budget."""
import contextlib

import pytest
import torch

import remat
from remat.graph_capture import hf_compat, joint
from remat.solver import get_solver

pytest.importorskip("transformers")

from tests.hf_models import HF_MODELS, hf_batch, hf_model, hf_step  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*not a single loss:UserWarning")  # loss + logits returned


def _tensors(batch: dict) -> list[torch.Tensor]:
    return [v for v in batch.values() if isinstance(v, torch.Tensor)]


def _loss_grads_logits(module, params, batch, seed=0):
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    out = module(**batch)
    out.loss.backward()
    res = [out.loss.detach()] + [p.grad.clone() for p in params], out.logits.detach(), type(out)
    for p in params:
        p.grad = None
    return res


def _assert_close(got, ref):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


@pytest.mark.parametrize("name", HF_MODELS)
def test_trains_with_padding_mask_under_budget(name):
    model, batch = hf_model(name, dropout=0.1), hf_batch(name)
    params = list(model.parameters())
    graph = remat.capture(model, (), batch)
    keep = get_solver("keep_all")(graph, None).predicted_peak_bytes
    lowest = get_solver("equal_spacing")(graph, 1).predicted_peak_bytes
    assert lowest < keep
    budget = (keep + lowest) // 2
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=(), example_kwargs=batch,
                         solver="equal_spacing")
    assert opt.plan.extra_cost > 0  # it recomputes
    ref, ref_logits, ref_type = _loss_grads_logits(model, params, batch)
    got, logits, out_type = _loss_grads_logits(opt, params, batch)
    assert out_type is ref_type  # the model's own ModelOutput, loss and logits in it
    _assert_close(got, ref)
    assert torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
    peak = remat.measure_peak(hf_step(opt, batch), resident=[model, *_tensors(batch)])
    for p in params:
        p.grad = None
    assert peak <= budget, (peak, budget)
    # the graph holds the mask computation, not the example's mask: another padding pattern (and
    # a batch without padding, where eager Hugging Face drops the mask) trains as the model does
    other = hf_batch(name, seed=2)
    if "attention_mask" in other:
        other["attention_mask"] = torch.ones_like(other["attention_mask"])
        other["attention_mask"][0, -9:] = 0
        other["attention_mask"][2, -1:] = 0
        for mask in (other["attention_mask"], torch.ones_like(other["attention_mask"])):
            other["attention_mask"] = mask
            _assert_close(_loss_grads_logits(opt, params, other)[0], _loss_grads_logits(model, params, other)[0])
    else:
        _assert_close(_loss_grads_logits(opt, params, other)[0], _loss_grads_logits(model, params, other)[0])
    assert not torch.compiler.is_compiling()  # the tracing switch is off again


class _LossOf(torch.nn.Module):
    """The model's loss alone, as a training loop takes it (`model(**batch).loss`)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch).loss


def _loss_and_grads(module, params, batch):
    for p in params:
        p.grad = None
    loss = module(**batch)
    loss.backward()
    res = [loss.detach()] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return res


@pytest.mark.parametrize("padded", [False, True], ids=["no_attention_mask", "padded"])
def test_keep_all_never_peaks_above_the_model_as_it_is(padded):
    """LLaMA with its default attention (SDPA), no recomputation: never above the model run as it
    is, gradients as eager's, for the batch it was planned on and for other masks. Without
    `attention_mask`, eager passes SDPA is_causal=True and grouped K/V; the traced step once built
    a packed-sequence mask from the position ids instead (so repeat_kv copies and a float mask per
    layer), and copied the fused attention's output to merge its heads: 96 KiB above eager."""
    model, batch = _LossOf(hf_model("llama", dropout=0.0)), hf_batch("llama")
    assert model.model.config._attn_implementation == "sdpa"
    if not padded:
        del batch["attention_mask"]
    params = list(model.parameters())

    def step(module):
        return lambda: module(**batch).backward()

    eager = remat.measure_peak(step(model), resident=[model, *_tensors(batch)])
    ref = _loss_and_grads(model, params, batch)
    opt = remat.optimize(model, budget_bytes=2**40, example_inputs=(), example_kwargs=batch, solver="keep_all")
    assert opt.plan.extra_cost == 0
    planned = remat.measure_peak(step(opt), resident=[model, *_tensors(batch)])
    assert planned <= eager, (planned, eager)
    _assert_close(_loss_and_grads(opt, params, batch), ref)
    other = hf_batch("llama", seed=2)
    if not padded:  # the same graph for other tokens
        del other["attention_mask"]
        _assert_close(_loss_and_grads(opt, params, other), _loss_and_grads(model, params, other))
        return
    other["attention_mask"][0, -9:] = 0  # another padding pattern, and none (eager drops the mask)
    for mask in (other["attention_mask"], torch.ones_like(other["attention_mask"])):
        other["attention_mask"] = mask
        _assert_close(_loss_and_grads(opt, params, other), _loss_and_grads(model, params, other))


def test_packed_position_ids_keep_their_mask():
    """Position ids the caller passes can differ between batches: the graph keeps the
    packed-sequence mask (built from them) and is right for packed and unpacked ones alike."""
    model, batch = hf_model("llama", dropout=0.0), hf_batch("llama")
    del batch["attention_mask"]
    batch["position_ids"] = torch.arange(32).repeat(4, 1)
    params = list(model.parameters())
    opt = remat.optimize(model, budget_bytes=2**40, example_inputs=(), example_kwargs=batch, solver="keep_all")
    packed = dict(batch, position_ids=torch.cat([torch.arange(12), torch.arange(20)]).repeat(4, 1))
    for b in (batch, packed):
        _assert_close(_loss_grads_logits(opt, params, b)[0], _loss_grads_logits(model, params, b)[0])
    assert not torch.compiler.is_compiling()


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_padding_masks_do_not_trace_without_the_switch(name, monkeypatch):
    """What hf_compat fixes: Hugging Face's mask shortcuts read the padding mask's values."""
    model, batch = hf_model(name), hf_batch(name)
    monkeypatch.setattr(hf_compat, "traced_as_compiled", contextlib.nullcontext)
    monkeypatch.setattr(joint, "traced_as_compiled", contextlib.nullcontext, raising=False)  # if imported there
    with pytest.raises(remat.TraceError, match="DataDependentOutputException"):
        remat.capture(model, (), batch)


def test_llama_under_autocast_matches_eager_autocast():
    """Mixed precision on a Hugging Face model: attention dropout in SDPA's float32 math path,
    RMSNorm and rotary embeddings in float32, matmuls in bfloat16."""
    model, batch = hf_model("llama", dropout=0.1), hf_batch("llama")
    params = list(model.parameters())

    def run(module):
        for p in params:
            p.grad = None
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module(**batch).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in params]

    ref = run(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt = remat.optimize(model, budget_bytes=2**40, example_inputs=(), example_kwargs=batch, solver="keep_all")
    assert all(torch.equal(a, b) for a, b in zip(run(opt), ref))


def test_a_returned_cache_is_a_clear_error():
    """Without use_cache=False the decoders return their key/value cache: refused, saying what to pass."""
    model, batch = hf_model("gpt2"), hf_batch("gpt2")
    del batch["use_cache"]
    with pytest.raises(TypeError, match="use_cache=False"):
        remat.optimize(model, budget_bytes=2**40, example_inputs=(), example_kwargs=batch, solver="keep_all")


def test_a_causal_lm_without_attention_mask_traces_no_mask_where_hugging_face_skips_the_shortcut_when_tracing(
        monkeypatch):
    """Hugging Face up to 5.17 kept the causal mask whenever it was tracing, padding mask or not
    (`if is_tracing(padding_mask): return False`): a causal LM called without attention_mask traced a
    materialized (B, 1, S, S) mask, so its SDPA stayed unfused and ran cuDNN's masked backward, 2.8x
    eager's causal one on an H200. Without a padding mask the shortcut's answer depends on lengths
    alone: it is answered as eager, and the attention fuses as with newer versions."""
    import transformers.masking_utils as masking

    newer = masking._ignore_causal_mask_sdpa

    def as_in_5_17(padding_mask, *args, **kwargs):
        if masking.is_tracing(padding_mask):
            return False
        return newer(padding_mask, *args, **kwargs)

    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", as_in_5_17)
    model, batch = _LossOf(hf_model("llama", dropout=0.0)), hf_batch("llama")
    del batch["attention_mask"]
    params = list(model.parameters())
    opt = remat.optimize(model, budget_bytes=2**40, example_inputs=(), example_kwargs=batch, solver="keep_all")
    g = opt.graph
    assert sum(n.op == "flash_attention.default" for n in g.nodes) == model.model.config.num_hidden_layers
    assert not any("scaled_dot_product" in n.op for n in g.nodes)
    _assert_close(_loss_and_grads(opt, params, batch), _loss_and_grads(model, params, batch))
    assert masking._ignore_causal_mask_sdpa is as_in_5_17  # put back after tracing
    # a padding mask is still answered as under torch.compile: the graph keeps it
    padded = hf_batch("llama")
    g = remat.capture(model, (), padded, quiet=True)
    assert any("scaled_dot_product" in n.op for n in g.nodes)


def test_a_vision_language_model_checking_its_image_tokens_is_traced_whole():
    """LLaVA checks that a batch holds as many image tokens as its vision tower gives features
    (torch_compilable_check, a tensor check under the compile flag): the check stays in the traced
    step (graph_capture/tensor_checks.py), so the whole step is planned, not block by block, trains
    with eager's loss and gradients, and a batch with an image token missing still fails."""
    import transformers as tf

    torch.manual_seed(0)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=16, patch_size=8)
    text = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=32, pad_token_id=0)
    model = tf.LlavaForConditionalGeneration(tf.LlavaConfig(vision_config=vision, text_config=text,
                                                             image_token_index=63, vision_feature_layer=-1))
    model.train()
    ids = torch.randint(1, 60, (2, 16))
    ids[:, :4] = 63  # the four patches' tokens
    batch = dict(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16), labels=ids.masked_fill(ids == 63, -100),
                 use_cache=False)
    model(**batch).loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]  # not the vision tower's unread last norm
    ref, _, _ = _loss_grads_logits(model, params, batch)
    keep = remat.optimize(model, example_inputs=(), example_kwargs=batch, solver="keep_all", quiet=True)
    assert isinstance(keep, remat.RematModule)
    assert any(n.op.startswith("_assert_async") for n in keep.graph.nodes)
    floor = keep.graph.resident_bytes + sum(v.kept_bytes for v in keep.graph.nodes)
    budget = int(floor + 0.5 * (keep.plan.predicted_peak_bytes - floor))
    opt = remat.optimize(model, budget_bytes=budget, example_inputs=(), example_kwargs=batch, quiet=True)
    got, _, _ = _loss_grads_logits(opt, params, batch)
    _assert_close(got, ref)
    bad = dict(batch, input_ids=ids.clone())
    bad["input_ids"][0, 0] = 5
    with pytest.raises(ValueError):
        model(**bad)
    with pytest.raises(RuntimeError, match="tensor check of the model failed"):
        opt(**bad)
