"""The small values the relaxation (solver/checkmate/relaxation.py) leaves out of its model on large graphs.

A value read by every layer (rotary positions, masks, norm statistics) is modelled by the
relaxation over every row it lives; such values are tiny beside the activations but many. Left
out, they count as live whenever read, holding no memory and never recomputed: every schedule is
still a point of the smaller model (drop a small value's recomputations, cost >= 0, and its bytes
from every row: no row gets more), so its optimum stays a lower bound, lower by at most what
their bytes would have freed.
"""
from __future__ import annotations

from remat.core.training_graph import TrainingGraph

__all__ = ["small_values", "SMALL_FROM_NODES", "SMALL_MIN_COUNT", "SMALL_RATIO", "SMALL_SHARE"]

# On graphs of SMALL_FROM_NODES nodes or more, the relaxation leaves out the forward values of at most
# SMALL_RATIO of the median forward value's bytes, smallest first, together at most SMALL_SHARE of the
# budget above the resident bytes (small_values): Gemma-2's rotary positions, masks and norm
# statistics (64 B-4 KB against 512 KB activations and a 27 MB room) are read by every layer and made
# 28% of its relaxation's variables. Smaller graphs keep every value: their LPs are fast, and any
# change of the LP moves its solution to another vertex and the plans read off it (the default GPT
# with one 2 KB value left out: 8.894% extra instead of 8.724%). For the same reason fewer than
# SMALL_MIN_COUNT small values are not left out: they save little (ResNet-50 has two, its fc output
# among them, and its plan at the smallest feasible budget cost 35.4% instead of 33.8% without them)
SMALL_FROM_NODES = 400
SMALL_MIN_COUNT = 16
SMALL_RATIO = 1 / 64
SMALL_SHARE = 0.002


def small_values(graph: TrainingGraph, budget: int, min_nodes: int | None = None) -> set[int]:
    """The recomputable forward values (indices) of at most SMALL_RATIO of the median forward value's
    bytes, smallest first, whose bytes add up to at most SMALL_SHARE of the budget above the resident
    bytes. The relaxation treats them as live whenever read and holding no memory: every schedule
    is still one of its points (drop a small value's recomputations, cost >= 0, and its bytes from
    every row: no row gets more), so its bound stays a bound, lower by at most what their bytes
    would have freed; the plans read off it never drop them (refining may). None on graphs of
    fewer than `min_nodes` nodes (None: SMALL_FROM_NODES), and none where fewer than
    SMALL_MIN_COUNT qualify."""
    if len(graph.nodes) < (SMALL_FROM_NODES if min_nodes is None else min_nodes):
        return set()
    values = sorted((v.out_bytes, u) for u, v in enumerate(graph.nodes) if v.recomputable and not v.is_backward)
    if not values:
        return set()
    cap = SMALL_RATIO * values[len(values) // 2][0]
    room = (budget - graph.resident_bytes) * SMALL_SHARE
    out, total = set(), 0
    for b, u in values:
        if b > cap or total + b > room:
            break
        total += b
        out.add(u)
    return out if len(out) >= SMALL_MIN_COUNT else set()
