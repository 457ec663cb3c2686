"""Checkmate's plans and certificates at half of each model's activation memory (or, with
--smallest, at its smallest feasible budget), side by side with another checkout of remat (a
baseline), on the models of benchmarks/compare.py and small Hugging
Face configs (BERT, GPT-2, T5, ViT, Llama, Gemma-2, GPT-NeoX, Qwen2) and torchvision's ResNet-50,
DenseNet-121 and Swin-T (benchmarks/vision_models.py, batch 8 at 224 px); with --more, further
Hugging Face models no other benchmark or test plans (Mistral, Phi, OPT, BART, RoBERTa, DistilBERT, GPT-Neo,
Falcon, BLOOM, GPT-J, StableLM, Gemma, StarCoder2, ELECTRA, ALBERT, DeBERTa-v2; ConvNeXt, ResNet-18, MobileNetV2,
RegNet, DeiT, Swin, EfficientNet-B0, MobileViT, BEiT, SegFormer at 64 px: benchmarks/more_models.py), to check
the solver off the models it was tuned on; with --third, a third set added later for the same check (Qwen3, OLMo,
Phi-3, Granite, GPT-BigCode, CodeGen, Mixtral, XLM-RoBERTa, MPNet, Pegasus, mT5; DINOv2, ConvNeXt-V2,
PoolFormer, CvT, SwinV2, ResNet-50, LeViT); with --fourth, a fourth (UMT5, LongT5, mBART, MarianMT,
Nemotron, Gemma-3, OLMoE, RemBERT); with --fifth, a fifth (DeepSeek-V3, Qwen2-MoE, Mamba2,
ModernBERT, T5Gemma, Hiera, PVTv2, BiT).

Budget: resident bytes (parameters, gradients, kept outputs) plus half of what keep_all holds
above them. Per model and checkout, in its own process on a saved graph: extra cost (% of the
step's cost), the proven lower bound, the gap, wall and CPU seconds (CPU seconds are the fairer
figure on a shared machine), the bound's source, RSS.

    python benchmarks/certificates.py                           # this checkout only
    python benchmarks/certificates.py --baseline /path/to/other/checkout --models bert llama
    python benchmarks/certificates.py --smallest     # at each model's smallest feasible budget
    python benchmarks/certificates.py --third --graphs /tmp/third   # the third set of models
    python benchmarks/certificates.py --fourth --graphs /tmp/fourth   # the fourth
    python benchmarks/certificates.py --fifth --graphs /tmp/fifth   # the fifth
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from more_models import FIFTH_MODELS as FIFTH, FOURTH_MODELS as FOURTH, MORE_MODELS as MORE, THIRD_MODELS as THIRD

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = ("resnet", "unet", "mobilenet", "gpt", "neox", "vit", "bert", "llama", "gpt2", "qwen2s", "gemma2", "t5",
          "resnet50", "densenet121", "swin_t")

CAPTURE = r"""
import sys, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[3])
from remat.api import capture
name = sys.argv[1]
if name in ("gpt", "unet", "resnet", "mobilenet"):
    from remat.default_model import GPTConfig, default_model, default_inputs
    from remat.models import build_mobilenet, build_resnet, build_unet, mobilenet_inputs, resnet_inputs, unet_inputs
    m, x = {"gpt": lambda: (default_model(GPTConfig()), default_inputs(GPTConfig())),
            "unet": lambda: (build_unet(), unet_inputs()), "resnet": lambda: (build_resnet(), resnet_inputs()),
            "mobilenet": lambda: (build_mobilenet(), mobilenet_inputs())}[name]()
    g = capture(m, x)
elif name in ("resnet50", "densenet121", "swin_t"):
    sys.path.insert(0, sys.argv[3] + "/benchmarks")
    import vision_models as vm
    g = capture(vm.vision_model(name), vm.vision_inputs(8, 224))
elif name in ("llama", "gpt2", "bert", "t5", "vit"):
    from tests.hf_models import hf_model, hf_batch
    m = hf_model(name, dropout=0.1, width=128, layers=4, seq=128, image=64)
    g = capture(m, (), example_kwargs=hf_batch(name, batch=8, seq=128, image=64))
elif name in ("gemma2", "neox", "qwen2s"):
    import transformers as tf
    from tests.hf_models import hf_batch
    torch.manual_seed(0)
    small = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_attention_heads=4, max_position_embeddings=128)
    m = {"gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(num_hidden_layers=3, num_key_value_heads=2, head_dim=32, **small)),
         "neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(num_hidden_layers=4, **small)),
         "qwen2s": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(num_hidden_layers=4, num_key_value_heads=2, **small))}[name]()
    m.train()
    g = capture(m, (), example_kwargs=hf_batch("llama", batch=8, seq=128))
else:
    sys.path.insert(0, sys.argv[3] + "/benchmarks")
    from more_models import more_model
    m, kwargs = more_model(name)
    g = capture(m, (), example_kwargs=kwargs)
