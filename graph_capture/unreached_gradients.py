"""Gradients no loss reached stay None, as in eager.

AOTAutograd runs a step's backward as one function of all the step's outputs: where a backward
reaches only some of them (the loss, not an auxiliary head's logits), the others' incoming gradients
are zeros, and every parameter and input gets a gradient, zeros where none of the reached outputs
depends on it. Eager autograd leaves those gradients None, and optimizers treat the two differently:
AdamW's weight decay and SGD's momentum move a parameter whose gradient is zeros, and skip one whose
gradient is None. So each planned step's backward node gets a hook (`leave_unreached_none`) that
replaces such a gradient by None: each primal's gradient reads the incoming gradients of a known
set of the step's outputs (`gradient_sources`, from the joint graph), and where none of those
received one in this backward, that gradient is None.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from remat.compat.torch_private import aot_backward_node, tangent_output

__all__ = ["gradient_sources", "leave_unreached_none"]


def gradient_sources(joint_gm: fx.GraphModule, num_fwd_outputs: int) -> list[int] | None:
    """Per primal (parameters, buffers, then inputs, as the joint graph takes them), a bit mask of
    the forward outputs whose incoming gradients (tangents) its gradient reads (0: none, or no
    gradient). None where the joint graph's descriptors do not say which output a tangent is for."""
    out = joint_gm.graph.output_node()
    descs = out.meta.get("desc")
    if not isinstance(descs, (list, tuple)) or len(descs) != len(out.args[0]):
        return None
    forward_outputs = list(descs[:num_fwd_outputs])
    mask: dict[fx.Node, int] = {}
    for n in joint_gm.graph.nodes:
        if n.op == "placeholder":
            of = tangent_output(n.meta.get("desc"))
            if of is None:
                mask[n] = 0
            elif of in forward_outputs:
                mask[n] = 1 << forward_outputs.index(of)
            else:  # the gradient of no forward output we know: say nothing rather than guess
                return None
        elif n.op != "output":
            m = 0
            for a in n.all_input_nodes:
                m |= mask.get(a, 0)
            mask[n] = m
    return [mask.get(g, 0) if isinstance(g, fx.Node) else 0 for g in out.args[0][num_fwd_outputs:]]


def leave_unreached_none(outputs, sources: list[int] | None, num_fwd_outputs: int) -> None:
    """Hook the backward node of a planned step's `outputs`: in each backward, a gradient whose
    `sources` (gradient_sources) all received no gradient is None, not zeros. Nothing is hooked
    where the node's inputs and outputs are not the joint graph's primals and forward outputs (an
    AOTAutograd wrapper deduplicated inputs or added outputs): those gradients stay as they are."""
    node = aot_backward_node(outputs) if sources else None
    if node is None:
        return

    def hook(grad_inputs, grad_outputs):
        if len(grad_inputs) != len(sources) or len(grad_outputs) != num_fwd_outputs:
            return None
        reached = 0
        for slot, g in enumerate(grad_outputs):
            if g is not None:
                reached |= 1 << slot
        if all(g is None or not m or m & reached for g, m in zip(grad_inputs, sources)):
            return None
        return tuple(None if isinstance(g, torch.Tensor) and m and not m & reached else g
                     for g, m in zip(grad_inputs, sources))

    node.register_hook(hook)
