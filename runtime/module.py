"""RematModule: the drop-in nn.Module that runs a model's training steps under plans.

A training loop calls a module in more ways than the one call remat traced: the last, smaller
batch of an epoch, dynamically padded sequences, inputs that require grad (a block inside a bigger
model), another train/eval mode or autocast, keyword arguments present or absent. Each of these is
another function to differentiate, and a graph traced for one of them computes the wrong thing for
another (an input traced as not requiring grad gets no gradient). So each gets its own plan: a
call's *key* (`call_key`) is everything a traced graph is specialised on (the argument structure,
the values of the non-tensor arguments, each tensor's shape, dtype, device type, requires_grad and
strides where it is not contiguous, every submodule's train/eval mode, the autocast state, and the
model's Python state the forward read: module hooks and plain attribute values,
runtime/call_state.py), and the module keeps one planned step per key (`PlannedStep`). A call
whose key it has not seen is planned by its `planner` (remat/pipeline.py: trace that call, then a
plan judged by the simulator on that call's graph) before it runs, so no call runs a graph traced
for another.

The planned steps are a cache bounded like torch.compile's recompile limit (`cache_limit`, 8 by
default): past it the least recently used step is dropped (its plan is kept, so a key seen again
costs a trace, not a solve) and PlanCacheLimitWarning says so once. `plan_log` records how each key
was planned and what it cost.

Why this file is long: the key, the cache it indexes and every way a module comes by its planned
steps (planned, copied, adopted, rebound from an equal module's) are one object's behaviour.
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn

from remat.core.errors import RematWarning
from remat.compat.torch_private import pytree
from remat.graph_capture.autocast_state import AutocastState
from remat.graph_capture.joint import FlatSignature, bound_step
from remat.runtime.call_state import module_state
from remat.core.training_graph import TrainingGraph
from remat.runtime.compile import PlannedGraphs
from remat.core.plan import Plan

__all__ = ["RematModule", "ModelWrapper", "SignatureForward", "PlannedStep", "PlanRecord", "CallPlanner", "CallKey", "call_key",
           "describe_key", "model_device_types", "OutsideBudgetWarning", "BlockBudgetWarning", "PlanCacheLimitWarning", "DEFAULT_CACHE_LIMIT"]

# torch._dynamo.config.recompile_limit's default: the planned steps a module keeps before it drops
# the least recently used one
DEFAULT_CACHE_LIMIT = 8


class OutsideBudgetWarning(RematWarning):
    """The model returns more than a loss: memory used outside the module is not budgeted."""


class BlockBudgetWarning(RematWarning):
    """A block planned within a larger step (remat/blockwise.py) met a call that needs more than its
    share of the step's budget: planned at that call's smallest feasible budget instead."""


class PlanCacheLimitWarning(RematWarning):
    """A module met more kinds of call (shapes, requires_grad patterns, modes) than its cache holds:
    each new one costs a trace from now on."""


CallKey = tuple  # (argument structure, leaves, submodule modes, frozen parameters, autocast state, hooks,
# attribute values): see call_key


def _modes(model: nn.Module) -> tuple[tuple[str, bool], ...]:
    return tuple((name, m.training) for name, m in model.named_modules())


def _frozen(model: nn.Module) -> tuple[int, ...]:
    """The positions of the model's parameters that do not require grad: freezing or unfreezing a
    layer during training (fine-tuning schedules) changes which gradients the step computes, so the
    step is planned again for the new pattern."""
    return tuple(i for i, p in enumerate(model.parameters()) if not p.requires_grad)


def model_device_types(model: nn.Module) -> tuple[str, ...]:
    """The device types of the model's parameters and buffers (for call_key)."""
    return tuple(sorted({t.device.type for t in (*model.parameters(), *model.buffers())}))


def _value_key(x: Any) -> tuple:
    """A non-tensor argument as part of a key: its type and value (1, 1.0 and True differ)."""
    try:
        hash(x)
        return (type(x), x)
    except TypeError:  # an unhashable leaf (rare: pytree flattens containers) by its repr
        return (type(x), repr(x))


