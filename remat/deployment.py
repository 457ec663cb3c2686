"""Plans that travel: what a plan was made for, and the checks that it is deployed on just that.

A plan saved by `remat solve` or `opt.plan.save(path)` records its context (`plan_context`): the
model (class, and each parameter and buffer by name, shape and dtype), the example inputs (shape
and dtype of every tensor, the value of everything else), the device, the autocast state, the
train/eval mode, `fused_attention`, the loss head (`loss_head`: "chunked" or "unchunked", added by
remat/pipeline.py), the torch version, the solver and its options, and the machine.
The file format itself (schema version, the graph saved with the plan, the checks that the file
is what it says) is core/plan.py's.

Deploying checks, cheapest first, so a plan for something else is refused with one line saying
what differs and what to do (`PlanMismatchError`), never deployed:

1. before tracing (`check_context`): another model (parameters), other input shapes or dtypes,
   another device type, another train/eval mode, autocast state or fused_attention, or a loss head
   that `chunked_loss` excludes (a chunked plan under "off", an unchunked one under "on");
2. after tracing (`rejudge`): the graph's fingerprint; when it differs although everything above
   matched, the message says what else can change a graph (the torch version, if it differs, or
   the model's code). The plan is then simulated on the graph traced here (op workspaces are
   measured per machine): a schedule that cannot run on it is a PlanFileError.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from typing import Any

import torch
import torch.nn as nn

from remat.attention.router import fused_attention_mode
from remat.loss_head.router import chunked_loss_mode
from remat.graph_capture.autocast_state import AutocastState, step_device_types
from remat.core.training_graph import TrainingGraph
from remat.machine_info import machine
from remat.core.plan import PlanMismatchError
from remat.core.plan import Plan, PlanFileError
from remat.core.simulator import ScheduleError, simulate

__all__ = ["load_plan", "plan_context", "with_context", "check_context", "rejudge", "describe_inputs",
           "input_tensors"]



def _solve_for(what: str) -> str:
    return f"solve for {what} (remat solve ...) and deploy that plan"


def load_plan(path: str | os.PathLike) -> Plan:
    """The plan saved at `path` (remat solve --out, or plan.save(path)); PlanFileError with one
    line saying what is wrong when the file is missing, damaged, edited or of another schema."""
    return Plan.load(path)


# ---- what a plan was made for ----------------------------------------------------------------

def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _leaves(x: Any, where: str):
    """(where, leaf) for the tensors and other values of nested tuples, lists and dicts."""
    if isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{where}[{i}]")
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{where}[{k!r}]")
    else:
        yield where, x


def _args_tuple(args: Any) -> tuple:
    return (args,) if isinstance(args, torch.Tensor) else tuple(args)


def input_tensors(args: Any, kwargs: dict | None = None) -> list[torch.Tensor]:
    """Every tensor among the example inputs."""
    return [x for _, x in [*_leaves(_args_tuple(args), "args"), *_leaves(kwargs or {}, "kwargs")]
            if isinstance(x, torch.Tensor)]


def describe_inputs(args: Any, kwargs: dict | None = None) -> list[dict]:
    """Each input: {"arg": "args[0]", "shape": [8, 256], "dtype": "int64"} for a tensor,
    {"arg": ..., "value": repr} for anything else (traced as a constant)."""
    out = []
    for where, x in [*_leaves(_args_tuple(args), "args"), *_leaves(kwargs or {}, "kwargs")]:
        if isinstance(x, torch.Tensor):
            out.append({"arg": where, "shape": list(x.shape), "dtype": _dtype(x)})
        else:
            out.append({"arg": where, "value": repr(x)[:80]})
    return out


def _state(model: nn.Module) -> list[list]:
    """[name, shape, dtype] of each parameter and buffer."""
    return [[n, list(t.shape), _dtype(t)] for n, t in (*model.named_parameters(), *model.named_buffers())]


def _device(tensors: list[torch.Tensor]) -> str:
    types = sorted({t.device.type for t in tensors}) or ["cpu"]
    return ",".join(types)


def plan_context(model: nn.Module, args: Any, kwargs: dict | None = None, *, fused_attention: bool | str = True,
                 solver: str | None = None, solver_options: dict | None = None, device: str | None = None) -> dict:
    """What a plan for `model` on these example inputs is made for (JSON-ready). `device`: the
    device type it is for, when that is not where the tensors are (a plan made on fake tensors)."""
    tensors = [*model.parameters(), *model.buffers(), *input_tensors(args, kwargs)]
    device = device or _device(tensors)
    state = _state(model)
    types = step_device_types(model, input_tensors(args, kwargs))
    ctx = {"model": f"{type(model).__module__}.{type(model).__qualname__}",
           "parameters": {"tensors": len(state), "values": sum(_numel(s) for _, s, _ in state),
                          "sha256": _state_hash(state), "list": state},
           "inputs": describe_inputs(args, kwargs),
           "dtype": ",".join(sorted({_dtype(t) for t in model.parameters()})) or "none",  # the parameters'
           "device": device,
           "device_name": torch.cuda.get_device_name() if "cuda" in device and torch.cuda.is_available() else "",
           "training": model.training,
           "autocast": str(AutocastState.current(types)),
           "fused_attention": fused_attention_mode(fused_attention),
           "torch": torch.__version__,
           "machine": machine()}
    if solver is not None:
        ctx["solver"] = solver
        ctx["solver_options"] = {k: v for k, v in (solver_options or {}).items()
                                 if isinstance(v, (int, float, str, bool, type(None)))}
    return ctx


def with_context(plan: Plan, model: nn.Module, args: Any, kwargs: dict | None = None, **kw) -> Plan:
    """`plan` with its context filled in (see plan_context for the keywords)."""
    return dataclasses.replace(plan, context=plan_context(model, args, kwargs, **kw))


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _state_hash(state: list[list]) -> str:
    return hashlib.sha256(repr(state).encode()).hexdigest()[:16]


def _shape_text(item: dict) -> str:
    if "shape" in item:
        return f"{item['arg']} {tuple(item['shape'])} {item['dtype']}"
    return f"{item['arg']}={item['value']}"


def _source(plan: Plan, source: str | None) -> str:
    path = plan.loaded_from  # set by Plan.load
    return source or (f"plan file {path!r}" if path else "the plan")


def _model_difference(saved: dict, state: list[list]) -> str | None:
    """What differs between the saved parameter list and this model's, or None."""
    if saved.get("sha256") == _state_hash(state):
        return None
    theirs = {n: (tuple(s), d) for n, s, d in saved.get("list", [])}
    mine = {n: (tuple(s), d) for n, s, d in state}
    for n, (s, d) in mine.items():
        if n not in theirs:
            return f"this model has {n} {s} {d}, which the plan's model does not have"
        if theirs[n] != (s, d):
            return f"{n} is {s} {d} here, {theirs[n][0]} {theirs[n][1]} in the plan's model"
    for n in theirs:
        if n not in mine:
            return f"the plan's model has {n}, which this model does not have"
    return "its parameters are listed in another order"


