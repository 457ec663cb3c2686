"""Property test: sequences of calls a training loop can make, drawn by hypothesis, each checked
against the unmodified model. A call draws its batch shape, whether its input (and an optional
keyword tensor) requires grad, whether the keyword is passed at all, train or eval mode, and grad
or no_grad; it must return the model's loss and give the model's gradients (parameters and inputs),
or raise one of remat's documented errors (none is expected for these models). One remat module per
model serves every example, so the cache is exercised across them as a training run would."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import remat  # noqa: E402
from remat.default_model import GPTConfig, default_model  # noqa: E402


class Net(nn.Module):
    """A small MLP with LayerNorm and dropout; `scale` (optional) multiplies the hidden state."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.drop, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Dropout(0.2), nn.Linear(16, 4)

    def forward(self, x, y, scale=None):
        h = self.drop(torch.relu(self.norm(self.fc1(x))))
        if scale is not None:
            h = h * scale
        return F.cross_entropy(self.fc2(h), y)


GPT = GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32, dropout=0.1, batch_size=2)
_PAIRS: dict[str, tuple] = {}


def _pair(name: str):
    """(remat module, its model, an eager copy), made once per model for every example."""
    if name not in _PAIRS:
        torch.manual_seed(0)
        model = Net() if name == "mlp" else default_model(GPT)
        ref = copy.deepcopy(model)
        example = _inputs(name, 2, 16, False)[0]
        opt = remat.optimize(model, budget_bytes=2**30, example_inputs=example, quiet=True, cache_limit=64)
        _PAIRS[name] = (opt, model, ref)
    return _PAIRS[name]


def _inputs(name: str, batch: int, length: int, grad: bool, scale: str = "absent", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        x = torch.randn(batch, 8, generator=g).requires_grad_(grad)
        args = (x, torch.randint(0, 4, (batch,), generator=g))
        kwargs = {} if scale == "absent" else {"scale": torch.rand(16, generator=g).requires_grad_(scale == "grad")}
        return args, kwargs
    idx = torch.randint(0, GPT.vocab_size, (batch, length), generator=g)
    return (idx, torch.randint(0, GPT.vocab_size, (batch, length), generator=g)), {}


calls = st.fixed_dictionaries({
    "batch": st.sampled_from([1, 2, 3]),
    "length": st.sampled_from([16, 32]),
    "grad": st.booleans(),  # the input requires grad (the MLP's: a float input)
    "scale": st.sampled_from(["absent", "no grad", "grad"]),  # the MLP's keyword tensor
    "train": st.booleans(),
    "no_grad": st.booleans(),
    "seed": st.integers(0, 3),
})


def _run(module, model, name, call):
    (args, kwargs) = _inputs(name, call["batch"], call["length"], call["grad"] and name == "mlp", call["scale"],
                             call["seed"])
    for p in model.parameters():
        p.grad = None
    module.train(call["train"])
    torch.manual_seed(call["seed"])
    if call["no_grad"]:
        with torch.no_grad():
            return module(*args, **kwargs), [], args, kwargs
    loss = module(*args, **kwargs)
    loss.backward()
    leaves = [t for t in (*args, *kwargs.values()) if t.requires_grad]
    return loss.detach(), [p.grad for p in model.parameters()] + [t.grad for t in leaves], args, kwargs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)
@given(name=st.sampled_from(["mlp", "gpt"]), sequence=st.lists(calls, min_size=1, max_size=4))
def test_every_call_of_a_sequence_computes_what_the_model_computes(name, sequence):
    opt, model, ref = _pair(name)
    for call in sequence:
        got, got_grads, *_ = _run(opt, model, name, call)
        want, want_grads, *_ = _run(ref, ref, name, call)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), call
        assert len(got_grads) == len(want_grads), call
        for a, b in zip(got_grads, want_grads):
            assert (a is None) == (b is None), call
            if a is not None:
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), call
