"""Launching the Triton kernels: which path runs, the launch configs, the jit cache, the launches.

* Mode: CUDA tensors run the Triton kernels when Triton is importable; CPU tensors run the PyTorch
  reference (`attention.reference`), whatever the environment: a user's `TRITON_INTERPRET=1` does
  not send remat's CPU attention through Triton's interpreter (slow, and with other temporaries
  than the ones the plan was measured with). `set_triton_mode("interpret")` runs the kernels on
  CPU tensors in the interpreter (with `TRITON_INTERPRET=1` set while they launch: that is how the
  tests exercise them); "never" forces the reference, "always" refuses to fall back.
* Jitting: `jit_kernels(interpret, fp32)` jits the plain kernel bodies of `attention.kernels` once
  per mode, each bound to a globals namespace holding that mode's `tl` and `dropout_keep_tl` (so
  compiled and interpreted kernels coexist in one process, and no module global is patched).
* Configs: GPU launch configs per kernel (autotuned for fp16/bf16), fixed blocks for the interpreter.

Triton is imported lazily, on first use; everything else in `remat.attention` works without it.
"""
from __future__ import annotations

import builtins
import contextlib
import functools
import os
import types
from typing import Optional

import torch

import remat.attention.kernels as kernels
from remat.attention.dropout_hash import dropout_keep_tl, dropout_threshold
from remat.attention.reference import new_attention_output

__all__ = ["TRITON_MAX_HEAD_DIM", "INTERPRET_BLOCKS", "GPU_CONFIGS", "GPU_FP32_CONFIG", "triton_available",
           "bind_globals", "device_context", "import_triton", "interpret_mode", "set_triton_mode", "get_triton_mode", "triton_runs_on",
           "torch_kernels_may_take", "use_triton",
           "jit_kernels", "block_d", "triton_forward", "triton_backward"]

# Largest head dim the Triton kernels take; bigger ones use the reference path.
TRITON_MAX_HEAD_DIM = 128
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
_MODES = ("auto", "never", "always", "interpret")
_mode = ["auto"]  # the one user setting (set_triton_mode); a list so no `global` statement is needed


@functools.cache
def import_triton():
    """The triton module, or None when it cannot be imported (imported once, on first use)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return None
    return triton


def triton_available() -> bool:
    """True when ``import triton`` works."""
    return import_triton() is not None


def interpret_mode() -> bool:
    """True when the Triton interpreter is requested (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def set_triton_mode(mode: str) -> None:
    """``"auto"`` (default): Triton on CUDA, the PyTorch reference on CPU; ``"interpret"``: also
    the kernels on CPU, in Triton's interpreter (``TRITON_INTERPRET=1`` must be set while they
    launch); ``"never"``: always the PyTorch reference; ``"always"``: like auto but raise instead
    of falling back when the Triton path cannot be used for a supported dtype/device."""
    if mode not in _MODES:
        raise ValueError(f"mode must be 'auto', 'interpret', 'never' or 'always', got {mode!r}")
    _mode[0] = mode


def get_triton_mode() -> str:
    """The mode set by `set_triton_mode` ("auto" unless changed)."""
    return _mode[0]


def triton_runs_on(device: torch.device) -> bool:
    """Whether remat's Triton kernels run on tensors of `device` in the current mode: compiled on
    CUDA, interpreted on CPU in "interpret" mode with TRITON_INTERPRET=1, never in "never" mode."""
    mode = get_triton_mode()
    return (mode != "never"
            and ((device.type == "cuda" and not interpret_mode())
                 or (device.type == "cpu" and mode == "interpret" and interpret_mode()))
            and triton_available())


def torch_kernels_may_take(q: torch.Tensor, k: torch.Tensor, causal: bool, dropout_p: float) -> bool:
    """What every one of torch's own fused kernels behind the op (cuDNN's, attention.cudnn; the CPU
    flash kernel, attention.cpu_flash) needs beyond its device and dtype: the default mode "auto"
    ("never" asks for the reference, "interpret" and "always" for the Triton kernels), no dropout
    (the op's is its own hashed mask), causal only with Sq == Sk (torch's kernels align the causal
    mask top-left, the op bottom-right), a non-empty problem."""
    return (get_triton_mode() == "auto" and dropout_p == 0.0 and (not causal or q.shape[2] == k.shape[2])
            and q.numel() > 0 and k.shape[2] > 0)


def use_triton(t: torch.Tensor) -> bool:
    """Whether attention on tensors like ``t`` (the query) runs the Triton kernels."""
    mode = get_triton_mode()
    if mode == "never":
        return False
    ok = (
        t.dtype in _TRITON_DTYPES
        and t.dim() == 4
        and 1 <= t.shape[-1] <= TRITON_MAX_HEAD_DIM
        and triton_runs_on(t.device)
    )
    if not ok and mode == "always":
        raise RuntimeError(
            f"remat flash attention: Triton path unavailable for dtype={t.dtype} device={t.device} "
            f"shape={tuple(t.shape)} (triton importable: {triton_available()}, interpret: {interpret_mode()})"
        )
    return ok


# Block sizes used by the interpreter (deliberately unequal, so masks and the causal block
# arithmetic are exercised).  Tests may override them.
INTERPRET_BLOCKS = {"fwd": (64, 32), "dkdv": (32, 64), "dq": (64, 32), "pre": 64}

# GPU configs: (BLOCK_M, BLOCK_N, num_warps, num_stages) for fp16/bf16; the first is the default
# when autotuning is off (REMAT_FLASH_AUTOTUNE=0).  Autotuning is keyed on head dim, causal, group
# size and dtypes (not on sequence lengths).  Every config compiles for sm_90 without spilling
# registers at head dims 64 and 128, with and without dropout (`python benchmarks/compile_check.py`,
# which compiles them with Triton's ptxas, no GPU needed); earlier lists spilled up to 1.1 KB per
# thread in dK/dV at d = 128.
GPU_CONFIGS = {
    "fwd": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (64, 32, 4, 4)],
    "dkdv": [(32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 8, 4), (16, 64, 4, 4)],
    "dq": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 4), (64, 32, 4, 4)],
}
# fp32 tiles are twice the bytes and fp32 dots (no TF32) run without tensor cores: one small config
# per kernel, no autotuning (fp32 is a correctness path). Chosen to spill nothing at head dims 32
# and 64 (the d = 128 forward spills 320 bytes per thread).
GPU_FP32_CONFIG = {"fwd": (32, 32, 8, 2), "dkdv": (32, 32, 8, 2), "dq": (64, 32, 8, 2)}
# Integer args that vary with the problem and would otherwise trigger a recompile per value
# (Triton specializes ints on ==1 and %16==0); strides stay specialized (unit stride matters).
_NO_SPECIALIZE = {
    "fwd": ["H", "GROUP", "SQ", "SK"],
    "dkdv": ["H", "HKV", "GROUP", "SQ", "SK"],
    "dq": ["H", "GROUP", "SQ", "SK"],
    "pre": ["H", "SQ"],
}
_BODIES = {"pre": kernels.attn_bwd_preprocess_kernel, "fwd": kernels.attn_fwd_kernel,
           "dkdv": kernels.attn_bwd_dkdv_kernel, "dq": kernels.attn_bwd_dq_kernel}


