"""remat beyond one device: one plan for every rank, and what a budget per rank must leave room for.

* **One plan.** `plan_on_one_rank(decide, adopt, src)` turns "solve the graph" into "rank `src`
  solves, every other rank receives its plan": the plan (or the error that stopped it, e.g.
  InfeasibleBudgetError with its smallest feasible budget) is broadcast as JSON, and each receiving
  rank checks that its own traced graph has the planner's fingerprint before it deploys the plan
  (PlanMismatchError naming both ranks otherwise). No rank waits forever on a failed solve.
* **DDP.** `ddp_reserved_bytes(module)`: DistributedDataParallel allocates one gradient bucket
  element per parameter that requires grad when it is built (measured: the profiler sees exactly
  these bytes, with `gradient_as_bucket_view` True or False), and they stay allocated. The step
  itself allocates nothing more (gradients are copied into the buckets, all-reduced in place, and
  copied back into `.grad`) except, in some steps, one gradient-sized tensor held a little past the
  step's end; a per-rank budget B is met when the step is planned for `B - ddp_reserved_bytes(module)`.
* **FSDP2.** Blocks are planned before sharding (torchtitan's order, `remat.distributed`); what a
  block holds between its forward and its backward and what it adds while it runs come from the
  simulator (`block_profile`), and `fit_block_level` picks, from one calibration step, the least
  recomputing level that keeps the per-rank peak under the budget.
* **Wrappers remat cannot see through** (`distributed_wrapper`): a model already wrapped in DDP, or
  already sharded by FSDP, is refused by `remat.optimize` (the other order is the supported one).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from remat.core.errors import RematError
from remat.compat.torch_private import disable_current_modes, disable_torch_function
from remat.core.training_graph import TrainingGraph
from remat.core.plan import PlanMismatchError
from remat.core.plan import InfeasibleBudgetError, Plan
from remat.core.simulator import forward_end, simulate

DDP_BOOKKEEPING_BYTES = 4096  # the reducer's small tensors besides the buckets (measured: up to 640 bytes)

__all__ = ["plan_on_one_rank", "broadcast_plans", "ddp_reserved_bytes", "DDP_BOOKKEEPING_BYTES", "distributed_wrapper",
           "BlockProfile", "block_profile", "fit_block_level", "DistributedPlanError"]


class DistributedPlanError(RematError, RuntimeError):
    """The rank that plans for the others failed with an error this rank cannot rebuild; the message
    names that rank and its error."""


def _dist():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                           "first (torchrun sets up the environment it reads)")
    return dist


def _broadcast(payload: str | None, src: int, group) -> str:
    """`payload` (given on `src`, a rank of `group`) on every rank of `group`."""
    dist = _dist()
    box = [payload]
    device = None
    if dist.get_backend(group) == "nccl":  # NCCL moves the pickled object through the current GPU
        device = torch.device("cuda", torch.cuda.current_device())
    # called while remat traces (the plan is made inside AOTAutograd's partition step): the
    # collective must see real tensors, not the trace's fake ones or the attention router's mode
    with disable_current_modes(), disable_torch_function():
        dist.broadcast_object_list(box, group=group, group_src=src, device=device)
    return box[0]


def _error_payload(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e), "min_feasible_bytes": getattr(e, "min_feasible_bytes", None)}


def _raise_received(payload: dict, src: int) -> None:
    msg = f"rank {src}, which plans for every rank, failed: {payload['message']}"
    if payload["error"] == "InfeasibleBudgetError":
        raise InfeasibleBudgetError(msg, min_feasible_bytes=payload["min_feasible_bytes"])
    if payload["error"] == "PlanMismatchError":
        raise PlanMismatchError(msg)
    raise DistributedPlanError(f"{msg} ({payload['error']})")


def broadcast_plans(make: Callable[[], list[Plan]] | None, src: int = 0, group=None) -> list[Plan]:
    """The plans `make()` returns on rank `src`, on every rank of `group` (`make` is only called
    there; other ranks may pass None). An error raised by `make` is raised on every rank."""
    dist = _dist()
    if dist.get_rank(group) == src:
        try:
            plans = make()
            payload = {"plans": [p.to_json() for p in plans]}
        except Exception as e:
            _broadcast(json.dumps(_error_payload(e)), src, group)
            raise
        _broadcast(json.dumps(payload), src, group)
        return plans
    payload = json.loads(_broadcast(None, src, group))
    if "error" in payload:
        _raise_received(payload, src)
    return [Plan.from_json(s, source=f"the plan broadcast by rank {src}") for s in payload["plans"]]


def plan_on_one_rank(decide: Callable[[TrainingGraph], Plan], adopt: Callable[[Plan, TrainingGraph], Plan],
                     src: int = 0, group=None) -> Callable[[TrainingGraph], Plan]:
    """A `decide(graph) -> Plan` for every rank of `group`: rank `src` runs `decide` and broadcasts
    the plan; every other rank receives it and returns `adopt(plan, graph)` (the plan judged again on
    its own graph) after checking the graphs match. Every rank must call it (collectively)."""
    dist = _dist()
    if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < dist.get_world_size(group):
        raise ValueError(f"solve_on_rank must be a rank of the process group (0 to {dist.get_world_size(group) - 1}), "
                         f"got {src!r}")

    def run(graph: TrainingGraph) -> Plan:
        if dist.get_rank(group) == src:
            try:
                plan = decide(graph)
                payload = {"plan": plan.to_json(), "fingerprint": graph.fingerprint()}
            except Exception as e:
                _broadcast(json.dumps(_error_payload(e)), src, group)
                raise
            _broadcast(json.dumps(payload), src, group)
            return plan
        payload = json.loads(_broadcast(None, src, group))
        if "error" in payload:
            _raise_received(payload, src)
        mine = graph.fingerprint()
        if payload["fingerprint"] != mine:
            raise PlanMismatchError(
                f"rank {dist.get_rank(group)} traced graph {mine}, but rank {src} planned graph "
                f"{payload['fingerprint']}: the ranks' models or example input shapes differ; give every "
                f"rank the same model and example inputs of the same shape")
        return adopt(Plan.from_json(payload["plan"], source=f"the plan broadcast by rank {src}"), graph)

    return run


def ddp_reserved_bytes(module: nn.Module) -> int:
    """Bytes DistributedDataParallel holds on each rank outside the training step: its gradient
    buckets, one element per distinct parameter that requires grad, allocated when DDP is built,
    counted twice: the second forward re-allocates the buckets (in the order the first backward
    filled them) before the old ones are freed, and on CPU/gloo the old ones are sometimes still
    alive at the step's peak (measured: the step's peak plus two bucket sets, in some runs and not
    others). Plan the step for `budget - ddp_reserved_bytes(model)` so the step and the buckets
    together fit. Also included, for what DDP holds now and then at the end of a step (measured on
    CPU/gloo, not in every step): one gradient-sized tensor more, up to the largest parameter's
    bytes, released just after the step, and DDP_BOOKKEEPING_BYTES for the reducer's small tensors
    (up to 640 bytes). Not a peak of the step: building DDP broadcasts rank 0's parameters through a
    flat copy before any activation exists (the step's own peak holds every gradient, so it is
    never below it)."""
    seen: set[int] = set()
    sizes = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            sizes.append(p.numel() * p.element_size())
    return 2 * sum(sizes) + max(sizes, default=0) + DDP_BOOKKEEPING_BYTES


def distributed_wrapper(model: nn.Module) -> str | None:
    """Why `remat.optimize(model)` cannot plan `model`, if it is (or holds) a distributed wrapper:
    DistributedDataParallel (its reducer hooks run outside any traced graph) or modules FSDP2 has
    sharded (their parameters are gathered by hooks at run time); None otherwise."""
    if not torch.distributed.is_available():
        return None
    import sys

    from torch.nn.parallel import DistributedDataParallel

    sharded: tuple = ()
    if "torch.distributed.fsdp" in sys.modules:  # nothing can be sharded before FSDP is imported
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        sharded = (FSDPModule, FullyShardedDataParallel)
    for name, m in model.named_modules():
        where = f"the model ({type(m).__name__})" if not name else f"its submodule {name} ({type(m).__name__})"
        if isinstance(m, DistributedDataParallel):
            return (f"{where} is DistributedDataParallel: its gradient hooks run outside any graph remat can "
                    f"trace. Plan the model and let DDP wrap remat's module: "
                    f"DistributedDataParallel(remat.optimize(model, ...))")
        if sharded and isinstance(m, sharded):
            return (f"{where} is already sharded by FSDP: its parameters are gathered by hooks at run time, "
                    f"which remat's trace cannot hold. Plan each block before sharding it: "
                    f"remat.distributed.fully_shard_with_remat(model, blocks, budget_bytes=..., example_inputs=...)")
    return None


@dataclass(frozen=True)
class BlockProfile:
    """What one block's plan means for the rest of the step, from the simulator: `saved_bytes`,
    memory the block holds from the end of its forward until its backward (saved activations, its
    input when saved, resident included); `peak_bytes`, the block's own peak while it runs."""

    saved_bytes: int
    peak_bytes: int


