"""Run a strategy for real and compare it with its plan: the numbers behind `remat demo` and
`benchmarks/core.py`."""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from remat.api import optimize
from remat.attention.router import fused_attention_mode, route_attention
from remat.machine_info import MiB
from remat.measure import count_flops, measure_peak
from remat.core.plan import Plan

__all__ = ["StrategyRow", "training_step", "run_strategy", "format_table", "reference_step", "extra_cost_frac"]


@dataclass
class StrategyRow:
    """One strategy run for real: its plan's predictions beside what a real step measured."""

    strategy: str
    budget_bytes: int | None
    status: str
    predicted_peak_bytes: int
    measured_peak_bytes: int
    extra_cost_frac: float  # recomputations (+ a chunked head's added cost) / the model's own step's cost
    extra_flops_predicted: int
    extra_flops_measured: int
    solve_time_s: float
    step_time_s: float
    grads_match: bool | None  # loss and every gradient allclose to the unmodified model's
    max_grad_err: float | None
    plan: Plan | None = field(default=None, repr=False)  # to deploy again without solving

    @property
    def measured_over_predicted(self) -> float:
        return self.measured_peak_bytes / self.predicted_peak_bytes

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "plan"}
        sched = self.plan.schedule if self.plan else []
        return {**d, "measured_over_predicted": self.measured_over_predicted,
                # identifies the plan across runs (benchmarks/demo_under_load.py)
                "schedule_sha256": hashlib.sha256("\n".join(sched).encode()).hexdigest(),
                "plan_details": {k: v for k, v in (self.plan.details if self.plan else {}).items()
                                 if isinstance(v, (int, float, str, dict))}}


def training_step(module: nn.Module, params: Sequence[torch.Tensor], inputs: Sequence) -> Callable[[], torch.Tensor]:
    """One step: loss = module(*inputs); loss.backward(), starting with no gradients."""

    def step():
        loss = module(*inputs)
        loss.backward()
        return loss

    def fresh():
        for p in params:
            p.grad = None

    step.fresh = fresh  # type: ignore[attr-defined]
    return step


