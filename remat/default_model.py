"""The built-in default model: a small GPT-style decoder (nanoGPT's shape) with its loss.

It is the model `remat demo` optimizes and the one the acceptance tests run: token embedding,
N pre-norm blocks of causal self-attention and an MLP (with dropout), a final norm, an LM head
and the cross-entropy loss, so one call is one full training step's forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "default_model", "default_inputs"]


@dataclass
class GPTConfig:
    vocab_size: int = 512  # tokens in the vocabulary
    block_size: int = 256  # longest sequence the position embedding covers
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 128  # residual stream width
    dropout: float = 0.1  # dropout after the embeddings, the projections and the MLP
    attn_dropout: float | None = None  # dropout on the attention probs (None: same as dropout)
    attention: str = "explicit"  # "explicit": softmax(QK^T * scale)V; "sdpa": F.scaled_dot_product_attention
    batch_size: int = 8  # batch of the example inputs

    def __post_init__(self):
        """Refuse a shape the model cannot run (e.g. a width the heads do not divide) here, with
        the field's name, rather than as a reshape error deep in the first forward."""
        from remat.validate import RematArgumentError, RematArgumentTypeError

        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise RematArgumentTypeError(f"GPTConfig.{name} must be an integer, got {type(v).__name__} {v!r}")
            if v < 1:
                raise RematArgumentError(f"GPTConfig.{name} must be at least 1, got {v}")
        if self.n_embd % self.n_head:
            raise RematArgumentError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if (self.n_embd // self.n_head) % 2:
            raise RematArgumentError(f"GPTConfig: the head dimension n_embd / n_head = {self.n_embd // self.n_head} "
                                     f"must be even")
        for name in ("dropout", "attn_dropout"):
            v = getattr(self, name)
            if v is None and name == "attn_dropout":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise RematArgumentTypeError(f"GPTConfig.{name} must be a number, got {type(v).__name__} {v!r}")
            if not 0 <= v < 1:  # also refuses NaN
                raise RematArgumentError(f"GPTConfig.{name} must be in [0, 1), got {v}")
        if self.attention not in ("explicit", "sdpa"):
            raise RematArgumentError(f"GPTConfig.attention must be 'explicit' or 'sdpa', got {self.attention!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.fused = cfg.attention == "sdpa"  # remat routes SDPA to its flash-attention op
        self.attn_p = cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(self.attn_p)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hd)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_p if self.training else 0.0,
                                               is_causal=True)  # (B, nh, T, hd)
        else:
            # explicit softmax(QK^T * scale)V: its s x s scores are what checkpointing is about
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(~self.causal_mask[:, :, :T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """forward(idx, targets) -> scalar cross-entropy loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))


def default_model(cfg: GPTConfig | None = None, seed: int = 0) -> GPT:
    """The default GPT with deterministic initial weights."""
    torch.manual_seed(seed)
    return GPT(cfg or GPTConfig())


def default_inputs(cfg: GPTConfig | None = None, seed: int = 1, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets) of shape (batch_size, block_size)."""
    cfg = cfg or GPTConfig()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size), generator=g)
    return idx.to(device), targets.to(device)
