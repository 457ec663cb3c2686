"""Every strategy a user would compare against, measured side by side on real training steps.

    python benchmarks/compare.py [--models gpt unet resnet mobilenet] [--budgets 6] [--steps 10]
                                 [--compile-budgets 1.0 0.7 0.5 0.3] [--threads 1] [--quick]
                                 [--no-match-peers] [--no-min-peak] [--out benchmarks/results]
                                 [--render]

For each model (the default GPT of remat.default_model, and remat.models' U-Net, ResNet and
MobileNet) the step is captured once (remat.capture) and its budgets are swept from keep_all's
predicted peak down to the smallest feasible one (the lowest peak any strategy reaches, checkmate's
lowest-peak plan included), `--budgets` values evenly spaced. At each budget every remat strategy
(keep_all, equal_spacing, checkmate, chen_greedy, per_block, selective, revolve) is solved with
`remat.solve` on that graph (the call `remat.optimize` makes; InfeasibleBudgetError and revolve's
NotAChainError are recorded as the row's status) and each distinct plan is deployed with
`remat.optimize(model, plan=...)` and measured once. The real peers run as they are:

* eager `torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)` around every block
  (the blocks per_block finds in the graph, e.g. GPT's `h.0` .. `h.3`);
* `torch.utils.checkpoint.checkpoint_sequential(trunk, segments, x, use_reentrant=False)` where
  the model runs a sequential trunk (GPT's `h`, ResNet's `layers`, MobileNet's `features`; the
  U-Net has skip connections and none), for segments 2, ceil(sqrt(n)) and n;
* `torch.compile` (inductor, CPU) with `torch._functorch.config.activation_memory_budget` at each
  `--compile-budgets` value; a compile error is recorded in the row.

Each row: predicted peak (remat rows), measured peak (remat.measure_peak: the profiler's live
tensor bytes on CPU plus parameters, buffers and inputs), predicted and measured extra FLOPs
(remat.count_flops of the step, minus the keep_all module's for remat rows and the eager model's
for peers), step time (median of `--steps` steps after one warm-up; process CPU time, which the
other processes of a shared machine disturb less than wall-clock time, with the wall-clock median
beside it), its ratio to keep_all (whose steps alternate with the row's, so that drift in the
machine's load weighs on both) and to the row's own base (keep_all for
remat, the unmodified eager model for checkpoint peers, torch.compile at budget 1.0 for compile
rows), the predicted time ratio (1 + extra cost / step cost, remat's default FLOP cost model) and
the same schedule's on the graph captured again with `cost_model="measured"` (each op timed on this
machine, graph_capture/op_timing.py; the notes give both models' largest and mean |pred/meas - 1|),
solve time, MIP
gap, and whether loss and gradients equal the unmodified model's (dropout on, the same seed before
each step; "exact" bit for bit, "ok" allclose(rtol=1e-5, atol=1e-6), else "DIFF" with the largest
error). Inductor draws dropout masks from its own generator (torch._inductor.config.fallback_random
False, the default), so a compile row's gradients differ from eager's wherever dropout is on; each
compile row is therefore also checked compiled again with fallback_random=True (eager's generator,
the same masks): "same masks" in the peer table, which tells a different random stream from a
wrong gradient (a mask recomputed in the backward differently from the forward's).
benchmarks/amb_dropout_grads.py checks the default configuration (Inductor's generator) the other
way: each budget's gradients against budget 1.0's at the same seed.

Checkmate is also solved at each peer's measured peak (`--no-match-peers` skips it), and each .md
ends with "checkmate against each peer": the two at the same memory, measured extra FLOPs, peak,
gradients and time. Where checkmate's plan recomputes as many FLOPs as the peer or more (its
default objective weighs bytes moved too, as time does), it is solved again with extra FLOPs as
its only objective (flop_floor.py's) and measured as "checkmate (FLOP objective)"; the table
compares the peer with whichever of the two recomputes fewer measured FLOPs.

Results per model: compare_<model>.csv (with the machine line, the command and the notes as `#`
lines), .md and .png (extra step time over each strategy's own base vs measured peak, one curve
per strategy) under `--out`; `--render` rewrites the .md and .png from the CSV. `--quick` (a
smoke test, under 2 minutes): tiny models, 3 budgets, checkmate with a 5 s time limit, no
min-peak MILP, no peer matching, torch.compile at one budget on the ResNet only, with the
aot_eager_decomp_partition backend (the same partitioner and memory budget, without inductor's
code generation).
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import math
import os
import platform
import statistics
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import torch
import torch.nn as nn

import remat
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.models import build_mobilenet, build_resnet, build_unet, mobilenet_inputs, resnet_inputs, unet_inputs
from remat.report import reference_step, training_step
from remat.solver import get_solver
from remat.core.plan import LOWEST_PEAK
from remat.solver.per_block import find_blocks
from remat.core.plan import InfeasibleBudgetError, Plan
from remat.solver.revolve import NotAChainError
from remat.core.simulator import simulate

from flop_floor import flop_objective  # benchmarks/ (this script's folder) is on sys.path

MiB = 2**20
REMAT = ("keep_all", "equal_spacing", "checkmate", "chen_greedy", "per_block", "selective", "revolve")


# ---- models -----------------------------------------------------------------------------------

def _models(quick: bool) -> dict:
    """name -> (build() -> (model, inputs), description, sequential trunk attribute or None)."""
    if quick:
        gcfg = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64, batch_size=2)
        return {
            "gpt": (lambda: (default_model(gcfg), default_inputs(gcfg)), f"default GPT, {gcfg}", "h"),
            "unet": (lambda: (build_unet(width=8, depth=2), unet_inputs(batch=2, size=32)),
                     "U-Net width 8, depth 2, batch 2, 32x32", None),
            "resnet": (lambda: (build_resnet(widths=(8, 16), blocks_per_stage=2), resnet_inputs(batch=4, size=16)),
                       "ResNet widths (8, 16), 2 blocks per stage, batch 4, 16x16", "layers"),
            "mobilenet": (lambda: (build_mobilenet(stem=8, last=64), mobilenet_inputs(batch=2, size=32)),
                          "MobileNet stem 8, last 64, batch 2, 32x32", "features"),
        }
    cfg = GPTConfig()
    return {
        "gpt": (lambda: (default_model(cfg), default_inputs(cfg)), f"default GPT, {cfg}", "h"),
        "unet": (lambda: (build_unet(), unet_inputs()), "U-Net (remat.models defaults: width 16, depth 3, "
                 "batch 2, 3x64x64, 4 classes, dropout 0.1)", None),
        "resnet": (lambda: (build_resnet(), resnet_inputs()), "ResNet (remat.models defaults: widths "
                   "(16, 32, 64), 2 blocks per stage, batch 16, 3x32x32, dropout 0.1)", "layers"),
        "mobilenet": (lambda: (build_mobilenet(), mobilenet_inputs()), "MobileNet (remat.models defaults: "
                      "stem 16, 8 inverted residual blocks, last 256, batch 8, 3x64x64, dropout 0.2)", "features"),
    }


# ---- rows and measurement -----------------------------------------------------------------------

@dataclass
class Row:
    model: str
    strategy: str  # remat strategy name or peer description
    family: str  # "remat", "remat@peer" (checkmate at a peer's measured peak), "peer"
    curve: str  # what the plot joins into one line
    budget_bytes: int | None = None
    status: str = ""
    predicted_peak: int | None = None
    measured_peak: int | None = None
    pred_xflops: int | None = None
    meas_xflops: int | None = None
    pred_time_ratio: float | None = None
    pred_time_ratio_measured: float | None = None  # the schedule judged on the measured-cost graph
    cpu_s: float | None = None  # median process CPU time of a step
    wall_s: float | None = None  # median wall-clock time of a step
    time_ratio: float | None = None  # median CPU time over keep_all's, timed alternately
    base_ratio: float | None = None  # time_ratio over the row's own base's
    solve_s: float | None = None
    gap: float | None = None
    grads: str = ""
    grads_same_masks: str = ""  # compile rows: grads compiled with fallback_random=True (eager's masks)
    max_grad_err: float | None = None
    note: str = ""
    schedule_sha: str = ""
    base: str = field(default="", repr=False)  # name of the base row (for base_ratio)


def _fresh(params):
    for p in params:
        p.grad = None


def measure(step, params, resident, ref, seed: int, steps: int, keep_step=None) -> dict:
    """Peak, FLOPs, gradients against `ref` (loss, grads) and step times of `step()` (which runs
    loss = ...; loss.backward() and returns the loss), each from a fresh start (no gradients).
    With `keep_step` (keep_all's step) the timed steps alternate with keep_all's, and
    `time_ratio` is the ratio of the two medians: drift in the machine's load weighs on both."""
    _fresh(params)
    torch.manual_seed(seed)
    step()  # warm-up (compiles where torch.compile is involved)
    _fresh(params)
    peak = remat.measure_peak(step, resident=resident)
    _fresh(params)
    flops = remat.count_flops(step)
    _fresh(params)
    torch.manual_seed(seed)
    grads, err = grads_verdict(step().detach(), params, ref)
    times = {"cpu": [], "wall": [], "keep": []}
    for _ in range(steps):
        for fn, key in ((keep_step, "keep"), (step, "cpu")):
            if fn is None:
                continue
            _fresh(params)
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            times[key].append(time.process_time() - c0)
            if key == "cpu":
                times["wall"].append(time.perf_counter() - w0)
    _fresh(params)
    cpu = statistics.median(times["cpu"])
    return {"measured_peak": peak, "flops": flops, "grads": grads, "max_grad_err": err, "cpu_s": cpu,
            "wall_s": statistics.median(times["wall"]),
            "time_ratio": cpu / statistics.median(times["keep"]) if times["keep"] else 1.0}


def grads_verdict(loss, params, ref) -> tuple[str, float]:
    """("exact" | "ok" | "DIFF", largest error) of `loss` and the parameters' gradients against
    `ref` (loss, gradients)."""
    ref_loss, ref_grads = ref
    pairs = [(loss, ref_loss)] + [(p.grad, g) for p, g in zip(params, ref_grads)]
    err = max(float((a - b).abs().max()) if a is not None else math.inf for a, b in pairs)
    ok = all(a is not None and torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
    return ("exact" if err == 0 else "ok" if ok else "DIFF"), err


def same_masks_grads(model: nn.Module, params, inputs, ref, amb: float, backend: str) -> str:
    """The gradients of one seeded step of `model` compiled at activation_memory_budget `amb` with
    torch._inductor.config.fallback_random=True (dropout from eager's generator), against `ref`."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    try:
        with functorch_config.patch(activation_memory_budget=amb), inductor_config.patch(fallback_random=True):
            compiled = torch.compile(model, backend=backend)
            _fresh(params)
            torch.manual_seed(0)
            loss = compiled(*inputs)
            loss.backward()
            verdict, err = grads_verdict(loss.detach(), params, ref)
    except Exception as e:  # recorded, not fatal
        return f"error: {type(e).__name__}"
    finally:
        _fresh(params)
        torch._dynamo.reset()
    return verdict if verdict != "DIFF" else f"DIFF ({err:.1e})"


def _sha(plan: Plan) -> str:
    return hashlib.sha256("\n".join(plan.schedule).encode()).hexdigest()[:12]


# ---- peers ----------------------------------------------------------------------------------------

@contextmanager
def checkpointed_blocks(model: nn.Module, names: list[str]):
    """Each named submodule's forward wrapped in torch.utils.checkpoint (use_reentrant=False)."""
    from torch.utils.checkpoint import checkpoint

    mods = [model.get_submodule(n) for n in names]
    for m in mods:
        orig = m.forward
        m.forward = lambda *a, _f=orig, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    try:
        yield
    finally:
        for m in mods:
            del m.forward


class _Sequential(nn.Module):
    """Runs `mods` (held unregistered) with torch.utils.checkpoint.checkpoint_sequential."""

    def __init__(self, mods: list[nn.Module], segments: int):
        super().__init__()
        self.mods = list(mods)
        self.segments = segments

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint_sequential

        return checkpoint_sequential(self.mods, self.segments, x, use_reentrant=False)


@contextmanager
def sequential_trunk(model: nn.Module, attr: str, segments: int):
    """model.<attr> (a Sequential, or a ModuleList the forward iterates) run by
    checkpoint_sequential with `segments` segments."""
    orig = model._modules[attr]
    wrapped = _Sequential(list(orig), segments)
    model._modules[attr] = nn.ModuleList([wrapped]) if isinstance(orig, nn.ModuleList) else wrapped
    try:
        yield
    finally:
        model._modules[attr] = orig


# ---- one model ------------------------------------------------------------------------------------

def run_model(name: str, build, desc: str, trunk: str | None, a) -> tuple[list[Row], list[str]]:
    say = lambda m: print(f"[{name} {time.strftime('%H:%M:%S')}] {m}", flush=True)  # noqa: E731
    model, inputs = build()
    model.train()
    params = list(model.parameters())
    resident = [*params, *model.buffers(), *[x for x in inputs if isinstance(x, torch.Tensor)]]
    notes: list[str] = []
    say("reference step (eager, seed 0) and capture")
    ref_loss, ref_grads, keep_flops = reference_step(model, inputs, seed=0)
    ref = (ref_loss, ref_grads)
    graph = remat.capture(model, inputs)
    total_cost = graph.total_cost
    say("capture with measured op times (cost_model='measured')")
    timed = remat.capture(model, inputs, cost_model="measured")  # the same graph, costs in ns
    assert timed.fingerprint() == graph.fingerprint(), "the measured-cost graph is not the same graph"
    extra_ns: dict[str, float] = {}  # schedule sha -> extra ns the measured model predicts
    step_ns = timed.meta["cost_timing"].get("first_computation_ns", timed.total_cost)  # every node once
    keep_plan = remat.solve(graph, None, solver="keep_all")
    lows: dict[str, int] = {}
    for s in REMAT[1:]:
        if s == "checkmate":
            continue
        try:
            lows[s] = get_solver(s)(graph, LOWEST_PEAK).predicted_peak_bytes
        except NotAChainError as e:
            notes.append(f"revolve: {e}")
    if a.min_peak:
        from remat.solver.checkmate import min_feasible_budget

        t0 = time.perf_counter()
        lows["checkmate"], low_plan = min_feasible_budget(graph, time_limit_s=a.time_limit, return_plan=True)
        floor = low_plan.details.get("peak_lower_bound")
        notes.append(f"checkmate's smallest feasible budget ({low_plan.details.get('schedule_source')}): "
                     f"{lows['checkmate'] / MiB:.2f} MiB, found in {time.perf_counter() - t0:.1f} s"
                     + ("" if floor is None else f"; no plan peaks below {floor / MiB:.2f} MiB (proven)"))
    notes.append("lowest peak each strategy reaches (MiB): " + ", ".join(f"{k} {v / MiB:.2f}" for k, v in lows.items()))
    hi, lo = keep_plan.predicted_peak_bytes, min(lows.values())
    n = max(a.budgets, 2)
    budgets = [round(hi + (lo - hi) * k / (n - 1)) for k in range(n)]
    say(f"{len(graph.nodes)} nodes; budgets (MiB): {', '.join(f'{b / MiB:.2f}' for b in budgets)}")
    rows: list[Row] = []
    measured: dict[str, dict] = {}
    timer: dict = {}  # keep_all's step, which every timed step alternates with

    def deploy_and_measure(plan: Plan) -> tuple[dict, str]:
        key = _sha(plan)  # one measurement per distinct schedule, whichever strategy made it
        if key in measured:
            return measured[key], ""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = remat.optimize(model, example_inputs=tuple(inputs), plan=plan)
        note = "; ".join(str(w.message)[:120] for w in caught if "budget" in str(w.message))
        step = training_step(opt, params, inputs)
        m = measure(step, params, resident, ref, 0, a.steps, keep_step=timer.get("keep_all"))
        m["predicted_peak"] = opt.plan.predicted_peak_bytes
        timer.setdefault("keep_all", step)  # the first plan measured is keep_all's
        measured[key] = m
        return m, note

    def remat_row(strategy: str, budget: int | None, family: str = "remat", curve: str | None = None,
                  solve_on=None, label: str | None = None, **kw) -> Row:
        """One remat row: `strategy`'s plan at `budget`, deployed and measured; `solve_on`: solve on
        this graph instead (the same graph with other costs), the plan judged on the capture's."""
        row = Row(model=name, strategy=label or strategy, family=family, curve=curve or strategy,
                  budget_bytes=budget, base="keep_all")
        t0 = time.perf_counter()
        try:
            plan = remat.solve(solve_on or graph, budget, solver=strategy,
                               time_limit_s=a.time_limit if strategy == "checkmate" else None, **kw)
        except InfeasibleBudgetError as e:
            row.status, row.note = "infeasible", f"smallest feasible {e.min_feasible_bytes / MiB:.2f} MiB"
            row.solve_s = time.perf_counter() - t0
            return row
        except NotAChainError:
            row.status, row.note = "not a chain", "NotAChainError (see notes)"
            return row
        row.solve_s = plan.solve_time_s
        row.status, row.gap = plan.status, plan.gap
        row.pred_xflops = plan.extra_flops
        row.pred_time_ratio = 1 + (plan.extra_cost if solve_on is None else
                                   simulate(graph, list(plan.schedule)).extra_cost) / total_cost
        row.schedule_sha = _sha(plan)
        extra_ns[row.schedule_sha] = simulate(timed, list(plan.schedule)).extra_cost
        row.pred_time_ratio_measured = 1 + extra_ns[row.schedule_sha] / step_ns
        m, note = deploy_and_measure(plan)
        row.note = note
        row.predicted_peak = m["predicted_peak"]
        row.measured_peak, row.meas_xflops = m["measured_peak"], m["flops"] - keep_flops
        row.cpu_s, row.wall_s, row.grads, row.max_grad_err = m["cpu_s"], m["wall_s"], m["grads"], m["max_grad_err"]
        row.time_ratio = m["time_ratio"]
        return row

    say("keep_all")
    rows.append(remat_row("keep_all", None))
    not_chain = False
    for strategy in REMAT[1:]:
        for b in budgets:
            if strategy == "revolve" and not_chain:
                break
            say(f"{strategy} at {b / MiB:.2f} MiB")
            row = remat_row(strategy, b)
            rows.append(row)
            not_chain = not_chain or row.status == "not a chain"

    # ---- peers
    def peer_row(label: str, curve: str, base: str, ctx_factory, step_factory=None, per_step: bool = False) -> Row:
        """A peer measured like the remat rows. `ctx_factory()` sets it up around the measurement,
        or, with `per_step`, around each of its steps (a peer that changes the model's modules:
        keep_all's steps, alternating with its own, need the model as traced)."""
        say(label)
        row = Row(model=name, strategy=label, family="peer", curve=curve, base=base)
        try:
            with nullcontext() if per_step else ctx_factory():
                step = step_factory() if step_factory else training_step(model, params, inputs)
                if per_step:
                    inner = step

                    def step():
                        with ctx_factory():
                            return inner()

                m = measure(step, params, resident, ref, 0, a.steps, keep_step=timer["keep_all"])
        except Exception as e:  # a peer that fails (e.g. torch.compile) is recorded, not fatal
            row.status = "error"
            row.note = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            return row
        row.status = "measured"
        row.measured_peak, row.meas_xflops = m["measured_peak"], m["flops"] - eager_flops
        row.cpu_s, row.wall_s, row.grads, row.max_grad_err = m["cpu_s"], m["wall_s"], m["grads"], m["max_grad_err"]
        row.time_ratio = m["time_ratio"]
        return row

    _fresh(params)
    eager_flops = remat.count_flops(training_step(model, params, inputs))
    rows.append(peer_row("eager (no checkpointing)", "eager", "eager (no checkpointing)", nullcontext))
    blocks = list(find_blocks(graph))
    if blocks:
        rows.append(peer_row(f"torch checkpoint per block ({len(blocks)})", "torch checkpoint per block",
                             "eager (no checkpointing)", lambda: checkpointed_blocks(model, blocks), per_step=True))
    else:
        notes.append("no repeated blocks: no torch.utils.checkpoint per-block row")
    if trunk is not None:
        count = len(model._modules[trunk])
        for seg in sorted({2, math.ceil(math.sqrt(count)), count}):
            rows.append(peer_row(f"checkpoint_sequential({trunk}, {seg})", "checkpoint_sequential",
                                 "eager (no checkpointing)", lambda seg=seg: sequential_trunk(model, trunk, seg),
                                 per_step=True))
    else:
        notes.append("not sequential (skip connections): no checkpoint_sequential row")
    import torch._functorch.config as functorch_config

    quick_compile = "resnet" if "resnet" in a.models else a.models[0]
    comp_budgets = a.compile_budgets if (not a.quick or name == quick_compile) else []
    for amb in comp_budgets:
        torch._dynamo.reset()

        def compiled_step():
            compiled = torch.compile(model, backend=a.compile_backend)

            def step():
                loss = compiled(*inputs)
                loss.backward()
                return loss

            return step

        tag = "" if a.compile_backend == "inductor" else f" ({a.compile_backend})"
        rows.append(peer_row(f"torch.compile{tag} amb={amb:g}", "torch.compile activation_memory_budget",
                             f"torch.compile{tag} amb=1",
                             lambda amb=amb: functorch_config.patch(activation_memory_budget=amb), compiled_step))
        if rows[-1].status == "measured":
            say(f"torch.compile amb={amb:g} again with fallback_random=True: eager's dropout masks")
            rows[-1].grads_same_masks = same_masks_grads(model, params, inputs, ref, amb, a.compile_backend)
    torch._dynamo.reset()

    # ---- checkmate at each peer's measured peak
    keep_row = rows[0]
    if a.match_peers:
        done: dict[int, Row] = {}
        for r in [r for r in rows if r.family == "peer" and r.measured_peak and not r.strategy.startswith("eager")]:
            b = r.measured_peak
            if b in done:
                continue
            if b >= keep_row.measured_peak:
                notes.append(f"{r.strategy} peaks at or above keep_all ({b / MiB:.2f} MiB): checkmate at its peak "
                             f"is keep_all's plan (no recomputation)")
                continue
            say(f"checkmate at {r.strategy}'s measured peak {b / MiB:.2f} MiB")
            done[b] = remat_row("checkmate", b, family="remat@peer", curve="checkmate")
            done[b].note = (done[b].note + f" at the measured peak of {r.strategy}").strip()
            rows.append(done[b])
            c = done[b]
            if c.meas_xflops and r.meas_xflops is not None and c.meas_xflops >= r.meas_xflops:
                # the default objective (FLOPs plus bytes moved: time) recomputes more FLOPs than the
                # peer here: solve again with FLOPs as the only objective (flop_floor.py's)
                say(f"checkmate (FLOP objective) at {r.strategy}'s measured peak {b / MiB:.2f} MiB")
                f = remat_row("checkmate", b, family="remat@peer", curve="checkmate (FLOP objective)",
                              solve_on=flop_objective(graph), label="checkmate (FLOP objective)")
                f.note = (f.note + f" at the measured peak of {r.strategy}; objective: extra FLOPs only").strip()
                rows.append(f)

    compile_rows = [r for r in rows if r.strategy.startswith("torch.compile") and r.grads]
    if compile_rows:
        diff = [r.strategy for r in compile_rows if r.grads == "DIFF"]
        wrong = [r.strategy for r in compile_rows if r.grads_same_masks.startswith(("DIFF", "error"))]
        notes.append("torch.compile rows: " + (
            f"gradients differ from eager in {', '.join(diff)} (Inductor draws dropout masks from its own "
            "generator: torch._inductor.config.fallback_random=False, the default)" if diff else
            "gradients equal eager's") + "; compiled again with fallback_random=True (eager's masks): " + (
            f"gradients still differ (or the check failed) in {', '.join(wrong)}" if wrong else
            "every row's gradients equal eager's") + "; measured on the steps after a warm-up (compiling) step")

    # ---- ratios to each row's own base (keep_all, the eager model, torch.compile at budget 1)
    by_name = {r.strategy: r for r in rows if r.time_ratio}
    keep = by_name["keep_all"]
    for r in rows:
        base = by_name.get(r.base)
        if r.time_ratio and base is not None:
            r.base_ratio = r.time_ratio / base.time_ratio
    notes.append(timed_note(timed))
    notes.append(disagreement_note(rows, extra_ns, keep.cpu_s))
    notes.insert(0, f"keep_all: predicted peak {keep.predicted_peak / MiB:.2f} MiB, measured "
                    f"{keep.measured_peak / MiB:.2f} MiB, step {keep.cpu_s * 1e3:.0f} ms CPU "
                    f"({keep.wall_s * 1e3:.0f} ms wall); "
                    f"eager model {by_name['eager (no checkpointing)'].cpu_s * 1e3:.0f} ms CPU")
    return rows, notes


def timed_note(timed) -> str:
    """One line: how the measured-cost graph was timed, and the sum of its ops' times."""
    t = timed.meta.get("cost_timing", {})
    est = t.get("estimated_nodes", [])
    return (f"measured cost model: {len(timed.nodes)} nodes, {t.get('signatures')} distinct op calls timed on "
            f"{t.get('device')} ({t.get('warmup')} warm-up runs, median of {t.get('repeats')}, torch threads "
            f"{t.get('torch_threads')}, {t.get('seconds')} s); sum of op times "
            f"{t.get('first_computation_ns', timed.total_cost) / 1e6:.1f} ms"
            + (f"; {len(est)} nodes priced by the FLOP model: {', '.join(est[:5])}" if est else ""))


def disagreement(rows: list[Row], pred: str) -> tuple[float, float, int, int] | None:
    """(largest, mean |pred/meas - 1|, count, how many over 10%) over the distinct schedules of the
    remat rows that were measured, keep_all's own schedule left out (its ratios are 1 by
    construction); `pred` names the Row field holding the prediction."""
    keep = next((r.schedule_sha for r in rows if r.strategy == "keep_all"), None)
    seen: dict[str, float] = {}
    for r in rows:
        p = getattr(r, pred)
        if r.family.startswith("remat") and r.schedule_sha and r.schedule_sha != keep and p and r.time_ratio:
            seen.setdefault(r.schedule_sha, abs(p / r.time_ratio - 1))
    if not seen:
        return None
    errs = list(seen.values())
    return max(errs), sum(errs) / len(errs), len(errs), sum(e > 0.10 for e in errs)


def disagreement_note(rows: list[Row], extra_ns: dict[str, float] | None = None,
                      keep_cpu_s: float | None = None) -> str:
    """One line: how far the predicted time ratios are from the measured ones (time/keep), for the
    FLOP cost model ("time pred") and the measured one ("time pred (measured)"); with `extra_ns`,
    also the measured model's extra nanoseconds over keep_all's measured step time (the step
    spends time outside the ops too: Python, autograd, the allocator)."""
    parts = []
    for label, field_name in (("FLOP model (time pred)", "pred_time_ratio"),
                              ("measured model (time pred (measured))", "pred_time_ratio_measured")):
        d = disagreement(rows, field_name)
        parts.append(f"{label}: " + ("no schedule to compare" if d is None else
                                      f"largest {d[0]:.1%}, mean {d[1]:.1%} over {d[2]} distinct schedules, "
                                      f"{d[3]} over 10%"))
    if extra_ns and keep_cpu_s:
        over_step = [dataclasses_replace(r, pred_time_ratio=1 + extra_ns[r.schedule_sha] / (keep_cpu_s * 1e9))
                     for r in rows if r.schedule_sha in extra_ns]
        d = disagreement(over_step, "pred_time_ratio")
        if d is not None:
            parts.append(f"measured model's extra time over keep_all's measured step time: largest {d[0]:.1%}, "
                         f"mean {d[1]:.1%}, {d[3]} over 10%")
    return "time prediction vs measurement, |pred/meas - 1|: " + "; ".join(parts)


# ---- output ---------------------------------------------------------------------------------------

def machine() -> str:
    """One line: platform, cores, threads, torch version, load."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
            f"torch {torch.__version__}, python {platform.python_version()}, {platform.platform()}, "
            f"load average at start {load}")


def _mib(x):
    return "-" if x is None else f"{x / MiB:.2f}"


def _g(x):
    return "-" if x is None else f"{x / 1e9:.3f}"


def _r(x):
    return "-" if x is None else f"{x:.3f}"


COLUMNS = ["strategy", "budget MiB", "status", "pred MiB", "meas MiB", "meas/keep", "xFLOP pred G", "xFLOP meas G",
           "time pred", "time pred (measured)", "time/keep", "time/base", "step ms (cpu/wall)", "solve s", "gap",
           "grads", "note"]


def _cells(r: Row, keep_peak: int) -> list[str]:
    grads = r.grads if r.grads != "DIFF" else f"DIFF ({r.max_grad_err:.1e})"
    return [r.strategy + (" @peer" if r.family == "remat@peer" else ""), _mib(r.budget_bytes), r.status,
            _mib(r.predicted_peak), _mib(r.measured_peak),
            "-" if r.measured_peak is None else f"{r.measured_peak / keep_peak:.3f}", _g(r.pred_xflops),
            _g(r.meas_xflops), _r(r.pred_time_ratio), _r(r.pred_time_ratio_measured), _r(r.time_ratio),
            _r(r.base_ratio),
            "-" if r.cpu_s is None else f"{r.cpu_s * 1e3:.0f}/{r.wall_s * 1e3:.0f}",
            "-" if r.solve_s is None else f"{r.solve_s:.2f}", "-" if r.gap is None else f"{r.gap:.2g}",
            grads or "-", r.note.replace("|", "/")]


def write_results(out: Path, name: str, desc: str, rows: list[Row], notes: list[str], head: list[str]) -> None:
    keep_peak = next(r.measured_peak for r in rows if r.strategy == "keep_all")
    lines = [f"# {name}: strategies side by side", "", *[f"    {h}" for h in head], f"    model: {desc}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(r, keep_peak)) + " |" for r in rows]
    lines += ["", "time pred: 1 + extra cost / step cost (remat's cost model); time pred (measured): the same "
              "schedule judged by the simulator on the measured-cost graph (remat.capture(..., "
              "cost_model='measured'): each op's median time on this machine, as recomputed), 1 + extra ns / sum "
              "of the first computations' ns; "
              "time/keep: median CPU time of a step "
              "over keep_all's, their steps alternating; time/base: over the row's own base (keep_all for remat "
              "rows, the eager model for checkpoint peers, torch.compile at budget 1.0 for compile rows). "
              "xFLOP: matmul-like FLOPs of "
              "recomputation (count_flops minus keep_all's, or minus the eager model's for peers).", ""]
    lines += [f"* {n}" for n in notes]
    lines += ["", "## checkmate against each peer, at the peer's measured peak", "",
              *peer_summary(rows)]
    lines += ["", "## checkmate against the best baseline, at each budget of the sweep", "",
              *baseline_summary(rows)]
    (out / f"compare_{name}.md").write_text("\n".join(lines) + "\n")
    with open(out / f"compare_{name}.csv", "w", newline="") as f:
        for h in head:
            f.write(f"# {h}\n")
        f.write(f"# model: {desc}\n")
        for n in notes:
            f.write(f"# note: {n}\n")
        w = csv.writer(f)
        names = [x.name for x in fields(Row)]
        w.writerow(names)
        for r in rows:
            w.writerow([getattr(r, k) for k in names])
    _plot(out / f"compare_{name}.png", name, rows, head[0])


def peer_summary(rows: list[Row]) -> list[str]:
    """Markdown lines: for each peer, checkmate solved at the peer's measured peak (the
    "remat@peer" rows; keep_all where the peer peaks at or above it) against the peer: measured
    peak, measured extra FLOPs, gradients and step time over each one's own base."""
    keep = next(r for r in rows if r.strategy == "keep_all")
    at: dict[int, Row] = {}  # budget -> its checkmate row (of two measured: the one recomputing fewer FLOPs)
    for r in (r for r in rows if r.family == "remat@peer"):
        best = at.get(r.budget_bytes)
        if best is None or (r.measured_peak is not None and (r.meas_xflops or 0) < (best.meas_xflops or 0)):
            at[r.budget_bytes] = r
    head = ["peer", "peer MiB", "peer xFLOP G", "peer time/base", "peer grads", "checkmate MiB",
            "checkmate xFLOP G", "checkmate time/keep", "checkmate grads", "verdict"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for p in rows:
        if p.family != "peer" or p.strategy.startswith("eager"):
            continue
        if p.measured_peak is None:
            out.append(f"| {p.strategy} | - | - | - | - | - | - | - | - | peer failed: {p.note[:80]} |")
            continue
        c = keep if p.measured_peak >= keep.measured_peak else at.get(p.measured_peak)
        if c is None:
            verdict = "not compared (--no-match-peers)"
        elif c.measured_peak is None:
            verdict = f"checkmate cannot reach this peak ({c.status}: {c.note})"
        else:
            dx = (p.meas_xflops or 0) - (c.meas_xflops or 0)
            wins = [c.measured_peak <= p.measured_peak, dx > 0, c.grads == "exact"]
            rel = f"{c.meas_xflops / p.meas_xflops:.0%} of the peer's" if p.meas_xflops else "peer recomputes no FLOPs"
            more = f"{abs(dx) / 1e9:.3f} GFLOP {'fewer' if dx >= 0 else 'more'} extra FLOPs ({rel})"
            verdict = ("beats it" if all(wins) else "ties" if dx == 0 and wins[0] else "does not beat it") + \
                f": {more}, peak {(c.measured_peak - p.measured_peak) / MiB:+.2f} MiB" + \
                ("" if c.strategy in ("checkmate", "keep_all") else f" ({c.strategy})")
            if p.grads_same_masks.startswith("DIFF"):  # benchmarks/amb_dropout_grads.py: Inductor's own RNG too
                verdict += ("; the peer's gradients are wrong with fallback_random=True (eager's masks in the "
                            "forward, others in its recomputation)")
        cm = c if c is not None and c.measured_peak is not None else None
        out.append("| " + " | ".join([
            p.strategy, _mib(p.measured_peak), _g(p.meas_xflops), _r(p.base_ratio),
            (p.grads or "-") + (f" (same masks: {p.grads_same_masks})" if p.grads_same_masks else ""),
            _mib(cm.measured_peak) if cm else "-", _g(cm.meas_xflops) if cm else "-",
            _r(cm.time_ratio) if cm else "-", (cm.grads if cm else "-") or "-", verdict]) + " |")
    return out


def baseline_summary(rows: list[Row]) -> list[str]:
    """Markdown lines: at each budget of the sweep where checkmate has a plan, its measured extra
    FLOPs and time/keep against the baseline (a remat strategy other than keep_all and checkmate)
    that recomputes the fewest measured FLOPs there."""
    head = ["budget MiB", "checkmate xFLOP G", "checkmate time/keep", "best baseline", "its xFLOP G",
            "its time/keep", "checkmate's FLOPs less by"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    sweep = [r for r in rows if r.family == "remat" and r.budget_bytes is not None and r.measured_peak is not None]
    for c in (r for r in sweep if r.strategy == "checkmate"):
        others = [r for r in sweep if r.budget_bytes == c.budget_bytes and r.strategy not in ("checkmate", "keep_all")]
        if not others:
            out.append(f"| {_mib(c.budget_bytes)} | {_g(c.meas_xflops)} | {_r(c.time_ratio)} | no baseline fits | "
                       "- | - | - |")
            continue
        b = min(others, key=lambda r: (r.meas_xflops, r.time_ratio or 0))
        less = (b.meas_xflops - c.meas_xflops) / 1e9
        out.append(f"| {_mib(c.budget_bytes)} | {_g(c.meas_xflops)} | {_r(c.time_ratio)} | {b.strategy} | "
                   f"{_g(b.meas_xflops)} | {_r(b.time_ratio)} | {less:.3f} GFLOP"
                   + (f" ({less * 1e9 / b.meas_xflops:.0%} of its)" if b.meas_xflops else "") + " |")
    return out


def render(out: Path) -> None:
    """Rewrite compare_<model>.md and .png from compare_<model>.csv (e.g. after changing the
    report's layout); notes come from the CSV, or from the existing .md when the CSV has none."""
    types = {f.name: str(f.type) for f in fields(Row)}
    for path in sorted(out.glob("compare_*.csv")):
        name = path.stem[len("compare_"):]
        comments = [ln[2:].rstrip("\n") for ln in path.read_text().splitlines() if ln.startswith("# ")]
        head = [c for c in comments if c.startswith(("machine:", "command:"))]
        desc = next(c[len("model: "):] for c in comments if c.startswith("model: "))
        notes = [c[len("note: "):] for c in comments if c.startswith("note: ")]
        if not notes and (out / f"compare_{name}.md").exists():
            md = (out / f"compare_{name}.md").read_text().split("## checkmate against each peer")[0]
            notes = [ln[2:] for ln in md.splitlines() if ln.startswith("* ")]
        rows = []
        with open(path, newline="") as f:
            for d in csv.DictReader(ln for ln in f if not ln.startswith("#")):
                kw = {}
                for k, v in d.items():
                    t = types[k]
                    kw[k] = (None if v == "" and "None" in t else int(v) if t.startswith("int") else
                             float(v) if t.startswith("float") else v)
                rows.append(Row(**kw))
        write_results(out, name, desc, rows, notes, head)
        print(f"rewrote {out / f'compare_{name}.md'} and .png")


def _plot(path: Path, name: str, rows: list[Row], head: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.measured_peak is None or r.base_ratio is None:
            continue
        curves.setdefault(r.curve, []).append((r.measured_peak / MiB, 100 * (r.base_ratio - 1)))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    markers = "os^vD<>pP*Xh"
    for k, (curve, pts) in enumerate(sorted(curves.items())):
        pts = sorted(set(pts))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[k % len(markers)], label=curve,
                color=plt.get_cmap("tab20")(k % 20), linestyle="-" if len(pts) > 1 else "none")
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("extra step time over the strategy's own base (%)")
    ax.set_title(f"{name}: extra step time vs measured peak\n{head[:110]}", fontsize=9)
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt", "unet", "resnet", "mobilenet"],
                    choices=["gpt", "unet", "resnet", "mobilenet"])
    ap.add_argument("--budgets", type=int, default=6, help="budgets from keep_all's peak to the smallest feasible")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row (median; at least 10 is sensible)")
    ap.add_argument("--compile-budgets", type=float, nargs="*", default=[1.0, 0.7, 0.5, 0.3])
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend (--quick: aot_eager_decomp_partition, the same partitioner without "
                         "inductor's code generation, which takes a minute per model on CPU)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier times on a shared machine)")
    ap.add_argument("--time-limit", type=float, default=None, help="wall-clock limit on each checkmate MILP")
    ap.add_argument("--no-min-peak", dest="min_peak", action="store_false",
                    help="skip checkmate's lowest-peak search when choosing the smallest budget")
    ap.add_argument("--no-match-peers", dest="match_peers", action="store_false",
                    help="do not solve checkmate at each peer's measured peak")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny models, 3 budgets, < 2 minutes")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the .md and .png files from the CSV files under --out")
    a = ap.parse_args()
    if a.render:
        render(Path(a.out))
        return 0
    if a.quick:
        a.budgets, a.match_peers, a.min_peak = min(a.budgets, 3), False, False
        a.time_limit = a.time_limit or 5.0
        a.compile_budgets = a.compile_budgets[-2:-1] or a.compile_budgets
        a.compile_backend = "aot_eager_decomp_partition"
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    models = _models(a.quick)
    for name in a.models:
        build, desc, trunk = models[name]
        t0 = time.perf_counter()
        head = [machine(), f"command: python benchmarks/compare.py {' '.join(sys.argv[1:])}".rstrip()]
        rows, notes = run_model(name, build, desc, trunk, a)
        notes.append(f"wall time for this model: {time.perf_counter() - t0:.0f} s")
        write_results(out, name, desc, rows, notes, head)
        print((out / f"compare_{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
