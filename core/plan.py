"""Plan: what a solver decides, in a form that can be saved, loaded and deployed later.

The plan file (schema version 2, `Plan.save` / `Plan.load`) is JSON, never a pickle: one line per
top-level key, first what a reader wants (format, schema_version, strategy, budget, predicted peak,
cost, bound, gap, status, context: the model, inputs, device, torch version and solver options it
was made for, filled in by remat/deployment.py), then the per-module summary (core/module_summary.py),
the schedule and the TrainingGraph it was solved on. With its graph the file checks itself when it
is loaded: the graph must have the fingerprint the plan names, the schedule must run on it
(`simulate`) and give the peak the file states, so an edited or damaged file is refused with one
line saying what is wrong (PlanFileError), never deployed. Files of schema version 1 (written
before versions were recorded: no context, no graph) still load; a version this remat does not
know is refused with the advice to solve again.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path

from remat.core.errors import RematError
from remat.core.training_graph import TrainingGraph
from remat.core.plan_details import PlanDetails
from remat.core.simulator import simulate

__all__ = ["Plan", "PlanStatus", "plan_from_schedule", "finished", "LOWEST_PEAK", "InfeasibleBudgetError", "PlanFileError", "PlanFileNotFoundError",
           "PlanMismatchError", "SCHEMA_VERSION", "FORMAT", "PlanDetails"]

SCHEMA_VERSION = 2  # of the plan file; 1: the files written before it was recorded (no version key)
FORMAT = "remat plan"  # the file's "format" key, so a foreign JSON file is named as such
_SOLVE_AGAIN = "solve again (remat solve, or remat.optimize with a budget) and save the new plan"


# A budget below every plan's peak: a strategy asked for it answers with the lowest-peak plan it
# has (status "infeasible"). The one name for "the lowest peak this strategy reaches".
LOWEST_PEAK = 1


class PlanStatus(StrEnum):
    """What a solver can say about its plan (a str: `plan.status == "optimal"` holds, and the plan
    file stores the word)."""

    OPTIMAL = "optimal"  # proven: gap within the solver's mip_gap
    FEASIBLE = "feasible"  # fits the budget; plan.gap says how far from proven
    HEURISTIC = "heuristic"  # a baseline's plan: fits, nothing proven
    INFEASIBLE = "infeasible"  # nothing fits; the schedule is the lowest-peak one found


class InfeasibleBudgetError(RematError, ValueError):
    """No plan of this strategy fits the budget; `min_feasible_bytes` is the smallest budget
    for which one was found (None when unknown)."""

    def __init__(self, message: str, min_feasible_bytes: int | None = None):
        super().__init__(message)
        self.min_feasible_bytes = min_feasible_bytes


class PlanFileError(RematError, ValueError):
    """A saved plan cannot be read: the file is missing, empty, not JSON (e.g. truncated) or not a
    plan. The message names the file and what is wrong."""


class PlanMismatchError(RematError, ValueError):
    """A plan made for another training graph (model, shapes, device, mode, rank) than the one it is
    deployed on; the message says what differs."""


class PlanFileNotFoundError(PlanFileError, FileNotFoundError):
    """The plan file does not exist (also a FileNotFoundError, as it was before)."""


@dataclass(frozen=True)
class Plan:
    """A strategy's answer: the schedule to run and what the simulator predicts for it (saved and
    loaded as JSON; tied to its graph by the graph's fingerprint). Frozen: a changed plan is a new
    one (`dataclasses.replace`), so a plan handed out, cached or saved never changes under its
    holder."""

    strategy: str  # "checkmate", "keep_all", "equal_spacing", ...
    budget_bytes: int | None  # what it was asked to fit (None: no budget)
    schedule: list[str]  # flat execution order over the graph's nodes; repeats are recomputations
    predicted_peak_bytes: int  # the simulator's peak for `schedule`, resident memory included
    total_cost: float
    extra_cost: float  # cost of recomputation, FLOP-equivalents
    extra_flops: int  # matmul-like FLOPs of recomputation (what FlopCounterMode adds)
    status: PlanStatus  # a PlanStatus (a plain string is converted; an unknown one is an error)
    solve_time_s: float = 0.0
    gap: float | None = None  # relative MIP gap certified by the solver (0 when optimal)
    lower_bound: float | None = None  # proven lower bound on the optimal extra cost at this budget
    graph_fingerprint: str = ""  # TrainingGraph.fingerprint() of the graph it was made for
    details: PlanDetails = field(default_factory=dict)  # how the strategy found it (keys: core/plan_details.py)
    # what it was made for: model, parameters, inputs, device, torch version, solver options
    # (remat/deployment.py fills it in; empty for plans that never left a solver)
    context: dict = field(default_factory=dict)
    # the graph `schedule` was judged on (plan_from_schedule sets it); saved with the plan
    graph: TrainingGraph | None = field(default=None, repr=False, compare=False)
    # the file it was loaded from (Plan.load sets it; never saved): lets later checks name the file
    loaded_from: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.status, PlanStatus):
            try:
                object.__setattr__(self, "status", PlanStatus(self.status))
            except ValueError:
                raise ValueError(f"unknown plan status {self.status!r}; one of "
                                 f"{', '.join(s.value for s in PlanStatus)}") from None

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

    def to_dict(self) -> dict:
        """The plan file's content (schema version SCHEMA_VERSION): the summary first, then the
        per-module summary, the schedule and the graph."""
        from remat.core.module_summary import module_summary

        d = {"format": FORMAT, "schema_version": SCHEMA_VERSION}
        plain = asdict(dataclasses.replace(self, graph=None))
        del plain["graph"], plain["loaded_from"]
        plain["status"] = self.status.value
        schedule = plain.pop("schedule")
        d.update(plain)
        if self.graph is not None:
            d["modules"] = module_summary(self.graph, self.schedule)
        d["schedule"] = schedule
        if self.graph is not None:
            d["graph"] = self.graph.to_dict()
        return d

    def to_json(self) -> str:
        """The plan file's text: one line per top-level key (readable with head or grep)."""
        d = self.to_dict()
        return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in d.items()) + "\n}"

    @classmethod
    def from_json(cls, s: str, source: str = "the plan JSON") -> "Plan":
        """The Plan `s` holds; PlanFileError (naming `source`) when it is not valid JSON of a Plan,
        of another schema version, or when its schedule does not run on its own graph."""
        if not s.strip():
            raise PlanFileError(f"{source} is empty: not a saved plan")
        try:
            data = json.loads(s)
        except json.JSONDecodeError as e:
            raise PlanFileError(f"{source} is not valid JSON ({e}); was it truncated? Save the plan again, "
                                f"or {_SOLVE_AGAIN}") from None
        data = _unwrapped(data, source)
        graph_data = data.pop("graph", None) if isinstance(data, dict) else None
        plan = cls(**_checked_fields(data, source))
        if graph_data is not None:
            plan = dataclasses.replace(plan, graph=_own_graph(plan, graph_data, source))
        return plan

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
        plan = cls.from_json(text, source=f"plan file {str(path)!r}")
        return dataclasses.replace(plan, loaded_from=str(path))


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
    "status": (lambda x: x in {s.value for s in PlanStatus}, f"one of {', '.join(s.value for s in PlanStatus)}"),
    "solve_time_s": (_is_num, "a number"),
    "gap": (lambda x: x is None or _is_num(x), "a number or null"),
    "graph_fingerprint": (lambda x: isinstance(x, str), "a string"),
    "details": (lambda x: isinstance(x, dict), "an object"),
    "lower_bound": (lambda x: x is None or (_is_num(x) and not math.isnan(x)), "a number or null"),
    "context": (lambda x: isinstance(x, dict), "an object"),
}


