"""equal_spacing: Chen et al.'s sqrt(n) checkpointing on the forward graph.

Candidates are the articulation points of the (undirected) forward graph: values that separate
the graph, such as the residual stream between blocks. Every k-th candidate is kept; everything
else the backward needs is recomputed on demand from the nearest kept values. We try every k and
return the cheapest plan that fits the budget (Chen's sqrt(n) is one of the k tried).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import networkx as nx

from remat.solver.options import StrategyOptions
from remat.core.training_graph import TrainingGraph
from remat.core.plan import Plan, finished, plan_from_schedule
from remat.solver.schedule import cheapest_fitting, schedule_from_kept

__all__ = ["Options", "solve", "checkpoint_candidates"]


def checkpoint_candidates(graph: TrainingGraph) -> list[str]:
    """Articulation points of the forward graph, in topological order."""
    fwd = [n for n in graph.forward_nodes]
    names = {n.name for n in fwd}
    g = nx.Graph()
    g.add_nodes_from(names)
    g.add_edges_from((i, n.name) for n in fwd for i in n.inputs if i in names)
    points = set(nx.articulation_points(g))
    return [n.name for n in fwd if n.name in points and n.recomputable]


@dataclass(frozen=True)
class Options(StrategyOptions):
    """equal_spacing takes no options (it tries every spacing k)."""


def solve(graph: TrainingGraph, budget_bytes: int | None = None) -> Plan:
    """The cheapest plan over every k (keep every k-th candidate) that fits `budget_bytes`; when
    none fits, the lowest-peak one, with status "infeasible"."""
    t0 = time.perf_counter()
    cands = checkpoint_candidates(graph)
    plans = []
    for k in range(1, len(cands) + 2):  # k = len+1 keeps no candidate at all
        kept = cands[k - 1::k]
        plans.append(plan_from_schedule(graph, schedule_from_kept(graph, kept), strategy="equal_spacing",
                                        budget_bytes=budget_bytes, status="heuristic",
                                        details={"k": k, "checkpoints": len(kept), "candidates": len(cands)}))
    return finished(cheapest_fitting(plans), t0)
