"""per_block: keep each repeated block's inputs, recompute everything inside it.

Source: what `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` around every layer
of a model's repeated container (a ModuleList or Sequential of blocks: GPT's `h`, ResNet's
stages, MobileNet's `features`) does; the usual "activation checkpointing per transformer layer"
(e.g. Hugging Face's `gradient_checkpointing_enable`, FSDP's `apply_activation_checkpointing`).

What is implemented, exactly:

* **Blocks** come from the forward nodes' module paths (Node.module_path, e.g. "h.0.attn" is in
  block "h.0"). A *repeated container* is a module path P with at least two numbered children
  P.0, P.1, ... of which at least two have the same structure (the same sorted list of (relative
  module path, op) of their nodes): so GPT's `h` qualifies, a `Sequential(conv, bn, relu)` stem
  does not. Only the outermost repeated containers are used (the blocks of `h`, not the layers
  inside a block that is itself a Sequential). Every numbered child of a repeated container is a
  block; a node belongs to the block whose path prefixes its own. `containers=` names the
  containers instead (e.g. `containers=("h",)`).
* **What is kept**: every forward value computed outside all blocks (as eager autograd keeps
  it), and every value of a block that something outside that block reads (the block's outputs,
  which are the next blocks' inputs; for a U-Net also the skip connections a decoder block takes
  in). Everything else inside a block is recomputed in the backward, on demand from the kept
  values (schedule_from_kept).
* **Differences from torch.utils.checkpoint**, both from remat's runtime, not choices here:
  random values (dropout masks) are kept (1 byte per element) instead of replaying the RNG, and
  ops that update state (BatchNorm in training mode, whose running statistics are step outputs)
  are never recomputed (torch's checkpoint recomputes them and updates the running statistics a
  second time). The recomputation runs node by node just before the backward node that reads it,
  where torch's checkpoint re-runs the block's forward when its backward starts (stopping early
  once it has what it needs), so remat's peak can be lower than the eager checkpoint's.

The plan does not depend on the budget: it is returned with status "heuristic" when it fits and
"infeasible" when it does not (as keep_all). A graph without a repeated container gets the
keep-all plan (details["blocks"] == 0).
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from remat.core.training_graph import TrainingGraph
from remat.solver.options import OptionsError, StrategyOptions
from remat.core.plan import Plan, finished, plan_from_schedule
from remat.solver.schedule import schedule_from_kept

__all__ = ["Options", "solve", "find_blocks", "repeated_containers", "block_kept"]


def _numbered_child(path: str, prefix: str) -> str | None:
    """`prefix.k` when `path` is `prefix.k` or below it (k an integer; prefix "" is the model
    itself, a Sequential), else None."""
    if prefix and not path.startswith(prefix + "."):
        return None
    head = (path[len(prefix) + 1:] if prefix else path).split(".", 1)[0]
    if not head.isdigit():
        return None
    return f"{prefix}.{head}" if prefix else head


def repeated_containers(graph: TrainingGraph) -> list[str]:
    """The outermost module paths with at least two numbered children of the same structure."""
    paths = {n.module_path for n in graph.forward_nodes if n.module_path}
    prefixes = set()
    for p in paths:
        parts = p.split(".")
        for k, part in enumerate(parts):
            if part.isdigit():
                prefixes.add(".".join(parts[:k]))
    sig: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for n in graph.forward_nodes:
        for pre in prefixes:
            child = _numbered_child(n.module_path, pre)
            if child is not None:
                sig[pre][child].append((n.module_path[len(child):], n.op))
    repeated = []
    for pre, children in sig.items():
        shapes = [tuple(sorted(v)) for v in children.values()]
        if len(children) >= 2 and len(set(shapes)) < len(shapes):
            repeated.append(pre)
    return sorted(p for p in repeated
                  if not any(p != q and (q == "" or p.startswith(q + ".")) for q in repeated))


def find_blocks(graph: TrainingGraph, containers: Iterable[str] | None = None) -> dict[str, list[str]]:
    """Block path -> its forward nodes (topological order), for the numbered children of
    `containers` (default: repeated_containers(graph))."""
    conts = list(repeated_containers(graph) if containers is None else containers)
    blocks: dict[str, list[str]] = {}
    for n in graph.forward_nodes:
        for pre in conts:
            child = _numbered_child(n.module_path, pre)
            if child is not None:
                blocks.setdefault(child, []).append(n.name)
                break
    return blocks


def block_kept(graph: TrainingGraph, blocks: dict[str, list[str]]) -> list[str]:
    """Forward values kept for the backward: those outside every block, and those of a block that
    a forward node outside it reads."""
    owner = {name: b for b, names in blocks.items() for name in names}
    kept = []
    for n in graph.forward_nodes:
        b = owner.get(n.name)
        if b is None or any(not graph.node(u).is_backward and owner.get(u) != b for u in graph.users[n.name]):
            kept.append(n.name)
    return kept


@dataclass(frozen=True)
class Options(StrategyOptions):
    """containers: the repeated containers' module paths, e.g. ("h",) (None: found from the
    module paths)."""

    containers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        c = self.containers
        if c is not None and (isinstance(c, str) or not all(isinstance(x, str) for x in c)):
            raise OptionsError(f"containers must be module paths (a list of str) or None, got {c!r}")


def solve(graph: TrainingGraph, budget_bytes: int | None = None, *,
          containers: Iterable[str] | None = None) -> Plan:
    """Keep each block's inputs and outputs, recompute its inside (see the module docstring).
    containers: the repeated containers' module paths (default: found from the module paths).
    Status "heuristic" when the plan fits `budget_bytes` (or there is none), else "infeasible"."""
    t0 = time.perf_counter()
    conts = list(repeated_containers(graph) if containers is None else containers)
    blocks = find_blocks(graph, conts)
    kept = block_kept(graph, blocks)
    plan = plan_from_schedule(graph, schedule_from_kept(graph, kept), strategy="per_block",
                              budget_bytes=budget_bytes, status="heuristic",
                              details={"containers": conts, "blocks": len(blocks),
                                       "block_names": list(blocks), "kept": len(kept)})
    return finished(plan, t0)
