"""Each strategy's options are one frozen dataclass (solver/options.py): its fields are exactly the
keyword options of the strategy's `solve`, each value is checked where the options are made, and a
misspelt option is an error naming the strategy's options, never dropped."""
import dataclasses
import inspect

import pytest

import remat
from remat.solver import STRATEGIES, get_options, get_solver
from remat.solver.options import OptionsError
from tests.models import small_gpt


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_options_fields_are_solves_keyword_options(strategy):
    params = list(inspect.signature(get_solver(strategy)).parameters.values())
    assert [p.name for p in params[:2]] == ["graph", "budget_bytes"]
    assert all(p.kind is not p.VAR_KEYWORD for p in params), "a **kwargs would drop misspelt options"
    options = get_options(strategy)
    assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen
    fields = {f.name: f.default for f in dataclasses.fields(options)}
    assert {p.name: p.default for p in params[2:]} == fields


@pytest.mark.parametrize("strategy, kwargs, match", [
    ("revolve", {"snapshot": 2}, r"takes no option snapshot \(its options: snapshots\)"),
    ("equal_spacing", {"k": 2}, r"takes no option k \(its options: none\)"),
    ("revolve", {"snapshots": -1}, r"snapshots must be >= 0"),
    ("chen_greedy", {"grid": 2.5}, r"grid must be an int"),
    ("per_block", {"containers": "h"}, r"containers must be module paths"),
    ("checkmate", {"milp": "sometimes"}, r"milp must be one of"),
    ("checkmate", {"backend": "gurobi"}, r"backend must be one of"),
    ("checkmate", {"certify": 1}, r"certify must be one of True, False"),
    ("checkmate", {"mip_gap": -0.1}, r"mip_gap must be >= 0"),
    ("checkmate", {"time_limit_s": 0}, r"time_limit_s must be > 0"),
])
def test_a_bad_option_is_refused_where_the_options_are_made(strategy, kwargs, match):
    with pytest.raises(OptionsError, match=match):
        get_options(strategy).make(strategy, kwargs)


def test_remat_solve_refuses_a_misspelt_option_before_solving():
    model, inputs = small_gpt(dropout=0.0)
    graph = remat.capture(model, inputs, quiet=True)
    with pytest.raises(remat.RematArgumentError, match=r"solver 'revolve' takes no option snapshot"):
        remat.solve(graph, 2**30, solver="revolve", snapshot=1)
    plan = remat.solve(graph, None, solver="revolve", snapshots=1)
    assert plan.details["snapshots"] == 1
