"""Solve time of checkmate on the models people train: Hugging Face decoders shaped like
Llama-3.2-1B, Mistral-7B and Qwen2-1.5B (bf16, built on the meta device, planned with remat's
fake-tensor capture for device "cuda", batch 1, sequence 4096) and torchvision's ResNet-50,
DenseNet-121 and Swin-T (benchmarks/vision_models.py; real tensors on the CPU, batch 8, 224x224).

Budgets: the decoders at 70% and 50% of keep_all's predicted peak, the vision models at 70% and 50%
of their activation memory (above parameters, gradients and other resident bytes). A budget below
the smallest feasible one is solved at the smallest feasible budget instead (the row says so).

Each capture, smallest-feasible search and solve runs in its own process (its RSS is the row's;
a row past --timeout is reported as such, with nothing else made up). Graphs are cached in --graphs.

    python benchmarks/solve_time_models.py                      # every model, both budgets
    python benchmarks/solve_time_models.py --models resnet50 --fracs 0.5
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DECODERS = {
    "llama1b": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", vocab_size=128256, hidden_size=2048,
                    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    tie_word_embeddings=True, rope_theta=500000.0, head_dim=64),
    "mistral7b": dict(cls="MistralForCausalLM", cfg="MistralConfig", vocab_size=32768, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      sliding_window=None),
    "qwen2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config", vocab_size=151936, hidden_size=1536,
                  intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  tie_word_embeddings=True),
}
VISION = ("resnet50", "densenet121", "swin_t")
SEQ, VISION_BATCH = 4096, 8


def capture(name: str, out: Path) -> None:
    """Capture `name`'s training step and write its TrainingGraph to `out`."""
    import torch

    if name in DECODERS:
        import transformers

        spec = dict(DECODERS[name])
        cls, cfg = getattr(transformers, spec.pop("cls")), getattr(transformers, spec.pop("cfg"))
        from remat.graph_capture.fake_capture import capture_without_memory, planned_device

        with torch.device("meta"):
            model = cls(cfg(max_position_embeddings=SEQ, **spec)).to(torch.bfloat16)
        model.train()
        ids = torch.empty(1, SEQ, dtype=torch.long, device="meta")
        g = capture_without_memory(model, (), dict(input_ids=ids, labels=ids, use_cache=False),
                                   device=planned_device("cuda"))
    else:
        sys.path.insert(0, str(HERE))
        import vision_models as vm
        from remat.api import capture as capture_step

        torch.set_num_threads(1)
        g = capture_step(vm.vision_model(name), vm.vision_inputs(VISION_BATCH, 224))
    out.write_text(g.to_json())


def _budget(g, name: str, frac: float) -> int:
    from remat.solver import keep_all

    keep = keep_all.solve(g).predicted_peak_bytes
    if name in DECODERS:
        return int(frac * keep)
    floor = g.resident_bytes + sum(v.kept_bytes for v in g.nodes)
    return int(floor + frac * (keep - floor))


def smallest(path: Path) -> dict:
    """The smallest feasible budget checkmate finds for the graph at `path`, and its time."""
    from remat.core.training_graph import TrainingGraph
    from remat.solver.checkmate.lowest_peak import min_feasible_budget

    g = TrainingGraph.from_json(path.read_text())
    t0 = time.perf_counter()
    mf = min_feasible_budget(g)
    return {"smallest": mf if isinstance(mf, int) else mf[0], "smallest_s": round(time.perf_counter() - t0, 1)}


