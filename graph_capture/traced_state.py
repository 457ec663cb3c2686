"""Tensors a model's forward stores on its modules while it is traced never stay there.

A forward may keep a tensor on a module: a lazily built cache (rotary cos/sin tables grown to the
longest sequence seen, with the length they cover), a recurrent state (RecurrentGemma's RG-LRU
keeps its last one). Traced, the forward runs on the trace's own tensors (fake or functional; twice:
AOTAutograd runs it for the graph's metadata, then for the graph), so what it stores is a tensor of
the trace, meaningless once that run ends: left on the module, the next run (the trace's second, the
other loss head's, a new batch shape's) would read it as a constant of a dead trace and fail
("Unexpected fake buffer"), and so would the model itself, called eagerly again ("Attempting to use
FunctionalTensor on its own"). So a module that holds, after a traced run, a tensor it did not hold
before (as an attribute, a buffer, a parameter, or inside a list, tuple or dict attribute, also one
filled in place) is put back as it was: its attributes, buffers, parameters and submodules, plain values too,
since they describe that tensor (the cache's length). The planned step computes those values in its
graph every call, as the forward did. A loop that reads such a tensor back from the module after a
call (an auxiliary loss kept on an attribute) would find the value from before the trace:
TracedStateWarning names the modules, once per model and modules. Modules that stored no tensor
keep what their forward set (a flag, a Python step counter): like any Python side effect of the
forward, that happens only while a call is traced (runtime/module.py keys the next call with the
state the trace left, docs/known-limits.md).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from remat.compat.torch_private import pytree
from remat.core.errors import RematWarning

__all__ = ["traced_tensors_not_kept", "TracedStateWarning"]

_CONTAINERS = ("_parameters", "_buffers", "_modules")
_MISSING = object()
_WARNED: set = set()  # (model class, module paths) already named: AOTAutograd runs the forward twice a trace


class TracedStateWarning(RematWarning):
    """The model's forward stored tensors on its modules while traced: they are not kept there."""


class _Saved:
    """One module's state before a trace: its attributes (references) and its containers' entries."""

    def __init__(self, module: nn.Module):
        self.attrs = dict(vars(module))
        self.entries = {name: dict(vars(module).get(name) or {}) for name in _CONTAINERS}
        self.non_persistent = set(vars(module).get("_non_persistent_buffers_set", ()))
        # the contents of list and dict attributes, which a forward may fill in place (an auxiliary
        # loss appended to a list the module holds)
        self.contents = {k: (list(v) if isinstance(v, list) else dict(v)) for k, v in self.attrs.items()
                         if isinstance(v, (list, dict)) and k not in _CONTAINERS}

    def changed(self, module: nn.Module) -> list:
        """The values of `module` added or replaced since (attributes, containers' entries, and the
        contents of list and dict attributes filled in place)."""
        now = vars(module)
        out = [v for k, v in now.items() if self.attrs.get(k, _MISSING) is not v]
        for name in _CONTAINERS:
            before = self.entries[name]
            out += [v for k, v in (now.get(name) or {}).items() if before.get(k, _MISSING) is not v]
        out += [self.attrs[k] for k in self.contents if now.get(k) is self.attrs[k]]  # read against `held`
        return out

    def restore(self, module: nn.Module) -> None:
        now = vars(module)
        for k in [k for k in now if k not in self.attrs]:
            del now[k]
        now.update(self.attrs)
        for k, items in self.contents.items():
            held = self.attrs[k]
            if isinstance(held, list):
                held[:] = items
            else:
                held.clear()
                held.update(items)
        for name in _CONTAINERS:
            container = now.get(name)
            if container is not None:
                container.clear()
                container.update(self.entries[name])
        if "_non_persistent_buffers_set" in now:
            now["_non_persistent_buffers_set"].clear()
            now["_non_persistent_buffers_set"].update(self.non_persistent)


def _tensors(values: list) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


@contextmanager
def traced_tensors_not_kept(model: nn.Module) -> Iterator[None]:
    """Within: `model` is traced. After, every module that holds a tensor it did not hold before is
    put back as it was (see the module docstring)."""
    named = list(model.named_modules())
    saved = [_Saved(m) for _, m in named]
    # the containers (parameters, buffers, lists, dicts) are among the attributes: their tensors too
    held = {id(t) for s in saved for t in _tensors(list(s.attrs.values()))}
    try:
        yield
    finally:
        put_back = []
        for (path, m), s in zip(named, saved):
            if any(id(t) not in held for t in _tensors(s.changed(m))):
                s.restore(m)
                put_back.append(path or "(the model)")
        key = (type(model).__name__, tuple(put_back))
        if put_back and key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(TracedStateWarning(
                f"{key[0]}'s forward stored tensors on {', '.join(put_back[:4])}"
                f"{f' and {len(put_back) - 4} more' if len(put_back) > 4 else ''} while traced; the planned step "
                "runs the traced graph, not the forward, so those modules are left as they were before the trace "
                "(a cache is computed in the step every call; a tensor read back from a module after a call, such "
                "as an auxiliary loss, is not there: return it from forward)"), stacklevel=2)
