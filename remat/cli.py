"""Command line: `remat demo` (the main job on the built-in GPT) and `remat plan` (solve once for
it, save the plan); for your own model (remat/cli_offline.py) `remat solve` (plan once, save the
plan file), `remat inspect` (read it), `remat check` (deploy it here and measure) and
`remat max-batch` (the largest batch whose plan fits).

Every argument is checked while parsing, before anything is traced or solved: a bad value ends
the run with one line on stderr (`remat demo: error: ...`) and exit code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from remat.default_model import GPTConfig, default_inputs, default_model
from remat.machine_info import MiB, machine
from remat.plan_file import plan_context
from remat.report import format_table, reference_step, run_strategy
from remat.graph_capture import progress
from remat.solver import STRATEGIES
from remat.runtime.partition import PlanMismatchError
from remat.solver.plan import InfeasibleBudgetError, PlanFileError
from remat.validate import RematArgumentError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block): `remat demo: error: ...`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# argparse types: each raises ArgumentTypeError, which argparse reports as "argument --x: <message>"
def _number(s: str) -> float:
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return x


def _int_at_least(lowest: int, what: str):
    """An argparse type: an integer >= `lowest`, described as `what` in the error."""

    def parse(s: str) -> int:
        try:
            n = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if n < lowest:
            raise argparse.ArgumentTypeError(f"expected {what}, got {n}")
        return n

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_count = _int_at_least(0, "a non-negative integer")


def _positive(s: str) -> float:
    x = _number(s)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s}")
    return x


def _fraction(s: str) -> float:
    x = _number(s)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {s}")
    return x


def _probability(s: str) -> float:
    x = _number(s)
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"expected a dropout probability in [0, 1), got {s}")
    return x


def _output_file(s: str) -> str:
    """A file we will be able to write at the end: its folder exists and is writable, so a typo
    fails now and not after minutes of solving."""
    folder = os.path.dirname(os.path.abspath(s))
    if os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"{s!r} is a directory; give a file name")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"the directory {folder!r} is not writable")
    return s


def _config(a: argparse.Namespace) -> GPTConfig:
    return GPTConfig(n_layer=a.layers, block_size=a.seq, batch_size=a.batch, n_embd=a.embd,
                     n_head=a.heads, dropout=a.dropout, attn_dropout=a.attn_dropout, attention=a.attention)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=_positive_int, default=4)
    p.add_argument("--seq", type=_positive_int, default=256, help="sequence length")
    p.add_argument("--batch", type=_positive_int, default=8)
    p.add_argument("--embd", type=_positive_int, default=128, help="width (divisible by --heads, even per head)")
    p.add_argument("--heads", type=_positive_int, default=4)
    p.add_argument("--dropout", type=_probability, default=0.1)
    p.add_argument("--budget-frac", type=_fraction, default=0.5,
                   help="budget as a fraction of keep_all's measured peak, in (0, 1] (default 0.5)")
    p.add_argument("--budget-mib", type=_positive, default=None,
                   help="absolute budget in MiB (overrides --budget-frac)")
    p.add_argument("--time-limit", type=_positive, default=None,
                   help="optional wall-clock limit on the MILP, seconds (default: none; the solver's "
                        "deterministic work limits alone, so the plan does not depend on machine load)")
    p.add_argument("--attention", choices=["explicit", "sdpa"], default="explicit",
                   help="how the model spells attention (default: explicit softmax(QK^T)V)")
    p.add_argument("--attn-dropout", type=_probability, default=None,
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


def _say(msg: str) -> None:
    print(msg, flush=True)


@contextmanager
def _step(msg: str) -> Iterator[None]:
    """Print what is about to take a while, then how long it took."""
    _say(f"{msg} ...")
    t0 = time.perf_counter()
    yield
    _say(f"  done in {time.perf_counter() - t0:.1f} s")


def demo(a: argparse.Namespace) -> int:
    cfg = _config(a)
    model = default_model(cfg)
    inputs = default_inputs(cfg)
    _say(f"remat demo: GPT {cfg.n_layer} layers, seq {cfg.block_size}, batch {cfg.batch_size}, "
         f"width {cfg.n_embd}, dropout {cfg.dropout}, {cfg.attention} attention, fused attention: "
         f"{a.fused_attention}  [{machine()}]")
    fused = a.fused_attention
    with _step("reference: one step of the unmodified model, and the FLOPs of a step that recomputes nothing"):
        ref = reference_step(model, inputs, seed=0, fused_attention=fused)
    with _step("keep_all: capturing the training step and measuring its peak"):
        rows = [run_strategy(model, inputs, "keep_all", None, reference=ref, fused_attention=fused)]
    keep_peak = rows[0].measured_peak_bytes
    budget = int(a.budget_mib * MiB) if a.budget_mib else int(a.budget_frac * keep_peak)
    _say(f"keep_all measured peak {keep_peak / MiB:.2f} MiB; budget {budget / MiB:.2f} MiB")
    notes = []
    for strategy in ("equal_spacing", "checkmate"):
        what = (f"checkmate: capturing, solving the MILP ({_limit_text(a.time_limit)}), measuring"
                if strategy == "checkmate" else f"{strategy}: capturing, planning, measuring")
        _say(f"{what} ...")
        t0 = time.perf_counter()
        try:
            row = run_strategy(model, inputs, strategy, budget, reference=ref, time_limit_s=a.time_limit,
                               fused_attention=fused)
        except InfeasibleBudgetError as e:
            notes.append(f"{strategy}: infeasible: {e}")
            _say(f"  {notes[-1]}")
            continue
        rows.append(row)
        _say(f"  {row.status}: predicted peak {row.predicted_peak_bytes / MiB:.2f} MiB, measured "
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


def plan_cmd(a: argparse.Namespace) -> int:
    from remat.api import capture, solve

    cfg = _config(a)
    model = default_model(cfg)
    inputs = default_inputs(cfg)
    if a.budget_mib:
        budget = int(a.budget_mib * MiB)
    else:
        with _step("keep_all: capturing the training step and measuring its peak"):
            keep = run_strategy(model, inputs, "keep_all", None, fused_attention=a.fused_attention).measured_peak_bytes
        budget = int(a.budget_frac * keep)
    with _step("capturing the training step"):
        graph = capture(model, inputs, fused_attention=a.fused_attention)
    try:
        limit = f", {_limit_text(a.time_limit)}" if a.solver == "checkmate" else ""
        with _step(f"solving {a.solver} under {budget / MiB:.2f} MiB{limit}"):
            plan = solve(graph, budget, solver=a.solver, time_limit_s=a.time_limit)
    except InfeasibleBudgetError as e:
        print(f"infeasible: {e}", file=sys.stderr)
        return 1
    plan = dataclasses.replace(plan, context=plan_context(model, inputs, fused_attention=a.fused_attention,
                                                          solver=a.solver, solver_options={"time_limit_s": a.time_limit}))
    plan.save(a.out)
    print(f"{a.solver}: {plan.status}, predicted peak {plan.predicted_peak_bytes / MiB:.2f} MiB "
          f"(budget {budget / MiB:.2f}), extra cost {plan.extra_cost / graph.total_cost:.1%}, "
          f"solved in {plan.solve_time_s:.1f} s -> {a.out}")
    return 0


def _parser() -> _Parser:
    p = _Parser(prog="remat", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,plan,solve,inspect,check,max-batch}")
    d = sub.add_parser("demo", help="optimize the built-in GPT and compare strategies")
    _model_args(d)
    d.add_argument("--steps", type=_count, default=3, help="training steps with the optimized module")
    d.add_argument("--json", type=_output_file, default=None, help="also write the results here")
    d.set_defaults(fn=demo, parser=d, check=_check_model_args)
    pl = sub.add_parser("plan", help="solve for the built-in GPT and save the plan as JSON")
    _model_args(pl)
    pl.add_argument("--solver", default="checkmate", choices=STRATEGIES)
    pl.add_argument("--out", type=_output_file, default="plan.json", help="where to save the plan (default plan.json)")
    pl.set_defaults(fn=plan_cmd, parser=pl, check=_check_model_args)
    from remat.cli_offline import add_commands  # (imports this module's argument types)

    add_commands(sub)
    for cmd in sub.choices.values():  # every command: progress on stderr unless --quiet
        cmd.add_argument("--quiet", action="store_true",
                         help="no progress lines on stderr for long captures and solves")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run a command (`remat demo`, `plan`, `solve`, `inspect`, `check`, `max-batch`) with `argv`
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
