"""The public entry points: capture, plan, optimize."""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch.nn as nn

from remat.blockwise import BlockwiseModule, plan_blockwise
from remat.loss_head.router import chunked_loss_mode
from remat.graph_capture.joint import TraceError
from remat.core.training_graph import TrainingGraph
from remat.head_choice import plan_head
from remat.pipeline import Decision, PlanOptions, StepPlanner, planned_step, trace_graph
from remat.deployment import check_context, load_plan, rejudge
from remat.runtime.distributed import plan_on_one_rank
from remat.runtime.module import (DEFAULT_CACHE_LIMIT, OutsideBudgetWarning, RematModule, call_key, describe_key,
                                  model_device_types)
from remat.core.plan import InfeasibleBudgetError, Plan
from remat.settings import CaptureOptions, Solver, settle
from remat.solving import solve
from remat.validate import (budget_in_bytes, check_capture_args, check_chunked_loss, check_optimize_args,
                            example_arguments)

__all__ = ["capture", "solve", "optimize", "TraceError", "InfeasibleBudgetError"]


def capture(model: nn.Module, example_inputs: Any, example_kwargs: dict | None = None,
            fused_attention: bool | str = True, *, quiet: bool = False, cost_model: str = "flops",
            chunked_loss: bool = False) -> TrainingGraph:
    """Trace one training step of `model` (forward and backward, ATen level) into a TrainingGraph.
    `fused_attention`: trace attention as remat's flash op where it can (see `optimize`).
    quiet: no progress on stderr (shown otherwise for stages longer than a couple of seconds).
    cost_model: "flops" (default; deterministic): each node costs its FLOPs plus a weight per byte
    moved; "measured": each node costs the median time its ops take on the capture device, in
    nanoseconds, as Checkmate profiles its ops (graph_capture/op_timing.py; plans may then differ
    from run to run). The graph's structure, bytes and fingerprint are the same either way.
    chunked_loss: trace a linear head followed by cross-entropy as remat's chunked loss op where the
    router proves it the model's function (see `optimize`; default False: the model's own head)."""
    check_capture_args(model, example_inputs, example_kwargs, fused_attention, cost_model)  # before any tracing
    check_chunked_loss(chunked_loss, allow_auto=False)
    return trace_graph(model, example_arguments(example_inputs), example_kwargs, fused_attention, cost_model, quiet,
                       chunked_loss=bool(chunked_loss))