def call_key(model: nn.Module, args: tuple, kwargs: dict,
             device_types: tuple[str, ...]) -> tuple[CallKey, list[torch.Tensor]]:
    """The key of the call `model(*args, **kwargs)` and its tensors in argument order.
    `device_types`: where the model's parameters are (the autocast state is read for those and the
    inputs' device types)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors: list[torch.Tensor] = []
    parts = []
    types = set(device_types)
    for x in leaves:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            types.add(x.device.type)
            # strides where not contiguous: a graph traced on one layout can fail on another (a view
            # of a contiguous input is no view of a channels_last one)
            layout = None if x.is_contiguous() else tuple(x.stride())
            parts.append((tuple(x.shape), x.dtype, x.device.type, x.requires_grad, layout))
        else:
            parts.append(_value_key(x))
    hooks, settings = module_state(model)
    return (spec, tuple(parts), _modes(model), _frozen(model), AutocastState.current(types), hooks, settings), tensors


def describe_key(key: CallKey) -> str:
    """The call a key stands for, in a few words: each argument's shape and dtype (requires_grad
    where it does), or its value, and the mode: "idx=(4, 64) int64, targets=(4, 64) int64 (train)"."""
    spec, parts, modes, frozen, autocast, hooks, _ = key

    def leaf(p: tuple) -> str:
        if len(p) == 5 and isinstance(p[1], torch.dtype):
            shape, dtype, _, grad, strides = p
            return (f"{tuple(shape)} {str(dtype).removeprefix('torch.')}{' requires_grad' if grad else ''}"
                    f"{f' strides {strides}' if strides is not None else ''}")
        return repr(p[1])

    args, kwargs = pytree.tree_unflatten([leaf(p) for p in parts], spec)
    named = [str(a) if not isinstance(a, str) else a for a in args]
    named += [f"{k}={v}" for k, v in kwargs.items()]
    mode = "train" if modes and modes[0][1] else "eval"
    extra = f", {len(frozen)} parameters frozen" if frozen else ""
    extra += "" if not autocast.enabled else f", {autocast}"
    extra += f", {len(hooks)} kinds of module hooks" if hooks else ""
    return f"inputs {', '.join(named) or 'none'} ({mode}{extra})"


@dataclass(frozen=True)
class PlanRecord:
    """How one key was planned: `how` is "solved", "keep_all fits", "reused the schedule of <call>"
    or "saved plan"; `trace_s`, the trace (graph capture) time, `plan_s` the time to decide the plan
    (solve, or re-simulate a reused schedule); the plan's predicted peak against the budget."""

    call: str
    how: str
    trace_s: float
    plan_s: float
    predicted_peak_bytes: int
    budget_bytes: int | None


@dataclass
class PlannedStep:
    """One planned call: the compiled step over the call's flat tensors (AOTAutograd's, running the
    plan's forward and backward graphs), how the call's arguments and outputs map to them, the plan
    and the graph it was made on, and the step's graphs (to switch to Inductor)."""

    step: Callable
    signature: FlatSignature
    plan: Plan
    graph: TrainingGraph
    graphs: PlannedGraphs
    record: PlanRecord
    compiled_fit: list[tuple[int, int]] | None = None  # remat/compiled_fit.py's rounds, if it ran

    def run(self, tensors: list[torch.Tensor]) -> Any:
        """The step on the call's tensors (a call of this step's key), its outputs rebuilt."""
        return self.signature.rebuild_outputs(self.step(*tensors))

    def __call__(self, *args, **kwargs) -> Any:
        return self.run(self.signature.flatten(args, kwargs))


class CallPlanner(Protocol):
    """What a RematModule asks to plan a call it has not seen (remat/pipeline.py's StepPlanner)."""

    def plan_call(self, model: nn.Module, args: tuple, kwargs: dict, *, known: Plan | None,
                  others: list[tuple[str, Plan]], call: str) -> PlannedStep:
        """The planned step for `model(*args, **kwargs)`: `known`, a plan already made for this key
        (a saved or copied one, judged again on the new trace); `others`, (call, plan) of the other
        keys (the most recent last), whose schedules may serve again; `call` describes this call."""
        ...


class SignatureForward:
    """A wrapper module's `forward`, presenting the wrapped model's signature (`inspect.signature`,
    which Hugging Face's Trainer reads to keep the dataset columns the model takes) and calling the
    wrapper's `_dispatch(args, kwargs)`. It holds its module weakly, so the wrapper is freed as soon
    as it is dropped (no reference cycle)."""

    def __init__(self, module: nn.Module):
        self._module = weakref.ref(module)
        try:
            import inspect

            self.__signature__ = inspect.signature(module.module.forward)
        except (TypeError, ValueError):  # a forward without a signature (a builtin)
            pass
        self.__doc__ = getattr(module.module.forward, "__doc__", None)

    def __call__(self, *args, **kwargs):
        module = self._module()
        assert module is not None, "the module this forward belongs to was freed"
        return module._dispatch(args, kwargs)


