"""remat's attention stage: the fused flash-attention op and the router that puts it in a traced step.

* `router`: `route_attention()` replaces attention the op can take (SDPA and the explicit
  softmax(QK^T)V chain) while a step is traced, and records what it left alone and why;
* `pattern`: the tracker that recognises the explicit chain and proves it unchanged (version counters);
* `op`: the `torch.ops.remat.flash_attention` custom op (forward, backward, fake kernels, autograd);
* `cudnn`: cuDNN's attention kernels behind the op, on the GPUs where torch's SDPA runs them;
* `launch` and `kernels`: the Triton FlashAttention-2 kernels and how they are launched (GPU, or the
  Triton interpreter on CPU); `reference`: the PyTorch path computing the same on CPU;
* `dropout_hash`: attention dropout as a counter-based hash, so the backward regenerates the mask.

Both graph_capture (which routes attention while tracing) and runtime (which runs the op) depend on
this package; it depends on neither.
"""
from remat.attention.op import flash_attention, flash_attention_with_lse
from remat.attention.router import AttentionRouter, fused_attention_mode, route_attention

__all__ = ["flash_attention", "flash_attention_with_lse", "route_attention", "AttentionRouter",
           "fused_attention_mode"]
