"""Tests for the fused FlashAttention-2 op and kernels (remat.attention: op, launch, kernels, reference).

The Triton kernels run in the Triton interpreter on CPU tensors (TRITON_INTERPRET=1); the PyTorch
fallback and the custom op's autograd/fake registrations are tested on CPU as well.  Everything is
compared against a float64 PyTorch reference.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: Triton attention tests skipped")
from remat.attention import launch, reference  # noqa: E402
from remat.attention.op import flash_attention, flash_attention_with_lse  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _interpret_env():
    # The kernels run in Triton's interpreter on CPU tensors. remat jits them per mode, when they are
    # first launched in it, so the variable only has to be "1" while these tests run, whatever the
    # user set (or not) and whenever triton was imported; it is put back afterwards, so other
    # modules' CPU tests never run the interpreter.
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    prev_mode = launch.get_triton_mode()
    launch.set_triton_mode("interpret")  # CPU tensors run the kernels (the interpreter), not the reference
    # Tiny ops: one intra-op thread avoids OpenMP spin-waits that make this module ~10x slower
    # when the CPUs are shared with other work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    launch.set_triton_mode(prev_mode)
    if prev is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = prev


@pytest.fixture(autouse=True)
def _restore_mode():
    mode = launch.get_triton_mode()
    blocks = dict(launch.INTERPRET_BLOCKS)
    yield
    launch.set_triton_mode(mode)
    launch.INTERPRET_BLOCKS.clear()
    launch.INTERPRET_BLOCKS.update(blocks)


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------
def _mask(sq, sk):
    return torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)


def ref_attention(q, k, v, causal, scale, upcast=True):
    """Plain softmax attention; upcast=True -> float64 math, else native-dtype math (the
    accuracy a straightforward PyTorch implementation reaches in that dtype)."""
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_mask(q.shape[2], k.shape[2]), float("-inf"))
    s32 = s if upcast else s.float()
    lse = torch.logsumexp(s32, -1)
    p = torch.softmax(s32, -1).nan_to_num(0.0).to(q.dtype)  # all-masked rows -> zeros
    return p @ v, lse


def _inputs(dtype, B, H, HK, SQ, SK, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, SQ, D, generator=g).to(dtype)
    k = torch.randn(B, HK, SK, D, generator=g).to(dtype)
    v = torch.randn(B, HK, SK, D, generator=g).to(dtype)
    do = torch.randn(B, H, SQ, D, generator=g).to(dtype)
    return q, k, v, do


def _run(fn, q, k, v, do, causal, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal, scale)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _errors(res, ref):
    return [(a.double() - b.double()).abs().max().item() for a, b in zip(res, ref)]


def _ref_grads(q, k, v, do, causal, scale, upcast=True):
    return _run(lambda q, k, v, c, s: ref_attention(q, k, v, c, s, upcast)[0], q, k, v,
                do.double() if upcast else do, causal, scale)


def _fa(q, k, v, causal, scale):
    return flash_attention(q, k, v, causal=causal, scale=scale)


# (B, Hq, Hkv, Sq, Sk, D, causal)
FP32_CASES = [
    (1, 2, 2, 100, 100, 32, False),  # S not a multiple of any block
    (1, 2, 2, 129, 129, 64, True),  # one row past a block boundary
    (2, 4, 2, 100, 100, 32, True),  # GQA
    (1, 4, 1, 64, 64, 64, False),  # exact blocks, MQA
    (1, 2, 1, 100, 60, 32, True),  # Sq > Sk causal: first 40 rows attend to nothing
    (1, 2, 2, 60, 130, 48, True),  # Sq < Sk causal, head dim padded 48 -> 64
]
LOWP_CASES = [
    (torch.float16, (1, 2, 2, 129, 129, 64, True)),
    (torch.float16, (2, 4, 2, 100, 100, 32, False)),
    (torch.float16, (1, 2, 1, 100, 60, 32, True)),
    (torch.bfloat16, (1, 2, 2, 100, 100, 32, True)),
    (torch.bfloat16, (1, 4, 2, 129, 129, 64, False)),
]


# ---------------------------------------------------------------------------------------------
# Triton kernels (interpreter)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", FP32_CASES, ids=lambda c: "x".join(map(str, c)))
def test_triton_fp32_matches_fp64(case):
    B, H, HK, SQ, SK, D, causal = case
    q, k, v, do = _inputs(torch.float32, B, H, HK, SQ, SK, D)
    assert launch.use_triton(q)
    scale = 1.0 / math.sqrt(D)
    res = _run(_fa, q, k, v, do, causal, scale)
    ref = _ref_grads(q, k, v, do, causal, scale)
    err = _errors(res, ref)
    assert all(math.isfinite(e) for e in err), err
    assert err[0] < 2e-5, f"out err {err[0]}"
    assert max(err[1:]) < 5e-5, f"grad errs (dq, dk, dv) {err[1:]}"
    # lse
    _, lse = flash_attention_with_lse(q, k, v, causal=causal)
    _, lse_ref = ref_attention(q, k, v, causal, scale)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, SQ)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert (lse.double()[fin] - lse_ref[fin]).abs().max() < 2e-5


@pytest.mark.parametrize("dtype,case", LOWP_CASES, ids=lambda c: str(c).replace("torch.", "") if isinstance(c, torch.dtype) else "x".join(map(str, c)))
def test_triton_low_precision(dtype, case):
    """fp16 / bf16 (bf16 dots upcast in the interpreter): error vs float64 at most 3x the error of
    a plain PyTorch attention computed in the same dtype (+ a small floor)."""
    B, H, HK, SQ, SK, D, causal = case
    q, k, v, do = _inputs(dtype, B, H, HK, SQ, SK, D, seed=1)
    assert launch.use_triton(q)
    scale = 1.0 / math.sqrt(D)
    res = _run(_fa, q, k, v, do, causal, scale)
    assert res[0].dtype == dtype and all(g.dtype == dtype for g in res[1:])
    ref = _ref_grads(q, k, v, do, causal, scale)
    native = _ref_grads(q, k, v, do, causal, scale, upcast=False)
    err, err_native = _errors(res, ref), _errors(native, ref)
    floor = 1e-4 if dtype == torch.float16 else 1e-3
    for name, e, en in zip(("out", "dq", "dk", "dv"), err, err_native):
        assert math.isfinite(e), name
        assert e <= 3 * en + floor, f"{name}: err {e:.3e} vs native {dtype} err {en:.3e}"


def test_triton_other_block_shapes():
    """Swap which of BLOCK_M / BLOCK_N is larger (causal block-skipping arithmetic)."""
    launch.INTERPRET_BLOCKS.update({"fwd": (32, 64), "dkdv": (64, 32), "dq": (32, 64), "pre": 32})
    for B, H, HK, SQ, SK, D, causal in [(1, 4, 2, 97, 131, 32, True), (1, 2, 1, 131, 70, 32, True),
                                        (1, 2, 2, 77, 77, 32, False)]:
        q, k, v, do = _inputs(torch.float32, B, H, HK, SQ, SK, D, seed=2)
        scale = 0.3
        err = _errors(_run(_fa, q, k, v, do, causal, scale), _ref_grads(q, k, v, do, causal, scale))
        assert max(err) < 5e-5, (SQ, SK, err)


def test_triton_fully_masked_rows_are_zero():
    q, k, v, do = _inputs(torch.float32, 1, 2, 2, 100, 40, 32, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_with_lse(q, k, v, causal=True)
    (out * do).sum().backward()
    dead = 100 - 40  # rows 0..59 see no key
    assert not torch.isnan(out).any() and not torch.isnan(q.grad).any()
    assert not torch.isnan(k.grad).any() and not torch.isnan(v.grad).any()
    assert torch.all(out[:, :, :dead] == 0)
    assert torch.all(q.grad[:, :, :dead] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :dead])) and torch.isfinite(lse[:, :, dead:]).all()
    assert (out[:, :, dead:].abs().sum(-1) > 0).all()


def test_triton_strided_inputs():
    """q/k/v as head-transposed views of (B, S, H, D) buffers (non-contiguous)."""
    g = torch.Generator().manual_seed(4)
    qb = torch.randn(2, 70, 4, 32, generator=g)
    kb = torch.randn(2, 90, 2, 32, generator=g)
    vb = torch.randn(2, 90, 2, 32, generator=g)
    q, k, v = qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2)
    do = torch.randn(2, 70, 4, 32, generator=g).transpose(1, 2)
    assert not q.is_contiguous()
    for causal in (False, True):
        err = _errors(_run(_fa, q, k, v, do, causal, 0.2), _ref_grads(q, k, v, do, causal, 0.2))
        assert max(err) < 5e-5, err


def test_triton_lse_gradient():
    """A gradient flowing into lse (d lse / d s = softmax) is handled by the backward."""
    q, k, v, do = _inputs(torch.float32, 1, 4, 2, 70, 90, 32, seed=5)
    dl = torch.randn(1, 4, 70, generator=torch.Generator().manual_seed(6))
    for causal in (False, True):
        grads = []
        for fn, cast in ((flash_attention_with_lse, lambda t: t), (None, torch.Tensor.double)):
            qq, kk, vv = (cast(t).detach().requires_grad_() for t in (q, k, v))
            if fn is None:
                out, lse = ref_attention(qq, kk, vv, causal, 0.25)
            else:
                out, lse = fn(qq, kk, vv, causal=causal, scale=0.25)
            ((out * cast(do)).sum() + (lse * cast(dl)).sum()).backward()
            grads.append((qq.grad, kk.grad, vv.grad))
        assert max(_errors(*grads)) < 5e-5


def test_saved_tensors_have_no_score_matrix():
    q, k, v, do = _inputs(torch.float32, 1, 2, 2, 96, 96, 32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = flash_attention(q, k, v, causal=True)
    assert sorted(shapes) == sorted([(1, 2, 96, 32)] * 4 + [(1, 2, 96)])
    out.backward(do)


# ---------------------------------------------------------------------------------------------
# PyTorch fallback, custom op registration
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", FP32_CASES[2:], ids=lambda c: "x".join(map(str, c)))
def test_fallback_matches_fp64(dtype, case):
    launch.set_triton_mode("never")
    B, H, HK, SQ, SK, D, causal = case
    q, k, v, do = _inputs(dtype, B, H, HK, SQ, SK, D, seed=7)
    assert not launch.use_triton(q)
    scale = 1.0 / math.sqrt(D)
    err = _errors(_run(_fa, q, k, v, do, causal, scale), _ref_grads(q, k, v, do, causal, scale))
    tol = 5e-5 if dtype == torch.float32 else 1e-12
    assert max(err) < tol, err


def test_fallback_chunking(monkeypatch):
    launch.set_triton_mode("never")
    monkeypatch.setattr(reference, "_REF_CHUNK", 16)
    q, k, v, do = _inputs(torch.float64, 1, 4, 2, 50, 40, 16, seed=8)
    err = _errors(_run(_fa, q, k, v, do, True, 0.3), _ref_grads(q, k, v, do, True, 0.3))
    assert max(err) < 1e-12, err


def _f64_leaves(g, *shapes):
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


def test_fallback_gradcheck():
    launch.set_triton_mode("never")
    g = torch.Generator().manual_seed(9)
    q, k, v = _f64_leaves(g, (1, 4, 12, 8), (1, 2, 17, 8), (1, 2, 17, 8))
    for causal in (False, True):  # Sq <= Sk: every row sees a key, lse is finite
        assert torch.autograd.gradcheck(lambda q, k, v: flash_attention_with_lse(q, k, v, causal, 0.4), (q, k, v))
    # Sq > Sk causal (fully masked rows): out only (lse is -inf there)
    ks, vs = _f64_leaves(g, (1, 2, 7, 8), (1, 2, 7, 8))
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, True, 0.4), (q, ks, vs))


@pytest.mark.parametrize("path", ["fallback", "triton"])
def test_opcheck(path):
    if path == "triton":
        dtype = torch.float32
    else:
        launch.set_triton_mode("never")
        dtype = torch.float64
    q, k, v, do = _inputs(dtype, 1, 4, 2, 40, 48, 16, seed=10)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for causal in (False, True):
        torch.library.opcheck(torch.ops.remat.flash_attention.default, (q, k, v, causal, 0.25))
        out, lse = torch.ops.remat.flash_attention(q, k, v, causal, 0.25)
        det = [t.detach() for t in (q, k, v, out, lse)]
        for dlse in (None, torch.randn_like(lse)):
            torch.library.opcheck(torch.ops.remat.flash_attention_backward.default,
                                  (do, *det, dlse, causal, 0.25))


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 33, 40, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 50, 40, dtype=torch.bfloat16)
        out, lse = torch.ops.remat.flash_attention(q, k, k, True, 0.1)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        assert lse.shape == (2, 8, 33) and lse.dtype == torch.float32
        dq, dk, dv = torch.ops.remat.flash_attention_backward(out, q, k, k, out, lse, None, True, 0.1)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_bad_shapes_rejected():
    q = torch.randn(1, 3, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError):
        flash_attention(q, k, k)


def test_import_and_fallback_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from remat.attention.op import flash_attention\n"
        "from remat.attention.launch import triton_available, use_triton\n"
        "assert not triton_available()\n"
        "q = torch.randn(1, 2, 10, 8, requires_grad=True)\n"
        "assert not use_triton(q)\n"
        "flash_attention(q, q, q, causal=True).sum().backward()\n"
        "assert torch.isfinite(q.grad).all()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# attention dropout: the hashed mask, in the kernels and in the PyTorch path
# ---------------------------------------------------------------------------------------------
def ref_dropout_attention(q, k, v, causal, scale, p, seed):
    """float64 softmax attention with the probabilities dropped by the op's hashed mask."""
    from remat.attention.dropout_hash import dropout_keep_mask

    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_mask(q.shape[2], k.shape[2]), float("-inf"))
    B, H, SQ, SK = s.shape
    keep = dropout_keep_mask(seed, (B, H), SQ, (0, SQ), SK, p)
    return (torch.softmax(s, -1).nan_to_num(0.0) * keep / (1 - p)) @ v


