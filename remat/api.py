"""The public entry points: capture, plan, optimize."""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from remat.compat.torch_private import compiled_submodules, default_partition
from remat.compiled_fit import fit_compiled
from remat.graph_capture import progress
from remat.graph_capture.build import JointGraphInfo, build_training_graph
from remat.graph_capture.rewrites import prepare_joint_graph
from remat.graph_capture.rng_replay import step_device_type
from remat.graph_capture.joint import PartitionFailed, TraceError, trace_training_step
from remat.graph_capture.op_timing import measured_cost_graph
from remat.graph_capture.training_graph import TrainingGraph
from remat.plan_file import check_context, load_plan, plan_context, rejudge
from remat.runtime.compile import CompiledPeakWarning, PlannedGraphs
from remat.runtime.distributed import plan_on_one_rank
from remat.runtime.module import OutsideBudgetWarning, RematModule
from remat.runtime.partition import partition_with_plan
from remat.solver import get_solver
from remat.solver.plan import LOWEST_PEAK, InfeasibleBudgetError, Plan
from remat.validate import budget_in_bytes, check_capture_args, check_optimize_args, check_solve_args

__all__ = ["capture", "solve", "optimize", "TraceError", "InfeasibleBudgetError"]


def _as_tuple(example_inputs: Any) -> tuple:
    if example_inputs is None:
        raise ValueError("example_inputs is required: remat traces one training step to plan it")
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a tensor or a tuple of arguments, got {type(example_inputs).__name__}")


def _joint_info(joint_gm, num_fwd_outputs: int, name: str) -> JointGraphInfo:
    prepare_joint_graph(joint_gm, step_device_type(joint_gm))
    return build_training_graph(joint_gm, num_fwd_outputs, name=name)


class Planner:
    """AOTAutograd's partition function for one trace: it builds the TrainingGraph from the joint
    graph (`info`, `graph`) and, given `decide` (TrainingGraph -> Plan), splits the joint graph
    into forward and backward by that plan (`plan`); without `decide` it splits it as AOTAutograd
    would. `cost_model` "measured": the graph's costs are the ops' measured times (op_timing.py).
    Errors while planning (a budget no plan fits, a saved plan for another graph, ...) are
    remat's own: they leave the trace as they are (PartitionFailed), not as a TraceError."""

    def __init__(self, name: str, decide: Callable[[TrainingGraph], Plan] | None = None,
                 cost_model: str = "flops"):
        self.name = name
        self.decide = decide
        self.cost_model = cost_model
        self.info: JointGraphInfo | None = None
        self.plan: Plan | None = None

    @property
    def graph(self) -> TrainingGraph:
        assert self.info is not None, "the partition function was not called"
        return self.info.graph

    def __call__(self, joint_gm, joint_inputs, *, num_fwd_outputs: int, **kw):
        try:
            self.info = _joint_info(joint_gm, num_fwd_outputs, self.name)
            if self.cost_model == "measured":  # same structure, costs in measured nanoseconds
                self.info.graph = measured_cost_graph(self.info)
            if self.decide is not None:
                self.plan = self.decide(self.info.graph)
                return partition_with_plan(self.info, self.plan)
        except Exception as e:
            raise PartitionFailed(e) from e
        return default_partition(joint_gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)


def capture(model: nn.Module, example_inputs: Any, example_kwargs: dict | None = None,
            fused_attention: bool | str = True, *, quiet: bool = False, cost_model: str = "flops") -> TrainingGraph:
    """Trace one training step of `model` (forward and backward, ATen level) into a TrainingGraph.
    `fused_attention`: trace attention as remat's flash op where it can (see `optimize`).
    quiet: no progress on stderr (shown otherwise for stages longer than a couple of seconds).
    cost_model: "flops" (default; deterministic): each node costs its FLOPs plus a weight per byte
    moved; "measured": each node costs the median time its ops take on the capture device, in
    nanoseconds, as Checkmate profiles its ops (graph_capture/op_timing.py; plans may then differ
    from run to run). The graph's structure, bytes and fingerprint are the same either way."""
    check_capture_args(model, example_inputs, example_kwargs, fused_attention, cost_model)  # before any tracing
    planner = Planner(type(model).__name__, cost_model=cost_model)
    with progress.quiet(quiet):
        trace_training_step(model, _as_tuple(example_inputs), example_kwargs, planner, fused_attention)
    return planner.graph


