"""Trace a model's training step into AOTAutograd's joint forward+backward fx graph, and compile
it once split.

`capture_training_step` flattens (args, kwargs) into tensors, wraps the model so AOTAutograd sees a
flat function, and runs AOTAutograd's first stage: the joint graph (`CapturedStep.joint_gm`).
Whoever captured it decides, with plain calls, how the graph is split into a forward and a
backward (remat/pipeline.py: build the TrainingGraph, solve, lay the graph out by the plan), then
`CapturedStep.compile(forward_gm, backward_gm)` runs AOTAutograd's second stage, whose partition
function only hands it those two graphs. A failure while tracing or compiling is a TraceError;
an error of the caller's own between the two (an infeasible budget) leaves as it is.

The compiled step is called with the model's parameters and buffers as they are at each call
(`CompiledStep`): AOTAutograd binds the objects it saw while tracing, and a model whose
parameters were replaced since (`load_state_dict(..., assign=True)`) would otherwise keep training
the old tensors.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from remat.core.errors import RematError, RematWarning
from remat.compat.torch_private import (allow_retained_backward, aot_compile_joint, as_partitioner_runs,
                                       backward_keeps_graph, joint_graph, joint_metadata, joint_needs_autograd,
                                       joint_state_names, pytree)
from remat.graph_capture.eager_calls import eager_executable
from remat.graph_capture.export import TraceError, export_joint
from remat.graph_capture.module_paths import annotate_module_paths
from remat.graph_capture.outputs import OutputError, OutputStructure
from remat.graph_capture.step_identity import StepIdentity, graph_code, placeholder_layouts
from remat.graph_capture.trace_failures import what_failed
from remat.graph_capture.traced_state import traced_tensors_not_kept
from remat.graph_capture.unreached_gradients import gradient_sources, leave_unreached_none

__all__ = ["FlatSignature", "TraceError", "OutputError", "ParameterMismatchError", "DoubleBackwardError",
           "RetainedGraphWarning", "CompiledStep", "CapturedStep", "run_boxed", "capture_training_step", "bound_step"]


class ParameterMismatchError(RematError, RuntimeError):
    """The model's parameters or buffers no longer match the ones the step was traced with (other
    names, shapes, dtypes, devices, requires_grad or tying): the step cannot run them."""


class DoubleBackwardError(RematError, RuntimeError):
    """A backward with `create_graph=True` (double backward: gradient penalties, MAML) reached a
    planned step, whose backward is one compiled function autograd cannot differentiate again."""


class RetainedGraphWarning(RematWarning):
    """A backward with `retain_graph=True` ran through a planned step: its saved activations stay
    alive for the whole backward (and after it), so the step can peak above the plan's prediction."""


def _check_backward(grad_outputs) -> None:
    """Runs before a planned step's backward (a prehook on its outputs' grad_fns): refuse a double
    backward before anything is computed, and say once that retain_graph keeps what the plan frees."""
    if torch.is_grad_enabled():  # autograd enables grad mode in a backward exactly when create_graph=True
        raise DoubleBackwardError(
            "backward(create_graph=True) / autograd.grad(..., create_graph=True) reached a remat module: its "
            "planned backward runs as one compiled function, which autograd cannot differentiate again "
            "(double backward, e.g. a gradient penalty). Compute that loss through the unplanned model "
            "(`opt.module(...)`, or torch.utils.checkpoint), and use the remat module for the ordinary steps.")
    if backward_keeps_graph():
        global _said_retained
        if not _said_retained:
            _said_retained = True
            warnings.warn(RetainedGraphWarning(
                "backward(retain_graph=True) through a remat module: gradients are as eager's, but the step's saved "
                "activations are kept for the whole backward (the plan frees each after its last use), so this "
                "step can peak above the plan's prediction"), stacklevel=3)


_said_retained = False


def guard_backward(outputs) -> None:
    """Register `_check_backward` on every grad_fn of a planned step's outputs (each path from a loss
    back into the step passes one of them)."""
    for fn in {id(t.grad_fn): t.grad_fn for t in outputs
               if isinstance(t, torch.Tensor) and t.grad_fn is not None}.values():
        fn.register_prehook(_check_backward)


