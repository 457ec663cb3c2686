"""Remove the copies AOTAutograd's trace makes where the model itself copies nothing.

Eager `dropout(x, p=0.0, train=True)` (and `dropout(x, train=False)`) returns `x` itself, but
torch's decomposition, which AOTAutograd traces through, returns `x.clone()`. In a Llama or GPT-2
block the attention probabilities go through such a dropout: the traced step then keeps the
softmax output (for the softmax backward) *and* its copy (for the matmul backward), one s x s
tensor per layer that the model run as it is never allocates, so a plan with no recomputation
peaked above the unmodified model. A clone that copies an intermediate value bit for bit, with
the same strides and the whole storage, in a graph that mutates neither, can read its input
instead: the values are equal and nothing can tell the two apart.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from remat.graph_capture.profiling import storage_bytes
from remat.graph_capture.workspace import tensors_in

__all__ = ["drop_redundant_clones", "aliases_of", "refresh_fake_values"]

aten = torch.ops.aten


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _mutates(n: fx.Node) -> bool:
    if n.target is operator.getitem:
        return False
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._schema.is_mutable
    return True  # an op whose schema we cannot read: assume it may write


def _untouchable(g: fx.Graph) -> set[StorageWeakRef]:
    """Storages of the step's inputs (parameters, buffers, arguments) and storages some op may
    write to (conservatively: every tensor a mutating op reads)."""
    out: set[StorageWeakRef] = set()
    for n in g.nodes:
        if n.op == "placeholder" or (n.op == "call_function" and _mutates(n)):
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor):
                out.add(_storage(n.meta["val"]))
            for a in n.all_input_nodes:
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor):
                    out.add(_storage(v))
    return out


def _redundant(c: fx.Node, outputs: set[fx.Node], untouchable: set[StorageWeakRef]) -> bool:
    if c.op != "call_function" or c.target is not aten.clone.default or not c.args:
        return False
    x = c.args[0]
    if not isinstance(x, fx.Node) or x.op != "call_function":
        return False
    xv, cv = x.meta.get("val"), c.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(cv, torch.Tensor):
        return False
    if c in outputs or (xv.shape, xv.stride(), xv.dtype) != (cv.shape, cv.stride(), cv.dtype):
        return False
    # x must cover its whole storage, or reading x would keep a larger base alive than the copy
    if xv.storage_offset() != 0 or storage_bytes(xv) != storage_bytes(cv):
        return False
    # x is an intermediate value, and nothing writes to either tensor (or any alias of them)
    return _storage(xv) not in untouchable and _storage(cv) not in untouchable


def aliases_of(c: fx.Node) -> list[fx.Node] | None:
    """The nodes whose values alias c's storage through c (its views, their views...), in graph
    order; None when one of them is not a single tensor (a list of views: left alone)."""
    old = _storage(c.meta["val"])
    found: list[fx.Node] = []
    todo = list(c.users)
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        ts = tensors_in(n.meta.get("val"))
        if not any(_storage(t) == old for t in ts):
            continue
        if not isinstance(n.meta.get("val"), torch.Tensor) or n.op != "call_function":
            return None
        found.append(n)
        todo.extend(n.users)
    order = {n: i for i, n in enumerate(c.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def refresh_fake_values(aliases: list[fx.Node]) -> None:
    """Recompute the aliases' fake values (in graph order) from their inputs' as they are now, so
    they alias the storage those view (a clone dropped: x's; a copy made, traced_layout.py: the
    copy's): the graph builder groups them with its owner."""
    for n in aliases:
        v = n.meta["val"]
        args = fx.node.map_arg(n.args, lambda a: a.meta["val"])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: a.meta["val"])
        with v.fake_mode:
            n.meta["val"] = n.target(*args, **kwargs)


def drop_redundant_clones(gm: fx.GraphModule) -> int:
    """Make every reader of a redundant `clone(x)` read `x`; returns the number removed."""
    g = gm.graph
    outputs = set(g.output_node().all_input_nodes)
    untouchable = _untouchable(g)
    count = 0
    for c in list(g.nodes):
        if not _redundant(c, outputs, untouchable):
            continue
        aliases = aliases_of(c)
        if aliases is None:
            continue
        x, readers = c.args[0], list(c.users)
        saved = {n: n.meta["val"] for n in aliases}
        c.replace_all_uses_with(x)
        try:
            refresh_fake_values(aliases)
        except Exception:  # a view fake tensors cannot redo: keep the copy, as traced
            for n, v in saved.items():
                n.meta["val"] = v
            for r in readers:
                r.replace_input_with(x, c)
            continue
        g.erase_node(c)
        count += 1
    if count:
        g.lint()
        gm.recompile()
    return count