def _autotune_enabled() -> bool:
    return os.environ.get("REMAT_FLASH_AUTOTUNE", "1") != "0"


def bind_globals(fn, namespace: dict):
    """`fn` with its global names looked up in `namespace` (same code, so Triton reads the same
    source; the interpreter may add names to the namespace, which is this mode's own dict)."""
    bound = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    # the parameters' annotations say which are tl.constexpr: Triton 3.6 reads them from here
    bound.__annotations__ = dict(fn.__annotations__)
    bound.__qualname__, bound.__module__, bound.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return bound


@functools.cache
def _jit_namespace(interpret: bool) -> dict:
    """The globals the kernel bodies see in one mode: triton.language and the dropout-mask helper
    jitted in that mode. triton.jit builds interpreted or compiled functions by TRITON_INTERPRET,
    so callers jit with the variable set as `interpret` says (see `jit_kernels`)."""
    triton = import_triton()
    namespace = {"__builtins__": builtins, "__name__": kernels.__name__, "tl": triton.language}
    namespace["dropout_keep_tl"] = triton.jit(bind_globals(dropout_keep_tl, namespace))
    return namespace


@functools.cache
def jit_kernels(interpret: bool, fp32: bool = False) -> dict:
    """{"pre", "fwd", "dkdv", "dq"} -> jitted kernel (autotuned on GPU for fp16/bf16), once per mode."""
    triton = import_triton()
    if triton is None:
        raise RuntimeError("triton is not available")
    if interpret != interpret_mode():
        raise RuntimeError(f"jit_kernels(interpret={interpret}) called with TRITON_INTERPRET="
                           f"{os.environ.get('TRITON_INTERPRET')!r}: triton.jit would build the other kind")
    tune = _autotune_enabled() and not interpret and not fp32
    namespace = _jit_namespace(interpret)
    ks = {}
    for name, body in _BODIES.items():
        jitted = triton.jit(bind_globals(body, namespace), do_not_specialize=_NO_SPECIALIZE[name])
        if tune and name != "pre":
            configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                       for bm, bn, w, st in GPU_CONFIGS[name]]
            jitted = triton.autotune(configs=configs, key=["HEAD_DIM", "CAUSAL", "GROUP"])(jitted)
        ks[name] = jitted
    return ks


