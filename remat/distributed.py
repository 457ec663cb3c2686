"""remat on several devices, the user's side: FSDP2 with each block planned before sharding, under a
budget per rank (`fully_shard_with_remat`), and DDP's share of a per-rank budget
(`ddp_reserved_bytes`, from runtime/distributed.py: plan the step for `budget - ddp_reserved_bytes(model)`
and wrap remat's module, `DistributedDataParallel(remat.optimize(model, ..., solve_on_rank=0))`).

FSDP2:

`fully_shard_with_remat(model, blocks, budget_bytes=B, example_inputs=...)` does torchtitan's order
(activation checkpointing per block, then `fully_shard` per block and on the root) with plans
chosen so that each rank's measured peak stays under B:

1. one forward without grad records each block's inputs; each block is traced on its own;
2. rank `solve_on_rank` solves every distinct block graph at `levels` budgets, from its
   lowest-memory plan (level 0) to no recomputation, and broadcasts the plans;
3. every block is replaced by its RematModule at level 0, then sharded (`fsdp_kwargs` go to
   `fully_shard`), the root last; a block whose traced step equals an earlier block's
   (graph_capture/step_identity.py: a model's identical layers) runs that block's compiled step
   with its own parameters instead of being traced again, here and in 5.;
4. one calibration step measures the per-rank peak at level 0 (the largest over the ranks), with
   FSDP2's real memory: sharded parameters and gradients, the all-gathered blocks, the root's
   parameters, gradients and activations. RNG state, buffers and gradients are restored after it,
   so training is the same as without it;
5. the highest level whose bound fits B is deployed (`runtime.distributed.fit_block_level`): each
   block's plan changes the peak by at most what it holds more between its forward and its
   backward, plus what the running block adds at its own peak (simulated), plus a margin of one
   block's gathered parameters for collectives in flight. Blocks are traced again for that level
   under FSDP2's `unshard()` and swap their step (`RematModule.adopt`).
6. a later kind of call (another batch shape) is planned by each block, with the same solver, under
   its plan's budget, the block's share; one that no plan fits under it is planned at its smallest
   feasible budget (`BlockBudgetWarning`): the per-rank budget was calibrated on the example inputs.

Why not the other design (plan the sharded model as one graph): FSDP2 gathers each block's
parameters with hooks when the block runs and frees them after, and the traced graph sees only
tensors; a whole-model step would gather every block's parameters for the whole step, and the
graph would not hold the collectives. Planning blocks keeps FSDP2's per-block gathering, and the
calibration step measures what no block graph can see.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from remat.block_levels import plans_at_levels
from remat.graph_capture.step_identity import first_equal
from remat.measure import measure_peak
from remat.pipeline import PlanOptions, deployed_as, identified_trace
from remat.runtime.distributed import BlockProfile, block_profile, broadcast_plans, ddp_reserved_bytes, fit_block_level
from remat.runtime.module import OutsideBudgetWarning, RematModule
from remat.core.plan import Plan
from remat.validate import budget_in_bytes

__all__ = ["ShardedPlan", "fully_shard_with_remat", "block_inputs", "ddp_reserved_bytes"]


@dataclass
class ShardedPlan:
    """What fully_shard_with_remat chose: the per-rank budget, the calibration step's measured peak
    (largest over the ranks) at level 0, the margin, the level deployed (0..levels-1) and the bound
    on the per-rank peak it guarantees, and each block's plan."""

    budget_bytes: int
    calibrated_peak_bytes: int
    margin_bytes: int
    level: int
    levels: int
    bound_bytes: int
    plans: list[Plan] = field(default_factory=list)


