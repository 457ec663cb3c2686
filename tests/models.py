"""Small models for the tests (kept tiny: the suite runs on 2 CPU cores)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from remat.default_model import GPTConfig, default_inputs, default_model

SMALL = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1, batch_size=4)


def small_gpt(dropout: float = 0.1):
    cfg = GPTConfig(**{**SMALL.__dict__, "dropout": dropout})
    return default_model(cfg), default_inputs(cfg)


class KwargsNet(nn.Module):
    """Keyword arguments, a non-tensor argument, several outputs, BatchNorm buffers."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 32)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, *, target=None, scale: float = 1.0):
        h = self.drop(torch.relu(self.bn(self.fc1(x))))
        y = self.fc2(h) * scale
        loss = F.mse_loss(y, target)
        return {"loss": loss, "y": y}


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent control flow: cannot be traced into one graph
            h = h * 2
        return h.sum()


class ConvNet(nn.Module):
    """Convolutions, BatchNorm (an op with several outputs that die at different times), residual
    connections, dropout."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout(0.1),
                          nn.Conv2d(16, 16, 3, padding=1)) for _ in range(3)])
        self.fc = nn.Linear(16, 10)

    def forward(self, x, y):
        h = self.stem(x)
        for block in self.blocks:
            h = torch.relu(h + block(h))
        return F.cross_entropy(self.fc(h.mean((2, 3))), y)