def _unwrapped(data, source: str):
    """The plan's fields from a parsed plan file: its format and schema version checked and
    dropped, with the derived per-module summary (recomputed from the graph whenever needed)."""
    if not isinstance(data, dict):
        return data  # _checked_fields names what it is
    data = dict(data)
    fmt = data.pop("format", FORMAT)
    if fmt != FORMAT:
        raise PlanFileError(f"{source} is a {fmt!r} file, not a {FORMAT!r} file: not a saved plan")
    version = data.pop("schema_version", 1)
    if not (_is_int(version) and version in (1, SCHEMA_VERSION)):
        what = f"schema version {version!r}" if _is_int(version) else f"an invalid schema version {version!r:.40}"
        raise PlanFileError(f"{source} has {what}; this remat reads versions 1 to {SCHEMA_VERSION}: "
                            f"{_SOLVE_AGAIN} with this remat, or deploy it with the remat that wrote it")
    if version == 1 and ("graph" in data or "context" in data):
        raise PlanFileError(f"{source} has no schema_version but holds a graph or context: it was edited; {_SOLVE_AGAIN}")
    modules = data.pop("modules", [])
    if not isinstance(modules, list):
        raise PlanFileError(f"{source} is not a valid plan: modules must be a list, got {modules!r:.80}")
    return data


