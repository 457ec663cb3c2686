"""Small irregular models to try remat on: a U-Net, a ResNet-style and a MobileNet-style net.

Each `forward(x, y)` is one training step's forward and returns the scalar loss, as
`remat.optimize` expects (the loss is what the budgeted step ends with), and each comes with a
`build_*` (deterministic weights for a seed) and an `*_inputs` (an example batch):

    model, inputs = build_unet(), unet_inputs()
    opt = remat.optimize(model, budget_bytes=..., example_inputs=inputs)
    loss = opt(*inputs); loss.backward()

* **U-Net** (Ronneberger et al. 2015): an encoder of `depth` levels (two 3x3 conv-BatchNorm-ReLU
  each, then 2x2 max pooling), a bottleneck with dropout, a decoder that upsamples (transposed
  conv), concatenates the encoder's output of the same level (skip connections) and convolves
  again, and a 1x1 head with a per-pixel cross-entropy: the graph is not a chain.
* **ResNet** (He et al. 2016): a stem, stages of BasicBlocks (two 3x3 conv-BN, identity or
  1x1-conv shortcut, ReLU) held in one `nn.Sequential` `layers`, pooling, dropout and a classifier.
* **MobileNet** (Sandler et al. 2018, MobileNetV2): a stem and inverted residual blocks (1x1
  expansion, 3x3 depthwise convolution, 1x1 projection, residual where shapes allow, ReLU6) in one
  `nn.Sequential` `features`, a 1x1 convolution, pooling, dropout and a classifier.

The repeated blocks live in numbered containers (`down`/`up`, `layers`, `features`), so the
per_block strategy and torch.utils.checkpoint find them. The default sizes take well under a
second per training step on a CPU.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["UNet", "ResNet", "MobileNet", "build_unet", "unet_inputs", "build_resnet", "resnet_inputs",
           "build_mobilenet", "mobilenet_inputs", "MODELS"]


def _conv_bn_relu(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act=nn.ReLU) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), act())


class _DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1 = _conv_bn_relu(cin, cout)
        self.conv2 = _conv_bn_relu(cout, cout)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class _Up(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = _DoubleConv(2 * cout, cout)

    def forward(self, x, skip):
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    """U-Net: forward(x (B, C, H, W), y (B, H, W) class indices) -> per-pixel cross-entropy."""

    def __init__(self, in_channels: int = 3, classes: int = 4, width: int = 16, depth: int = 3,
                 dropout: float = 0.1):
        super().__init__()
        chans = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList(_DoubleConv(in_channels if i == 0 else chans[i - 1], chans[i])
                                  for i in range(depth))
        self.bottleneck = _DoubleConv(chans[depth - 1], chans[depth])
        self.drop = nn.Dropout2d(dropout)
        self.up = nn.ModuleList(_Up(chans[i + 1], chans[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x, y):
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.drop(self.bottleneck(x))
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return F.cross_entropy(self.head(x), y)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet with BasicBlocks: forward(x (B, C, H, W), y (B,)) -> cross-entropy."""

    def __init__(self, in_channels: int = 3, classes: int = 10, widths: tuple[int, ...] = (16, 32, 64),
                 blocks_per_stage: int = 2, dropout: float = 0.1):
        super().__init__()
        self.stem = _conv_bn_relu(in_channels, widths[0])
        blocks, cin = [], widths[0]
        for s, w in enumerate(widths):
            for b in range(blocks_per_stage):
                blocks.append(_BasicBlock(cin, w, 2 if s > 0 and b == 0 else 1))
                cin = w
        self.layers = nn.Sequential(*blocks)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x, y):
        h = self.layers(self.stem(x))
        return F.cross_entropy(self.fc(self.drop(h.mean((2, 3)))), y)


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        mid = cin * expand
        self.residual = stride == 1 and cin == cout
        self.expand = _conv_bn_relu(cin, mid, 1, act=nn.ReLU6) if expand != 1 else nn.Identity()
        self.depthwise = _conv_bn_relu(mid, mid, 3, stride, groups=mid, act=nn.ReLU6)
        self.project = nn.Sequential(nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = self.project(self.depthwise(self.expand(x)))
        return x + h if self.residual else h


class MobileNet(nn.Module):
    """MobileNetV2-style: forward(x (B, C, H, W), y (B,)) -> cross-entropy. `settings` rows are
    MobileNetV2's (expansion t, channels c, repeats n, first stride s)."""

    def __init__(self, in_channels: int = 3, classes: int = 10, stem: int = 16,
                 settings: tuple[tuple[int, int, int, int], ...] = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2),
                                                                    (6, 64, 2, 2)),
                 last: int = 256, dropout: float = 0.2):
        super().__init__()
        layers: list[nn.Module] = [_conv_bn_relu(in_channels, stem, 3, 2, act=nn.ReLU6)]
        cin = stem
        for t, c, n, s in settings:
            for i in range(n):
                layers.append(_InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        self.features = nn.Sequential(*layers)
        self.last = _conv_bn_relu(cin, last, 1, act=nn.ReLU6)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(last, classes)

    def forward(self, x, y):
        h = self.last(self.features(x))
        return F.cross_entropy(self.fc(self.drop(h.mean((2, 3)))), y)


def build_unet(width: int = 16, depth: int = 3, in_channels: int = 3, classes: int = 4, dropout: float = 0.1,
               seed: int = 0) -> UNet:
    """A U-Net with deterministic weights for `seed`, in training mode."""
    torch.manual_seed(seed)
    return UNet(in_channels, classes, width, depth, dropout)


def unet_inputs(batch: int = 2, size: int = 64, in_channels: int = 3, classes: int = 4,
                seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (batch, in_channels, size, size), per-pixel labels (batch, size, size)); `size` must
    be divisible by 2**depth."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, in_channels, size, size, generator=g),
            torch.randint(0, classes, (batch, size, size), generator=g))


def build_resnet(widths: tuple[int, ...] = (16, 32, 64), blocks_per_stage: int = 2, in_channels: int = 3,
                 classes: int = 10, dropout: float = 0.1, seed: int = 0) -> ResNet:
    """A ResNet with deterministic weights for `seed`, in training mode."""
    torch.manual_seed(seed)
    return ResNet(in_channels, classes, tuple(widths), blocks_per_stage, dropout)


def resnet_inputs(batch: int = 16, size: int = 32, in_channels: int = 3, classes: int = 10,
                  seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (batch, in_channels, size, size), labels (batch,))."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, in_channels, size, size, generator=g),
            torch.randint(0, classes, (batch,), generator=g))


def build_mobilenet(stem: int = 16, last: int = 256, in_channels: int = 3, classes: int = 10,
                    dropout: float = 0.2, seed: int = 0) -> MobileNet:
    """A MobileNetV2-style net with deterministic weights for `seed`, in training mode."""
    torch.manual_seed(seed)
    return MobileNet(in_channels, classes, stem, last=last, dropout=dropout)


def mobilenet_inputs(batch: int = 8, size: int = 64, in_channels: int = 3, classes: int = 10,
                     seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (batch, in_channels, size, size), labels (batch,))."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, in_channels, size, size, generator=g),
            torch.randint(0, classes, (batch,), generator=g))


# name -> (build, example inputs), both with their default sizes
MODELS = {"unet": (build_unet, unet_inputs), "resnet": (build_resnet, resnet_inputs),
          "mobilenet": (build_mobilenet, mobilenet_inputs)}
