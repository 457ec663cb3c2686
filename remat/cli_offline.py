"""The offline workflow's commands, for the user's own model: `remat solve` (plan once, save the
plan file), `remat inspect` (read it: table and plot), `remat check` (deploy it on this machine and
measure) and `remat max-batch` (the largest batch whose plan fits a budget). remat/cli.py registers
them beside `demo` and `plan`; the work itself is remat/offline.py's.

As everywhere in the CLI, arguments are checked before any work: factories are imported and the
plan file is read (and checked) while parsing, the model is built only after every argument
passed. A bad argument, a damaged plan file or a plan for something else ends the run with one
line on stderr and exit code 2; no plan fitting the budget (solve, max-batch), or a measured peak
over it or gradients that differ from the model's (check), with exit code 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time

import torch

from remat.cli_args import Parser, fraction, output_file, positive, positive_int, say, step
from remat.machine_info import MiB, machine
from remat.offline import (build, capture_graph, check_plan, keep_all_peak, largest_batch, load_factory,
                           takes_batch)
from remat.deployment import check_context, describe_inputs, plan_context
from remat.head_choice import loss_head_of
from remat.solver import STRATEGIES
from remat.core.plan import InfeasibleBudgetError, Plan, PlanFileError
from remat.core.module_summary import module_summary, rollup
from remat.validate import RematArgumentError

__all__ = ["add_commands"]

GB = 10**9


# ---- argument types -----------------------------------------------------------------------------

def _factory(s: str):
    try:
        fn = load_factory(s)
    except RematArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    fn.spec = s  # type: ignore[attr-defined]  (for messages)
    return fn


def _plan_file(s: str) -> Plan:
    try:
        return Plan.load(s)
    except PlanFileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _plan_device(s: str) -> str:
    """The device a plan is made for: it need not be here (fake tensors; graph_capture/fake_capture.py)."""
    if s not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {s!r}")
    return s


def _device(s: str) -> str:
    """A device to run on: it must be here."""
    _plan_device(s)
    if s == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"cuda: this machine has no usable GPU (torch {torch.__version__}); "
                                         f"use --device cpu, or run on a machine with a GPU")
    return s


def _option(s: str) -> tuple[str, object]:
    key, eq, value = s.partition("=")
    if not eq or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected name=value (e.g. backend=cbc), got {s!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a plain string


def _batches(s: str) -> list[str]:
    names = [n for n in s.split(",") if n]
    bad = [n for n in names if n not in STRATEGIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected solvers from {', '.join(STRATEGIES)} separated by commas, got {s!r}")
    return names


# ---- parsers ------------------------------------------------------------------------------------

BUILT_IN = ("remat.offline:default_gpt", "remat.offline:default_gpt_batch")  # solve's default model and inputs
DEFAULT_FRAC = 0.5  # solve's budget when none is given: this fraction of keep_all's predicted peak


def _factories(p: argparse.ArgumentParser, batch_help: str, run: bool = False, built_in: bool = False) -> None:
    model, inputs = BUILT_IN if built_in else (None, None)
    p.add_argument("--model", type=_factory, required=not built_in, default=model, metavar="MODULE:FN",
                   help="returns the nn.Module: my_pkg.models:build_model or path/to/file.py:build_model"
                        + (f" (default: the built-in GPT, {model})" if built_in else ""))
    p.add_argument("--inputs", type=_factory, required=not built_in, default=inputs, metavar="MODULE:FN",
                   help="returns the example inputs: a tensor, a tuple of arguments, a dict of keyword "
                        "arguments, or (args, kwargs)")
    p.add_argument("--batch", type=positive_int, default=None, help=batch_help)
    if run:
        p.add_argument("--device", type=_device, default=None,
                       help="move the model and inputs there and run (cpu or cuda; default: the plan's device)")
    else:
        p.add_argument("--device", type=_plan_device, default=None,
                       help="the device to plan for: cpu or cuda, which need not be here (default: where the "
                            "model's parameters are, cpu for meta)")
    p.add_argument("--fused-attention", choices=["exact", "all", "off"], default=None,
                   help="attention run as remat's flash op (default: exact; check: the plan's)")


def _budget(p: argparse.ArgumentParser, frac_help: str, required: bool = True) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--budget-gb", type=positive, help="budget in GB (10^9 bytes)")
    g.add_argument("--budget-mib", type=positive, help="budget in MiB")
    g.add_argument("--budget-frac", type=fraction, help=frac_help)


def _solver(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunked-loss", choices=["on", "off"], default="off",
                   help="trace a linear head followed by cross-entropy as remat's chunked loss op, which keeps "
                        "no [tokens, vocab] tensor (default off: the model's own head; remat.optimize's "
                        "default 'auto' plans both)")
    p.add_argument("--time-limit", type=positive, default=None,
                   help="optional wall-clock limit on checkmate's MILP, seconds (default: deterministic work limits)")
    p.add_argument("--option", type=_option, action="append", default=[], metavar="NAME=VALUE",
                   help="a solver option (e.g. backend=cbc, coarsen_to=60); repeatable")


def add_commands(sub) -> None:
    """Add solve, inspect, check and max-batch to the CLI's subparsers."""
    s = sub.add_parser("solve", aliases=["plan"],
                       help="plan your model's (default: the built-in GPT's) training step under a budget; save the plan file")
    _factories(s, "call --inputs with this batch size", built_in=True)
    _budget(s, f"budget as a fraction of keep_all's predicted peak, in (0, 1] (default {DEFAULT_FRAC} when no "
               f"budget is given)", required=False)
    s.add_argument("--solver", default="checkmate", choices=STRATEGIES)
    _solver(s)
    s.add_argument("--out", type=output_file, default="plan.json", help="the plan file (default plan.json)")
    s.set_defaults(fn=solve_cmd, parser=s, check=_check_solve)

    i = sub.add_parser("inspect", help="a plan file as a table per module, and a plot of memory over the step")
    i.add_argument("plan", type=_plan_file, help="a plan file (remat solve --out)")
    i.add_argument("--png", type=output_file, default=None, help="save the memory plot here")
    i.add_argument("--depth", type=positive_int, default=None, help="module paths cut to this many parts (h.0)")
    i.add_argument("--top", type=positive_int, default=None, help="only the N modules recomputing most")
    i.set_defaults(fn=inspect_cmd, parser=i, check=lambda p, a: None)

    c = sub.add_parser("check", help="deploy a plan file here: measured vs predicted peak, time, gradients")
    _factories(c, "call --inputs with this batch size", run=True)
    c.add_argument("--plan", type=_plan_file, required=True, help="the plan file to deploy")
    c.add_argument("--steps", type=positive_int, default=3, help="timed steps per module (median; default 3)")
    c.add_argument("--seed", type=int, default=0, help="torch seed for the steps compared (default 0)")
    c.set_defaults(fn=check_cmd, parser=c, check=_check_check)

    m = sub.add_parser("max-batch", help="the largest batch size whose plan fits the budget")
    _factories(m, "with --budget-frac: the batch whose keep_all peak the fraction is of")
    _budget(m, "budget as a fraction of keep_all's predicted peak at --batch")
    m.add_argument("--solver", default="checkmate", choices=STRATEGIES, help="whose plan is saved (default checkmate)")
    m.add_argument("--compare", type=_batches, default=["keep_all"], metavar="S1,S2",
                   help="strategies searched before --solver (default keep_all)")
    _solver(m)
    m.add_argument("--max-batch", type=positive_int, default=1 << 16, help="largest batch tried (default 65536)")
    m.add_argument("--multiple-of", type=positive_int, default=1, help="try only multiples of this (default 1)")
    m.add_argument("--out", type=output_file, default="plan.json",
                   help="where --solver's plan at its largest batch is saved (default plan.json)")
    m.set_defaults(fn=max_batch_cmd, parser=m, check=_check_max_batch)


