"""Command line: `remat demo` (the main job on the built-in GPT); for your own model, or the
built-in GPT by default (remat/cli_offline.py), `remat solve` (alias `remat plan`: plan once, save
the plan file), `remat inspect` (read it), `remat check` (deploy it here and measure) and
`remat max-batch` (the largest batch whose plan fits).

Every argument is checked while parsing, before anything is traced or solved: a bad value ends
the run with one line on stderr (`remat demo: error: ...`) and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from remat.cli_args import Parser, count, fraction, output_file, positive, positive_int, probability, say, step
from remat.cli_offline import add_commands
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.machine_info import MiB, machine
from remat.report import format_table, reference_step, run_strategy
from remat.core import progress
from remat.core.plan import PlanMismatchError
from remat.core.plan import InfeasibleBudgetError, PlanFileError
from remat.validate import RematArgumentError

__all__ = ["main"]


def _config(a: argparse.Namespace) -> GPTConfig:
    return GPTConfig(n_layer=a.layers, block_size=a.seq, batch_size=a.batch, n_embd=a.embd,
                     n_head=a.heads, dropout=a.dropout, attn_dropout=a.attn_dropout, attention=a.attention)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--seq", type=positive_int, default=256, help="sequence length")
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--embd", type=positive_int, default=128, help="width (divisible by --heads, even per head)")
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--dropout", type=probability, default=0.1)
    p.add_argument("--budget-frac", type=fraction, default=0.5,
                   help="budget as a fraction of keep_all's measured peak, in (0, 1] (default 0.5)")
    p.add_argument("--budget-mib", type=positive, default=None,
                   help="absolute budget in MiB (overrides --budget-frac)")
    p.add_argument("--time-limit", type=positive, default=None,
                   help="optional wall-clock limit on the MILP, seconds (default: none; the solver's "
                        "deterministic work limits alone, so the plan does not depend on machine load)")
    p.add_argument("--attention", choices=["explicit", "sdpa"], default="explicit",
                   help="how the model spells attention (default: explicit softmax(QK^T)V)")
    p.add_argument("--attn-dropout", type=probability, default=None,
                   help="dropout on attention probs (default: --dropout)")
    p.add_argument("--fused-attention", choices=["exact", "all", "off"], default="exact",
                   help="attention run as remat's flash op: 'exact' where it computes the same function "
                        "(no attention dropout), 'all' also with attention dropout (remat's own masks), "
                        "'off' never (default: exact)")


def _check_model_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """What one argument alone cannot say: the width must split into heads of even size, and the
    budget in MiB must come to at least a byte."""
    if a.embd % a.heads:
        p.error(f"--embd {a.embd} is not divisible by --heads {a.heads} (each head gets embd / heads channels)")
    if (a.embd // a.heads) % 2:
        p.error(f"--embd {a.embd} / --heads {a.heads} = {a.embd // a.heads} channels per head; it must be even")
    if a.budget_mib is not None and int(a.budget_mib * MiB) < 1:
        p.error(f"argument --budget-mib: {a.budget_mib:g} MiB is less than one byte")
    try:
        _config(a)
    except ValueError as e:  # anything else GPTConfig refuses
        p.error(str(e))


def _limit_text(limit: float | None) -> str:
    return "deterministic work limits" if limit is None else f"time limit {limit:g} s"


def demo(a: argparse.Namespace) -> int:
    cfg = _config(a)
    model = default_model(cfg)
    inputs = default_inputs(cfg)
    say(f"remat demo: GPT {cfg.n_layer} layers, seq {cfg.block_size}, batch {cfg.batch_size}, "
         f"width {cfg.n_embd}, dropout {cfg.dropout}, {cfg.attention} attention, fused attention: "
         f"{a.fused_attention}  [{machine()}]")
    fused = a.fused_attention
    with step("reference: one step of the unmodified model, and the FLOPs of a step that recomputes nothing"):
        ref = reference_step(model, inputs, seed=0, fused_attention=fused)
    with step("keep_all: capturing the training step and measuring its peak"):
        rows = [run_strategy(model, inputs, "keep_all", None, reference=ref, fused_attention=fused)]
    keep_peak = rows[0].measured_peak_bytes
    budget = int(a.budget_mib * MiB) if a.budget_mib else int(a.budget_frac * keep_peak)
    say(f"keep_all measured peak {keep_peak / MiB:.2f} MiB; budget {budget / MiB:.2f} MiB")
    notes = []
    for strategy in ("equal_spacing", "checkmate"):
        what = (f"checkmate: capturing, solving the MILP ({_limit_text(a.time_limit)}), measuring"
                if strategy == "checkmate" else f"{strategy}: capturing, planning, measuring")
        say(f"{what} ...")
        t0 = time.perf_counter()
        try:
            row = run_strategy(model, inputs, strategy, budget, reference=ref, time_limit_s=a.time_limit,
                               fused_attention=fused)
        except InfeasibleBudgetError as e:
            notes.append(f"{strategy}: infeasible: {e}")
            say(f"  {notes[-1]}")
            continue
        rows.append(row)
        say(f"  {row.status}: predicted peak {row.predicted_peak_bytes / MiB:.2f} MiB, measured "
             f"{row.measured_peak_bytes / MiB:.2f} MiB, extra compute {row.extra_cost_frac:.1%}; "
             f"solved in {row.solve_time_s:.1f} s, done in {time.perf_counter() - t0:.1f} s")
    print(format_table(rows, keep_peak))
    for n in notes:
        print(n)
    # train a few steps with the optimized module
    from remat.api import optimize

    cm = [r for r in rows if r.strategy == "checkmate"]
    if a.steps > 0 and cm:
        opt = optimize(model, example_inputs=inputs, plan=cm[0].plan, fused_attention=fused)  # the plan just solved
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(a.steps):
            optim.zero_grad(set_to_none=True)
            loss = opt(*inputs)
            loss.backward()
            optim.step()
            losses.append(round(loss.item(), 4))
        print(f"trained {a.steps} steps with the checkmate module: losses {losses}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "config": vars(cfg), "budget_bytes": budget,
                       "keep_all_peak": keep_peak, "rows": [r.as_dict() for r in rows], "notes": notes}, f, indent=1)
    return 0


def _parser() -> Parser:
    p = Parser(prog="remat", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,solve,inspect,check,max-batch}")
    d = sub.add_parser("demo", help="optimize the built-in GPT and compare strategies")
    _model_args(d)
    d.add_argument("--steps", type=count, default=3, help="training steps with the optimized module")
    d.add_argument("--json", type=output_file, default=None, help="also write the results here")
    d.set_defaults(fn=demo, parser=d, check=_check_model_args)
    add_commands(sub)
    for cmd in dict.fromkeys(sub.choices.values()):  # every command (an alias once): progress unless --quiet
        cmd.add_argument("--quiet", action="store_true",
                         help="no progress lines on stderr for long captures and solves")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run a command (`remat demo`, `solve` (alias `plan`), `inspect`, `check`, `max-batch`) with `argv`
    (None: sys.argv); returns the exit code."""
    a = _parser().parse_args(argv)
    a.check(a.parser, a)
    try:
        with progress.quiet(a.quiet):
            return a.fn(a)
    except (RematArgumentError, PlanFileError) as e:  # checked above already; one line all the same
        a.parser.error(str(e))
        return 2
    except PlanMismatchError as e:  # a plan file for another model, shape or device: what to do, one line
        a.parser.exit(2, f"{a.parser.prog}: error: {e}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
