"""Issue #3 integration: SDPA calls become one remat::flash_attention node whose saved memory is
linear in the sequence length; the optimized module still matches eager (CPU fallback path)."""
import math

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.report import reference_step, run_strategy
from remat.runtime.attention import route_attention
from remat.solver import get_solver

CFG = dict(vocab_size=128, block_size=128, n_layer=2, n_head=4, n_embd=64, batch_size=2, attn_dropout=0.0)


def _gpt(attention: str):
    cfg = GPTConfig(**CFG, attention=attention)
    return default_model(cfg), default_inputs(cfg), cfg


def test_fused_graph_has_no_quadratic_node_and_fits_lower_budgets():
    model, inputs, cfg = _gpt("sdpa")
    g = remat.capture(model, inputs)
    s2 = cfg.batch_size * cfg.n_head * cfg.block_size**2 * 4  # one fp32 (B, H, S, S) tensor
    flash = [n for n in g.nodes if n.op.startswith("flash_attention")]
    assert len(flash) == 2 * cfg.n_layer  # one forward and one backward node per layer
    assert max(n.out_bytes + n.kept_bytes for n in g.nodes) < s2
    assert max(n.workspace_bytes for n in g.nodes) < s2
    explicit_model, explicit_inputs, _ = _gpt("explicit")
    ge = remat.capture(explicit_model, explicit_inputs, fused_attention=False)
    assert max(n.out_bytes for n in ge.nodes) >= s2  # the explicit pattern saves s x s scores
    lowest = lambda graph: get_solver("equal_spacing")(graph, 1).predicted_peak_bytes  # noqa: E731
    keep = lambda graph: get_solver("keep_all")(graph, None).predicted_peak_bytes  # noqa: E731
    assert keep(g) < keep(ge) and lowest(g) < lowest(ge)


def test_fused_module_matches_eager_sdpa_with_dropout_elsewhere():
    model, inputs, _ = _gpt("sdpa")  # residual/MLP dropout stays on
    ref = reference_step(model, inputs, seed=0)
    keep = run_strategy(model, inputs, "keep_all", None, reference=ref)
    assert keep.grads_match, keep.max_grad_err
    row = run_strategy(model, inputs, "equal_spacing", int(0.8 * keep.measured_peak_bytes), reference=ref)
    assert row.grads_match, row.max_grad_err
    assert row.measured_peak_bytes <= row.budget_bytes
    assert abs(row.measured_over_predicted - 1) <= 0.05
    # eager CPU SDPA has no FLOP formula, so compare with the keep_all module's measured FLOPs
    assert row.extra_flops_measured - keep.extra_flops_measured == row.extra_flops_predicted > 0


def test_router_leaves_what_it_cannot_take():
    q = k = v = torch.randn(1, 2, 8, 16)
    with route_attention() as router:
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert router.routed == 1 and len(router.passed) == 2
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)


# ---- the explicit softmax(QK^T * scale)V pattern -------------------------------------------------
def test_explicit_pattern_is_traced_as_the_fused_op():
    model, inputs, cfg = _gpt("explicit")  # attn_dropout=0: the chain can be fused
    g = remat.capture(model, inputs)
    s2 = cfg.batch_size * cfg.n_head * cfg.block_size**2 * 4
    assert len([n for n in g.nodes if n.op.startswith("flash_attention")]) == 2 * cfg.n_layer
    assert max(n.out_bytes + n.kept_bytes for n in g.nodes) < s2  # the traced scores were dead code
    sdpa_model, sdpa_inputs, _ = _gpt("sdpa")
    assert len(g.nodes) == len(remat.capture(sdpa_model, sdpa_inputs).nodes)
    unfused = remat.capture(model, inputs, fused_attention=False)
    assert max(n.out_bytes for n in unfused.nodes) >= s2