def _tensors(x: Any) -> list[torch.Tensor]:
    from remat.compat.torch_private import pytree

    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def block_inputs(model: nn.Module, blocks: Sequence[nn.Module], example_inputs: tuple,
                 example_kwargs: dict | None = None) -> list[tuple[tuple, dict]]:
    """Each block's (args, kwargs) in one forward of `model` without grad (RNG state restored):
    copies, with every floating-point positional argument requiring grad (an activation, whose
    gradient the block's backward computes)."""
    from remat.compat.torch_private import pytree

    seen: list[tuple[tuple, dict] | None] = [None] * len(blocks)

    def grab(i: int):
        def hook(_m, args, kwargs):
            if seen[i] is None:
                args = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, args)
                kwargs = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, kwargs)
                args = tuple(a.requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in args)
                seen[i] = (args, kwargs)
        return hook

    handles = [b.register_forward_pre_hook(grab(i), with_kwargs=True) for i, b in enumerate(blocks)]
    devices = [t.device for t in _tensors(example_inputs) if t.device.type == "cuda"][:1]
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model(*example_inputs, **(example_kwargs or {}))
    finally:
        for h in handles:
            h.remove()
    missing = [i for i, s in enumerate(seen) if s is None]
    if missing:
        raise ValueError(f"blocks {missing} did not run in the model's forward: pass the blocks the forward calls")
    return seen  # type: ignore[return-value]


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for name, m in model.named_modules():
        for child_name, child in m.named_children():
            if child is old:
                setattr(m, child_name, new)
                return
    raise ValueError(f"{type(old).__name__} is not a submodule of {type(model).__name__}")