# ---- checks across arguments (still before any work) ----------------------------------------------

def _check_factories(p: Parser, a: argparse.Namespace) -> None:
    spec = a.inputs.spec
    if a.batch is not None and not takes_batch(a.inputs):
        p.error(f"argument --batch: --inputs {spec} takes no batch size argument")
    if a.batch is None:
        try:
            inspect.signature(a.inputs).bind()
        except TypeError:
            p.error(f"--inputs {spec} needs an argument (the batch size?): give --batch")
        except ValueError:
            pass


def _check_budget(p: Parser, a: argparse.Namespace) -> None:
    if a.budget_mib is not None and int(a.budget_mib * MiB) < 1:
        p.error(f"argument --budget-mib: {a.budget_mib:g} MiB is less than one byte")
    if a.budget_gb is not None and int(a.budget_gb * GB) < 1:
        p.error(f"argument --budget-gb: {a.budget_gb:g} GB is less than one byte")


def _check_solve(p: Parser, a: argparse.Namespace) -> None:
    _check_factories(p, a)
    _check_budget(p, a)
    _check_options(p, a)


def _check_options(p: Parser, a: argparse.Namespace) -> None:
    from remat.validate import check_solver

    for name in [a.solver, *getattr(a, "compare", [])]:
        try:
            check_solver(name, dict(a.option) if name == a.solver else {})
        except RematArgumentError as e:
            p.error(f"argument --option: {e}")