@dataclass
class FlatSignature:
    """How one call's (args, kwargs) map to the flat tensors the compiled step takes."""

    in_spec: pytree.TreeSpec
    tensor_positions: list[int]  # which leaves are tensors
    constants: dict[int, Any]  # the non-tensor leaves, fixed at trace time
    tensor_meta: list[tuple[tuple[int, ...], torch.dtype, str]]  # (shape, dtype, device type)
    outputs: OutputStructure | None = None  # filled in while tracing

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
        """The output's tensors; OutputError for an output no later call could return."""
        self.outputs, tensors = OutputStructure.of(out)
        return tensors

    def rebuild_outputs(self, tensors) -> Any:
        assert self.outputs is not None
        return self.outputs.rebuild(list(tensors))


class _FlatStep(nn.Module):
    """Calls the user's model from flat tensors, so AOTAutograd sees a flat function. The model
    is registered as a submodule: AOTAutograd lifts its parameters and buffers as inputs."""

    def __init__(self, model: nn.Module, sig: FlatSignature):
        super().__init__()
        self.model = model
        self.sig = sig

    def forward(self, *tensors):
        args, kwargs = self.sig.unflatten(list(tensors))
        # each run of the forward while it is traced (AOTAutograd runs it twice: for the graph's
        # metadata, then for the graph) starts from the model's own state, not from a cache the
        # last run built of its tensors
        with traced_tensors_not_kept(self.model):
            return tuple(self.sig.record_outputs(self.model(*args, **kwargs)))


