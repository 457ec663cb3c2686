"""Progress on stderr for the stages that can take a while (tracing, probing ops, solving).

Nothing is shown for a stage that ends within DELAY_S seconds, so small models stay silent; a
longer one shows a tqdm line with its name, its count (ops probed, LPs solved) and what it knows
so far (nodes, best bound, incumbent, gap), and the elapsed time; redrawn twice a second on a
terminal, every LOG_REDRAW_S seconds when stderr goes to a file or a pipe. `quiet()` (what
`quiet=True` / `--quiet` turn on) silences every stage in its context, threads included that it
starts.

This lives in the lowest stage that reports progress (graph_capture); solver/ and remat/ use it.
"""
from __future__ import annotations

import contextvars
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["DELAY_S", "REDRAW_S", "LOG_REDRAW_S", "quiet", "is_quiet", "stage", "Stage"]

DELAY_S = 2.0  # a stage shorter than this shows nothing
REDRAW_S = 0.5  # how often the line is redrawn on a terminal
LOG_REDRAW_S = 30.0  # ... and when stderr is a file or a pipe (a log gets a line per this, not a stream)
_QUIET = contextvars.ContextVar("remat_quiet", default=False)


@contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """Within this context no stage shows progress (on=False: leave the setting as it is)."""
    if not on:
        yield
        return
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def is_quiet() -> bool:
    """Whether progress is silenced here."""
    return _QUIET.get()


class Stage:
    """One stage's progress line: `advance(n)` counts work done, `note(**facts)` shows what is
    known so far. A ticker thread redraws the line every half second, so a stage stuck in one long
    call (tracing) still shows its elapsed time."""

    def __init__(self, desc: str, total: int | None, unit: str):
        self._bar = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        tty = getattr(sys.stderr, "isatty", lambda: False)()
        self._period = REDRAW_S if tty else LOG_REDRAW_S
        self._args = dict(desc=f"remat: {desc}", total=total, unit=unit, file=sys.stderr, leave=False,
                          dynamic_ncols=True, mininterval=self._period)
        self._n = 0
        self._facts: dict = {}
        self._ticker = None
        if not is_quiet():
            self._ticker = threading.Thread(target=self._tick, name="remat-progress", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(self._period):
            self._draw()

    def _draw(self) -> None:
        if time.perf_counter() - self._t0 < DELAY_S:
            return
        with self._lock:
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(initial=self._n, **self._args)
                # elapsed counts from the stage's start (tqdm keeps its own clock)
                self._bar.start_t = self._bar._time() - (time.perf_counter() - self._t0)
                self._bar.last_print_t = self._bar.start_t
            self._bar.n = self._n
            if self._facts:
                self._bar.set_postfix(self._facts, refresh=False)
            self._bar.refresh()

    def advance(self, n: int = 1) -> None:
        """Count `n` more units of work done."""
        self._n += n

    def note(self, **facts) -> None:
        """Show these facts (name=value) on the line from now on."""
        self._facts.update({k: _short(v) for k, v in facts.items()})

    def close(self) -> None:
        """End the stage: its line is removed (closing twice is harmless)."""
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            self._t0 = float("inf")  # never drawn again


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


@contextmanager
def stage(desc: str, total: int | None = None, unit: str = "it") -> Iterator[Stage]:
    """A Stage for the body (see Stage); shown only if it lasts DELAY_S seconds and progress is
    not quiet."""
    s = Stage(desc, total, unit)
    try:
        yield s
    finally:
        s.close()
