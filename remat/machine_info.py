"""How measured results are labelled: the machine they ran on (`machine()`) and the unit sizes are
printed in (`MiB`).

The CLI and every benchmark import both from here, so all results files and printed tables describe
their machine the same way (README's figures keep each file's `machine:` line) and convert bytes
with the same constant.
"""
from __future__ import annotations

import os
import platform

import torch

__all__ = ["MiB", "machine"]

MiB = 2**20  # bytes per mebibyte: every size remat prints is in MiB


def machine(*extra: str) -> str:
    """One line naming where results were measured: architecture, CPU cores, torch's thread count,
    the Python and torch versions, then `extra` (other versions that matter, e.g. "transformers
    5.24.0"), then the platform string and the 1-minute load average when the line is made (times
    measured while other work shares the cores are longer than on a quiet machine: the load says so)."""
    parts = [platform.machine(), f"{os.cpu_count()} cores", f"{torch.get_num_threads()} threads",
             f"python {platform.python_version()}", f"torch {torch.__version__}", *extra, platform.platform(),
             f"load average {os.getloadavg()[0]:.1f}"]
    return ", ".join(parts)
