"""One call of a model, planned: trace it, decide its plan, lay its graph out by that plan.

    trace   graph_capture: AOTAutograd's joint forward+backward graph of the call -> TrainingGraph
    decide  a plan for that graph: a plan already made for this call, judged again on the new trace;
            keep_all where it fits; another call's schedule where it fits as tightly; or a solve
    lower   runtime/partition.py: the joint graph in the plan's order, split into forward and backward

Why this file is long: the head choice (`StepPlanner._best_head`) runs the same trace, decide and
lower steps as one call's plan, in the order of traces and solves its measurements set (each head
traced once where it can be, its graph solved alone, after the other, or at once).

`planned_step` runs the three for one call and returns the runtime's PlannedStep. `StepPlanner` is
what a RematModule calls for every kind of call (shape, requires_grad pattern, mode) it has not seen
(runtime/module.py); `remat.optimize` plans the example inputs with it.

The three run as plain calls (`planned_step`): AOTAutograd traces the joint graph and stops
(graph_capture/joint.py `capture_training_step`); the TrainingGraph is built from it and decided
on; the joint graph is laid out by the plan; AOTAutograd then compiles the two graphs it is handed.
Errors while deciding (an infeasible budget, a saved plan for another graph) are remat's own and
leave as they are.

**A call the module has not seen** (another batch size, sequence length, requires_grad pattern) is
traced (the graph depends on it), then planned in the first of these ways that applies:

1. a plan made for this very key before (a copied or unpickled module; a saved plan): judged again on
   the new trace, no solve;
2. checkmate, and keep_all's peak fits the budget: keep_all is optimal (nothing recomputed), no solve;
3. checkmate, and a schedule planned for another call runs on this graph (the same nodes, op for op,
   at other sizes: `TrainingGraph.structure_fingerprint`): it is simulated at the new sizes (the peak
   is checked, never assumed) and serves if it fits and uses at least REUSE_TIGHTNESS of the budget
   (with more room left, a plan that recomputes less is likely: solve instead), or if it fits and
   the other call's graph is this very graph (only a non-tensor argument's value differed: a step
   counter, a flag), so a Python number that changes every call costs a trace, never a solve;
4. otherwise the strategy solves the graph (baselines always do: they are fast).
The budget holds at every shape: where no plan fits, InfeasibleBudgetError names the call and the
smallest feasible budget for it.

**The loss head** (`chunked_loss`, remat/loss_head/): a linear head followed by cross-entropy can be
traced as the chunked op, which keeps no [tokens, vocab] tensor but computes the logits once more in
the backward. "on" traces it so wherever the router proves it the model's function, "off" never;
"auto" (the default) makes it checkmate's choice (the baselines keep the model's head), per call:
the step is planned with the model's own head first; where that plan recomputes nothing, it is kept
(the chunked head would only add its matmul), and so is a fitting plan whose graph has no
log-softmax computed from a linear (the only head the router can take) of at least HEAD_SHARE (1%)
of the budget (nothing a chunked head could save is worth a second trace); otherwise (a plan that
recomputes, or no plan that fits) the step is traced again with the chunked head, where its graph
has such a log-softmax at all, and planned too, and the plan that fits with the lower total cost
(the graph's cost plus its recomputations) is kept. The chunked head's graph is solved only if the
rows' bound (solver/checkmate/peak_rows.py) leaves it room to cost less in all than the model's
head's plan; otherwise it is dropped after that bound (HF Mamba and Funnel of
benchmarks/unseen_models.py at half their activation memory: remat.optimize 25 -> 16 s and 23 -> 17
s, the same plans). At the smallest budget already found for the model's head's graph (the budget
a refusal named, its lowest-peak search cached; within that search's resolution,
peak_bisection.PEAK_RESOLUTION), where that bound seldom prunes, the chunked head
is traced before either is solved, and the two graphs are solved at once inside that trace
(solving.at_once: two threads, HiGHS lets go of the GIL, each solve the one it would be alone, so
the plan kept is the same); a chunked head that wins is lowered in that very trace, a model's head
that wins is traced again to be lowered with its plan (dots.llm1 at its smallest
budget: 112.6 -> 53.6 s, `benchmarks/unseen_models.py --smallest --models dots1`). Asked again for
the same call there (remat.optimize called again with the budget a refusal named), the two graphs
the last planning traced (remat/trace_memo.py) are solved at once before anything is traced, and
only the cheaper head is traced, its plan lowered only where that trace equals the graph solved on
(otherwise planned as with nothing remembered): one trace instead of three. Where the router
takes no head after all, that trace is the model's own step, planned there alone. Under a budget
below the smallest one already found for a head's graph (an equal graph: the model traced again at
the budget an InfeasibleBudgetError named, which the other head reached), that head is not solved
again. A later call
traces the head the last call's plan took first; where that call's schedule serves (3. above), the
other head is not traced. The plan records its head (`details["loss_head"]`, and its context), and a
saved plan is deployed on the head it was made for (deployment.py refuses one whose head
`chunked_loss` excludes).
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from remat.compat.torch_private import compiled_submodules
from remat.core import progress
from remat.graph_capture.build import JointGraphInfo, build_training_graph
from remat.graph_capture.joint import CapturedStep, capture_training_step
from remat.graph_capture.op_timing import measured_cost_graph
from remat.graph_capture.rewrites import prepare_joint_graph
from remat.graph_capture.step_identity import StepIdentity
from remat.graph_capture.rng_replay import step_device_type
from remat.core.training_graph import TrainingGraph
from remat.deployment import plan_context, rejudge
from remat.head_choice import (has_chunked_head, head_added, head_may_lower_smallest, head_worth_tracing, loss_head_of,
                               may_cost_less, plan_head, routable_log_softmaxes)
from remat.runtime.compile import PlannedGraphs
from remat.runtime.module import (DEFAULT_CACHE_LIMIT, BlockBudgetWarning, PlannedStep, PlanRecord, RematModule, call_key, describe_key,
                                  model_device_types)
from remat.runtime.call_state import warn_traced_hooks
from remat.runtime.partition import partition_with_plan
from remat.solver import get_solver
from remat.solver.checkmate.peak_bisection import PEAK_RESOLUTION
from remat.solver.checkmate.peak_rows import peak_floor
from remat.solver.schedule import keep_all_schedule
from remat.core.plan import (InfeasibleBudgetError, Plan, PlanFileError, PlanMismatchError, PlanStatus,
                             plan_from_schedule)
from remat.core.simulator import ScheduleError, simulate
from remat.loss_head.router import chunked_loss_mode
from remat.trace_memo import forget, memo_key, recall, remember
from remat.solving import (at_once, infeasible_budget, known_smallest_feasible, smallest_feasible_of_each, solve,
                           strategy_options)

__all__ = ["PlanOptions", "joint_info", "Decision", "StepPlanner", "planned_step", "trace_graph", "identified_trace", "deployed_module",
           "deployed_as",
           "REUSE_TIGHTNESS", "has_chunked_head", "loss_head_of", "head_added", "plan_head"]

# A schedule planned for another call serves a new one when its peak there uses at least this share
# of the budget: with more room left a solve is likely to find a plan that recomputes less.
REUSE_TIGHTNESS = 0.9


@dataclass(frozen=True)
class PlanOptions:
    """What planning a call needs besides the call: the budget and the solver's and capture's options
    (validated by remat/validate.py before one is made)."""

    budget_bytes: int | None  # the step's peak (None: no budget, keep_all)
    solver: str = "checkmate"  # a strategy of remat.solver.STRATEGIES
    time_limit_s: float | None = None  # checkmate's optional wall-clock limit
    solver_options: tuple[tuple[str, Any], ...] = ()  # the strategy's own keyword options
    fused_attention: bool | str = True  # which attention to trace as remat's flash op
    cost_model: str = "flops"  # what the solver minimises: "flops" or "measured"
    quiet: bool = False  # no progress lines on stderr
    compiled: bool = False  # measure the Inductor-compiled step and plan until it fits (compiled_fit.py)
    chunked_loss: bool | str = "auto"  # the loss head chunked: "auto" (the cheaper plan), "on"/True, "off"/False
    # the budget is a block's share of the step's, set by remat for the block's example call
    # (remat/blockwise.py): a later call no plan fits under it is planned at its own smallest
    # feasible budget, with a BlockBudgetWarning, instead of raising; the user's budget is the step's
    block_share: bool = False

    @property
    def solver_kwargs(self) -> dict[str, Any]:
        return dict(self.solver_options)

    def context_options(self) -> dict[str, Any]:
        """The solver options a plan's context records."""
        return {"time_limit_s": self.time_limit_s, **self.solver_kwargs,
                **({"cost_model": self.cost_model} if self.cost_model != "flops" else {})}


