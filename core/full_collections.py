"""Fewer full garbage collections while a solver runs.

A solve builds a relaxation of a few hundred thousand Python objects (its rows and states) and
then allocates lists by the million in its plan searches (every simulated schedule). CPython
counts those allocations and, every tenth young collection, considers a full one, which walks
every object the process holds: on RegNet at half its activation memory, 20 full collections
took 3.3 s of an 18 s solve; made rare, the same plans came sooner (`benchmarks/certificates.py`
against the checkout before, this 2-core machine: RegNet 14.9 -> 12.5 s, T5 14.3 -> 12.2 s,
benchmarks/results/certificates.txt). Almost nothing a solve allocates is cyclic garbage (reference counts free its
lists), and the young collections still run, so cycles made and dropped within the solve are
still found there or at the next full collection after it.

`rare_full_collections()` raises the full collection's threshold (the count of young-generation
collections between two full ones) to at least FULL_EVERY for its duration, then puts back what
was set before; nested and concurrent uses (threads solving at once) share one raise, undone by
the last to leave. A caller who disabled the collector or set larger thresholds keeps them.
"""
from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["FULL_EVERY", "rare_full_collections"]

FULL_EVERY = 1000  # young-generation (gen 1) collections between two full ones; CPython's default is 10

_lock = threading.Lock()
_users = 0
_saved: tuple[int, ...] | None = None


@contextmanager
def rare_full_collections() -> Iterator[None]:
    """Within this context, a full collection at most every FULL_EVERY gen-1 collections (usable
    as a decorator too)."""
    global _users, _saved
    with _lock:
        if _users == 0:
            _saved = gc.get_threshold()
            if _saved[2] < FULL_EVERY:
                gc.set_threshold(_saved[0], _saved[1], FULL_EVERY)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _saved is not None:
                now = gc.get_threshold()
                if now[2] == max(_saved[2], FULL_EVERY):  # a threshold a caller set meanwhile stays
                    gc.set_threshold(now[0], now[1], _saved[2])
                _saved = None
