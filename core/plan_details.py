"""The keys a Plan's `details` may hold, typed: what each strategy records about how it found its
plan. Every key is optional (a strategy fills in its own); at run time `details` is a plain dict,
saved in the plan file as JSON, so a reader written against these names reads old files too.
"""
from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["PlanDetails"]


class PlanDetails(TypedDict, total=False):
    """plan.details, key by key: every key optional, each filled in by the strategy named beside it."""

    # ---- checkmate (solver/checkmate/strategy.py): where the plan came from ---------------------------------
    schedule_source: str  # "milp", "relaxation", "equal_spacing", "fallback", "lowest_peak", ...
    refined_from: str  # the candidate the chosen schedule was refined from
    fine_nodes: int
    coarse_nodes: int  # the coarse MILP's graph size
    backend: str  # the MILP backend that answered ("highs", "cbc")
    backend_requested: str
    limits: dict[str, Any]  # the deterministic work limits (and time limit, if any) it ran under
    refined: dict[str, dict[str, float]]  # candidate -> {"extra_cost", "peak_bytes"} after refining
    bound_scope: str  # why lower_bound is 0 for a plan the relaxation does not cover
    warning: str
    reason: str  # why nothing better was found / why infeasible
    proof: str  # the proven statement behind an "infeasible" status
    fallback: dict[str, Any]  # {"reason", "candidates"} when a fallback answered; where the lowest-peak
    # search's plans answered, "answered_by": the one that did (lowest_peak.py cheapest_known_fit)
    # ---- checkmate: the rows over the budget (solver/checkmate/peak_rows.py) -------------------------------
    peak_rows: dict[str, Any]  # {"rows_over_budget", "solves": [each model's size, status, bound], "bound", "s"}
    bound_source: str  # what gave lower_bound: the rows' models, or which relaxation and its branch and bound, or none
    certify_skipped: str  # why the certified search did not run (a large graph or relaxation, no plan fits, near the floor)
    # ---- checkmate: the certified search (solver/checkmate/certified_search.py) -------------------------
    relaxation: dict[str, Any]  # {"variables", "rows", "dense", ...} of the relaxation's LP
    certify: dict[str, Any]  # {"root_bound", "bound", "lps", "iterations", "stopped_by", "s"}
    guided_plans: list[Any]  # the plans read off LP solutions
    # HiGHS's MILP of the relaxation, where the branch and bound stopped short of its gap on a small
    # relaxation: {"status", "nodes", "bound", "s"}
    relaxation_milp: dict[str, Any]
    # HiGHS's root node on a larger relaxation (its bound only), where the branch and bound stalled
    # with a gap over ROOT_CUTS_GAP: {"status", "reports", "bound", "s"}
    root_cuts: dict[str, Any]
    plan_source: str
    certified_s: float
    infeasible_row: str | None  # the node at which the relaxation proved the budget infeasible
    variables: Any
    constraints: Any
    # ---- checkmate: the coarse MILP (solver/checkmate/milp_model.py) -----------------------------------
    milp: str  # why it did not run
    milp_status: str
    milp_gap: float | None
    milp_s: float
    milp_plan: dict[str, float]  # the MILP's own plan before refining: {"extra_cost", "peak_bytes"}
    milp_peak_bytes: int
    milp_failed: bool
    milp_infeasible: bool
    milp_overshoot_bytes: int
    objective: float
    best_bound: float | None
    stopped_by: str | None
    unit_bytes: int
    build_s: float
    baseline: dict[str, Any]  # the baseline plan warm-starting the MILP
    attempts: list[dict[str, Any]]  # one entry per backend tried
    coarse_peak_bytes: int | None
    coarse_extra_cost: float
    equal_spacing: dict[str, Any]  # equal_spacing's plan at the same budget, for comparison
    # ---- the lowest peak (solver/checkmate/lowest_peak.py) --------------------------------------------
    lowest_peak: dict[str, Any]  # {"peak_bytes", "source"} of the lowest-peak plan
    lowest_peak_candidates: dict[str, int]  # candidate -> its peak
    peak_lower_bound: int  # proven: no schedule peaks below it
    peak_relieved_from: int  # the peak before solver/checkmate/peak_relief.py lowered it
    # ---- baselines ------------------------------------------------------------------------------
    k: int  # equal_spacing: every k-th articulation point kept
    checkpoints: int
    candidates: int
    threshold_bytes: int  # chen_greedy
    split_points: int
    split_sets_judged: int
    kept_bytes: int  # chen_greedy: bytes of the kept split points, and the largest segment's
    max_segment_bytes: int
    steps: int  # revolve: chain steps, snapshots, advances
    snapshots: int
    advances: int
    states: int  # the chain's states
    containers: list[str]  # per_block
    blocks: int
    block_names: list[str]
    kept: int  # the nodes kept
    cores: int  # selective
    core_nodes: int
    fused_cores: int  # attention cores that are one fused op
    # ---- the loss head (remat/pipeline.py) ------------------------------------------------------
    loss_head: str  # "chunked" (remat's chunked linear cross-entropy op) or "unchunked" (the model's own)
    loss_head_flops: int  # FLOPs the chunked head's graph adds to the model's (when both were traced)
    loss_head_cost: float  # the same in the cost model's units (a plan's extra_cost leaves it out)
    # ---- planning without the memory (remat/planning.py) ----------------------------------------
    estimated_workspaces: list[dict[str, Any]]
    buffers_without_data: list[str]
