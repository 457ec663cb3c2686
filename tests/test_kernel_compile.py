"""The Triton kernels compile for the GPU (sm_90) with Triton's own ptxas, no GPU needed: the
interpreter tests check their math, this checks that the compiled language accepts them, for the
variants with the most to go wrong (dropout's integer hash, causal, head dim 128), and that their
default launch configs do not spill registers."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: kernel compile check skipped")

from remat.attention.launch import GPU_CONFIGS  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the kernel tooling lives there
from kernel_compile import SM90_SHARED_LIMIT, KernelVariant, compile_variant  # noqa: E402


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_kernels_compile_for_sm90_with_dropout(kernel):
    v = KernelVariant(kernel, torch.bfloat16, 128, True, True, GPU_CONFIGS[kernel][0])
    r = compile_variant(v)
    if r.error and ("ptxas" in r.error.lower() and "not found" in r.error.lower()):
        pytest.skip(f"no ptxas in this triton install: {r.error}")
    assert r.ok, r.error
    assert 0 < r.shared_bytes <= SM90_SHARED_LIMIT
    if r.stack_bytes is not None:  # cuobjdump ran: the default config must not spill registers
        assert r.stack_bytes == 0, f"{v.label()} spills {r.stack_bytes} bytes per thread"


def test_compile_check_reports_errors_instead_of_raising():
    v = KernelVariant("fwd", torch.bfloat16, 128, True, False, (48, 64, 4, 3))  # tl.arange needs powers of 2
    r = compile_variant(v)
    # Triton's front end reports it as a CompilationError; with TRITON_INTERPRET=1 set when triton
    # was imported its language builtins are the interpreter's, whose check is a bare assert
    assert not r.ok and r.error.split(":")[0] in ("CompilationError", "AssertionError"), r.error
