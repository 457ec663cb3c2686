"""What a traced call depends on beyond its arguments: the model's Python state the forward read.

A planned step runs the graph traced at its call's first occurrence; the model's Python code does
not run again. So whatever that code read while it was traced is baked into the graph:
* module hooks (forward, forward-pre, backward, of each submodule): a hook that scales an output is
  part of the graph, and one added or removed later would be ignored or kept (global module hooks
  are not: tools that observe every module, FlopCounterMode's ModuleTracker, register them around
  a step that must not be traced again for them);
* plain values of the submodules' attributes and of the plain objects they hold under public names
  (a dropout rate, a flag, a Hugging Face config's settings): a rate changed mid-training would
  keep its old value. Bookkeeping is left out: nn.Module's own attributes, and the flags wrappers
  set on every module after a call was traced (FSDP2's `_is_fsdp_managed_module`, Hugging Face's
  `_is_hf_initialized`), which would otherwise trace every block again at its first wrapped call.
Both are part of a call's key (runtime/module.py `call_key`), so a call after any of them changed
is traced again. A hook's Python side effects (printing, logging, storing tensors) happen only
while a call is traced; TracedHooksWarning says so when a traced model has hooks.
"""
from __future__ import annotations

import enum
import math
import warnings

import torch
import torch.nn as nn

from remat.core.errors import RematWarning

__all__ = ["module_state", "TracedHooksWarning", "warn_traced_hooks"]

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_SIMPLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format, enum.Enum)
_SHORT = 16  # tuples, lists and dicts of plain values up to this length count as plain values
_MODULE_OWN = frozenset(vars(nn.Module()))  # parameters, buffers, submodules, hooks, train/eval: keyed apart
_WRAPPER_FLAGS = ("_fsdp", "_is_fsdp", "_is_hf_")  # prefixes of flags wrappers set on every module
_SKIP = object()


class TracedHooksWarning(RematWarning):
    """The model has module hooks: remat traced them into the planned step."""


def _plain(v):
    """`v` as a hashable key part where it is a plain value (or a short container of them), else _SKIP."""
    if isinstance(v, float) and math.isnan(v):
        return "nan"  # nan != nan: a key holding it would never match itself
    if isinstance(v, _SIMPLE):
        return v
    if isinstance(v, (tuple, list)) and len(v) <= _SHORT:
        parts = tuple(_plain(x) for x in v)
        return _SKIP if any(p is _SKIP for p in parts) else (type(v).__name__, parts)
    if isinstance(v, dict) and len(v) <= _SHORT:
        parts = tuple((_plain(k), _plain(x)) for k, x in v.items())
        return _SKIP if any(p is _SKIP for kv in parts for p in kv) else ("dict", parts)
    return _SKIP


def _holds_settings(v) -> bool:
    """A plain object whose attributes a forward may read (a config), not a module, tensor or code."""
    return (hasattr(v, "__dict__") and not isinstance(v, (nn.Module, torch.Tensor, type)) and not callable(v)
            and type(v).__module__ != "builtins")


def module_state(model: nn.Module) -> tuple[tuple, tuple]:
    """(hooks, settings) of `model`, read in one walk over its submodules (a call's key reads both at
    every call). hooks: the module hooks a call runs, by handle id, as (submodule index, hook kind,
    ids) for each submodule that has some. settings: the plain values of every submodule's
    attributes but bookkeeping, and all plain attribute values of the objects they hold under public
    names (one level: a Hugging Face config shared by every layer counts once, its
    `_attn_implementation` included)."""
    hooks: list[tuple] = []
    settings: list[tuple] = []
    seen: set[int] = set()
    for i, m in enumerate(model.modules()):
        attributes = m.__dict__
        hooks.extend((i, name, tuple(d)) for name in _HOOK_DICTS if (d := attributes.get(name)))
        for name, v in attributes.items():
            if name in _MODULE_OWN or name.startswith(_WRAPPER_FLAGS):
                continue
            p = _plain(v)
            if p is not _SKIP:
                settings.append((i, name, p))
            # an object held under a private name is a wrapper's state (FSDP2's, accelerate's hook)
            elif not name.startswith("_") and _holds_settings(v) and id(v) not in seen:
                seen.add(id(v))
                settings.extend((i, name, k, q) for k, x in vars(v).items() if (q := _plain(x)) is not _SKIP)
    return tuple(hooks), tuple(settings)


def warn_traced_hooks(model: nn.Module) -> None:
    """Say so where a submodule of `model` has module hooks remat is about to trace."""
    names = [name or type(model).__name__ for name, m in model.named_modules()
             if any(m.__dict__.get(d) for d in _HOOK_DICTS)]
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        warnings.warn(TracedHooksWarning(
            f"remat traces the module hooks of {shown} into the planned step: what they compute is part of "
            f"every step, but their Python side effects (printing, logging, storing tensors, counting) happen "
            f"only while a call is traced; adding or removing a hook traces the call again"), stacklevel=4)