def _budget(budget_gb: float | None, budget_bytes: int | None) -> int | None:
    """The budget in bytes (None: none given), after checking it (remat/validate.py)."""
    return budget_in_bytes(budget_gb, budget_bytes)


def solve(graph: TrainingGraph, budget_bytes: int | None, solver: str = "checkmate",
          time_limit_s: float | None = None, *, quiet: bool = False, **solver_kwargs) -> Plan:
    """Plan `graph` under `budget_bytes` with one strategy; raise InfeasibleBudgetError when no
    plan fits, naming the smallest budget found feasible (a budget this call then accepts, with the
    same options). time_limit_s: an optional wall-clock limit on checkmate's MILP (None: only its
    deterministic work limits, so the plan does not depend on the machine's load). quiet: no
    progress on stderr."""
    check_solve_args(graph, budget_bytes, solver, time_limit_s, solver_kwargs)  # before any solving
    with progress.quiet(quiet):
        return _solve(graph, budget_bytes, solver, time_limit_s, solver_kwargs)


def _solve(graph: TrainingGraph, budget_bytes: int | None, solver: str, time_limit_s: float | None,
           solver_kwargs: dict) -> Plan:
    fn = get_solver(solver)
    kwargs = dict(solver_kwargs)
    if solver == "checkmate":
        kwargs["time_limit_s"] = time_limit_s
    plan = fn(graph, budget_bytes, **kwargs)
    if budget_bytes is not None and (plan.status == "infeasible" or not plan.fits):
        smallest = _smallest_feasible(graph, solver, time_limit_s, **solver_kwargs)
        raise InfeasibleBudgetError(
            f"no {solver} plan fits {budget_bytes / 2**20:.2f} MiB; the smallest budget found feasible "
            f"is {smallest / 2**20:.2f} MiB ({smallest} bytes)", min_feasible_bytes=smallest)
    return plan


def _smallest_feasible(graph: TrainingGraph, solver: str, time_limit_s: float | None = None,
                       **solver_kwargs) -> int:
    """The smallest budget `solve` accepts with these options: for checkmate the peak of its
    lowest-peak plan, which `solve` falls back to (cached per graph), so the two never disagree."""
    if solver == "checkmate":
        from remat.solver.checkmate import min_feasible_budget

        return min_feasible_budget(graph, time_limit_s=time_limit_s, **solver_kwargs)
    # baselines: the lowest peak they can reach, with no budget they must meet
    return get_solver(solver)(graph, LOWEST_PEAK).predicted_peak_bytes


def _rejudge(plan: Plan, graph: TrainingGraph) -> Plan:
    """A saved plan re-simulated on the graph traced here (workspaces are measured per machine);
    PlanMismatchError naming what differs when it was made for another graph (remat/plan_file.py)."""
    return rejudge(plan, graph)


