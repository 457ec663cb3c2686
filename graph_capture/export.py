"""AOTAutograd's joint graph of a training step, traced with remat's routers, and the fallback
where remat's fused attention op cannot take the model's attention.

The fused op keeps its output for its backward (attention/op.py). A model that writes into
attention's output in place after it (BigBird's block-sparse attention calls `unsqueeze_` on it)
fails autograd's saved-tensor check while the step is traced, where the model's own code (a
matmul, which keeps its inputs, not its output) does not: the step is then traced again without
the fused op, a FusedAttentionWarning says so, and the model's later traces (new call kinds,
planning again) skip the attempt.
"""
from __future__ import annotations

import warnings
import weakref
from contextlib import ExitStack

import torch
import torch.nn as nn

from remat.core.errors import RematError, RematWarning
from remat.core.progress import Stage
from remat.compat.torch_private import aot_export_joint, fresh_fake_tensor_cache
from remat.graph_capture.host_rng import HostRandomError, host_rng_states, host_rngs_drawn
from remat.graph_capture.module_paths import record_module_spans
from remat.graph_capture.outputs import OutputError
from remat.graph_capture.trace_failures import trace_failure, what_failed

__all__ = ["export_joint", "TraceError", "FusedAttentionWarning"]

# the models whose step failed to trace with the fused op: their later traces go straight to their
# own attention code (a failed attempt costs a whole trace: BigBird's 2.9 s of 6.9 s)
_UNFUSED: weakref.WeakSet = weakref.WeakSet()


class TraceError(RematError, RuntimeError):
    """The model's training step could not be traced; the message names the op or source line."""


class FusedAttentionWarning(RematWarning):
    """Tracing the step with remat's fused attention op failed where tracing the model's own
    attention code did not: the step is traced without the fused op."""


class _FusedAttentionFailed(Exception):
    """Tracing failed after attention was routed to the fused op (the cause: `__cause__`)."""


def export_joint(stack: ExitStack, model: nn.Module, step, flat: list, fused_attention: bool | str,
                 chunked_loss: bool):
    """AOTAutograd's joint graph of `step` (the model's flat training step), the module spans
    recorded while tracing it and the autocast state it was traced in, with the contexts it needs
    entered on `stack`; traced with the fused attention op as `fused_attention` says, or without
    it where that trace fails (see the module doc). Raises TraceError (or OutputError)."""
    from remat.attention.router import fused_attention_mode

    fused = False if model in _UNFUSED else fused_attention
    attempt = stack.enter_context(ExitStack())
    try:
        with warnings.catch_warnings():
            if fused_attention_mode(fused) != "off":  # autograd's report of a failure retried below
                warnings.filterwarnings("ignore", "Error detected in", UserWarning)
            return _export(attempt, model, step, flat, fused, chunked_loss)
    except _FusedAttentionFailed as failed:
        attempt.close()
        found = _export(stack, model, step, flat, False, chunked_loss)
        _UNFUSED.add(model)
        warnings.warn(FusedAttentionWarning(
            f"fused attention left off for {type(model).__name__}: tracing it with remat's fused attention op failed "
            f"({what_failed(failed.__cause__)}), so the model's own attention code is traced instead. The fused op "
            "keeps its output for its backward: a model that writes into attention's output in place (BigBird's "
            "block-sparse attention does) cannot use it"), stacklevel=4)
        return found


def _export(stack: ExitStack, model: nn.Module, step, flat: list, fused_attention: bool | str, chunked_loss: bool):
    """export_joint's one attempt. Raises _FusedAttentionFailed where tracing failed after attention
    was routed to the fused op, TraceError (or OutputError) for any other failure."""
    from remat.attention.router import route_attention
    from remat.graph_capture.autocast_state import AutocastState, backward_traced_as_eager, step_device_types
    from remat.graph_capture.hf_compat import traced_as_compiled
    from remat.graph_capture.tensor_checks import checks_kept_in_graph
    from remat.loss_head.router import route_loss_head

    tracing = Stage("tracing the training step (forward and backward)", None, "it")
    router = None
    try:
        spans = stack.enter_context(record_module_spans(model))
        router = stack.enter_context(route_attention(fused_attention, model))
        stack.enter_context(route_loss_head(bool(chunked_loss)))
        # trace as torch.compile does, so that Hugging Face skips its data-dependent mask
        # shortcuts (graph_capture/hf_compat.py); the step checks each call runs under the
        # autocast it was traced in, the backward without any (autocast_state.py)
        autocast = AutocastState.current(step_device_types(model, flat))
        stack.enter_context(traced_as_compiled())
        # a tensor check of the model's (an image-token count) stays in the graph, run every call
        stack.enter_context(checks_kept_in_graph())
        stack.enter_context(backward_traced_as_eager())
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        # from an empty fake-tensor cache (fresh_fake_tensor_cache says why): a module's first
        # trace in a process and its later ones must count the same bytes, or a plan made on one
        # would not match the other (a model planned block by block traces each block twice)
        fresh_fake_tensor_cache()
        host_rngs = host_rng_states()
        joint = aot_export_joint(stack, step, flat)
        drawn = host_rngs_drawn(host_rngs)
        if drawn:  # frozen into the graph: every step would repeat the trace's draws (host_rng.py)
            raise HostRandomError(drawn)
    except (TraceError, OutputError):
        raise
    except Exception as e:  # tracing failures surface from deep inside torch: name the culprit
        if router is not None and router.routed:
            raise _FusedAttentionFailed() from e
        raise TraceError(trace_failure(type(model).__name__, e, model)) from e
    finally:
        tracing.close()
    return joint, spans, autocast
