"""Mixed precision: the autocast state a plan is made for, and the check that a call runs under it.

A step traced under `torch.autocast` has autocast's casts written into its graph as ordinary ops
(`_to_copy` to bfloat16 before each matmul, back to float32 before softmax, ...), so the plan and
its memory numbers are for the dtypes the step really runs in. The price is that the graph is only
right for that autocast state:

* planned without autocast and called under it, autocast casts the graph's ops again and the call
  fails deep inside the graph ("expected m1 and m2 to have the same dtype");
* planned under autocast and called without it (or under another dtype), AOTAutograd runs the
  graph with autocast off and its built-in casts: the call silently runs the planned precision.

So the state at trace time is recorded (`AutocastState`) and every planned call checks it first
(`guard_autocast`), raising `AutocastMismatchError` that names both states.

The backward is traced as eager autograd runs it after `loss.backward()` outside the autocast
block, i.e. without autocast (`backward_traced_as_eager`; AOTAutograd's default traces it under
the forward's autocast, which changes float32 matmuls of the backward). A backward run inside an
autocast block, where eager would apply autocast to the backward's ops, is refused the same way.

What is compared: for each device type the step's tensors live on (parameters, buffers, inputs),
whether autocast is enabled and, if so, its dtype. Not compared: autocast's weight-cast cache
(`torch.is_autocast_cache_enabled()`) changes neither values nor the traced graph (tracing runs with
the cache disabled, and the graph's casts are plain ops at run time), and grad mode does not reach a
planned call (under no_grad the module runs the model as it is).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from remat.core.errors import RematError
from remat.compat.torch_private import autocast_supported_devices, backward_without_autocast

__all__ = ["AutocastState", "AutocastMismatchError", "guard_autocast", "backward_traced_as_eager",
           "step_device_types"]


class AutocastMismatchError(RematError, RuntimeError):
    """A planned step was called under another autocast state than the one it was planned in."""


def _device_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    if device_type not in autocast_supported_devices() or not torch.is_autocast_enabled(device_type):
        return False, None
    return True, torch.get_autocast_dtype(device_type)


@dataclass(frozen=True)
class AutocastState:
    """Autocast per device type: ((device type, enabled, dtype or None), ...), sorted by device
    type. Two states are equal when every listed device type has the same enabled flag and dtype."""

    devices: tuple[tuple[str, bool, torch.dtype | None], ...]

    @classmethod
    def current(cls, device_types: Iterable[str]) -> "AutocastState":
        """The autocast state now, for these device types."""
        return cls(tuple((d, *_device_state(d)) for d in sorted(set(device_types))))

    @property
    def device_types(self) -> tuple[str, ...]:
        return tuple(d for d, _, _ in self.devices)

    @property
    def enabled(self) -> bool:
        """Whether autocast is on for any of the device types."""
        return any(on for _, on, _ in self.devices)

    def __str__(self) -> str:
        on = [f"torch.autocast({d!r}, dtype={dt})" for d, enabled, dt in self.devices if enabled]
        return " and ".join(on) if on else "no autocast"


def step_device_types(model: torch.nn.Module, tensors: Iterable) -> set[str]:
    """The device types of a step's tensors: the model's parameters and buffers and the inputs."""
    types = {t.device.type for t in (*model.parameters(), *model.buffers())}
    types |= {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    return types or {"cpu"}


def guard_autocast(step: Callable, planned: AutocastState) -> Callable:
    """`step` that first checks it is called under the `planned` autocast state, and whose backward
    checks it runs with autocast off (see `backward_traced_as_eager`); the state is kept as
    `.autocast_state` on the returned callable."""

    def check_backward(grad_outputs):
        now = AutocastState.current(planned.device_types)
        if now.enabled:
            raise AutocastMismatchError(
                f"the backward of a module planned under {planned} runs under {now}: remat traces the "
                f"backward as eager autograd runs it outside autocast, and eager autograd would apply this "
                f"autocast to the backward's ops. Call loss.backward() outside the autocast block (as "
                f"torch.autocast's documentation recommends).")

    def guarded(*args, **kwargs):
        now = AutocastState.current(planned.device_types)
        if now != planned:
            raise AutocastMismatchError(
                f"this module was planned under {planned} but is called under {now}: the planned graph "
                f"has the dtype casts of its autocast state built in and cannot run under another one. "
                f"Call remat.optimize under the same autocast as the training step "
                f"(e.g. `with torch.autocast(...): opt = remat.optimize(...)`), one module per autocast state.")
        outs = step(*args, **kwargs)
        # every path from a loss back into the step passes one of its outputs' grad_fns; a prehook
        # runs there, before the step's backward, and sees the autocast of `loss.backward()`
        for fn in {id(t.grad_fn): t.grad_fn for t in outs
                   if isinstance(t, torch.Tensor) and t.grad_fn is not None}.values():
            fn.register_prehook(check_backward)
        return outs

    guarded.autocast_state = planned  # type: ignore[attr-defined]
    guarded.__wrapped__ = step  # type: ignore[attr-defined]
    return guarded


@contextmanager
def backward_traced_as_eager() -> Iterator[None]:
    """Trace the backward as eager autograd runs it after `loss.backward()` outside the autocast
    block (what torch.autocast's documentation prescribes): without autocast. AOTAutograd's default
    ("same_as_forward") traces it under the forward's autocast, which casts float32 matmuls of the
    backward to 16 bits where eager keeps them in float32 (e.g. SDPA's math path with dropout, which
    runs in float32 inside a bfloat16 step): gradients off by 16-bit roundings. A backward run under
    autocast is refused by `guard_autocast`."""
    with backward_without_autocast():
        yield