def optimize(model: nn.Module, budget_gb: float | None = None, *, example_inputs: Any,
             example_kwargs: dict | None = None, budget_bytes: int | None = None,
             solver: str | Solver = "checkmate", capture: CaptureOptions | None = None,
             plan: Plan | str | os.PathLike | None = None, compiled: bool = False,
             cache_limit: int = DEFAULT_CACHE_LIMIT, solve_on_rank: int | None = None, quiet: bool = False,
             time_limit_s: float | None = None, fused_attention: bool | str = True, cost_model: str = "flops",
             chunked_loss: bool | str = "auto", **solver_kwargs) -> RematModule | BlockwiseModule:
    """Return a drop-in module whose training steps peak under the budget.

    The settings come in groups (remat/settings.py): the budget (`budget_gb` or `budget_bytes`),
    the solver (`solver=remat.Solver("checkmate", time_limit_s=..., **its options)`, or its name
    with `time_limit_s` and its options as keywords), the capture
    (`capture=remat.CaptureOptions(fused_attention=..., cost_model=..., chunked_loss=...)`, or
    those as keywords), and how the module runs (`plan`, `compiled`, `cache_limit`, `solve_on_rank`,
    `quiet`).

    The budget is the real peak of one training step, forward and backward: parameters,
    buffers, inputs, activations, temporaries and the gradients produced so far (optimizer state
    and gradients kept from earlier steps are not part of the step; zero grads with
    set_to_none=True). The example inputs are planned now; every other kind of call the module
    meets later (another batch shape, inputs that require grad, another train/eval mode or
    autocast, keyword arguments present or absent) is traced and planned under the same budget at
    its first call (remat/pipeline.py says how; `module.plan_for(*args, **kwargs)` plans one ahead,
    e.g. the largest shapes of a run), and cached: at most `cache_limit` planned steps are kept
    (runtime/module.py). Pass `plan=` (a path, or `remat.load_plan(path)`) to deploy a saved plan
    without solving; one made for another model, input shape, device or mode is refused first.
    `fused_attention` picks which attention runs remat's flash-attention op (Triton on CUDA,
    PyTorch code on CPU), which keeps no s x s tensor: True or "exact" (default) fuses
    scaled_dot_product_attention without mask or dropout and the explicit
    softmax(QK^T * scale [causal mask])V pattern without dropout, so the module computes what the
    model computes; "all" also fuses attention with dropout on its probabilities, drawing the
    masks from remat's own counter-based generator (same distribution, other masks than torch's);
    False fuses nothing.
    `chunked_loss` decides the loss head: a linear (or a matmul with a tied embedding) followed by
    cross-entropy (or log_softmax + nll_loss), mean or sum, with ignore_index and label smoothing, can
    run as remat's chunked op (remat/loss_head/), which computes the loss over row chunks and the
    logits again in the backward, so no [tokens, vocab] tensor lives whole, at one more logits
    matmul. "auto" (default) plans the step with the model's head and, where that plan recomputes
    or does not fit, with the chunked head too, and keeps the cheaper plan that fits (per kind of
    call; `plan.details["loss_head"]` says which); True/"on" chunks wherever the router can, False/"off"
    never. Where the model also returns its logits (Hugging Face's `.logits`), they are still
    computed by the model's own linear, with eager's values.
    The model itself is not modified. The module returns what the model returns (any pytree,
    dataclasses included, rebuilt on every call); an output that is neither a tensor nor a
    constant (e.g. a Hugging Face cache: pass use_cache=False) raises OutputError here, and an
    output other than a single loss draws an OutsideBudgetWarning (what the caller does with it is
    not budgeted). Each call uses the model's current parameters; freezing or unfreezing some
    (`requires_grad_`) plans the step again for that pattern; a parameter of another shape, dtype
    or device raises ParameterMismatchError (call remat.optimize again).
    `solve_on_rank` (torch.distributed initialised, every rank calling): that rank solves the
    example inputs' plan and broadcasts it, the others deploy it (README: Beyond one device); later
    kinds of call are planned by each rank on its own (the default cost model is deterministic, so
    ranks that meet the same shape plan the same). A model torch.compile
    wrapped (`torch.compile(model)`, `.compile()`d submodules) is traced as the eager model and
    the plan's forward and backward graphs are compiled by Inductor as they are (CompiledPeakWarning:
    a compiled step's peak is Inductor's, measured, not predicted, and can exceed the budget).
    Tracing, probing and solving show progress on stderr when they take more than a couple of
    seconds; `quiet=True` silences it. `cost_model` ("flops" or "measured") is what the solver
    minimises, as in `capture`.
    `compiled=True`: the plan's graphs run Inductor's code (as under torch.compile), and the
    compiled step's peak is measured on the example inputs (and on each new kind of call, at its
    first call); where it exceeds the budget, remat
    plans again at a budget lowered by the excess, and higher by the room left where it fits with
    room to spare while recomputing (remat/compiled_fit.py; the model's gradients, buffers and
    random state are left as they were), so the returned module's compiled step fits the budget on
    these inputs, recomputing least of the plans tried (`module.compiled_fit` lists each round's
    plan budget and measured peak), or InfeasibleBudgetError says what each round measured."""
    chosen, how = settle(solver, time_limit_s, solver_kwargs, capture, fused_attention=fused_attention,
                         cost_model=cost_model, chunked_loss=chunked_loss)
    solver, time_limit_s, solver_kwargs = chosen.name, chosen.time_limit_s, chosen.kwargs
    fused_attention, cost_model, chunked_loss = how.fused_attention, how.cost_model, how.chunked_loss
    check_optimize_args(model, budget_gb, budget_bytes, example_inputs, example_kwargs, solver, time_limit_s,
                        plan, fused_attention, solver_kwargs, cost_model, compiled, solve_on_rank, cache_limit)
    budget = budget_in_bytes(budget_gb, budget_bytes)  # None: keep_all with no budget, or a saved plan's
    args = example_arguments(example_inputs)
    kwargs = dict(example_kwargs or {})
    if plan is not None and not isinstance(plan, Plan):  # the path of a saved plan
        plan = load_plan(plan)
    if plan is not None:  # made for another model, shape, device or mode: refused before tracing
        check_context(plan, model, args, kwargs, fused_attention, chunked_loss=chunked_loss)
        if budget is None:  # later kinds of call are planned under the saved plan's budget
            budget = plan.budget_bytes
    options = PlanOptions(budget_bytes=budget, solver=solver, time_limit_s=time_limit_s,
                          solver_options=tuple(solver_kwargs.items()), fused_attention=fused_attention,
                          cost_model=cost_model, quiet=quiet, compiled=compiled, chunked_loss=chunked_loss)
    planner = StepPlanner(options)
    key, _ = call_key(model, args, kwargs, model_device_types(model))
    call = describe_key(key)
    if solve_on_rank is None:
        try:
            first = planner.plan_call(model, args, kwargs, known=plan, others=[], call=call)
        except TraceError as e:
            if e.__cause__ is None or budget is None or plan is not None or compiled:
                raise  # not a failure inside the model's code, or nothing to plan blocks with
            return plan_blockwise(model, args, kwargs, options, e, cache_limit=cache_limit)
    else:  # one rank solves, the others receive its plan (runtime/distributed.py)
        solved = Decision(planner.choose(model, args, kwargs, known=plan, others=[]),
                          how=f"plan from rank {solve_on_rank}")
        shared = plan_on_one_rank(solved, rejudge, src=solve_on_rank)
        # every rank traces the same head: a saved plan's, else the chunked one only where it is asked for
        chunked = plan_head(plan) == "chunked" if plan is not None else chunked_loss_mode(chunked_loss) == "on"
        first = planned_step(model, args, kwargs, options, Decision(lambda g: (shared(g), solved.how)), call,
                             chunked=chunked)
    if not first.signature.outputs.single_scalar:
        warnings.warn(OutsideBudgetWarning(
            f"{type(model).__name__} returns {first.signature.outputs.describe()}, not a single loss: the budget "
            f"covers this module's training step, and memory used outside it (e.g. a loss computed on its logits, "
            f"and its backward) is not part of it; outputs the backward gets no gradient for are given "
            f"zero gradients of their size. Return only the loss from the model to have all of it planned."),
            stacklevel=2)
    after, _ = call_key(model, args, kwargs, model_device_types(model))  # attributes the trace changed
    return RematModule(model, planner, (key, first, after), cache_limit=cache_limit)

