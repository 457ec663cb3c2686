"""BatchNorm in training mode with a recomputable output, its statistics kept on their own.

AOTAutograd's joint graph holds a training BatchNorm as one op,

    bn = _native_batch_norm_legit_functional(x, w, b, running_mean, running_var, True, momentum, eps)
    out, save_mean, save_invstd, new_mean, new_var = bn[0], ..., bn[4]

whose new running statistics are step outputs (the buffers' new values). build.py groups an op
with every storage it allocates, so the big normalised `out` shared a node with step outputs and
could never be recomputed: a plan that recomputes what follows a BatchNorm had to keep `out`.
The rewrite splits the op into two ops, so into two TrainingGraph nodes:

    out = remat::batch_norm(x, w, b, running_mean, running_var, momentum, eps, recompute=False,
                            stats_dtype=running_mean.dtype)
    save_mean, save_invstd, new_mean, new_var = remat::batch_norm_stats(out, running_mean, running_var)

`remat::batch_norm` owns `out` and nothing the step returns: it is recomputable. Its first
computation runs the graph's own kernel (`_native_batch_norm_legit_functional`, so `out` and the
statistics are eager's bit for bit) and attaches the four small statistics to the `out` tensor it
returns; `remat::batch_norm_stats`, right after it in the graph, takes them off that tensor and
returns them (it allocates nothing). It is never recomputed (it owns step outputs), so the running
statistics are written once, from the first computation.

The runtime emits every recomputation with recompute=True and no running statistics
(runtime/partition.py, `recomputation_args`): the buffers are updated in place after the forward,
and a backward that read them would fail autograd's version check. A recomputation runs the
kernel the functional one wraps (`_native_batch_norm_legit`) on the same `x`, updating two fresh
buffers of the running statistics' dtype where the functional kernel clones the running ones: the
same kernel, so `out` is bit-identical (in training mode it never depends on the running
statistics), and the same allocations in the same order, so one probed workspace (which counts
the statistics the first computation holds at its peak, graph_capture/workspace.py) is exact for
both; a recomputation frees its statistics on return and never touches the model's buffers
(checked by tests/test_bn_replay.py).

Pairing: the statistics travel on the very `out` tensor their op must read, so the stats op can
never take another BatchNorm's statistics; an `out` that carries none (a recomputation's, or a
tensor a compiler copied) raises BatchNormOrderError, as does a second take. A tensor never taken
from (a probe's) frees its statistics with itself. Under Inductor both ops run as fallback kernels,
but Inductor may hand the stats op a copy of `out` (on MobileNet a fused kernel wrote one for a
channels-last conversion): a graph holding the stats op keeps its fx code under torch.compile
(runtime/compile.py, tests/test_compile_compat.py). The memory model assumes the stats node runs right after its
output's first computation, as every schedule does that the graph's order and the solvers made
in tests/test_bn_replay.py (a schedule putting steps between them would hold the statistics
earlier than simulated: a few hundred bytes, which the measured peak would show).

Only on the CPU for now: the same kernels should make a CUDA recomputation bit-identical too, and
its memory exact, but neither is tested without a GPU (cuDNN's batch norm also saves a reserve
buffer); there the graph is left as it is and `out` is kept.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from remat.core.errors import RematError
from remat.graph_capture.light_ops import light_op

__all__ = ["make_batch_norm_recomputable", "batch_norm", "batch_norm_stats", "is_recomputable_batch_norm",
           "recomputation_args", "BatchNormOrderError", "BATCH_NORM_OP", "BATCH_NORM_STATS_OP"]

aten = torch.ops.aten
BATCH_NORM_OP = "batch_norm.default"  # the TrainingGraph op names of the two nodes (build.py names ops so)
BATCH_NORM_STATS_OP = "batch_norm_stats.default"
_STASH = "_remat_bn_stats"  # attribute of a first computation's `out` holding its statistics


class BatchNormOrderError(RematError, RuntimeError):
    """A BatchNorm's statistics were asked of a tensor that is not the first computation of its
    output (ops ran out of the graph's order, or a compiler passed a copy)."""


@light_op("batch_norm", "(Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean, Tensor? running_var, "
                        "float momentum, float eps, bool recompute, ScalarType stats_dtype) -> Tensor")
def batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float, eps: float,
               recompute: bool, stats_dtype: torch.dtype) -> torch.Tensor:
    """BatchNorm's normalised output in training mode. The first computation (recompute=False)
    runs the functional kernel and attaches its other four outputs to `out` for
    remat::batch_norm_stats. A recomputation (running_mean/var None: the runtime does not hand it
    the buffers, which the forward has since updated in place) runs the same kernel on two fresh
    buffers of `stats_dtype` where the functional kernel clones the running ones (the same
    allocations in the same order) and drops its statistics."""
    if not recompute:
        out, *stats = aten._native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, True,
                                                               momentum, eps)
        setattr(out, _STASH, (out.data_ptr(), tuple(stats)))
        return out
    c = x.shape[1]
    mean = torch.empty(c, dtype=stats_dtype, device=x.device)
    var = torch.empty(c, dtype=stats_dtype, device=x.device)
    return aten._native_batch_norm_legit.default(x, weight, bias, mean, var, True, momentum, eps)[0]


