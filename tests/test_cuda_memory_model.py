"""What a plan made for a GPU must count beyond the graph, and what a process must give back.

The GPU run (benchmarks/gpu_check.py, results in benchmarks/results/gpu_check_h200.txt) found
three things the CPU could not show; the parts of them that do not need a GPU are tested here:
  * PuLP's first import pinned the stack that imported it, so a model optimized inside a function
    was never freed (on the GPU: its parameters stayed allocated into the next model's peak);
  * measure_peak must measure on the device the work is on without being told;
  * Triton 3.6 reads which kernel parameters are constexpr from the function's annotations.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from remat.graph_capture.cuda_library import cuda_library_workspace_bytes
from remat.measure import measure_peak

FREED_SCRIPT = textwrap.dedent("""
    import gc, weakref
    import remat
    from remat.default_model import GPTConfig, default_inputs, default_model

    def optimize_and_step():
        cfg = GPTConfig(n_layer=2, block_size=64, batch_size=2)
        model, inputs = default_model(cfg), default_inputs(cfg)
        keep = remat.optimize(model, example_inputs=inputs, solver="keep_all", quiet=True)
        budget = int(0.9 * keep.plan.predicted_peak_bytes)
        opt = remat.optimize(model, budget_bytes=budget, example_inputs=inputs, quiet=True)
        opt(*inputs).backward()
        return weakref.ref(model), weakref.ref(opt)

    model, opt = optimize_and_step()
    gc.collect()
    print("alive", model() is not None, opt() is not None)
""")


def test_a_model_optimized_inside_a_function_is_freed_when_the_function_returns():
    # a fresh interpreter: the first solve of the process is the one that imported PuLP
    out = subprocess.run([sys.executable, "-c", FREED_SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "alive False False" in out.stdout, out.stdout + out.stderr[-2000:]


def test_measure_peak_measures_cpu_work_on_the_cpu_without_being_told():
    w = torch.randn(64, 64, requires_grad=True)

    def step():
        (w @ w).relu().sum().backward()

    told = measure_peak(step, resident=[w], device="cpu")
    w.grad = None
    found = measure_peak(step, resident=[w])
    assert found == told > w.numel() * 4


def test_library_workspaces_count_only_on_cuda():
    assert cuda_library_workspace_bytes(torch.device("cpu")) == 0


def test_bound_kernels_keep_the_constexpr_annotations_triton_reads():
    from remat.attention import kernels
    from remat.attention.launch import bind_globals

    bound = bind_globals(kernels.attn_fwd_kernel, {})
    assert bound.__annotations__ == kernels.attn_fwd_kernel.__annotations__
    assert "constexpr" in str(bound.__annotations__["HEAD_DIM"])
