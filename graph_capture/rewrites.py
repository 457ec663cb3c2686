"""The rewrites every captured joint graph goes through before its TrainingGraph is built, in one
place, so that remat.capture, the runtime and the fake-tensor planner all plan the same graph.

In order: dropout's output split off its mask (build.split_dropout_outputs), copies the trace makes
where eager aliases dropped (clones.drop_redundant_clones), dropout made replayable from a saved
generator state where the step's device allows it (rng_replay.make_dropout_replayable), training
BatchNorm split into a recomputable output and its kept statistics where the step's device allows
it (bn_replay.make_batch_norm_recomputable: on the CPU only, where its recomputation is proven
bit-identical and its memory exact; on other devices the graph keeps the single BatchNorm op, so
its output is kept, as before).
"""
from __future__ import annotations

import torch.fx as fx

from remat.graph_capture.bn_replay import make_batch_norm_recomputable
from remat.graph_capture.build import split_dropout_outputs
from remat.graph_capture.clones import drop_redundant_clones
from remat.graph_capture.rng_replay import make_dropout_replayable

__all__ = ["prepare_joint_graph"]


def prepare_joint_graph(joint_gm: fx.GraphModule, device_type: str) -> None:
    """Rewrite `joint_gm` in place for planning on `device_type` ("cpu", "cuda", ...)."""
    split_dropout_outputs(joint_gm)
    drop_redundant_clones(joint_gm)  # copies the trace makes where eager aliases (dropout p=0)
    make_dropout_replayable(joint_gm, device_type)  # recomputable from a saved RNG state
    make_batch_norm_recomputable(joint_gm, device_type)  # BatchNorm's output apart from its statistics
