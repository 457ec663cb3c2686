"""Build a TrainingGraph from AOTAutograd's joint graph.

One TrainingGraph node per *allocation*: an op that creates new storage, together with every view
and getitem that only aliases what it created (a view frees nothing and costs nothing; the storage
lives while any alias of it is live). Views of parameters and inputs alias resident memory and are
not nodes at all. A storage used by nothing is counted as the op's workspace.

What the real step holds, not only what the trace shows (so the simulator matches the measured CPU
peak to the byte): each storage has the size the real kernel gives it (workspace.py runs every op
once: CPU mse_loss's 0-d loss is a view of a batch-sized buffer); the new values of mutated
buffers (BatchNorm's running statistics) are `forward_kept`, dropped when the forward ends or after
their last backward reader; the backward's tangents are listed with their readers, as they only
exist once the backward starts (see TrainingGraph).

Before grouping, `native_dropout`'s output is split off its mask: `native_dropout` keeps producing
the mask (1 byte per element; on CPU replayable from its saved generator state, see
graph_capture/rng_replay.py) and the output becomes `x * mask * scale`,
the very arithmetic the CPU kernel performs (bit-identical), which can be recomputed freely. Without
this the 4-byte output would be tied to the mask's lifetime.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry

from remat.compat.torch_private import is_input_mutation_output
from remat.graph_capture.profiling import allocation_bytes
from remat.graph_capture.profiling import storage_bytes as _storage_bytes
from remat.core.training_graph import Node, TrainingGraph
from remat.graph_capture.cuda_library import cuda_library_workspace_bytes
from remat.graph_capture.traced_layout import copy_into_traced_layouts, refuse_misfit_views
from remat.graph_capture.workspace import OpProbe, probe_ops, tensors_in

__all__ = ["JointGraphInfo", "build_training_graph", "split_dropout_outputs", "BYTES_WEIGHT"]

aten = torch.ops.aten

# Cost model: FLOPs of matmul-like ops plus BYTES_WEIGHT FLOP-equivalents per byte read or written,
# so memory-bound ops are not free (roughly a CPU's FLOP/s to memory-bandwidth ratio).
BYTES_WEIGHT = 4.0
VIEW_COST = 1.0  # a view launches nothing but is not entirely free


@dataclass
class JointGraphInfo:
    """What the runtime needs to map a plan back onto the fx joint graph."""

    gm: fx.GraphModule
    num_fwd_outputs: int
    groups: dict[str, list[fx.Node]]  # TrainingGraph node name -> its fx nodes, in graph order
    resident_aliases: list[fx.Node]  # views of placeholders, emitted up front by the runtime
    graph: TrainingGraph


def _dropout_scale(scale: float, x: torch.Tensor) -> float:
    """The factor eager dropout really multiplies `x` (and, backward, its gradient) by. On CPU,
    `F.dropout` multiplies by a noise tensor of x's dtype, so under autocast (bfloat16/float16)
    1/(1-p) is rounded to that dtype first (1/0.9 -> 1.109375 in bfloat16); the traced graph's
    native_dropout / native_dropout_backward with the unrounded float are off by one rounding in
    ~25% of elements, so the rewrite uses the rounded factor (a no-op for float32/float64). CUDA's
    fused kernel multiplies by the float32 factor, as `mul` with a Python float does: left as is
    (tests/test_autocast.py compares the result with eager under autocast)."""
    if x.device.type == "cpu" and x.dtype.is_floating_point:
        return float(torch.tensor(scale, dtype=x.dtype))
    return scale


def split_dropout_outputs(gm: fx.GraphModule) -> int:
    """Rewrite getitem(native_dropout(x, p, True), 0) as mul(mul(x, mask), 1/(1-p)). Returns the
    number of dropouts rewritten."""
    g = gm.graph
    count = rescaled = 0
    for nd in list(g.nodes):
        if nd.target is aten.native_dropout_backward.default:  # its scale, as eager's (see above)
            grad, mask, scale = nd.args[:3]
            nd.args = (grad, mask, _dropout_scale(float(scale), grad.meta["val"]), *nd.args[3:])
            rescaled += 1
            continue
        if nd.target is not aten.native_dropout.default:
            continue
        x, p = nd.args[0], float(nd.args[1])
        train = nd.args[2] if len(nd.args) > 2 else nd.kwargs.get("train")
        if train is False or p <= 0.0 or p >= 1.0:
            continue
        outs = {u.args[1]: u for u in nd.users if u.target is operator.getitem}
        if 0 not in outs or 1 not in outs:
            continue
        out, mask = outs[0], outs[1]
        scale = _dropout_scale(1.0 / (1.0 - p), x.meta["val"])
        with g.inserting_after(mask):
            m1 = g.call_function(aten.mul.Tensor, (x, mask))
        with g.inserting_after(m1):
            m2 = g.call_function(aten.mul.Tensor, (m1, scale))
        xv, mv = x.meta["val"], mask.meta["val"]
        # the final product takes over the output's fake value (its views alias that storage);
        # the dropout's own, now unread, output and x * mask get fresh storages
        with xv.fake_mode:
            m1.meta = {**out.meta, "val": aten.mul.Tensor(xv, mv)}
            nd.meta["val"] = (torch.empty_like(out.meta["val"]), mv)
        m2.meta = dict(out.meta)
        out.replace_all_uses_with(m2)
        g.erase_node(out)
        count += 1
    if count or rescaled:
        g.lint()
        gm.recompile()
    return count


def _is_backward(n: fx.Node) -> bool:
    return n.meta.get("partitioner_tag") == "is_backward"


def _flops(n: fx.Node) -> int:
    packet = getattr(n.target, "overloadpacket", None)
    if packet not in flop_registry:
        return 0
    args = fx.node.map_arg(n.args, lambda a: a.meta["val"])
    kwargs = fx.node.map_arg(n.kwargs, lambda a: a.meta["val"])
    try:
        return int(flop_registry[packet](*args, **kwargs, out_val=n.meta["val"]))
    except Exception:
        return 0


def _traffic_bytes(n: fx.Node) -> int:
    read = sum(t.numel() * t.element_size() for a in n.all_input_nodes for t in tensors_in(a.meta.get("val")))
    written = sum(t.numel() * t.element_size() for t in tensors_in(n.meta.get("val")))
    return read + written


def _is_mutation(desc) -> bool:
    """Whether an output descriptor of AOTAutograd's joint graph is a mutated input's new value."""
    # a torch without output descriptors (None): count the output as kept (conservative)
    return bool(is_input_mutation_output(desc))


def _is_tangent(n: fx.Node) -> bool:
    desc = n.meta.get("desc")
    if desc is not None and hasattr(desc, "is_tangent"):
        return bool(desc.is_tangent())
    return n.name.startswith("tangents")  # AOTAutograd's own naming (partitioners._is_tangent)


def _tangents(g: fx.Graph, group_of: dict[fx.Node, fx.Node], aliases: set[fx.Node],
              allocator: str = "cpu") -> tuple[tuple[int, tuple[str, ...]], ...]:
    """(bytes, readers) of each tangent input of the backward. The loss's tangent is the seed
    gradient autograd's engine creates for `loss.backward()` and holds until the backward returns:
    no readers (held to the end). The tangents of other outputs are, in the step the budget covers
    (`model(...)[loss].backward()`), zeros that AOTAutograd creates and the backward graph drops
    after their last reader. The loss is taken to be every one-element output (0-d, or shape (1,):
    `backward()` seeds either), or the only output: an output the user also backpropagates through
    is outside the planned step (OutsideBudgetWarning). Another one-element output (an auxiliary
    loss returned beside the loss) is counted held too: a few bytes over, never under."""
    ts = [n for n in g.nodes if n.op == "placeholder" and _is_tangent(n)
          and isinstance(n.meta.get("val"), torch.Tensor)]

    def readers(n: fx.Node) -> set[str]:
        out: set[str] = set()
        for u in n.users:
            if u in aliases:  # a view of the tangent, emitted up front: its readers read the tangent
                out |= readers(u)
            elif group_of.get(u) is not None:
                out.add(group_of[u].name)
        return out

    def returned(n: fx.Node) -> bool:  # a gradient that is the tangent itself lives to the end
        return any(u.op == "output" or (u in aliases and returned(u)) for u in n.users)

    result = []
    for n in ts:
        held = len(ts) == 1 or n.meta["val"].numel() == 1 or returned(n)
        result.append((allocation_bytes(_storage_bytes(n.meta["val"]), allocator),
                       () if held else tuple(sorted(readers(n)))))
    return tuple(result)


def _allocator_of(devices: set[torch.device]) -> str:
    """The memory model of a graph whose inputs live on `devices`: CUDA's when any is a GPU."""
    return "cuda" if any(d.type == "cuda" for d in devices) else "cpu"


