"""Which loss head a step is traced and planned with, read off its TrainingGraph: whether the
model's graph has a head the chunked op could take and whether it is worth a second trace, whether
the chunked head's graph may cost less than a plan already made, and which head a graph or a plan
has (remat/pipeline.py weighs the two heads under "auto"; remat/loss_head/ is the op and its router).
"""
from __future__ import annotations

from typing import Any

from remat.core.plan import Plan
from remat.core.training_graph import Node, TrainingGraph
from remat.solver.checkmate.peak_rows import peak_rows_search

__all__ = ["HEAD_SHARE", "HEAD_BUFFERS", "SMALLEST_SHARE", "routable_log_softmaxes", "head_worth_tracing",
           "head_may_lower_smallest", "may_cost_less", "has_chunked_head", "loss_head_of", "head_added", "plan_head"]

# "auto" traces the chunked head beside a plan that fits only where the model's head holds a
# log-softmax of at least this share of the budget: below it the second trace costs more than the
# head's bytes could save
HEAD_SHARE = 0.01
# Where no plan of the model's head fits, its chunked head is traced and searched for a smaller
# smallest budget only where it could give one: the chunked op holds none of the head's logits,
# log-softmax and their gradients (each at most the log-softmax's bytes, HEAD_BUFFERS of them), so
# it lowers the peak by at most that; under SMALLEST_SHARE of the budget (the lowest-peak search's
# resolution, solver/checkmate/peak_bisection.py PEAK_RESOLUTION) it cannot lower it at all.
# LayoutLMv3 for sequence classification (10 labels): its chunked head's search was half of 34 s.
HEAD_BUFFERS = 4
SMALLEST_SHARE = 1e-3


# what the router follows from a linear's logits to the loss (loss_head/router.py: casts, contiguous
# copies, indexing that keeps the vocabulary dim; views are no nodes of a TrainingGraph)
_HEAD_CHAIN_OPS = frozenset({"_to_copy", "clone", "index", "slice", "select", "_unsafe_view", "view", "reshape",
                             "alias", "expand", "squeeze", "unsqueeze"})
_LINEAR_OPS = frozenset({"mm", "addmm", "bmm", "linear", "matmul"})


def routable_log_softmaxes(graph: TrainingGraph) -> list[Node]:
    """The forward log-softmaxes of `graph` whose input a linear computed, through the ops the router
    follows: the only loss heads the router can take. A head whose logits come otherwise (BART's
    added final_logits_bias, Gemma-2's soft-capping, a segmentation model's upsampled convolution)
    is not routed, so its chunked trace would be the model's own step again."""
    by_name = {n.name: n for n in graph.nodes}

    def from_linear(node: Node) -> bool:
        todo, seen = list(node.inputs), set()
        while todo:
            name = todo.pop()
            if name in seen or name not in by_name:
                continue
            seen.add(name)
            op = by_name[name].op.split(".")[0]
            if op in _LINEAR_OPS:
                return True
            if op in _HEAD_CHAIN_OPS:
                todo.extend(by_name[name].inputs)
        return False

    return [n for n in graph.nodes if not n.is_backward and n.op.startswith("_log_softmax") and from_linear(n)]


def _largest_head_bytes(graph: TrainingGraph) -> int:
    """The bytes of the largest log-softmax the router can take in `graph` (0: none)."""
    return max((n.out_bytes for n in routable_log_softmaxes(graph)), default=0)


def head_worth_tracing(graph: TrainingGraph, budget: int) -> bool:
    """Whether `graph` (the model's head) has a cross-entropy the router can take whose log-softmax is
    big enough (HEAD_SHARE of the budget) for the chunked head to be worth a second trace."""
    largest = _largest_head_bytes(graph)
    return largest > 0 and largest >= HEAD_SHARE * budget


def head_may_lower_smallest(graph: TrainingGraph, budget: int) -> bool:
    """Whether `graph` (the model's head) has a head the router can take whose chunked trace could
    have a smaller smallest feasible budget by more than SMALLEST_SHARE of `budget` (see HEAD_BUFFERS)."""
    largest = _largest_head_bytes(graph)
    return largest > 0 and HEAD_BUFFERS * largest >= SMALLEST_SHARE * budget


def may_cost_less(graph: TrainingGraph, budget: int, total: float) -> bool:
    """Whether a plan of `graph` under `budget` may cost less than `total` (the graph's cost plus its
    recomputations): the rows' proven bound on its recomputations leaves room for that (the bound of
    the schedules in the graph's order, the scope of checkmate's own; no plans made: on a 2-layer LSTM
    of 3,989 nodes the rows' search with its plans took 99 s)."""
    room = total - graph.total_cost
    return room > 0 and peak_rows_search(graph, budget, incumbent=room, bound_only=True).bound < room


def has_chunked_head(graph: TrainingGraph) -> bool:
    """Whether the loss head of `graph` is remat's chunked op (the router routed one)."""
    return any(n.op.startswith("chunked_linear_cross_entropy") for n in graph.nodes)


def loss_head_of(graph: TrainingGraph) -> str:
    """The loss head a traced graph has, as plans record it: "chunked" or "unchunked"."""
    return "chunked" if has_chunked_head(graph) else "unchunked"


def head_added(chunked: TrainingGraph, plain: TrainingGraph) -> dict[str, Any]:
    """What the chunked head's graph adds to the model's own: FLOPs, and cost in the cost model's
    units (the plan's extra cost counts only its recomputations), as details for reports."""
    return {"loss_head_flops": sum(n.flops for n in chunked.nodes) - sum(n.flops for n in plain.nodes),
            "loss_head_cost": chunked.total_cost - plain.total_cost}


def plan_head(plan: Plan) -> str:
    """The loss head a plan was made for: "chunked" or "unchunked" (plans made before the
    option existed: unchunked)."""
    return plan.context.get("loss_head") or plan.details.get("loss_head") or "unchunked"
