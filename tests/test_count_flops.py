"""remat.count_flops: torch.utils.flop_counter's formulas over the ops the profiler records, equal to
PyTorch's own FlopCounterMode on eager steps (matmuls, strided, grouped and transposed convolutions,
their backward), and right on a torch.compile'd step, which a dispatch mode would run eagerly."""
import pytest
import torch
import torch._functorch.config as functorch_config
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import remat
from remat.models import build_mobilenet, build_unet, mobilenet_inputs, unet_inputs
from tests.models import small_gpt


def _flop_counter_mode(step) -> int:
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


@pytest.mark.parametrize("case", ["gpt", "unet", "mobilenet"])
def test_counts_what_flop_counter_mode_counts_on_an_eager_step(case):
    torch.manual_seed(0)
    model, inputs = {"gpt": small_gpt,
                     "unet": lambda: (build_unet(width=8, depth=2), unet_inputs(batch=2, size=32)),  # ConvTranspose
                     "mobilenet": lambda: (build_mobilenet(stem=8, last=64), mobilenet_inputs(batch=2, size=32)),
                     }[case]()

    def step():
        model(*inputs).backward()

    assert remat.count_flops(step) == _flop_counter_mode(step) > 0


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        probs = torch.softmax(q @ k.transpose(1, 2), -1)
        return torch.tanh(probs @ v).square().mean()


def test_a_compiled_step_is_counted_compiled_with_its_recomputations():
    torch.manual_seed(0)
    model, x = _Attention(), torch.randn(4, 64, 16)

    def step_of(fn):
        return lambda: fn(x).backward()

    eager = remat.count_flops(step_of(model))
    assert eager == _flop_counter_mode(step_of(model))
    torch._dynamo.reset()
    try:
        # a budget of 0: the partitioner saves as little as it can, recomputing the attention's matmul
        with functorch_config.patch(activation_memory_budget=0.0):
            compiled = torch.compile(model, backend="aot_eager_decomp_partition")
            step_of(compiled)()  # compiles
            counted = remat.count_flops(step_of(compiled))
            with torch.profiler.profile() as prof:
                step_of(compiled)()
            # FlopCounterMode, a dispatch mode, sends Dynamo to run the model eagerly: no recomputation
            assert _flop_counter_mode(step_of(compiled)) == eager
    finally:
        torch._dynamo.reset()
    assert counted > eager  # the backward's recomputed q @ k^T
    # counting left the model compiled (a dispatch mode would have left it running eagerly)
    assert any("Torch-Compiled Region" in e.key for e in prof.key_averages())
