"""`optimize`'s settings in groups, so that a call site with many of them reads: which solver plans
with which options, and how the step is captured.

    remat.optimize(model, budget_gb=40, example_inputs=batch,
                   solver=remat.Solver("checkmate", time_limit_s=120, mip_gap=1e-3),
                   capture=remat.CaptureOptions(fused_attention="all", cost_model="measured",
                                                chunked_loss="auto"))

Each group is checked when it is made (RematArgumentError naming the bad setting). The flat
keywords of `optimize` and `remat.plan` (`solver="checkmate"`, `time_limit_s=`, the strategy's
options as keywords, `fused_attention=`, `cost_model=`, `chunked_loss=`) are shorthands for the same fields; a
setting given both in a group and as a keyword raises, so no call says two things.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from remat.validate import RematArgumentError, RematArgumentTypeError, check_chunked_loss, check_cost_model, \
    check_fused_attention, check_solver, check_time_limit

__all__ = ["Solver", "CaptureOptions", "settle"]


@dataclass(frozen=True, init=False)
class Solver:
    """The strategy that plans (remat.solver.STRATEGIES), its optional wall-clock limit, and its own
    options (`remat.Solver("checkmate", mip_gap=1e-3)`; each strategy's `Options` lists them)."""

    name: str
    time_limit_s: float | None
    options: tuple[tuple[str, Any], ...]

    def __init__(self, name: str = "checkmate", *, time_limit_s: float | None = None, **options: Any) -> None:
        check_solver(name, options)
        check_time_limit(time_limit_s)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "time_limit_s", time_limit_s)
        object.__setattr__(self, "options", tuple(sorted(options.items())))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The strategy's options as keyword arguments."""
        return dict(self.options)


@dataclass(frozen=True)
class CaptureOptions:
    """How the training step is traced: which attention runs remat's fused op (`fused_attention`,
    see `remat.optimize`), what the solver minimises (`cost_model`: "flops" or "measured") and
    whether the loss head is traced as remat's chunked op (`chunked_loss`: "auto", the cheaper
    plan of both; True/"on"; False/"off")."""

    fused_attention: bool | str = True
    cost_model: str = "flops"
    chunked_loss: bool | str = "auto"

    def __post_init__(self) -> None:
        check_fused_attention(self.fused_attention)
        check_cost_model(self.cost_model)
        check_chunked_loss(self.chunked_loss)


def settle(solver: Any, time_limit_s: Any, solver_kwargs: dict, capture: Any,
           **capture_keywords: Any) -> tuple[Solver, CaptureOptions]:
    """The groups a call runs with, from its groups and its flat keywords (see the module
    docstring). `capture_keywords`: the call's CaptureOptions fields given as keywords (their
    default values count as not given)."""
    if isinstance(solver, Solver):
        if time_limit_s is not None or solver_kwargs:
            given = ", ".join(["time_limit_s"] * (time_limit_s is not None) + sorted(solver_kwargs))
            raise RematArgumentError(f"solver=remat.Solver(...) holds the solver's settings; {given} given as "
                                     f"keywords too: give each in one place")
    else:
        solver = Solver(solver, time_limit_s=time_limit_s, **solver_kwargs) if isinstance(solver, str) else \
            _not_a_solver(solver)
    defaults = {f.name: f.default for f in fields(CaptureOptions)}
    given = {k: v for k, v in capture_keywords.items() if not (v is defaults[k] or v == defaults[k])}
    if capture is None:
        return solver, CaptureOptions(**capture_keywords)
    if not isinstance(capture, CaptureOptions):
        raise RematArgumentTypeError(f"capture must be a remat.CaptureOptions or None, got {type(capture).__name__}")
    if given:
        raise RematArgumentError(f"capture=remat.CaptureOptions(...) holds the capture's settings; "
                                 f"{', '.join(sorted(given))} given as keywords too: give each in one place")
    return solver, capture


def _not_a_solver(solver: Any) -> Solver:
    from remat.solver import STRATEGIES

    raise RematArgumentTypeError(f"solver must be a string, one of {', '.join(STRATEGIES)}, or a remat.Solver; got "
                                 f"{type(solver).__name__} {solver!r}")
