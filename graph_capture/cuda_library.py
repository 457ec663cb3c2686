"""The memory CUDA's math libraries hold for as long as the process runs, counted into a plan.

cuBLAS and cuBLASLt get their workspaces from PyTorch's caching allocator, one per (handle,
stream), the first time a matmul runs on them, and keep them: `torch.cuda.max_memory_allocated`
counts them in every step's peak. A training step runs matmuls on two threads, each with its own
handle: the forward on the calling thread, the backward on the autograd engine's device thread.
On an H200 with torch 2.11 each thread holds a 32 MiB cuBLAS and a 1 MiB cuBLASLt workspace, as much
as a small model's activations (benchmarks/results/gpu_check_h200.txt). The graph shows none of
it, so a plan made on a GPU adds it to its resident bytes (graph_capture/build.py), measured here:
the workspaces are released, matmuls on the plain and the Lt path run on this thread, and what the
allocator then holds is one thread's share; the step's is twice that. Releasing them releases every
thread's (PyTorch keeps one map for the process), so in the first step after a capture the autograd
thread allocates its workspace again at its first backward matmul: that step can peak below the
plan, never above it; from the second step on both are held throughout, as the plan counts them.
"""
from __future__ import annotations

import torch

from remat.compat.torch_private import clear_cublas_workspaces, disable_current_modes

__all__ = ["cuda_library_workspace_bytes", "STEP_THREADS"]

STEP_THREADS = 2  # the forward's thread and autograd's device thread each hold their own workspaces


def cuda_library_workspace_bytes(device: torch.device, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> int:
    """Bytes the cuBLAS/cuBLASLt workspaces of a training step on `device` hold (0 off CUDA), for
    matmuls in `dtypes` (the step's floating dtypes: fp32 and the half types can take the plain
    and the Lt path)."""
    if device.type != "cuda":
        return 0
    # called while AOTAutograd partitions (fake-tensor mode, grad off): real tensors, outside it
    with disable_current_modes(), torch.no_grad(), torch.cuda.device(device):
        torch.cuda.synchronize()
        if not clear_cublas_workspaces():
            return 0  # this torch cannot release them: they may already be in the baseline
        base = torch.cuda.memory_allocated()
        for dtype in dtypes:
            a = torch.randn(64, 64, device=device, dtype=dtype)
            b = torch.randn(64, 64, device=device, dtype=dtype)
            bias = torch.randn(64, device=device, dtype=dtype)
            torch.nn.functional.linear(a, b, bias)  # addmm: the Lt path
            torch.mm(a, b)  # the plain cuBLAS path
            del a, b, bias
        torch.cuda.synchronize()
        per_thread = max(0, torch.cuda.memory_allocated() - base)
    return STEP_THREADS * per_thread