def check_context(plan: Plan, model: nn.Module, args: Any, kwargs: dict | None = None,
                  fused_attention: bool | str = True, source: str | None = None,
                  chunked_loss: bool | str = "auto") -> None:
    """Refuse (PlanMismatchError, one line) a plan made for another model, other input shapes or
    dtypes, another device, mode, autocast state or fused_attention, before anything is traced.
    A plan without context (schema 1, or never saved) is checked by its fingerprint alone."""
    ctx = plan.context
    if not ctx:
        return
    src = _source(plan, source)
    if "parameters" in ctx:
        diff = _model_difference(ctx["parameters"], _state(model))
        if diff:
            p = ctx["parameters"]
            raise PlanMismatchError(
                f"{src} was made for another model ({ctx.get('model')}, {p.get('tensors')} parameter and buffer "
                f"tensors, {p.get('values')} values): {diff}; {_solve_for('this model')}")
    if "inputs" in ctx:
        mine = describe_inputs(args, kwargs)
        if mine != ctx["inputs"]:
            first = next((f"{_shape_text(a)} here, {_shape_text(b)} in the plan" for a, b in zip(mine, ctx["inputs"])
                          if a != b), f"{len(mine)} inputs here, {len(ctx['inputs'])} in the plan")
            raise PlanMismatchError(
                f"{src} was made for other inputs ({', '.join(_shape_text(i) for i in ctx['inputs'])}): {first}; "
                f"{_solve_for('these shapes')}, or call with inputs of the planned shapes")
    tensors = [*model.parameters(), *model.buffers(), *input_tensors(args, kwargs)]
    device = _device(tensors)
    if "device" in ctx and ctx["device"] != device:
        raise PlanMismatchError(
            f"{src} was solved for device {ctx['device']}{' (' + ctx['device_name'] + ')' if ctx.get('device_name') else ''}"
            f", but the model and inputs are on {device}: solve for this device (remat solve --device "
            f"{device.split(',')[0]}), or move the model and inputs to {ctx['device']}")
    if "training" in ctx and ctx["training"] != model.training:
        mode = "train" if ctx["training"] else "eval"
        raise PlanMismatchError(f"{src} was made with the model in {mode} mode, it is in "
                                f"{'train' if model.training else 'eval'} mode now: call model.{mode}() "
                                f"before deploying, or solve for this mode")
    if "autocast" in ctx:
        now = str(AutocastState.current(step_device_types(model, input_tensors(args, kwargs))))
        if now != ctx["autocast"]:
            raise PlanMismatchError(f"{src} was made under {ctx['autocast']}, this is {now}: deploy it under the "
                                    f"same autocast, or solve under this one")
    if "fused_attention" in ctx and ctx["fused_attention"] != fused_attention_mode(fused_attention):
        raise PlanMismatchError(f"{src} was made with fused_attention={ctx['fused_attention']!r}, this is "
                                f"fused_attention={fused_attention_mode(fused_attention)!r}: pass "
                                f"fused_attention={ctx['fused_attention']!r}, or solve with this setting")
    head, mode = ctx.get("loss_head"), chunked_loss_mode(chunked_loss)
    if (head == "chunked" and mode == "off") or (head == "unchunked" and mode == "on"):
        # the plan's fingerprint is that of the graph with its head: the other head is another graph
        raise PlanMismatchError(f"{src} was made with the loss head {head}, this is chunked_loss={chunked_loss!r}: "
                                f"pass chunked_loss='auto' (the plan's head), or solve with this setting")