class Decision:
    """`decide(graph) -> Plan` for one call, remembering how it decided (`how`, for the plan log)
    and how long that took."""

    def __init__(self, choose: Callable[[TrainingGraph], tuple[Plan, str]], how: str = "solved"):
        self._choose = choose
        self.how = how
        self.seconds = 0.0

    def __call__(self, graph: TrainingGraph) -> Plan:
        t0 = time.perf_counter()
        plan, self.how = self._choose(graph)
        self.seconds = time.perf_counter() - t0
        return plan


def joint_info(captured: CapturedStep, cost_model: str = "flops") -> JointGraphInfo:
    """The captured joint graph, rewritten (graph_capture/rewrites.py), with its TrainingGraph;
    `cost_model` "measured": the graph's costs are the ops' measured times (op_timing.py). Run inside
    `captured.graph_work()`."""
    joint_gm = captured.joint_gm
    prepare_joint_graph(joint_gm, step_device_type(joint_gm))
    info = build_training_graph(joint_gm, captured.num_fwd_outputs, name=captured.name)
    if cost_model == "measured":  # same structure, costs in measured nanoseconds
        info.graph = measured_cost_graph(info)
    return info


class _NotCheaper(Exception):
    """The chunked head's graph cannot cost less in all than the model's head's plan (`may_cost_less`),
    or has no chunked head (the router took none: the model's own step, planned as its head)."""