def _own_graph(plan: "Plan", graph_data, source: str) -> TrainingGraph:
    """The graph saved with `plan`, after checking that the plan is what it says on that graph:
    the graph has the plan's fingerprint, the schedule runs on it and peaks where the file says."""
    from remat.core.simulator import ScheduleError

    try:
        graph = TrainingGraph.from_dict(graph_data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanFileError(f"{source} holds a damaged graph ({type(e).__name__}: {e}); {_SOLVE_AGAIN}") from None
    if graph.fingerprint() != plan.graph_fingerprint:
        raise PlanFileError(f"{source}: its graph has fingerprint {graph.fingerprint()}, but the plan names "
                            f"{plan.graph_fingerprint!r}: the file was edited or damaged; {_SOLVE_AGAIN}")
    try:
        sim = simulate(graph, plan.schedule)
    except ScheduleError as e:
        raise PlanFileError(f"{source}: its schedule cannot run on its graph: {e}; the schedule was edited "
                            f"or damaged: {_SOLVE_AGAIN}") from None
    if sim.peak_bytes != plan.predicted_peak_bytes:
        raise PlanFileError(f"{source} says its schedule peaks at {plan.predicted_peak_bytes} bytes, but on its "
                            f"graph the schedule peaks at {sim.peak_bytes} bytes: the file was edited; {_SOLVE_AGAIN}")
    return graph


def _checked_fields(data, source: str) -> dict:
    """`data` (parsed JSON) as Plan's keyword arguments, or PlanFileError saying what is wrong."""
    if not isinstance(data, dict):
        raise PlanFileError(f"{source} holds a JSON {type(data).__name__}, not a plan (a JSON object)")
    names = {f.name for f in fields(Plan)}
    required = [f.name for f in fields(Plan) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise PlanFileError(f"{source} is not a plan: it lacks {', '.join(missing)}")
    unknown = sorted(set(data) - names | ({"loaded_from"} & set(data)))
    if unknown:
        raise PlanFileError(f"{source} has fields this version of remat does not know: {', '.join(unknown)}")
    for name, (ok, what) in _FIELD_CHECKS.items():
        if name in data and not ok(data[name]):
            raise PlanFileError(f"{source} is not a valid plan: {name} must be {what}, got {data[name]!r:.80}; "
                                f"{_SOLVE_AGAIN}")
    return data


def plan_from_schedule(graph: TrainingGraph, schedule: list[str], *, strategy: str,
                       budget_bytes: int | None, status: PlanStatus | str, solve_time_s: float = 0.0,
                       gap: float | None = None, lower_bound: float | None = None,
                       details: PlanDetails | dict | None = None) -> Plan:
    """Judge `schedule` with the simulator and package it as a Plan (the one constructor the
    strategies use)."""
    sim = simulate(graph, schedule)
    return Plan(strategy=strategy, budget_bytes=budget_bytes, schedule=list(schedule),
                predicted_peak_bytes=sim.peak_bytes, total_cost=sim.total_cost,
                extra_cost=sim.extra_cost, extra_flops=sim.extra_flops, status=status,
                solve_time_s=solve_time_s, gap=gap, lower_bound=lower_bound, graph_fingerprint=graph.fingerprint(),
                details=dict(details or {}), graph=graph)


def finished(plan: Plan, t0: float, **changes) -> Plan:
    """`plan` (with `changes`) as a strategy returns it: its solve time counted from `t0`
    (time.perf_counter()), and status "infeasible" when it does not fit its budget."""
    plan = dataclasses.replace(plan, **changes) if changes else plan
    status = plan.status if plan.fits else PlanStatus.INFEASIBLE
    return dataclasses.replace(plan, solve_time_s=time.perf_counter() - t0, status=status)
