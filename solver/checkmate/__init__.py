"""checkmate: the optimal strategy. Plans under a budget at the least extra compute, with a proven
lower bound on what any plan must recompute.

`solve(graph, budget_bytes)` runs named stages as plain calls (strategy.py):
  1. candidates (candidates.py): equal_spacing's, chen_greedy's and revolve's plans, and, where its
     gate lets it run (milp.py: coarse graphs of at most 64 nodes unless milp="always"),
     Checkmate's MILP (Jain et al. 2020) on the coarsened graph (milp_model.py, milp_stages.py,
     solved on the backends in turn by milp_attempts.py and backends.py), each refined on the
     fine graph (solver/refine.py);
  2. certify (certify.py): the bound and plans of the rows over the budget (peak_rows.py): for
     each step that keeping everything puts over the budget, a small model of what any plan must
     recompute to fit there (row_models.py), alone and a few together; when the best plan is
     within `mip_gap` of it, that is the proof;
     otherwise the certified search on the fine graph (certified_search.py): a relaxation of the
     problem (relaxation.py, relaxation_rows.py, solved on HiGHS by sparse_lp.py) whose LP is
     branched on (branch_and_bound.py), each LP solution turned into plans (guided.py,
     exchange.py), until the best plan is within `mip_gap` of the bound (bounds.py) or a
     deterministic work limit is spent; the bound is the larger of the two;
  3. choose (choose.py): the cheapest plan that fits, or the lowest-peak fallback;
  4. plan: plan.lower_bound (proven: no schedule whose first computations follow the graph's
     order fits the budget at a lower extra cost), plan.gap = (extra cost - lower bound) / extra
     cost, and status "optimal" when the gap is within mip_gap, "feasible" otherwise,
     "infeasible" when nothing fits (details["reason"] says whether that is proven).
`min_feasible_budget` is the peak of the lowest-peak plan known (lowest_peak.py, its peak lowered
by local moves in peak_relief.py), with a proven lower bound on any plan's peak in its details.

`solve` never raises for a solver failure and never calls a budget infeasible that
min_feasible_budget (same options) reported feasible: its lowest-peak plan is the last fallback.
The coarse MILP alone is the strategy `checkmate_milp` (milp.py).
"""
from remat.solver.checkmate.lowest_peak import min_feasible_budget
from remat.solver.checkmate.milp import MILP_MAX_COARSE_NODES
from remat.solver.checkmate.milp_attempts import MIN_NODES, NODE_WORK, SolverFallbackWarning, node_limit
from remat.solver.checkmate.milp_stages import DEFAULT_COARSEN_TO
from remat.solver.checkmate.strategy import Options, solve

__all__ = ["Options", "solve", "min_feasible_budget", "node_limit", "SolverFallbackWarning", "DEFAULT_COARSEN_TO",
           "NODE_WORK", "MIN_NODES", "MILP_MAX_COARSE_NODES"]
