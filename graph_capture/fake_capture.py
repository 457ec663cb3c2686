"""Capture a training step without its memory: traced on fake tensors, for a device that need not be here.

`capture_without_memory(model, inputs, device=...)` gives the TrainingGraph `remat.capture` gives
for the real model and inputs of the same shapes (the same nodes, bytes and fingerprint), while
allocating none of the step's memory: the model may be built on the meta device or under a
FakeTensorMode, or be a real model; the inputs may be meta, fake or real tensors (only their
shapes, strides and dtypes are read).

How: every parameter, input and buffer without data becomes a fake tensor (a new FakeTensorMode's,
on the CPU) for the time of the trace, and the model's own tensors are put back afterwards.
Buffers with real CPU data are left as they are, so the attention router can still read a causal
mask's values (a mask on the meta device has none: attention that reads it is not proven causal
and stays unfused). The step is traced on the CPU whatever `device` says: this torch cannot trace
fake CUDA tensors without a GPU (AOTAutograd's functionalization needs a CUDA device guard), and
remat plans are made on the CPU graph anyway (the fused attention's PyTorch path saves what the
GPU kernels save). `device` decides the memory model and where op workspaces are measured:

* "cpu": bytes exact (the profiler's count); each op run once on the CPU, at its traced shapes if
  its inputs and outputs fit `limits`, else on smaller shapes and scaled (graph_capture/workspace.py);
* "cuda": every allocation rounded up to 512 bytes, as the caching allocator counts it; op
  workspaces measured on the GPU as above when this machine has one, else known formulas or 0.

Every workspace not measured at its traced shape is listed in `graph.meta["estimated_workspaces"]`.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from remat.compat.torch_private import disable_current_modes, fake_tensor_mode, is_fake, pytree
from remat.graph_capture.build import build_training_graph
from remat.graph_capture.joint import capture_training_step
from remat.graph_capture.rewrites import prepare_joint_graph
from remat.graph_capture.scaled_workspace import ProbeLimits, probe_within
from remat.core.training_graph import TrainingGraph

__all__ = ["capture_without_memory", "planned_device", "ProbeLimits"]


def planned_device(device) -> torch.device:
    """`device` ("cpu", "cuda", "cuda:1", a torch.device) as the device a plan is made for."""
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device must be 'cpu' or 'cuda' (or a torch.device of either), got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"remat plans for 'cpu' or 'cuda' devices, got {device!r}")
    return dev


def _fake_like(t: torch.Tensor, mode) -> torch.Tensor:
    """A fake CPU tensor of `t`'s shape, strides, dtype and requires_grad (a leaf)."""
    with mode:
        f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
    return f.requires_grad_() if t.requires_grad else f


def _has_data(t: torch.Tensor) -> bool:
    return not t.is_meta and not is_fake(t) and t.device.type == "cpu"


@contextmanager
def _fake_state(model: nn.Module, mode) -> Iterator[list[str]]:
    """The model's parameters (all) and buffers (those without real CPU data) replaced by fakes
    of the same shapes, strides, dtypes and requires_grad (tied ones stay tied), then put back.
    Yields the names of the buffers that had no data (their values are unknown to the trace)."""
    fakes: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    without_data = [name for name, b in model.named_buffers() if b.is_meta or is_fake(b)]
    try:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in fakes:
                    fakes[id(p)] = nn.Parameter(_fake_like(p.detach(), mode), requires_grad=p.requires_grad)
                swapped.append((mod._parameters, name, p))
                mod._parameters[name] = fakes[id(p)]
            for name, b in list(mod._buffers.items()):
                if b is None or _has_data(b):
                    continue
                if id(b) not in fakes:
                    fakes[id(b)] = _fake_like(b.detach(), mode)
                swapped.append((mod._buffers, name, b))
                mod._buffers[name] = fakes[id(b)]
        yield without_data
    finally:
        for table, name, original in reversed(swapped):
            table[name] = original


def _fake_inputs(args: tuple, kwargs: dict, mode) -> tuple[tuple, dict]:
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    fakes: dict[int, torch.Tensor] = {}
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if id(x) not in fakes:
                fakes[id(x)] = _fake_like(x, mode)
            x = fakes[id(x)]
        out.append(x)
    return pytree.tree_unflatten(out, spec)


def capture_without_memory(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None = None, *,
                           device="cpu", fused_attention: bool | str = True,
                           limits: ProbeLimits | None = None, chunked_loss: bool = False) -> TrainingGraph:
    """The TrainingGraph of one training step of `model`, traced on fake tensors and measured for
    `device` (see the module doc); with `chunked_loss`, its loss head traced as remat's chunked op
    where the router can (remat.loss_head.router). `limits`: how large one op's probe may be (default ProbeLimits()).
    The graph's meta records `planned_for` (the device type), `estimated_workspaces` (the ops whose
    workspace was not measured at its traced shape, and how it was estimated), `buffers_without_data`
    (meta or fake buffers: a causal mask among them is not known to be one, so attention reading it
    stays unfused, unlike in the real model's graph) and `capture_s`."""
    dev = planned_device(device)
    limits = limits or ProbeLimits()
    probe_device = torch.device("cpu") if dev.type == "cpu" else (dev if torch.cuda.is_available() else None)
    allocator = dev.type
    name = type(model).__name__

    t0 = time.perf_counter()
    # a FakeTensorMode the caller may be in is stepped out of: the trace makes its own fakes, and
    # the probes draw random numbers that must not move the caller's generator
    rng_devices = [probe_device.index or 0] if probe_device is not None and probe_device.type == "cuda" else []
    with disable_current_modes(), torch.random.fork_rng(devices=rng_devices):
        mode = fake_tensor_mode()
        args, kwargs = _fake_inputs(tuple(example_inputs), dict(example_kwargs or {}), mode)
        with _fake_state(model, mode) as without_data:
            with capture_training_step(model, args, kwargs, fused_attention, chunked_loss=chunked_loss) as captured, \
                    captured.graph_work():
                # what remat.capture does with the joint graph (remat/pipeline.py), measured as asked
                joint_gm = captured.joint_gm
                prepare_joint_graph(joint_gm, dev.type)  # as remat.capture does: the same graph
                probed = probe_within(joint_gm, probe_device, limits, allocator)
                g = build_training_graph(joint_gm, captured.num_fwd_outputs, name=name, probe=probed,
                                         allocator=allocator).graph
    g.meta.update({"planned_for": dev.type, "traced_on": "cpu (fake tensors)",
                   "estimated_workspaces": probed.estimated, "buffers_without_data": without_data,
                   "capture_s": round(time.perf_counter() - t0, 3)})
    return g
