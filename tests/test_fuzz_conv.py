"""Fuzz: small random conv nets under random budgets and every strategy. The nets mix what real
vision models do and what the runtime must replay exactly: BatchNorm in train and eval mode (its
running statistics must advance once per step, as eager's), in-place ReLU and in-place residual adds,
depthwise and pointwise convs, concatenated skips, squeeze-excitation gates, pooling and
nearest-neighbour upsampling, dropout and dropout2d. Every `optimize` call either refuses the budget
with a smallest feasible one above it, refuses a non-chain graph (revolve), or returns a module whose
loss, gradients and buffers after a step equal the unmodified model's (same seed), and whose measured
peak is the predicted one and within the budget. A refused budget is retried at the smallest feasible
one the refusal names, which must then be accepted.

Each net is drawn from its seed (random.Random, not hypothesis: one case per strategy (two for checkmate), more under
REMAT_FUZZ_SCALE (tests/fuzz_scale.py), spread over pytest-xdist's workers; a failure prints the net it drew)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from tests.fuzz_scale import fuzz_count
from tests.fuzz_check import optimize_and_compare

KINDS = ["plain", "residual", "depthwise", "concat", "down_up", "squeeze_excite"]
ACTS = {"relu_inplace": lambda x: F.relu(x, inplace=True), "relu": F.relu, "silu": F.silu,
        "hardswish": F.hardswish, "gelu": F.gelu}
STRATEGIES = ["checkmate", "checkmate", "equal_spacing", "chen_greedy", "per_block", "selective", "revolve",
              "keep_all"]


class FuzzBlock(nn.Module):
    """conv -> [BatchNorm] -> activation, then what `kind` adds, then [dropout / dropout2d]."""

    def __init__(self, c: int, kind: str, act: str, drop: str | None, p: float, bn: bool):
        super().__init__()
        self.kind, self.act, self.drop, self.p = kind, ACTS[act], drop, p
        self.conv = nn.Conv2d(c, c, 3, padding=1, groups=c if kind == "depthwise" else 1)
        self.norm = nn.BatchNorm2d(c) if bn else nn.Identity()
        if kind == "depthwise":
            self.pw = nn.Conv2d(c, c, 1)
        elif kind == "concat":
            self.pw = nn.Conv2d(2 * c, c, 1)
        elif kind == "squeeze_excite":
            self.fc1, self.fc2 = nn.Linear(c, max(1, c // 2)), nn.Linear(max(1, c // 2), c)

    def _dropout(self, h):
        if self.drop == "dropout":
            return F.dropout(h, self.p, self.training)
        if self.drop == "dropout2d":
            return F.dropout2d(h, self.p, self.training)
        return h

    def forward(self, x):
        if self.kind == "down_up":
            h = self.act(self.norm(self.conv(F.max_pool2d(x, 2))))
            return self._dropout(F.interpolate(h, size=x.shape[-2:], mode="nearest")) + x
        h = self.act(self.norm(self.conv(x)))
        if self.kind == "depthwise":
            h = self.pw(h)
        elif self.kind == "concat":
            h = self.pw(torch.cat([h, x], dim=1))
        elif self.kind == "squeeze_excite":
            gate = torch.sigmoid(self.fc2(F.relu(self.fc1(h.mean(dim=(2, 3))))))
            h = h * gate[:, :, None, None]
        h = self._dropout(h)
        if self.kind == "residual":
            if self.drop is not None and self.training:
                h += x  # in place on dropout's output, which no backward reads
            else:
                h = h + x
        return h


class FuzzConvNet(nn.Module):
    def __init__(self, width: int, blocks: list[dict], head: str, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(*(FuzzBlock(width, **b) for b in blocks))
        self.head_kind = head
        self.head = nn.Linear(width * 64 if head == "flatten" else width, classes)

    def forward(self, x, y):
        h = self.blocks(self.stem(x))
        if self.head_kind == "avg":
            h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        elif self.head_kind == "max":
            h = h.amax(dim=(2, 3))
        else:
            h = h.reshape(h.shape[0], -1)
        return F.cross_entropy(self.head(h), y)


def _case(seed: int) -> dict:
    """A net drawn from `seed`: its width, 2 to 6 blocks (kind, activation, dropout, BatchNorm), head,
    mode (train 6 times in 7), batch, and the budget as a fraction of the eager step's peak."""
    rng = random.Random(seed)
    blocks = [dict(kind=rng.choice(KINDS), act=rng.choice(sorted(ACTS)),
                   drop=rng.choice([None, "dropout", "dropout2d"]), p=rng.choice([0.1, 0.5]), bn=rng.random() < 0.7)
              for _ in range(rng.randint(2, 6))]
    return dict(width=rng.choice([4, 8, 12]), blocks=blocks, head=rng.choice(["avg", "max", "flatten"]),
                train=rng.random() < 6 / 7, batch=rng.choice([2, 4]), frac=rng.uniform(0.4, 1.2))


# every strategy on a net of its own (checkmate on 2): 8 nets, each drawn from its seed
CASES = [(solver, seed) for seed, solver in enumerate(STRATEGIES * fuzz_count(1))]


@pytest.mark.parametrize("solver,seed", CASES, ids=[f"{solver}-{seed}" for solver, seed in CASES])
def test_random_conv_nets_and_budgets(solver, seed):
    case = _case(seed)
    torch.manual_seed(seed)
    model = FuzzConvNet(case["width"], case["blocks"], case["head"]).train(case["train"])
    x = torch.randn(case["batch"], 3, 8, 8)
    y = torch.randint(0, 5, (case["batch"],))
    try:
        optimize_and_compare(model, (x, y), case["frac"], solver, seed, described=f"net {case}")
    except remat.NotAChainError:
        # revolve is for chains only; a residual, concat or gated block makes the graph branch
        assert solver == "revolve" and any(b["kind"] not in ("plain", "depthwise") for b in case["blocks"])
