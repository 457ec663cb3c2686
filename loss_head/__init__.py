"""remat's loss-head stage: the chunked linear cross-entropy op and the router that puts it in a
traced step.

* `op`: `torch.ops.remat.chunked_linear_cross_entropy` (forward, backward, fake kernels, autograd):
  the loss of `cross_entropy(h @ W.T [+ b])` computed by row chunks, the logits recomputed by
  vocabulary blocks in the backward, so no [tokens, vocab] tensor lives whole;
* `kernels`: the chunk's loss terms and a vocabulary block's gradient of the logits, one Triton pass
  each on the GPU (the launch helpers are attention's), the PyTorch ops elsewhere;
* `router`: `route_loss_head()` replaces a linear head followed by cross-entropy while a step is
  traced, where it can prove the replacement computes the same function, and records why not elsewhere.

graph_capture routes the head while tracing and runtime runs the op; this package imports core,
compat and attention (its Triton launch helpers).
"""
from remat.loss_head.op import chunked_linear_cross_entropy
from remat.loss_head.router import LossHeadRouter, route_loss_head

__all__ = ["chunked_linear_cross_entropy", "route_loss_head", "LossHeadRouter"]