def test_explicit_pattern_module_matches_the_unmodified_model():
    model, inputs, _ = _gpt("explicit")
    ref = reference_step(model, inputs, seed=0)  # eager explicit attention, dropout elsewhere on
    keep = run_strategy(model, inputs, "keep_all", None, reference=ref)
    row = run_strategy(model, inputs, "equal_spacing", int(0.8 * keep.measured_peak_bytes), reference=ref)
    assert keep.grads_match and row.grads_match, (keep.max_grad_err, row.max_grad_err)
    assert row.measured_peak_bytes <= row.budget_bytes


class _Attn(torch.nn.Module):
    """Explicit attention spelled in the ways models spell it."""

    def __init__(self, s: int, variant: str, p: float = 0.0):
        super().__init__()
        self.variant, self.p = variant, p
        self.register_buffer("bias", torch.tril(torch.ones(s, s)).view(1, 1, s, s))  # minGPT: float 0/1

    def forward(self, q, k, v):
        T, d = q.shape[-2], q.shape[-1]
        if self.variant == "div_mT_tril_in_forward":
            att = torch.matmul(q, k.mT) / math.sqrt(d)
            causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=q.device))
            att = att.masked_fill(causal.logical_not(), float("-inf"))
        elif self.variant == "float_buffer_eq_0":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        elif self.variant == "no_mask_upcast":
            att = (q @ k.transpose(-1, -2)).float() * 0.3
        elif self.variant == "llama_additive_mask":  # LLaMA: scores / sqrt(d) + triu(full(-inf), 1)
            att = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)
            mask = torch.triu(torch.full((T, T), float("-inf"), device=q.device), diagonal=1)
            att = mask + att.float()
        elif self.variant == "band_mask":  # sliding window: not what the fused op computes
            band = torch.ones(T, T, dtype=torch.bool).triu(1) | torch.ones(T, T, dtype=torch.bool).tril(-4)
            att = (q @ k.transpose(-2, -1)).masked_fill(band, float("-inf"))
        att = F.softmax(att, dim=-1).to(v.dtype)
        return F.dropout(att, self.p, self.training) @ v


@pytest.mark.parametrize("variant,causal,scale", [("div_mT_tril_in_forward", True, None),
                                                  ("float_buffer_eq_0", True, None),
                                                  ("no_mask_upcast", False, 0.3),
                                                  ("llama_additive_mask", True, None)])
def test_explicit_variants_are_routed(variant, causal, scale):
    q, k, v = (torch.randn(2, 3, 16, 8, requires_grad=True) for _ in range(3))
    mod = _Attn(16, variant)
    with route_attention(model=mod) as router:
        out = mod(q, k, v)
    assert router.routed == 1 and router.passed == []
    expect = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    assert torch.allclose(out, expect, atol=1e-5)
    g_out, g_ref = torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(expect.sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_out, g_ref))


def test_explicit_attention_the_op_cannot_take_is_left_alone():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    band = _Attn(16, "band_mask")
    with route_attention(model=band) as router:
        out = band(q, k, v)
    assert router.routed == 0 and any("not recognised as causal" in r for r in router.passed)
    assert torch.equal(out, band(q, k, v))  # computed by the model's own code
    drop = _Attn(16, "float_buffer_eq_0", p=0.5)
    with route_attention(model=drop) as router:
        drop(q, k, v)
    assert router.routed == 0 and router.passed == ["explicit attention: dropout p=0.5 on the probabilities (fuse_dropout is off)"]
    drop.eval()  # no dropout at eval: fusable again
    with route_attention(model=drop) as router:
        drop(q, k, v)
    assert router.routed == 1