def _check_check(p: Parser, a: argparse.Namespace) -> None:
    _check_factories(p, a)
    dev = a.plan.context.get("device")
    if a.device is None and dev == "cuda" and not torch.cuda.is_available():
        p.error("the plan was solved for cuda, and this machine has no usable GPU: check it where it will "
                "run, or solve for this machine (remat solve --device cpu)")


def _check_max_batch(p: Parser, a: argparse.Namespace) -> None:
    if not takes_batch(a.inputs):
        p.error(f"argument --inputs: {a.inputs.spec} must take the batch size as its argument (e.g. "
                f"def example_batch(batch_size): ...) for max-batch")
    if a.multiple_of > a.max_batch:
        p.error(f"argument --multiple-of: {a.multiple_of} is above --max-batch {a.max_batch}")
    if a.budget_frac is not None and a.batch is None:
        p.error("argument --budget-frac: give --batch, the batch whose keep_all peak the fraction is of")
    _check_budget(p, a)
    _check_options(p, a)


# ---- the commands -------------------------------------------------------------------------------

def _fused(a: argparse.Namespace, default: str = "exact") -> str:
    return a.fused_attention or default


def _budget_bytes(a: argparse.Namespace, keep_peak=None) -> int:
    if a.budget_gb is not None:
        return int(a.budget_gb * GB)
    if a.budget_mib is not None:
        return int(a.budget_mib * MiB)
    return int((a.budget_frac if a.budget_frac is not None else DEFAULT_FRAC) * keep_peak())


def _inputs_text(args, kwargs) -> str:
    return ", ".join(f"{i['arg']} {tuple(i['shape'])} {i['dtype']}" if "shape" in i else f"{i['arg']}={i['value']}"
                     for i in describe_inputs(args, kwargs))


def _top_modules(plan: Plan, n: int = 3) -> str:
    rows = [r for r in rollup(module_summary(plan.graph, plan.schedule), 2) if r["recomputations"]]
    rows.sort(key=lambda r: -r["recomputed_bytes"])
    total = plan.graph.total_cost
    return "; ".join(f"{r['module']} {r['recomputed_bytes'] / MiB:.2f} MiB (+{r['extra_cost'] / total:.1%})"
                     for r in rows[:n])


def _planned_device(a: argparse.Namespace, model) -> str:
    if a.device:
        return a.device
    return "cuda" if any(t.device.type == "cuda" for t in model.parameters()) else "cpu"


def _details(plan: Plan, graph) -> Plan:
    """`plan` with what a plan made on fake tensors records about its graph (estimated
    workspaces, ...)."""
    try:
        from remat.planning import plan_details
    except ImportError:
        return plan
    return dataclasses.replace(plan, details={**plan.details, **plan_details(graph)})


