"""Tensor checks a model makes (`torch._check_tensor_all`) kept in the traced step, checked on
every call.

Library code states facts about its inputs as tensor checks: Hugging Face's vision-language models
check that a batch holds as many image tokens as the vision tower gives features
(`torch_compilable_check`, which under torch.compile's flag, held while remat traces, calls
`torch._check_tensor_all`; LLaVA, PaliGemma, Idefics2, Qwen2-VL and about 130 modeling files of
transformers 5.25 make such checks). Such a check reads the tensor's value (`.item()`), which a
fake tensor does not have, so the whole step could not be traced (DataDependentOutputException) and
the model was planned block by block. Answering it from the example's values would drop the check
for every later batch. Instead, while a step is traced, a check on a traced tensor becomes an
assert op of the graph (compat/torch_private.py `tensor_checks_as_asserts`), run at every call of
the planned step on that call's values. A batch that breaks the check still fails, with
RuntimeError and KEPT_CHECK_MESSAGE (where eager Hugging Face raises ValueError with a message built
from values the trace does not have); on CUDA, as torch's own asynchronous asserts, as a
device-side assert. Checks on real tensors (another thread's eager code) run as they always do.
"""
from __future__ import annotations

from contextlib import AbstractContextManager

from remat.compat.torch_private import tensor_checks_as_asserts

__all__ = ["checks_kept_in_graph", "KEPT_CHECK_MESSAGE"]

KEPT_CHECK_MESSAGE = ("a tensor check of the model failed (torch._check_tensor_all, traced by remat and run "
                      "at every call of the planned step): this batch breaks a condition the model's code states")


def checks_kept_in_graph() -> AbstractContextManager[None]:
    """While a step is traced: a tensor check on a traced tensor adds an assert to the graph
    instead of reading the tensor's value (module docstring)."""
    return tensor_checks_as_asserts(KEPT_CHECK_MESSAGE)