class ModelWrapper(nn.Module):
    """A module that wraps the user's model as a drop-in: the model is its one submodule
    (`.module`), its state_dict keys are the model's own, attributes it lacks are the model's, and its
    `forward` presents the model's signature and calls `_dispatch(args, kwargs)`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model
        self.__dict__["forward"] = SignatureForward(self)

    def _dispatch(self, args: tuple, kwargs: dict):
        raise NotImplementedError

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("forward", None)  # made again for the copy
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__["forward"] = SignatureForward(self)

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


class RematModule(ModelWrapper):
    """Wraps the user's model. With grad enabled, a call runs the planned step for its key (see the
    module docstring; a key not seen before is planned first): the forward keeps only what the plan
    keeps and the backward recomputes the rest where the plan says. Under no_grad (inference), and
    when nothing the call touches requires grad, there is no backward to plan and the model runs as
    it is.

    Parameters, buffers and state_dict keys are the model's own: an optimizer built over
    `model.parameters()` before `optimize()` keeps training the same tensors, and parameters
    replaced later (`load_state_dict(sd, assign=True)`) are the ones the step uses and trains.
    `plan` and `graph` are those of the latest call (at first, of the example inputs); `plans` holds
    every key's. `copy.deepcopy`, pickle and `torch.save` copy the model and the plans; the copy
    traces again at its first call of each key, with the same plan (no solve)."""

    def __init__(self, model: nn.Module, planner: CallPlanner,
                 first: tuple[CallKey, PlannedStep] | tuple[CallKey, PlannedStep, CallKey] | None = None,
                 *, cache_limit: int = DEFAULT_CACHE_LIMIT):
        super().__init__(model)
        # not submodules or buffers: plain attributes, invisible to state_dict and .to()
        d = self.__dict__
        d["_planner"] = planner
        d["_steps"] = OrderedDict()  # key -> PlannedStep, least recently used first
        d["_plans"] = {}  # key -> Plan, for every key planned (also those dropped from _steps)
        d["_latest"] = None  # the key of the latest call
        d["cache_limit"] = cache_limit
        d["_said_limit"] = False
        d["_inductor"] = False  # the steps' graphs run Inductor's code (torch.compile)
        d["plan_log"] = []  # a PlanRecord per key planned, in order
        d["_device_types"] = model_device_types(model)
        if first is not None:
            self._add(*first)

    # ---- the plans -------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan of the latest call (before any call: of the example inputs)."""
        return self._plans[self._latest]

    @property
    def graph(self) -> TrainingGraph:
        step = self._steps.get(self._latest)
        return step.graph if step is not None else self.plan.graph

    @property
    def plans(self) -> list[Plan]:
        """Every key's plan, in the order they were made."""
        return list(self._plans.values())

    @property
    def planned_graphs(self) -> PlannedGraphs | None:
        """The latest call's forward and backward graphs (None once its step left the cache)."""
        step = self._steps.get(self._latest)
        return step.graphs if step is not None else None

    @property
    def compiled_fit(self) -> list[tuple[int, int]] | None:
        step = self._steps.get(self._latest)
        return step.compiled_fit if step is not None else None

    def plan_for(self, *args, **kwargs) -> Plan:
        """Plan the call `self(*args, **kwargs)` now, without running it (e.g. for the largest
        shapes a run will see, before training): its planned step is cached as a call would
        cache it, and InfeasibleBudgetError says so now if the budget cannot hold at that shape."""
        key, _ = call_key(self.module, args, kwargs, self._device_types)
        return self._step_for(key, args, kwargs).plan

    def _add(self, key: CallKey, step: PlannedStep, also: CallKey | None = None) -> None:
        """Cache `step` under `key`, and under `also`: the key of the same call after it was traced,
        where tracing changed the model's attributes (a forward that counts its calls): the next
        call finds them so (the planned step does not run the forward's Python) and is not traced
        again for it."""
        if self._inductor:
            step.graphs.use_inductor()
        if also is not None and also != key:
            self._steps[also] = step
        self._steps[key] = step
        self._plans[key] = step.plan
        self.__dict__["_latest"] = key
        self.plan_log.append(step.record)
        while len(self._steps) > max(1, self.cache_limit):
            dropped, _ = self._steps.popitem(last=False)
            if not self._said_limit:
                self.__dict__["_said_limit"] = True
                warnings.warn(PlanCacheLimitWarning(
                    f"{type(self.module).__name__}: this module met more than cache_limit={self.cache_limit} kinds "
                    f"of call (input shapes, requires_grad patterns, modes, module hooks or attribute values, such "
                    f"as a dropout rate changed); from now on the least recently used "
                    f"planned step is dropped and traced again when its call comes back (its plan is kept, so "
                    f"that costs a trace, not a solve). Raise cache_limit (remat.optimize(..., cache_limit=...)), "
                    f"or pad batches to fewer shapes."), stacklevel=4)

    def _step_for(self, key: CallKey, args: tuple, kwargs: dict) -> PlannedStep:
        step = self._steps.get(key)
        if step is not None:
            self._steps.move_to_end(key)
            self.__dict__["_latest"] = key
            return step
        signature = getattr(self.forward, "__signature__", None)
        if signature is not None:  # a call the model's forward would refuse: its TypeError, not a trace
            signature.bind(*args, **kwargs)
        others = [(describe_key(k), p) for k, p in self._plans.items() if k != key]
        step = self._planner.plan_call(self.module, args, kwargs, known=self._plans.get(key), others=others,
                                       call=describe_key(key))
        self._add(key, step, also=call_key(self.module, args, kwargs, self._device_types)[0])
        return step

    def with_planner(self, planner: CallPlanner) -> "RematModule":
        """A RematModule of the same model that runs this one's planned steps (the same objects: no
        trace) and plans the calls it has not seen with `planner` (remat/blockwise.py: a block whose
        plan at another level is the same schedule keeps its step, under that level's budget)."""
        other = RematModule(self.module, planner, cache_limit=self.cache_limit)
        d = other.__dict__
        d["_steps"], d["_plans"] = OrderedDict(self._steps), dict(self._plans)
        d["_latest"], d["plan_log"], d["_inductor"] = self._latest, list(self.plan_log), self._inductor
        return other

    def bound_to(self, model: nn.Module, planner: CallPlanner, key: CallKey) -> "RematModule | None":
        """A RematModule of `model` running this module's latest planned step with `model`'s own
        parameters and buffers for the call `key` (not traced again), and planning the calls it has
        not seen with `planner`: for a model whose traced step for that call equals this one's
        (remat/blockwise.py: StepIdentity, blocks of one structure). None where it cannot be rebound."""
        step = self._steps.get(self._latest)
        bound = bound_step(step.step, model) if step is not None else None
        if bound is None:
            return None
        record = dataclasses.replace(step.record, call=describe_key(key), how="the step of an equal module",
                                     trace_s=0.0, plan_s=0.0)
        other = RematModule(model, planner, (key, dataclasses.replace(step, step=bound, record=record)),
                            cache_limit=self.cache_limit)
        other.__dict__["_inductor"] = self._inductor
        return other

    def adopt(self, other: "RematModule") -> None:
        """Run `other`'s planned steps from now on: other plans for the same model, traced by
        `remat.optimize(self.module, ..., plan=...)` (e.g. once FSDP2 has sharded this module, under
        its `unshard()`). The module, its parameters and any wrapper around this one stay as they are."""
        if other.module is not self.module:
            raise ValueError("adopt() takes a RematModule made for the same model (remat.optimize(self.module, ...))")
        for key in ("_planner", "_steps", "_plans", "_latest", "plan_log"):
            self.__dict__[key] = other.__dict__[key]
        if self._inductor:
            for step in self._steps.values():
                step.graphs.use_inductor()

    # ---- calls -----------------------------------------------------------------------------------
    def _dispatch(self, args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():  # inference: nothing to plan (compiled as usual under torch.compile)
            return self.module(*args, **kwargs)
        if torch.compiler.is_dynamo_compiling():  # torch.compile traces this call: see _step_under_compile
            return _step_under_compile(self, args, kwargs)
        return self._planned_step(args, kwargs)

    def _planned_step(self, args: tuple, kwargs: dict):
        key, tensors = call_key(self.module, args, kwargs, self._device_types)
        if key not in self._steps and not any(t.requires_grad for t in tensors) and \
                not any(p.requires_grad for p in self.module.parameters()):
            return self.module(*args, **kwargs)  # nothing requires grad: no backward to plan
        return self._step_for(key, args, kwargs).run(tensors)

    # ---- copies: the model and the plans; the steps are traced again at their first call ----------
    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_steps", None)  # traced again at each key's first call
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__["_steps"] = OrderedDict()

    def extra_repr(self) -> str:
        p = self.plan
        total = p.graph.total_cost if p.graph is not None else p.total_cost
        return (f"strategy={p.strategy}, predicted_peak={p.predicted_peak_bytes / 2**20:.1f} MiB, "
                f"extra_cost={p.extra_cost / max(total, 1):.1%}, planned calls={len(self._plans)}")


@torch.compiler.disable(reason="remat's planned step is a graph break by design: it is already partitioned "
                        "into the plan's forward and backward, and retracing it would let the compiler's "
                        "partitioner choose what to save again; Inductor compiles its two graphs as they are "
                        "(remat.runtime.compile). fullgraph=True cannot hold it: compile without fullgraph, or "
                        "pass the compiled model to remat.optimize(torch.compile(model), ...)")
def _step_under_compile(module: RematModule, args: tuple, kwargs: dict):
    """The planned step, called from code torch.compile compiled (Dynamo breaks the graph here):
    its forward and backward graphs are compiled by Inductor at their first call, as they are."""
    if not module._inductor:
        module.__dict__["_inductor"] = True
        for step in module._steps.values():
            step.graphs.use_inductor()
    return module._planned_step(args, kwargs)