def solve_cmd(a: argparse.Namespace) -> int:
    """remat solve: capture, solve, save the plan file with its context, print a short summary."""
    from remat.api import solve

    fused = _fused(a)
    options = dict(a.option)
    model, args, kwargs = build(a.model, a.inputs, a.batch)
    device = _planned_device(a, model)
    say(f"remat solve: {a.model.spec} on {_inputs_text(args, kwargs)}, for {device}")
    say(f"machine: {machine()}")
    t0 = time.perf_counter()
    graph, how = capture_graph(model, args, kwargs, fused, device, chunked_loss=a.chunked_loss == "on")
    say(f"captured the training step with {how}: {len(graph.nodes)} nodes in {time.perf_counter() - t0:.1f} s"
        + (f"; loss head: {loss_head_of(graph)}" if a.chunked_loss == "on" else ""))
    keep = keep_all_peak(graph)
    budget = _budget_bytes(a, lambda: keep)
    limit = "" if a.solver != "checkmate" else \
        (f", time limit {a.time_limit:g} s" if a.time_limit else ", deterministic work limits")
    try:
        with step(f"solving {a.solver} under {budget / MiB:.2f} MiB (keep_all peaks at {keep / MiB:.2f} MiB){limit}"):
            plan = solve(graph, budget, solver=a.solver, time_limit_s=a.time_limit, **options)
    except InfeasibleBudgetError as e:
        print(f"remat solve: infeasible: {e}", file=sys.stderr)
        return 1
    ctx = plan_context(model, args, kwargs or None, fused_attention=fused, solver=a.solver,
                       solver_options={"time_limit_s": a.time_limit, **options}, device=device)
    ctx["captured_with"], ctx["loss_head"] = how, loss_head_of(graph)
    plan = _details(dataclasses.replace(plan, context=ctx), graph)
    plan.save(a.out)
    gap = "" if plan.gap is None else f", gap {plan.gap:.1%}"
    print(f"{a.solver}: {plan.status}{gap}; predicted peak {plan.predicted_peak_bytes / MiB:.2f} MiB of a "
          f"{budget / MiB:.2f} MiB budget (keep_all {keep / MiB:.2f} MiB, {plan.predicted_peak_bytes / keep:.0%} of it); "
          f"extra compute {plan.extra_cost / graph.total_cost:.1%}; solved in {plan.solve_time_s:.1f} s")
    if plan.recomputed:
        print(f"recomputes {len(plan.recomputed)} values; most in: {_top_modules(plan)}")
    print(f"-> {a.out}   (remat inspect {a.out} [--png memory.png] for the table per module and a plot)")
    return 0


def inspect_cmd(a: argparse.Namespace) -> int:
    """remat inspect: the plan file's summary as text, and the plot with --png."""
    from remat.inspect_plan import NeedsGraphError, plot_timeline, summary_text

    print(summary_text(a.plan, depth=a.depth, top=a.top, name=a.plan.loaded_from or "plan"))
    if a.png:
        try:
            plot_timeline(a.plan, a.png)
        except NeedsGraphError as e:
            a.parser.error(str(e))
        except ImportError:
            a.parser.error("--png needs matplotlib: pip install matplotlib")
        print(f"plot -> {a.png}")
    return 0


def check_cmd(a: argparse.Namespace) -> int:
    """remat check: deploy the plan here, compare measured with predicted, keep_all and eager."""
    plan = a.plan
    ctx = plan.context
    device = a.device or (ctx.get("device") if ctx.get("device") in ("cpu", "cuda") else None)
    fused = _fused(a, ctx.get("fused_attention", "exact"))
    model, args, kwargs = build(a.model, a.inputs, a.batch, device)
    check_context(plan, model, args, kwargs or None, fused)  # another model, shapes, device: one line, exit 2
    say(f"remat check: {plan.loaded_from} ({plan.strategy}, budget "
         f"{'-' if plan.budget_bytes is None else f'{plan.budget_bytes / MiB:.2f} MiB'}) on {a.model.spec}, "
         f"{_inputs_text(args, kwargs)}")
    say(f"machine: {machine()}")
    if ctx.get("torch") and ctx["torch"] != torch.__version__:
        say(f"note: the plan was made with torch {ctx['torch']}, this is {torch.__version__}")
    with step(f"deploying the plan and keep_all, running {a.steps} steps each and the unmodified model"):
        r = check_plan(model, args, kwargs, plan, steps=a.steps, seed=a.seed, fused_attention=fused)
    print(f"graph fingerprint {r.plan.graph.fingerprint()}: the graph the plan was made for")
    w = 10
    print(f"{'':<{w}} {'predicted MiB':>13} {'measured MiB':>12} {'step ms':>9} {'vs keep_all':>11}")
    print(f"{'keep_all':<{w}} {r.keep_all_predicted_bytes / MiB:>13.2f} {r.keep_all_measured_bytes / MiB:>12.2f} "
          f"{r.keep_all_step_s * 1e3:>9.1f} {1.0:>10.2f}x")
    print(f"{'plan':<{w}} {r.predicted_peak_bytes / MiB:>13.2f} {r.measured_peak_bytes / MiB:>12.2f} "
          f"{r.step_s * 1e3:>9.1f} {r.step_s / r.keep_all_step_s:>10.2f}x")
    print(f"{'eager':<{w}} {'':>13} {'':>12} {r.eager_step_s * 1e3:>9.1f} {r.eager_step_s / r.keep_all_step_s:>10.2f}x")
    grads = ("equal the unmodified model's bit for bit" if r.grads_equal else
             f"match the unmodified model's (allclose, max abs error {r.max_grad_err:.2e})" if r.grads_close else
             f"DIFFER from the unmodified model's (max abs error {r.max_grad_err:.2e})")
    print(f"loss and {r.tensors_compared - 1} gradients {grads}")
    code = 0 if r.grads_close else 1
    if plan.budget_bytes is not None:
        ok = r.measured_peak_bytes <= plan.budget_bytes
        print(f"measured peak {r.measured_peak_bytes / MiB:.2f} MiB {'<=' if ok else '>'} budget "
              f"{plan.budget_bytes / MiB:.2f} MiB: {'OK' if ok else 'OVER BUDGET'}")
        code = code if ok else 1
    return code


