"""remat: optimal activation checkpointing for PyTorch."""
import os as _os

# The stages live at the repository root (core/, compat/, attention/, graph_capture/, solver/,
# runtime/) and are installed as remat.core, remat.compat, ...; when remat is imported from a source
# checkout (e.g. pytest run from the root), let it find them beside this folder.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "core", "__init__.py")) and _root not in __path__:
    __path__.append(_root)

from remat.api import InfeasibleBudgetError, TraceError, capture, optimize, solve
from remat.core.errors import RematError, RematWarning
from remat.blockwise import BlockwiseModule, BlockwisePlanWarning
from remat.graph_capture.autocast_state import AutocastMismatchError
from remat.graph_capture.export import FusedAttentionWarning
from remat.graph_capture.traced_state import TracedStateWarning
from remat.graph_capture.joint import DoubleBackwardError, ParameterMismatchError, RetainedGraphWarning
from remat.graph_capture.outputs import OutputError
from remat.graph_capture.profiling import ProfilerBusyError
from remat.graph_capture.workspace import WorkspaceNotMeasuredWarning
from remat.measure import count_flops, measure_peak, resident_bytes
from remat.runtime.compile import CompiledPeakWarning
from remat.runtime.module import BlockBudgetWarning, OutsideBudgetWarning, PlanCacheLimitWarning, RematModule
from remat.deployment import load_plan
from remat.planning import plan
from remat.settings import CaptureOptions, Solver
from remat.core.plan import PlanMismatchError
from remat.solver.checkmate import SolverFallbackWarning
from remat.core.plan import Plan, PlanFileError, PlanStatus
from remat.solver.revolve import NotAChainError
from remat.validate import RematArgumentError, RematArgumentTypeError

__all__ = ["optimize", "plan", "capture", "solve", "Solver", "CaptureOptions", "RematModule", "BlockwiseModule", "measure_peak", "count_flops", "resident_bytes", "Plan", "PlanStatus",
           "load_plan",
           # the errors and warnings remat documents (README: "What remat refuses"), and their bases
           "RematError", "RematWarning",
           "InfeasibleBudgetError", "TraceError", "PlanFileError", "PlanMismatchError", "RematArgumentError",
           "RematArgumentTypeError", "AutocastMismatchError", "ParameterMismatchError", "OutputError",
           "DoubleBackwardError", "BlockwisePlanWarning", "OutsideBudgetWarning", "BlockBudgetWarning", "PlanCacheLimitWarning", "RetainedGraphWarning", "FusedAttentionWarning", "TracedStateWarning",
           "WorkspaceNotMeasuredWarning", "ProfilerBusyError", "CompiledPeakWarning", "SolverFallbackWarning",
           "NotAChainError"]
