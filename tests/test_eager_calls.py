"""The eager runtime's public bindings (graph_capture/eager_calls.py) must call exactly the overload
they stand for, with the same arguments: same kernels, same allocations, same results."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat.graph_capture.eager_calls import PUBLIC_BINDINGS, eager_executable

aten = torch.ops.aten
a, b, v, c = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4), torch.randn(2, 4, 4)
SAMPLES = {  # overload -> (args, kwargs) it is called with in graphs
    aten.view.default: ((a, [16]), {}),
    aten.t.default: ((a,), {}),
    aten.transpose.int: ((c, 1, 2), {}),
    aten.permute.default: ((c, [2, 0, 1]), {}),
    aten.expand.default: ((v, [3, 4]), {}),
    aten.unsqueeze.default: ((a, 1), {}),
    aten.mm.default: ((a, b), {}),
    aten.bmm.default: ((c, c), {}),
    aten.addmm.default: ((v, a, b), {"beta": 0.5, "alpha": 2.0}),
    aten.mul.Tensor: ((a, 0.5), {}),
    aten.add.Tensor: ((a, b), {"alpha": 3}),
    aten.sub.Tensor: ((a, b), {"alpha": 2}),
    aten.div.Tensor: ((a, b), {}),
    aten.clone.default: ((c.transpose(1, 2),), {"memory_format": torch.contiguous_format}),
}


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def test_every_binding_has_a_sample():
    assert set(SAMPLES) == set(PUBLIC_BINDINGS)


@pytest.mark.parametrize("overload", list(PUBLIC_BINDINGS), ids=str)
def test_the_binding_dispatches_to_the_same_overload_with_the_same_result(overload):
    binding, keywords = PUBLIC_BINDINGS[overload]
    args, kwargs = SAMPLES[overload]
    assert set(kwargs) <= set(keywords)
    with _Record() as rec:
        got = binding(*args, **kwargs)
    assert rec.calls == [overload]
    want = overload(*args, **kwargs)
    assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want)


def test_the_executable_copy_keeps_the_graph_and_its_other_calls():
    def f(x, y):
        return (torch.mm(x, y) * 2 + torch.sum(x)).view(16).view(4, 4).t()

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(a, b)
    before = [n.target for n in gm.graph.nodes]
    exe = eager_executable(gm)
    assert [n.target for n in gm.graph.nodes] == before  # the traced graph keeps its OpOverloads
    targets = [n.target for n in exe.graph.nodes if n.op == "call_function"]
    assert torch.mm in targets and aten.sum.default in targets
    assert torch.equal(exe(a, b), gm(a, b))
