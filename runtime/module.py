"""RematModule: the drop-in nn.Module that runs a training step under a Plan."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from remat.graph_capture.joint import FlatSignature
from remat.graph_capture.training_graph import TrainingGraph
from remat.runtime.compile import PlannedGraphs
from remat.solver.plan import Plan

__all__ = ["RematModule", "ModeMismatchError", "OutsideBudgetWarning"]


class ModeMismatchError(RuntimeError):
    """A call with grad enabled in another train/eval mode than the one the plan was made for: the
    planned graph would compute the other mode's function, and the model run as it is would
    ignore the budget."""


class OutsideBudgetWarning(UserWarning):
    """The model returns more than a loss: memory used outside the module is not budgeted."""


def _modes(model: nn.Module) -> list[tuple[str, bool]]:
    return [(name, m.training) for name, m in model.named_modules()]


class RematModule(nn.Module):
    """Wraps the user's model. With grad enabled, a call runs the planned step: the forward keeps
    only what the plan keeps and the backward recomputes the rest where the plan says. The plan is
    for the train/eval mode of every submodule at optimize() time (dropout, BatchNorm); a call
    with grad enabled in any other mode raises ModeMismatchError. Under no_grad (inference) there
    is no backward to plan and the model runs as it is, in whatever mode.

    Parameters, buffers and state_dict keys are the model's own: an optimizer built over
    `model.parameters()` before `optimize()` keeps training the same tensors, and parameters
    replaced later (`load_state_dict(sd, assign=True)`) are the ones the step uses and trains."""

    def __init__(self, model: nn.Module, compiled_step: Callable, signature: FlatSignature,
                 plan: Plan, graph: TrainingGraph, graphs: PlannedGraphs | None = None):
        super().__init__()
        self.module = model
        # not submodules or buffers: plain attributes, invisible to state_dict and .to()
        self.__dict__["_step"] = compiled_step
        self.__dict__["_signature"] = signature
        self.__dict__["_planned_modes"] = _modes(model)
        self.__dict__["plan"] = plan
        self.__dict__["graph"] = graph
        self.__dict__["planned_graphs"] = graphs  # the step's forward/backward graphs (runtime/compile.py)

    def adopt(self, other: "RematModule") -> None:
        """Run `other`'s planned step from now on: another plan for the same model, traced by
        `remat.optimize(self.module, ..., plan=...)` (e.g. once FSDP2 has sharded this module, under
        its `unshard()`). The module, its parameters and any wrapper around this one stay as they are."""
        if other.module is not self.module:
            raise ValueError("adopt() takes a RematModule made for the same model (remat.optimize(self.module, ...))")
        mine, theirs = self.planned_graphs, other.planned_graphs
        if mine is not None and mine.inductor and theirs is not None:
            theirs.use_inductor()  # compiled as this one was
        for key in ("_step", "_signature", "_planned_modes", "plan", "graph", "planned_graphs"):
            self.__dict__[key] = other.__dict__[key]

    def _check_mode(self) -> None:
        now = _modes(self.module)
        if now == self._planned_modes:
            return
        if [n for n, _ in now] != [n for n, _ in self._planned_modes]:
            raise ModeMismatchError("the model's submodules changed since remat.optimize traced it; "
                                    "call remat.optimize again")
        diff = [(n or type(self.module).__name__, was) for (n, was), (_, is_) in zip(self._planned_modes, now)
                if was != is_]
        name, was = diff[0]
        who = f"{name} and {len(diff) - 1} other submodule(s) are" if len(diff) > 1 else f"{name} is"
        raise ModeMismatchError(
            f"this module was planned in {'train' if was else 'eval'} mode, but {who} now in "
            f"{'eval' if was else 'train'} mode with grad enabled: the plan does not cover this step. Run "
            f"inference under torch.no_grad(), switch back with .{'train' if was else 'eval'}(), or call "
            f"remat.optimize on the model in the mode you train it in")

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # inference: nothing to plan (compiled as usual under torch.compile)
            return self.module(*args, **kwargs)
        if torch.compiler.is_dynamo_compiling():  # torch.compile traces this call: see _step_under_compile
            return _step_under_compile(self, args, kwargs)
        return self._planned_step(args, kwargs)

    def _planned_step(self, args: tuple, kwargs: dict):
        self._check_mode()
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


@torch.compiler.disable(reason="remat's planned step is a graph break by design: it is already partitioned "
                        "into the plan's forward and backward, and retracing it would let the compiler's "
                        "partitioner choose what to save again; Inductor compiles its two graphs as they are "
                        "(remat.runtime.compile). fullgraph=True cannot hold it: compile without fullgraph, or "
                        "pass the compiled model to remat.optimize(torch.compile(model), ...)")
def _step_under_compile(module: RematModule, args: tuple, kwargs: dict):
    """The planned step, called from code torch.compile compiled (Dynamo breaks the graph here):
    its forward and backward graphs are compiled by Inductor at their first call, as they are."""
    if module.planned_graphs is not None:
        module.planned_graphs.use_inductor()
    return module._planned_step(args, kwargs)
