"""Solve once, deploy later, for the user's own model: what `remat solve`, `remat check` and
`remat max-batch` do (remat/cli_offline.py parses the arguments and prints).

The model and its example inputs come from factories named like entry points: `my_pkg.models:build`
(an importable module) or `path/to/file.py:build` (a file, imported with its folder on sys.path).
The model factory returns the nn.Module. The inputs factory returns the example inputs: a tensor, a
tuple or list of positional arguments, a dict of keyword arguments, or (args, kwargs); given a batch
size (`--batch`, and always in max-batch) it is called with it: `example_batch(16)`.

Graphs are captured on fake tensors where the model allows (graph_capture/fake_capture.py: no
memory is allocated for the step, and a plan for a GPU can be made on a machine without one), on
real tensors otherwise. Budget fractions are of keep_all's predicted peak (the
simulator's, which equals the measured peak on CPU).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from remat.api import capture
from remat.attention.router import fused_attention_mode, route_attention
from remat.core.training_graph import TrainingGraph
from remat.machine_info import MiB
from remat.measure import measure_peak
from remat.deployment import input_tensors
from remat.solver import get_solver
from remat.core.plan import Plan
from remat.solver.schedule import keep_all_schedule
from remat.core.simulator import simulate
from remat.solving import strategy_options
from remat.validate import RematArgumentError, check_solve_args

__all__ = ["load_factory", "takes_batch", "build", "capture_graph", "keep_all_peak", "try_solve",
           "CheckResult", "check_plan", "BatchSearch", "largest_batch", "default_gpt",
           "default_gpt_batch"]


# ---- factories --------------------------------------------------------------------------------

def load_factory(spec: str) -> Callable:
    """The callable `spec` names ("pkg.module:attr" or "path/to/file.py:attr"); RematArgumentError
    with one line saying what is wrong (no colon, no such module or file, an import that fails,
    no such attribute, not callable)."""
    if ":" not in spec or spec.startswith(":") or spec.endswith(":"):
        raise RematArgumentError(f"expected module:function or path/to/file.py:function, got {spec!r}")
    where, attr = spec.rsplit(":", 1)
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise RematArgumentError(f"{where!r} is not a file")
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # so the file can import its neighbours
        # the file's own name, as `python -c "import stem"` from its folder would (class names read
        # stem.Net in plan files); another module of that name already loaded: a private name
        name = path.stem if path.stem.isidentifier() and path.stem not in sys.modules else f"_remat_user_{path.stem}"
        try:
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise RematArgumentError(f"importing {where!r} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise RematArgumentError(f"no module {where!r} ({e}); is it installed, or run from its folder?") from None
        except Exception as e:
            raise RematArgumentError(f"importing {where!r} failed: {type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RematArgumentError(f"{where!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RematArgumentError(f"{spec!r} is a {type(obj).__name__}, not a function that builds it")
    return obj


def takes_batch(fn: Callable) -> bool:
    """Whether `fn` can be called with one positional argument (the batch size)."""
    try:
        inspect.signature(fn).bind(1)
    except (TypeError, ValueError):
        return False
    return True


def _split_inputs(value: Any, spec: str) -> tuple[tuple, dict]:
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, (tuple, list)):
        if len(value) == 2 and isinstance(value[1], dict) and isinstance(value[0], (tuple, list)):
            return tuple(value[0]), dict(value[1])
        return tuple(value), {}
    raise RematArgumentError(f"{spec} returned a {type(value).__name__}; it must return the example inputs: a "
                             f"tensor, a tuple of arguments, a dict of keyword arguments, or (args, kwargs)")


def _to(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def build(model_fn: Callable, inputs_fn: Callable, batch: int | None = None, device: str | None = None,
          model: nn.Module | None = None, names: tuple[str, str] = ("--model", "--inputs")
          ) -> tuple[nn.Module, tuple, dict]:
    """The model (built by `model_fn` unless given) and the example inputs (`inputs_fn(batch)` or
    `inputs_fn()`), moved to `device` when one is given."""
    if model is None:
        model = model_fn()
        if not isinstance(model, nn.Module):
            raise RematArgumentError(f"{names[0]} returned a {type(model).__name__}, not a torch.nn.Module")
    args, kwargs = _split_inputs(inputs_fn(batch) if batch is not None else inputs_fn(), names[1])
    if device is not None:
        model.to(device)
        args, kwargs = _to(args, device), _to(kwargs, device)
    return model, args, kwargs


# ---- capture and solve --------------------------------------------------------------------------

def capture_graph(model: nn.Module, args: tuple, kwargs: dict, fused_attention: bool | str = True,
                  device: str = "cpu", chunked_loss: bool = False) -> tuple[TrainingGraph, str]:
    """The training step's graph for `device` ("cpu" or "cuda": its memory model), and how it was
    captured: on fake tensors (graph_capture/fake_capture.py: no memory for the step, and a plan for
    a GPU can be made without one), or, when the model cannot run on fake tensors, on real ones
    (moved to `device`, which must then be here). `chunked_loss`: the loss head traced as remat's
    chunked op where the router can (remat.loss_head)."""
    try:
        from remat.graph_capture.fake_capture import capture_without_memory
    except ImportError:  # a remat without it
        capture_without_memory, why = None, "not available"
    if capture_without_memory is not None:
        try:
            graph = capture_without_memory(model, args, kwargs or None, device=device, fused_attention=fused_attention,
                                           chunked_loss=chunked_loss)
            return graph, "fake tensors"
        except Exception as e:  # data-dependent shapes, ops without a fake kernel, ...: real tensors
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if device == "cuda" and not torch.cuda.is_available():
        raise RematArgumentError(f"this model cannot be traced on fake tensors ({why}), and this machine has no "
                                 f"GPU to trace it for cuda on real ones: solve on a machine with a GPU")
    model.to(device)
    args, kwargs = _to(args, device), _to(kwargs, device)
    return (capture(model, args, kwargs or None, fused_attention=fused_attention, chunked_loss=chunked_loss),
            f"real tensors (fake: {why})")


def keep_all_peak(graph: TrainingGraph) -> int:
    """The simulated peak of the step that recomputes nothing."""
    return simulate(graph, keep_all_schedule(graph)).peak_bytes


def try_solve(graph: TrainingGraph, budget: int, solver: str, time_limit_s: float | None = None,
              **options) -> Plan | None:
    """`solver`'s plan under `budget`, or None when it finds none that fits (without the search
    for the smallest feasible budget that remat.solve adds)."""
    check_solve_args(graph, budget, solver, time_limit_s, options)
    try:
        plan = get_solver(solver)(graph, budget, **strategy_options(solver, time_limit_s, options).as_kwargs())
    except Exception as e:  # InfeasibleBudgetError and the strategies' own "nothing fits"
        if type(e).__name__ == "InfeasibleBudgetError":
            return None
        raise
    return plan if plan.status != "infeasible" and plan.fits else None


# ---- check: deploy on this machine and compare --------------------------------------------------

@dataclass
class CheckResult:
    """`remat check`'s measurements: the plan's module beside keep_all's and the eager model."""

    predicted_peak_bytes: int  # the plan re-simulated on the graph traced here
    measured_peak_bytes: int
    keep_all_predicted_bytes: int
    keep_all_measured_bytes: int
    step_s: float  # median over the timed steps
    keep_all_step_s: float
    eager_step_s: float
    grads_equal: bool  # loss and every gradient bit for bit
    grads_close: bool  # allclose(rtol=1e-5, atol=1e-6)
    max_grad_err: float
    tensors_compared: int
    plan: Plan = field(repr=False)


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    raise RematArgumentError(f"the model returned {type(out).__name__}"
                             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}, not a scalar loss: "
                             f"remat check runs loss = model(*inputs); loss.backward()")