@batch_norm.register_fake
def _(x, weight, bias, running_mean, running_var, momentum, eps, recompute, stats_dtype):
    if running_mean is None or running_var is None:
        return aten._native_batch_norm_legit.no_stats(x, weight, bias, True, momentum, eps)[0]
    return aten._native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, True,
                                                    momentum, eps)[0]


def recomputation_args(args: tuple) -> tuple:
    """A remat::batch_norm's arguments for its recomputation: recompute=True, and no running
    statistics (the buffers need not be saved for the backward; their values do not change `out`)."""
    x, w, b, _, _, momentum, eps, _, stats_dtype = args
    return (x, w, b, None, None, momentum, eps, True, stats_dtype)


@light_op("batch_norm_stats", "(Tensor out, Tensor running_mean, Tensor running_var) -> (Tensor, Tensor, Tensor, Tensor)")
def batch_norm_stats(out: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(save_mean, save_invstd, new running_mean, new running_var) of the first computation of
    `out` (remat::batch_norm with recompute=False), taken off it: no allocation."""
    held = getattr(out, _STASH, None)
    if held is None or held[0] != out.data_ptr():
        raise BatchNormOrderError("remat: BatchNorm statistics asked of a tensor that is not the first computation "
                                  "of its output (ops ran out of the graph's order, or a copy was passed); refusing "
                                  "rather than return statistics of another computation")
    delattr(out, _STASH)
    return held[1]


@batch_norm_stats.register_fake
def _(out, running_mean, running_var):
    _, *stats = aten._native_batch_norm_legit_functional(out, None, None, running_mean, running_var, True, 0.1, 1e-5)
    return tuple(stats)


def is_recomputable_batch_norm(n: fx.Node) -> bool:
    """Whether `n` is a remat::batch_norm (a recomputation of it must be emitted with recompute=True)."""
    return n.op == "call_function" and n.target is torch.ops.remat.batch_norm.default


def _rewritable(n: fx.Node) -> bool:
    """A forward training BatchNorm with running statistics, plain float constants and only
    getitem readers."""
    if n.op != "call_function" or n.target is not aten._native_batch_norm_legit_functional.default:
        return False
    if n.meta.get("partitioner_tag") == "is_backward" or n.kwargs or len(n.args) != 8:
        return False
    x, _, _, rm, rv, training, momentum, eps = n.args
    if training is not True or not all(isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                                       for a in (x, rm, rv)):
        return False
    if not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in (momentum, eps)):
        return False
    val = n.meta.get("val")
    if not isinstance(val, (list, tuple)) or len(val) != 5:
        return False
    return all(u.target is operator.getitem and isinstance(u.args[1], int) for u in n.users)


def make_batch_norm_recomputable(gm: fx.GraphModule, device_type: str) -> int:
    """Rewrite every forward `_native_batch_norm_legit_functional(..., True, ...)` of the joint
    graph as remat::batch_norm + remat::batch_norm_stats (module docstring), when the step runs
    on `device_type` "cpu". Returns how many were rewritten."""
    if device_type != "cpu":
        return 0
    g = gm.graph
    count = 0
    for n in list(g.nodes):
        if not _rewritable(n):
            continue
        x, w, b, rm, rv, _, momentum, eps = n.args
        val = n.meta["val"]
        base = {k: v for k, v in n.meta.items() if k != "val"}
        with g.inserting_before(n):
            out = g.call_function(torch.ops.remat.batch_norm.default,
                                  (x, w, b, rm, rv, float(momentum), float(eps), False, rm.meta["val"].dtype))
            out.meta = {**base, "val": val[0]}
            stats = g.call_function(torch.ops.remat.batch_norm_stats.default, (out, rm, rv))
            stats.meta = {**base, "val": tuple(val[1:])}
        for u in list(n.users):
            i = u.args[1]
            if i == 0:
                u.replace_all_uses_with(out)
                g.erase_node(u)
            else:
                u.args = (stats, i - 1)
        g.erase_node(n)
        count += 1
    if count:
        g.lint()
        gm.recompile()
    return count
