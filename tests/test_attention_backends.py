"""Which kernels the attention op runs (attention.cudnn: cuDNN's where torch's SDPA runs them;
attention.cpu_flash: torch's CPU flash kernel on the CPU; else Triton's or the PyTorch reference), and the gradients of both of its outputs: the op gives an unused
lse no gradient (None, not zeros), which is what lets its backward run cuDNN's kernels, so every
mix of losses on out and lse is checked against float64 autograd on the reference path, and, on a
CUDA machine, cuDNN's kernels against Triton's."""
import pytest
import torch

import remat.attention.op as op
from remat.attention import cudnn, launch
from remat.attention.reference import in_layout


def _ref(q, k, v, causal, scale):
    """Plain attention in float64: (out, lse), differentiable."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~(torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _inputs(seed=0, B=2, H=4, HKV=2, S=12, D=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(B, H, S, D, generator=g, dtype=torch.float64), torch.randn(B, H, S, generator=g,
                                                                                          dtype=torch.float64)


@pytest.mark.parametrize("loss_on", ["out", "lse", "both"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_of_out_and_lse(loss_on, causal):
    q, k, v, w_out, w_lse = _inputs()
    scale = 0.3

    def loss(out, lse):
        terms = {"out": (out * w_out).sum(), "lse": (lse * w_lse).sum()}
        return terms["out"] + terms["lse"] if loss_on == "both" else terms[loss_on]

    got_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    # lse does not depend on v: a loss on lse alone gives v a zero gradient
    got = torch.autograd.grad(loss(*op.flash_attention_with_lse(*got_in, causal=causal, scale=scale)), got_in,
                              allow_unused=True, materialize_grads=True)
    ref = torch.autograd.grad(loss(*_ref(*ref_in, causal, scale)), ref_in, allow_unused=True, materialize_grads=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_unused_lse_gets_no_gradient(monkeypatch):
    """dlse reaches the backward as None when only out is used, and as a tensor when lse is."""
    seen = []
    real = op.reference_attention_backward

    def spy(dout, q, k, v, out, lse, dlse, *rest):
        seen.append(dlse)
        return real(dout, q, k, v, out, lse, dlse, *rest)

    monkeypatch.setattr(op, "reference_attention_backward", spy)
    q, k, v, w_out, w_lse = _inputs()
    q.requires_grad_()
    prev = launch.get_triton_mode()
    launch.set_triton_mode("never")  # the reference path, which takes both
    try:
        out, lse = op.flash_attention_with_lse(q, k, v, causal=True)
        (out * w_out).sum().backward(retain_graph=True)
        (lse * w_lse).sum().backward()
    finally:
        launch.set_triton_mode(prev)
    assert seen[0] is None
    assert isinstance(seen[1], torch.Tensor) and torch.equal(seen[1], w_lse)


def test_cudnn_dispatch_off_cuda_and_setting():
    q, k, v, _, _ = _inputs()
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    assert not cudnn.cudnn_runs_on(*bf, True, 0.0)  # CPU tensors
    assert cudnn.cudnn_attention_enabled()
    cudnn.set_cudnn_attention(False)
    try:
        assert not cudnn.cudnn_attention_enabled()
    finally:
        cudnn.set_cudnn_attention(True)


def test_layout_copy_only_where_strides_differ():
    t = torch.randn(2, 3, 4, 5).transpose(1, 2)
    assert in_layout(t, t.to("meta")) is t
    # a size-1 dimension's stride does not make a layout differ
    u = torch.randn(1, 3, 4)
    assert in_layout(u, torch.empty_strided((1, 3, 4), (7, 4, 1), device="meta")) is u
    c = in_layout(t, torch.empty(t.shape, device="meta"))
    assert c.is_contiguous() and torch.equal(c, t)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("loss_on", ["out", "both"])
def test_cudnn_against_triton_on_cuda(loss_on):
    """Where cuDNN runs (sm90+), its outputs and gradients match the Triton kernels' within bf16's
    reach; with a gradient into lse the backward is Triton's on cuDNN's saved lse."""
    pytest.importorskip("triton")
    if launch.get_triton_mode() != "auto":
        pytest.skip("cuDNN runs in the default Triton mode only")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, HKV, S, D = 2, 8, 2, 256, 64
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k, v = (torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
            for _ in range(2))
    if not cudnn.cudnn_runs_on(q, k, v, True, 0.0):
        pytest.skip("cuDNN's attention does not run here (needs sm90+ and torch's cuDNN SDPA)")
    w_out = torch.randn(B, H, S, D, device="cuda", generator=g)
    w_lse = torch.randn(B, H, S, device="cuda", generator=g)
    results = {}
    for enabled in (True, False):
        cudnn.set_cudnn_attention(enabled)
        try:
            ins = [t.detach().requires_grad_() for t in (q, k, v)]
            out, lse = torch.ops.remat.flash_attention(*ins, True, D ** -0.5, 0.0, None, True)
            loss = (out.float() * w_out).sum() + ((lse * w_lse).sum() if loss_on == "both" else 0.0)
            results[enabled] = (out, lse, *torch.autograd.grad(loss, ins))
        finally:
            cudnn.set_cudnn_attention(True)
    for a, b in zip(results[True], results[False]):
        assert a.shape == b.shape and a.stride() == b.stride()
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def _model_layout(t):
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("loss_on", ["out", "both"])
def test_cpu_flash_kernel_against_the_reference(dtype, loss_on, monkeypatch):
    """On the CPU in the default mode the op runs torch's CPU flash kernel (attention.cpu_flash):
    the same outputs, layouts and gradients as the PyTorch reference (mode "never"), grouped-query
    k/v and q laid out as a model's; with a gradient into lse the backward is the reference's."""
    from remat.attention import cpu_flash

    calls = {"forward": 0, "backward": 0}
    for name in ("forward", "backward"):
        real = getattr(cpu_flash, f"cpu_flash_{name}")

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)
        monkeypatch.setattr(op, f"cpu_flash_{name}", counted)
    results = {}
    for mode in ("auto", "never"):
        prev = launch.get_triton_mode()
        launch.set_triton_mode(mode)
        try:
            g = torch.Generator().manual_seed(1)
            q = _model_layout(torch.randn(2, 4, 9, 8, generator=g)).to(dtype).requires_grad_()
            k, v = (_model_layout(torch.randn(2, 2, 9, 8, generator=g)).to(dtype).requires_grad_() for _ in range(2))
            out, lse = torch.ops.remat.flash_attention(q, k, v, True, 0.3, 0.0, None, True)
            w = torch.randn(out.shape, generator=g)
            loss = (out.float() * w).sum() + ((lse.float() * w[..., 0]).sum() if loss_on == "both" else 0.0)
            results[mode] = (out, lse, *torch.autograd.grad(loss, (q, k, v)))
        finally:
            launch.set_triton_mode(prev)
    assert calls == {"forward": 1, "backward": 1 if loss_on == "out" else 0}
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    for a, b in zip(results["auto"], results["never"]):
        assert a.dtype == b.dtype and a.stride() == b.stride()
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def test_cpu_flash_kernel_not_where_it_cannot_take_the_op():
    from remat.attention.cpu_flash import cpu_flash_runs_on

    q, k = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 4, 4)
    assert cpu_flash_runs_on(q, q, True, 0.0)
    assert not cpu_flash_runs_on(q, k, True, 0.0)  # causal, Sq != Sk: the op's mask is bottom-right
    assert cpu_flash_runs_on(q, k, False, 0.0)
    assert not cpu_flash_runs_on(q, q, True, 0.1)  # the op's own dropout mask
    assert not cpu_flash_runs_on(q.bfloat16(), q.bfloat16(), True, 0.0)  # slower than the reference here
    prev = launch.get_triton_mode()
    launch.set_triton_mode("never")
    try:
        assert not cpu_flash_runs_on(q, q, True, 0.0)
    finally:
        launch.set_triton_mode(prev)
