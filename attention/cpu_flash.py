"""torch's CPU flash-attention kernel behind remat's attention op, on CPU tensors.

The op's PyTorch reference (`attention.reference`) computes attention on the CPU by chunks of
query rows with PyTorch ops, in float32 or float64: 3-5 times slower, forward and backward, than
torch's fused CPU kernel (`aten._scaled_dot_product_flash_attention_for_cpu`, what
`F.scaled_dot_product_attention` runs on the CPU) in float32 at the shapes of
`benchmarks/cpu_attention.py` (`benchmarks/results/cpu_attention.txt`, this project's 2-core CI
machine), but in bfloat16 the kernel (that file's SDPA column) was slower than the
reference there (1.4-1.6 times; a CPU without bf16 units), so the kernel runs for float32 and float64 only. It returns the op's two outputs (the
attention and the per-row log-sum-exp of the scaled scores, in the op's lse dtype), takes
grouped-query k/v as they are, and its backward takes the op's saved out and lse: the op keeps its
graph node and what it saves, only the kernels change (as with cuDNN's on the GPU,
`attention.cudnn`). Its scratch memory is measured with the step's other ops' (graph_capture's
workspace probe), as the reference's was.

It runs when all of these hold, else the reference does: a float32 or float64 CPU tensor, the
default Triton mode "auto" (`attention.launch.set_triton_mode`: "never" asks for the reference,
"interpret" and "always" for the Triton kernels), no dropout (the op's dropout is its own hashed
mask), no gradient flowing into lse (the reference's backward takes it), causal only for Sq == Sk
(the kernel's causal mask is aligned top-left, the op's bottom-right), and a non-empty problem.
"""
from __future__ import annotations

import torch

from remat.attention.launch import torch_kernels_may_take
from remat.attention.reference import in_layout, lse_dtype, new_attention_output

__all__ = ["cpu_flash_runs_on", "cpu_flash_forward", "cpu_flash_backward"]

_DTYPES = (torch.float32, torch.float64)


def cpu_flash_runs_on(q: torch.Tensor, k: torch.Tensor, causal: bool, dropout_p: float) -> bool:
    """Whether the op on these inputs runs torch's CPU kernel (see the module's docstring; the
    backward also needs no gradient into lse)."""
    return q.device.type == "cpu" and q.dtype in _DTYPES and torch_kernels_may_take(q, k, causal, dropout_p)


def cpu_flash_forward(q, k, v, causal: bool, scale: float, sdpa_layout: bool = False):
    """``(out, lse)`` as the op returns them, from torch's CPU kernel."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, bool(causal),
                                                                         scale=float(scale))
    # the kernel lays out out and lse as q is laid out; the op's fake kernel promises its own layouts
    return (in_layout(out, new_attention_output(q.to("meta"), sdpa_layout)),
            lse.to(lse_dtype(q.dtype)).contiguous())


def cpu_flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """``(dq, dk, dv)`` from torch's CPU kernel, given the op's saved out and lse."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, bool(causal), scale=float(scale))
    # contiguous, as the op's fake backward returns them
    return dq.contiguous(), dk.contiguous(), dv.contiguous()
