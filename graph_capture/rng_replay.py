"""Dropout that can be recomputed: its mask replayed from the generator state saved before it.

A dropout mask is random, so it could only be kept (1 byte per element, all step long). As
`torch.utils.checkpoint` does, remat can instead save the generator's state just before the
dropout draws its mask (`remat::rng_state`, 5056 bytes) and recompute the dropout later from that
state, giving the same mask bit for bit. The joint graph's `native_dropout(x, p, True)` (whose
output split_dropout_outputs has already replaced by x * mask * scale, so only the mask is read)
becomes

    s = remat::rng_state(x)                            # random: never recomputed (kept while needed)
    out, mask = remat::dropout(s, x, p, replay=False)  # deterministic given s: recomputable

and the runtime emits each recomputation with replay=True (runtime/partition.py). The first
computation draws the mask as CPU native_dropout does (`bernoulli_(1 - p)` on a bool tensor), from
the global generator as eager does (nothing random runs between s and it: the schedule's first
computations follow the graph's order, and replays do not touch the global generator). A replay
draws it the same way from a private generator set to s (same mask, same allocations, checked by
tests/test_rng_replay.py), so the random stream after the step is eager's. Neither computes the
dropout's output, which nothing reads (`out` is left uninitialised).

A replay is right only if the first computation drew from s, i.e. nothing drew random numbers
between s and it. In the graph nothing does (s is inserted right before its dropout, and the
rewrite is skipped for a graph with any other random op), and fx runs nodes in order; a compiler
that reordered the pairs (Inductor, when it runs the plan) is caught: each first computation
checks that the last state saved is its own (a pointer comparison, no allocation) and raises
RngOrderError otherwise, so a reordering can never silently give a replay another mask.

Only on the CPU for now: CUDA's fused dropout kernel draws differently, and replaying it through
the global CUDA generator is untested without a GPU. There the masks are kept, as before.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from remat.core.errors import RematError
from remat.graph_capture.light_ops import light_op

__all__ = ["make_dropout_replayable", "rng_state", "dropout", "CPU_STATE_BYTES", "is_replayable_dropout",
           "probe_callable", "step_device_type", "RngOrderError"]

aten = torch.ops.aten
CPU_STATE_BYTES = int(torch.get_rng_state().numel())  # mt19937's state: 5056 bytes
_LAST_SAVED = [None]  # data pointer of the state the latest rng_state saved, until its dropout draws


class RngOrderError(RematError, RuntimeError):
    """A dropout was about to draw from another generator state than the one saved for its replay
    (random ops ran out of the graph's order)."""


@light_op("rng_state", "(Tensor like) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
def rng_state(like: torch.Tensor) -> torch.Tensor:
    """The state of the CPU generator (`like` orders it after the value the dropout reads)."""
    state = torch.get_rng_state()
    _LAST_SAVED[0] = state.data_ptr()
    return state


@rng_state.register_fake
def _(like):
    return torch.empty(CPU_STATE_BYTES, dtype=torch.uint8, device="cpu")


@light_op("dropout", "(Tensor state, Tensor x, float p, bool replay) -> (Tensor, Tensor)")
def dropout(state: torch.Tensor, x: torch.Tensor, p: float, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout(x, p, train=True)'s mask: drawn from the global generator (replay=False, the
    first computation), or replayed from `state`, leaving the global generator untouched. Its
    output is returned uninitialised (nothing reads it: see below)."""
    if x.device.type != "cpu":
        raise NotImplementedError("remat::dropout runs on the CPU only")
    gen = None  # the first computation draws from the global generator, as eager's dropout
    if not replay:
        if _LAST_SAVED[0] != state.data_ptr():
            raise RngOrderError("remat: a dropout is about to draw from another generator state than the one saved "
                                "for its recomputation (random ops ran out of the graph's order); refusing rather "
                                "than let its recomputation draw another mask")
        _LAST_SAVED[0] = None
    else:
        gen = torch.Generator()
        gen.set_state(state)
    mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p, generator=gen)
    # The output is not computed: make_dropout_replayable rewrites only dropouts whose output
    # nothing reads (split_dropout_outputs computes x * mask * scale itself), and computing it
    # (a bool-to-float cast and two multiplications) took ~40% of the dropout's time.
    return torch.empty_like(x), mask


@dropout.register_fake
def _(state, x, p, replay):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def probe_callable(target):
    """What the op probes (graph_capture/workspace.py) run for `target`: a remat::dropout first
    computation is run as right after its state was saved (its arguments are made up)."""
    if target is not torch.ops.remat.dropout.default:
        return target

    def first_draw(state, x, p, replay):
        _LAST_SAVED[0] = state.data_ptr()
        return target(state, x, p, replay)

    return first_draw


def step_device_type(gm: fx.GraphModule) -> str:
    """The device type of the joint graph's inputs ("mixed" if they are on several)."""
    types = {t.device.type for n in gm.graph.nodes if n.op == "placeholder"
             for t in [n.meta.get("val")] if isinstance(t, torch.Tensor)}
    return types.pop() if len(types) == 1 else "mixed"


def is_replayable_dropout(n: fx.Node) -> bool:
    """Whether `n` is a remat::dropout (a recomputation of it must be emitted with replay=True)."""
    return n.op == "call_function" and n.target is torch.ops.remat.dropout.default


def _replayable(nd: fx.Node) -> bool:
    """A native_dropout(x, 0 < p < 1, train=True) whose output nothing reads (only its mask: a
    replay's output would otherwise have to match the kernel's too)."""
    x, p = nd.args[0], float(nd.args[1])
    train = nd.args[2] if len(nd.args) > 2 else nd.kwargs.get("train")
    if train is not True or not 0.0 < p < 1.0 or not isinstance(x, fx.Node):
        return False
    return all(u.target is operator.getitem and u.args[1] == 1 for u in nd.users)


def make_dropout_replayable(gm: fx.GraphModule, device_type: str) -> int:
    """Rewrite every forward native_dropout(x, p, True) with 0 < p < 1 of the joint graph whose
    output nothing reads (only its mask) as rng_state + remat::dropout (module docstring), when
    the step runs on `device_type` "cpu" and its forward draws random numbers nowhere else.
    Returns how many were rewritten."""
    if device_type != "cpu":
        return 0
    g = gm.graph
    count = 0
    forward = [n for n in g.nodes if n.op == "call_function" and n.meta.get("partitioner_tag") != "is_backward"]
    seeded = [n for n in forward if isinstance(n.target, torch._ops.OpOverload)
              and torch.Tag.nondeterministic_seeded in n.target.tags]
    if any(n.target is not aten.native_dropout.default or not _replayable(n) for n in seeded):
        return 0  # another random op could draw between a state and its dropout: keep every mask
    for nd in list(g.nodes):
        if nd.target is not aten.native_dropout.default or nd.meta.get("partitioner_tag") == "is_backward":
            continue
        if not _replayable(nd):
            continue
        x, p = nd.args[0], float(nd.args[1])
        with g.inserting_before(nd):
            s = g.call_function(torch.ops.remat.rng_state.default, (x,))
        xv = x.meta["val"]
        with xv.fake_mode:
            s.meta = {**{k: v for k, v in nd.meta.items() if k != "val"}, "val": rng_state(xv)}
        nd.target = torch.ops.remat.dropout.default
        nd.args, nd.kwargs = (s, x, p, False), {}
        count += 1
    if count:
        g.lint()
        gm.recompile()
    return count
