"""How long `fully_shard_with_remat` takes to plan a GPT's blocks, on one CPU process (gloo, world
size 1), and how many blocks were traced to be deployed.

    python benchmarks/fsdp_planning.py [--layers 4 8] [--out benchmarks/results/fsdp_planning_cpu.txt]

Each block is traced once to be planned; a block whose traced step equals an earlier block's runs
that block's compiled step (graph_capture/step_identity.py), so only the distinct ones are traced
again to be deployed. The budget is 60% of the unmodified step's measured peak; the row gives the
planning seconds, the level deployed, its bound and how many blocks were traced to be deployed.
Each row runs in a process of its own (solves are cached within a process: every row's block
graph is the same).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from remat.default_model import GPTConfig, default_inputs, default_model
from remat.distributed import fully_shard_with_remat
from remat.machine_info import machine
from remat.measure import measure_peak


def plan_row(layers: int) -> str:
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=layers, n_head=4, n_embd=128, dropout=0.1, batch_size=8)
    torch.manual_seed(0)
    model = default_model(cfg)
    idx, tgt = default_inputs(cfg, seed=1)
    peak = measure_peak(lambda: model(idx, tgt).backward(), resident=[model, idx, tgt])
    model.zero_grad(set_to_none=True)
    budget = int(0.6 * peak)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded = fully_shard_with_remat(model, model.h, budget_bytes=budget, example_inputs=(idx, tgt), levels=4)
    seconds = time.perf_counter() - t0
    hows = [m.plan_log[0].how for m in model.h]
    traced = sum(h != "the step of an equal module" for h in hows)
    return (f"{layers:6d} {seconds:8.1f} {sharded.level:5d} {sharded.bound_bytes:11d} {budget:11d} "
            f"{traced:3d} of {len(hows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--row", type=int, help=argparse.SUPPRESS)  # one row, in this process
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/fsdp_planning_cpu.txt"))
    args = ap.parse_args()
    if args.row is not None:
        store = tempfile.mktemp(prefix="remat_fsdp_")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            print(plan_row(args.row), flush=True)
        finally:
            dist.destroy_process_group()
        return
    lines = [f"machine: {machine()}", "layers  plan s level     bound B    budget B deployed by a trace", "-" * 62]
    for n in args.layers:
        done = subprocess.run([sys.executable, __file__, "--row", str(n)], capture_output=True, text=True, check=True)
        lines.append(done.stdout.rstrip().splitlines()[-1])
        print(lines[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
