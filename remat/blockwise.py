"""When a training step cannot be traced whole: plan its repeated blocks one by one, run the rest as
it is, and keep the whole step's measured peak under the budget.

Why this file is long: the steps below are one procedure, each later step reading what the earlier
ones found (the blocks' calls, graphs, identities, plans, and the calibration's draw).

A forward with `if h.mean() > 0:`, an `.item()`, or a loss that calls `.nonzero()` (DeBERTa-v2's)
has no single graph: its control flow depends on the data. torch.compile breaks the graph there and
goes on; `torch.utils.checkpoint` needs no graph. remat does what per-block checkpointing does:

1. **Blocks**: the model's repeated blocks (`repeated_blocks`: the numbered children of the
   outermost containers that hold at least two children of the same structure, e.g. a ModuleList
   of transformer layers; the units per_block checkpoints). If a block cannot be traced either it
   runs as it is; if no block can (a data-dependent shape in every one: an MoE's routing), their
   parts are the units (`block_parts`: the children holding parameters whose name and structure
   recur in at least two blocks, its attention and its MLP); if none of those can either, the TraceError
   of the whole step is raised as it was, with a note saying why the blocks could not be planned.
2. **Their calls**: one forward of the model records each block's arguments as training passes
   them (which tensors require grad, keyword arguments included); each block's outputs are passed
   on detached, requiring grad where they did (its autograd graph dropped there, so one block's at
   a time is held). Random state, buffers and
   gradients are restored after it. Where that forward skipped blocks (LayerDrop,
   `if torch.rand([]) < p: continue`, or a path the data chose), more forwards, drawing on from the
   random state, record them while each finds one not called before (RECORD_FORWARDS in all); a
   block none called is planned for the call of the nearest block of the same structure.
3. **Plans at levels**: every distinct block graph is planned at `levels` budgets, from its
   smallest feasible one (level 0: least memory) to keep_all's peak (no recomputation), the graphs
   and their levels solved two at a time (remat/solving.py `at_once`: Informer 36 -> 23 s), every
   graph's smallest budget first (remat/block_levels.py: SwitchTransformers, six distinct block
   graphs, about 30 -> 26 s to optimize), the levels above the smallest within a 2% gap
   (`LEVEL_GAP`), each graph's plans remembered for a later call.
   A block is deployed (traced again, its plan lowered) only where no earlier block traced to the
   same step (graph_capture/step_identity.py: the joint graph's code and constants, its inputs'
   layouts, its parameters' names and layouts): such a block runs that block's compiled step with
   its own parameters and buffers (AOTAutograd's step takes them at every call).
4. **How the blocks' budgets are set**: every block gets its level-0 plan and one calibration step
   of the whole model (forward and backward, on the example inputs, its outputs held through the
   backward as a training loop holds them) measures the step's peak M0 (as `remat.measure_peak`
   does; the model is left as it was). The highest level j whose bound fits the
   budget is chosen (`runtime/distributed.py`'s `fit_block_level`, as for FSDP2): a block planned at
   level j holds dS more between its forward and its backward, and adds dP more at its own peak
   while it runs (both from the simulator), so the step peaks at most at
   `M0 + sum_i dS_i + max_i dP_i`. The blocks then run their level-j plans and a second step
   measures the peak again; if it exceeds the budget the level is lowered until one fits.
   Where that step skipped planned blocks (LayerDrop), it is measured again from the random state
   one draw further, up to CALIBRATION_DRAWS times, and the draw that ran the most of them is kept
   (the levels are checked from the same state). The planned blocks it still did not run add to M0,
   at every level, what each holds until its backward at level 0 or leaves after it (less its
   parameters and input) and, once, the most one adds above that while it runs: a later step may
   run them (LayerDrop draws anew each step; without that, a step dropping fewer layers than the
   calibration's went over the budget: Hugging Face's TimeSeriesTransformer by 15%). Blocks run as
   they are (not traceable) count in the draws too, first: one the kept draw did not run adds what
   its own step on its recorded call peaks at, measured alone (no plan says what it holds; without
   it Hugging Face's Autoformer, whose LayerDrop'd layers cannot be traced, went 25% over).
   InfeasibleBudgetError when even level 0 does not fit (its `min_feasible_bytes`: that bound).
5. Calls of other shapes are planned block by block (each block's RematModule plans new calls
   under its level's budget); the whole step's budget is measured for the example inputs only.
   That budget is the block's share, set by remat for its example call, so a call that no plan fits
   under it (a larger batch; a skipped LayerDrop block handed the first block's call, whose input
   did not require grad, then called with one that does) is planned at its own smallest feasible
   budget with a BlockBudgetWarning rather than stopping training (`PlanOptions.block_share`).

The model is not modified: during a call of the returned `BlockwiseModule` (with grad enabled) each
block's `forward` is redirected to its RematModule, and restored after. `BlockwisePlanWarning`
says once which blocks are planned and what the calibration measured.
"""
from __future__ import annotations

