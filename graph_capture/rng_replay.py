"""Dropout that can be recomputed: its mask replayed from the generator state saved before it.

A dropout mask is random, so it could only be kept (1 byte per element, all step long). As
`torch.utils.checkpoint` does, remat can instead save the generator's state just before the
dropout draws its mask (`remat::rng_state`, 5056 bytes) and recompute the dropout later from that
state, giving the same mask bit for bit. The joint graph's `native_dropout(x, p, True)` (whose
output split_dropout_outputs has already replaced by x * mask * scale, so only the mask is read)
becomes

    s = remat::rng_state(x)                            # random: never recomputed (kept while needed)
    out, mask = remat::dropout(s, x, p, replay=False)  # deterministic given s: recomputable

and the runtime emits each recomputation with replay=True (runtime/partition.py). On the CPU the
first computation draws the mask as CPU native_dropout does (`bernoulli_(1 - p)` on a bool tensor),
from the global generator as eager does (nothing random runs between s and it: the schedule's first
computations follow the graph's order, and replays do not touch the global generator). A replay
draws it the same way from a private generator set to s (same mask, same allocations, checked by
tests/test_rng_replay.py), so the random stream after the step is eager's. Neither computes the
dropout's output, which nothing reads (`out` is left uninitialised).

On CUDA the state is the device generator's Philox seed and offset (16 bytes, a CPU tensor, as
`torch.utils.checkpoint` saves it). The first computation is CUDA native_dropout itself, on the
global generator (eager's kernel at eager's offset: eager's mask); a replay sets the generator to
s, runs the same kernel and puts the generator back where it was, so the replay draws the first
computation's mask and the stream after the step is eager's (checked on the device by
benchmarks/gpu_dropout.py; the CPU suite cannot run it).

A replay is right only if the first computation drew from s, i.e. nothing drew random numbers
between s and it. In the graph nothing does (s is inserted right before its dropout, and the
rewrite is skipped for a graph with any other random op), and fx runs nodes in order; a compiler
that reordered the pairs (Inductor, when it runs the plan) is caught: each first computation
checks that the last state saved is its own (a pointer comparison, no allocation) and raises
RngOrderError otherwise, so a reordering can never silently give a replay another mask.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from remat.core.errors import RematError
from remat.graph_capture.light_ops import light_op

__all__ = ["make_dropout_replayable", "rng_state", "dropout", "CPU_STATE_BYTES", "CUDA_STATE_BYTES",
           "REPLAY_DEVICES", "is_replayable_dropout", "probe_callable", "step_device_type", "RngOrderError"]

aten = torch.ops.aten
CPU_STATE_BYTES = int(torch.get_rng_state().numel())  # mt19937's state: 5056 bytes
CUDA_STATE_BYTES = 16  # Philox: a 64-bit seed and a 64-bit offset (CUDAGeneratorImpl::get_state)
REPLAY_DEVICES = ("cpu", "cuda")  # the step devices whose dropouts are made replayable
_LAST_SAVED = [None]  # data pointer of the state the latest rng_state saved, until its dropout draws


class RngOrderError(RematError, RuntimeError):
    """A dropout was about to draw from another generator state than the one saved for its replay
    (random ops ran out of the graph's order)."""


@light_op("rng_state", "(Tensor like) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
def rng_state(like: torch.Tensor) -> torch.Tensor:
    """The state of the generator `like`'s device draws from (`like` also orders it after the value
    the dropout reads): a CPU tensor on either device."""
    state = torch.cuda.get_rng_state(like.device) if like.device.type == "cuda" else torch.get_rng_state()
    _LAST_SAVED[0] = state.data_ptr()
    return state


@rng_state.register_fake
def _(like):
    size = CUDA_STATE_BYTES if like.device.type == "cuda" else CPU_STATE_BYTES
    return torch.empty(size, dtype=torch.uint8, device="cpu")


def _check_order(state: torch.Tensor) -> None:
    """A first computation must draw right after its own state was saved (module docstring)."""
    if _LAST_SAVED[0] != state.data_ptr():
        raise RngOrderError("remat: a dropout is about to draw from another generator state than the one saved "
                            "for its recomputation (random ops ran out of the graph's order); refusing rather "
                            "than let its recomputation draw another mask")
    _LAST_SAVED[0] = None


def _cuda_dropout(state: torch.Tensor, x: torch.Tensor, p: float, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA native_dropout at the global generator's state (first computation) or at `state`,
    the generator put back afterwards (replay), as torch.utils.checkpoint replays it."""
    if not replay:
        return aten.native_dropout.default(x, p, True)
    now = torch.cuda.get_rng_state(x.device)
    torch.cuda.set_rng_state(state, x.device)
    try:
        return aten.native_dropout.default(x, p, True)
    finally:
        torch.cuda.set_rng_state(now, x.device)


@light_op("dropout", "(Tensor state, Tensor x, float p, bool replay) -> (Tensor, Tensor)")
def dropout(state: torch.Tensor, x: torch.Tensor, p: float, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout(x, p, train=True)'s mask: drawn from the global generator (replay=False, the
    first computation), or replayed from `state`, leaving the global generator where it was. On
    the CPU its output is returned uninitialised (nothing reads it: see below); CUDA's kernel
    computes it with the mask."""
    if not replay:
        _check_order(state)
    if x.device.type == "cuda":
        return _cuda_dropout(state, x, p, replay)
    if x.device.type != "cpu":
        raise NotImplementedError(f"remat::dropout runs on the CPU and CUDA, not {x.device.type}")
    gen = None  # the first computation draws from the global generator, as eager's dropout
    if replay:
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
    the step runs on one of REPLAY_DEVICES and its forward draws random numbers nowhere else.
    Returns how many were rewritten."""
    if device_type not in REPLAY_DEVICES:
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
        with xv.fake_mode:  # the state of the step's device (a fake capture for CUDA traces on the CPU)
            size = CUDA_STATE_BYTES if device_type == "cuda" else CPU_STATE_BYTES
            s.meta = {**{k: v for k, v in nd.meta.items() if k != "val"},
                      "val": torch.empty(size, dtype=torch.uint8, device="cpu")}
        nd.target = torch.ops.remat.dropout.default
        nd.args, nd.kwargs = (s, x, p, False), {}
        count += 1
    if count:
        g.lint()
        gm.recompile()
    return count
