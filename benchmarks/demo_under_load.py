"""Run `remat demo` many times while other CPU-heavy processes run: does it ever crash, and is the
plan the same every time?

    python benchmarks/demo_under_load.py --runs 20 --burners 2 [--out benchmarks/results/demo_under_load.txt]

Each run is a fresh `remat demo --layers 2 --seq 64 --batch 2 --embd 64 --steps 0 --json ...` process;
`--burners` processes spin on the CPU for the whole time. A run's plan is identified by the SHA-256 of
the checkmate row's schedule (written by the demo's --json).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

from remat.machine_info import machine

DEMO_ARGS = ["--layers", "2", "--seq", "64", "--batch", "2", "--embd", "64", "--steps", "0"]


def _burner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _plan_id(path: str) -> str:
    with open(path) as f:
        out = json.load(f)
    cm = [r for r in out["rows"] if r["strategy"] == "checkmate"]
    if not cm:  # refused: the answer is the smallest feasible budget it names
        return "; ".join(n for n in out["notes"] if n.startswith("checkmate")) or "no checkmate row"
    r = cm[0]
    return f"{r.get('schedule_sha256', '?')[:12]} peak={r['predicted_peak_bytes']} extra={r['extra_cost_frac']:.6g}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--burners", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per demo run")
    p.add_argument("--out", default=None, help="also write the report here")
    p.add_argument("demo_args", nargs="*", help="extra arguments for remat demo (after --)")
    a = p.parse_args(argv)
    burners = [_burner() for _ in range(a.burners)]
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(a.runs):
                js = os.path.join(tmp, f"run{i}.json")
                cmd = [sys.executable, "-m", "remat.cli", "demo", *DEMO_ARGS, *a.demo_args, "--json", js]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                wall = time.perf_counter() - t0
                plan = _plan_id(js) if proc.returncode == 0 and os.path.exists(js) else "-"
                err = proc.stderr.strip().splitlines()[-1] if proc.returncode else ""
                results.append((i, proc.returncode, wall, plan, err))
                print(f"run {i:2d}: rc {proc.returncode}  {wall:6.1f} s  {plan}  {err}", flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    crashes = sum(1 for r in results if r[1] != 0)
    plans = collections.Counter(r[3] for r in results if r[1] == 0)
    lines = [f"machine: {machine()}",
             f"remat demo {' '.join(DEMO_ARGS + a.demo_args)}: {a.runs} runs with {a.burners} CPU burners",
             f"crashes: {crashes}/{a.runs}; distinct plans: {len(plans)}"]
    lines += [f"  {n:2d}x {plan}" for plan, n in plans.most_common()]
    walls = sorted(r[2] for r in results)
    lines.append(f"wall per run: median {walls[len(walls) // 2]:.1f} s, max {walls[-1]:.1f} s")
    report = "\n".join(lines)
    print(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(f"run {i:2d}: rc {rc}  {w:6.1f} s  {pl}  {e}" for i, rc, w, pl, e in results))
            f.write("\n" + report + "\n")
    return 1 if crashes else 0


if __name__ == "__main__":
    raise SystemExit(main())
