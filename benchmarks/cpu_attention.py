#!/usr/bin/env python
"""remat's attention op on the CPU as it runs by default (attention/cpu_flash.py: torch's CPU flash
kernel in float32 and float64, the op's chunked PyTorch reference in 16-bit dtypes) against the
reference (what the op ran on the CPU before; Triton mode "never") and the model's own
`F.scaled_dot_product_attention` (torch's CPU flash kernel itself, at these inputs), forward and
backward, causal, at a few shapes; and the outputs' and gradients' largest difference between the
default and the reference.

    python benchmarks/cpu_attention.py [--reps 5] [--threads N]

Prints one row per shape (B, Hq, Hkv, S, D, dtype): median milliseconds of --reps forward+backward
passes after one warm-up, for each path, and the ratios.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from remat.attention import launch
from remat.attention.op import flash_attention

SHAPES = [  # (B, Hq, Hkv, S, D, dtype)
    (8, 4, 4, 256, 32, torch.float32),  # the default GPT's (remat demo)
    (1, 32, 8, 1024, 64, torch.float32),  # a Llama-shaped layer, grouped-query
    (1, 16, 16, 2048, 64, torch.bfloat16),
]


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}")
    print(f"{'B':>2} {'Hq':>3} {'Hkv':>3} {'S':>5} {'D':>3} {'dtype':>9} | {'op':>9} {'reference':>9} "
          f"{'SDPA':>7} ms | ref/op op/SDPA | max diff out, dq")
    g = torch.Generator().manual_seed(0)
    for B, H, HKV, S, D, dtype in SHAPES:
        q = torch.randn(B, H, S, D, generator=g).to(dtype).requires_grad_()
        k, v = (torch.randn(B, HKV, S, D, generator=g).to(dtype).requires_grad_() for _ in range(2))
        do = torch.randn(B, H, S, D, generator=g).to(dtype)

        def op():
            q.grad = k.grad = v.grad = None
            out = flash_attention(q, k, v, causal=True)
            out.backward(do)
            return out.detach(), q.grad.clone()  # a copy: the next calls replace q.grad

        def sdpa():
            q.grad = k.grad = v.grad = None
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != HKV).backward(do)

        prev = launch.get_triton_mode()
        try:
            launch.set_triton_mode("auto")
            flash_ms, (out_f, dq_f) = _median_ms(op, args.reps), op()
            launch.set_triton_mode("never")  # the op's PyTorch reference
            ref_ms, (out_r, dq_r) = _median_ms(op, args.reps), op()
        finally:
            launch.set_triton_mode(prev)
        sdpa_ms = _median_ms(sdpa, args.reps)
        d_out = float((out_f.float() - out_r.float()).abs().max())
        d_dq = float((dq_f.float() - dq_r.float()).abs().max())
        print(f"{B:>2} {H:>3} {HKV:>3} {S:>5} {D:>3} {str(dtype)[6:]:>9} | {flash_ms:9.1f} {ref_ms:9.1f} {sdpa_ms:7.1f}    | "
              f"{ref_ms / flash_ms:6.2f} {flash_ms / sdpa_ms:7.2f} | {d_out:.1e}, {d_dq:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