def _loss(out: Any, loss_fn: Callable | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(out)
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out
    raise ValueError("the model does not return a scalar loss: pass loss_fn= (output -> scalar loss) for the "
                     "calibration step")


def _calibrate(model: nn.Module, inputs: tuple, kwargs: dict, loss_fn: Callable | None) -> int:
    """The per-rank peak of one training step (largest over the ranks), leaving no trace: RNG
    state, buffers and gradients are as they were before it."""
    import torch.distributed as dist

    params = list(model.parameters())
    buffers = [b.detach().clone() for b in model.buffers()]
    grads = [p.grad for p in params]
    flat = _tensors((inputs, kwargs))
    device = next((t.device for t in flat if t.device.type == "cuda"), None)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    with torch.random.fork_rng(devices=[device] if device is not None else []):
        peak = measure_peak(lambda: _loss(model(*inputs, **kwargs), loss_fn).backward(),
                            resident=[t.detach() for t in local] + flat, device=device)
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    for p, g in zip(params, grads):
        p.grad = g
    box = torch.tensor([peak], dtype=torch.int64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())


def fully_shard_with_remat(model: nn.Module, blocks: Sequence[nn.Module], *, example_inputs: Any,
                           budget_bytes: int | None = None, budget_gb: float | None = None,
                           example_kwargs: dict | None = None, solver: str = "checkmate",
                           time_limit_s: float | None = None, levels: int = 5, solve_on_rank: int = 0,
                           loss_fn: Callable | None = None, fsdp_kwargs: dict | None = None,
                           **solver_kwargs) -> ShardedPlan:
    """Plan every block of `blocks` (submodules of `model`, e.g. its ModuleList of transformer
    layers) with remat, shard each one and then `model` with FSDP2's `fully_shard`, in place, so
    that one training step (`model(*example_inputs, **example_kwargs)` returning the loss, or
    `loss_fn(output)`, then `.backward()`) peaks under the budget on every rank. Every rank calls it;
    `solve_on_rank` solves. See the module docstring for how, and README "Beyond one device".
    Raises InfeasibleBudgetError (with the smallest budget it can meet) when even the blocks'
    lowest-memory plans do not fit."""
    with warnings.catch_warnings():  # a block returns an activation, and the whole step is budgeted here
        warnings.simplefilter("ignore", OutsideBudgetWarning)
        return _fully_shard_with_remat(model, blocks, example_inputs, budget_bytes, budget_gb, example_kwargs,
                                       solver, time_limit_s, levels, solve_on_rank, loss_fn, fsdp_kwargs,
                                       solver_kwargs)


def _fully_shard_with_remat(model, blocks, example_inputs, budget_bytes, budget_gb, example_kwargs, solver,
                            time_limit_s, levels, solve_on_rank, loss_fn, fsdp_kwargs, solver_kwargs) -> ShardedPlan:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    budget = budget_in_bytes(budget_gb, budget_bytes)
    if budget is None:
        raise ValueError("give budget_bytes or budget_gb: the peak each rank may reach")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    if not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be a positive integer, got {levels!r}")
    inputs = example_inputs if isinstance(example_inputs, tuple) else \
        tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    blocks = list(blocks)
    fsdp_kwargs = dict(fsdp_kwargs or {})
    mp = fsdp_kwargs.get("mp_policy")
    if mp is not None and (getattr(mp, "param_dtype", None), getattr(mp, "reduce_dtype", None)) != (None, None):
        # the blocks are traced with the parameters' own dtype; FSDP2 would hand them cast ones
        raise ValueError("fully_shard_with_remat does not support FSDP2 mixed precision (mp_policy with param_dtype "
                         "or reduce_dtype) yet: the blocks are planned for their parameters' own dtype, and FSDP2 "
                         "would hand them cast ones")

    # 1-2. each block's graph; plans for every distinct graph at every level, solved on one rank
    seen_inputs = block_inputs(model, blocks, inputs, kwargs)
    traced = [identified_trace(b, a, k) for b, (a, k) in zip(blocks, seen_inputs)]
    graphs = [g for g, _ in traced]
    distinct = list(dict.fromkeys(g.fingerprint() for g in graphs))
    first = {fp: next(g for g in graphs if g.fingerprint() == fp) for fp in distinct}

    def make() -> list[Plan]:
        solved = plans_at_levels(first, levels, solver, time_limit_s, solver_kwargs)
        return [p for fp in distinct for p in solved[fp]]

    flat_plans = broadcast_plans(make, src=solve_on_rank)
    by_graph = {fp: flat_plans[i * levels:(i + 1) * levels] for i, fp in enumerate(distinct)}
    per_block = [by_graph[g.fingerprint()] for g in graphs]
    # a block whose traced step equals an earlier one's runs that one's compiled step (not traced again)
    twins = first_equal([i for _, i in traced], per_block)
    profiles: list[list[BlockProfile]] = [[block_profile(g, p) for p in ps] for g, ps in zip(graphs, per_block)]
    gathered = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks)

    def block_module(i: int, b: nn.Module, plan: Plan, made: list[RematModule]) -> RematModule:
        # later kinds of call planned with the same solver, under the plan's budget as the block's
        # share of the step's (PlanOptions.block_share: one no plan fits is planned at its smallest)
        options = PlanOptions(budget_bytes=plan.budget_bytes, solver=solver, time_limit_s=time_limit_s,
                              solver_options=tuple(solver_kwargs.items()), quiet=True, block_share=True)
        a, k = seen_inputs[i]
        return deployed_as(made[twins[i]] if twins[i] != i else None, b, a, k, options, plan)

    # 3. level 0 deployed, then sharded as torchtitan shards: each block, then the root
    remats: list[RematModule] = []
    for i, (b, ps) in enumerate(zip(blocks, per_block)):
        r = block_module(i, b, ps[0], remats)
        _replace(model, b, r)
        remats.append(r)
    for r in remats:
        fully_shard(r, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)

    # 4-5. calibration step at level 0, then the highest level that fits
    measured = _calibrate(model, inputs, kwargs, loss_fn)
    level, bound = fit_block_level(measured, gathered, budget, profiles)
    if level > 0:
        adopted: list[RematModule] = []
        for i, (r, ps) in enumerate(zip(remats, per_block)):
            r.unshard()
            try:
                adopted.append(block_module(i, r.module, ps[level], adopted))
                r.adopt(adopted[-1])
            finally:
                r.reshard()
    return ShardedPlan(budget_bytes=budget, calibrated_peak_bytes=measured, margin_bytes=gathered, level=level,
                       levels=levels, bound_bytes=bound, plans=[ps[level] for ps in per_block])