# ---- attention dropout, fused on request ---------------------------------------------------------
def test_attention_dropout_is_fused_only_when_asked():
    cfg = GPTConfig(**{**CFG, "attn_dropout": 0.1}, attention="explicit")
    model, inputs = default_model(cfg), default_inputs(cfg)
    s2 = cfg.batch_size * cfg.n_head * cfg.block_size**2 * 4
    exact = remat.capture(model, inputs)  # default: the model's own dropout, so its s x s tensors
    assert not any(n.op.startswith("flash_attention") for n in exact.nodes)
    assert max(n.out_bytes for n in exact.nodes) >= s2
    for attention in ("explicit", "sdpa"):
        cfg = GPTConfig(**{**CFG, "attn_dropout": 0.1}, attention=attention)
        g = remat.capture(default_model(cfg), default_inputs(cfg), fused_attention="all")
        assert len([n for n in g.nodes if n.op.startswith("flash_attention")]) == 2 * cfg.n_layer
        assert max(n.out_bytes + n.kept_bytes for n in g.nodes) < s2
        # one seed per layer, drawn from torch's generator: random, tiny, never recomputed
        assert len([n for n in g.nodes if n.is_random and n.op.startswith("randint")]) == cfg.n_layer


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_fused_dropout_module_matches_the_eagerly_fused_model(attention):
    cfg = GPTConfig(**{**CFG, "attn_dropout": 0.1}, attention=attention)
    model, inputs = default_model(cfg), default_inputs(cfg)
    ref = reference_step(model, inputs, seed=0, fused_attention="all")
    keep = run_strategy(model, inputs, "keep_all", None, reference=ref, fused_attention="all")
    row = run_strategy(model, inputs, "equal_spacing", int(0.85 * keep.measured_peak_bytes), reference=ref,
                       fused_attention="all")
    assert row.plan.extra_flops > 0  # something is recomputed, the fused attention included
    for r in (keep, row):
        assert r.grads_match and r.max_grad_err == 0.0, (r.strategy, r.max_grad_err)
    assert row.measured_peak_bytes <= row.budget_bytes
    unfused = reference_step(model, inputs, seed=0, fused_attention=True)
    assert not torch.equal(unfused[0], ref[0])  # other dropout masks than torch's, as documented


def test_fused_attention_option_is_checked():
    model, inputs, _ = _gpt("sdpa")
    with pytest.raises(ValueError, match="fused_attention"):
        remat.capture(model, inputs, fused_attention="yes")


def test_explicit_cross_attention_and_scores_used_elsewhere():
    q = torch.randn(2, 4, 10, 8, requires_grad=True)
    k, v = torch.randn(2, 4, 14, 8), torch.randn(2, 4, 14, 8)
    with route_attention() as router:
        out = F.softmax((q @ k.mT) * 0.5, dim=-1) @ v  # Sq != Sk, no mask
    assert router.routed == 1
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, scale=0.5), atol=1e-6)
    bias = torch.randn(10, 14)
    with route_attention() as router:  # an additive bias is not the fused op's function
        out = F.softmax((q @ k.mT) * 0.5 + bias, dim=-1) @ v
    assert router.routed == 0
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.5), atol=1e-6)


def test_recomputed_fused_attention_with_dropout_regenerates_its_masks():
    """A plan that keeps no fused-attention output recomputes the op in the backward from its kept
    seed: the module is still bit-identical to the eagerly fused model."""
    from remat.solver.plan import plan_from_schedule
    from remat.solver.schedule import schedule_from_kept

    cfg = GPTConfig(**{**CFG, "attn_dropout": 0.1}, attention="explicit")
    model, inputs = default_model(cfg), default_inputs(cfg)
    g = remat.capture(model, inputs, fused_attention="all")
    flash = {n.name for n in g.forward_nodes if n.op.startswith("flash_attention")}
    kept = {n.name for n in g.forward_nodes} - flash
    plan = plan_from_schedule(g, schedule_from_kept(g, kept), strategy="drop_attention", budget_bytes=None,
                              status="heuristic")
    assert flash <= set(plan.recomputed) and plan.extra_flops > 0
    ref = reference_step(model, inputs, seed=0, fused_attention="all")
    row = run_strategy(model, inputs, "keep_all", None, reference=ref, plan=plan, fused_attention="all")
    assert row.grads_match and row.max_grad_err == 0.0, row.max_grad_err
    assert row.extra_flops_measured == plan.extra_flops