def rejudge(plan: Plan, graph: TrainingGraph, source: str | None = None) -> Plan:
    """`plan` on the graph traced here: PlanMismatchError when the graph is another (saying what
    can explain it), PlanFileError when its schedule cannot run on it; otherwise the plan with its
    numbers simulated on this graph (op workspaces are measured per machine) and a warning when
    that peak exceeds its budget."""
    src = _source(plan, source)
    mine = graph.fingerprint()
    if plan.graph_fingerprint and plan.graph_fingerprint != mine:
        ctx = plan.context
        if ctx.get("torch") and ctx["torch"] != torch.__version__:
            why = (f"it was made with torch {ctx['torch']}, this is torch {torch.__version__}, which traces "
                   f"this model to another graph: solve again with this torch")
        elif ctx:
            why = ("the model, its inputs, device and torch version are the ones it was made for, so the "
                   "model's code (its forward, or a layer) changed since: solve again")
        else:
            why = "a different model, input shape or torch version; solve again"
        raise PlanMismatchError(f"{src} was made for graph {plan.graph_fingerprint}, but this model traces to "
                                f"{mine}: {why}")
    try:
        sim = simulate(graph, plan.schedule)
    except ScheduleError as e:
        raise PlanFileError(f"{src}: its schedule cannot run on this model's graph: {e}; the schedule was "
                            f"edited or damaged: solve again") from None
    out = dataclasses.replace(plan, predicted_peak_bytes=sim.peak_bytes, total_cost=sim.total_cost,
                              extra_cost=sim.extra_cost, extra_flops=sim.extra_flops, graph=graph)
    if out.budget_bytes is not None and sim.peak_bytes > out.budget_bytes:
        warnings.warn(f"on this machine the saved plan peaks at {sim.peak_bytes} bytes, over its budget "
                      f"of {out.budget_bytes} bytes (op workspaces differ here); consider solving again")
    return out
