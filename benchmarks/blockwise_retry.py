"""A user's way to the smallest budget of a model planned block by block: `remat.optimize` under a
share of the eager step's measured peak, refused with an InfeasibleBudgetError, then called again at
the budget that error names. Per model: seconds of each call, and where the second call's time goes
(the blocks' traces, their level plans, their deployment, the calibration steps).

    python benchmarks/blockwise_retry.py [--models time_series_transformer switch_transformers] [--share 0.6]

Models from benchmarks/unseen_models.py (small configs, random weights). A model whose first call
fits the share is reported as such (ask a smaller --share)."""
from __future__ import annotations

import argparse
import collections
import time
import warnings

import torch

import remat
import remat.blockwise as blockwise
from remat.core.plan import InfeasibleBudgetError
from remat.machine_info import machine
from unseen_models import _loss, _models

PHASES = {"_traced": "traces", "plans_at_levels": "level plans", "deployed_as": "deployment", "_measure": "steps"}


def timed_phases() -> dict[str, float]:
    """Seconds spent in each of blockwise's phases (PHASES), counted from now on."""
    spent: dict[str, float] = collections.defaultdict(float)
    for name, label in PHASES.items():
        real = getattr(blockwise, name)

        def wrapper(*a, real=real, label=label, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0
        setattr(blockwise, name, wrapper)
    return spent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["time_series_transformer", "switch_transformers"])
    ap.add_argument("--share", type=float, default=0.6, help="share of the eager step's peak asked first")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(f"machine: {machine()}")
    spent = timed_phases()
    builds = _models()
    for name in a.models:
        torch.manual_seed(0)
        model, kw = builds[name]()
        model.train()
        resident = [model, *(v for v in kw.values() if isinstance(v, torch.Tensor))]
        eager = remat.measure_peak(lambda: _loss(model(**kw)).backward(), resident=resident)
        for p in model.parameters():
            p.grad = None
        spent.clear()
        t0 = time.perf_counter()
        try:
            remat.optimize(model, budget_bytes=int(a.share * eager), example_inputs=(), example_kwargs=kw, quiet=True)
        except InfeasibleBudgetError as e:
            first = time.perf_counter() - t0
            spent.clear()
            t0 = time.perf_counter()
            opt = remat.optimize(model, budget_bytes=e.min_feasible_bytes, example_inputs=(), example_kwargs=kw,
                                 quiet=True)
            second = time.perf_counter() - t0
            parts = ", ".join(f"{k} {spent[k]:.1f}" for k in PHASES.values())
            print(f"{name:<24} refused in {first:5.1f} s; at the budget named ({e.min_feasible_bytes} B) "
                  f"{second:5.1f} s (level {opt.fit.level}; {parts})", flush=True)
            continue
        print(f"{name:<24} fits {a.share} of its eager peak: no refusal to retry", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
