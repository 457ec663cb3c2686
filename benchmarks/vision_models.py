"""ResNet-50, DenseNet-121 and Swin-T written after torchvision's definitions, for the solver's
benchmarks (torchvision itself cannot be installed beside the CPU torch here: its C ops do not load).

What follows torchvision (models/resnet.py, densenet.py, swin_transformer.py; ops/misc.py's MLP,
ops/stochastic_depth.py), so the traced training step has the same ops, shapes and graph:

* ResNet-50: 7x7/2 stem, 3x3/2 max pool, Bottleneck blocks [3, 4, 6, 3] (expansion 4, the stride on
  the 3x3 convolution: "ResNet V1.5"), 1x1 projection + BatchNorm where the shape changes, in-place
  ReLUs, global average pool, fc to 1000 classes.
* DenseNet-121: growth 32, blocks (6, 12, 24, 16), bottleneck width 4 x 32, 64 stem features;
  every dense layer concatenates all earlier features of its block (BN-ReLU-1x1-BN-ReLU-3x3), the
  transitions halve channels (BN-ReLU-1x1) and resolution (2x2 average pool); norm5, ReLU, pool, fc.
* Swin-T: 4x4 patches to 96 channels, depths (2, 2, 6, 2), heads (3, 6, 12, 24), 7x7 windows,
  shifted windows on every other block (the -100 mask between shifted regions, cyclic roll),
  relative position bias per head, MLP ratio 4 with GELU, stochastic depth rising to 0.2,
  patch merging (2x2 concatenation, LayerNorm, linear to 2x channels), final LayerNorm, pool, head.

Weights are initialised with torch's defaults (the plan depends on shapes and ops, not values).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["resnet50", "densenet121", "swin_t", "VISION_MODELS", "vision_model", "vision_inputs"]


# ---- ResNet-50 --------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * 4, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        down = None
        if stride != 1 or self.inplanes != planes * 4:
            down = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride=stride, bias=False),
                                 nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, down)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000) -> ResNet:
    return ResNet((3, 4, 6, 3), num_classes)


# ---- DenseNet-121 -----------------------------------------------------------------------------
class _DenseLayer(nn.Module):
    def __init__(self, num_input_features: int, growth_rate: int, bn_size: int):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, padding=1, bias=False)

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        concated = torch.cat(inputs, 1)  # every earlier feature map of the block
        bottleneck = self.conv1(self.relu1(self.norm1(concated)))
        return self.conv2(self.relu2(self.norm2(bottleneck)))


class _DenseBlock(nn.ModuleDict):
    def __init__(self, num_layers: int, num_input_features: int, bn_size: int, growth_rate: int):
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"denselayer{i + 1}", _DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size))

    def forward(self, init_features):
        features = [init_features]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    def __init__(self, num_input_features: int, num_output_features: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, 1, bias=False)
        self.pool = nn.AvgPool2d(2, stride=2)


class DenseNet(nn.Module):
    def __init__(self, growth_rate: int = 32, block_config=(6, 12, 24, 16), num_init_features: int = 64,
                 bn_size: int = 4, num_classes: int = 1000):
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, num_init_features, 7, stride=2, padding=3, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(num_init_features))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("pool0", nn.MaxPool2d(3, stride=2, padding=1))
        num = num_init_features
        for i, n in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", _DenseBlock(n, num, bn_size, growth_rate))
            num += n * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", _Transition(num, num // 2))
                num //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(num))
        self.classifier = nn.Linear(num, num_classes)

    def forward(self, x):
        out = F.relu(self.features(x), inplace=True)
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(out, (1, 1)), 1))


def densenet121(num_classes: int = 1000) -> DenseNet:
    return DenseNet(32, (6, 12, 24, 16), 64, 4, num_classes)


# ---- Swin-T -----------------------------------------------------------------------------------
def _relative_position_index(ws: int) -> torch.Tensor:
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij"))
    flat = torch.flatten(coords, 1)
    rel = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += ws - 1
    rel[:, :, 1] += ws - 1
    rel[:, :, 0] *= 2 * ws - 1
    return rel.sum(-1).flatten()


def shifted_window_attention(x, qkv_weight, proj_weight, relative_position_bias, window_size: int, num_heads: int,
                             shift_size: list[int], qkv_bias, proj_bias, training: bool):
    B, H, W, C = x.shape
    ws = window_size
    pad_r, pad_b = (ws - W % ws) % ws, (ws - H % ws) % ws
    x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
    _, pH, pW, _ = x.shape
    shift = list(shift_size)
    if ws >= pH:
        shift[0] = 0
    if ws >= pW:
        shift[1] = 0
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    nw = (pH // ws) * (pW // ws)
    x = x.view(B, pH // ws, ws, pW // ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(B * nw, ws * ws, C)
    qkv = F.linear(x, qkv_weight, qkv_bias)
    qkv = qkv.reshape(x.size(0), x.size(1), 3, num_heads, C // num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    q = q * (C // num_heads) ** -0.5
    attn = q.matmul(k.transpose(-2, -1))
    attn = attn + relative_position_bias
    if sum(shift) > 0:  # tokens of different regions after the roll must not attend to each other
        mask = x.new_zeros((pH, pW))
        hs = ((0, -ws), (-ws, -shift[0]), (-shift[0], None))
        wsl = ((0, -ws), (-ws, -shift[1]), (-shift[1], None))
        count = 0
        for h in hs:
            for w in wsl:
                mask[h[0]:h[1], w[0]:w[1]] = count
                count += 1
        mask = mask.view(pH // ws, ws, pW // ws, ws).permute(0, 2, 1, 3).reshape(nw, ws * ws)
        mask = mask.unsqueeze(1) - mask.unsqueeze(2)
        mask = mask.masked_fill(mask != 0, float(-100.0)).masked_fill(mask == 0, float(0.0))
        attn = attn.view(x.size(0) // nw, nw, num_heads, x.size(1), x.size(1))
        attn = attn + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, num_heads, x.size(1), x.size(1))
    attn = F.softmax(attn, dim=-1)
    attn = F.dropout(attn, p=0.0, training=training)
    x = attn.matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), C)
    x = F.linear(x, proj_weight, proj_bias)
    x = F.dropout(x, p=0.0, training=training)
    x = x.view(B, pH // ws, pW // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(B, pH, pW, C)
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
    return x[:, :H, :W, :].contiguous()


class ShiftedWindowAttention(nn.Module):
    def __init__(self, dim: int, window_size: int, shift_size: list[int], num_heads: int):
        super().__init__()
        self.window_size, self.shift_size, self.num_heads = window_size, shift_size, num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window_size - 1) ** 2, num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", _relative_position_index(window_size))

    def forward(self, x):
        n = self.window_size ** 2
        bias = self.relative_position_bias_table[self.relative_position_index].view(n, n, -1)
        bias = bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        return shifted_window_attention(x, self.qkv.weight, self.proj.weight, bias, self.window_size, self.num_heads,
                                        self.shift_size, self.qkv.bias, self.proj.bias, self.training)


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth(p, "row"): drop a sample's residual branch with probability p."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device).bernoulli_(keep)
        if keep > 0.0:
            noise.div_(keep)
        return x * noise


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, shift: list[int], sd_prob: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = ShiftedWindowAttention(dim, window, shift, heads)
        self.stochastic_depth = StochasticDepth(sd_prob)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        # torchvision.ops.MLP(dim, [4 dim, dim], activation_layer=GELU, dropout=0.0)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.0), nn.Linear(4 * dim, dim),
                                 nn.Dropout(0.0))

    def forward(self, x):
        x = x + self.stochastic_depth(self.attn(self.norm1(x)))
        return x + self.stochastic_depth(self.mlp(self.norm2(x)))


class PatchMerging(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim)

    def forward(self, x):
        H, W = x.shape[-3:-1]
        x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        x = torch.cat([x[..., 0::2, 0::2, :], x[..., 1::2, 0::2, :], x[..., 0::2, 1::2, :], x[..., 1::2, 1::2, :]], -1)
        return self.reduction(self.norm(x))


class Permute(nn.Module):
    def __init__(self, dims: list[int]):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


class SwinTransformer(nn.Module):
    def __init__(self, embed_dim: int = 96, depths=(2, 2, 6, 2), heads=(3, 6, 12, 24), window: int = 7,
                 stochastic_depth_prob: float = 0.2, num_classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, embed_dim, 4, stride=4), Permute([0, 2, 3, 1]),
                                                 nn.LayerNorm(embed_dim))]
        total, block_id = sum(depths), 0
        for i, (depth, h) in enumerate(zip(depths, heads)):
            dim = embed_dim * 2 ** i
            stage = []
            for j in range(depth):
                sd = stochastic_depth_prob * block_id / (total - 1)
                stage.append(SwinBlock(dim, h, window, [0, 0] if j % 2 == 0 else [window // 2] * 2, sd))
                block_id += 1
            layers.append(nn.Sequential(*stage))
            if i < len(depths) - 1:
                layers.append(PatchMerging(dim))
        self.features = nn.Sequential(*layers)
        num = embed_dim * 2 ** (len(depths) - 1)
        self.norm = nn.LayerNorm(num)
        self.permute = Permute([0, 3, 1, 2])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(num, num_classes)

    def forward(self, x):
        x = self.permute(self.norm(self.features(x)))
        return self.head(torch.flatten(self.avgpool(x), 1))


def swin_t(num_classes: int = 1000) -> SwinTransformer:
    return SwinTransformer(96, (2, 2, 6, 2), (3, 6, 12, 24), 7, 0.2, num_classes)


# ---- what the benchmarks train ---------------------------------------------------------------
class WithLoss(nn.Module):
    """model(images) -> cross-entropy against labels: one training step's loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images, labels):
        return F.cross_entropy(self.model(images), labels)


VISION_MODELS = {"resnet50": resnet50, "densenet121": densenet121, "swin_t": swin_t}


def vision_model(name: str, seed: int = 0) -> nn.Module:
    """`name` (one of VISION_MODELS) with its loss, in train mode."""
    torch.manual_seed(seed)
    return WithLoss(VISION_MODELS[name]()).train()


def vision_inputs(batch: int = 8, size: int = 224, seed: int = 1, classes: int = 1000) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)