def _state_of(module: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """Names and tensors of the parameters and buffers, in the order AOTAutograd lifts them as the
    step's first inputs (tied parameters once per name)."""
    # one walk of the modules (named_parameters and named_buffers would walk them twice), in their
    # order: this runs before every step
    pnames, ptensors, bnames, btensors = [], [], [], []
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for k, p in m._parameters.items():
            if p is not None:
                pnames.append(dot + k)
                ptensors.append(p)
        for k, b in m._buffers.items():
            if b is not None:
                bnames.append(dot + k)
                btensors.append(b)
    return pnames + bnames, ptensors + btensors


def _describe(t: torch.Tensor) -> tuple:
    # strides too: a traced graph may read its inputs with the strides it saw (as_strided)
    return tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad


def _ties(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor, the index of the first one that is the same object (tied weights)."""
    first: dict[int, int] = {}
    return [first.setdefault(id(t), i) for i, t in enumerate(tensors)]


class CompiledStep:
    """AOTAutograd's compiled training step, called with the model's parameters and buffers as
    they are at each call, so a replaced parameter (`load_state_dict(sd, assign=True)`,
    `model.fc.weight = nn.Parameter(...)`) is the one trained. The graph was traced for the
    parameters' names, shapes, strides, dtypes, devices, requires_grad and tying; a call that finds any of
    these changed raises ParameterMismatchError rather than run a graph made for other tensors.

    `run` is AOTAutograd's runtime function (`aot_compile_joint`), taking one list: the parameters
    and buffers, then the inputs; `step` the module it traced, whose parameters and buffers it lifted
    in `_state_of`'s order."""

    def __init__(self, run: Callable, step: nn.Module, sources: list[int] | None = None, num_fwd_outputs: int = 0):
        self._run = run
        self._module = step
        self._sources, self._num_fwd = sources, num_fwd_outputs  # unreached_gradients.py
        self._names, tensors = _state_of(step)
        self._meta = [_describe(t) for t in tensors]
        self._ties = _ties(tensors)
        allow_retained_backward(run)  # retain_graph=True works as in eager

    def _name(self, i: int) -> str:
        return self._names[i].removeprefix("model.")

    def current_state(self) -> list[torch.Tensor]:
        """The parameters and buffers to run with now, checked against the traced ones."""
        names, tensors = _state_of(self._module)
        if names != self._names:
            gone = [n.removeprefix("model.") for n in self._names if n not in names]
            new = [n.removeprefix("model.") for n in names if n not in self._names]
            raise ParameterMismatchError(
                f"the model's parameters and buffers changed since remat.optimize traced it (removed: "
                f"{gone or 'none'}, added: {new or 'none'}); call remat.optimize again")
        for i, (t, meta) in enumerate(zip(tensors, self._meta)):
            if _describe(t) != meta:
                raise ParameterMismatchError(
                    f"{self._name(i)} is now {_describe(t)} (shape, strides, dtype, device, requires_grad), "
                    f"traced as {meta}; the planned step cannot run it: call remat.optimize again")
        if _ties(tensors) != self._ties:
            i = next(i for i, (a, b) in enumerate(zip(_ties(tensors), self._ties)) if a != b)
            raise ParameterMismatchError(
                f"{self._name(i)} is tied to other parameters differently than when traced (shared weights "
                f"were split or joined); call remat.optimize again")
        return tensors

    def bound_to(self, model: nn.Module) -> "CompiledStep":
        """This compiled step, run with `model`'s parameters and buffers: for a model whose traced step
        equals this one's (graph_capture/step_identity.py, e.g. another block of the same structure),
        so it is not traced again. ParameterMismatchError where its state is laid out otherwise."""
        other = copy.copy(self)
        other._module = _FlatStep(model, self._module.sig)
        other._names, tensors = _state_of(other._module)
        other._meta = [_describe(t) for t in tensors]
        other._ties = _ties(tensors)
        if (other._names, other._meta, other._ties) != (self._names, self._meta, self._ties):
            raise ParameterMismatchError(f"{type(model).__name__}'s parameters and buffers are not laid out as "
                                         f"those the step was traced with")
        return other

    def __call__(self, *flat: torch.Tensor):
        outs = self._run([*self.current_state(), *flat])
        guard_backward(outs)
        leave_unreached_none(outs, self._sources, self._num_fwd)
        return outs


def run_boxed(gm: torch.fx.GraphModule, example_inputs):
    """An AOTAutograd compiler that runs the graph as it is, with the boxed calling convention: the graph receives the list of
    its inputs and clears it, so each input (a saved activation, in the backward) is freed after
    its last use instead of living until the graph returns."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()
    runnable = eager_executable(gm)  # the same calls, the frequent ones through public bindings

    def run(args: list):
        # forward, not __call__: global module hooks (FlopCounterMode's ModuleTracker) are not meant
        # for the step's own graphs, and register grad hooks on their outputs, which fails here
        return runnable.forward(args)

    run._boxed_call = True
    return run


class CapturedStep:
    """A training step `capture_training_step` traced: AOTAutograd's joint graph (`joint_gm`: primals
    then tangents in; the `num_fwd_outputs` forward outputs, then one gradient per primal, out) and
    the call's signature (`sig`). Valid inside the `with` only (AOTAutograd's contexts are open)."""

    def __init__(self, joint, step: "_FlatStep", autocast, name: str):
        self._joint = joint
        self._step = step
        self._autocast = autocast
        self.name = name
        self.sig = step.sig
        self.joint_gm = joint_graph(joint)
        out = next(n for n in reversed(self.joint_gm.graph.nodes) if n.op == "output")
        primals = sum(1 for n in self.joint_gm.graph.nodes if n.op == "placeholder" and n.name.startswith("primals"))
        self.num_fwd_outputs = len(out.args[0]) - primals
        if self.num_fwd_outputs < 0:
            raise TraceError(f"the joint graph of {name} has fewer outputs ({len(out.args[0])}) than primals ({primals})")
        if joint_state_names(joint) != _state_of(step)[0]:
            raise TraceError(f"AOTAutograd lifted the parameters and buffers of {name} in another order than "
                             "remat passes them")

    def identity(self) -> StepIdentity | None:
        """What this step computes, to compare with another traced step (graph_capture/step_identity.py);
        None where a constant of its graph cannot be compared. Taken before the graph is rewritten."""
        code = graph_code(self.joint_gm)
        if code is None:
            return None
        names, tensors = _state_of(self._step)
        sig = self.sig
        return StepIdentity(code=code[0], constants=code[1], placeholders=placeholder_layouts(self.joint_gm),
                            metadata=joint_metadata(self._joint),
                            signature=(sig.in_spec, sig.constants, sig.tensor_meta, sig.outputs),
                            state=(names, [_describe(t) for t in tensors], _ties(tensors)), autocast=self._autocast)

    @staticmethod
    def graph_work():
        """The context the work on the joint graph runs in (rewrites, measured costs, the split):
        grad and autocast off, as AOTAutograd runs a partition function."""
        return as_partitioner_runs()

    def compile(self, forward_gm: torch.fx.GraphModule, backward_gm: torch.fx.GraphModule,
                graph_compilers: tuple[Callable, Callable] | None = None) -> Callable:
        """The compiled step (a CompiledStep, guarded for autocast, taking the flat tensors) that
        runs `forward_gm` and `backward_gm`, the joint graph split. `graph_compilers`: AOTAutograd's
        (forward, backward) compilers for them (default: run them as they are, boxed)."""
        joint, n_fwd = self.joint_gm, self.num_fwd_outputs
        handed: list[bool] = []

        def hand_over(joint_gm, joint_inputs, *, num_fwd_outputs: int, **kw):
            # the split was made for the captured graph: refuse to hand it over for any other
            if joint_gm is not joint or num_fwd_outputs != n_fwd:
                raise TraceError("AOTAutograd's joint graph changed between capture and compile "
                                 f"({num_fwd_outputs} forward outputs, captured {n_fwd})")
            handed.append(True)
            return forward_gm, backward_gm

        from remat.graph_capture.autocast_state import guard_autocast

        fw_compiler, bw_compiler = graph_compilers or (run_boxed, run_boxed)
        try:
            run = aot_compile_joint(self._joint, hand_over, fw_compiler, bw_compiler)
        except RematError:
            raise
        except Exception as e:
            raise TraceError(f"could not compile the training step of {self.name}: {what_failed(e)}") from e
        if not handed:
            raise TraceError(f"AOTAutograd compiled the step of {self.name} without asking for its split")
        sources = gradient_sources(joint, n_fwd)
        return guard_autocast(CompiledStep(run, self._step, sources, n_fwd), self._autocast)


def bound_step(step: Callable, model: nn.Module) -> Callable | None:
    """`step` (what `CapturedStep.compile` returned) run with `model`'s parameters and buffers
    (`CompiledStep.bound_to`), under the same autocast guard; None for a step of another kind."""
    from remat.graph_capture.autocast_state import guard_autocast

    compiled = getattr(step, "__wrapped__", None)
    if not isinstance(compiled, CompiledStep) or not hasattr(step, "autocast_state"):
        return None
    return guard_autocast(compiled.bound_to(model), step.autocast_state)


@contextmanager
def capture_training_step(model: nn.Module, args: tuple, kwargs: dict | None, fused_attention: bool | str = True,
                          chunked_loss: bool = False) -> Iterator[CapturedStep]:
    """Trace model(*args, **kwargs) + its backward into AOTAutograd's joint graph (a CapturedStep,
    valid inside the `with`). With `fused_attention` (True/"exact", "all" or False), attention the
    fused op can take is traced as remat's flash-attention op (see remat.attention.router; where
    that trace fails, the model's own attention code: graph_capture/export.py). With
    `chunked_loss`, a linear head followed by cross-entropy is traced as remat's chunked loss op
    (see remat.loss_head.router). Modules torch.compile wrapped are traced as the eager modules they
    wrap (`set_stance("force_eager")`): the compiler must not run inside the trace.
    Raises OutputError for an output no later call could return, and TraceError for any other
    failure to trace; errors raised inside the `with` leave as they are."""
    from remat.attention.router import fused_attention_mode

    fused_attention_mode(fused_attention)  # bad values are the caller's error, not a trace failure
    kwargs = dict(kwargs or {})
    sig = FlatSignature.of(tuple(args), kwargs)
    flat = [a for i, a in enumerate(pytree.tree_leaves((tuple(args), kwargs))) if i not in sig.constants]
    if not any(p.requires_grad for p in model.parameters()) and not any(t.requires_grad for t in flat):
        raise TraceError("nothing requires grad: there is no backward pass to plan")
    step = _FlatStep(model, sig)
    name = type(model).__name__
    with ExitStack() as stack:
        joint, spans, autocast = export_joint(stack, model, step, flat, fused_attention, chunked_loss)
        if sig.outputs is None:
            raise TraceError("tracing did not run the model's forward")
        if not joint_needs_autograd(joint):  # traced for inference: no output depends on a parameter
            hint = ("" if torch.is_grad_enabled() else "; grad is disabled where remat was called (torch.no_grad() or "
                    "torch.inference_mode()): call it with grad enabled, as the training step runs")
            raise TraceError(f"no output of {name} requires grad (none depends on a parameter "
                             f"or an input that requires grad): there is no backward pass to plan{hint}")
        captured = CapturedStep(joint, step, autocast, name)
        annotate_module_paths(captured.joint_gm, spans)
        yield captured