import contextvars
import dataclasses
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from remat.block_calls import Redirected, block_parts, block_structure, cuda_device, record_block_calls
from remat.core.errors import RematWarning
from remat.compat.torch_private import pytree
from remat.graph_capture.joint import TraceError
from remat.core.training_graph import TrainingGraph
from remat.runtime.distributed import BlockProfile, block_profile, fit_block_level
from remat.graph_capture.step_identity import StepIdentity, first_equal
from remat.pipeline import PlanOptions, StepPlanner, deployed_as, identified_trace
from remat.runtime.module import DEFAULT_CACHE_LIMIT, ModelWrapper, OutsideBudgetWarning, RematModule
from remat.block_levels import plans_at_levels
from remat.core.plan import InfeasibleBudgetError, Plan

__all__ = ["BlockwiseModule", "BlockwiseFit", "BlockwisePlanWarning", "repeated_blocks", "plan_blockwise",
           "DEFAULT_LEVELS", "CALIBRATION_DRAWS"]

DEFAULT_LEVELS = 4  # budgets per distinct block graph, from its lowest peak to keep_all's
CALIBRATION_DRAWS = 4  # random states the calibration step is measured from, at most (4.)
MIB = 2 ** 20


class BlockwisePlanWarning(RematWarning):
    """The step could not be traced whole: its repeated blocks are planned one by one, the rest of
    the model runs as it is."""


@dataclass
class BlockwiseFit:
    """What plan_blockwise chose: the budget, the calibrated peak at level 0 (`calibrated_bytes`),
    the level deployed and the bound it guarantees, the peak measured at that level, and each
    planned block's name and plan."""

    budget_bytes: int
    calibrated_bytes: int
    level: int
    levels: int
    bound_bytes: int
    measured_bytes: int
    blocks: list[str] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list, repr=False)
    eager_blocks: list[str] = field(default_factory=list)  # blocks that could not be traced either
    skipped_blocks: list[str] = field(default_factory=list)  # blocks the calibration step did not run
    # of those, blocks run as they are that raised when run alone: not counted in the bound
    unmeasured_blocks: list[str] = field(default_factory=list)


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the model's repeated blocks: every numbered child of each outermost module
    that has at least two numbered children of the same structure (class, parameter names, shapes
    and dtypes), in the order of named_modules."""
    found: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, m in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue  # inside a block already found: only the outermost containers count
        numbered = [(c, child) for c, child in m.named_children() if c.isdigit()]
        shapes = [block_structure(child) for _, child in numbered]
        if len(numbered) >= 2 and len(set(shapes)) < len(shapes):
            for c, child in numbered:
                full = f"{name}.{c}" if name else c
                found.append((full, child))
                taken.append(full)
    return found


def _traced(blocks: list[nn.Module], calls: list,
            options: PlanOptions) -> tuple[list[TrainingGraph | None], list[StepIdentity | None], list[str]]:
    """Each block's graph traced for its recorded call (None: not called by the forward, or it
    cannot be traced: it runs as it is), what each traced step computes (StepIdentity: blocks with
    equal ones share one compiled step), and the first line of each TraceError."""
    graphs: list[TrainingGraph | None] = []
    identities: list[StepIdentity | None] = []
    reasons: list[str] = []
    for b, call in zip(blocks, calls):
        graph, identity = None, None  # not called by this forward, or it cannot be traced: run as it is
        if call is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", OutsideBudgetWarning)
                    graph, identity = identified_trace(b, call[0], call[1], options.fused_attention,
                                                       options.cost_model, quiet=True)
            except TraceError as e:
                reasons.append(' '.join(str(e).split())[:300])
        graphs.append(graph)
        identities.append(identity)
    return graphs, identities, reasons


_in_block = contextvars.ContextVar("remat_in_block", default=False)


def _to_planned(planned: nn.Module | None, own, ran: list[int] | None = None, i: int = 0):
    """A block's forward that runs its RematModule `planned` (its own forward where None), except for
    calls from inside that module (tracing the block, or running it under no_grad), which get the
    block's own forward; each call from the model counted in `ran[i]` where `ran` is given."""
    if planned is None and ran is None:
        return own

    def forward(*args, **kwargs):
        if _in_block.get():
            return own(*args, **kwargs)
        if ran is not None:
            ran[i] += 1
        if planned is None:
            return own(*args, **kwargs)
        token = _in_block.set(True)
        try:
            return planned(*args, **kwargs)
        finally:
            _in_block.reset(token)
    return forward


