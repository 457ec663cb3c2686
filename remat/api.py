"""The public entry points: capture, plan, optimize."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch._functorch.partitioners import default_partition

from remat.graph_capture.build import JointGraphInfo, build_training_graph, split_dropout_outputs
from remat.graph_capture.joint import TraceError, trace_training_step
from remat.graph_capture.training_graph import TrainingGraph
from remat.runtime.module import RematModule
from remat.runtime.partition import partition_with_plan
from remat.solver import get_solver
from remat.solver.plan import InfeasibleBudgetError, Plan

__all__ = ["capture", "solve", "optimize", "TraceError", "InfeasibleBudgetError"]

GB = 1e9


def _as_tuple(example_inputs: Any) -> tuple:
    if example_inputs is None:
        raise ValueError("example_inputs is required: remat traces one training step to plan it")
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a tensor or a tuple of arguments, got {type(example_inputs).__name__}")


def _joint_info(joint_gm, num_fwd_outputs: int, name: str) -> JointGraphInfo:
    split_dropout_outputs(joint_gm)
    return build_training_graph(joint_gm, num_fwd_outputs, name=name)


def capture(model: nn.Module, example_inputs: Any, example_kwargs: dict | None = None,
            fused_attention: bool | str = True) -> TrainingGraph:
    """Trace one training step of `model` (forward and backward, ATen level) into a TrainingGraph.
    `fused_attention`: trace attention as remat's flash op where it can (see `optimize`)."""
    holder: dict[str, JointGraphInfo] = {}

    def record(joint_gm, joint_inputs, *, num_fwd_outputs, **kw):
        holder["info"] = _joint_info(joint_gm, num_fwd_outputs, type(model).__name__)
        return default_partition(joint_gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)

    trace_training_step(model, _as_tuple(example_inputs), example_kwargs, record, fused_attention)
    return holder["info"].graph


def _budget(budget_gb: float | None, budget_bytes: int | None) -> int | None:
    if budget_gb is not None and budget_bytes is not None:
        raise ValueError("give budget_gb or budget_bytes, not both")
    b = budget_bytes if budget_bytes is not None else (None if budget_gb is None else int(budget_gb * GB))
    if b is not None and b <= 0:
        raise ValueError(f"the memory budget must be positive, got {b} bytes")
    return b


def solve(graph: TrainingGraph, budget_bytes: int | None, solver: str = "checkmate",
          time_limit_s: float = 60.0, **solver_kwargs) -> Plan:
    """Plan `graph` under `budget_bytes` with one strategy; raise InfeasibleBudgetError when no
    plan fits, naming the smallest budget found feasible."""
    fn = get_solver(solver)
    kwargs = dict(solver_kwargs)
    if solver == "checkmate":
        kwargs["time_limit_s"] = time_limit_s
    plan = fn(graph, budget_bytes, **kwargs)
    if budget_bytes is not None and (plan.status == "infeasible" or not plan.fits):
        smallest = _smallest_feasible(graph, solver, time_limit_s)
        raise InfeasibleBudgetError(
            f"no {solver} plan fits {budget_bytes / 2**20:.2f} MiB; the smallest budget found feasible "
            f"is {smallest / 2**20:.2f} MiB ({smallest} bytes)", min_feasible_bytes=smallest)
    return plan


def _smallest_feasible(graph: TrainingGraph, solver: str, time_limit_s: float) -> int:
    if solver == "checkmate":
        from remat.solver.checkmate import min_feasible_budget

        return min_feasible_budget(graph, time_limit_s=time_limit_s)
    # baselines: the lowest peak they can reach, with no budget they must meet
    return get_solver(solver)(graph, 1).predicted_peak_bytes


def _rejudge(plan: Plan, graph: TrainingGraph) -> Plan:
    """A saved plan re-simulated on the graph traced here (workspaces are measured per machine)."""
    import dataclasses
    import warnings

    from remat.runtime.partition import PlanMismatchError
    from remat.solver.simulator import simulate

    if plan.graph_fingerprint and plan.graph_fingerprint != graph.fingerprint():
        raise PlanMismatchError(
            f"the plan was made for graph {plan.graph_fingerprint}, but this model traces to "
            f"{graph.fingerprint()} (a different model, input shape or torch version); solve again")
    sim = simulate(graph, plan.schedule)
    out = dataclasses.replace(plan, predicted_peak_bytes=sim.peak_bytes, total_cost=sim.total_cost,
                              extra_cost=sim.extra_cost, extra_flops=sim.extra_flops)
    if out.budget_bytes is not None and sim.peak_bytes > out.budget_bytes:
        warnings.warn(f"on this machine the saved plan peaks at {sim.peak_bytes} bytes, over its budget "
                      f"of {out.budget_bytes} bytes (op workspaces differ here); consider solving again")
    return out


def optimize(model: nn.Module, budget_gb: float | None = None, *, example_inputs: Any,
             example_kwargs: dict | None = None, budget_bytes: int | None = None,
             solver: str = "checkmate", time_limit_s: float = 60.0, plan: Plan | None = None,
             fused_attention: bool | str = True, **solver_kwargs) -> RematModule:
    """Return a drop-in module whose training step peaks under the budget.

    The budget is the real peak of one training step, forward and backward: parameters,
    buffers, inputs, activations, temporaries and the gradients produced so far (optimizer state
    and gradients kept from earlier steps are not part of the step; zero grads with
    set_to_none=True). Pass `plan=` (e.g. `Plan.load(path)`) to deploy a saved plan without solving.
    `fused_attention` picks which attention runs remat's flash-attention op (Triton on CUDA,
    PyTorch code on CPU), which keeps no s x s tensor: True or "exact" (default) fuses
    scaled_dot_product_attention without mask or dropout and the explicit
    softmax(QK^T * scale [causal mask])V pattern without dropout, so the module computes what the
    model computes; "all" also fuses attention with dropout on its probabilities, drawing the
    masks from remat's own counter-based generator (same distribution, other masks than torch's);
    False fuses nothing.
    The model itself is not modified."""
    budget = _budget(budget_gb, budget_bytes)
    if budget is None and plan is None:
        raise ValueError("give budget_gb or budget_bytes (or a saved plan=)")
    args = _as_tuple(example_inputs)
    holder: dict[str, Any] = {}

    def planned_partition(joint_gm, joint_inputs, *, num_fwd_outputs, **kw):
        try:
            info = _joint_info(joint_gm, num_fwd_outputs, type(model).__name__)
            if plan is not None:  # a saved plan: judge it again on this machine's graph
                chosen = _rejudge(plan, info.graph)
            else:
                chosen = solve(info.graph, budget, solver=solver, time_limit_s=time_limit_s, **solver_kwargs)
            fw, bw = partition_with_plan(info, chosen)
        except Exception as e:  # planning errors are ours, not tracing failures: pass them through
            e._remat_passthrough = True
            raise
        holder["plan"], holder["graph"] = chosen, info.graph
        return fw, bw

    compiled, sig = trace_training_step(model, args, example_kwargs, planned_partition, fused_attention)
    return RematModule(model, compiled, sig, holder["plan"], holder["graph"])
