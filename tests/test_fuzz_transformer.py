"""Fuzz: small random language models under random budgets and every strategy, spelled the ways
current LMs are: RMSNorm or LayerNorm, rotary or learned positions, SwiGLU or GELU (exact or tanh)
MLPs, SDPA (is_causal, or a boolean causal-and-padding mask) or explicit softmax attention, grouped-
query attention, attention, residual and embedding dropout, tied input and output embeddings, a
padding_idx, ignore_index targets and label smoothing; each run with fused_attention True, False or
"all". Each net is drawn from its seed; the check is tests/fuzz_check.py's: loss, gradients and
buffers equal the unmodified model's after a step (not compared where "all" fuses attention dropout:
its masks come from remat's own generator), measured peak == predicted <= budget."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from tests.fuzz_scale import fuzz_count
from tests.fuzz_check import optimize_and_compare

V = 64  # vocabulary
STRATEGIES = ["checkmate", "checkmate", "equal_spacing", "chen_greedy", "per_block", "selective", "revolve",
              "keep_all"]


class RMSNorm(nn.Module):
    """LLaMA's."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rotary(x, pos):
    """Rotary position embedding on interleaved pairs, its angles computed in forward."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device).float() / d))
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Block(nn.Module):
    """Pre-norm attention and MLP, each added back through dropout."""

    def __init__(self, c, h, kv, cfg):
        super().__init__()
        self.cfg, self.h, self.kv, self.d = cfg, h, kv, c // h
        norm = RMSNorm if cfg["norm"] == "rms" else nn.LayerNorm
        self.n1, self.n2 = norm(c), norm(c)
        self.q = nn.Linear(c, c, bias=cfg["bias"])
        self.kvp = nn.Linear(c, 2 * kv * self.d, bias=cfg["bias"])
        self.o = nn.Linear(c, c, bias=cfg["bias"])
        if cfg["mlp"] == "swiglu":
            self.w1, self.w3 = nn.Linear(c, 2 * c, bias=False), nn.Linear(c, 2 * c, bias=False)
            self.w2 = nn.Linear(2 * c, c, bias=False)
        else:
            self.fc, self.proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.drop = nn.Dropout(cfg["resid_p"])
        self.attn_p = cfg["attn_p"]

    def attn(self, x, pad):
        b, t, c = x.shape
        q = self.q(x).view(b, t, self.h, self.d).transpose(1, 2)
        k, v = self.kvp(x).view(b, t, 2, self.kv, self.d).permute(2, 0, 3, 1, 4)
        if self.cfg["pos"] == "rotary":
            pos = torch.arange(t, device=x.device)
            q, k = rotary(q, pos), rotary(k, pos)
        if self.kv != self.h:
            k = k.repeat_interleave(self.h // self.kv, dim=1)
            v = v.repeat_interleave(self.h // self.kv, dim=1)
        p = self.attn_p if self.training else 0.0
        if self.cfg["attn"] == "sdpa":
            if pad is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
            else:
                causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
                mask = causal[None, None] & pad[:, None, None, :]
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.d)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~causal, float("-inf"))
            if pad is not None:
                att = att.masked_fill(~pad[:, None, None, :], float("-inf"))
            att = F.dropout(att.softmax(-1), p, self.training)
            y = att @ v
        return self.o(y.transpose(1, 2).reshape(b, t, c))

    def mlp(self, x):
        if self.cfg["mlp"] == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.proj(F.gelu(self.fc(x), approximate=self.cfg["gelu"]))

    def forward(self, x, pad):
        x = x + self.drop(self.attn(self.n1(x), pad))
        return x + self.drop(self.mlp(self.n2(x)))


class LM(nn.Module):
    """Token embedding [+ learned positions], the blocks, a final LayerNorm, a [tied] head, cross-entropy."""

    def __init__(self, cfg):
        super().__init__()
        c, h = cfg["c"], cfg["h"]
        self.cfg = cfg
        self.emb = nn.Embedding(V, c, padding_idx=0 if cfg["padidx"] else None)
        if cfg["pos"] == "learned":
            self.pos = nn.Embedding(32, c)
        self.blocks = nn.ModuleList(Block(c, h, cfg["kv"], cfg) for _ in range(cfg["layers"]))
        self.nf = nn.LayerNorm(c)
        self.head = nn.Linear(c, V, bias=False)
        if cfg["tie"]:
            self.head.weight = self.emb.weight
        self.edrop = nn.Dropout(cfg["emb_p"])

    def forward(self, idx, targets, pad=None):
        x = self.emb(idx)
        if self.cfg["pos"] == "learned":
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        x = self.edrop(x)
        for blk in self.blocks:
            x = blk(x, pad)
        logits = self.head(self.nf(x))
        return F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-100,
                               label_smoothing=self.cfg["smooth"])


def _case(seed: int) -> dict:
    rng = random.Random(seed)
    h = rng.choice([2, 4])
    return dict(c=h * rng.choice([4, 8]), h=h, kv=rng.choice([1, h]), layers=rng.randint(1, 3),
                norm=rng.choice(["rms", "ln"]), bias=rng.random() < 0.5, mlp=rng.choice(["swiglu", "gelu"]),
                gelu=rng.choice(["none", "tanh"]), pos=rng.choice(["rotary", "learned"]),
                attn=rng.choice(["sdpa", "explicit"]), attn_p=rng.choice([0.0, 0.0, 0.1]),
                resid_p=rng.choice([0.0, 0.1]), emb_p=rng.choice([0.0, 0.1]), tie=rng.random() < 0.5,
                padidx=rng.random() < 0.3, smooth=rng.choice([0.0, 0.1]), batch=rng.choice([2, 4]),
                seq=rng.choice([8, 16]), ignore=rng.random() < 0.5, padded=rng.random() < 0.3,
                fused=rng.choice([True, False, "all"]), frac=rng.uniform(0.4, 1.1))


# every strategy on a net of its own (checkmate on 2): 8 nets, more under REMAT_FUZZ_SCALE
CASES = [(solver, seed) for seed, solver in enumerate(STRATEGIES * fuzz_count(1))]


@pytest.mark.parametrize("solver,seed", CASES, ids=[f"{solver}-{seed}" for solver, seed in CASES])
def test_random_language_models_and_budgets(solver, seed):
    cfg = _case(seed)
    torch.manual_seed(seed)
    model = LM(cfg)
    idx = torch.randint(1, V, (cfg["batch"], cfg["seq"]))
    targets = torch.randint(0, V, (cfg["batch"], cfg["seq"]))
    if cfg["ignore"]:
        targets[:, :2] = -100
    args = (idx, targets)
    if cfg["padded"]:
        pad = torch.ones(cfg["batch"], cfg["seq"], dtype=torch.bool)
        pad[0, -3:] = False
        args = (idx, targets, pad)
    exact = not (cfg["fused"] == "all" and cfg["attn_p"] > 0)
    try:
        optimize_and_compare(model, args, cfg["frac"], solver, seed, described=f"net {cfg}", exact=exact,
                             rtol=1e-5, atol=1e-5, fused_attention=cfg["fused"])
    except remat.NotAChainError:
        assert solver == "revolve"
