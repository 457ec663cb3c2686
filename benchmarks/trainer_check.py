"""Hugging Face's Trainer on a remat module against the Trainer on the unmodified model.

    python benchmarks/trainer_check.py [--steps 8] [--frac 0.8] [--solver checkmate] [--out benchmarks/results]

Tiny LLaMA (causal LM, DataCollatorForLanguageModeling) and BERT (sequence classification,
DataCollatorWithPadding), dropout 0.1, default TrainingArguments but for batch 4, `--steps`
optimizer steps, gradient accumulation 1 and 4, a dataset of 3 to 16 tokens per row padded per
batch to a multiple of 8 (tests/framework_loops.py). The remat module is planned for the largest
call the Trainer makes (4 x 16 tokens, with `num_items_in_batch`) at `--frac` of keep_all's peak
there. Per run: the losses the two Trainers logged, their largest difference, the largest
parameter difference after the last step, how each kind of call was planned, and for every
padded shape the Trainer passed, one step's peak measured (`remat.measure_peak`) against its
plan's prediction and the budget. Writes trainer_check.txt.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.framework_loops, from the repository root

import remat  # noqa: E402
from remat.machine_info import machine  # noqa: E402
from remat.solver import keep_all  # noqa: E402
from tests.framework_loops import MAX_LEN, example_batch, hf_pair, trainer_run  # noqa: E402


def _call(kind: str, batch: int, length: int) -> dict:
    """A Trainer-like call of `batch` rows padded to `length` tokens, with num_items_in_batch."""
    full = example_batch(kind, batch)
    call = {k: v[:, :length].contiguous() if v.dim() == 2 else v for k, v in full.items()}
    call["num_items_in_batch"] = (call["labels"] != -100).sum()  # as the Trainer counts it
    return call


def run(kind: str, accumulation: int, steps: int, frac: float, solver: str) -> list[str]:
    model, ref = hf_pair(kind, dropout=0.1)
    example = _call(kind, 4, MAX_LEN)
    peak = keep_all.solve(remat.capture(model, (), example, quiet=True)).predicted_peak_bytes
    budget = int(frac * peak)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.OutsideBudgetWarning)  # the logits are returned too
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=(), example_kwargs=example, quiet=True,
                             solver=solver)
    losses, params = trainer_run(opt, kind, steps=steps, accumulation=accumulation)
    ref_losses, ref_params = trainer_run(ref, kind, steps=steps, accumulation=accumulation)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_diff = max((a - b).abs().max().item() for a, b in zip(params, ref_params))
    peaks = []
    for length in (8, 16):
        call = _call(kind, 4, length)
        opt.plan_for(**call)
        for p in model.parameters():
            p.grad = None
        measured = remat.measure_peak(lambda: opt(**call).loss.backward(), resident=[model, *call.values()])
        peaks.append(f"{length} tok: {measured / 2**20:.3f}/{opt.plan.predicted_peak_bytes / 2**20:.3f} MiB "
                     f"({'<=' if measured <= budget else '>'} budget)")
    hows = "; ".join(sorted({r.how.split(" (")[0].replace("reused the schedule of inputs", "reused") for r in opt.plan_log}))
    return [f"{kind:6s} {accumulation:3d}  {len(losses):5d}  {losses[0]:.4f}/{losses[-1]:.4f}  "
            f"{ref_losses[0]:.4f}/{ref_losses[-1]:.4f}  {loss_diff:9.1e}  {param_diff:10.1e}  "
            f"{budget / 2**20:7.3f}  {', '.join(peaks)}  | {len(opt.plan_log)} calls planned: {hows}"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--frac", type=float, default=0.8)
    ap.add_argument("--solver", default="checkmate")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    lines = [f"machine: {machine()}, torch {torch.__version__}, transformers {transformers.__version__}",
             f"command: python benchmarks/trainer_check.py --steps {a.steps} --frac {a.frac} --solver {a.solver}",
             f"Trainer, default TrainingArguments (batch 4, {a.steps} steps), rows of 3-{MAX_LEN} tokens padded to a "
             f"multiple of 8, dropout 0.1; budget {a.frac:.0%} of keep_all at 4 x {MAX_LEN} with num_items_in_batch",
             "model  acc  steps  remat loss 1st/last  eager loss 1st/last  loss diff  param diff  budget MiB  "
             "peak measured/predicted per padded shape"]
    for kind, acc in [("llama", 1), ("llama", 4), ("bert", 1), ("bert", 4)]:
        lines += run(kind, acc, a.steps, a.frac, a.solver)
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer_check.txt").write_text(text)


if __name__ == "__main__":
    main()
