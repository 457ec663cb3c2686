"""Rewrite the joint graph so it executes a Plan, then split it into forward and backward.

The plan's schedule is a flat list of TrainingGraph nodes; each expands to its fx nodes. We lay
the fx nodes out in schedule order in a new joint graph, copying a node again where the schedule
recomputes it, and every later reader takes the latest copy. The forward is every step up to the
first computation of the last forward node; the rest is the backward. Forward values the backward
reads become AOTAutograd's saved tensors. fx code drops each value after its last use, so the
executed lifetimes are the simulator's.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from remat.compat.torch_private import extract_fwd_bwd_modules
from remat.graph_capture.bn_replay import is_recomputable_batch_norm, recomputation_args
from remat.graph_capture.build import JointGraphInfo
from remat.graph_capture.rng_replay import is_replayable_dropout
from remat.runtime.compile import RECOMPUTED
from remat.core.plan import Plan

__all__ = ["scheduled_joint_graph", "partition_with_plan"]


def _forward_boundary(info: JointGraphInfo, schedule: list[str]) -> int:
    """Index of the last step of the forward pass."""
    last_fwd = [n.name for n in info.graph.forward_nodes][-1]
    return schedule.index(last_fwd)


def scheduled_joint_graph(info: JointGraphInfo, plan: Plan) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The joint graph in schedule order, and the forward nodes the backward reads."""
    old = info.gm.graph
    new = fx.Graph()
    latest: dict[fx.Node, fx.Node] = {}
    is_bwd: dict[fx.Node, bool] = {}

    def copy(n: fx.Node, backward: bool, recomputed: bool = False) -> None:
        c = new.node_copy(n, lambda a: latest[a])
        c.meta = dict(n.meta)
        if recomputed:  # a value computed again (counted under torch.compile: runtime/compile.py)
            c.meta[RECOMPUTED] = True
            if is_replayable_dropout(c):  # its mask drawn again from the state saved before the first
                c.args = (*c.args[:3], True)
            elif is_recomputable_batch_norm(c):  # BatchNorm's output again, its statistics dropped
                c.args = recomputation_args(c.args)
        # strict placement: without it the extraction would also copy into the backward any
        # forward node whose inputs happen to be saved, and fx keeps random ops even when unused
        c.meta["partitioner_tag"] = "must_be_in_backward" if backward else "must_be_in_forward"
        latest[n] = c
        is_bwd[c] = backward

    for n in old.nodes:
        if n.op in ("placeholder", "get_attr"):
            c = new.node_copy(n)
            c.meta = dict(n.meta)
            latest[n] = c
            is_bwd[c] = n.meta.get("partitioner_tag") == "is_backward"
    for n in info.resident_aliases:  # views of parameters/inputs: free, emitted once up front
        copy(n, any(is_bwd[latest[a]] for a in n.all_input_nodes))
    boundary = _forward_boundary(info, plan.schedule)
    seen: set[str] = set()
    for step, name in enumerate(plan.schedule):
        for n in info.groups[name]:
            copy(n, step > boundary, name in seen)
        seen.add(name)
    out = old.output_node()
    new_out = new.output(fx.node.map_arg(out.args[0], lambda a: latest[a]))
    new_out.meta = dict(out.meta)
    new.lint()
    gm = fx.GraphModule(info.gm, new)
    saved = []
    for c in new.nodes:
        if c.op == "output" or is_bwd.get(c, True):
            continue
        if any(is_bwd.get(u, False) for u in c.users):
            saved.append(c)
    return gm, saved


def partition_with_plan(info: JointGraphInfo, plan: Plan) -> tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd's (forward, backward) modules for the joint graph laid out in `plan`'s order:
    what the forward computes and the backward reads is saved, recomputations run as node copies."""
    gm, saved = scheduled_joint_graph(info, plan)
    saved_tensors = [n for n in saved if isinstance(n.meta.get("val"), torch.Tensor)]
    saved_syms = [n for n in saved if not isinstance(n.meta.get("val"), torch.Tensor)]
    return extract_fwd_bwd_modules(gm, saved_tensors, saved_syms, num_fwd_outputs=info.num_fwd_outputs)
