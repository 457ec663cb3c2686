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
computation is native_dropout itself, drawing from the global generator as eager does (nothing
random runs between s and it: the schedule's first computations follow the graph's order, and
replays do not touch the global generator). A replay draws the mask with a private generator set
to s (`bernoulli_` on a bool tensor, as the CPU kernel does: same mask, same allocations, checked
by tests/test_rng_replay.py), so the random stream after the step is eager's.

Only on the CPU for now: CUDA's fused dropout kernel draws differently, and replaying it through
the global CUDA generator is untested without a GPU; and not when Inductor compiles the plan (it
may reorder the state and the draw). There the masks are kept, as before.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["make_dropout_replayable", "rng_state", "dropout", "CPU_STATE_BYTES", "is_replayable_dropout",
           "replays_dropout", "step_device_type"]

aten = torch.ops.aten
CPU_STATE_BYTES = int(torch.get_rng_state().numel())  # mt19937's state: 5056 bytes


@torch.library.custom_op("remat::rng_state", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def rng_state(like: torch.Tensor) -> torch.Tensor:
    """The state of the CPU generator (`like` orders it after the value the dropout reads)."""
    return torch.get_rng_state()


@rng_state.register_fake
def _(like):
    return torch.empty(CPU_STATE_BYTES, dtype=torch.uint8, device="cpu")


@torch.library.custom_op("remat::dropout", mutates_args=())
def dropout(state: torch.Tensor, x: torch.Tensor, p: float, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout(x, p, train=True): drawn from the global generator (replay=False, the first
    computation), or replayed from `state`, leaving the global generator untouched."""
    if not replay:
        out, mask = aten.native_dropout(x, p, True)
        return out, mask
    if x.device.type != "cpu":
        raise NotImplementedError("remat::dropout replays on the CPU only")
    gen = torch.Generator()
    gen.set_state(state)
    p1m = 1.0 - p
    mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(p1m, generator=gen)
    return x.mul(mask).mul_(1.0 / p1m), mask


@dropout.register_fake
def _(state, x, p, replay):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def replays_dropout(model: torch.nn.Module) -> bool:
    """Whether a plan for `model` may recompute dropout (not when Inductor will run the plan:
    torch.compile'd submodules; see the module docstring). capture, plan and optimize all ask
    this, so they trace the same graph."""
    from remat.compat.torch_private import compiled_submodules

    return not compiled_submodules(model)


def step_device_type(gm: fx.GraphModule) -> str:
    """The device type of the joint graph's inputs ("mixed" if they are on several)."""
    types = {t.device.type for n in gm.graph.nodes if n.op == "placeholder"
             for t in [n.meta.get("val")] if isinstance(t, torch.Tensor)}
    return types.pop() if len(types) == 1 else "mixed"


def is_replayable_dropout(n: fx.Node) -> bool:
    """Whether `n` is a remat::dropout (a recomputation of it must be emitted with replay=True)."""
    return n.op == "call_function" and n.target is torch.ops.remat.dropout.default


def make_dropout_replayable(gm: fx.GraphModule, device_type: str) -> int:
    """Rewrite every forward native_dropout(x, p, True) with 0 < p < 1 of the joint graph whose
    output nothing reads (only its mask) as rng_state + remat::dropout (module docstring), when
    the step runs on `device_type` "cpu". Returns how many were rewritten."""
    if device_type != "cpu":
        return 0
    g = gm.graph
    count = 0
    for nd in list(g.nodes):
        if nd.target is not aten.native_dropout.default or nd.meta.get("partitioner_tag") == "is_backward":
            continue
        x, p = nd.args[0], float(nd.args[1])
        train = nd.args[2] if len(nd.args) > 2 else nd.kwargs.get("train")
        if train is not True or not 0.0 < p < 1.0 or not isinstance(x, fx.Node):
            continue
        if any(u.target is not operator.getitem or u.args[1] != 1 for u in nd.users):
            continue  # its output is read as it is: a replay's output would have to match it too
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
