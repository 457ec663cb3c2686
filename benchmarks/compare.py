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
import math
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

import remat
from remat.core.plan import LOWEST_PEAK, InfeasibleBudgetError, Plan
from remat.core.simulator import simulate
from remat.default_model import GPTConfig, default_inputs, default_model
from remat.models import build_mobilenet, build_resnet, build_unet, mobilenet_inputs, resnet_inputs, unet_inputs
from remat.report import reference_step, training_step
from remat.solver import get_solver
from remat.solver.per_block import find_blocks
from remat.solver.revolve import NotAChainError

# benchmarks/ (this script's folder) is on sys.path
from compare_measure import (Row, checkpointed_blocks, fresh, measure, same_masks_grads, schedule_sha,
                             sequential_trunk)
from compare_report import MiB, disagreement_note, machine, render, timed_note, write_results
from flop_floor import flop_objective

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


# ---- one model ------------------------------------------------------------------------------------

class ModelRun:
    """Every row of one model: the remat strategies at each budget of the sweep, the peers, and
    checkmate at each peer's measured peak (`run`). Each distinct schedule is deployed and measured
    once; every timed step alternates with keep_all's."""

    def __init__(self, name: str, build, desc: str, trunk: str | None, a):
        self.name, self.trunk, self.a = name, trunk, a
        self.model, self.inputs = build()
        self.model.train()
        self.params = list(self.model.parameters())
        self.resident = [*self.params, *self.model.buffers(), *[x for x in self.inputs if isinstance(x, torch.Tensor)]]
        self.notes: list[str] = []
        self.rows: list[Row] = []
        self.measured: dict[str, dict] = {}  # schedule sha -> its measurement
        self.extra_ns: dict[str, float] = {}  # schedule sha -> extra ns the measured cost model predicts
        self.keep_step = None  # keep_all's step, which every timed step alternates with

    def say(self, msg: str) -> None:
        print(f"[{self.name} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def run(self) -> tuple[list[Row], list[str]]:
        self.capture()
        self.remat_rows()
        self.peer_rows()
        if self.a.match_peers:
            self.checkmate_at_peer_peaks()
        self.finish()
        return self.rows, self.notes

    # ---- the graph and the budgets
    def capture(self) -> None:
        self.say("reference step (eager, seed 0) and capture")
        ref_loss, ref_grads, self.keep_flops = reference_step(self.model, self.inputs, seed=0)
        self.ref = (ref_loss, ref_grads)
        self.graph = remat.capture(self.model, self.inputs)
        self.say("capture with measured op times (cost_model='measured')")
        self.timed = remat.capture(self.model, self.inputs, cost_model="measured")  # the same graph, costs in ns
        assert self.timed.fingerprint() == self.graph.fingerprint(), "the measured-cost graph is not the same graph"
        self.step_ns = self.timed.meta["cost_timing"].get("first_computation_ns", self.timed.total_cost)
        self.budgets = self.sweep()
        self.say(f"{len(self.graph.nodes)} nodes; budgets (MiB): {', '.join(f'{b / MiB:.2f}' for b in self.budgets)}")

    def sweep(self) -> list[int]:
        """`--budgets` budgets from keep_all's peak down to the lowest peak any strategy reaches."""
        lows: dict[str, int] = {}
        for s in REMAT[1:]:
            if s == "checkmate":
                continue
            try:
                lows[s] = get_solver(s)(self.graph, LOWEST_PEAK).predicted_peak_bytes
            except NotAChainError as e:
                self.notes.append(f"revolve: {e}")
        if self.a.min_peak:
            from remat.solver.checkmate import min_feasible_budget

            t0 = time.perf_counter()
            lows["checkmate"], low_plan = min_feasible_budget(self.graph, time_limit_s=self.a.time_limit,
                                                              return_plan=True)
            floor = low_plan.details.get("peak_lower_bound")
            self.notes.append(f"checkmate's smallest feasible budget ({low_plan.details.get('schedule_source')}): "
                              f"{lows['checkmate'] / MiB:.2f} MiB, found in {time.perf_counter() - t0:.1f} s"
                              + ("" if floor is None else f"; no plan peaks below {floor / MiB:.2f} MiB (proven)"))
        self.notes.append("lowest peak each strategy reaches (MiB): "
                          + ", ".join(f"{k} {v / MiB:.2f}" for k, v in lows.items()))
        hi = remat.solve(self.graph, None, solver="keep_all").predicted_peak_bytes
        lo = min(lows.values())
        n = max(self.a.budgets, 2)
        return [round(hi + (lo - hi) * k / (n - 1)) for k in range(n)]

    # ---- remat's rows
    def deploy_and_measure(self, plan: Plan) -> tuple[dict, str]:
        key = schedule_sha(plan)  # one measurement per distinct schedule, whichever strategy made it
        if key in self.measured:
            return self.measured[key], ""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = remat.optimize(self.model, example_inputs=tuple(self.inputs), plan=plan)
        note = "; ".join(str(w.message)[:120] for w in caught if "budget" in str(w.message))
        step = training_step(opt, self.params, self.inputs)
        m = measure(step, self.params, self.resident, self.ref, 0, self.a.steps, keep_step=self.keep_step)
        m["predicted_peak"] = opt.plan.predicted_peak_bytes
        self.keep_step = self.keep_step or step  # the first plan measured is keep_all's
        self.measured[key] = m
        return m, note

    def remat_row(self, strategy: str, budget: int | None, family: str = "remat", curve: str | None = None,
                  solve_on=None, label: str | None = None, **kw) -> Row:
        """One remat row: `strategy`'s plan at `budget`, deployed and measured; `solve_on`: solve on
        this graph instead (the same graph with other costs), the plan judged on the capture's."""
        row = Row(model=self.name, strategy=label or strategy, family=family, curve=curve or strategy,
                  budget_bytes=budget, base="keep_all")
        t0 = time.perf_counter()
        try:
            plan = remat.solve(solve_on or self.graph, budget, solver=strategy,
                               time_limit_s=self.a.time_limit if strategy == "checkmate" else None, **kw)
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
                                   simulate(self.graph, list(plan.schedule)).extra_cost) / self.graph.total_cost
        row.schedule_sha = schedule_sha(plan)
        self.extra_ns[row.schedule_sha] = simulate(self.timed, list(plan.schedule)).extra_cost
        row.pred_time_ratio_measured = 1 + self.extra_ns[row.schedule_sha] / self.step_ns
        m, note = self.deploy_and_measure(plan)
        row.note = note
        row.predicted_peak = m["predicted_peak"]
        row.measured_peak, row.meas_xflops = m["measured_peak"], m["flops"] - self.keep_flops
        row.cpu_s, row.wall_s, row.grads, row.max_grad_err = m["cpu_s"], m["wall_s"], m["grads"], m["max_grad_err"]
        row.time_ratio = m["time_ratio"]
        return row

    def remat_rows(self) -> None:
        self.say("keep_all")
        self.rows.append(self.remat_row("keep_all", None))
        not_chain = False
        for strategy in REMAT[1:]:
            for b in self.budgets:
                if strategy == "revolve" and not_chain:
                    break
                self.say(f"{strategy} at {b / MiB:.2f} MiB")
                row = self.remat_row(strategy, b)
                self.rows.append(row)
                not_chain = not_chain or row.status == "not a chain"

    # ---- the peers
    def peer_row(self, label: str, curve: str, base: str, ctx_factory, step_factory=None,
                 per_step: bool = False) -> Row:
        """A peer measured like the remat rows. `ctx_factory()` sets it up around the measurement,
        or, with `per_step`, around each of its steps (a peer that changes the model's modules:
        keep_all's steps, alternating with its own, need the model as traced)."""
        self.say(label)
        row = Row(model=self.name, strategy=label, family="peer", curve=curve, base=base)
        try:
            with nullcontext() if per_step else ctx_factory():
                step = step_factory() if step_factory else training_step(self.model, self.params, self.inputs)
                if per_step:
                    inner = step

                    def step():
                        with ctx_factory():
                            return inner()

                m = measure(step, self.params, self.resident, self.ref, 0, self.a.steps, keep_step=self.keep_step)
        except Exception as e:  # a peer that fails (e.g. torch.compile) is recorded, not fatal
            row.status = "error"
            row.note = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            return row
        row.status = "measured"
        row.measured_peak, row.meas_xflops = m["measured_peak"], m["flops"] - self.eager_flops
        row.cpu_s, row.wall_s, row.grads, row.max_grad_err = m["cpu_s"], m["wall_s"], m["grads"], m["max_grad_err"]
        row.time_ratio = m["time_ratio"]
        return row

    def peer_rows(self) -> None:
        model, eager = self.model, "eager (no checkpointing)"
        fresh(self.params)
        self.eager_flops = remat.count_flops(training_step(model, self.params, self.inputs))
        self.rows.append(self.peer_row(eager, "eager", eager, nullcontext))
        blocks = list(find_blocks(self.graph))
        if blocks:
            self.rows.append(self.peer_row(f"torch checkpoint per block ({len(blocks)})", "torch checkpoint per block",
                                           eager, lambda: checkpointed_blocks(model, blocks), per_step=True))
        else:
            self.notes.append("no repeated blocks: no torch.utils.checkpoint per-block row")
        if self.trunk is not None:
            count = len(model._modules[self.trunk])
            for seg in sorted({2, math.ceil(math.sqrt(count)), count}):
                self.rows.append(self.peer_row(f"checkpoint_sequential({self.trunk}, {seg})", "checkpoint_sequential",
                                               eager, lambda seg=seg: sequential_trunk(model, self.trunk, seg),
                                               per_step=True))
        else:
            self.notes.append("not sequential (skip connections): no checkpoint_sequential row")
        self.compile_rows()

    def compile_rows(self) -> None:
        import torch._functorch.config as functorch_config

        a, model, inputs = self.a, self.model, self.inputs
        quick_compile = "resnet" if "resnet" in a.models else a.models[0]
        for amb in a.compile_budgets if (not a.quick or self.name == quick_compile) else []:
            torch._dynamo.reset()

            def compiled_step():
                compiled = torch.compile(model, backend=a.compile_backend)

                def step():
                    loss = compiled(*inputs)
                    loss.backward()
                    return loss

                return step

            tag = "" if a.compile_backend == "inductor" else f" ({a.compile_backend})"
            row = self.peer_row(f"torch.compile{tag} amb={amb:g}", "torch.compile activation_memory_budget",
                                f"torch.compile{tag} amb=1",
                                lambda amb=amb: functorch_config.patch(activation_memory_budget=amb), compiled_step)
            self.rows.append(row)
            if row.status == "measured":
                self.say(f"torch.compile amb={amb:g} again with fallback_random=True: eager's dropout masks")
                row.grads_same_masks = same_masks_grads(model, self.params, inputs, self.ref, amb, a.compile_backend)
        torch._dynamo.reset()

    # ---- checkmate at each peer's measured peak
    def checkmate_at_peer_peaks(self) -> None:
        keep_row = self.rows[0]
        done: dict[int, Row] = {}
        for r in [r for r in self.rows if r.family == "peer" and r.measured_peak and not r.strategy.startswith("eager")]:
            b = r.measured_peak
            if b in done:
                continue
            if b >= keep_row.measured_peak:
                self.notes.append(f"{r.strategy} peaks at or above keep_all ({b / MiB:.2f} MiB): checkmate at its "
                                  f"peak is keep_all's plan (no recomputation)")
                continue
            self.say(f"checkmate at {r.strategy}'s measured peak {b / MiB:.2f} MiB")
            c = done[b] = self.remat_row("checkmate", b, family="remat@peer", curve="checkmate")
            c.note = (c.note + f" at the measured peak of {r.strategy}").strip()
            self.rows.append(c)
            if c.meas_xflops and r.meas_xflops is not None and c.meas_xflops >= r.meas_xflops:
                # the default objective (FLOPs plus bytes moved: time) recomputes more FLOPs than the
                # peer here: solve again with FLOPs as the only objective (flop_floor.py's)
                self.say(f"checkmate (FLOP objective) at {r.strategy}'s measured peak {b / MiB:.2f} MiB")
                f = self.remat_row("checkmate", b, family="remat@peer", curve="checkmate (FLOP objective)",
                                   solve_on=flop_objective(self.graph), label="checkmate (FLOP objective)")
                f.note = (f.note + f" at the measured peak of {r.strategy}; objective: extra FLOPs only").strip()
                self.rows.append(f)

    # ---- ratios and notes
    def finish(self) -> None:
        rows, notes = self.rows, self.notes
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
        # ratios to each row's own base (keep_all, the eager model, torch.compile at budget 1)
        by_name = {r.strategy: r for r in rows if r.time_ratio}
        keep = by_name["keep_all"]
        for r in rows:
            base = by_name.get(r.base)
            if r.time_ratio and base is not None:
                r.base_ratio = r.time_ratio / base.time_ratio
        notes.append(timed_note(self.timed))
        notes.append(disagreement_note(rows, self.extra_ns, keep.cpu_s))
        notes.insert(0, f"keep_all: predicted peak {keep.predicted_peak / MiB:.2f} MiB, measured "
                        f"{keep.measured_peak / MiB:.2f} MiB, step {keep.cpu_s * 1e3:.0f} ms CPU "
                        f"({keep.wall_s * 1e3:.0f} ms wall); "
                        f"eager model {by_name['eager (no checkpointing)'].cpu_s * 1e3:.0f} ms CPU")


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
        rows, notes = ModelRun(name, build, desc, trunk, a).run()
        notes.append(f"wall time for this model: {time.perf_counter() - t0:.0f} s")
        write_results(out, name, desc, rows, notes, head)
        print((out / f"compare_{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
