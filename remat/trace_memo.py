"""The graphs the last planned calls traced, per model, call and loss head, so that planning the
same call again (remat.optimize called again on the same model and inputs: at the budget an
InfeasibleBudgetError named) can weigh both loss heads before tracing either (remat/pipeline.py).

A trace of a Hugging Face decoder costs ~4-5 s on CPU, almost all of it AOTAutograd's; planning a
call at its smallest budget weighs both heads, so it traced the model's head, then the chunked
head, then the winner again to be lowered. With the graphs remembered only the winner is traced,
and that trace is checked equal to the graph it was solved on (`TrainingGraph` equality: every
node, size, cost and workspace) before its plan is used; a trace that differs (the model's code
or an input's values changed what it traces, which the key cannot see) is planned as if nothing
were remembered. So a plan is lowered only on a trace equal to the graph it was solved on.

The key is the call's (runtime/module.py `call_key`: shapes, dtypes, modes, frozen parameters,
autocast, hooks, module settings) with the input tensors' identities and versions, the
parameters' shapes, dtypes and devices, and what the trace depends on besides (the loss head, the
fused attention). The model is held weakly: a memo never keeps a model alive. Graphs measured
(`cost_model="measured"`) are not remembered: their costs differ from trace to trace.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch.nn as nn

from remat.core.training_graph import TrainingGraph
from remat.runtime.module import call_key, model_device_types

__all__ = ["memo_key", "remember", "recall", "forget", "clear", "MEMO_SIZE"]

# the graphs remembered, the most recent kept: a call and its two loss heads take two
MEMO_SIZE = 8

_MEMO: OrderedDict[tuple, tuple[weakref.ref, TrainingGraph]] = OrderedDict()
_LOCK = threading.Lock()


def memo_key(model: nn.Module, args: tuple, kwargs: dict, fused_attention: Any, cost_model: str,
             chunked: bool) -> tuple | None:
    """The key a trace of `model(*args, **kwargs)` is remembered under, taken before it is traced
    (a trace can change the model's attributes); None where it is not remembered."""
    if cost_model != "flops":
        return None
    try:
        key, tensors = call_key(model, args, kwargs, model_device_types(model))
        # inference tensors keep no version counter, and some tensor subclasses no data pointer:
        # their calls are not remembered
        inputs = tuple((id(t), t.data_ptr(), t._version) for t in tensors)
        hash(key)
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return None
    params = tuple((tuple(p.shape), p.dtype, p.device) for p in model.parameters())
    return (id(model), key, inputs, params, fused_attention, bool(chunked))


def remember(key: tuple | None, model: nn.Module, graph: TrainingGraph) -> None:
    """Remember `graph` as the trace of `key` (from memo_key, for `model`)."""
    if key is None:
        return
    try:
        ref = weakref.ref(model)
    except TypeError:  # (a class whose __slots__ leave out __weakref__: not remembered)
        return
    with _LOCK:
        _MEMO[key] = (ref, graph)
        _MEMO.move_to_end(key)
        while len(_MEMO) > MEMO_SIZE:
            _MEMO.popitem(last=False)


def recall(key: tuple | None, model: nn.Module) -> TrainingGraph | None:
    """The graph remembered for `key` where it was traced from this very `model`, else None."""
    if key is None:
        return None
    with _LOCK:
        hit = _MEMO.get(key)
        if hit is None or hit[0]() is not model:  # (another model at a reused id)
            return None
        _MEMO.move_to_end(key)
        return hit[1]


def forget(key: tuple | None) -> None:
    """Drop what is remembered for `key` (a trace that came out other than remembered)."""
    if key is not None:
        with _LOCK:
            _MEMO.pop(key, None)


def clear() -> None:
    """Forget every graph."""
    with _LOCK:
        _MEMO.clear()

