"""Compile the flash-attention kernels ahead of time for a GPU target, without a GPU.

Triton ships ptxas, so `triton.compile` can take a kernel all the way to a cubin for, say, sm_90 on
a machine with no CUDA device. That catches what the CPU interpreter cannot: type errors of the
compiled language, layouts that do not lower, and tiles that overflow shared memory. The cubin's
resource usage (registers per thread, stack bytes: register spills) comes from Triton's bundled
cuobjdump, a static hint of where a kernel will be slow. Used by
`tests/test_kernel_compile.py` (a few variants) and `benchmarks/compile_check.py` (every variant the
GPU path can launch).
"""
from __future__ import annotations

import itertools
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass

import torch

from remat.attention import launch

__all__ = ["KernelVariant", "CompileResult", "all_variants", "compile_variant", "SM90_SHARED_LIMIT"]

SM90_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on H100/H200 (227 KiB)

_POINTER_DTYPES = {"LSE": "*fp32", "DELTA": "*fp32", "SEED": "*i64"}
_TENSOR_POINTERS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
_FLOAT_SCALARS = {"qk_scale_log2", "sm_scale", "DROP_SCALE"}
_TL_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class KernelVariant:
    kernel: str  # "fwd" | "dkdv" | "dq"
    dtype: torch.dtype
    head_dim: int
    causal: bool
    dropout: bool
    config: tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)

    def label(self) -> str:
        bm, bn, w, st = self.config
        return (f"{self.kernel:<4} {_TL_NAMES[self.dtype]} d{self.head_dim:<3} causal={int(self.causal)} "
                f"dropout={int(self.dropout)} M{bm} N{bn} w{w} s{st}")


@dataclass(frozen=True)
class CompileResult:
    variant: KernelVariant
    ok: bool
    shared_bytes: int | None
    seconds: float
    error: str | None = None
    registers: int | None = None  # per thread, from cuobjdump (None: not available)
    stack_bytes: int | None = None  # per thread; > 0 means registers spill to local memory


def all_variants(head_dims=(64, 128), dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> list[KernelVariant]:
    """Every (kernel, dtype, head dim, causal, dropout, config) the GPU path can launch."""
    out = []
    for name, dtype, d, causal, dropout in itertools.product(("fwd", "dkdv", "dq"), dtypes, head_dims,
                                                             (False, True), (False, True)):
        configs = [launch.GPU_FP32_CONFIG[name]] if dtype == torch.float32 else launch.GPU_CONFIGS[name]
        out.extend(KernelVariant(name, dtype, d, causal, dropout, c) for c in configs)
    return out


def _signature(fn, dtype: torch.dtype) -> dict[str, str]:
    sig = {}
    for arg in fn.arg_names:
        if arg in _TENSOR_POINTERS:
            sig[arg] = "*" + _TL_NAMES[dtype]
        elif arg in _POINTER_DTYPES:
            sig[arg] = _POINTER_DTYPES[arg]
        elif arg in _FLOAT_SCALARS:
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"  # strides, sizes, DROP_THRESH (constexprs are overwritten below)
    return sig


def _is_unit_stride(arg: str) -> bool:
    """s_qd, s_kd, s_dkd, ...: the stride of the head dimension."""
    return arg.startswith("s_") and arg.endswith("d") and len(arg) >= 4


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack bytes) of the kernel in `cubin`, via the cuobjdump Triton ships."""
    tool = os.path.join(os.path.dirname(launch.import_triton().__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True,
                              timeout=60).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def compile_variant(v: KernelVariant, arch: int = 90) -> CompileResult:
    """Compile one variant to a cubin for sm_<arch>; never raises."""
    t0 = time.perf_counter()
    interpret = os.environ.pop("TRITON_INTERPRET", None)  # triton.jit must build compiled kernels
    try:
        if not launch.triton_available():
            raise RuntimeError("triton is not installed")
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        fn = launch.jit_kernels(interpret=False, fp32=True)[v.kernel]  # plain jit functions, no autotuner
        bm, bn, warps, stages = v.config
        constexprs = dict(HEAD_DIM=v.head_dim, BLOCK_D=launch.block_d(v.head_dim),
                          CAUSAL=v.causal, DOT_FP32=False, PREC="ieee", DROPOUT=v.dropout, BLOCK_M=bm, BLOCK_N=bn)
        # Specialise as a launch on contiguous (B, H, S, D) tensors does: the head-dim strides are 1
        # (Triton turns an int argument equal to 1 into a constant), pointers and the other
        # strides are multiples of 16 (torch allocations are 16-byte aligned; rows hold D elements).
        # Without this the compiler cannot prove loads contiguous and does not pipeline them.
        constexprs.update({a: 1 for a in fn.arg_names if _is_unit_stride(a)})
        sig = _signature(fn, v.dtype)
        sig.update({k: "constexpr" for k in constexprs})
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if sig[a].startswith("*") or (a.startswith("s_") and sig[a] == "i32")}
        src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
        kernel = launch.import_triton().compile(src, target=GPUTarget("cuda", arch, 32),
                                   options=dict(num_warps=warps, num_stages=stages))
        shared = int(kernel.metadata.shared)
        ok = shared <= SM90_SHARED_LIMIT
        regs, stack = _resource_usage(kernel.asm["cubin"])
        return CompileResult(v, ok, shared, time.perf_counter() - t0,
                             None if ok else f"shared memory {shared} > {SM90_SHARED_LIMIT}", regs, stack)
    except Exception as exc:  # report, do not stop the sweep
        msg = str(exc).strip().splitlines()
        return CompileResult(v, False, None, time.perf_counter() - t0,
                             f"{type(exc).__name__}: {msg[0] if msg else ''}")
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