def solve_row(path: Path, name: str, frac: float, at: int | None) -> dict:
    """checkmate at `frac` of the model's memory (or at `at` bytes) on the graph at `path`."""
    import resource

    from remat.core.training_graph import TrainingGraph
    from remat.solver import checkmate

    g = TrainingGraph.from_json(path.read_text())
    budget = at if at is not None else _budget(g, name, frac)
    t0 = time.perf_counter()
    p = checkmate.solve(g, budget)
    d, total = p.details, max(g.total_cost, 1e-12)
    # the largest model solved: the whole step's relaxation when it was built, else the rows' largest
    rel = d.get("relaxation") or {}
    if not rel:  # the rows' models: "constraints" are their rows ("rows" is how many steps one covers)
        biggest = max((d.get("peak_rows") or {}).get("solves") or [{}], key=lambda e: e.get("variables", 0))
        rel = {"variables": biggest.get("variables"), "rows": biggest.get("constraints")}
    return {"nodes": len(g.nodes), "budget": budget, "s": round(time.perf_counter() - t0, 1), "status": str(p.status),
            "extra": 100 * p.extra_cost / total if p.fits else None,
            "bound": 100 * (p.lower_bound or 0) / total if p.fits else None, "gap": p.gap,
            "vars": rel.get("variables"), "rows": rel.get("rows"),
            "bound_source": d.get("bound_source"),
            "stopped_by": (d.get("certify") or {}).get("stopped_by"),
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}


def _child(args: list[str], timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if r.returncode == 0 and lines else {"error": (r.stderr or "failed").strip()[-300:]}


def _fmt(name: str, frac: float, r: dict, sm: dict) -> str:
    mib = lambda b: f"{b / 2**30:.2f}G" if b else "-"  # noqa: E731
    small = f"{mib(sm.get('smallest'))} ({sm.get('smallest_s', '-')} s)" if "smallest" in sm else sm.get("error", "-")
    if "error" in r:
        return f"{name:12} {frac:4.0%}  {r['error']}; smallest feasible {small}"
    pct = lambda x: "-" if x is None else f"{x:.3f}%"  # noqa: E731
    gap = "-" if r["gap"] is None else f"{100 * r['gap']:.2f}%"
    note = " (at the smallest feasible budget)" if r.get("at_smallest") else ""
    return (f"{name:12} {frac:4.0%} {r['nodes']:6} {r['vars'] or '-':>8} {r['rows'] or '-':>8} {mib(r['budget']):>7} "
            f"{r['s']:7.1f} {r['status']:>10} {pct(r['extra']):>8} {pct(r['bound']):>8} {gap:>7} {r['rss_mib']:7}  "
            f"smallest {small}{note}; bound: {r['bound_source'] or '-'}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join([*DECODERS, *VISION]))
    ap.add_argument("--fracs", default="0.7,0.5")
    ap.add_argument("--graphs", default="/tmp/remat_solve_time_graphs")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--no-smallest", action="store_true", help="skip the smallest-feasible search")
    ap.add_argument("--out", default=str(HERE / "results" / "solve_time_models.txt"))
    ap.add_argument("--child", nargs="+")
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "capture":
            capture(rest[0], Path(rest[1]))
            print("{}")
        elif kind == "smallest":
            print(json.dumps(smallest(Path(rest[0]))))
        else:
            print(json.dumps(solve_row(Path(rest[0]), rest[1], float(rest[2]), int(rest[3]) if rest[3] != "-" else None)))
        return 0
    gdir = Path(a.graphs)
    gdir.mkdir(parents=True, exist_ok=True)
    from remat.machine_info import machine

    lines = [f"machine: {machine()}",
             f"command: python benchmarks/solve_time_models.py --models {a.models} --fracs {a.fracs}",
             "checkmate, default options; extra and bound in % of the step's cost; gap = (extra - bound) / extra",
             "vars/rows: the largest model solved (the whole step's relaxation if built, else the rows' models)",
             "model         budget nodes     vars     rows  budget  solve s     status    extra    bound     gap  RSS MiB"]
    for name in a.models.split(","):
        path = gdir / f"{name}.json"
        if not path.exists():
            r = _child(["capture", name, str(path)], a.timeout)
            if "error" in r:
                lines.append(f"{name:12} capture failed: {r['error']}")
                continue
        sm = {"error": "not searched"} if a.no_smallest else _child(["smallest", str(path)], a.timeout)
        for frac in map(float, a.fracs.split(",")):
            r = _child(["row", str(path), name, str(frac), "-"], a.timeout)
            if r.get("status") == "infeasible" and "smallest" in sm:
                r = _child(["row", str(path), name, str(frac), str(sm["smallest"])], a.timeout)
                r["at_smallest"] = True
            lines.append(_fmt(name, frac, r, sm))
            print(lines[-1], flush=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
