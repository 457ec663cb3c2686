"""The command line's argument types and printing, shared by every command (remat/cli.py's demo,
remat/cli_offline.py's solve, inspect, check and max-batch): each type raises ArgumentTypeError, so a
bad value ends the run while parsing with one line (`remat solve: error: argument --x: ...`)."""
from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Parser", "number", "int_at_least", "positive_int", "count", "positive", "fraction", "probability",
           "output_file", "say", "step"]


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block): `remat demo: error: ...`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# argparse types: each raises ArgumentTypeError, which argparse reports as "argument --x: <message>"
def number(s: str) -> float:
    """A finite number."""
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return x


def int_at_least(lowest: int, what: str):
    """An argparse type: an integer >= `lowest`, described as `what` in the error."""

    def parse(s: str) -> int:
        """An integer of at least `lowest` (the argparse type int_at_least made)."""
        try:
            n = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if n < lowest:
            raise argparse.ArgumentTypeError(f"expected {what}, got {n}")
        return n

    return parse


positive_int = int_at_least(1, "a positive integer")  # an argparse type: an integer >= 1
count = int_at_least(0, "a non-negative integer")  # an argparse type: an integer >= 0


def positive(s: str) -> float:
    """A number > 0."""
    x = number(s)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s}")
    return x


def fraction(s: str) -> float:
    """A fraction in (0, 1]."""
    x = number(s)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {s}")
    return x


def probability(s: str) -> float:
    """A dropout probability in [0, 1)."""
    x = number(s)
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"expected a dropout probability in [0, 1), got {s}")
    return x


def output_file(s: str) -> str:
    """A file we will be able to write at the end: its folder exists and is writable, so a typo
    fails now and not after minutes of solving."""
    folder = os.path.dirname(os.path.abspath(s))
    if os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"{s!r} is a directory; give a file name")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"the directory {folder!r} is not writable")
    return s


def say(msg: str) -> None:
    """One line on stdout, flushed (progress a user is waiting for)."""
    print(msg, flush=True)


@contextmanager
def step(msg: str) -> Iterator[None]:
    """Print what is about to take a while, then how long it took."""
    say(f"{msg} ...")
    t0 = time.perf_counter()
    yield
    say(f"  done in {time.perf_counter() - t0:.1f} s")
