"""How checkmate's certified solver scales: solve time, plan cost, proven lower bound and gap.

    python benchmarks/solve_time.py [--layers 4 12 24 48 96] [--dtypes fp32 bf16] [--flat-limit 600]
                                    [--out benchmarks/results]

Table 1, the spec's GPT: d=768, 12 heads, sequence 1024, batch 8, vocabulary 50304, dropout 0.1,
planned with remat's fake-tensor capture (no step memory allocated) for device cuda, at 50% of
keep_all's predicted peak, in fp32 and in bf16 (the model's parameters and activations in
bfloat16, as `model.to(torch.bfloat16)` trains). Table 2, the default model (4 layers, sequence 256, width 128), captured
for real on the CPU, at 90%, 70% and 50% of keep_all's predicted peak, next to equal_spacing's
plan refined on the fine graph. Each row runs in its own process (its peak RSS is its own), with
checkmate's default options (deterministic work limits, no wall clock). The flat MILP (Checkmate's
MILP on the fine graph, no coarsening) runs on the feasible 4-layer 50% rows under a wall-clock limit
only (no node limit).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SPEC = dict(vocab_size=50304, block_size=1024, n_head=12, n_embd=768, dropout=0.1, batch_size=8)


DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _graph(kind: str, layers: int, dtype: str = "fp32"):
    import torch

    from remat.default_model import GPT, GPTConfig, default_inputs, default_model

    if kind == "spec":
        from remat.graph_capture.fake_capture import capture_without_memory, planned_device

        cfg = GPTConfig(n_layer=layers, **SPEC)
        with torch.device("meta"):
            model = GPT(cfg).to(getattr(torch, DTYPES[dtype]))
        idx = torch.empty(cfg.batch_size, cfg.block_size, dtype=torch.long, device="meta")
        return capture_without_memory(model, (idx, idx), None, device=planned_device("cuda"))
    from remat.api import capture

    cfg = GPTConfig(n_layer=layers, block_size=256, dropout=0.1)
    return capture(default_model(cfg), default_inputs(cfg))


def row(kind: str, layers: int, frac: float, flat_limit: float, dtype: str = "fp32") -> dict:
    """One measurement (run in a fresh process)."""
    from remat.solver import checkmate, equal_spacing, keep_all
    from remat.solver.refine import drop_recomputations
    from remat.core.simulator import simulate

    t0 = time.perf_counter()
    g = _graph(kind, layers, dtype)
    capture_s = time.perf_counter() - t0
    keep = keep_all.solve(g).predicted_peak_bytes
    budget = int(frac * keep)
    t1 = time.perf_counter()
    plan = checkmate.solve(g, budget)
    solve_s = time.perf_counter() - t1
    d = plan.details
    out = {"kind": kind, "dtype": dtype, "layers": layers, "frac": frac, "nodes": len(g.nodes), "budget": budget, "keep_all": keep,
           "total_cost": g.total_cost, "capture_s": capture_s, "solve_s": solve_s, "status": plan.status,
           "extra": plan.extra_cost, "lower_bound": plan.lower_bound, "gap": plan.gap,
           "peak": plan.predicted_peak_bytes, "variables": d.get("relaxation", {}).get("variables"),
           "rows": d.get("relaxation", {}).get("rows"), "certify": d.get("certify"),
           "source": d.get("refined_from"), "proof": d.get("proof"), "peak_floor": d.get("peak_lower_bound"),
           "lowest_peak": d.get("lowest_peak")}
    if kind == "default":
        es = equal_spacing.solve(g, budget)
        if es.fits:
            out["es_refined"] = simulate(g, drop_recomputations(g, es.schedule, budget)).extra_cost
    if layers <= 4 and frac == 0.5 and plan.status != "infeasible" and flat_limit > 0:
        t2 = time.perf_counter()
        # no node limit: only the wall clock stops it (its default node limit stopped it at 498 s)
        flat = checkmate.solve(g, budget, coarsen_to=None, milp="always", certify=False, time_limit_s=flat_limit,
                               max_nodes=10**9)
        fd = flat.details
        out["flat"] = {"s": time.perf_counter() - t2, "status": fd.get("milp_status"),
                       "stopped_by": fd.get("stopped_by"), "plan_extra": (fd.get("milp_plan") or {}).get("extra_cost"),
                       "objective": fd.get("objective"), "bound": fd.get("best_bound"),
                       "binaries": (fd.get("variables") or {}).get("binaries"),
                       "warm_start": (fd.get("baseline") or {}).get("name")}
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _pct(x, total):
    return "-" if x is None else f"{100 * x / total:.3f}%"


def _flat(r) -> str:
    f = r.get("flat")
    if f is None:
        return "not run" if r["layers"] <= 4 else "too large"
    if f["status"] == "optimal":
        return f"optimal {_pct(f['plan_extra'], r['total_cost'])} ({f['s']:.0f} s)"
    ws = f" (warm start: {f['warm_start']})" if f.get("warm_start") else ""
    by = f" by its {f['stopped_by']}" if f.get("stopped_by") else ""
    return (f"stopped{by} at {f['s']:.0f} s: incumbent {_pct(f['plan_extra'], r['total_cost'])}{ws}, "
            f"bound {_pct(f['bound'], r['total_cost'])}")


def table(rows: list[dict]) -> list[str]:
    lines = [f"{'dtype':>5} {'layers':>6} {'budget':>7} {'nodes':>6} {'vars':>7} {'rows':>7} {'solve s':>8} {'status':>10} "
             f"{'extra':>8} {'bound':>8} {'gap':>7} {'RSS MiB':>8}  flat MILP / notes"]
    for r in rows:
        note = _flat(r) if r["layers"] <= 4 else ""
        if r["status"] == "infeasible":
            note = f"infeasible: no plan below {r['peak_floor'] / 2**30:.3f} GiB ({r['peak_floor']} bytes) exists; " \
                   f"lowest plan found {r['lowest_peak']['peak_bytes'] / 2**30:.3f} GiB"
        if r.get("es_refined") is not None:
            note += f"; equal_spacing refined {_pct(r['es_refined'], r['total_cost'])}"
        gap = "-" if r["gap"] is None else f"{100 * r['gap']:.2f}%"
        extra = "-" if r["status"] == "infeasible" else _pct(r["extra"], r["total_cost"])
        lines.append(f"{r.get('dtype', 'fp32'):>5} {r['layers']:>6} {round(100 * r['frac']):>6}% {r['nodes']:>6} {r['variables'] or '-':>7} "
                     f"{r['rows'] or '-':>7} {r['solve_s']:>8.1f} {r['status']:>10} {extra:>8} "
                     f"{_pct(r['lower_bound'], r['total_cost']):>8} {gap:>7} {r['rss_mib']:>8.0f}  {note}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12, 24, 48, 96])
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--flat-limit", type=float, default=600.0, help="wall-clock seconds for the flat MILP (0: skip)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # kind:layers:frac:dtype, run in a child process
    ap.add_argument("--render", action="store_true", help="rewrite solve_time.txt from solve_time.json, no solving")
    a = ap.parse_args()
    out = Path(a.out)
    if a.render:
        saved = json.loads((out / "solve_time.json").read_text())
        return _write(out, saved["machine"], saved["rows"])
    if a.row:
        kind, layers, frac, dtype = a.row.split(":")
        print(json.dumps(row(kind, int(layers), float(frac), a.flat_limit, dtype)))
        return 0
    from remat.machine_info import machine

    jobs = ([("spec", n, 0.5, d) for d in a.dtypes for n in a.layers]
            + [("default", 4, f, "fp32") for f in (0.9, 0.7, 0.5)])
    rows = []
    for kind, n, f, d in jobs:
        res = subprocess.run([sys.executable, __file__, "--row", f"{kind}:{n}:{f}:{d}", "--flat-limit", str(a.flat_limit)],
                             capture_output=True, text=True)
        if res.returncode:
            print(res.stderr[-2000:], file=sys.stderr)
            return res.returncode
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(table([rows[-1]])[-1], flush=True)
    return _write(Path(a.out), machine(), rows)


def _write(out: Path, machine: str, rows: list[dict]) -> int:
    """solve_time.txt and .json under `out`, and the table on stdout."""
    spec = [r for r in rows if r["kind"] == "spec"]
    default = [r for r in rows if r["kind"] == "default"]
    text = [f"machine: {machine}",
            "checkmate, default options (deterministic work limits, mip_gap 1e-4); extra and bound in % of the "
            "step's cost (FLOP-equivalents), gap = (extra - bound) / extra; the bound is proven: no schedule "
            "computing the nodes first in graph order fits the budget at a lower extra cost",
            "", "GPT d=768, 12 heads, seq 1024, batch 8, vocab 50304, dropout 0.1, fp32 and bf16; fake-tensor capture "
            "for cuda (remat.plan's); budget 50% of keep_all's predicted peak:", *table(spec),
            "", "default model (4 layers, seq 256, width 128, dropout 0.1), captured on the CPU; budgets "
            "90/70/50% of keep_all's predicted peak:", *table(default)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "solve_time.txt").write_text("\n".join(text) + "\n")
    (out / "solve_time.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1, default=str))
    print("\n".join(text))
    print(f"wrote {out / 'solve_time.txt'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