def _loss(out: Any) -> torch.Tensor:
    """The loss of a model's output: the output itself when it is one element, else its `loss`
    (Hugging Face's outputs, dicts)."""
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    raise ValueError("planning a step that cannot be traced whole measures the step: the model must return its "
                     "loss (a one-element tensor, or an output with a `loss`)")


class BlockwiseModule(ModelWrapper):
    """The model with its repeated blocks running remat plans and the rest as it is (see the module
    docstring). Parameters, buffers and state_dict keys are the model's own; `fit` says what was
    chosen, `blocks` holds each planned block's RematModule (None for a block run as it is)."""

    def __init__(self, model: nn.Module, names: list[str], blocks: list[nn.Module], planned: list[RematModule | None],
                 fit: BlockwiseFit):
        super().__init__(model)
        d = self.__dict__
        d["block_names"] = names
        d["_blocks"] = blocks
        d["blocks"] = planned
        d["fit"] = fit

    def _dispatch(self, args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        ran = self.__dict__.get("_ran")  # counted while plan_blockwise measures a step
        with Redirected(self._blocks, lambda i, own: _to_planned(self.blocks[i], own, ran, i)):
            return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        f = self.fit
        return (f"planned blocks={len(f.blocks)}, level={f.level}/{f.levels - 1}, "
                f"measured peak={f.measured_bytes / MIB:.2f} MiB of {f.budget_bytes / MIB:.2f} MiB")


def _measure(module: BlockwiseModule, model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, list[int]]:
    """The peak of one step of `module` on the example inputs (the model left as it was), and how
    many times the model called each block in it."""
    from remat.compiled_fit import untouched
    from remat.measure import measure_peak

    device = cuda_device(model, args, kwargs)
    resident = [model, *[t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]]

    def step():  # the outputs held through the backward, as a training loop holds them and the plans count them
        out = module(*args, **kwargs)
        _loss(out).backward()

    ran = module.__dict__["_ran"] = [0] * len(module._blocks)
    try:
        with untouched(model, device):
            return measure_peak(step, resident=resident, device=device), ran
    finally:
        del module.__dict__["_ran"]


@contextmanager
def _calibration_draw(module: BlockwiseModule, model: nn.Module, args: tuple, kwargs: dict,
                      planned: list[bool | None]):
    """Measure the step (`_measure`) from the random state, and where it skipped blocks (LayerDrop),
    from up to CALIBRATION_DRAWS - 1 states after it, one draw further each: yields the (peak, calls
    per block) of the draw that skipped the fewest blocks run as they are, then the fewest planned
    ones (the first of those), with the random state set to the one it started from; the caller's
    state is restored after. planned[i]: block i is planned (True), run as it is (False), or not
    called by any forward recorded (None: not counted)."""
    device = cuda_device(model, args, kwargs)
    cuda = [device] if device is not None else []
    with torch.random.fork_rng(devices=cuda):
        best = None
        for _ in range(CALIBRATION_DRAWS):
            state = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda])
            peak, ran = _measure(module, model, args, kwargs)
            # a skipped block run as it is counts first: no plan says what it holds (_unplanned_bytes)
            missed = (sum(1 for r, p in zip(ran, planned) if p is False and r == 0),
                      sum(1 for r, p in zip(ran, planned) if p and r == 0))
            if best is None or missed < best[0]:
                best = (missed, peak, ran, state)
            if missed == (0, 0):
                break
            torch.rand(())  # the next draw
            for d in cuda:
                torch.rand((), device=d)
        torch.set_rng_state(best[3][0])
        for d, st in zip(cuda, best[3][1]):
            torch.cuda.set_rng_state(st, d)
        yield best[1], best[2]


