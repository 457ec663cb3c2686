"""cuDNN's fused attention kernels behind remat's attention op, where torch's own SDPA picks them.

On Hopper (sm90) and newer, torch's SDPA ranks cuDNN's attention first, and on an H200 its backward
took 32.6 ms for the 16 calls of a Llama-3.2-1B-shaped step where remat's Triton backward took 53.9 ms
(`benchmarks/results/gpu_speed_h200_run4_profile.txt`). The op keeps its graph node, its outputs
and what it saves (q, k, v, out, lse): only the kernels that compute them change, so plans, the
memory model and recomputation are the same with either backend. What makes that sound, checked on
an H200 by `benchmarks/gpu_attention_backends.py` (`benchmarks/results/gpu_attention_backends_h200*`):
cuDNN's log-sum-exp is the op's lse (natural log of the scaled scores' row sums, float32; within
1.9e-6 of the Triton kernel's), its forward and backward take grouped-query k/v as they are, and its
backward takes the op's saved out and lse; with a gradient into lse the Triton backward runs on
cuDNN's saved out and lse (its dq within bf16's rounding of the all-Triton op's).

cuDNN runs when all of these hold, else the Triton kernels do: CUDA, fp16/bf16, no dropout (the
op's dropout is its own hashed mask, which cuDNN cannot regenerate), no gradient flowing into lse
(cuDNN's backward has no input for it), causal only for Sq == Sk (cuDNN aligns the mask top-left, the
op bottom-right), a device of compute capability 9.0 or more, torch's cuDNN SDPA backend enabled
(`torch.backends.cuda.enable_cudnn_sdp`), and torch's own check
(`torch.backends.cuda.can_use_cudnn_attention`) accepting the shapes, strides and head dim.
`set_cudnn_attention(False)` keeps the Triton kernels everywhere, as does any Triton mode but the
default "auto" (`attention.launch.set_triton_mode`: "always" and "interpret" ask for the Triton
kernels, "never" for the PyTorch reference).
"""
from __future__ import annotations

import functools

import torch

from remat.attention.launch import torch_kernels_may_take
from remat.attention.reference import in_layout, new_attention_output

__all__ = ["set_cudnn_attention", "cudnn_attention_enabled", "cudnn_runs_on", "cudnn_forward",
           "cudnn_backward"]

# Compute capability from which torch's SDPA ranks cuDNN's attention first.
CUDNN_MIN_CAPABILITY = (9, 0)
_enabled = [True]  # the one user setting (set_cudnn_attention); a list so no `global` is needed


def set_cudnn_attention(enabled: bool) -> None:
    """Let the attention op run cuDNN's kernels where they apply (the default), or never."""
    _enabled[0] = bool(enabled)


def cudnn_attention_enabled() -> bool:
    """The setting of `set_cudnn_attention` (True unless changed)."""
    return _enabled[0]


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cudnn_runs_on(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout_p: float) -> bool:
    """Whether the op's forward on these inputs runs cuDNN's kernels (see the module's docstring;
    the backward also needs no gradient into lse)."""
    if not (_enabled[0] and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and torch_kernels_may_take(q, k, causal, dropout_p)):
        return False
    if _capability(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
            < CUDNN_MIN_CAPABILITY:
        return False
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, bool(causal), q.shape[1] != k.shape[1])
    return bool(torch.backends.cuda.can_use_cudnn_attention(params))


def cudnn_forward(q, k, v, causal: bool, scale: float, sdpa_layout: bool = False):
    """``(out, lse)`` as the op returns them, from cuDNN's forward."""
    B, H, SQ, _ = q.shape
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, bool(causal), False,
                                                             scale=float(scale))
    out, lse = res[0], res[1]  # lse is (B, H, Sq, 1) float32
    return in_layout(out, new_attention_output(q.to("meta"), sdpa_layout)), lse.reshape(B, H, SQ)


def cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """``(dq, dk, dv)`` from cuDNN's backward, given the op's saved out and lse (either kernel's)."""
    SQ, SK = q.shape[2], k.shape[2]
    dout = in_layout(dout, out.to("meta"))  # cuDNN reads dO in out's layout
    # No dropout: cuDNN's graph has no dropout node and does not read the philox seed/offset.
    philox = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.reshape(*lse.shape, 1), philox, philox, None, None, None, SQ, SK, 0.0,
        bool(causal), scale=float(scale))
    # contiguous, as the op's fake backward (and the Triton kernels) return them
    return dq.contiguous(), dk.contiguous(), dv.contiguous()
