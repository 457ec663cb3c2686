"""Plan: what a solver decides, in a form that can be saved, loaded and deployed later."""
from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from remat.graph_capture.training_graph import TrainingGraph
from remat.solver.simulator import simulate

__all__ = ["Plan", "plan_from_schedule", "InfeasibleBudgetError", "PlanFileError"]


class InfeasibleBudgetError(ValueError):
    """No plan of this strategy fits the budget; `min_feasible_bytes` is the smallest budget
    for which one was found (None when unknown)."""

    def __init__(self, message: str, min_feasible_bytes: int | None = None):
        super().__init__(message)
        self.min_feasible_bytes = min_feasible_bytes


class PlanFileError(ValueError):
    """A saved plan cannot be read: the file is missing, empty, not JSON (e.g. truncated) or not a
    plan. The message names the file and what is wrong."""


class PlanFileNotFoundError(PlanFileError, FileNotFoundError):
    """The plan file does not exist (also a FileNotFoundError, as it was before)."""


@dataclass
class Plan:
    """A strategy's answer: the schedule to run and what the simulator predicts for it (saved and
    loaded as JSON; tied to its graph by the graph's fingerprint)."""

    strategy: str  # "checkmate", "keep_all", "equal_spacing", ...
    budget_bytes: int | None  # what it was asked to fit (None: no budget)
    schedule: list[str]  # flat execution order over the graph's nodes; repeats are recomputations
    predicted_peak_bytes: int  # the simulator's peak for `schedule`, resident memory included
    total_cost: float
    extra_cost: float  # cost of recomputation, FLOP-equivalents
    extra_flops: int  # matmul-like FLOPs of recomputation (what FlopCounterMode adds)
    status: str  # "optimal", "feasible" (gap below), "heuristic", or "infeasible"
    solve_time_s: float = 0.0
    gap: float | None = None  # relative MIP gap certified by the solver (0 when optimal)
    graph_fingerprint: str = ""  # TrainingGraph.fingerprint() of the graph it was made for
    details: dict = field(default_factory=dict)  # strategy-specific numbers (coarse size, k, ...)

    @property
    def recomputed(self) -> dict[str, list[int]]:
        """node name -> the schedule steps at which it is recomputed."""
        seen: set[str] = set()
        out: dict[str, list[int]] = {}
        for s, name in enumerate(self.schedule):
            if name in seen:
                out.setdefault(name, []).append(s)
            seen.add(name)
        return out

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.predicted_peak_bytes <= self.budget_bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str, source: str = "the plan JSON") -> "Plan":
        """The Plan `s` holds; PlanFileError (naming `source`) when it is not valid JSON of a Plan."""
        if not s.strip():
            raise PlanFileError(f"{source} is empty: not a saved plan")
        try:
            data = json.loads(s)
        except json.JSONDecodeError as e:
            raise PlanFileError(f"{source} is not valid JSON ({e}); was it truncated? Save the plan again") from None
        return cls(**_checked_fields(data, source))

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically: a temporary file in the same folder renamed over
        `path`, so a crash or a full disk never leaves a truncated plan behind."""
        path = Path(path)
        text = self.to_json()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        # os.open with mode 0o666 lets the umask decide the permissions, as a plain open() would
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """The plan saved at `path`; PlanFileError naming the file when it is missing, empty,
        truncated or not a plan."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise PlanFileNotFoundError(f"plan file {str(path)!r} does not exist") from None
        except IsADirectoryError:
            raise PlanFileError(f"plan file {str(path)!r} is a directory, not a saved plan") from None
        except UnicodeDecodeError:
            raise PlanFileError(f"plan file {str(path)!r} is not text: not a saved plan") from None
        return cls.from_json(text, source=f"plan file {str(path)!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# what each field of a saved plan must hold (fields not listed here are not type-checked)
_FIELD_CHECKS = {
    "strategy": (lambda x: isinstance(x, str), "a string"),
    "budget_bytes": (lambda x: x is None or (_is_int(x) and x >= 0), "a non-negative integer or null"),
    "schedule": (lambda x: isinstance(x, list) and all(isinstance(n, str) for n in x), "a list of node names"),
    "predicted_peak_bytes": (lambda x: _is_int(x) and x >= 0, "a non-negative integer"),
    "total_cost": (lambda x: _is_num(x) and math.isfinite(x), "a finite number"),
    "extra_cost": (lambda x: _is_num(x) and math.isfinite(x), "a finite number"),
    "extra_flops": (_is_int, "an integer"),
    "status": (lambda x: isinstance(x, str), "a string"),
    "solve_time_s": (_is_num, "a number"),
    "gap": (lambda x: x is None or _is_num(x), "a number or null"),
    "graph_fingerprint": (lambda x: isinstance(x, str), "a string"),
    "details": (lambda x: isinstance(x, dict), "an object"),
}


def _checked_fields(data, source: str) -> dict:
    """`data` (parsed JSON) as Plan's keyword arguments, or PlanFileError saying what is wrong."""
    if not isinstance(data, dict):
        raise PlanFileError(f"{source} holds a JSON {type(data).__name__}, not a plan (a JSON object)")
    names = {f.name for f in fields(Plan)}
    required = [f.name for f in fields(Plan) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise PlanFileError(f"{source} is not a plan: it lacks {', '.join(missing)}")
    unknown = sorted(set(data) - names)
    if unknown:
        raise PlanFileError(f"{source} has fields this version of remat does not know: {', '.join(unknown)}")
    for name, (ok, what) in _FIELD_CHECKS.items():
        if name in data and not ok(data[name]):
            raise PlanFileError(f"{source} is not a valid plan: {name} must be {what}, got {data[name]!r:.80}")
    return data


def plan_from_schedule(graph: TrainingGraph, schedule: list[str], *, strategy: str,
                       budget_bytes: int | None, status: str, solve_time_s: float = 0.0,
                       gap: float | None = None, details: dict | None = None) -> Plan:
    """Judge `schedule` with the simulator and package it as a Plan."""
    sim = simulate(graph, schedule)
    return Plan(strategy=strategy, budget_bytes=budget_bytes, schedule=list(schedule),
                predicted_peak_bytes=sim.peak_bytes, total_cost=sim.total_cost,
                extra_cost=sim.extra_cost, extra_flops=sim.extra_flops, status=status,
                solve_time_s=solve_time_s, gap=gap, graph_fingerprint=graph.fingerprint(),
                details=dict(details or {}))
