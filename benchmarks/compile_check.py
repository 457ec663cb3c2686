"""Compile every flash-attention kernel variant for an H100/H200 (sm_90) on this machine, no GPU.

    python benchmarks/compile_check.py [--arch 90] [--head-dims 64 128] [--out benchmarks/results]

For each kernel (forward, dK/dV, dQ), dtype (bf16, fp16, fp32), head dim, causal or not, attention
dropout or not, and every launch config the GPU path can use (the autotuner's list; fp32's single
config), Triton compiles the kernel to a cubin with its bundled ptxas. Printed per variant: the
shared memory a block needs (against sm_90's 227 KiB), registers per thread and stack bytes per
thread (> 0: registers spill to local memory, a sign the config will be slow), compile time. This checks that the
GPU path compiles; it says nothing about speed (benchmarks/gpu_check.py measures that on a GPU).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from remat.machine_info import machine
from kernel_compile import SM90_SHARED_LIMIT, all_variants, compile_variant


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    lines = [f"machine: {machine()}", f"target: cuda sm_{a.arch}, shared memory limit {SM90_SHARED_LIMIT} bytes",
             f"{'variant':<58} {'shared B':>9} {'regs':>5} {'stack B':>7} {'compile s':>9}  result"]
    print("\n".join(lines), flush=True)
    rows = []
    for v in all_variants(head_dims=tuple(a.head_dims)):
        r = compile_variant(v, a.arch)
        shared, regs, stack = ("-" if x is None else str(x) for x in (r.shared_bytes, r.registers, r.stack_bytes))
        lines.append(f"{v.label():<58} {shared:>9} {regs:>5} {stack:>7} {r.seconds:>9.1f}  "
                     f"{'ok' if r.ok else 'FAIL ' + str(r.error)}")
        print(lines[-1], flush=True)
        rows.append({"variant": v.label(), "ok": r.ok, "shared_bytes": r.shared_bytes, "registers": r.registers,
                     "stack_bytes": r.stack_bytes, "seconds": r.seconds, "error": r.error})
    failed = sum(not r["ok"] for r in rows)
    spills = sum(bool(r["stack_bytes"]) for r in rows)
    lines.append(f"{len(rows) - failed}/{len(rows)} variants compiled within the shared-memory limit; "
                 f"{spills} spill registers to the stack")
    print(lines[-1])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"compile_check_sm{a.arch}.txt").write_text("\n".join(lines) + "\n")
    (out / f"compile_check_sm{a.arch}.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
