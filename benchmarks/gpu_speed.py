#!/usr/bin/env python
"""Training speed at the same memory (issue #27): tokens/s of a bf16 Llama-3.2-1B-shaped Hugging Face
decoder (vocab 128256, d 2048, 16 layers, GQA 32/8, tied embeddings, no dropout), AdamW, batch 4 x
sequence 4096, under the checkpointing people use and under remat at each of those peers' measured
peaks.

    python benchmarks/gpu_speed.py --out DIR [--batch 4] [--seq 4096] [--deadline-s 420] [--profile]
                                   [--sdpa-rows] [--triton-rows] [--skip "compile,remat compiled"]
    python benchmarks/gpu_speed.py --out DIR --tiny        # a small model on the CPU: the script's smoke test
    python benchmarks/gpu_speed.py --render benchmarks/results/gpu_speed_h200.json   # the README's table
    bash benchmarks/gpu_session.sh gpu_speed.py ...        # on the GPU machine (wheels, the package laid out)

Rows, in this order (each written to DIR/gpu_speed.{json,txt} as it ends; rows past the deadline are
reported as not run):
  eager                      the model as it is (the reference: gradients, FLOPs)
  eager rerun                the same again: the noise floor of the gradient comparison
  checkpoint per block       torch.utils.checkpoint (non-reentrant) on every decoder layer, as
                             `model.gradient_checkpointing_enable` applies it
  selective per block        torchtitan's "op" selective activation checkpointing on every decoder
                             layer: save the outputs of matmuls (all but every second one) and
                             attention, recompute the rest
  compile budget 0.5 / 0.3   torch.compile with torch._functorch.config.activation_memory_budget
  remat @ <peer>             remat.optimize(budget_bytes=<that peer's measured step peak>)
  remat (SDPA) @ <peer>      the same with fused_attention=False (torch's SDPA, e.g. cuDNN, instead of
                             remat's attention op), with --sdpa-rows
  remat (Triton) @ <peer>    the same with the op's Triton kernels where it would run cuDNN's
                             (attention.cudnn.set_cudnn_attention(False)), with --triton-rows
  remat compiled @ <peer>    the same with compiled=True (Inductor runs the plan's graphs)

Per row: the step's measured peak (torch.cuda.max_memory_allocated over forward and backward, less
the optimizer state, which is remat's budget: the step's real peak; the optimizer step is measured on
its own), the plan's predicted peak (remat rows), the median time of --steps full iterations
(zero_grad, forward, backward, AdamW step) after --warmup, tokens/s, FLOPs of one step (forward and
backward, remat.measure.count_flops: the ops the profiler records, compiled code included) against
eager's, and the first step's gradients against eager's on the same parameters and batch
(||g - g_eager|| / ||g_eager|| over all parameters, next to eager's own rerun).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                rope_theta=500000.0, attention_dropout=0.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, attention_dropout=0.0)
SOLVE_LIMIT_S = 20.0
PROFILE_ROWS = 25


class LossOnly(nn.Module):
    """The training loop's `loss = model(input_ids=ids, labels=ids).loss`, as a module returning the
    loss alone (so remat plans all of the step, and every strategy frees the logits alike)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids, use_cache=False).loss