def _unplanned_bytes(blocks: Sequence[nn.Module], calls: Sequence[tuple[tuple, dict]], model: nn.Module,
                    device: torch.device | None) -> tuple[int, list[int]]:
    """What blocks run as they are (not traceable) that the calibration step did not run add to a
    step that runs them, at most, as `_absent_bytes` counts planned ones, from measurements of each
    block alone on its recorded call: its forward's peak with its outputs held (at least what it holds
    until its backward), its whole step's peak (the forward, then a backward from its outputs' sum:
    the most it adds while it runs) and its parameters' gradients (what it leaves after). Without it,
    a step running the layers LayerDrop skipped in the calibration went over the budget (Hugging
    Face's Autoformer, whose layers cannot be traced: 2.16 MB measured under 1.73 MB). Returns the
    bytes and the positions of the blocks that raised when run alone (not counted: the caller says so)."""
    from remat.compiled_fit import untouched
    from remat.measure import measure_peak

    def above(fn) -> int:  # the most bytes fn() allocates above what is live before it
        before = torch.cuda.memory_allocated(device) if device is not None else 0
        return measure_peak(fn, device=device or "cpu") - before

    measured, failed = [], []
    for i, (block, (a, k)) in enumerate(zip(blocks, calls)):
        held: list = []

        def forward(block=block, a=a, k=k):
            held.append(block(*a, **k))

        def step():
            forward()
            grads = [t for t in pytree.tree_leaves(held.pop()) if isinstance(t, torch.Tensor) and t.requires_grad]
            if grads:
                sum(t.float().sum() for t in grads).backward()

        try:
            with untouched(model, device):
                saved = above(forward)
                held.clear()
                peak = above(step)
        except Exception:  # noqa: BLE001 - a block that runs only inside its model's forward: said in the warning
            failed.append(i)
            continue
        finally:
            held.clear()
        kept = sum(p.numel() * p.element_size() for p in block.parameters() if p.requires_grad)
        measured.append((BlockProfile(saved_bytes=saved, peak_bytes=max(peak, saved)), 0, kept))
    return _absent_bytes(measured), failed


def _absent_bytes(absent: Sequence[tuple[BlockProfile, int, int]]) -> int:
    """What the planned blocks the calibration step did not run add to that step's peak, at most, in
    a step that runs them at level 0 (`absent`: each one's level-0 profile, its graph's resident
    bytes, the parameters and input the step holds anyway, and its kept bytes, the gradients it
    leaves after its backward): what each holds until its backward or leaves after it, and once,
    the most any of them adds above that while it runs."""
    if not absent:
        return 0
    return (sum(max(0, p.saved_bytes - resident, kept) for p, resident, kept in absent)
            + max(max(0, p.peak_bytes - max(p.saved_bytes, resident)) for p, resident, _ in absent))


