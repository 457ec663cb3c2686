"""compare.py's rows and how each is measured: one training step's peak, FLOPs, gradients and
times (`measure`), the gradient verdict against the eager reference, and the peers as users run them
(torch.utils.checkpoint around every block, checkpoint_sequential over a trunk, torch.compile with
eager's dropout masks)."""
from __future__ import annotations

import hashlib
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

import remat
from remat.core.plan import Plan

__all__ = ["Row", "fresh", "measure", "grads_verdict", "same_masks_grads", "schedule_sha", "checkpointed_blocks",
           "sequential_trunk"]


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


def fresh(params):
    """Every parameter's gradient dropped: each measured step starts from none."""
    for p in params:
        p.grad = None


def measure(step, params, resident, ref, seed: int, steps: int, keep_step=None) -> dict:
    """Peak, FLOPs, gradients against `ref` (loss, grads) and step times of `step()` (which runs
    loss = ...; loss.backward() and returns the loss), each from a fresh start (no gradients).
    With `keep_step` (keep_all's step) the timed steps alternate with keep_all's, and
    `time_ratio` is the ratio of the two medians: drift in the machine's load weighs on both."""
    fresh(params)
    torch.manual_seed(seed)
    step()  # warm-up (compiles where torch.compile is involved)
    fresh(params)
    peak = remat.measure_peak(step, resident=resident)
    fresh(params)
    flops = remat.count_flops(step)
    fresh(params)
    torch.manual_seed(seed)
    grads, err = grads_verdict(step().detach(), params, ref)
    times = {"cpu": [], "wall": [], "keep": []}
    for _ in range(steps):
        for fn, key in ((keep_step, "keep"), (step, "cpu")):
            if fn is None:
                continue
            fresh(params)
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            times[key].append(time.process_time() - c0)
            if key == "cpu":
                times["wall"].append(time.perf_counter() - w0)
    fresh(params)
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
            fresh(params)
            torch.manual_seed(0)
            loss = compiled(*inputs)
            loss.backward()
            verdict, err = grads_verdict(loss.detach(), params, ref)
    except Exception as e:  # recorded, not fatal
        return f"error: {type(e).__name__}"
    finally:
        fresh(params)
        torch._dynamo.reset()
    return verdict if verdict != "DIFF" else f"DIFF ({err:.1e})"


def schedule_sha(plan: Plan) -> str:
    """A short hash of a plan's schedule: one measurement per distinct schedule."""
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
