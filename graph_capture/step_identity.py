"""When two traced training steps are one function of their parameters, buffers and inputs.

A model's repeated blocks (twelve decoder layers, their attention parts) are distinct modules, each
traced on its own: its graph is made of its own code, attribute values and call. Where two blocks'
traces are equal, AOTAutograd's compiled step of one computes the other's when handed the other's
parameters and buffers (the compiled step takes them as inputs at every call, graph_capture/joint.py
`CompiledStep`), so a block need not be traced again to be deployed (remat/blockwise.py).

"Equal" is decided on what the compiled step is made of, not on what the planner sees (the
TrainingGraph's nodes and sizes, which leave out scalars such as an attention scale):

* the joint graph's code, every subgraph's code (higher-order ops), and the value of every constant
  it reads (`get_attr`: tensors compared by their bytes; a constant without data, on the meta device
  or fake, or of another kind, makes the step one that is never shared);
* every placeholder's shape, strides, dtype and device;
* AOTAutograd's metadata of the step (which inputs it mutates, which outputs alias inputs, what
  requires grad): its runtime wrapper acts on it;
* the call's argument structure, its non-tensor values and its output structure;
* the parameters' and buffers' names, shapes, strides, dtypes, devices, requires_grad and tying;
* the autocast state the step was traced under.
"""
from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from remat.compat.torch_private import disable_current_modes, is_fake

__all__ = ["StepIdentity", "graph_code", "placeholder_layouts", "first_equal"]


@dataclass(frozen=True, eq=True)
class StepIdentity:
    """What a traced step computes (see the module docstring); two equal ones are one function of
    their parameters, buffers and inputs. Compared with ==, never hashed (it holds dicts)."""

    code: tuple[str, ...]
    constants: tuple
    placeholders: tuple
    metadata: str
    signature: tuple
    state: tuple
    autocast: Any


def _tensor_value(t: torch.Tensor) -> tuple | None:
    """A constant tensor by its layout and a digest of its bytes; None for one without data."""
    if t.device.type == "meta" or is_fake(t):
        return None
    with disable_current_modes():  # read while the trace's fake mode is on: the constant is a real tensor
        flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    return (tuple(t.shape), t.stride(), t.dtype, t.device, digest)


def graph_code(gm: fx.GraphModule) -> tuple[tuple[str, ...], tuple] | None:
    """The code of `gm` and of every subgraph it reads, and its constants' values (by `get_attr`
    target); None where a constant cannot be compared."""
    code: list[str] = [gm.code]
    constants: list[tuple] = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = operator.attrgetter(node.target)(gm)
        if isinstance(value, fx.GraphModule):
            inner = graph_code(value)
            if inner is None:
                return None
            code += inner[0]
            constants += [(node.target, *c) for c in inner[1]]
        elif isinstance(value, torch.Tensor):
            described = _tensor_value(value)
            if described is None:
                return None
            constants.append((node.target, described))
        else:
            return None
    return tuple(code), tuple(constants)


def placeholder_layouts(gm: fx.GraphModule) -> tuple:
    """Every placeholder's (shape, strides, dtype, device), from the fake value it was traced with."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            out.append((str(tuple(val.shape)), str(val.stride()), val.dtype, val.device))
        else:
            out.append(repr(val))
    return tuple(out)


def first_equal(identities: list[StepIdentity | None], plans: list) -> list[int]:
    """For each traced step, the index of the first one whose identity equals its own and whose
    `plans` entry is the same object (the plans made for one graph), so that its compiled step can
    run this one with this one's parameters; its own index where there is none (None identities and
    None plans match nothing)."""
    return [next((j for j in range(i) if ps is not None and ident is not None and plans[j] is ps
                  and identities[j] == ident), i) for i, (ident, ps) in enumerate(zip(identities, plans))]