# ----------------------------------------------------------------------------------------------
# the peers
# ----------------------------------------------------------------------------------------------
def torchtitan_sac_context():
    """torchtitan's per-op selective checkpointing policy: save matmul outputs (all but every
    second one, counted separately in the forward and in the recomputation) and attention outputs."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default}
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        save.add(aten._scaled_dot_product_cudnn_attention.default)
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            counts[key] += 1
        keep = func in save and not (func == aten.mm.default and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@contextlib.contextmanager
def triton_attention():
    """remat's attention op on its Triton kernels where it would run cuDNN's."""
    from remat.attention.cudnn import set_cudnn_attention

    set_cudnn_attention(False)
    try:
        yield
    finally:
        set_cudnn_attention(True)


@contextlib.contextmanager
def checkpointed(lm: nn.Module, selective: bool):
    """`lm` with every decoder layer checkpointed (non-reentrant), as Hugging Face applies it."""
    kwargs = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = torchtitan_sac_context
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    try:
        yield
    finally:
        lm.gradient_checkpointing_disable()


# ----------------------------------------------------------------------------------------------
# measuring one strategy
# ----------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        import transformers

        self.args = args
        self.device = torch.device("cpu" if args.tiny else "cuda")
        self.dtype = torch.float32 if args.tiny else torch.bfloat16
        cfg = transformers.LlamaConfig(max_position_embeddings=args.seq, **(TINY if args.tiny else LLAMA_1B))
        torch.manual_seed(0)
        with torch.device(self.device):
            lm = transformers.LlamaForCausalLM(cfg).to(self.dtype)
        lm.config.use_cache = False
        lm.train()
        self.lm = lm
        self.model = LossOnly(lm)
        self.params = [p for p in self.model.parameters()]
        self.initial = [p.detach().clone() for p in self.params]
        self.n_params = sum(p.numel() for p in self.params)
        g = torch.Generator().manual_seed(1)
        self.batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(self.device)
                        for _ in range(2)]
        self.ref_grads: list[torch.Tensor] | None = None
        self.ref_flops: int | None = None
        self.profiles: list[str] = []

    # -- helpers ---------------------------------------------------------------------------------
    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def clean(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def reset_params(self):
        with torch.no_grad():
            for p, p0 in zip(self.params, self.initial):
                p.copy_(p0)
                p.grad = None

    def grad_error(self) -> float:
        num = den = 0.0
        for p, r in zip(self.params, self.ref_grads):
            g = torch.zeros_like(r) if p.grad is None else p.grad
            num += (g.float() - r.float()).pow(2).sum().item()
            den += r.float().pow(2).sum().item()
        return (num / den) ** 0.5

    def step_peak(self, fn, opt) -> tuple[int, int]:
        """(the step's peak, the optimizer step's peak) in bytes. The step's peak is remat's budget:
        the model's parameters and buffers and the batch, plus what forward and backward allocate
        (max_memory_allocated less everything else allocated before the step: the optimizer state
        and this benchmark's own tensors, the initial parameters and eager's gradients)."""
        from remat.measure import resident_bytes

        b = self.batches[1]
        opt.zero_grad(set_to_none=True)
        if self.device.type != "cuda":  # the profiler's allocation events (the smoke test)
            from remat.measure import measure_peak

            fb = measure_peak(lambda: fn(b).backward(), resident=[self.model, b], device="cpu")
            opt.step()
            return fb, 0
        self.sync()
        others = torch.cuda.memory_allocated() - resident_bytes([self.model, b])
        torch.cuda.reset_peak_memory_stats()
        fn(b).backward()
        self.sync()
        fb = torch.cuda.max_memory_allocated() - others
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        self.sync()
        return fb, torch.cuda.max_memory_allocated()

    def profile(self, name: str, fn, opt) -> str:
        """The CUDA kernels of one iteration, by time (the top PROFILE_ROWS)."""
        from torch.profiler import ProfilerActivity, profile

        self.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            opt.zero_grad(set_to_none=True)
            fn(self.batches[0]).backward()
            opt.step()
            self.sync()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=PROFILE_ROWS, max_name_column_width=70)
        return f"== {name}\n{table}\n"

    def run(self, name: str, fn, compiled: bool = False, **extra) -> dict:
        """One strategy's row: first step's gradients and FLOPs, then timed iterations. `compiled`:
        `fn` runs Inductor's code."""
        from torch.utils.flop_counter import FlopCounterMode

        from remat.measure import count_flops

        a = self.args
        row = {"strategy": name, **extra}
        self.reset_params()
        self.clean()
        t0 = time.perf_counter()
        # first call (compiles, if anything compiles), then the gradient check on fresh parameters
        fn(self.batches[0]).backward()
        self.reset_params()
        row["first_call_s"] = time.perf_counter() - t0
        if self.ref_grads is None:
            fn(self.batches[0]).backward()
            self.ref_grads = [p.grad.detach().clone() for p in self.params]
            row["grad_rel_err"] = 0.0
        else:
            fn(self.batches[0]).backward()
            row["grad_rel_err"] = self.grad_error()
        self.reset_params()
        try:
            if compiled:  # the profiler sees the ops compiled code calls (a dispatch mode would un-compile it)
                flops = count_flops(lambda: fn(self.batches[0]).backward())
            else:  # a dispatch mode: a selective checkpoint's saved outputs are not counted as recomputed
                with FlopCounterMode(display=False) as counter:
                    fn(self.batches[0]).backward()
                flops = counter.get_total_flops()
        except Exception as exc:  # torch 2.11's SDPA formula refuses grouped-query attention's shapes
            flops, row["flops_error"] = None, f"{type(exc).__name__}: {exc}"
        if self.ref_flops is None and name == "eager":
            self.ref_flops = flops
        row["flops"] = flops
        row["extra_flops"] = flops / self.ref_flops - 1 if flops and self.ref_flops else None
        self.reset_params()
        opt = torch.optim.AdamW(self.params, lr=1e-5, foreach=True)
        times = []
        for i in range(a.warmup + a.steps):
            self.sync()
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            fn(self.batches[i % 2]).backward()
            opt.step()
            self.sync()
            times.append(time.perf_counter() - t)
        row["step_peak_bytes"], row["optimizer_step_peak_bytes"] = self.step_peak(fn, opt)
        row["optimizer_state_bytes"] = sum(t.numel() * t.element_size() for s in opt.state.values()
                                           for t in s.values() if isinstance(t, torch.Tensor))
        if a.profile:
            self.profiles.append(self.profile(name, fn, opt))
        med = statistics.median(times[a.warmup:])
        row.update(step_s=med, tokens_per_s=a.batch * a.seq / med, times_s=times)
        del opt
        self.reset_params()
        self.clean()
        return row