def _launch(kern, name: str, interpret: bool, fp32: bool, grid_dim0_len: int, grid1: int, args: tuple,
            meta: dict):
    """Launch a kernel with BLOCK_M/BLOCK_N from autotune, a fixed config, or INTERPRET_BLOCKS.
    ``grid_dim0_len`` is the length split by BLOCK_M (fwd, dq) or BLOCK_N (dkdv)."""
    triton = import_triton()
    split_key = "BLOCK_N" if name == "dkdv" else "BLOCK_M"
    if interpret:
        bm, bn = INTERPRET_BLOCKS[name]
        blocks = {"BLOCK_M": bm, "BLOCK_N": bn}
        kern[(triton.cdiv(grid_dim0_len, blocks[split_key]), grid1)](*args, **meta, **blocks)
    elif isinstance(kern, triton.runtime.Autotuner):
        kern[lambda META: (triton.cdiv(grid_dim0_len, META[split_key]), grid1)](*args, **meta)
    else:
        bm, bn, w, st = GPU_FP32_CONFIG[name] if fp32 else GPU_CONFIGS[name][0]
        blocks = {"BLOCK_M": bm, "BLOCK_N": bn}
        kern[(triton.cdiv(grid_dim0_len, blocks[split_key]), grid1)](
            *args, **meta, **blocks, num_warps=w, num_stages=st
        )


def _prec(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def block_d(d: int) -> int:
    """The head-dim tile: the next power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, import_triton().next_power_of_2(d))


def device_context(t: torch.Tensor):
    """The context a kernel on `t` launches in: its CUDA device current, nothing on the CPU
    (the interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _dropout_args(dropout_p: float, seed: Optional[torch.Tensor], dummy: torch.Tensor) -> tuple:
    """(SEED pointer, DROP_THRESH, DROP_SCALE) kernel args and the DROPOUT flag."""
    if dropout_p > 0.0:
        return (seed.to(device=dummy.device, dtype=torch.int64).reshape(()), dropout_threshold(dropout_p),
                1.0 / (1.0 - dropout_p)), True
    return (dummy, 0, 1.0), False


def triton_forward(q, k, v, causal: bool, scale: float, dropout_p: float = 0.0, seed=None,
                   sdpa_layout: bool = False):
    """The forward kernel: ``(out like q, lse (B, Hq, Sq) fp32)``."""
    interpret = interpret_mode()
    fp32 = q.dtype == torch.float32
    kern = jit_kernels(interpret, fp32)
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    out = new_attention_output(q, sdpa_layout)
    lse = torch.empty((B, H, SQ), dtype=torch.float32, device=q.device)
    dot_fp32 = interpret and q.dtype == torch.bfloat16
    (seed_t, thresh, drop_scale), dropout = _dropout_args(dropout_p, seed, lse)
    meta = dict(HEAD_DIM=D, BLOCK_D=block_d(D), CAUSAL=bool(causal), DOT_FP32=dot_fp32, PREC=_prec(q.dtype),
                DROPOUT=dropout)
    args = (q, k, v, out, lse, seed_t, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            H, H // HKV, SQ, SK, scale * _LOG2E, thresh, drop_scale)
    with device_context(q):
        _launch(kern["fwd"], "fwd", interpret, fp32, SQ, B * H, args, meta)
    return out, lse


def triton_backward(dout, q, k, v, out, lse, dlse, causal: bool, scale: float, dropout_p: float = 0.0,
                    seed=None):
    """The backward kernels (preprocess, dK/dV, dQ): ``(dq, dk, dv)``."""
    interpret = interpret_mode()
    fp32 = q.dtype == torch.float32
    kern = jit_kernels(interpret, fp32)
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    BLOCK_D = block_d(D)
    dot_fp32 = interpret and q.dtype == torch.bfloat16
    lse = lse.contiguous()
    delta = torch.empty((B, H, SQ), dtype=torch.float32, device=q.device)
    dq = torch.empty((B, H, SQ, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, HKV, SK, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, HKV, SK, D), dtype=v.dtype, device=v.device)
    with device_context(q):
        bm = INTERPRET_BLOCKS["pre"] if interpret else 64
        kern["pre"][(import_triton().cdiv(SQ, bm), B * H)](
            out, dout, delta, *out.stride(), *dout.stride(), H, SQ,
            HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=bm, **({} if interpret else {"num_warps": 4}),
        )
        if dlse is not None:
            # d lse_i / d s_ij = p_ij, so a gradient flowing into lse shifts delta by -dlse.
            delta = delta - dlse.to(torch.float32)
        (seed_t, thresh, drop_scale), dropout = _dropout_args(dropout_p, seed, lse)
        meta = dict(HEAD_DIM=D, BLOCK_D=BLOCK_D, CAUSAL=bool(causal), DOT_FP32=dot_fp32, PREC=_prec(q.dtype),
                    DROPOUT=dropout)
        common = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
        _launch(kern["dkdv"], "dkdv", interpret, fp32, SK, B * HKV,
                (q, k, v, dout, lse, delta, dk, dv, seed_t, *common, *dk.stride(), *dv.stride(),
                 H, HKV, H // HKV, SQ, SK, scale, scale * _LOG2E, thresh, drop_scale), meta)
        _launch(kern["dq"], "dq", interpret, fp32, SQ, B * H,
                (q, k, v, dout, lse, delta, dq, seed_t, *common, *dq.stride(),
                 H, H // HKV, SQ, SK, scale, scale * _LOG2E, thresh, drop_scale), meta)
    return dq, dk, dv