open(sys.argv[2], "w").write(g.to_json())
"""

SOLVE = r"""
import json, resource, sys, time
from remat.core.training_graph import TrainingGraph
from remat.solver import checkmate, keep_all
g = TrainingGraph.from_json(open(sys.argv[1]).read())
keep = keep_all.solve(g).predicted_peak_bytes
floor = g.resident_bytes + sum(v.kept_bytes for v in g.nodes)
budget = int(floor + float(sys.argv[2]) * (keep - floor))
t, c = time.perf_counter(), time.process_time()
p = checkmate.solve(g, budget)
total = g.total_cost
print(json.dumps({"nodes": len(g.nodes), "s": round(time.perf_counter() - t, 1), "cpu": round(time.process_time() - c, 1),
                  "status": str(p.status), "extra": 100 * p.extra_cost / total, "bound": 100 * (p.lower_bound or 0) / total,
                  "gap": 100 * (p.gap or 0), "fits": p.predicted_peak_bytes <= budget,
                  "source": (p.details.get("bound_source") or "")[:40],
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}))
"""

SMALLEST = r"""
import json, resource, sys, time
from remat.core.training_graph import TrainingGraph
from remat.solver import checkmate, keep_all
g = TrainingGraph.from_json(open(sys.argv[1]).read())
keep = keep_all.solve(g).predicted_peak_bytes
t, c = time.perf_counter(), time.process_time()
budget = checkmate.min_feasible_budget(g)
found = time.perf_counter() - t
p = checkmate.solve(g, budget)
total = g.total_cost
print(json.dumps({"nodes": len(g.nodes), "s": round(time.perf_counter() - t, 1), "cpu": round(time.process_time() - c, 1),
                  "found_s": round(found, 1), "budget_pct": 100 * budget / keep, "status": str(p.status),
                  "extra": 100 * p.extra_cost / total, "gap": 100 * (p.gap or 0), "fits": p.predicted_peak_bytes <= budget,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}))
"""


def _run(code: str, args: list[str], checkout: Path, timeout: float) -> str | None:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    try:
        out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                             timeout=timeout, cwd=checkout)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        raise RuntimeError(f"{args}: {out.stderr[-2000:]}")
    return (out.stdout.strip().splitlines() or [""])[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", choices=MODELS + MORE + THIRD + FOURTH + FIFTH)
    ap.add_argument("--more", action="store_true", help="the models of MORE (unless --models names others)")
    ap.add_argument("--third", action="store_true", help="the models of THIRD (unless --models names others)")
    ap.add_argument("--fourth", action="store_true", help="the models of FOURTH (unless --models names others)")
    ap.add_argument("--fifth", action="store_true", help="the models of FIFTH (unless --models names others)")
    ap.add_argument("--frac", type=float, default=0.5, help="share of the activation memory above resident")
    ap.add_argument("--baseline", type=Path, help="another remat checkout to solve the same graphs with")
    ap.add_argument("--graphs", type=Path, default=Path("/tmp/remat_certificate_graphs"))
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--smallest", action="store_true",
                    help="at each model's smallest feasible budget (min_feasible_budget, then solve there)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    a.models = a.models or list(FIFTH if a.fifth else FOURTH if a.fourth else THIRD if a.third else MORE if a.more else MODELS)
    a.out = a.out or HERE / "results" / ("smallest_budget.txt" if a.smallest else "certificates.txt")
    a.graphs.mkdir(parents=True, exist_ok=True)
    checkouts = [("this", ROOT)] + ([("baseline", a.baseline.resolve())] if a.baseline else [])
    what = ("smallest budget (% of keep_all) / extra / gap / s to find it / s in all (cpu s)" if a.smallest
            else "extra / bound / gap / s (cpu s) / bound from")
    head = "| model | nodes | " + " | ".join(f"{n}: {what}" for n, _ in checkouts) + " |"
    at = "its smallest feasible budget" if a.smallest else f"{a.frac:.0%} of the activation memory"
    flags = (" --smallest" if a.smallest else "") + (" --more" if a.more else "") + (" --third" if a.third else "") + \
        (" --fourth" if a.fourth else "") + (" --fifth" if a.fifth else "") + \
        (" --baseline " + str(a.baseline) if a.baseline else "")
    lines = [f"# checkmate at {at}: `python benchmarks/certificates.py{flags}`",
             f"# machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start, "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "", head, "|" + "---|" * (2 + len(checkouts))]
    print("\n".join(lines), flush=True)
    for name in a.models:
        path = a.graphs / f"{name}.json"
        if not path.exists():
            _run(CAPTURE, [name, str(path), str(ROOT)], ROOT, a.timeout)
        cells, nodes = [], "?"
        for _, checkout in checkouts:
            out = _run(SMALLEST if a.smallest else SOLVE, [str(path), str(a.frac)], checkout, a.timeout)
            if out is None:
                cells.append(f"over {a.timeout:.0f} s")
                continue
            r = json.loads(out)
            nodes = r["nodes"]
            if r["status"].lower().endswith("infeasible"):  # proven: the budget is under every schedule's peak
                cells.append("infeasible (under the smallest feasible budget)")
                continue
            fits = "" if r["fits"] else " OVER BUDGET"
            if a.smallest:
                cells.append(f"{r['budget_pct']:.1f}% / {r['extra']:.3f}% / {r['gap']:.1f}% / {r['found_s']} / "
                             f"{r['s']} ({r['cpu']}){fits}")
                continue
            cells.append(f"{r['extra']:.3f}% / {r['bound']:.3f}% / {r['gap']:.1f}% / {r['s']} ({r['cpu']}) / "
                         f"{r['source'].split(':')[0].split(' (')[0]}{fits}")
        lines.append(f"| {name} | {nodes} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
