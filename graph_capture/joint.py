"""Trace a model's training step into AOTAutograd's joint forward+backward fx graph.

`trace_training_step` flattens (args, kwargs) into tensors, wraps the model so AOTAutograd sees a
flat function, and runs `aot_module_simplified`. AOTAutograd hands the joint graph to a
`partition_fn`; we pass our own so that whoever calls this (capture, or the runtime with a plan)
decides how the graph is split into a forward and a backward.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._functorch.aot_autograd import aot_module_simplified

from remat.graph_capture.module_paths import annotate_module_paths, record_module_spans

__all__ = ["FlatSignature", "TraceError", "trace_training_step"]


class TraceError(RuntimeError):
    """The model's training step could not be traced; the message names the op or source line."""


@dataclass
class FlatSignature:
    """How one call's (args, kwargs) map to the flat tensors the compiled step takes."""

    in_spec: pytree.TreeSpec
    tensor_positions: list[int]  # which leaves are tensors
    constants: dict[int, Any]  # the non-tensor leaves, fixed at trace time
    tensor_meta: list[tuple[tuple[int, ...], torch.dtype, str]]  # (shape, dtype, device type)
    out_spec: pytree.TreeSpec | None = None  # filled in while tracing
    out_tensor_positions: list[int] = field(default_factory=list)
    out_constants: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "FlatSignature":
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        consts = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
        meta = [(tuple(leaves[i].shape), leaves[i].dtype, leaves[i].device.type) for i in pos]
        return cls(spec, pos, consts, meta)

    def flatten(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The call's tensors, after checking the call matches the traced one."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise ValueError(f"the call's argument structure differs from the one remat planned for:\n"
                             f"  planned: {self.in_spec}\n  got:     {spec}")
        tensors = []
        for i, x in enumerate(leaves):
            if i in self.constants:
                if isinstance(x, torch.Tensor) or x != self.constants[i]:
                    raise ValueError(f"argument leaf {i} is {x!r}; remat planned for {self.constants[i]!r}")
            else:
                if not isinstance(x, torch.Tensor):
                    raise ValueError(f"argument leaf {i} is {type(x).__name__}; remat planned for a tensor")
                tensors.append(x)
        for t, (shape, dtype, dev) in zip(tensors, self.tensor_meta):
            if tuple(t.shape) != shape or t.dtype != dtype or t.device.type != dev:
                raise ValueError(f"input of shape {tuple(t.shape)} {t.dtype} on {t.device.type} does not "
                                 f"match the planned {shape} {dtype} on {dev}; call remat.optimize again "
                                 f"with example inputs of the new shape")
        return tensors

    def unflatten(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        leaves: list[Any] = [None] * (len(self.tensor_positions) + len(self.constants))
        for i, t in zip(self.tensor_positions, tensors):
            leaves[i] = t
        for i, c in self.constants.items():
            leaves[i] = c
        return pytree.tree_unflatten(leaves, self.in_spec)

    def record_outputs(self, out: Any) -> list[torch.Tensor]:
        leaves, self.out_spec = pytree.tree_flatten(out)
        self.out_tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.out_constants = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
        return [leaves[i] for i in self.out_tensor_positions]

    def rebuild_outputs(self, tensors) -> Any:
        assert self.out_spec is not None
        leaves: list[Any] = [None] * (len(self.out_tensor_positions) + len(self.out_constants))
        for i, t in zip(self.out_tensor_positions, tensors):
            leaves[i] = t
        for i, c in self.out_constants.items():
            leaves[i] = c
        return pytree.tree_unflatten(leaves, self.out_spec)


class _FlatStep(nn.Module):
    """Calls the user's model from flat tensors, so AOTAutograd sees a flat function. The model
    is registered as a submodule: AOTAutograd lifts its parameters and buffers as inputs."""

    def __init__(self, model: nn.Module, sig: FlatSignature):
        super().__init__()
        self.model = model
        self.sig = sig

    def forward(self, *tensors):
        args, kwargs = self.sig.unflatten(list(tensors))
        return tuple(self.sig.record_outputs(self.model(*args, **kwargs)))


def _compile_identity(gm: torch.fx.GraphModule, example_inputs):
    """Run the graph as it is, with the boxed calling convention: the graph receives the list of
    its inputs and clears it, so each input (a saved activation, in the backward) is freed after
    its last use instead of living until the graph returns."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()

    def run(args: list):
        return gm(args)

    run._boxed_call = True
    return run


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch and remat's own machinery: the user's line."""
    import os

    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    import remat
    import remat.runtime
    import remat.solver

    ours = {os.path.dirname(os.path.abspath(m.__file__)) for m in (remat, remat.runtime, remat.solver)}
    ours.add(os.path.dirname(os.path.abspath(__file__)))
    for fr in reversed(frames):
        path = os.path.abspath(fr.filename)
        if path.startswith(torch_dir) or path.startswith("<"):
            continue
        if os.path.dirname(path) in ours and not path.endswith("default_model.py"):
            continue
        return f"{fr.filename}:{fr.lineno}: {fr.line}"
    return "<unknown source line>"


def trace_training_step(model: nn.Module, args: tuple, kwargs: dict | None,
                        partition_fn: Callable[..., Any],
                        fused_attention: bool | str = True) -> tuple[Callable, FlatSignature]:
    """Trace model(*args, **kwargs) + its backward. `partition_fn(joint_gm, joint_inputs,
    num_fwd_outputs=...)` receives the joint graph and returns (forward_gm, backward_gm).
    With `fused_attention` (True/"exact", "all" or False), attention the fused op can take is traced
    as remat's flash-attention op (see remat.runtime.attention).
    Returns AOTAutograd's compiled callable (taking the flat tensors) and the signature."""
    from remat.runtime.attention import fused_attention_mode, route_attention

    fused_attention_mode(fused_attention)  # bad values are the caller's error, not a trace failure
    kwargs = dict(kwargs or {})
    sig = FlatSignature.of(tuple(args), kwargs)
    flat = [a for i, a in enumerate(pytree.tree_leaves((tuple(args), kwargs))) if i not in sig.constants]
    if not any(p.requires_grad for p in model.parameters()) and not any(t.requires_grad for t in flat):
        raise TraceError("nothing requires grad: there is no backward pass to plan")
    step = _FlatStep(model, sig)
    try:
        with record_module_spans(model) as spans, route_attention(fused_attention, model):
            # the spans are complete once tracing is done, which is before AOTAutograd partitions
            def partition_with_paths(joint_gm, joint_inputs, **kw):
                annotate_module_paths(joint_gm, spans)
                return partition_fn(joint_gm, joint_inputs, **kw)

            compiled = aot_module_simplified(step, flat, fw_compiler=_compile_identity,
                                             bw_compiler=_compile_identity,
                                             partition_fn=partition_with_paths)
    except TraceError:
        raise
    except Exception as e:  # tracing failures surface from deep inside torch: name the culprit
        if getattr(e, "_remat_passthrough", False):
            raise
        raise TraceError(f"could not trace the training step of {type(model).__name__}: "
                         f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}\n"
                         f"  at {_user_frame(e)}") from e
    if sig.out_spec is None:
        raise TraceError("tracing did not run the model's forward")
    return compiled, sig