class _BothHeads(Exception):
    """The model's head's graph, traced, will have the chunked head weighed against it: the two are
    solved at once (`StepPlanner._best_head`) instead of this trace's solve."""


class _StaleMemo(Exception):
    """The head's trace differs from the graph remembered for it (remat/trace_memo.py), on which
    its plan was solved: the call is planned as if nothing were remembered."""


class _ModelHeadCheaper(Exception):
    """Both heads weighed inside the chunked head's trace, the model's head's plan is the cheaper:
    it is lowered on a trace of the model's head (`StepPlanner._best_head`)."""


def planned_step(model: nn.Module, args: tuple, kwargs: dict, options: PlanOptions, decision: Decision,
                 call: str, chunked: bool = False) -> PlannedStep:
    """Trace `model(*args, **kwargs)` with its backward (its loss head chunked if `chunked` and
    the router can), plan it with `decision` and return the planned step (trace, decide and lower;
    see the module docstring). The plan records the head it was made for."""
    graphs = PlannedGraphs()
    warn_traced_hooks(model)  # every call planned traces here: hooks' side effects run only now
    if compiled_submodules(model):  # the user asked torch.compile for this model: Inductor runs the plan
        graphs.use_inductor()
    t0 = time.perf_counter()
    memo = memo_key(model, args, kwargs, options.fused_attention, options.cost_model, chunked)
    with progress.quiet(options.quiet), capture_training_step(model, args, kwargs, options.fused_attention,
                                                              chunked_loss=chunked) as captured:
        with captured.graph_work():
            info = joint_info(captured, options.cost_model)  # trace
            remember(memo, model, info.graph)
            plan = decision(info.graph)  # decide
            forward_gm, backward_gm = partition_with_plan(info, plan)  # lower
        step = captured.compile(forward_gm, backward_gm, graphs.compilers)
    sig = captured.sig
    total = time.perf_counter() - t0
    head = loss_head_of(info.graph)
    plan = dataclasses.replace(plan, details={**plan.details, "loss_head": head},
                               context={**plan.context, "loss_head": head} if plan.context else plan.context)
    record = PlanRecord(call=call, how=decision.how, trace_s=total - decision.seconds, plan_s=decision.seconds,
                        predicted_peak_bytes=plan.predicted_peak_bytes, budget_bytes=options.budget_bytes)
    return PlannedStep(step, sig, plan, info.graph, graphs, record)