DROPOUT_CASES = [(1, 2, 2, 100, 100, 32, True), (2, 4, 2, 70, 90, 32, False), (1, 2, 1, 100, 60, 32, True)]


@pytest.mark.parametrize("path", ["triton", "fallback"])
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: "x".join(map(str, c)))
def test_dropout_matches_fp64_with_the_same_mask(path, case):
    if path == "fallback":
        launch.set_triton_mode("never")
    B, H, HK, SQ, SK, D, causal = case
    q, k, v, do = _inputs(torch.float32, B, H, HK, SQ, SK, D, seed=11)
    seed = torch.tensor(1234567, dtype=torch.int64)
    fa = lambda q, k, v, c, s: flash_attention(q, k, v, c, s, dropout_p=0.2, seed=seed)  # noqa: E731
    ref = lambda q, k, v, c, s: ref_dropout_attention(q, k, v, c, s, 0.2, seed)  # noqa: E731
    res = _run(fa, q, k, v, do, causal, 0.3)
    expect = _run(ref, q, k, v, do.double(), causal, 0.3)
    err = _errors(res, expect)
    assert max(err) < 5e-5, err
    plain = _run(_fa, q, k, v, do, causal, 0.3)
    assert (res[0] - plain[0]).abs().max() > 0.1  # dropout did something


