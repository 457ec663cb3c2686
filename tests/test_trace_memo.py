"""remat/trace_memo.py: the graphs remembered per model, call and loss head."""
import gc
import weakref

import torch
import torch.nn as nn

from remat import trace_memo


def _key(model, x, chunked=False, cost_model="flops"):
    return trace_memo.memo_key(model, (x,), {}, True, cost_model, chunked)


def test_a_graph_is_recalled_only_for_its_model_call_and_head():
    trace_memo.clear()
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 4)
    graph = object()  # (the memo stores what it is given)
    trace_memo.remember(_key(model, x), model, graph)
    assert trace_memo.recall(_key(model, x), model) is graph
    assert trace_memo.recall(_key(model, x, chunked=True), model) is None  # the other loss head
    assert trace_memo.recall(_key(other, x), other) is None  # another model
    assert trace_memo.recall(_key(model, torch.randn(3, 4)), model) is None  # another shape
    assert trace_memo.recall(_key(model, x.clone()), model) is None  # other tensors (their values may differ)
    x.add_(1)  # the same tensor written since: another version
    assert trace_memo.recall(_key(model, x), model) is None
    model.eval()  # another mode
    assert trace_memo.recall(_key(model, x), model) is None
    model.train()
    before = _key(model, x)
    model.half()  # the parameters' dtype
    assert before is not None and _key(model, x) != before
    assert _key(model, x, cost_model="measured") is None  # measured costs differ from trace to trace
    with torch.inference_mode():
        assert _key(model, torch.randn(2, 4)) is None  # an inference tensor keeps no version


def test_the_memo_keeps_no_model_alive_and_forgets_the_oldest():
    trace_memo.clear()
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    key = _key(model, x)
    trace_memo.remember(key, model, object())
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    keys = []
    for _ in range(trace_memo.MEMO_SIZE + 1):
        m = nn.Linear(4, 4)
        keys.append((m, _key(m, x)))
        trace_memo.remember(keys[-1][1], m, object())
    assert trace_memo.recall(keys[0][1], keys[0][0]) is None
    assert all(trace_memo.recall(k, m) is not None for m, k in keys[1:])
    trace_memo.forget(keys[-1][1])
    assert trace_memo.recall(keys[-1][1], keys[-1][0]) is None


class _Slotted:
    """A callable without weak references (its __slots__ leave out __weakref__)."""

    __slots__ = ()


def test_a_model_without_weak_references_is_not_remembered():
    trace_memo.clear()
    model = _Slotted()
    trace_memo.remember(("key",), model, object())
    assert trace_memo.recall(("key",), model) is None
