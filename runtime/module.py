"""RematModule: the drop-in nn.Module that runs a training step under a Plan."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from remat.graph_capture.joint import FlatSignature
from remat.graph_capture.training_graph import TrainingGraph
from remat.solver.plan import Plan

__all__ = ["RematModule"]


class RematModule(nn.Module):
    """Wraps the user's model. In training mode with grad enabled, a call runs the planned
    forward (keeping only what the plan keeps) and the backward recomputes the rest where the plan
    says. In eval mode or under no_grad there is nothing to plan and the model runs as it is.

    Parameters, buffers and state_dict keys are the model's own: an optimizer built over
    `model.parameters()` before `optimize()` keeps training the same tensors."""

    def __init__(self, model: nn.Module, compiled_step: Callable, signature: FlatSignature,
                 plan: Plan, graph: TrainingGraph):
        super().__init__()
        self.module = model
        # not submodules or buffers: plain attributes, invisible to state_dict and .to()
        self.__dict__["_step"] = compiled_step
        self.__dict__["_signature"] = signature
        self.__dict__["plan"] = plan
        self.__dict__["graph"] = graph

    def forward(self, *args, **kwargs):
        if not (self.module.training and torch.is_grad_enabled()):
            return self.module(*args, **kwargs)
        flat = self._signature.flatten(args, kwargs)
        return self._signature.rebuild_outputs(self._step(*flat))

    # the state is the wrapped model's, under its own keys
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["module"], name)

    def extra_repr(self) -> str:
        p = self.plan
        return (f"strategy={p.strategy}, predicted_peak={p.predicted_peak_bytes / 2**20:.1f} MiB, "
                f"extra_cost={p.extra_cost / max(self.graph.total_cost, 1):.1%}")