def test_dropout_mask_statistics_and_determinism():
    from remat.attention.dropout_hash import dropout_keep_mask

    keep = dropout_keep_mask(torch.tensor(7), (2, 4), 256, (0, 256), 256, 0.1)
    assert abs(keep.float().mean().item() - 0.9) < 0.005
    # rows, columns and heads are not correlated: neighbours agree as often as chance says
    for a, b in ((keep[..., 1:, :], keep[..., :-1, :]), (keep[..., 1:], keep[..., :-1]),
                 (keep[:, 1:], keep[:, :-1])):
        assert abs((a == b).float().mean().item() - (0.9**2 + 0.1**2)) < 0.01
    assert torch.equal(keep[:, :, 100:130], dropout_keep_mask(torch.tensor(7), (2, 4), 256, (100, 130), 256, 0.1))
    assert not torch.equal(keep, dropout_keep_mask(torch.tensor(8), (2, 4), 256, (0, 256), 256, 0.1))


def test_dropout_gradcheck_and_opcheck():
    launch.set_triton_mode("never")
    g = torch.Generator().manual_seed(12)
    q, k, v = _f64_leaves(g, (1, 4, 12, 8), (1, 2, 17, 8), (1, 2, 17, 8))
    seed = torch.tensor(99, dtype=torch.int64)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, True, 0.4, 0.3, seed), (q, k, v))
    torch.library.opcheck(torch.ops.remat.flash_attention.default, (q, k, v, True, 0.4, 0.3, seed))
    with pytest.raises(ValueError):
        torch.ops.remat.flash_attention(q, k, v, True, 0.4, 0.3, None)
    with pytest.raises(ValueError):
        flash_attention(q, k, v, True, 0.4, 1.0, seed)


