"""`remat.plan`: a Plan made without the step's memory, for a device that need not be here.

    with torch.device("meta"):
        model = GPT(cfg)                                   # no parameter memory
    idx = torch.empty(8, 2048, dtype=torch.long, device="meta")
    plan = remat.plan(model, (idx, idx), budget_gb=40, device="cuda")
    plan.save("plan.json")
    ...                                                     # later, on the GPU, the real model:
    opt = remat.optimize(model, example_inputs=(idx, targets), plan=remat.Plan.load("plan.json"))

The step is traced on fake tensors (graph_capture/fake_capture.py): the graph, and so the plan's
fingerprint, are the ones `remat.capture` gives for the real model and inputs of the same shapes.
`device` gives the memory model ("cpu": exact bytes; "cuda": every allocation rounded up to the
caching allocator's 512-byte blocks) and where op workspaces are measured; those that could not be
measured at their real shapes (too large to allocate here, or no such device here) are estimated,
and `plan.details["estimated_workspaces"]` lists them. `remat.optimize(..., plan=plan)` judges the
plan again on the real graph, with every workspace measured, as for any saved plan.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from remat.api import solve
from remat.settings import CaptureOptions, Solver, settle
from remat.core import progress
from remat.graph_capture.fake_capture import capture_without_memory, planned_device
from remat.graph_capture.scaled_workspace import ProbeLimits
from remat.core.training_graph import TrainingGraph
from remat.core.plan import InfeasibleBudgetError, Plan
from remat.loss_head.router import chunked_loss_mode
from remat.head_choice import has_chunked_head, head_added, loss_head_of
from remat.solver.checkmate.peak_rows import peak_floor
from remat.validate import (RematArgumentError, RematArgumentTypeError, budget_in_bytes,
                            check_optimize_args, example_arguments)

__all__ = ["plan", "capture_without_memory", "ProbeLimits"]


def _device(device: Any):
    if isinstance(device, bool) or not isinstance(device, (str, torch.device)):
        raise RematArgumentTypeError(f"device must be 'cpu' or 'cuda' (or a torch.device), got {type(device).__name__}")
    try:
        return planned_device(device)
    except ValueError as e:
        raise RematArgumentError(str(e)) from None


def _limits(probe_limit_bytes: Any) -> ProbeLimits:
    if probe_limit_bytes is None:
        return ProbeLimits()
    if isinstance(probe_limit_bytes, bool) or not isinstance(probe_limit_bytes, int):
        raise RematArgumentTypeError(f"probe_limit_bytes must be an integer, got {type(probe_limit_bytes).__name__}")
    if probe_limit_bytes < 1:
        raise RematArgumentError(f"probe_limit_bytes must be positive, got {probe_limit_bytes}")
    return ProbeLimits(max_bytes=probe_limit_bytes)


def plan(model: nn.Module, example_inputs: Any, budget_gb: float | None = None, *, budget_bytes: int | None = None,
         device="cpu", example_kwargs: dict | None = None, solver: str | Solver = "checkmate",
         capture: CaptureOptions | None = None, probe_limit_bytes: int | None = None, quiet: bool = False,
         time_limit_s: float | None = None, fused_attention: bool | str = True, chunked_loss: bool | str = "auto",
         **solver_kwargs) -> Plan:
    """Plan one training step of `model` under the budget for `device`, without allocating the
    step's memory: `model` may live on the meta device or be made of fake tensors, and
    `example_inputs` may be meta or fake tensors (only shapes, strides and dtypes are read).

    `device` ("cpu" or "cuda"): the memory model the plan is judged by (CUDA: each allocation
    rounded up to 512 bytes) and where op workspaces are measured. Each op is run once, one at a
    time, on real data: at its real shapes if its inputs and outputs fit `probe_limit_bytes`
    (default 256 MiB) and its FLOPs the probe's limit, else on smaller shapes, and scaled; with no
    CUDA device here a CUDA plan uses known formulas (or 0) for the workspaces. Those are listed in
    `plan.details["estimated_workspaces"]` (op, nodes, method: "scaled", "formula" or "unmeasured",
    bytes). Buffers on the meta device have no values (`plan.details["buffers_without_data"]`): a
    causal mask among them is not proven causal, so attention reading it stays unfused, and the
    plan will not match the real model's graph if the real mask fuses it (build such a mask in
    `forward`, use `scaled_dot_product_attention(is_causal=True)`, or give the model real buffers).
    The budget, the solver and capture settings (as groups or keywords) and `quiet` are
    `remat.optimize`'s (a plan made here is traced with the "flops" cost model; `chunked_loss`
    "auto": the step is captured with the chunked loss head too where the model's own head
    recomputes or does not fit, and the plan that fits at the lower total cost is kept;
    `plan.details["loss_head"]` says which, and deploying traces that head). Deploy the plan with
    `remat.optimize(model, example_inputs=..., plan=plan)` on the real model and inputs of the same
    shapes: it is judged again there, with every workspace measured."""
    # remat.optimize's checks (a budget is required), before any tracing
    chosen, how = settle(solver, time_limit_s, solver_kwargs, capture, fused_attention=fused_attention,
                         chunked_loss=chunked_loss)
    solver, time_limit_s, solver_kwargs = chosen.name, chosen.time_limit_s, chosen.kwargs
    fused_attention, chunked_loss = how.fused_attention, how.chunked_loss
    if how.cost_model != "flops":
        raise RematArgumentError("remat.plan plans without the memory, so it cannot time ops: cost_model='flops' only")
    check_optimize_args(model, budget_gb, budget_bytes, example_inputs, example_kwargs, solver, time_limit_s,
                        None, fused_attention, solver_kwargs)
    budget = budget_in_bytes(budget_gb, budget_bytes)
    dev = _device(device)
    limits = _limits(probe_limit_bytes)
    if dev.type == "cuda" and torch.is_autocast_enabled("cuda"):
        # the step is traced on the CPU (graph_capture/fake_capture.py), where CUDA's autocast
        # does not apply and CPU autocast casts other ops: the graph would not be the GPU's
        raise RematArgumentError("remat.plan cannot plan a step under CUDA autocast (it traces on the CPU); "
                                 "solve on the GPU with remat.optimize, or plan in full precision")
    mode = chunked_loss_mode(chunked_loss)

    def capture(chunked: bool) -> TrainingGraph:
        return capture_without_memory(model, example_arguments(example_inputs), example_kwargs, device=dev,
                                      fused_attention=fused_attention, limits=limits, chunked_loss=chunked)

    def solved(graph: TrainingGraph) -> Plan:
        p = solve(graph, budget, solver=solver, time_limit_s=time_limit_s, **solver_kwargs)
        head = loss_head_of(graph)
        return dataclasses.replace(p, details={**p.details, **plan_details(graph), "loss_head": head})

    with progress.quiet(quiet):
        graph = capture(mode == "on")
        if mode != "auto" or solver != "checkmate":  # (the baselines keep the model's head, as in optimize)
            return solved(graph)
        plain, failed = None, None
        if budget is None or peak_floor(graph) <= budget:  # else proven not to fit: no search for its smallest
            try:
                plain = solved(graph)
            except InfeasibleBudgetError as e:
                failed = e
        if plain is not None and plain.extra_cost == 0:
            return plain  # nothing recomputed: the chunked head could only add its matmul
        other = capture(True)
        if not has_chunked_head(other):
            return plain if plain is not None else solved(graph)  # (raises, naming its smallest budget)
        try:
            chunked = solved(other)
        except InfeasibleBudgetError as e:
            if plain is not None:
                return plain
            if failed is None:
                try:
                    return solved(graph)  # searched now for the error's smallest budget
                except InfeasibleBudgetError as f:
                    failed = f
            raise min((failed, e), key=lambda x: x.min_feasible_bytes if x.min_feasible_bytes is not None
                      else float("inf")) from None
        if plain is None or chunked.total_cost < plain.total_cost:
            return dataclasses.replace(chunked, details={**chunked.details, **head_added(other, graph)})
        return plain


def plan_details(graph: TrainingGraph) -> dict:
    """What a plan made without the memory records about its graph (see `plan`)."""
    meta = graph.meta
    return {"planned_for": meta.get("planned_for", "cpu"),
            "memory_model": "cuda: allocations rounded up to 512 bytes" if meta.get("allocator") == "cuda"
            else "cpu: exact bytes",
            "traced_on": meta.get("traced_on", ""), "graph_nodes": len(graph.nodes),
            "capture_s": meta.get("capture_s"), "buffers_without_data": list(meta.get("buffers_without_data", [])),
            "estimated_workspaces": list(meta.get("estimated_workspaces", []))}
