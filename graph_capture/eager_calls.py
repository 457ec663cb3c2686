"""Run a partitioned graph eagerly with less Python per op: its most frequent ATen calls made
through PyTorch's public bindings.

The fx code of a graph calls each op as an OpOverload (`torch.ops.aten.mm.default(a, b)`), whose
generic argument handling costs about 2 µs more per call than the public binding of the same
overload (`torch.mm(a, b)`: 3.6-4.0 against 1.6-2.4 µs on this project's CPU for tiny tensors).
A step of the default GPT calls several hundred of them (views, transposes, matmuls, products):
where kernels are short (a small model, or any model on a GPU) that is a visible share of the
step. The copy run here calls, for the overloads listed below and only with the arguments those
bindings take, the binding that dispatches to that same overload with the same arguments: the
same kernels, allocations and results. The graph itself (what Inductor compiles, what the memory
model and the plan were made on) keeps its OpOverloads.
"""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["PUBLIC_BINDINGS", "eager_executable"]

aten = torch.ops.aten

# overload -> (public binding that dispatches to exactly it, keyword arguments the binding takes)
PUBLIC_BINDINGS = {
    aten.view.default: (torch.Tensor.view, ()),
    aten.t.default: (torch.t, ()),
    aten.transpose.int: (torch.transpose, ()),
    aten.permute.default: (torch.permute, ()),
    aten.expand.default: (torch.Tensor.expand, ()),
    aten.unsqueeze.default: (torch.unsqueeze, ()),
    aten.mm.default: (torch.mm, ()),
    aten.bmm.default: (torch.bmm, ()),
    aten.addmm.default: (torch.addmm, ("beta", "alpha")),
    aten.mul.Tensor: (torch.mul, ()),
    aten.add.Tensor: (torch.add, ("alpha",)),
    aten.sub.Tensor: (torch.sub, ("alpha",)),
    aten.div.Tensor: (torch.div, ()),
    aten.clone.default: (torch.clone, ("memory_format",)),
}


def eager_executable(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` (same code generator, same nodes in the same order) whose calls of the
    overloads in PUBLIC_BINDINGS go through their public bindings."""
    graph = fx.Graph()
    graph.set_codegen(gm.graph._codegen)
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in PUBLIC_BINDINGS:
            continue
        binding, keywords = PUBLIC_BINDINGS[n.target]
        if set(n.kwargs) <= set(keywords):
            n.target = binding
    return fx.GraphModule(gm, graph)
