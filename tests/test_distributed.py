"""remat under DDP and FSDP2 on 2 CPU ranks (gloo), spawned by the tests: after 3 steps the
parameters on every rank equal those of the same training of the unmodified model, and each rank's
measured peak stays under its budget; one rank plans for all; the wrong wrapping order is refused.

Each test spawns one 2-rank job that runs every check of its kind and writes one JSON per rank;
the assertions run here, on what the ranks wrote."""
from __future__ import annotations

import gc
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


WORLD = 2
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


def _train(step_module, model, inputs, rank, measure=None, steps=3):
    """3 SGD steps with the same seeds as every other training here; each step's measured peak
    (`measure(model)`: what is resident before the step), or none without `measure`."""
    import remat

    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)
    peaks = []
    for _ in range(steps):
        optim.zero_grad(set_to_none=True)
        if measure is None:
            step_module(*inputs).backward()
        else:
            peaks.append(remat.measure_peak(lambda: step_module(*inputs).backward(), resident=measure(model)))
        optim.step()
    return peaks


def _ddp_job(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import remat
    from remat.default_model import GPTConfig, default_inputs, default_model
    from remat.distributed import ddp_reserved_bytes

    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1, batch_size=4)
    model, ref = default_model(cfg), default_model(cfg)
    idx, tgt = default_inputs(cfg, seed=1 + rank)  # each rank its own batch
    keep = remat.solve(remat.capture(model, (idx, tgt)), None, solver="keep_all").predicted_peak_bytes
    reserved = ddp_reserved_bytes(model)
    buckets = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(0.8 * keep) + reserved  # per rank: the step and DDP's buckets
    opt = remat.optimize(model, budget_bytes=budget - reserved, example_inputs=(idx, tgt), solver="equal_spacing",
                         solve_on_rank=0)
    out = dict(budget=budget, reserved=reserved, buckets=buckets, keep=keep, schedule=opt.plan.schedule,
               recomputed=len(opt.plan.recomputed), predicted=opt.plan.predicted_peak_bytes)
    # the step alone, then DDP built and 3 steps trained inside one profile: its buckets (allocated when
    # DDP is built, re-allocated in the second forward) and whatever gloo holds are all measured
    out["step_alone"] = remat.measure_peak(lambda: opt(idx, tgt).backward(), resident=[model, idx, tgt])
    for p in model.parameters():
        p.grad = None
    out["peak"] = remat.measure_peak(lambda: _train(DDP(opt), model, (idx, tgt), rank), resident=[model, idx, tgt])
    _train(DDP(ref), ref, (idx, tgt), rank)
    out["param_diff"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    out["same_as_ref"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in
                             zip(model.parameters(), ref.parameters()))

    # the other order: refused before any tracing, with the order that works
    try:
        remat.optimize(DDP(default_model(cfg)), budget_bytes=budget, example_inputs=(idx, tgt))
    except remat.RematArgumentError as e:
        out["wrapped_error"] = str(e)
    # a rank whose graph differs from the planner's refuses the plan; the planner's error reaches all
    shape = (idx, tgt) if rank == 0 else (idx[:2], tgt[:2])
    try:
        remat.optimize(default_model(cfg), budget_bytes=2**40, example_inputs=shape, solver="keep_all",
                       solve_on_rank=0)
        out["mismatch"] = None
    except remat.PlanMismatchError as e:
        out["mismatch"] = str(e)
    try:
        remat.optimize(default_model(cfg), budget_bytes=1000, example_inputs=(idx, tgt), solver="equal_spacing",
                       solve_on_rank=0)
    except remat.InfeasibleBudgetError as e:
        out["infeasible_min"] = e.min_feasible_bytes
    return out


def _fsdp_job(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    import remat
    from remat.default_model import GPTConfig, default_inputs, default_model
    from remat.distributed import fully_shard_with_remat

    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=3, n_head=2, n_embd=32, dropout=0.1, batch_size=8)
    model, ref = default_model(cfg), default_model(cfg)
    idx, tgt = default_inputs(cfg, seed=1 + rank)
    for block in ref.h:  # the unmodified model, sharded the same way
        fully_shard(block)
    fully_shard(ref)
    resident = lambda m: [p.to_local() for p in m.parameters()] + [idx, tgt]  # noqa: E731 (local shards)
    ref_peaks = _train(ref, ref, (idx, tgt), rank, resident)
    box = torch.tensor([max(ref_peaks)])
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    budget = int(0.6 * box.item())  # per rank: 60% of what the unmodified sharded step peaks at
    sharded = fully_shard_with_remat(model, model.h, budget_bytes=budget, example_inputs=(idx, tgt),
                                     solver="equal_spacing", levels=6)
    out = dict(budget=budget, ref_peaks=ref_peaks, level=sharded.level, bound=sharded.bound_bytes,
               calibrated=sharded.calibrated_peak_bytes, margin=sharded.margin_bytes,
               recomputed=[len(p.recomputed) for p in sharded.plans],
               # the three layers trace to one step: the first one's runs the other two
               hows=[m.plan_log[0].how for m in model.h])
    out["peaks"] = _train(model, model, (idx, tgt), rank, resident)
    # the reference trained 3 steps already: train a fresh one to compare after the same 3 steps
    fresh = default_model(cfg)
    for block in fresh.h:
        fully_shard(block)
    fully_shard(fresh)
    _train(fresh, fresh, (idx, tgt), rank, resident)
    out["param_diff"] = max((a.full_tensor() - b.full_tensor()).abs().max().item()
                            for a, b in zip(model.parameters(), fresh.parameters()))
    out["same_as_ref"] = all(torch.allclose(a.full_tensor(), b.full_tensor(), rtol=1e-5, atol=1e-5)
                             for a, b in zip(model.parameters(), fresh.parameters()))
    try:
        remat.optimize(ref, budget_bytes=budget, example_inputs=(idx, tgt))
    except remat.RematArgumentError as e:
        out["wrapped_error"] = str(e)
    # a batch 16 times the example's needs more than each block's share: planned at the block's
    # smallest (BlockBudgetWarning), with the unmodified model's loss and gradients
    import warnings

    big = (idx.repeat(16, 1), tgt.repeat(16, 1))
    losses, warned = [], []
    for m in (model, fresh):
        for p in m.parameters():
            p.grad = None
        torch.manual_seed(7)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = m(*big)
            loss.backward()
        losses.append(loss.item())
        warned.append(sorted({w.category.__name__ for w in seen if w.category.__module__.startswith("remat")}))
    out["big_warnings"] = warned[0]
    out["big_same"] = losses[0] == losses[1] and all(
        torch.allclose(a.grad.full_tensor(), b.grad.full_tensor(), rtol=1e-5, atol=1e-6)
        for a, b in zip(model.parameters(), fresh.parameters()))
    return out


def _worker(rank: int, job: str, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        result = {"_ddp": _ddp_job, "_fsdp": _fsdp_job}[job](rank)
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
        f.flush()
        os.fsync(f.fileno())
    gc.collect()  # the job's modules (and FSDP2's device mesh, which holds the group) go first
    dist.destroy_process_group()
    # Everything this rank measured is on disk. Leave without the interpreter's teardown: under load
    # gloo's worker threads can still hold work objects then, and destroying them at finalization
    # aborts the process ("terminate called without an active exception", pytorch#179291), which
    # mp.spawn reports as a failed rank although every check of the job had run.
    os._exit(0)


def _spawn(job: str, tmp_path) -> list[dict]:
    mp.spawn(_worker, args=(job, str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return results


def test_ddp_wraps_remat_with_the_budget_per_rank(tmp_path):
    ranks = _spawn("_ddp", tmp_path)
    assert ranks[0]["schedule"] == ranks[1]["schedule"]  # one plan, solved on rank 0
    for r, res in enumerate(ranks):
        assert res["recomputed"] > 0
        assert res["step_alone"] == res["predicted"]  # the simulator is exact on CPU
        # what DDP adds to the step is within what the budget set aside for it (ddp_reserved_bytes)
        assert res["peak"] <= res["predicted"] + res["reserved"] <= res["budget"], (r, res)
        assert res["peak"] - res["step_alone"] >= res["buckets"]  # the buckets are really there
        assert res["same_as_ref"], (r, res["param_diff"])
        assert "DistributedDataParallel(remat.optimize(model" in res["wrapped_error"]
        assert res["infeasible_min"] == ranks[0]["infeasible_min"] > 1000
    assert ranks[0]["mismatch"] is None and "rank 1 traced graph" in ranks[1]["mismatch"]


def test_fsdp2_blocks_planned_before_sharding_fit_the_budget_per_rank(tmp_path):
    ranks = _spawn("_fsdp", tmp_path)
    for r, res in enumerate(ranks):
        assert res["level"] == ranks[0]["level"] and all(n > 0 for n in res["recomputed"])
        assert res["hows"] == ["saved plan"] + ["the step of an equal module"] * 2, res["hows"]
        assert max(res["peaks"]) <= res["bound"] <= res["budget"], (r, res)
        assert max(res["peaks"]) < min(res["ref_peaks"])
        assert res["same_as_ref"], (r, res["param_diff"])
        assert "fully_shard_with_remat" in res["wrapped_error"]
        assert res["big_same"] and res["big_warnings"] == ["BlockBudgetWarning"], (r, res["big_warnings"])
