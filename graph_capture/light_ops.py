"""remat's own ATen-level ops (remat::batch_norm, remat::dropout, ...), defined with little per-call cost.

`torch.library.custom_op` wraps every call of its Python kernel in layers of its own (a
torch.compile-disable guard, argument checks, a dispatch wrapper): about 30 µs a call on the CPU,
as long as a small BatchNorm kernel itself, paid by every BatchNorm and dropout of every step. These
ops are defined instead on a `torch.library.Library` with the kernel registered directly for every
backend (CompositeExplicitAutograd: the runtime calls them inside its compiled forward and
backward, where autograd does not record), about 8 µs a call. They carry what custom_op gave them:
the same schema, the pt2_compliant tag (torch.compile may run graphs holding them) and a fake
implementation for tracing.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["light_op"]

_LIB = torch.library.Library("remat", "FRAGMENT")  # noqa: TOR901 (the ops are defined once, at import)


class _LightOp:
    """A defined op: call it like the kernel, `register_fake` its fake implementation."""

    def __init__(self, name: str, kernel: Callable):
        self.qualname = f"remat::{name}"
        self.kernel = kernel
        self.default = getattr(torch.ops.remat, name).default

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fake, lib=_LIB)
        return fake


def light_op(name: str, schema: str, tags: tuple = ()) -> Callable[[Callable], _LightOp]:
    """Decorator: define remat::`name` with `schema` ("(Tensor x, float p) -> Tensor") and the
    decorated function as its kernel on every device."""
    def define(kernel: Callable) -> _LightOp:
        _LIB.define(f"{name}{schema}", tags=(torch.Tag.pt2_compliant_tag, *tags))
        _LIB.impl(name, kernel, "CompositeExplicitAutograd")
        return _LightOp(name, kernel)

    return define
