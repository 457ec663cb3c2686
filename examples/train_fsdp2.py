"""Sharded training (FSDP2) with remat: each block planned before it is sharded, per-rank budget.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py            # CPU (gloo), or one GPU per rank (NCCL)
    torchrun --nproc-per-node 2 examples/train_fsdp2.py --budget-mb 3

torchtitan's order: activation checkpointing per transformer block, then `fully_shard` on every
block and on the root. `fully_shard_with_remat` does both, choosing the blocks' plans from one
calibration step so that each rank's peak stays under the budget (README: Beyond one device).
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import remat
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.distributed import fully_shard_with_remat


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-mb", type=float, default=None, help="peak per rank (default: 70%% of FSDP2 alone)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets rank, world size and address
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=64, dropout=0.1, batch_size=8)
    idx, targets = default_inputs(cfg, seed=1 + rank, device=device)  # each rank its own batch
    local = lambda m: [p.to_local() for p in m.parameters()] + [idx, targets]  # noqa: E731 (this rank's shards)

    budget = None if args.budget_mb is None else int(args.budget_mb * 2**20)
    if budget is None:  # for the demo: 70% of what FSDP2 alone peaks at, measured on a sharded copy
        plain = default_model(cfg).to(device)
        for block in plain.h:
            fully_shard(block)
        fully_shard(plain)
        eager = remat.measure_peak(lambda: plain(idx, targets).backward(), resident=local(plain), device=device)
        budget = int(0.7 * eager)
        del plain

    model = default_model(cfg).to(device)  # same initial weights on every rank
    sharded = fully_shard_with_remat(model, model.h, budget_bytes=budget, example_inputs=(idx, targets),
                                     solve_on_rank=0)  # plans every block, shards blocks and root
    if rank == 0:
        print(f"level {sharded.level + 1}/{sharded.levels}: per-rank peak at most {sharded.bound_bytes / 2**20:.2f} "
              f"MiB (budget {budget / 2**20:.2f} MiB), {len(sharded.plans[0].recomputed)} values recomputed per block")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for step in range(args.steps):
        optim.zero_grad(set_to_none=True)
        peak = remat.measure_peak(lambda: model(idx, targets).backward(), resident=local(model), device=device)
        optim.step()
        if rank == 0:
            print(f"step {step}: peak {peak / 2**20:.2f} MiB per rank, budget {budget / 2**20:.2f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
