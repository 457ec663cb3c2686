"""Argument checks for the public API, run before any expensive work (tracing, solving).

Every check raises one clear error naming the argument, what it got and what is allowed:
`RematArgumentError` (a ValueError) for a bad value, `RematArgumentTypeError` (a
RematArgumentError and a TypeError) for a value of the wrong type. `optimize`, `capture` and
`solve` call `check_optimize_args`, `check_capture_args` and `check_solve_args` on their first
line, so a NaN budget or a misspelt solver fails in microseconds, not after a minute of tracing.
"""
from __future__ import annotations

from remat.core.errors import RematError

import math
import numbers
import os
from typing import Any

__all__ = ["RematArgumentError", "RematArgumentTypeError", "budget_in_bytes", "check_optimize_args",
           "check_capture_args", "check_solve_args", "check_solver", "check_time_limit", "check_cost_model",
           "check_fused_attention", "check_chunked_loss", "example_arguments"]

GB = 1e9  # budget_gb is in units of 10^9 bytes


class RematArgumentError(RematError, ValueError):
    """An argument of remat's API has a value remat cannot use; the message names it."""


class RematArgumentTypeError(RematArgumentError, TypeError):
    """An argument of remat's API has the wrong type; the message names it."""


def _kind(x: Any) -> str:
    return type(x).__name__


