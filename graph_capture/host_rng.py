"""Whether a trace drew from Python's or NumPy's global random number generators.

A planned step runs the graph traced at its call's first occurrence, so a draw from a host RNG the
model's Python code made while traced is frozen into that graph: LayerDrop written with
`random.random() < p` would skip the same layers at every step. torch's own RNG is traced as ops
(dropout masks are drawn again at each step); the host RNGs are not. So a trace compares their
states before and after, and a trace that moved one raises TraceError (and the model can still be
planned block by block, remat/blockwise.py, its Python running at every step between blocks).
"""
from __future__ import annotations

import random
import sys

from remat.core.errors import RematError

__all__ = ["host_rng_states", "host_rngs_drawn", "HostRandomError"]


class HostRandomError(RematError, RuntimeError):
    """The model's Python code drew from a host RNG while its step was traced (wrapped in the
    TraceError that tracing raises, so a model with a budget is planned block by block)."""

    def __init__(self, drawn: list[str]):
        super().__init__(
            f"the forward drew from {' and '.join(drawn)} while traced: a planned step runs the traced graph, "
            f"so those draws would be the same at every step (a LayerDrop written with random.random() would "
            f"skip the same layers every step); draw with torch (torch.rand: a planned step draws again at every "
            f"step), or give a budget, with which the model is planned block by block and its Python runs at every step")


def host_rng_states() -> dict[str, object]:
    """The states of Python's global RNG and, where NumPy is loaded, NumPy's global RNG."""
    states: dict[str, object] = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        states["numpy.random"] = np.random.get_state(legacy=False)
    return states


def host_rngs_drawn(before: dict[str, object]) -> list[str]:
    """The host RNGs whose state moved since `before` (host_rng_states)."""
    now = host_rng_states()
    return [name for name, state in before.items() if not _same(state, now[name])]


def _same(a, b) -> bool:
    """Two RNG states equal (NumPy's hold its MT19937 key as an array)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if hasattr(a, "shape") and hasattr(b, "shape"):
        return a.shape == b.shape and bool((a == b).all())
    return a == b
