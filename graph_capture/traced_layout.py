"""Views that cannot run on the layout a real kernel gives: the tensor copied into its traced layout.

The trace decides every tensor's strides with PyTorch's fake kernels, and a `view` in the joint
graph is valid for those strides. Some real kernels lay their output out otherwise: CPU
`softplus_backward` follows its gradient's transposed strides where its fake kernel returns a
contiguous tensor (Hugging Face Doge's dynamic mask), CPU BatchNorm on a transposed input returns a
contiguous output where its fake kernel keeps the transposed strides (PatchTST). A view of such an
output fails at the planned step's first call ("view size is not compatible"; torch.compile's
aot_eager backend fails the same way). The op probe (workspace.py) runs every op on the layouts the
real ops before it gave, so it sees those views fail: each is then made to read a copy of its
input in the traced layout (`clone` into the contiguous format, or `empty_strided` and `copy` for
another layout), inserted before it in the joint graph, and the graph is probed again. The copy is
a node like any other: the simulator counts its bytes, the planner may drop and recompute it, and
the values and gradients are the model's (only the strides change, to those the trace assumed).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from remat.graph_capture.clones import aliases_of, refresh_fake_values

__all__ = ["copy_into_traced_layouts", "refuse_misfit_views"]


def _is_view(target) -> bool:
    """Whether an fx node's target is an ATen op returning a view of its input."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def copy_into_traced_layouts(gm: fx.GraphModule, views: list[fx.Node]) -> int:
    """Make each of `views` read a copy of its input laid out as the input's fake tensor (see the
    module docstring): one copy per input, before the first of its views. Returns the copies made."""
    g = gm.graph
    position = {n: i for i, n in enumerate(g.nodes)}
    by_source: dict[fx.Node, list[fx.Node]] = {}
    made = 0
    for view in sorted(set(views), key=position.__getitem__):
        by_source.setdefault(view.args[0], []).append(view)
    for source, readers in by_source.items():
        # each view's own views, whose fake values must follow it onto the copy (None: a list of
        # views among them, left as traced, as graph_capture/clones.py leaves them)
        following = [aliases_of(view) for view in readers]
        if any(f is None for f in following):
            continue
        v = source.meta["val"]
        meta = {k: x for k, x in readers[0].meta.items() if k not in ("val", "tensor_meta")}
        with g.inserting_before(readers[0]), v.fake_mode:
            if v.is_contiguous():
                copy = g.call_function(torch.ops.aten.clone.default, (source,),
                                       {"memory_format": torch.contiguous_format})
                copy.meta.update(meta, val=torch.ops.aten.clone.default(v, memory_format=torch.contiguous_format))
            else:
                size, stride = list(v.shape), list(v.stride())
                kwargs = {"dtype": v.dtype, "device": v.device}
                empty = g.call_function(torch.ops.aten.empty_strided.default, (size, stride), kwargs)
                empty.meta.update(meta, val=torch.ops.aten.empty_strided.default(size, stride, **kwargs))
                copy = g.call_function(torch.ops.aten.copy.default, (empty, source))
                copy.meta.update(meta, val=torch.ops.aten.copy.default(empty.meta["val"], v))
        # the views and their own views: their fake values alias the copy now, so that the graph
        # builder groups them with it (not with the source)
        moved = [n for view, after in zip(readers, following) for n in (view, *after)]
        saved = {n: n.meta["val"] for n in moved}
        for view in readers:
            view.replace_input_with(source, copy)
        try:
            refresh_fake_values(moved)
        except Exception:  # a view fake tensors cannot redo on the copy: left as traced (refused below)
            for n, val in saved.items():
                n.meta["val"] = val
            for view in readers:
                view.replace_input_with(copy, source)
            _erase_back_to(g, copy, source)
            continue
        made += 1
    g.lint()
    gm.recompile()
    return made


def _erase_back_to(g: fx.Graph, copy: fx.Node, source: fx.Node) -> None:
    """Remove `copy` and the `empty_strided` it copies into, where it made one."""
    empty = copy.args[0] if copy.args[0] is not source else None
    g.erase_node(copy)
    if isinstance(empty, fx.Node) and not empty.users:
        g.erase_node(empty)


def refuse_misfit_views(misfits: list[tuple[fx.Node, tuple[int, ...]]]) -> None:
    """Raise TraceError for the first view that still cannot run on its input's real layout: the
    planned step would raise "view size is not compatible" at its first call."""
    from remat.graph_capture.joint import TraceError

    for n, real in misfits[:1]:
        source, fake = n.args[0], tuple(n.args[0].meta["val"].stride())
        # the op whose kernels disagree: the first one before the view that is not a view itself
        # (a transpose only passes its input's layout on; PatchTST's BatchNorm before it decides it)
        maker = source
        while _is_view(maker.target) and maker.args and isinstance(maker.args[0], fx.Node):
            maker = maker.args[0]
        where = maker.meta.get("remat_module_path")
        via = f", through {source.name} ({source.target})" if maker is not source else ""
        raise TraceError(
            f"{maker.name} ({maker.target}{f', in {where}' if where else ''}) is laid out with other strides by "
            f"the real kernel than by the fake one the trace ran{via}: {real} against {fake} where the view "
            f"{n.name} takes it, which cannot run on the real layout (no copy in the traced layout could be made "
            f"for it): the planned step would fail at its first call (a mismatch of PyTorch's fake kernel; torch.compile's "
            f"aot_eager backend fails the same way). Make that tensor contiguous in the model (`.contiguous()` "
            f"after it) or take it with `.reshape`.")
