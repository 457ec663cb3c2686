"""selective: Megatron's selective activation recomputation, recompute the attention core only.

Source: V. Korthikanti, J. Casper, S. Lym, L. McAfee, M. Andersch, M. Shoeybi, B. Catanzaro,
"Reducing Activation Recomputation in Large Transformer Models", MLSys 2023 (arXiv:2205.05198,
2022), Section 5 ("Selective Activation Recomputation"): keep every activation the matmuls (and
the other cheap-to-store, expensive-to-recompute ops) need, and recompute only "the QK^T matrix
multiply, softmax, softmax dropout, and attention over V", whose s x s values take most of the
memory but little of the compute. In Megatron-LM this is `--recompute-granularity selective`
(`recompute_modules=["core_attn"]` in Megatron-Core), which checkpoints the core-attention module
taking q, k, v (and the mask) as inputs.

What is implemented, exactly:

* **The attention core** of an unfused attention is found from each softmax (ops `_softmax`,
  `softmax`, `_safe_softmax`; not `_log_softmax`) by op and module path: its score matmul is the
  nearest `bmm`/`matmul`/`baddbmm` ancestor in the softmax's module (path equal to or below the
  softmax's module path), its attention-over-V matmul the nearest such descendant; the core is
  every node on a path from the score matmul through the softmax to the AV matmul, both matmuls
  included: scores, scale, masking, softmax, the dropout's output, attention over V. A softmax
  with no matmul on either side (a classifier's) is not attention and is left alone. The inputs
  of the core (q, k, v, the mask) are kept, as Megatron's checkpoint saves them.
* **The core's output is kept**: Megatron's checkpoint returns the attention-over-V product and
  the output projection saves it as its input, so it is not dropped; the recomputation replays
  what the backward needs from q, k, v: the scores, scale, mask, softmax and the dropout's output
  (its mask replayed from the saved generator state, as Megatron replays the RNG state, where
  remat can: graph_capture/rng_replay.py; else kept, 1 byte per element). remat does not re-run the attention-over-V matmul itself, whose recomputed
  output nothing would read (torch's checkpoint re-runs it): the same memory as Megatron, one
  matmul less of recomputation.
* **Fused attention** (remat's `flash_attention` op, or PyTorch's `_scaled_dot_product_*`
  attention ops left unfused): the core is that one op, and its only value is its output (with
  the kernel's log-sum-exp), which is kept as above: nothing is recomputed. Its backward already
  recomputes the scores tile by tile, which is why Megatron-LM skips the core-attention
  checkpoint with `--use-flash-attn`.
* **Everything else** in the forward is kept; the core's values are recomputed on demand in the
  backward (schedule_from_kept).

The plan does not depend on the budget: status "heuristic" when it fits, "infeasible" when not (as
keep_all). A graph without attention gets the keep-all plan (details["cores"] == 0).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from remat.solver.options import StrategyOptions
from remat.core.training_graph import TrainingGraph
from remat.core.plan import Plan, finished, plan_from_schedule
from remat.solver.schedule import schedule_from_kept

__all__ = ["Options", "solve", "attention_cores", "core_outputs", "SOFTMAX_OPS", "MATMUL_OPS", "FUSED_ATTENTION_OPS"]

SOFTMAX_OPS = ("_softmax", "softmax", "_safe_softmax")
MATMUL_OPS = ("bmm", "matmul", "baddbmm")
FUSED_ATTENTION_OPS = ("flash_attention", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                       "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention")


def _base(op: str) -> str:
    """`aten` op name without its overload: "bmm.default" -> "bmm"."""
    return op.split(".", 1)[0]


def _within(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".") if module else True


def attention_cores(graph: TrainingGraph) -> list[list[str]]:
    """The attention cores of the forward graph (each a list of node names in topological order):
    for unfused attention the nodes from the score matmul through the softmax to the
    attention-over-V matmul, both included; a fused attention op on its own."""
    fwd = {n.name for n in graph.forward_nodes}
    cores: list[list[str]] = []
    order = graph.index
    for n in graph.forward_nodes:
        base = _base(n.op)
        if base in FUSED_ATTENTION_OPS:
            cores.append([n.name])
            continue
        if base not in SOFTMAX_OPS:
            continue
        mod = n.module_path
        # upwards: ancestors within the module, stopping at (and recording) matmuls
        up, stack, score = {n.name}, [n.name], set()
        while stack:
            for i in graph.node(stack.pop()).inputs:
                u = graph.node(i)
                if i in up or i not in fwd or not _within(u.module_path, mod):
                    continue
                up.add(i)
                if _base(u.op) in MATMUL_OPS:
                    score.add(i)
                else:
                    stack.append(i)
        # downwards: users within the module, stopping at matmuls
        down, stack, av = {n.name}, [n.name], set()
        while stack:
            for w in graph.users[stack.pop()]:
                u = graph.node(w)
                if w in down or w not in fwd or not _within(u.module_path, mod):
                    continue
                down.add(w)
                if _base(u.op) in MATMUL_OPS:
                    av.add(w)
                else:
                    stack.append(w)
        if not score or not av:
            continue  # not attention (e.g. a classifier's softmax)
        # keep the nodes on paths score -> softmax and softmax -> av
        from_score = _reach(graph, score, up, forward=True)
        to_av = _reach(graph, av, down, forward=False)
        core = (up & from_score) | (down & to_av)
        cores.append(sorted(core, key=order.__getitem__))
    return cores


def _reach(graph: TrainingGraph, start: set[str], within: set[str], forward: bool) -> set[str]:
    """Nodes of `within` reachable from `start` along edges (users if forward, else inputs)."""
    seen, stack = set(start), list(start)
    while stack:
        x = stack.pop()
        nxt = graph.users[x] if forward else graph.node(x).inputs
        for y in nxt:
            if y in within and y not in seen:
                seen.add(y)
                stack.append(y)
    return seen


def core_outputs(graph: TrainingGraph, core: list[str]) -> list[str]:
    """The values of `core` that Megatron keeps: its attention-over-V matmuls (those after the
    softmax), or the fused op itself."""
    if len(core) == 1:
        return list(core)
    soft = next(k for k, x in enumerate(core) if _base(graph.node(x).op) in SOFTMAX_OPS)
    return [x for x in core[soft + 1:] if _base(graph.node(x).op) in MATMUL_OPS]


@dataclass(frozen=True)
class Options(StrategyOptions):
    """selective takes no options (the attention cores are found in the graph)."""


def solve(graph: TrainingGraph, budget_bytes: int | None = None) -> Plan:
    """Keep every forward value except the attention cores' inner values (scores, scale, mask,
    softmax, dropout output), which are recomputed from q, k, v; the cores' outputs are kept (see
    the module docstring). Status "heuristic" when the plan fits `budget_bytes` (or there is none),
    else "infeasible"."""
    t0 = time.perf_counter()
    cores = attention_cores(graph)
    recompute = {x for c in cores for x in c if x not in core_outputs(graph, c)}
    kept = [n.name for n in graph.forward_nodes if n.name not in recompute]
    plan = plan_from_schedule(graph, schedule_from_kept(graph, kept), strategy="selective",
                              budget_bytes=budget_bytes, status="heuristic",
                              details={"cores": len(cores), "core_nodes": len(recompute),
                                       "fused_cores": sum(len(c) == 1 for c in cores)})
    return finished(plan, t0)
