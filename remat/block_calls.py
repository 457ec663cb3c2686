"""What a model passes its repeated blocks in training (remat/blockwise.py, 2.): the blocks'
forwards redirected while the model runs, and their calls recorded as training makes them; and the
blocks' parts, planned where no block traces (`block_parts`).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from remat.compat.torch_private import pytree

__all__ = ["Redirected", "block_structure", "block_parts", "record_block_calls", "cuda_device", "RECORD_FORWARDS"]

RECORD_FORWARDS = 4  # forwards recording the blocks' calls, at most (remat/blockwise.py, 2.)


def block_structure(m: nn.Module) -> tuple:
    """What makes two blocks the same: class, parameter names, shapes and dtypes."""
    return (type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()))


def block_parts(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """(name, module) of the parts of the blocks `found` (repeated_blocks'): the children holding
    parameters (a ModuleList's or ModuleDict's entries in its place: they have no forward of their
    own) whose name and structure recur in at least two blocks, as repeated_blocks asks of blocks
    (an encoder's and a decoder's blocks differ, and a first block may hold a table the others
    read), in each block's order."""
    def parts(m: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
        out = []
        for c, child in m.named_children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                out += parts(child, f"{prefix}{c}.")
            elif next(child.parameters(), None) is not None:
                out.append((f"{prefix}{c}", child))
        return out

    each = [parts(b, "") for _, b in found]
    count = Counter((c, block_structure(m)) for p in each for c, m in p)
    return [(f"{name}.{c}", m) for (name, _), p in zip(found, each) for c, m in p if count[c, block_structure(m)] >= 2]


class Redirected:
    """Context manager: while entered, block i's `forward` is `forwards[i]` (made from the block's
    own forward); each block's own is restored after."""

    def __init__(self, blocks: Sequence[nn.Module], make):
        self.blocks, self.make = blocks, make

    def __enter__(self):
        self.saved = [b.__dict__.get("forward") for b in self.blocks]
        for i, (b, own) in enumerate(zip(self.blocks, self.saved)):
            b.__dict__["forward"] = self.make(i, own or type(b).forward.__get__(b))
        return self

    def __exit__(self, *exc):
        for b, own in zip(self.blocks, self.saved):
            if own is None:
                b.__dict__.pop("forward", None)
            else:
                b.__dict__["forward"] = own
        return False


def _passed_on(t: Any) -> Any:
    """A block's output as the recording forward passes it on: detached, requiring grad where it did.
    A copy that requires grad, not the output made a leaf: the model may write into a block's output
    in place (XLM's `tensor *= mask`), which autograd refuses on a leaf that requires grad."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().requires_grad_().clone() if t.requires_grad else t.detach()


def _detached(x: Any) -> Any:
    """A copy of a block's argument as training passes it: tensors detached and copied with their
    strides (a non-contiguous slice stays laid out as the calls will pass it: strides are part of a
    call's key; an expanded tensor, stride 0 along a dimension, is copied as one slice along it,
    expanded again), requiring grad where the original does."""
    def copy(t):
        if not isinstance(t, torch.Tensor):
            return t
        src, expanded = t.detach(), False
        for d, (n, st) in enumerate(zip(t.shape, t.stride())):
            if st == 0 and n > 1:  # ProphetNet's relative positions: (0, 0, 32, 1)
                src, expanded = src.narrow(d, 0, 1), True
        c = torch.empty_strided(src.shape, src.stride(), dtype=t.dtype, device=t.device).copy_(src)
        if expanded:
            c = c.expand(t.shape)
        return c.requires_grad_(t.requires_grad) if c.is_floating_point() or c.is_complex() else c
    return pytree.tree_map(copy, x)


def record_block_calls(model: nn.Module, blocks: Sequence[nn.Module], args: tuple,
                        kwargs: dict) -> list[tuple[tuple, dict] | None]:
    """Each block's first (args, kwargs) in a forward of `model` with grad enabled, each block's
    outputs passed on detached (requiring grad where they did: one block's autograd graph at a time); where
    that forward skipped blocks, further forwards (RECORD_FORWARDS in all) while each finds one not
    called before, and a block none called takes the call of the nearest block of the same
    structure (None where there is none). RNG state, buffers and gradients are left as they were."""
    from remat.compiled_fit import untouched

    seen: list[tuple[tuple, dict] | None] = [None] * len(blocks)

    def recorder(i: int, own):
        def record(*a, **k):
            if seen[i] is None:
                seen[i] = (_detached(a), _detached(k))
            # run with grad, so that each output requires grad exactly where training's does (a
            # T5 cross-attention's position bias is zeros that require none: copied as requiring
            # it, every later block's recorded call differed from training's and was planned again
            # at the first step); the block's autograd graph goes with `out`, one block at a time
            out = own(*a, **k)
            return pytree.tree_map(_passed_on, out)
        return record

    with untouched(model, cuda_device(model, args, kwargs)), Redirected(blocks, recorder):
        # forwards drawing on from the random state where one skipped blocks (LayerDrop can skip every
        # block), while each finds a block not called before
        for _ in range(RECORD_FORWARDS):
            before = sum(c is not None for c in seen)
            model(*args, **kwargs)
            if all(c is not None for c in seen) or sum(c is not None for c in seen) == before > 0:
                break
    # a block these forwards did not call (LayerDrop skipped it: `if torch.rand([]) < p`, or the data
    # chose another path) takes the call of the nearest block of the same structure that was called:
    # later steps may call it, and the bound (plan_blockwise) must count it
    for i, b in enumerate(blocks):
        if seen[i] is None:
            same = [j for j, c in enumerate(seen)
                    if c is not None and block_structure(blocks[j]) == block_structure(b)]
            if same:
                seen[i] = seen[min(same, key=lambda j: (abs(j - i), j))]
    return seen


def cuda_device(model: nn.Module, args: tuple, kwargs: dict) -> torch.device | None:
    """The CUDA device of the model's parameters or the call's tensors, if any (None: a CPU step)."""
    tensors = [*model.parameters(), *pytree.tree_leaves((args, kwargs))]
    return next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda"), None)
