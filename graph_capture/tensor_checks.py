"""Tensor checks a model makes (`torch._check_tensor_all`) kept in the traced step, checked on
every call.

Library code states facts about its inputs as tensor checks: Hugging Face's vision-language models
check that a batch holds as many image tokens as the vision tower gives features
(`torch_compilable_check`, which under torch.compile's flag, held while remat traces, calls
`torch._check_tensor_all`; LLaVA, PaliGemma, Idefics2, SmolVLM, Qwen2-VL and about 130 modeling
files of transformers 5.25). Such a check reads the tensor's value (`.item()`), which a fake tensor
does not have, so the whole step could not be traced (DataDependentOutputException) and the model
was planned block by block. Answering it from the example's values would drop the check for every
later batch. Instead, while a step is traced, a check on a traced tensor becomes
`torch._assert_async(cond.all(), ...)`: an op of the graph (side-effecting, so no pass drops it),
run at every call of the planned step on that call's values. A batch that breaks the check still
fails, with RuntimeError (where eager Hugging Face raises ValueError with its own message, built
from values the trace does not have); on CUDA, as torch's own asynchronous asserts, as a device-side
assert. Checks on real tensors (another thread's eager code) run as they always do.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["checks_kept_in_graph", "KEPT_CHECK_MESSAGE"]

KEPT_CHECK_MESSAGE = ("a tensor check of the model failed (torch._check_tensor_all, traced by remat and run "
                      "at every call of the planned step): this batch breaks a condition the model's code states")


@contextmanager
def checks_kept_in_graph() -> Iterator[None]:
    """While a step is traced: `torch._check_tensor_all` (and `_with`) on a traced tensor adds an
    asynchronous assert to the graph instead of reading the tensor's value (module docstring)."""
    original = torch._check_tensor_all_with

    def check(error_type, cond, message=None):
        if isinstance(cond, torch.Tensor) and cond.dtype == torch.bool and is_fake(cond):
            torch._assert_async(cond.all(), KEPT_CHECK_MESSAGE)
            return
        original(error_type, cond, message)

    # torch._check_tensor_all calls torch._check_tensor_all_with through torch's module globals
    torch._check_tensor_all_with = check
    try:
        yield
    finally:
        torch._check_tensor_all_with = original