def _reused(graph: TrainingGraph, budget: int, options: PlanOptions,
            others: list[tuple[str, Plan]]) -> tuple[Plan, str] | None:
    """Another call's schedule where it runs on `graph` and fits as tightly as REUSE_TIGHTNESS asks,
    or fits at all when that call's graph is this one (the same nodes and sizes: only a non-tensor
    argument's value differs, e.g. a step counter), for which that schedule was solved."""
    shape = graph.structure_fingerprint()
    for call, other in reversed(others):  # the most recent first
        if other.graph is None or other.graph.structure_fingerprint() != shape:
            continue
        try:
            sim = simulate(graph, other.schedule)
        except ScheduleError:
            continue
        same_graph = other.graph.fingerprint() == graph.fingerprint()
        if sim.peak_bytes <= budget and (same_graph or sim.peak_bytes >= REUSE_TIGHTNESS * budget):
            how = f"reused the schedule of {call}"
            return plan_from_schedule(graph, other.schedule, strategy=options.solver, budget_bytes=budget,
                                      status=PlanStatus.FEASIBLE, details={"plan_source": how}), how
    return None


@dataclass(frozen=True)
class StepPlanner:
    """Plans the calls a RematModule has not seen, with the options it was made with (picklable:
    a copied module plans with the same options)."""

    options: PlanOptions

    def choose(self, model: nn.Module, args: tuple, kwargs: dict, *, known: Plan | None,
               others: list[tuple[str, Plan]], budget: int | None = None,
               smallest_on_failure: bool = True) -> Callable[[TrainingGraph], tuple[Plan, str]]:
        """graph -> (plan, how) for this call: the order of the module docstring; `budget`
        overrides the options' (compiled_fit.py plans at lowered budgets). Without
        `smallest_on_failure`, a budget no plan fits raises InfeasibleBudgetError without searching
        for the smallest feasible one (min_feasible_bytes None): the other loss head may fit."""
        o = self.options
        budget = o.budget_bytes if budget is None else budget
        context = plan_context(model, args, kwargs, fused_attention=o.fused_attention, solver=o.solver,
                               solver_options=o.context_options())

        def choose(graph: TrainingGraph) -> tuple[Plan, str]:
            if known is not None:
                return rejudge(known, graph), "saved plan"
            if others and budget is not None and o.solver == "checkmate":
                keep = get_solver("keep_all")(graph, budget)
                if keep.fits:  # nothing recomputed: no plan costs less
                    plan = plan_from_schedule(graph, keep.schedule, strategy=o.solver, budget_bytes=budget,
                                              status=PlanStatus.OPTIMAL, gap=0.0, lower_bound=0.0,
                                              details={"plan_source": "keep_all fits"})
                    return dataclasses.replace(plan, context=context), "keep_all fits"
                reused = _reused(graph, budget, o, others)
                if reused is not None:
                    return dataclasses.replace(reused[0], context=context), reused[1]
            if smallest_on_failure or budget is None:
                plan = solve(graph, budget, solver=o.solver, time_limit_s=o.time_limit_s, quiet=o.quiet,
                             **o.solver_kwargs)
            else:
                if peak_floor(graph) > budget:  # proven: no schedule in the graph's order fits
                    raise InfeasibleBudgetError(f"no plan fits {budget / 2**20:.2f} MiB (the peak's floor is over it)")
                # the smallest budget found for this very graph (the same model traced again: a
                # budget refused, then asked at the smallest one the refusal named, which the
                # other head reached) is the smallest solve accepts, so solving under it is spared
                # (BigBird's block-sparse attention at its smallest budget: 12 s)
                smallest = known_smallest_feasible(graph, o.solver, o.time_limit_s, **o.solver_kwargs)
                if smallest is not None and smallest > budget:
                    raise infeasible_budget(o.solver, budget, smallest)
                plan = get_solver(o.solver)(graph, budget, **strategy_options(
                    o.solver, o.time_limit_s, o.solver_kwargs).as_kwargs())
                if plan.status == "infeasible" or not plan.fits:
                    raise InfeasibleBudgetError(f"no {o.solver} plan fits {budget / 2**20:.2f} MiB")
            return dataclasses.replace(plan, context=context), "solved"

        return choose

    def plan_call(self, model: nn.Module, args: tuple, kwargs: dict, *, known: Plan | None,
                  others: list[tuple[str, Plan]], call: str) -> PlannedStep:
        """The planned step for this call (runtime/module.py's CallPlanner). With `compiled`, a new
        call's compiled step is measured and planned again until it fits (remat/compiled_fit.py)."""
        o = self.options
        try:
            if o.compiled and known is None:
                from remat.compiled_fit import fit_compiled

                def build(b: int) -> PlannedStep:
                    return self._best_head(model, args, kwargs, others, call, b)

                return fit_compiled(build, o.budget_bytes, model, args, kwargs)
            if known is not None:  # a saved plan runs on the head it was made for
                step = planned_step(model, args, kwargs, o, Decision(self.choose(
                    model, args, kwargs, known=known, others=others)), call, chunked=plan_head(known) == "chunked")
            else:
                step = self._best_head(model, args, kwargs, others, call, None)
            if o.compiled:
                step.graphs.use_inductor()
            return step
        except InfeasibleBudgetError as e:
            if o.block_share and known is None and not o.compiled and e.min_feasible_bytes is not None:
                return self._over_share(model, args, kwargs, others, call, e.min_feasible_bytes)
            raise InfeasibleBudgetError(f"{call}: {e}", min_feasible_bytes=e.min_feasible_bytes) from None

    def _over_share(self, model: nn.Module, args: tuple, kwargs: dict, others: list[tuple[str, Plan]], call: str,
                    smallest: int) -> PlannedStep:
        """A block's call that no plan fits under its share of the step's budget (`block_share`),
        planned at the smallest budget found for it: a call unlike the block's example (an input
        that requires grad where the example's did not, a longer sequence) can need more than the
        share; the block's planned memory is then over what the step was measured with."""
        step = self._best_head(model, args, kwargs, others, call, smallest)
        share = self.options.budget_bytes or 0
        warnings.warn(BlockBudgetWarning(
            f"{call}: no plan of {type(model).__name__} fits its share of the step's budget, {share / 2**20:.2f} MiB "
            f"(set for the block's example call); planned at its smallest feasible budget, {smallest / 2**20:.2f} "
            f"MiB: the step's peak was measured for the example inputs, and this call can take it over the budget"),
            stacklevel=2)
        return step

    def _best_head(self, model: nn.Module, args: tuple, kwargs: dict, others: list[tuple[str, Plan]], call: str,
                   budget: int | None) -> PlannedStep:
        """The planned step with the loss head `chunked_loss` asks for; under "auto" the cheaper
        of the two heads' plans that fits (the module docstring)."""
        o = self.options
        mode = chunked_loss_mode(o.chunked_loss)

        traced: dict[bool, TrainingGraph] = {}  # each head's graph, planned or not
        tried: dict[bool, PlannedStep | None] = {}  # each head's step at this budget (None: none fits)

        def step(chunked: bool, search: bool = True, to_beat: float | None = None,
                 defer: bool = False) -> PlannedStep:
            choose = self.choose(model, args, kwargs, known=None, others=others, budget=budget,
                                 smallest_on_failure=search)

            def recording(graph: TrainingGraph) -> tuple[Plan, str]:
                traced[chunked] = graph
                if chunked and mode == "auto" and not has_chunked_head(graph):
                    raise _NotCheaper  # not solved twice (DPT's pixel-wise loss: 18 s each)
                if to_beat is not None and not may_cost_less(graph, limit, to_beat):
                    raise _NotCheaper
                if defer and both_heads_solved(graph):
                    raise _BothHeads
                return choose(graph)

            return planned_step(model, args, kwargs, o, Decision(recording), call, chunked=chunked)

        def fitting(chunked: bool, to_beat: float | None = None, defer: bool = False) -> PlannedStep | None:
            # a budget a head does not fit is not searched below here: the other head may fit
            if chunked not in tried:
                try:
                    tried[chunked] = step(chunked, search=False, to_beat=to_beat, defer=defer)
                except (InfeasibleBudgetError, _NotCheaper):
                    tried[chunked] = None
            return tried[chunked]

        def with_head_added(chosen: PlannedStep) -> PlannedStep:
            """`chosen`, where it has the chunked head and the model's head was traced too, with what
            the chunked head costs beyond the model's in its details, for reports."""
            if loss_head_of(chosen.graph) == "chunked" and False in traced:
                chosen.plan = dataclasses.replace(chosen.plan, details={
                    **chosen.plan.details, **head_added(traced[True], traced[False])})
            return chosen

        def both_heads_solved(graph: TrainingGraph) -> bool:
            """Whether the model's head's graph, traced, is one whose plan the chunked head's would be
            weighed against in full (a head worth it; a plan that must recompute: keep_all over the
            budget, no other call's schedule serving; the budget the smallest already found for this
            graph, within the lowest-peak search's resolution): then the two are solved at once (the
            module docstring)."""
            smallest = known_smallest_feasible(graph, o.solver, o.time_limit_s, **o.solver_kwargs)
            return (True not in tried and smallest is not None
                    and smallest <= limit <= smallest * (1 + PEAK_RESOLUTION)
                    and head_worth_tracing(graph, limit)
                    and simulate(graph, keep_all_schedule(graph)).peak_bytes > limit
                    and (not others or _reused(graph, limit, o, others) is None))

        def at_once_choice() -> Callable[[TrainingGraph], tuple[Plan, str]]:
            return self.choose(model, args, kwargs, known=None, others=others, budget=budget,
                               smallest_on_failure=False)

        def weighed_at_once(graphs: dict[bool, TrainingGraph]) -> dict[bool, tuple[Plan, str]]:
            """Each head's plan that fits ({chunked: (plan, how)}), the graphs solved at once."""
            choose = at_once_choice()

            def solved(g: TrainingGraph) -> tuple[Plan, str] | None:
                try:
                    return choose(g)
                except InfeasibleBudgetError:
                    return None

            with progress.quiet(o.quiet):
                plans = at_once({c: (lambda g=g: solved(g)) for c, g in graphs.items()}, o.solver_kwargs)
            return {c: p for c, p in plans.items() if p is not None}

        def cheaper(weighed: dict[bool, tuple[Plan, str]]) -> bool:
            """The head whose plan fits with the lower total cost (the model's head on a tie)."""
            return min(weighed, key=lambda c: (weighed[c][0].total_cost, c))

        def remembered_at_once() -> PlannedStep | None:
            """Both heads weighed at once as `both_at_once` would, on the graphs an earlier planning
            of this very call traced (remat/trace_memo.py: remat.optimize asked again at the budget
            a refusal named), before either is traced again: only the cheaper head is traced, to be
            lowered, and only where that trace equals the graph its plan was solved on. None where
            the memo lacks either graph, the two would not be weighed at once here, neither plan
            fits, or the trace came out other (then forgotten): planned as without the memo."""
            keys = {c: memo_key(model, args, kwargs, o.fused_attention, o.cost_model, c) for c in (False, True)}
            graphs = {c: recall(k, model) for c, k in keys.items()}
            if (graphs[False] is None or graphs[True] is None or not has_chunked_head(graphs[True])
                    or not both_heads_solved(graphs[False])):
                return None
            t0 = time.perf_counter()
            weighed = weighed_at_once(graphs)
            if not weighed:
                return None
            head = cheaper(weighed)
            plan, how = weighed[head]
            seconds = time.perf_counter() - t0

            def checked(g: TrainingGraph) -> tuple[Plan, str]:
                if g != graphs[head]:
                    raise _StaleMemo
                return rejudge(plan, g), how

            try:
                chosen = planned_step(model, args, kwargs, o, Decision(checked), call, chunked=head)
            except _StaleMemo:
                forget(keys[False])
                forget(keys[True])
                return None
            # (the seconds the two solves took, as planning)
            chosen.record = dataclasses.replace(chosen.record, plan_s=chosen.record.plan_s + seconds)
            traced.update(graphs)
            tried[head], tried[not head] = chosen, None
            return chosen

        def both_at_once() -> PlannedStep | None:
            """Both heads solved at once (the module docstring), inside the chunked head's trace: the
            planned step of the one whose plan fits with the lower total cost (the model's head on a
            tie), the chunked head's lowered in that very trace, the model's head's traced again.
            None where neither fits, or where the router took no head (that trace is the model's own
            step: planned there, alone, as `tried[False]`)."""
            choose = at_once_choice()
            weighed: dict[bool, tuple[Plan, str]] = {}

            def chunked_traced(graph: TrainingGraph) -> tuple[Plan, str]:
                traced[True] = graph
                if not has_chunked_head(graph):  # the router took no head: the model's step, solved alone
                    return choose(graph)
                weighed.update(weighed_at_once({False: traced[False], True: graph}))
                if not weighed:
                    raise InfeasibleBudgetError("neither loss head's plan fits")
                if cheaper(weighed):
                    return weighed[True]
                raise _ModelHeadCheaper

            t0 = time.perf_counter()
            try:
                first = planned_step(model, args, kwargs, o, Decision(chunked_traced), call, chunked=True)
            except InfeasibleBudgetError:
                tried[False] = tried[True] = None
                return None
            except _ModelHeadCheaper:
                first = None
            if first is not None and not has_chunked_head(traced[True]):  # (not traced again)
                tried[False], tried[True] = first, None
                return None
            if first is not None:  # the chunked head's plan is the cheaper
                tried[True], tried[False] = first, None
                return first
            seconds = time.perf_counter() - t0
            plan, how = weighed[False]

            def planned(g: TrainingGraph) -> tuple[Plan, str]:  # the graph traced again to be lowered
                try:
                    return rejudge(plan, g), how
                except (PlanMismatchError, PlanFileError):  # another trace than the one solved
                    return choose(g)

            chosen = planned_step(model, args, kwargs, o, Decision(planned), call, chunked=False)
            # (the seconds the chunked head's trace and the two solves took, as planning)
            chosen.record = dataclasses.replace(chosen.record, plan_s=chosen.record.plan_s + seconds)
            tried[False], tried[True] = chosen, None  # (weighed: not the cheaper)
            return chosen

        if mode != "auto" or o.solver != "checkmate":
            # the baselines reproduce their published methods on the model's own step
            return step(mode == "on")
        limit = o.budget_bytes if budget is None else budget
        if others:
            # the head the last call's plan took, traced first: where that call's schedule serves
            # here, both heads were weighed on the same nodes already, so the other head is neither
            # traced nor solved again (a Python number that changes every call costs one trace)
            last = plan_head(others[-1][1]) == "chunked"
            first = fitting(last)
            if first is not None and first.record.how.startswith("reused"):
                return first
        if limit is not None and not tried:
            remembered = remembered_at_once()
            if remembered is not None:
                return with_head_added(remembered)
        try:
            plain = fitting(False, defer=limit is not None)
        except _BothHeads:
            chosen = both_at_once()
            if chosen is not None:
                return with_head_added(chosen)
            plain = fitting(False)  # neither fits, or the router took no head: as below
        if plain is not None and (limit is None or plain.plan.extra_cost == 0):
            return plain  # nothing recomputed: the chunked head could only add its matmul
        if plain is not None and not head_worth_tracing(traced[False], limit):
            return plain
        # None also where the router took no head: the same step as the model's, not solved again;
        # not traced where the model's graph shows no head the router could take (DPT's pixel-wise
        # loss: ~3 s)
        # nor where none fits and the chunked head could not lower the smallest budget (a classifier's
        # few labels: head_choice.HEAD_BUFFERS)
        routable = False not in traced or (bool(routable_log_softmaxes(traced[False])) if plain is not None
                                           else head_may_lower_smallest(traced[False], limit))
        chunked = fitting(True, to_beat=None if plain is None else plain.plan.total_cost) if routable else None
        if plain is None and chunked is None:
            # neither fits: the smallest budget either head reaches, searched now on the graphs
            # traced above (each head traced once: a trace costs seconds, Funnel's ~5 s each), the
            # two at once (solving.smallest_feasible_of_each); a head
            # whose lowest-peak plan fits after all is planned (its solve falls back to that plan)
            heads = [c for c in (False, True) if c in traced and (not c or has_chunked_head(traced[c]))]
            if not heads:  # no graph got as far as planning: the step's own search, as for one head
                return step(False)
            with progress.quiet(o.quiet):
                smallest = smallest_feasible_of_each({c: traced[c] for c in heads}, o.solver, o.time_limit_s,
                                                     **o.solver_kwargs)
            best = min(heads, key=lambda c: (smallest[c], c))
            if smallest[best] <= limit:
                return step(best)
            raise infeasible_budget(o.solver, limit, smallest[best])
        if plain is None or (chunked is not None and chunked.plan.total_cost < plain.plan.total_cost):
            assert chunked is not None
            return with_head_added(chunked)
        return plain