def build_training_graph(gm: fx.GraphModule, num_fwd_outputs: int, name: str = "",
                         probe: bool | OpProbe = True, allocator: str | None = None) -> JointGraphInfo:
    """Group the (already dropout-split) joint graph into allocation nodes. With `probe`, each
    op's internal workspace is measured on real tensors of the traced shapes (see workspace.py);
    an OpProbe is taken as that measurement (made by the caller, e.g. on smaller shapes).
    `allocator` ("cpu": exact bytes; "cuda": each allocation rounded up to 512 bytes, as CUDA's
    caching allocator counts it; default: "cuda" for a graph on a GPU) is how bytes are counted;
    the traced, unrounded sizes are kept in the graph's meta for its fingerprint."""
    g = gm.graph
    output_node = g.output_node()
    out_args = list(output_node.args[0])
    output_nodes = {a for a in out_args if isinstance(a, fx.Node)}
    # outputs that are only the new values of mutated inputs (AOTAutograd's output descriptors):
    # the forward copies them into the inputs and drops them (see TrainingGraph's forward_kept)
    descs = output_node.meta.get("desc")
    if not isinstance(descs, (list, tuple)) or len(descs) != len(out_args):
        descs = [None] * len(out_args)
    user_visible = {a for a, d in zip(out_args, descs) if isinstance(a, fx.Node) and not _is_mutation(d)}

    storage_owner: dict[StorageWeakRef, fx.Node] = {}  # storage -> fx node that allocated it
    storage_bytes: dict[StorageWeakRef, int] = {}
    traced_excess: dict[StorageWeakRef, int] = {}  # real minus traced bytes, where they differ
    resident: set[StorageWeakRef] = set()
    group_of: dict[fx.Node, fx.Node] = {}  # fx node -> owning (allocating) fx node, or None if resident
    resident_aliases: list[fx.Node] = []
    resident_bytes = 0

    # run each op once on real tensors: its workspace, and the real size of its outputs' storages
    devices = {t.device for n in g.nodes if n.op == "placeholder" for t in tensors_in(n.meta.get("val"))}
    allocator = allocator or _allocator_of(devices)
    probed = probe if isinstance(probe, OpProbe) else OpProbe()
    if probe is True and len(devices) == 1:
        probed = probe_ops(gm, next(iter(devices)), allocator=allocator)
        # views that cannot run on the layout a real kernel gives read a copy in the traced one
        if probed.misfit_views and copy_into_traced_layouts(gm, [view for view, _ in probed.misfit_views]):
            probed = probe_ops(gm, next(iter(devices)), allocator=allocator)
        refuse_misfit_views(probed.misfit_views)
    # a plan for a GPU, made where one is (a real capture, or planning on fake tensors traced on
    # the CPU): the math libraries' workspaces the step will hold (cuda_library.py)
    library_bytes = 0
    if allocator == "cuda" and probe is not False and torch.cuda.is_available():
        on = next((d for d in devices if d.type == "cuda"), torch.device("cuda", torch.cuda.current_device()))
        dtypes = {t.dtype for n in g.nodes if n.op in ("placeholder", "call_function")
                  for t in tensors_in(n.meta.get("val")) if t.dtype.is_floating_point}
        library_bytes = cuda_library_workspace_bytes(on, tuple(sorted(dtypes | {torch.float32}, key=str)))
    traced_resident = 0  # the resident bytes as traced (unrounded), for the fingerprint

    position = {n: i for i, n in enumerate(g.nodes)}
    for n in g.nodes:
        if n.op == "placeholder":
            # each tangent is its own tensor when the step runs (the gradient autograd passes for
            # each output, zeros where none), even where the trace gives tangents of outputs that
            # alias one storage (BLIP returns one tensor twice): the simulator counts each
            tangent = _is_tangent(n)
            for t in tensors_in(n.meta.get("val")):
                ref = StorageWeakRef(t.untyped_storage())
                if tangent or ref not in resident:
                    resident.add(ref)
                    resident_bytes += allocation_bytes(_storage_bytes(t), allocator)
                    traced_resident += _storage_bytes(t)
            continue
        if n.op != "call_function":
            continue
        refs = [StorageWeakRef(t.untyped_storage()) for t in tensors_in(n.meta.get("val"))]
        real = probed.out_storages.get(n.name, ())
        owners = set()
        fresh = False
        for j, (ref, t) in enumerate(zip(refs, tensors_in(n.meta.get("val")))):
            if ref in resident:
                owners.add(None)
            elif ref in storage_owner:
                owners.add(storage_owner[ref])
            else:
                storage_owner[ref] = n
                # what the real kernel's output holds, where the probe saw it (mse_loss's 0-d loss
                # is a view of a batch-sized buffer); the fake tensor's own size otherwise
                real_b = real[j] if len(real) == len(refs) else None
                if real_b is None:
                    real_b = allocation_bytes(_storage_bytes(t), allocator)
                storage_bytes[ref] = real_b
                if storage_bytes[ref] != _storage_bytes(t):
                    traced_excess[ref] = storage_bytes[ref] - _storage_bytes(t)
                fresh = True
        if fresh or not refs:  # allocates (or produces no tensor: a tuple op, kept as its own group)
            group_of[n] = n
        elif owners == {None}:
            resident_aliases.append(n)
        elif len(owners) == 1:
            group_of[n] = next(iter(owners))
        else:  # aliases of several owners (e.g. a list of views); keep the earliest in graph order,
            # conservatively (by position, not set order: node hashes differ between processes)
            group_of[n] = min((o for o in owners if o is not None), key=position.__getitem__)

    # Tuple-returning allocators: their getitems own no storage of their own; fold them in.
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in g.nodes:
        if n in group_of:
            groups.setdefault(group_of[n], []).append(n)

    def group_key(fxn: fx.Node) -> fx.Node | None:
        return group_of.get(fxn)

    # each owner's storages, in the order they were allocated (one pass: per group a scan of every
    # storage was quadratic, 29 s of a 20,542-node trace, RWKV's CPU loop)
    owned_by: dict[fx.Node, list[StorageWeakRef]] = {}
    for ref, o in storage_owner.items():
        owned_by.setdefault(o, []).append(ref)

    nodes: list[Node] = []
    fx_groups: dict[str, list[fx.Node]] = {}
    traced: dict[str, list[int]] = {}  # node -> [out_bytes, kept_bytes] as traced, where they differ
    for owner, members in groups.items():
        member_set = set(members)
        inputs: list[str] = []
        for m in members:
            for a in m.all_input_nodes:
                k = group_key(a)
                if a in member_set or k is None or k is owner:
                    continue
                if k.name not in inputs:
                    inputs.append(k.name)
        # bytes of each storage this group allocated, split by whether anything outside reads it
        out_b = kept_b = ws_b = 0
        excess_out = excess_kept = 0  # what the real storages hold beyond the traced ones
        parts: list[tuple[int, tuple[str, ...]]] = []  # (bytes, readers) of each read storage
        fwd_kept: list[tuple[int, tuple[str, ...]]] = []  # (bytes, readers) of mutation outputs
        for ref in owned_by.get(owner, ()):
            aliases = [m for m in members if any(StorageWeakRef(t.untyped_storage()) == ref
                                                 for t in tensors_in(m.meta.get("val")))]
            is_out = any(m in output_nodes for m in aliases)
            readers = sorted({group_of[u].name for m in aliases for u in m.users
                              if u not in member_set and u in group_of})
            if is_out:
                kept_b += storage_bytes[ref]
                excess_kept += traced_excess.get(ref, 0)
                if not any(m in user_visible for m in aliases):  # a mutated buffer's new value
                    fwd_kept.append((storage_bytes[ref], tuple(readers)))
            elif readers:
                out_b += storage_bytes[ref]
                excess_out += traced_excess.get(ref, 0)
                parts.append((storage_bytes[ref], tuple(readers)))
            else:
                ws_b += storage_bytes[ref]
        # several outputs (layer/batch norm, ...): each lives until its own last reader has run
        out_parts = tuple(parts) if len(parts) > 1 else ()
        ws_b += max((probed.workspace.get(m.name, 0) for m in members), default=0)
        # the owner does the work; its views and getitems launch nothing (VIEW_COST each)
        flops = _flops(owner)
        cost = flops + BYTES_WEIGHT * _traffic_bytes(owner) + VIEW_COST * (len(members) - 1)
        is_random = any(isinstance(m.target, torch._ops.OpOverload) and
                        torch.Tag.nondeterministic_seeded in m.target.tags for m in members)
        nodes.append(Node(name=owner.name, op=str(getattr(owner.target, "__name__", owner.target)),
                          inputs=tuple(inputs), out_bytes=out_b, kept_bytes=kept_b,
                          workspace_bytes=ws_b, cost=max(cost, VIEW_COST), flops=flops,
                          is_backward=_is_backward(owner), is_random=is_random,
                          module_path=owner.meta.get("remat_module_path", ""),
                          members=tuple(m.name for m in members), out_parts=out_parts,
                          forward_kept=tuple(fwd_kept)))
        fx_groups[owner.name] = members
        if excess_out or excess_kept:
            traced[owner.name] = [out_b - excess_out, kept_b - excess_kept]
    # the traced sizes where the real ones differ: the fingerprint hashes these, so a plan saved on
    # one machine still matches the same graph traced on another (see TrainingGraph.fingerprint)
    meta = {"fx_nodes": sum(1 for _ in g.nodes), "num_fwd_outputs": num_fwd_outputs}
    if traced:
        meta["traced_bytes"] = traced
    tangents = _tangents(g, group_of, set(resident_aliases), allocator)
    if library_bytes:
        resident_bytes += library_bytes
        meta["library_workspace_bytes"] = library_bytes
    if allocator != "cpu":
        meta["allocator"] = allocator
        if traced_resident != resident_bytes:  # the fingerprint hashes the traced bytes
            meta["traced_resident_bytes"] = traced_resident
    tg = TrainingGraph(nodes=tuple(nodes), resident_bytes=resident_bytes, name=name, meta=meta,
                       tangents=tangents)
    return JointGraphInfo(gm=gm, num_fwd_outputs=num_fwd_outputs, groups=fx_groups,
                          resident_aliases=resident_aliases, graph=tg)