def reference_step(model: nn.Module, inputs: Sequence, seed: int, fused_attention: bool | str = True
                   ) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The unmodified model's loss and gradients for `seed`, and the FLOPs of a step that
    recomputes nothing. With fused_attention="all" the model runs eagerly with its attention fused
    as the optimized module fuses it (the dropout masks then come from remat's generator: the
    function the module must match).

    The FLOPs are counted on the keep_all module of the same `fused_attention`, not on the eager
    model: where attention is fused the two run different ops (the eager model computes the
    scores the fused op replaces), and extra FLOPs are what a plan adds to a step without
    recomputation."""
    params = list(model.parameters())
    step = training_step(model, params, inputs)
    if fused_attention_mode(fused_attention) == "all":
        step = _routed(step, model)
    step.fresh()
    torch.manual_seed(seed)
    loss = step().detach().clone()
    grads = [p.grad.detach().clone() for p in params]
    step.fresh()
    keep_all = optimize(model, example_inputs=tuple(inputs), solver="keep_all",
                        fused_attention=fused_attention)
    plain = training_step(keep_all, params, inputs)
    flops = count_flops(plain)
    plain.fresh()
    return loss, grads, flops


def _routed(step: Callable, model: nn.Module) -> Callable:
    def routed():
        with route_attention("all", model):
            return step()

    routed.fresh = step.fresh  # type: ignore[attr-defined]
    return routed


def run_strategy(model: nn.Module, inputs: Sequence, strategy: str, budget_bytes: int | None, *,
                 reference: tuple[torch.Tensor, list[torch.Tensor], int] | None = None,
                 plan: Plan | None = None, time_limit_s: float | None = None, seed: int = 0,
                 device: str | torch.device | None = None, fused_attention: bool | str = True) -> StrategyRow:
    """Optimize `model` with `strategy` under `budget_bytes` (None: no budget, keep_all only),
    then measure a real step: peak memory, FLOPs, time and gradients against `reference`."""
    opt = optimize(model, budget_bytes=budget_bytes,
                   example_inputs=tuple(inputs), solver=strategy, time_limit_s=time_limit_s, plan=plan,
                   fused_attention=fused_attention)
    params = list(model.parameters())
    step = training_step(opt, params, inputs)
    step.fresh()
    peak = measure_peak(step, resident=[model, *[x for x in inputs if isinstance(x, torch.Tensor)]], device=device)
    step.fresh()
    flops = count_flops(step)
    step.fresh()
    torch.manual_seed(seed)
    t1 = time.perf_counter()
    loss = step()
    step_time = time.perf_counter() - t1
    grads_ok, err = None, None
    if reference is not None:
        ref_loss, ref_grads, ref_flops = reference
        pairs = [(loss.detach(), ref_loss)] + [(p.grad, g) for p, g in zip(params, ref_grads)]
        grads_ok = all(a is not None and torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
        err = max(float((a - b).abs().max()) if a is not None else float("inf") for a, b in pairs)
    else:
        ref_flops = flops - _extra_flops(opt.plan)
    step.fresh()
    p = opt.plan
    return StrategyRow(strategy=strategy, budget_bytes=budget_bytes, status=p.status,
                       predicted_peak_bytes=p.predicted_peak_bytes, measured_peak_bytes=peak,
                       extra_cost_frac=extra_cost_frac(p, opt.graph),
                       extra_flops_predicted=_extra_flops(p), extra_flops_measured=flops - ref_flops,
                       solve_time_s=p.solve_time_s, step_time_s=step_time,
                       grads_match=grads_ok, max_grad_err=err, plan=p)


def extra_cost_frac(plan: Plan, graph) -> float:
    """The plan's extra cost over the model's own step, as a fraction of that step's cost: its
    recomputations, plus what a chunked loss head adds (remat/pipeline.py records it)."""
    head = float(plan.details.get("loss_head_cost", 0.0))
    return (plan.extra_cost + head) / (graph.total_cost - head)


def _extra_flops(plan: Plan) -> int:
    """The FLOPs the plan's step performs beyond the model's keep_all step: its recomputations, and
    what a chunked loss head adds (remat/pipeline.py records it)."""
    return plan.extra_flops + int(plan.details.get("loss_head_flops", 0))


def format_table(rows: Sequence[StrategyRow], keep_all_peak: int | None = None) -> str:
    """The rows as a fixed-width text table, sizes in MiB (with keep_all_peak: each measured peak
    as a fraction of it too)."""
    head = (f"{'strategy':<14} {'budget MiB':>10} {'status':<10} {'pred MiB':>9} {'meas MiB':>9} "
            f"{'meas/pred':>9} {'meas/keep':>9} {'extra':>7} {'xFLOP pred':>11} {'xFLOP meas':>11} "
            f"{'solve s':>8} {'grads':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        budget = "-" if r.budget_bytes is None else f"{r.budget_bytes / MiB:.1f}"
        keep = "-" if not keep_all_peak else f"{r.measured_peak_bytes / keep_all_peak:.3f}"
        grads = "-" if r.grads_match is None else ("ok" if r.grads_match else "DIFF")
        lines.append(f"{r.strategy:<14} {budget:>10} {r.status:<10} {r.predicted_peak_bytes / MiB:>9.2f} "
                     f"{r.measured_peak_bytes / MiB:>9.2f} {r.measured_over_predicted:>9.3f} {keep:>9} "
                     f"{r.extra_cost_frac:>6.1%} {r.extra_flops_predicted / 1e9:>10.3f}G "
                     f"{r.extra_flops_measured / 1e9:>10.3f}G {r.solve_time_s:>8.2f} {grads:>6}")
    return "\n".join(lines)