def trace_graph(model: nn.Module, args: tuple, kwargs: dict | None, fused_attention: bool | str = True,
                cost_model: str = "flops", quiet: bool = False, chunked_loss: bool = False) -> TrainingGraph:
    """The TrainingGraph of one call's training step (nothing compiled); with `chunked_loss`, its
    loss head traced as the chunked op where the router can."""
    return _trace_step(model, args, kwargs, fused_attention, cost_model, quiet, chunked_loss, identify=False)[0]


def identified_trace(model: nn.Module, args: tuple, kwargs: dict | None, fused_attention: bool | str = True,
                     cost_model: str = "flops", quiet: bool = False) -> tuple[TrainingGraph, StepIdentity | None]:
    """trace_graph's graph, and what the traced step computes (graph_capture/step_identity.py): two
    calls with equal identities can run one compiled step (remat/blockwise.py)."""
    return _trace_step(model, args, kwargs, fused_attention, cost_model, quiet, False, identify=True)


def _trace_step(model: nn.Module, args: tuple, kwargs: dict | None, fused_attention: bool | str, cost_model: str,
            quiet: bool, chunked_loss: bool, identify: bool) -> tuple[TrainingGraph, StepIdentity | None]:
    with progress.quiet(quiet), capture_training_step(model, args, kwargs, fused_attention,
                                                      chunked_loss=chunked_loss) as captured:
        identity = captured.identity() if identify else None  # before the graph work rewrites the graph
        with captured.graph_work():
            return joint_info(captured, cost_model).graph, identity


