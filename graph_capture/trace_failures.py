"""What a TraceError says when tracing a training step failed deep inside torch: the failure's
first line, the user's source line it came from, and where the failure has a known cause in the
model, what to do about it (a plain tensor attribute, a parameter read outside the traced call,
reentrant self-checkpointing)."""
from __future__ import annotations

import os
import traceback
from importlib.util import find_spec

import torch
import torch.nn as nn

__all__ = ["trace_failure", "what_failed"]


def trace_failure(name: str, exc: BaseException, model: nn.Module) -> str:
    """The message of the TraceError for `exc`, raised while tracing `model` (class `name`)."""
    return (f"could not trace the training step of {name}: {what_failed(exc)}\n"
            f"  at {_user_frame(exc)}{_plain_tensors_hint(exc, model)}{_real_parameter_hint(exc)}"
            f"{_reentrant_checkpoint_hint(exc)}")


def what_failed(exc: BaseException) -> str:
    """The error's type and the first line of its message (torch's run to many lines)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _plain_tensors_hint(exc: BaseException, model: nn.Module) -> str:
    """Where the trace met a real tensor that is neither a parameter, a buffer nor an input (a
    module attribute holding a plain tensor, as VideoMAE's sinusoidal position table), which
    AOTAutograd's fake tensors refuse: the model's attributes of that kind, and what to do."""
    if "convert all Tensors to FakeTensors" not in str(exc):
        return ""
    found = [f"{path + '.' if path else ''}{attr} {tuple(t.shape)}" for path, m in model.named_modules()
             for attr, t in vars(m).items() if isinstance(t, torch.Tensor)]
    if not found:
        return ""
    return ("\n  the model reads tensors held as plain module attributes, not as parameters or buffers: "
            f"{', '.join(found[:5])}{' ...' if len(found) > 5 else ''}; the step is traced without data and "
            "cannot take them: make each a buffer (`t = m.NAME; del m.NAME; m.register_buffer('NAME', t, "
            "persistent=False)`) and optimize again")


def _real_parameter_hint(exc: BaseException) -> str:
    """Where the trace met one of the model's parameters as the real tensor, not the traced one: code
    that reaches it other than through the module call the trace lifts (a custom autograd.Function
    running a submodule with tensors it saved, as Reformer's reversible layers do)."""
    text = str(exc)
    if "convert all Tensors to FakeTensors" not in text or "Parameter containing" not in text:
        return ""
    return ("\n  the step reads one of the model's parameters as itself, not as the tensor the trace passes for "
            "it: code that reaches parameters outside the module call, typically a custom "
            "torch.autograd.Function whose forward or backward runs submodules (reversible layers recompute "
            "their inputs that way); remat cannot trace that: run those layers without the custom Function, "
            "or leave this model to torch.utils.checkpoint")


def _reentrant_checkpoint_hint(exc: BaseException) -> str:
    """Where the model runs torch.utils.checkpoint with use_reentrant=True (its own recomputation,
    a backward inside the backward, which AOTAutograd cannot trace): what to do instead."""
    if "use_reentrant=True" not in str(exc):
        return ""
    return ("\n  the model checkpoints its own blocks with torch.utils.checkpoint(use_reentrant=True); remat plans "
            "what to recompute itself: turn that checkpointing off (Hugging Face: "
            "`model.gradient_checkpointing_disable()`), or pass use_reentrant=False, which traces through "
            "(remat's plan then decides), and optimize again")


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch and remat's own machinery: the user's line."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    # remat's own folders, found without importing the later stages of the pipeline
    stages = ("remat", "remat.compat", "remat.attention", "remat.graph_capture", "remat.solver", "remat.runtime")
    ours = {os.path.dirname(os.path.abspath(find_spec(name).origin)) for name in stages}
    for fr in reversed(frames):
        path = os.path.abspath(fr.filename)
        if path.startswith(torch_dir) or path.startswith("<"):
            continue
        if os.path.dirname(path) in ours and not path.endswith("default_model.py"):
            continue
        return f"{fr.filename}:{fr.lineno}: {fr.line}"
    return "<unknown source line>"