def max_batch_cmd(a: argparse.Namespace) -> int:
    """remat max-batch: each strategy's largest batch under the budget; --solver's plan saved."""
    fused = _fused(a)
    options = dict(a.option)
    model, _, _ = build(a.model, a.inputs, 1)
    device = _planned_device(a, model)
    graphs: dict[int, tuple] = {}

    def graph_at(b: int):
        if b not in graphs:
            _, args, kwargs = build(a.model, a.inputs, b, model=model)
            graph, _how = capture_graph(model, args, kwargs, fused, device, chunked_loss=a.chunked_loss == "on")
            ctx = plan_context(model, args, kwargs or None, fused_attention=fused, solver=a.solver,
                               solver_options={"time_limit_s": a.time_limit, **options}, device=device)
            ctx["captured_with"], ctx["loss_head"] = _how, loss_head_of(graph)
            graphs[b] = (graph, ctx)
        return graphs[b]

    budget = _budget_bytes(a, lambda: keep_all_peak(graph_at(a.batch)[0]))
    what = f" ({a.budget_frac:g} of keep_all's predicted peak at batch {a.batch})" if a.budget_frac else ""
    say(f"remat max-batch: {a.model.spec}, {a.inputs.spec}(batch), for {device}, budget {budget / MiB:.2f} MiB{what}")
    say(f"machine: {machine()}")
    order = list(dict.fromkeys([*a.compare, a.solver]))
    found, start = [], a.batch or 1
    for s in order:
        say(f"{s}: searching ...")
        r = largest_batch(s, budget, graph_at, start=start, max_batch=a.max_batch, multiple=a.multiple_of,
                          time_limit_s=a.time_limit,
                          options=options if s == a.solver else {}, say=say)
        found.append(r)
        start = max(1, r.batch)
    print(f"{'strategy':<14} {'largest batch':>13} {'predicted MiB':>13} {'extra compute':>13} {'probes':>6} {'time s':>7}")
    for r in found:
        extra = f"{r.plan.extra_cost / r.plan.graph.total_cost:.1%}" if r.plan else "-"
        peak = f"{r.plan.predicted_peak_bytes / MiB:.2f}" if r.plan else "-"
        print(f"{r.strategy:<14} {str(r.batch) + ('+' if r.capped else ''):>13} {peak:>13} {extra:>13} "
              f"{len(r.probes):>6} {r.seconds:>7.1f}")
    keep = next((r for r in found if r.strategy == "keep_all"), None)
    best = found[-1]
    if keep is not None and best is not keep and keep.batch:
        print(f"{best.strategy} fits batch {best.batch}, {best.batch / keep.batch:.2f}x keep_all's {keep.batch}")
    if best.plan is None:
        print(f"{best.strategy}: not even batch 1 fits {budget / MiB:.2f} MiB", file=sys.stderr)
        return 1
    _details(best.plan, best.plan.graph)
    best.plan.save(a.out)
    print(f"{best.strategy}'s plan for batch {best.batch} -> {a.out}")
    return 0