def _step(module: nn.Module, args: tuple, kwargs: dict) -> Callable[[], torch.Tensor]:
    """loss = module(*args, **kwargs); loss.backward(): what the budget covers (start it with no
    gradients: `_fresh`)."""
    def step() -> torch.Tensor:
        loss = _loss_of(module(*args, **kwargs))
        loss.backward()
        return loss
    return step


def _fresh(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


def _timed(step: Callable, n: int, device: torch.device, params: list[torch.Tensor]) -> float:
    _fresh(params)
    step()  # warm-up, untimed
    times = []
    for _ in range(n):
        _fresh(params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_plan(model: nn.Module, args: tuple, kwargs: dict, plan: Plan, *, steps: int = 3, seed: int = 0,
               fused_attention: bool | str = True) -> CheckResult:
    """Deploy `plan` on `model` here, run real steps: peak, time and gradients against keep_all and
    the unmodified model (same seed, so dropout draws the same masks)."""
    from remat.api import optimize

    params = [p for p in model.parameters() if p.requires_grad]
    tensors = input_tensors(args, kwargs)
    device = next(iter(tensors), next(model.parameters(), torch.empty(0))).device
    eager = _step(model, args, kwargs)
    if fused_attention_mode(fused_attention) == "all":  # the function the module computes
        plain = eager

        def eager() -> torch.Tensor:
            with route_attention("all", model):
                return plain()
    _fresh(params)
    torch.manual_seed(seed)
    ref_loss = eager().detach().clone()
    ref = [ref_loss] + [p.grad.detach().clone() if p.grad is not None else None for p in params]
    opt = optimize(model, example_inputs=args, example_kwargs=kwargs or None, plan=plan,
                   fused_attention=fused_attention)
    keep = optimize(model, example_inputs=args, example_kwargs=kwargs or None,
                    solver="keep_all", fused_attention=fused_attention)
    resident = [model, *tensors]
    run, run_keep = _step(opt, args, kwargs), _step(keep, args, kwargs)
    _fresh(params)
    keep_measured = measure_peak(run_keep, resident=resident, device=device)
    _fresh(params)
    measured = measure_peak(run, resident=resident, device=device)
    _fresh(params)
    torch.manual_seed(seed)
    got = [run().detach()] + [p.grad for p in params]
    equal, close, err = True, True, 0.0
    for a, b in zip(got, ref):
        if a is None or b is None:
            equal = close = equal and a is None and b is None
            continue
        equal = equal and torch.equal(a, b)
        close = close and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        err = max(err, float((a.double() - b.double()).abs().max()) if a.numel() else 0.0)
    times = {name: _timed(s, steps, device, params) for name, s in (("eager", eager), ("keep", run_keep), ("plan", run))}
    for p in params:
        p.grad = None
    return CheckResult(predicted_peak_bytes=opt.plan.predicted_peak_bytes, measured_peak_bytes=measured,
                       keep_all_predicted_bytes=keep.plan.predicted_peak_bytes, keep_all_measured_bytes=keep_measured,
                       step_s=times["plan"], keep_all_step_s=times["keep"], eager_step_s=times["eager"],
                       grads_equal=equal, grads_close=close, max_grad_err=err, tensors_compared=len(ref),
                       plan=opt.plan)


# ---- max-batch: the largest batch whose plan fits -----------------------------------------------

@dataclass
class BatchSearch:
    """One strategy's largest batch under the budget (0: not even batch 1 fits)."""

    strategy: str
    batch: int
    plan: Plan | None  # its plan at that batch (with context)
    probes: dict[int, int | None] = field(default_factory=dict)  # batch -> predicted peak (None: no plan fits)
    seconds: float = 0.0
    capped: bool = False  # the search stopped at max_batch: larger batches were not tried


def largest_batch(strategy: str, budget: int, graph_at: Callable[[int], tuple[TrainingGraph, dict]], *,
                  start: int = 1, max_batch: int = 1 << 16, multiple: int = 1, time_limit_s: float | None = None,
                  options: dict | None = None, say: Callable[[str], None] = lambda s: None) -> BatchSearch:
    """The largest batch (a multiple of `multiple`, at most `max_batch`) whose `strategy` plan fits
    `budget`: gallop from `start` (doubling up, or halving down), then bisect. `graph_at(b)` gives
    the graph at batch b and the context for its plan. Assumes a plan that fits at b fits at every
    smaller batch (the peak grows with the batch)."""
    t0 = time.perf_counter()
    found = BatchSearch(strategy, 0, None)
    # the search runs over k, the batch being k * multiple
    max_k = max_batch // multiple
    start = max(1, start // multiple)

    def fits(k: int) -> bool:
        b = k * multiple
        graph, ctx = graph_at(b)
        if strategy == "keep_all":
            plan = get_solver("keep_all")(graph, budget)
            plan = plan if plan.fits else None
        else:
            plan = try_solve(graph, budget, strategy, time_limit_s, **(options or {}))
        found.probes[b] = plan.predicted_peak_bytes if plan else None
        say(f"  {strategy} batch {b}: " + (f"fits, predicted peak {plan.predicted_peak_bytes / MiB:.2f} MiB"
                                             if plan else "no plan fits"))
        if plan is not None and b > found.batch:
            found.batch, found.plan = b, dataclasses.replace(plan, context=ctx)
        return plan is not None

    lo, hi = 0, None  # lo fits (0: nothing known to), hi does not
    b = max(1, min(start, max_k))
    if fits(b):
        lo = b
        while hi is None:
            if lo >= max_k:
                found.capped = True
                break
            b = min(2 * lo, max_k)
            if fits(b):
                lo = b
            else:
                hi = b
    else:
        hi = b
        while lo == 0 and hi > 1:
            b = hi // 2
            if fits(b):
                lo = b
            else:
                hi = b
    while hi is not None and hi - lo > 1:
        b = (lo + hi) // 2
        if fits(b):
            lo = b
        else:
            hi = b
    found.seconds = time.perf_counter() - t0
    return found


# ---- the built-in GPT as factories ----------------------------------------------------------------

def default_gpt() -> nn.Module:
    """The built-in GPT (remat.default_model, default config): `--model remat.offline:default_gpt`."""
    from remat.default_model import default_model

    return default_model()


def default_gpt_batch(batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets) for the built-in GPT at `batch_size`: `--inputs remat.offline:default_gpt_batch`."""
    from remat.default_model import GPTConfig, default_inputs

    return default_inputs(GPTConfig(batch_size=batch_size))
