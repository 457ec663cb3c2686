"""The planned step under torch.compile: the plan's graphs compiled by Inductor, never re-partitioned.

remat's runtime hands AOTAutograd a forward and a backward graph that already hold the plan: what
the forward saves, and the recomputations (copies of forward nodes) in the backward. torch.compile
would trace the model again and let its own partitioner (min-cut) choose what to save, undoing the
plan. So a step runs under torch.compile like this:

* `torch.compile(remat_module)` / `remat_module.compile()`: Dynamo does not trace into the planned
  step (it is a `torch.compiler.disable`d call, a graph break: code around it is compiled); the
  step's two graphs are compiled by Inductor at their first call (`PlannedGraphs.use_inductor`).
* `remat.optimize(torch.compile(model))`, or a model with `.compile()`d submodules: remat traces the
  eager modules (the compiler must not run inside remat's trace) and Inductor compiles the planned
  graphs.

Either way Inductor receives the partitioned graphs, as torch.compile hands it the graphs of its
own partitioner: it fuses and schedules inside each graph, and cannot move a value across the
forward/backward boundary, so what is saved and what is recomputed stays the plan's
(`PlannedGraphs.recomputed_nodes` counts the recomputations in the backward it compiles). Fusion does
change when buffers are freed inside a graph, so the compiled step's peak is measured, not
simulated to the byte (README, "Beyond one device"). Random ops run as ATen fallbacks
(`fallback_random`), so dropout masks are eager's.
"""
from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch
import torch.fx as fx

from remat.core.errors import RematWarning
from remat.compat.torch_private import inductor_compile
from remat.graph_capture import bn_replay  # noqa: F401  (registers remat::batch_norm_stats, looked up below)
from remat.graph_capture.joint import run_boxed

__all__ = ["PlannedGraphs", "GraphRunner", "RECOMPUTED", "CompiledPeakWarning"]

RECOMPUTED = "remat_recomputed"  # node.meta key the runtime sets on recomputations in the backward


class CompiledPeakWarning(RematWarning):
    """The plan's graphs run as Inductor compiled them: the step's peak is Inductor's, not the
    plan's prediction, and can exceed the budget (`python benchmarks/compile_budget.py` measures by
    how much). `remat.optimize(..., compiled=True)` measures it instead (remat/compiled_fit.py)."""


class GraphRunner:
    """One partitioned graph (forward or backward), called with AOTAutograd's boxed convention:
    it takes the list of its inputs and empties it, so each input (a saved activation, in the
    backward) is freed after its last use. It runs the fx code as it is until `use_inductor()`;
    then its next call compiles it with Inductor (on that call's inputs) and runs the compiled code."""

    _boxed_call = True  # AOTAutograd passes the input list itself

    def __init__(self, gm: fx.GraphModule, is_backward: bool):
        self.gm = gm
        self._eager = run_boxed(gm, None)  # the fx code, boxed
        self.is_backward = is_backward
        # remat::batch_norm hands its statistics to remat::batch_norm_stats on its output tensor;
        # Inductor can pass a copy of that tensor instead (seen on MobileNet: a fused kernel wrote
        # one), which batch_norm_stats refuses (BatchNormOrderError) mid-step. Such a graph keeps
        # its fx code under torch.compile, and says so once.
        self.keeps_fx_code = any(n.op == "call_function" and n.target is torch.ops.remat.batch_norm_stats.default
                                 for n in gm.graph.nodes)
        self._said_fx = False
        self.inductor = False
        self.compiled: Callable | None = None
        self._lock = threading.Lock()

    @property
    def recomputed_nodes(self) -> int:
        """Nodes of this graph that recompute a forward value (the plan's recomputations)."""
        return sum(1 for n in self.gm.graph.nodes if n.meta.get(RECOMPUTED))

    def __call__(self, args: list):
        if not self.inductor:
            return self._eager(args)
        if self.keeps_fx_code:
            if not self._said_fx:
                self._said_fx = True
                which = "backward" if self.is_backward else "forward"
                warnings.warn(f"remat: under torch.compile the plan's {which} graph runs its fx code, not Inductor's: "
                              "it computes BatchNorm so that it can be recomputed (remat::batch_norm hands its "
                              "statistics to remat::batch_norm_stats on its output tensor, and Inductor may pass a "
                              "copy of that tensor)", stacklevel=2)
            return self._eager(args)
        if self.compiled is None:
            with self._lock:
                if self.compiled is None:
                    gm = self.gm
                    self.compiled = inductor_compile(lambda *a: gm(list(a)), list(args),
                                                     is_backward=self.is_backward)
        return self.compiled(args)


class PlannedGraphs:
    """AOTAutograd's forward and backward compilers for one planned step (`compilers`), and the
    runners they made: `use_inductor()` switches both to Inductor (compiled at their next call)."""

    def __init__(self):
        self.forward: GraphRunner | None = None
        self.backward: GraphRunner | None = None
        self.inductor = False

    def _forward_compiler(self, gm: fx.GraphModule, example_inputs) -> GraphRunner:
        self.forward = GraphRunner(gm, is_backward=False)
        self.forward.inductor = self.inductor
        return self.forward

    def _backward_compiler(self, gm: fx.GraphModule, example_inputs) -> GraphRunner:
        self.backward = GraphRunner(gm, is_backward=True)
        self.backward.inductor = self.inductor
        return self.backward

    @property
    def compilers(self) -> tuple[Callable, Callable]:
        """(forward compiler, backward compiler), for trace_training_step."""
        return self._forward_compiler, self._backward_compiler

    def use_inductor(self) -> None:
        """Compile both graphs with Inductor at their next call (once; later calls reuse them). The
        first switch warns (CompiledPeakWarning): the budget was planned for the fx code."""
        if not self.inductor:
            warnings.warn(CompiledPeakWarning(
                "remat: torch.compile runs this plan's forward and backward through Inductor, whose code decides "
                "when buffers are freed and which temporaries exist: the step's peak is not the plan's predicted "
                "peak and can exceed the budget (benchmarks/compile_budget.py measures by how much). Pass "
                "compiled=True to remat.optimize (it measures the compiled step and plans again until it fits), "
                "leave that headroom in the budget, or run the remat module without torch.compile for a peak "
                "predicted to the byte."), stacklevel=3)
        self.inductor = True
        for r in (self.forward, self.backward):
            if r is not None:
                r.inductor = True

    @property
    def compiled(self) -> bool:
        """Whether both graphs run Inductor's code now."""
        return all(r is not None and r.compiled is not None for r in (self.forward, self.backward))

    @property
    def recomputed_nodes(self) -> int:
        """Recomputations in the backward graph, the one Inductor compiles (0 before the trace)."""
        return self.backward.recomputed_nodes if self.backward is not None else 0
