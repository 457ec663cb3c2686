"""Plans of every strategy on a fixed set of graphs, as hashes: run it at two commits and compare, to
show that a refactoring left the solver's answers byte-identical.

    python benchmarks/plan_identity.py [--out FILE]
    PYTHONPATH=/path/to/other/checkout python benchmarks/plan_identity.py --out other.txt   # another commit
    diff FILE other.txt

The graphs are the test suite's hand-made ones (tests/conftest.py: Checkmate's chains, random DAGs,
the GPT-like graph) and four captured models (a 2-layer GPT, the U-Net, ResNet and MobileNet of
remat.models at small sizes). Every strategy of remat.solver.STRATEGIES is asked for a plan at
keep_all's peak and at 80%, 60% and 40% of it; each line is a case and a hash of the plan's
schedule, status, predicted peak and extra cost (or the error's type); with `--details` also its
lower bound, gap and details (every timing left out: keys ending in `_s`, and `s`), so a change to
how a strategy reports its plan shows too. `--strategies a,b` limits the strategies asked. The
graphs come from the checkout remat is imported from, so the script runs on commits before `core/`
existed too.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path



def _graphs():
    import torch

    import remat

    root = Path(remat.__file__).resolve().parents[1]  # the checkout remat is imported from (PYTHONPATH)
    sys.path.insert(0, str(root))
    from tests.conftest import random_dag, training_chain, transformer_like

    from remat.default_model import GPTConfig, default_inputs, default_model
    from remat.models import build_mobilenet, build_resnet, build_unet, mobilenet_inputs, resnet_inputs, unet_inputs

    out = {f"chain{n}-{s}": training_chain(n, seed=s) for n in (4, 8, 16) for s in (0, 1)}
    out |= {f"dag{n}-{s}": random_dag(n, seed=s) for n in (8, 20) for s in (0, 1)}
    out["transformer4"] = transformer_like(4)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64, batch_size=2)
    models = {"gpt": (default_model(cfg), default_inputs(cfg)),
              "unet": (build_unet(width=8, depth=2), unet_inputs(batch=2, size=32)),
              "resnet": (build_resnet(widths=(8, 16), blocks_per_stage=2), resnet_inputs(batch=4, size=16)),
              "mobilenet": (build_mobilenet(stem=8, last=64), mobilenet_inputs(batch=2, size=32))}
    for name, (model, inputs) in models.items():
        out[name] = remat.capture(model, inputs, quiet=True)
    return out


def _untimed(x):
    """`x` without its timings (wall-clock seconds differ from run to run)."""
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if not (k == "s" or k.endswith("_s"))}
    if isinstance(x, (list, tuple)):
        return [_untimed(v) for v in x]
    return x


def _line(case: str, plan_or_error, details: bool = False) -> str:
    if isinstance(plan_or_error, BaseException):
        return f"{case}  error {type(plan_or_error).__name__}"
    p = plan_or_error
    fields = [p.schedule, str(p.status), p.predicted_peak_bytes, p.extra_cost]
    if details:
        fields += [p.lower_bound, p.gap, _untimed(p.details)]
    blob = json.dumps(fields, sort_keys=True, default=str)
    return f"{case}  {hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the lines to this file")
    ap.add_argument("--details", action="store_true", help="hash the bound, gap and details too (no timings)")
    ap.add_argument("--strategies", default=None, help="comma-separated strategies (default: all)")
    a = ap.parse_args(argv)
    from remat.solver import STRATEGIES, get_solver

    strategies = a.strategies.split(",") if a.strategies else STRATEGIES

    lines = []
    for gname, graph in _graphs().items():
        keep = get_solver("keep_all")(graph, None).predicted_peak_bytes
        for strategy in strategies:
            for frac in (1.0, 0.8, 0.6, 0.4):
                case = f"{gname} {strategy} {frac}"
                try:
                    result = get_solver(strategy)(graph, int(frac * keep))
                except Exception as e:  # NotAChainError and the like are answers too
                    result = e
                lines.append(_line(case, result, a.details))
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
