"""Trace library models (Hugging Face transformers) the way torch.compile traces them.

Hugging Face's mask code (`transformers.masking_utils`) takes shortcuts that read the *values* of
the padding mask: "is every token visible? then drop the mask and let SDPA use is_causal"
(`_ignore_causal_mask_sdpa`, `_ignore_bidirectional_mask_sdpa`, `padding_mask.all()`). remat traces
on fake tensors, which have no values, so such a read fails
(`DataDependentOutputException: aten._local_scalar_dense`). Answering it from the example inputs
would be worse: the graph remat plans is run for every later batch, whose masks differ, so a mask
dropped because the example happened to have no padding would silently be missing for the next one.

Hugging Face skips these shortcuts whenever `torch.compiler.is_compiling()` is true (through
`is_tracing` / `is_torchdynamo_compiling`) and then always builds the mask from the tensor, which is
right for every mask value. torch.compile holds that flag for its whole compile session, including
while AOTAutograd traces (`torch.compiler._compile_session_context`); `traced_as_compiled()` holds
it the same way while remat traces, so library code takes the path it takes under torch.compile.

What users pass (see also the README): the model in train() mode with its usual keyword arguments
(`input_ids`, `attention_mask`, `labels` so that the model returns its loss, `pixel_values`, ...),
and `use_cache=False` for decoders (LLaMA, GPT-2, T5): a key/value cache returned by the step is not
a tensor remat can plan for. The outputs (a ModelOutput with `loss`, `logits`, ...) come back with
the same structure.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["traced_as_compiled"]


@contextmanager
def traced_as_compiled() -> Iterator[None]:
    """Make `torch.compiler.is_compiling()` true while a step is traced (as torch.compile does
    during its compile session), so that libraries skip data-dependent shortcuts."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    # torch versions without the session context manager keep the same module flag
    old = getattr(torch.compiler, "_is_compiling_flag", None)
    if old is None:  # no flag to set: library code runs its eager path (and may fail to trace)
        yield
        return
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old