def test_dropout_seed_from_torch_generator():
    launch.set_triton_mode("never")
    q, k, v, _ = _inputs(torch.float32, 1, 2, 2, 32, 32, 16, seed=13)
    torch.manual_seed(5)
    a = flash_attention(q, k, v, True, dropout_p=0.5)
    b = flash_attention(q, k, v, True, dropout_p=0.5)
    torch.manual_seed(5)
    assert torch.equal(a, flash_attention(q, k, v, True, dropout_p=0.5)) and not torch.equal(a, b)


def test_triton_small_blocks_many_unmasked_tiles():
    """16 x 16 tiles: most tiles are off the diagonal and inside Sq/Sk, so the kernels skip their
    masks there; results must not change (causal and not, dropout, GQA, ragged S)."""
    launch.INTERPRET_BLOCKS.update({"fwd": (16, 16), "dkdv": (16, 16), "dq": (16, 16), "pre": 16})
    seed = torch.tensor(77, dtype=torch.int64)
    for causal, (sq, sk), p in [(True, (70, 70), 0.0), (False, (70, 90), 0.0), (True, (90, 70), 0.0),
                                (True, (70, 70), 0.25)]:
        q, k, v, do = _inputs(torch.float32, 1, 4, 2, sq, sk, 16, seed=14)
        fa = lambda q, k, v, c, s: flash_attention(q, k, v, c, s, dropout_p=p, seed=seed)  # noqa: E731
        ref = lambda q, k, v, c, s: ref_dropout_attention(q, k, v, c, s, p, seed)  # noqa: E731
        err = _errors(_run(fa, q, k, v, do, causal, 0.3), _run(ref, q, k, v, do.double(), causal, 0.3))
        assert max(err) < 5e-5, (causal, sq, sk, p, err)