# ----------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------
UNIT = [2**30, "GiB"]  # MiB for the CPU smoke test


def _gib(b) -> str:
    return "-" if b in (None, 0) else f"{b / UNIT[0]:7.2f}"


def _pct(r: dict) -> str:
    """Extra FLOPs over eager's step, where counted."""
    return "n/a" if r.get("extra_flops") is None else f"{r['extra_flops'] * 100:.2f}%"


def table(rows: list[dict], ref: dict | None) -> list[str]:
    head = (f"{'strategy':34s} {'budget':>7s} {'pred':>7s} {'meas':>7s} {'step ms':>8s} {'tok/s':>8s} "
            f"{'vs eager':>8s} {'extra FLOPs':>11s} {'grad err':>9s} {'setup s':>7s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "step_s" not in r:
            lines.append(f"{r['strategy']:34s} {r.get('status', '')}: {r.get('error', '')}"[:200])
            continue
        vs = r["tokens_per_s"] / ref["tokens_per_s"] if ref else float("nan")
        lines.append(f"{r['strategy']:34s} {_gib(r.get('budget_bytes')):>7s} {_gib(r.get('predicted_peak_bytes')):>7s} "
                     f"{_gib(r['step_peak_bytes']):>7s} {r['step_s'] * 1e3:8.1f} {r['tokens_per_s']:8.0f} {vs:8.3f} "
                     f"{_pct(r):>11s} {r['grad_rel_err']:9.2e} {r.get('optimize_s', 0) + r['first_call_s']:7.1f}")
    return lines


def versus(rows: list[dict]) -> list[str]:
    """remat's tokens/s at each peer's measured peak, as a ratio to that peer's."""
    by = {r["strategy"]: r for r in rows if "step_s" in r}
    out = []
    for r in rows:
        peer = r.get("peer")
        if peer and peer in by and "step_s" in r:
            p = by[peer]
            out.append(f"{r['strategy']:34s} {r['tokens_per_s'] / p['tokens_per_s']:6.3f}x {peer}'s tokens/s, "
                       f"measured peak {r['step_peak_bytes'] / p['step_peak_bytes']:6.3f}x its "
                       f"({'within' if r['step_peak_bytes'] <= r['budget_bytes'] else 'OVER'} the budget; "
                       f"measured/predicted {r['step_peak_bytes'] / r['predicted_peak_bytes']:.4f})")
    return out


def render(path: Path) -> str:
    """The results file's tables as Markdown (the README's table is this output). A results file
    holds one or more runs ({"runs": [...]}, or one run); a run's "benchmark_bytes_in_peaks" (tensors
    this script held while it measured, counted in that run's peaks and so in the budgets remat got)
    is subtracted from its measured peaks and budgets."""
    data = json.loads(Path(path).read_text())
    runs = data.get("runs", [data])
    rows, eager = [], None
    for i, run in enumerate(runs, 1):
        extra = run.get("benchmark_bytes_in_peaks", 0)
        for r in run["rows"]:
            if "step_s" not in r:
                continue
            r = dict(r, run=i, step_peak_bytes=r["step_peak_bytes"] - extra)
            if r.get("budget_bytes"):
                r["budget_bytes"] -= extra
            rows.append(r)
            if r["strategy"] == "eager" and eager is None:
                eager = r
    if eager and eager.get("flops"):  # every row's extra FLOPs against the first eager row's count
        for r in rows:
            r["extra_flops"] = r["flops"] / eager["flops"] - 1 if r.get("flops") else None
    env = runs[-1]["env"]
    out = [f"machine: {env['device']} ({env['cpu_cores']} CPU cores), torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; "
           f"Llama-3.2-1B-shaped, bf16, batch {runs[-1]['batch']} x {runs[-1]['seq']}, AdamW",
           "", "| strategy | step peak GiB (predicted) | step ms | tokens/s | vs eager | extra FLOPs | grad err | "
           "remat vs the peer at its peak |", "|---|---|---|---|---|---|---|---|"]
    by = {r["strategy"]: r for r in rows}
    for r in rows:
        pred = f" ({r['predicted_peak_bytes'] / 2**30:.2f})" if r.get("predicted_peak_bytes") else ""
        vs_eager = f"{r['tokens_per_s'] / eager['tokens_per_s']:.3f}" if eager else "-"
        peer = by.get(r.get("peer"))
        versus_peer = ""
        if peer:
            mem = r["step_peak_bytes"] / peer["step_peak_bytes"]
            versus_peer = (f"{r['tokens_per_s'] / peer['tokens_per_s']:.3f}x tokens/s at {mem:.3f}x its memory"
                           + ("" if mem <= 1.0005 else " (above its peak: not a same-memory row)"))
        out.append(f"| {r['strategy']} | {r['step_peak_bytes'] / 2**30:.2f}{pred} | {r['step_s'] * 1e3:.1f} | "
                   f"{r['tokens_per_s']:.0f} | {vs_eager} | {_pct(r)} | {r['grad_rel_err']:.2e} | {versus_peer} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for gpu_speed.json/.txt (required unless --render)")
    ap.add_argument("--render", help="print a results file's table as Markdown and exit")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=420.0, help="start no row after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="a tiny fp32 model on the CPU (smoke test)")
    ap.add_argument("--sdpa-rows", action="store_true",
                    help="also remat with attention left to torch's SDPA (fused_attention=False) at the checkpoint peers")
    ap.add_argument("--triton-rows", action="store_true",
                    help="also remat with the attention op's Triton kernels where it would run cuDNN's")
    ap.add_argument("--profile", action="store_true", help="profile one iteration per row (CUDA kernels by time)")
    ap.add_argument("--skip", default="", help="comma-separated row names (prefixes) not to run")
    args = ap.parse_args(argv)
    if args.render:
        print(render(Path(args.render)), end="")
        return 0
    if not args.out:
        ap.error("--out is required")
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.tiny and not torch.cuda.is_available():
        print("gpu_speed: no CUDA GPU; use --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    import remat
    import transformers

    if args.tiny:
        UNIT[:] = [2**20, "MiB"]
    # importing remat made FlopCounterMode count Hugging Face's enable_gqa attention on torch < 2.13
    # (compat.count_grouped_query_attention)
    bench = Bench(args)
    env = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "transformers": transformers.__version__, "python": platform.python_version(),
           "cpu_cores": os.cpu_count(), "device": torch.cuda.get_device_name() if not args.tiny else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    data = {"env": env, "command": "python benchmarks/gpu_speed.py " + " ".join(argv or sys.argv[1:]),
            "model": {"params": bench.n_params, **(TINY if args.tiny else LLAMA_1B)},
            "batch": args.batch, "seq": args.seq, "rows": []}
    rows = data["rows"]

    def dump():
        data["wall_s"] = time.time() - t_start
        ref = next((r for r in rows if r["strategy"] == "eager" and "step_s" in r), None)
        lines = [f"machine: {env['device']}, {env['cpu_cores']} CPU cores; torch {env['torch']}, triton {env['triton']}, "
                 f"transformers {env['transformers']}, Python {env['python']}",
                 f"command: {data['command']}",
                 f"model: Llama-3.2-1B-shaped LlamaForCausalLM ({bench.n_params / 1e9:.3f}B parameters), "
                 f"{bench.dtype}, batch {args.batch} x seq {args.seq}, AdamW; median of {args.steps} iterations "
                 f"after {args.warmup}",
                 f"budget/pred/meas: {UNIT[1]} of the step's peak (forward+backward, optimizer state excluded); "
                 "grad err: ||g - g_eager|| / ||g_eager|| on the first step; setup s: remat.optimize and the "
                 "first call (compilation)", ""]
        lines += table(rows, ref) + [""] + versus(rows)
        lines.append(f"\nwall {data['wall_s']:.0f} s")
        (out / "gpu_speed.json").write_text(json.dumps(data, indent=2, default=str))
        (out / "gpu_speed.txt").write_text("\n".join(lines) + "\n")
        if bench.profiles:
            (out / "gpu_speed_profile.txt").write_text("\n".join(bench.profiles))
        print(table(rows, ref)[-1], flush=True)

    skip = [s for s in args.skip.split(",") if s]

    def attempt(name: str, make, compiled: bool = False, **extra):
        """Run row `name` (make() -> (step function, context manager, details)) unless skipped or late."""
        if any(name.startswith(s) for s in skip):
            return None
        if time.time() - t_start > args.deadline_s:
            rows.append({"strategy": name, "status": "not run", "error": "past the deadline", **extra})
            dump()
            return None
        print(f"== {name} ({time.time() - t_start:.0f} s)", flush=True)
        t0 = time.perf_counter()
        try:
            fn, ctx, details = make()
            with ctx:
                row = bench.run(name, fn, compiled=compiled, **extra, **details)
        except Exception as exc:
            row = {"strategy": name, "status": "error", "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc(), **extra}
            traceback.print_exc()
        row["row_s"] = time.perf_counter() - t0
        rows.append(row)
        bench.clean()
        dump()
        return row

    model, lm = bench.model, bench.lm
    attempt("eager", lambda: (model, contextlib.nullcontext(), {}))
    attempt("eager rerun", lambda: (model, contextlib.nullcontext(), {}))
    peers = []
    for name, selective in (("checkpoint per block", False), ("selective per block (torchtitan)", True)):
        peers.append(attempt(name, lambda s=selective: (model, checkpointed(lm, s), {})))

    def remat_row(peer: dict, compiled: bool, fused: bool = True, triton_only: bool = False):
        """remat at `peer`'s measured step peak; `fused` False: attention left to torch's SDPA
        (fused_attention=False) instead of remat's op; `triton_only`: the op's Triton kernels only."""
        b = peer["step_peak_bytes"]

        def make():
            t0 = time.perf_counter()
            opt = remat.optimize(model, budget_bytes=b, example_inputs=(bench.batches[0],), compiled=compiled,
                                 time_limit_s=SOLVE_LIMIT_S, quiet=True, fused_attention=fused)
            plan = opt.plan
            return opt, (triton_attention() if triton_only else contextlib.nullcontext()), {
                "budget_bytes": b, "predicted_peak_bytes": plan.predicted_peak_bytes, "optimize_s": time.perf_counter() - t0,
                "plan_status": str(plan.status), "plan_gap": plan.gap, "plan_extra_flops": plan.extra_flops,
                "loss_head": plan.details.get("loss_head"), "fused_attention": fused}

        label = ("remat compiled" if compiled else "remat") + ("" if fused else " (SDPA)") + \
            (" (Triton)" if triton_only else "")
        return attempt(f"{label} @ {peer['strategy']}", make, compiled=compiled, peer=peer["strategy"])

    for p in peers:
        if p and "step_peak_bytes" in p:
            remat_row(p, compiled=False)
            if args.sdpa_rows:
                remat_row(p, compiled=False, fused=False)
            if args.triton_rows:
                remat_row(p, compiled=False, triton_only=True)
    # each compile peer, then remat at its peak: compiled first (Inductor against Inductor), then the
    # eager runtime
    for frac in (0.5, 0.3):
        def make(frac=frac):
            import torch._functorch.config as fc

            torch._dynamo.reset()
            return torch.compile(model), fc.patch(activation_memory_budget=frac), {}

        p = attempt(f"compile budget {frac}", make, compiled=True)
        torch._dynamo.reset()
        if p and "step_peak_bytes" in p:
            remat_row(p, compiled=True)
            remat_row(p, compiled=False)
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
