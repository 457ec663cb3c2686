"""remat: optimal activation checkpointing for PyTorch."""

from remat.api import InfeasibleBudgetError, TraceError, capture, optimize, solve
from remat.measure import count_flops, measure_peak, resident_bytes
from remat.solver.plan import Plan

__all__ = ["optimize", "capture", "solve", "measure_peak", "count_flops", "resident_bytes", "Plan",
           "InfeasibleBudgetError", "TraceError"]
