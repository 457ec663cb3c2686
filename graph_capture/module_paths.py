"""Attribute fx nodes to the module they came from, for readable reports.

AOTAutograd stamps every joint-graph node with the autograd sequence number of the forward op it
belongs to (backward nodes share their forward op's number). While the model is traced, module
hooks record which sequence numbers each module call spans; a node's module is the innermost span
that holds its number.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch.fx as fx
import torch.nn as nn

from remat.compat.torch_private import autograd_sequence_nr

__all__ = ["record_module_spans", "annotate_module_paths"]


@contextmanager
def record_module_spans(model: nn.Module):
    """Yields a list that fills with (first_seq, end_seq, module_path) while the model runs."""
    spans: list[tuple[int, int, str]] = []
    starts: dict[int, list[int]] = {}
    handles = []
    for name, mod in model.named_modules():
        if not name:
            continue

        def pre(m, args, _name=name):
            starts.setdefault(id(m), []).append(autograd_sequence_nr())

        def post(m, args, out, _name=name):
            s = starts[id(m)].pop()
            spans.append((s, autograd_sequence_nr(), _name))

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    try:
        yield spans
    finally:
        for h in handles:
            h.remove()


def annotate_module_paths(gm: fx.GraphModule, spans: list[tuple[int, int, str]]) -> None:
    """Set node.meta["remat_module_path"] from the recorded spans (innermost wins)."""
    if not spans:
        return
    # the innermost span is the shortest one containing the number
    ordered = sorted(spans, key=lambda s: s[1] - s[0])
    for n in gm.graph.nodes:
        seq = n.meta.get("seq_nr")
        if seq is None:
            continue
        for lo, hi, name in ordered:
            if lo <= seq < hi:
                n.meta["remat_module_path"] = name
                break