def block_profile(graph: TrainingGraph, plan: Plan) -> BlockProfile:
    """The BlockProfile of `plan` on `graph` (a block traced on its own: its output's gradient is the
    backward's input)."""
    sim = simulate(graph, plan.schedule)
    end = forward_end(graph, plan.schedule)
    if end is None or end + 1 >= len(plan.schedule):
        return BlockProfile(saved_bytes=sim.peak_bytes, peak_bytes=sim.peak_bytes)
    nxt = graph.node(plan.schedule[end + 1])
    tangents = sum(b for b, _ in graph.tangents)
    # memory while the first backward step runs, less that step's own allocations and the tangents
    # that arrive with the backward: what is live between the forward and the backward
    between = sim.timeline[end + 1] - nxt.out_bytes - nxt.kept_bytes - nxt.workspace_bytes - tangents
    return BlockProfile(saved_bytes=between, peak_bytes=sim.peak_bytes)


def fit_block_level(measured_bytes: int, margin_bytes: int, budget_bytes: int,
                    profiles: Sequence[Sequence[BlockProfile]]) -> tuple[int, int]:
    """The highest level (least recomputation) whose bound on the per-rank peak fits `budget_bytes`,
    and that bound. `profiles[i][j]`: block i planned at level j (level 0 is the one the calibration
    step ran, with peak `measured_bytes`). Changing the blocks' plans changes the peak by at most what
    every block holds more between its forward and its backward, plus what the block that is running
    adds more at its own peak:

        peak(level) <= measured + margin + sum_i max(0, dS_i) + max_i max(0, dP_i)

    `margin_bytes` covers what varies from one step to the next (collectives in flight).
    Raises InfeasibleBudgetError when even level 0 does not fit (its smallest budget: its bound)."""
    levels = min(len(p) for p in profiles)
    base = measured_bytes + margin_bytes
    if base > budget_bytes:
        raise InfeasibleBudgetError(
            f"the sharded step peaks at {measured_bytes} bytes per rank (+{margin_bytes} for collectives in "
            f"flight) with every block at its lowest-memory plan, over the budget of {budget_bytes} bytes",
            min_feasible_bytes=base)
    best = (0, base)
    for j in range(1, levels):
        d_saved = sum(max(0, p[j].saved_bytes - p[0].saved_bytes) for p in profiles)
        d_peak = max(max(0, p[j].peak_bytes - p[0].peak_bytes) for p in profiles)
        bound = base + d_saved + d_peak
        if bound <= budget_bytes:
            best = (j, bound)
    return best
