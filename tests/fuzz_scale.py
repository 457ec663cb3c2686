"""How many random cases the fuzz tests draw.

The README's test command draws the share that keeps the whole suite under ten minutes on a 2-core
CI machine; `REMAT_FUZZ_SCALE=k` draws k times as many (a thorough run, e.g. before a release or
after changing the capture, the router or a strategy):

    REMAT_FUZZ_SCALE=4 python -m pytest -q -n auto tests/test_fuzz.py tests/test_fuzz_conv.py \
        tests/test_fuzz_transformer.py tests/test_attention_spellings.py
"""
from __future__ import annotations

import os

__all__ = ["fuzz_count"]


def fuzz_count(n: int) -> int:
    """`n` cases at scale 1, `n * REMAT_FUZZ_SCALE` otherwise (at least 1)."""
    scale = float(os.environ.get("REMAT_FUZZ_SCALE", "1"))
    return max(1, round(n * scale))