def optimize(model: nn.Module, budget_gb: float | None = None, *, example_inputs: Any,
             example_kwargs: dict | None = None, budget_bytes: int | None = None,
             solver: str = "checkmate", time_limit_s: float | None = None, plan: Plan | str | os.PathLike | None = None,
             fused_attention: bool | str = True, solve_on_rank: int | None = None, quiet: bool = False,
             cost_model: str = "flops", compiled: bool = False, **solver_kwargs) -> RematModule:
    """Return a drop-in module whose training step peaks under the budget.

    The budget is the real peak of one training step, forward and backward: parameters,
    buffers, inputs, activations, temporaries and the gradients produced so far (optimizer state
    and gradients kept from earlier steps are not part of the step; zero grads with
    set_to_none=True). Pass `plan=` (a path, or `remat.load_plan(path)`) to deploy a saved plan
    without solving; one made for another model, input shape, device or mode is refused first.
    `fused_attention` picks which attention runs remat's flash-attention op (Triton on CUDA,
    PyTorch code on CPU), which keeps no s x s tensor: True or "exact" (default) fuses
    scaled_dot_product_attention without mask or dropout and the explicit
    softmax(QK^T * scale [causal mask])V pattern without dropout, so the module computes what the
    model computes; "all" also fuses attention with dropout on its probabilities, drawing the
    masks from remat's own counter-based generator (same distribution, other masks than torch's);
    False fuses nothing.
    The model itself is not modified. The module returns what the model returns (any pytree,
    dataclasses included, rebuilt on every call); an output that is neither a tensor nor a
    constant (e.g. a Hugging Face cache: pass use_cache=False) raises OutputError here, and an
    output other than a single loss draws an OutsideBudgetWarning (what the caller does with it is
    not budgeted). Each call uses the model's current parameters (ParameterMismatchError if they
    no longer fit the traced graph); with grad enabled, a call in another train/eval mode than
    the model's at optimize() time raises ModeMismatchError.
    `solve_on_rank` (torch.distributed initialised, every rank calling): that rank solves and
    broadcasts its plan, the others deploy it (README: Beyond one device). A model torch.compile
    wrapped (`torch.compile(model)`, `.compile()`d submodules) is traced as the eager model and
    the plan's forward and backward graphs are compiled by Inductor as they are (CompiledPeakWarning:
    a compiled step's peak is Inductor's, measured, not predicted, and can exceed the budget).
    Tracing, probing and solving show progress on stderr when they take more than a couple of
    seconds; `quiet=True` silences it. `cost_model` ("flops" or "measured") is what the solver
    minimises, as in `capture`.
    `compiled=True`: the plan's graphs run Inductor's code (as under torch.compile), and the
    compiled step's peak is measured on the example inputs; where it exceeds the budget, remat
    plans again at a budget lowered by the excess, and higher by the room left where it fits with
    room to spare while recomputing (remat/compiled_fit.py; the model's gradients, buffers and
    random state are left as they were), so the returned module's compiled step fits the budget on
    these inputs, recomputing least of the plans tried (`module.compiled_fit` lists each round's
    plan budget and measured peak), or InfeasibleBudgetError says what each round measured."""
    check_optimize_args(model, budget_gb, budget_bytes, example_inputs, example_kwargs, solver, time_limit_s,
                        plan, fused_attention, solver_kwargs, cost_model, compiled, solve_on_rank)
    budget = _budget(budget_gb, budget_bytes)  # None: solver="keep_all" with no budget (checked above)
    args = _as_tuple(example_inputs)
    if compiled:  # plan, compile, measure; plan again lower while the compiled step exceeds the budget
        def build(b: int) -> RematModule:
            with warnings.catch_warnings():  # a compiled model's plan: its peak is measured next
                warnings.simplefilter("ignore", CompiledPeakWarning)
                return optimize(model, budget_bytes=b, example_inputs=args, example_kwargs=example_kwargs,
                                solver=solver, time_limit_s=time_limit_s, fused_attention=fused_attention,
                                quiet=quiet, cost_model=cost_model, **solver_kwargs)

        return fit_compiled(build, budget, model, args, example_kwargs or {})
    if plan is not None and not isinstance(plan, Plan):  # the path of a saved plan
        plan = load_plan(plan)
    if plan is not None:  # made for another model, shape, device or mode: refused before tracing
        check_context(plan, model, args, example_kwargs, fused_attention)
    context = plan_context(model, args, example_kwargs, fused_attention=fused_attention, solver=solver,
                           solver_options={"time_limit_s": time_limit_s, **solver_kwargs,
                                           **({"cost_model": cost_model} if cost_model != "flops" else {})})

    def decide(graph: TrainingGraph) -> Plan:
        if plan is not None:  # a saved plan: judge it again on this machine's graph
            return _rejudge(plan, graph)
        solved = solve(graph, budget, solver=solver, time_limit_s=time_limit_s, **solver_kwargs)
        return dataclasses.replace(solved, context=context)  # what it is for, saved with it

    if solve_on_rank is not None:  # one rank solves, the others receive its plan (runtime/distributed.py)
        decide = plan_on_one_rank(decide, _rejudge, src=solve_on_rank)
    graphs = PlannedGraphs()
    if compiled_submodules(model):  # the user asked torch.compile for this model: Inductor runs the plan
        graphs.use_inductor()
    planner = Planner(type(model).__name__, decide, cost_model=cost_model)
    with progress.quiet(quiet):
        compiled, sig = trace_training_step(model, args, example_kwargs, planner, fused_attention,
                                            graph_compilers=graphs.compilers)
    assert planner.plan is not None
    if not sig.outputs.single_scalar:
        warnings.warn(OutsideBudgetWarning(
            f"{type(model).__name__} returns {sig.outputs.describe()}, not a single loss: the budget covers "
            f"this module's training step, and memory used outside it (e.g. a loss computed on its logits, "
            f"and its backward) is not part of it; outputs the backward gets no gradient for are given "
            f"zero gradients of their size. Return only the loss from the model to have all of it planned."),
            stacklevel=2)
    return RematModule(model, compiled, sig, planner.plan, planner.graph, graphs)