def _real(name: str, x: Any) -> float:
    """A finite real number (bools and strings are refused: `True` is no budget)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise RematArgumentTypeError(f"{name} must be a number, got {_kind(x)} {x!r}")
    if not math.isfinite(float(x)):
        raise RematArgumentError(f"{name} must be a finite positive number, got {x!r}")
    return float(x)


def budget_in_bytes(budget_gb: Any = None, budget_bytes: Any = None) -> int | None:
    """The budget in bytes from `budget_gb` (units of 10^9 bytes) or `budget_bytes` (an integer,
    or a float with an integral value), or None when neither is given."""
    if budget_gb is not None and budget_bytes is not None:
        raise RematArgumentError(f"give budget_gb or budget_bytes, not both (got budget_gb={budget_gb!r}, "
                                 f"budget_bytes={budget_bytes!r})")
    if budget_gb is not None:
        gb = _real("budget_gb", budget_gb)
        if gb <= 0:
            raise RematArgumentError(f"budget_gb must be positive, got {budget_gb!r}")
        if not math.isfinite(gb * GB):
            raise RematArgumentError(f"budget_gb={budget_gb!r} is too large to count in bytes")
        b = int(gb * GB)
        if b <= 0:
            raise RematArgumentError(f"budget_gb={budget_gb!r} is less than one byte; the budget must be positive")
        return b
    if budget_bytes is not None:
        if isinstance(budget_bytes, numbers.Integral) and not isinstance(budget_bytes, bool):
            b = int(budget_bytes)
        else:
            x = _real("budget_bytes", budget_bytes)
            if not x.is_integer():
                raise RematArgumentError(f"budget_bytes must be a whole number of bytes, got {budget_bytes!r}")
            b = int(x)
        if b <= 0:
            raise RematArgumentError(f"budget_bytes must be positive, got {budget_bytes!r}")
        return b
    return None


def check_time_limit(time_limit_s: Any) -> None:
    """A wall-clock limit in seconds: positive, or None (the solver's deterministic work limits)."""
    if time_limit_s is None:  # no wall-clock limit: the solver's deterministic work limits
        return
    if _real("time_limit_s", time_limit_s) <= 0:
        raise RematArgumentError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")


def check_solver(solver: Any, solver_kwargs: dict) -> None:
    """A strategy name and its options: RematArgumentError naming a bad one."""
    from remat.solver import STRATEGIES, get_options

    if not isinstance(solver, str):
        raise RematArgumentTypeError(f"solver must be a string, one of {', '.join(STRATEGIES)}; got {_kind(solver)} "
                                     f"{solver!r}")
    if solver not in STRATEGIES:
        raise RematArgumentError(f"unknown solver {solver!r}; choose one of {', '.join(STRATEGIES)}")
    if "time_limit_s" in solver_kwargs:
        raise RematArgumentError("time_limit_s is an argument of its own, not a solver option")
    from remat.solver.options import OptionsError

    try:
        get_options(solver).make(solver, solver_kwargs)
    except OptionsError as e:
        raise RematArgumentError(str(e)) from e


def check_fused_attention(fused_attention: Any) -> None:
    """A fused_attention mode (attention/router.py)."""
    from remat.attention.router import fused_attention_mode

    try:
        fused_attention_mode(fused_attention)
    except (TypeError, ValueError):
        raise RematArgumentError(f"fused_attention must be True, False, 'exact', 'all' or 'off', "
                                 f"got {fused_attention!r}") from None


def check_chunked_loss(chunked_loss: Any, allow_auto: bool = True) -> None:
    """`chunked_loss`: True/"on", False/"off", or "auto" (where planning chooses; not for capture)."""
    from remat.loss_head.router import chunked_loss_mode

    try:
        mode = chunked_loss_mode(chunked_loss)
    except (TypeError, ValueError):
        mode = None
    if mode is None or (mode == "auto" and not allow_auto):
        allowed = "True, False, 'on', 'off' or 'auto'" if allow_auto else "True or False"
        raise RematArgumentError(f"chunked_loss must be {allowed}, got {chunked_loss!r}")


def check_cost_model(cost_model: Any) -> None:
    """One of the cost models the solver can minimise (graph_capture/op_timing.py)."""
    from remat.graph_capture.op_timing import COST_MODELS

    if not isinstance(cost_model, str):
        raise RematArgumentTypeError(f"cost_model must be a string, one of {', '.join(map(repr, COST_MODELS))}; got "
                                     f"{_kind(cost_model)} {cost_model!r}")
    if cost_model not in COST_MODELS:
        raise RematArgumentError(f"unknown cost_model {cost_model!r}; choose one of "
                                 f"{', '.join(map(repr, COST_MODELS))}")


def _model(model: Any) -> None:
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        raise RematArgumentTypeError(f"model must be a torch.nn.Module, got {_kind(model)}")
    from remat.runtime.distributed import distributed_wrapper

    wrapped = distributed_wrapper(model)  # DDP(model), a sharded model: the other order is the supported one
    if wrapped:
        raise RematArgumentError(wrapped)


def _example_inputs(example_inputs: Any, example_kwargs: Any) -> None:
    import torch

    if example_inputs is None:
        raise RematArgumentError("example_inputs is required: remat traces one training step to plan it")
    if not isinstance(example_inputs, (torch.Tensor, list, tuple)):
        raise RematArgumentTypeError(f"example_inputs must be a tensor or a tuple of arguments, got "
                                     f"{_kind(example_inputs)}")
    if example_kwargs is not None:
        if not isinstance(example_kwargs, dict):
            raise RematArgumentTypeError(f"example_kwargs must be a dict of keyword arguments or None, got "
                                         f"{_kind(example_kwargs)}")
        bad = [k for k in example_kwargs if not isinstance(k, str)]
        if bad:
            raise RematArgumentTypeError(f"example_kwargs' keys must be argument names (str), got {bad[0]!r}")


def example_arguments(example_inputs: Any) -> tuple:
    """The example inputs as a tuple of positional arguments (a tensor alone is one argument)."""
    import torch

    if example_inputs is None:
        raise ValueError("example_inputs is required: remat traces one training step to plan it")
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a tensor or a tuple of arguments, got {type(example_inputs).__name__}")


def check_capture_args(model: Any, example_inputs: Any, example_kwargs: Any = None,
                       fused_attention: Any = True, cost_model: Any = "flops") -> None:
    """The arguments of `remat.capture`."""
    _model(model)
    _example_inputs(example_inputs, example_kwargs)
    check_fused_attention(fused_attention)
    check_cost_model(cost_model)


def check_solve_args(graph: Any, budget_bytes: Any, solver: Any = "checkmate", time_limit_s: Any = 60.0,
                     solver_kwargs: dict | None = None) -> None:
    """The arguments of `remat.solve` (a budget of None asks for no budget)."""
    from remat.core.training_graph import TrainingGraph

    if not isinstance(graph, TrainingGraph):
        raise RematArgumentTypeError(f"graph must be a TrainingGraph (from remat.capture), got {_kind(graph)}")
    budget_in_bytes(budget_bytes=budget_bytes)
    check_solver(solver, solver_kwargs or {})
    check_time_limit(time_limit_s)


def check_optimize_args(model: Any, budget_gb: Any, budget_bytes: Any, example_inputs: Any, example_kwargs: Any,
                        solver: Any, time_limit_s: Any, plan: Any, fused_attention: Any,
                        solver_kwargs: dict | None = None, cost_model: Any = "flops", compiled: Any = False,
                        solve_on_rank: Any = None, cache_limit: Any = 8) -> None:
    """The arguments of `remat.optimize`."""
    from remat.core.plan import Plan

    check_capture_args(model, example_inputs, example_kwargs, fused_attention, cost_model)
    budget = budget_in_bytes(budget_gb, budget_bytes)
    if plan is not None and not isinstance(plan, (Plan, str, os.PathLike)):
        raise RematArgumentTypeError(f"plan must be a remat.Plan or the path of a saved plan, got {_kind(plan)}")
    if budget is None and plan is None and solver != "keep_all":  # keep_all needs no budget
        raise RematArgumentError("give budget_gb or budget_bytes (or a saved plan=, or solver='keep_all')")
    check_solver(solver, solver_kwargs or {})
    check_time_limit(time_limit_s)
    if not isinstance(compiled, bool):
        raise RematArgumentTypeError(f"compiled must be True or False, got {_kind(compiled)}")
    if isinstance(cache_limit, bool) or not isinstance(cache_limit, int):
        raise RematArgumentTypeError(f"cache_limit must be a positive integer, got {_kind(cache_limit)}")
    if cache_limit < 1:
        raise RematArgumentError(f"cache_limit must be at least 1 (planned steps kept), got {cache_limit}")
    if compiled and budget is None:
        raise RematArgumentError("compiled=True plans again under the budget while the compiled step exceeds it: "
                                 "give budget_gb or budget_bytes")
    if compiled and plan is not None:
        raise RematArgumentError("compiled=True re-plans until the compiled step fits, which a saved plan cannot: "
                                 "deploy a saved plan (e.g. the plan of a module optimized with compiled=True) with "
                                 "torch.compile(remat.optimize(model, plan=...)) instead")
    if compiled and solve_on_rank is not None:
        raise RematArgumentError("compiled=True measures and re-plans on each rank, which solve_on_rank cannot "
                                 "keep identical: optimize with compiled=True on one rank, save the plan, and "
                                 "deploy it on every rank")
