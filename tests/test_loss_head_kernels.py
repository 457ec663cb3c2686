"""The chunked loss head's softmax-gradient kernel (loss_head/kernels.py) in Triton's interpreter
on CPU tensors, against the PyTorch ops it replaces on the GPU: the same float32 operations (exp is
Triton's, not torch's), so within float32 rounding of them before the final cast, and one rounding
step of the output dtype after it."""
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the loss head's kernel tests skipped")
from remat.attention import launch  # noqa: E402
from remat.loss_head import kernels as sg  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret_env():
    # as tests/test_triton_attention.py: the interpreter only while these tests run
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    prev_mode = launch.get_triton_mode()
    launch.set_triton_mode("interpret")
    yield
    launch.set_triton_mode(prev_mode)
    if prev is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = prev


def _case(n, c, v, c0, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, c, generator=g) * 4).to(dtype)
    lse = torch.logsumexp(torch.randn(n, v, generator=g) * 4, dim=-1)  # any finite row values
    s = torch.rand(n, generator=g) - 0.3  # negative factors too (a negative dloss)
    s[::5] = 0.0  # ignored rows
    target = torch.randint(0, v, (n,), generator=g)
    target[:3] = torch.tensor([c0, c0 + c - 1, c0 + c // 2])  # targets inside the block, at its ends
    return z, lse, s, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_kernel_computes_the_pytorch_ops_gradient(dtype, smoothing, monkeypatch):
    n, c, v, c0 = 19, 45, 200, 90  # not multiples of the interpreter's (8, 32) tiles: edge masks run
    z, lse, s, target = _case(n, c, v, c0, dtype)
    args = (z, lse, s, target, c0, smoothing / v, -(1 - smoothing))
    want = sg.softmax_grad_torch(*args, torch.float32)
    calls = []
    monkeypatch.setattr(sg, "softmax_grad_torch", lambda *a: calls.append(a))
    got32 = sg.softmax_grad(*args, torch.float32)
    got = sg.softmax_grad(*args, dtype)
    assert not calls  # the kernel ran, not the PyTorch ops
    assert got32.dtype == torch.float32 and got.dtype == dtype and got.shape == (n, c)
    torch.testing.assert_close(got32, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    # the target's term landed where the PyTorch ops put it (its rows' gradients are negative there)
    hit = [(i, int(t) - c0) for i, t in enumerate(target.tolist()) if c0 <= t < c0 + c and s[i] > 0]
    assert hit and all(got32[i, j] < 0 for i, j in hit)
    # rounded once to the output dtype: at most one step of it from the float32 values rounded
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=torch.finfo(dtype).eps,
                               atol=1e-6 * want.abs().max().item())
    assert torch.all(got[s == 0] == 0)  # ignored rows get no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("smoothing", [False, True])
def test_the_row_kernel_computes_the_pytorch_ops_loss_terms(dtype, smoothing, monkeypatch):
    g = torch.Generator().manual_seed(2)
    n, v = 11, 100  # not a multiple of the interpreter's 32-column steps: the row's tail is masked
    z = (torch.randn(n, v, generator=g) * 5).to(dtype)
    # a column no row can pick (a masked vocabulary entry: with label smoothing a -inf logit makes
    # the loss infinite, in eager too, so a very negative one there), and a row whose first steps
    # see only -inf
    z[:, 7] = -1e4 if smoothing else float("-inf")
    z[2, :40] = -1e4 if smoothing else float("-inf")
    t = torch.randint(0, v, (n,), generator=g)
    t[t == 7] = 8
    t[2] = 50  # each target's logit finite: a finite loss to compare
    valid = torch.ones(n, dtype=torch.bool)
    valid[[1, 6]] = False  # ignored rows
    safe_t = torch.where(valid, t, 0)
    want = sg.chunk_loss_terms_torch(z, safe_t, valid, torch.float32, smoothing)
    calls = []
    monkeypatch.setattr(sg, "chunk_loss_terms_torch", lambda *a: calls.append(a))
    got = sg.chunk_loss_terms(z, safe_t, valid, torch.float32, smoothing)
    assert not calls  # the kernel ran
    assert (got[1] is None) == (not smoothing)
    assert torch.isfinite(want[0]) and (not smoothing or torch.isfinite(want[1]))
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    # a target outside the vocabulary makes the loss NaN on the kernel path (torch's gather raises)
    bad = safe_t.clone()
    bad[0] = v
    assert sg.chunk_loss_terms(z, bad, valid, torch.float32, smoothing)[0].isnan()


def test_the_pytorch_ops_run_where_the_kernel_does_not():
    launch.set_triton_mode("never")
    z, lse, s, target = _case(7, 10, 30, 5, torch.bfloat16)
    out = sg.softmax_grad(z, lse, s, target, 5, 0.0, -1.0, torch.bfloat16)
    assert torch.equal(out, sg.softmax_grad_torch(z, lse, s, target, 5, 0.0, -1.0, torch.bfloat16))


def test_the_chunked_head_runs_both_kernels_and_matches_eager(monkeypatch):
    from remat.loss_head.op import chunked_linear_cross_entropy

    def refuse(*_):
        raise AssertionError("the PyTorch ops ran where the kernel runs")

    monkeypatch.setattr(sg, "chunk_loss_terms_torch", refuse)
    monkeypatch.setattr(sg, "softmax_grad_torch", refuse)

    g = torch.Generator().manual_seed(1)
    n, d, v = 24, 16, 100
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = (torch.randn(v, d, generator=g) * 0.3).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[3] = -100
    loss = chunked_linear_cross_entropy(h, w, None, t, label_smoothing=0.05)
    dh, dw = torch.autograd.grad(loss, (h, w))
    ref = torch.nn.functional.cross_entropy(h @ w.T, t, label_smoothing=0.05)
    rdh, rdw = torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for a, b in ((dh, rdh), (dw, rdw)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
