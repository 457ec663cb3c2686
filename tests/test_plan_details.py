"""Every key a strategy writes into plan.details is one core/plan_details.py types and documents."""
from __future__ import annotations

import pytest

from remat.solver import checkmate, get_solver
from remat.core.plan import LOWEST_PEAK, PlanDetails
from remat.solver.revolve import NotAChainError
from remat.solver.schedule import keep_all_schedule
from remat.core.simulator import simulate
from tests.conftest import training_chain, transformer_like

KNOWN = set(PlanDetails.__annotations__)


@pytest.mark.parametrize("g", [transformer_like(1, 0, d=1 << 14), training_chain(8, 3)], ids=["transformer", "chain"])
def test_details_keys_are_typed(g):
    full = simulate(g, keep_all_schedule(g)).peak_bytes
    plans = []
    for name in ("keep_all", "equal_spacing", "chen_greedy", "per_block", "selective", "revolve", "checkmate"):
        for budget in (full, int(0.6 * full), LOWEST_PEAK):
            try:
                plans.append(get_solver(name)(g, budget))
            except NotAChainError:
                continue
    plans.append(checkmate.min_feasible_budget(g, return_plan=True)[1])
    plans.append(checkmate.solve(g, int(0.6 * full), milp="always", coarsen_to=20))
    unknown = {(p.strategy, k) for p in plans for k in p.details if k not in KNOWN}
    assert not unknown