def deployed_module(model: nn.Module, args: tuple, kwargs: dict, options: PlanOptions, plan: Plan | None = None,
                    cache_limit: int = DEFAULT_CACHE_LIMIT) -> RematModule:
    """The RematModule of `model`, its example call (`args`, `kwargs`) planned now: with `plan`, that
    saved plan judged again on the trace; otherwise as `options` say."""
    planner = StepPlanner(options)
    key, _ = call_key(model, args, kwargs, model_device_types(model))
    first = planner.plan_call(model, args, kwargs, known=plan, others=[], call=describe_key(key))
    after, _ = call_key(model, args, kwargs, model_device_types(model))  # attributes the trace changed
    return RematModule(model, planner, (key, first, after), cache_limit=cache_limit)


def deployed_as(twin: RematModule | None, model: nn.Module, args: tuple, kwargs: dict, options: PlanOptions,
                plan: Plan, cache_limit: int = DEFAULT_CACHE_LIMIT) -> RematModule:
    """deployed_module's RematModule of `model` for its example call under `plan`; where `twin` is given
    (the RematModule of a model whose traced step for its own call equals this one's:
    graph_capture/step_identity.py, blocks of one structure), `twin`'s step bound to `model`'s
    parameters and buffers instead, not traced again (RematModule.bound_to)."""
    if twin is not None:
        key, _ = call_key(model, args, kwargs, model_device_types(model))
        bound = twin.bound_to(model, StepPlanner(options), key)
        if bound is not None:
            return bound
    return deployed_module(model, args, kwargs, options, plan, cache_limit)
