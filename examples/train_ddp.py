"""Data-parallel training with remat: every rank trains the same plan under a per-rank budget.

    torchrun --nproc-per-node 2 examples/train_ddp.py              # CPU (gloo), or one GPU per rank (NCCL)
    torchrun --nproc-per-node 2 examples/train_ddp.py --budget-mb 3

remat plans the model, DDP wraps remat's module (not the other way round). Rank 0 solves and
broadcasts the plan (`solve_on_rank=0`); the budget per rank covers the step and DDP's gradient
buckets, which DDP keeps allocated for the whole run.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import remat
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.distributed import ddp_reserved_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-mb", type=float, default=None, help="peak per rank (default: 70%% of no remat)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets rank, world size and address
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=64, dropout=0.1, batch_size=8)
    model = default_model(cfg).to(device)  # same weights everywhere (DDP also broadcasts rank 0's)
    idx, targets = default_inputs(cfg, seed=1 + rank, device=device)  # each rank its own batch

    reserved = ddp_reserved_bytes(model)  # DDP's gradient buckets (twice: rebuilt once) and a bit more
    if args.budget_mb is not None:
        budget = int(args.budget_mb * 2**20)
    else:  # for the demo: 70% of the step without remat, plus the buckets
        keep = remat.solve(remat.capture(model, (idx, targets)), None, solver="keep_all")
        budget = int(0.7 * keep.predicted_peak_bytes) + reserved
    opt = remat.optimize(model, budget_bytes=budget - reserved, example_inputs=(idx, targets),
                         solve_on_rank=0)  # rank 0 solves, every rank deploys the same plan
    ddp = DDP(opt, device_ids=[device.index] if cuda else None)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for step in range(args.steps):
        optim.zero_grad(set_to_none=True)
        peak = remat.measure_peak(lambda: ddp(idx, targets).backward(), resident=[model, idx, targets],
                                  device=device)
        optim.step()
        if not cuda:  # the CPU profiler sees only the step: add DDP's buckets, allocated before it
            peak += sum(p.numel() * p.element_size() for p in model.parameters())
            if step == 1:  # DDP re-allocates its buckets in this forward; the profiler sees the new
                continue   # ones but not the old ones freed, so it over-counts this step by that much
        if rank == 0:
            print(f"step {step}: peak {peak / 2**20:.2f} MiB per rank, budget {budget / 2**20:.2f} MiB, "
                  f"{len(opt.plan.recomputed)} values recomputed")
    if rank == 0:
        opt.plan.save("plan_ddp.json")  # later runs: remat.optimize(..., plan=remat.Plan.load("plan_ddp.json"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