def plan_blockwise(model: nn.Module, args: tuple, kwargs: dict, options: PlanOptions, error: TraceError, *,
                   levels: int = DEFAULT_LEVELS, cache_limit: int = DEFAULT_CACHE_LIMIT) -> BlockwiseModule:
    """The BlockwiseModule of `model` under `options.budget_bytes` (see the module docstring); `error`
    is the whole step's TraceError, raised again when no block can be planned."""
    budget_bytes = options.budget_bytes
    assert budget_bytes is not None
    solver, time_limit_s, solver_kwargs = options.solver, options.time_limit_s, options.solver_kwargs
    found = repeated_blocks(model)
    if not found:
        # said in a note, as below where no block traces: the step's own message names its line
        error.add_note("remat found no repeated blocks to plan one by one instead (numbered children of one "
                       "module, at least two of the same structure, e.g. a ModuleList of layers): the whole "
                       "step must trace")
        raise error
    names = [n for n, _ in found]
    blocks = [b for _, b in found]
    # where no block can be planned the whole step's TraceError is raised, with a note saying why the
    # blocks could not be planned either (the traceback shows it; str(error) stays the step's)
    tried = f"remat tried to plan its {len(blocks)} repeated blocks ({_names(names)}) one by one"
    try:
        calls = record_block_calls(model, blocks, args, kwargs)
    except Exception as e:  # the model cannot run these inputs eagerly either: the trace's error says why
        error.add_note(f"{tried}: running the model to record their calls raised {type(e).__name__}: "
                       f"{' '.join(str(e).split())[:300]}")
        raise error from None
    graphs, identities, reasons = _traced(blocks, calls, options)
    parts = block_parts(found) if reasons and all(g is None for g in graphs) else []
    if parts:
        # no block traces (a data-dependent shape in every one: an MoE's routing, a boolean index):
        # the parts every block has (its attention, its MLP) are planned one by one instead
        modules = [m for _, m in parts]
        try:
            part_calls = record_block_calls(model, modules, args, kwargs)
        except Exception:  # noqa: BLE001 - recorded as the blocks were: their failure is said below
            part_calls = None
        if part_calls is not None:
            part_graphs, part_identities, part_reasons = _traced(modules, part_calls, options)
            if any(g is not None for g in part_graphs):
                names, blocks, calls = [n for n, _ in parts], modules, part_calls
                graphs, identities = part_graphs, part_identities
            else:
                reasons += part_reasons
    if all(g is None for g in graphs):
        error.add_note(f"{tried}: " + (f"none could be traced either ({reasons[0]})" if reasons
                                       else "the model's forward called none of them")
                       + (f", nor their parts ({_names([n for n, _ in parts])})" if parts else ""))
        raise error
    distinct = list(dict.fromkeys(g.fingerprint() for g in graphs if g is not None))
    first = {fp: next(g for g in graphs if g is not None and g.fingerprint() == fp) for fp in distinct}
    # the distinct block graphs planned two at a time (the module docstring, 3.)
    by_graph = plans_at_levels(first, levels, solver, time_limit_s, solver_kwargs)
    per_block = [by_graph[g.fingerprint()] if g is not None else None for g in graphs]
    twins = first_equal(identities, per_block)

    def deploy(level: int, at_zero: list[RematModule | None] | None = None) -> list[RematModule | None]:
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OutsideBudgetWarning)  # the whole step is budgeted here
            for i, (b, call, ps) in enumerate(zip(blocks, calls, per_block)):
                if ps is None:
                    out.append(None)
                    continue
                block_options = dataclasses.replace(options, budget_bytes=ps[level].budget_bytes, quiet=True,
                                                    block_share=True)
                if at_zero is not None and at_zero[i] is not None and ps[level].schedule == ps[0].schedule:
                    # the same schedule as at level 0 (a small block's at every level): that module's
                    # step, not traced again, its new calls planned at this level's budget (RT-DETR:
                    # 10 of its 14 distinct blocks)
                    out.append(at_zero[i].with_planner(StepPlanner(block_options)))
                    continue
                # a block whose traced step equals an earlier one's runs that one's compiled step with
                # its own parameters (SwitchTransformers: 12 of its 24 deploying traces spared)
                twin = out[twins[i]] if twins[i] != i else None
                out.append(deployed_as(twin, b, call[0], call[1], block_options, ps[level], cache_limit))
        return out

    planned = deploy(0)
    fit = BlockwiseFit(budget_bytes=budget_bytes, calibrated_bytes=0, level=0, levels=levels, bound_bytes=0,
                       measured_bytes=0, blocks=[n for n, ps in zip(names, per_block) if ps is not None],
                       eager_blocks=[n for n, ps in zip(names, per_block) if ps is None])
    module = BlockwiseModule(model, names, blocks, planned, fit)
    # the step measured from the random state where it skips the fewest blocks (LayerDrop), and every
    # level checked below from that same state
    counted = [None if call is None else ps is not None for call, ps in zip(calls, per_block)]
    with _calibration_draw(module, model, args, kwargs, counted) as (peak, ran):
        fit.calibrated_bytes = fit.measured_bytes = peak
        profiles: list[list[BlockProfile]] = [[block_profile(g, p) for p in ps] for g, ps in zip(graphs, per_block)
                                              if ps is not None]
        # planned blocks the calibration step did not run (LayerDrop, or the data's path): a later step
        # may run them, so the bound of every level counts each as it would be at level 0, on top of the
        # step measured; with every block run the step is that bound at most
        planned_graphs = [(g, r) for g, r, ps in zip(graphs, ran, per_block) if ps is not None]
        absent = [(p[0], g.resident_bytes, sum(n.kept_bytes for n in g.nodes))
                  for p, (g, r) in zip(profiles, planned_graphs) if r == 0]
        # blocks run as they are that it did not run: measured alone, their bytes on top as well
        unplanned = [i for i, (r, c) in enumerate(zip(ran, counted)) if r == 0 and c is False]
        fit.skipped_blocks = [n for n, r, c in zip(names, ran, counted) if r == 0 and c is not None]
        unplanned_bytes, failed = _unplanned_bytes([blocks[i] for i in unplanned], [calls[i] for i in unplanned],
                                                   model, cuda_device(model, args, kwargs))
        fit.unmeasured_blocks = [names[unplanned[j]] for j in failed]
        calibrated = fit.calibrated_bytes + _absent_bytes(absent) + unplanned_bytes
        if calibrated > budget_bytes:
            skipped = (f" (and {len(fit.skipped_blocks)} blocks the calibration step did not run, counted as a later "
                       f"step may run them)" if fit.skipped_blocks else "")
            raise InfeasibleBudgetError(
                f"{type(model).__name__}'s step cannot be traced whole, and with its {len(fit.blocks)} repeated "
                f"blocks at their lowest-memory plans (the rest as it is) it peaks at {calibrated / MIB:.2f} "
                f"MiB{skipped}, over "
                f"the budget of {budget_bytes / MIB:.2f} MiB", min_feasible_bytes=calibrated)
        level, fit.bound_bytes = fit_block_level(calibrated, 0, budget_bytes, profiles)
        for tried in range(level, 0, -1):  # the bound says it fits; measure that it does
            module.__dict__["blocks"] = deploy(tried, planned)
            fit.measured_bytes, _ = _measure(module, model, args, kwargs)
            if fit.measured_bytes <= budget_bytes:
                fit.level = tried
                break
        else:
            module.__dict__["blocks"] = planned
            fit.measured_bytes = fit.calibrated_bytes
    fit.plans = [b.plan for b in module.blocks if b is not None]
    cause = str(error).splitlines()
    skipped = ("; not run by the calibration step (counted in the bound, as a later step may run them): "
               + _names(fit.skipped_blocks)) if fit.skipped_blocks else ""
    if fit.unmeasured_blocks:
        skipped += ("; of those, these raised when run alone on their recorded calls, so what they add is not in the "
                    "bound and a step running them can peak over the budget: " + _names(fit.unmeasured_blocks))
    warnings.warn(BlockwisePlanWarning(
        f"{type(model).__name__}'s training step cannot be traced whole ({cause[0].split(': ', 1)[-1]}"
        f"{'; ' + cause[1].strip() if len(cause) > 1 else ''}): remat planned its {len(fit.blocks)} repeated "
        f"blocks ({_names(fit.blocks)}) one by one at level {fit.level} of {levels - 1} and runs the rest as it "
        f"is{'; not traceable either, run as they are: ' + _names(fit.eager_blocks) if fit.eager_blocks else ''}"
        f"{skipped}. "
        f"Measured peak of the step on the example inputs: {fit.measured_bytes / MIB:.2f} MiB, budget "
        f"{budget_bytes / MIB:.2f} MiB (README: when a step does not trace whole)"), stacklevel=3)
    return module


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
