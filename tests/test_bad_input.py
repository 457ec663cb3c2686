"""Bad inputs to the API and to Plan.load: one clear error naming the argument, raised before
anything is traced or solved (the model's forward here raises if it is ever called)."""
from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import torch
import torch.nn as nn

import remat
from remat.validate import budget_in_bytes as _budget
from remat.default_model import GPTConfig
from remat.core.plan import Plan, PlanFileError
from remat.validate import RematArgumentError, RematArgumentTypeError
from tests.conftest import training_chain


class Untouchable(nn.Module):
    """Any tracing would call forward: it must never happen for bad arguments."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        raise AssertionError("remat traced the model before checking its arguments")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).pow(2).mean()


X = torch.randn(2, 4)
NAN, INF = float("nan"), float("inf")

# (keyword arguments of optimize, error type, text the message must hold)
OPTIMIZE_CASES = [
    (dict(budget_gb=NAN), RematArgumentError, "budget_gb must be a finite positive number, got nan"),
    (dict(budget_gb=INF), RematArgumentError, "budget_gb must be a finite positive number, got inf"),
    (dict(budget_gb=-INF), RematArgumentError, "budget_gb must be a finite positive number"),
    (dict(budget_gb="40"), RematArgumentTypeError, "budget_gb must be a number, got str '40'"),
    (dict(budget_gb=True), RematArgumentTypeError, "budget_gb must be a number, got bool"),
    (dict(budget_gb=-1), RematArgumentError, "budget_gb must be positive, got -1"),
    (dict(budget_gb=0), RematArgumentError, "budget_gb must be positive"),
    (dict(budget_gb=1e-12), RematArgumentError, "less than one byte; the budget must be positive"),
    (dict(budget_gb=[40]), RematArgumentTypeError, "budget_gb must be a number, got list"),
    (dict(budget_gb=1e300), RematArgumentError, "budget_gb=1e+300 is too large to count in bytes"),
    (dict(budget_bytes=12.5), RematArgumentError, "budget_bytes must be a whole number of bytes, got 12.5"),
    (dict(budget_bytes=NAN), RematArgumentError, "budget_bytes must be a finite positive number"),
    (dict(budget_bytes=INF), RematArgumentError, "budget_bytes must be a finite positive number"),
    (dict(budget_bytes="1000000"), RematArgumentTypeError, "budget_bytes must be a number, got str"),
    (dict(budget_bytes=False), RematArgumentTypeError, "budget_bytes must be a number, got bool"),
    (dict(budget_bytes=0), RematArgumentError, "budget_bytes must be positive, got 0"),
    (dict(budget_bytes=-5.0), RematArgumentError, "budget_bytes must be positive"),
    (dict(budget_gb=1, budget_bytes=10**9), RematArgumentError, "give budget_gb or budget_bytes, not both"),
    (dict(), RematArgumentError, "give budget_gb or budget_bytes (or a saved plan=, or solver='keep_all')"),
    (dict(budget_gb=1, solver="magic"), RematArgumentError, "unknown solver 'magic'; choose one of"),
    (dict(budget_gb=1, solver=None), RematArgumentTypeError, "solver must be a string"),
    (dict(budget_gb=1, time_limit_s=0), RematArgumentError, "time_limit_s must be a positive number of seconds"),
    (dict(budget_gb=1, time_limit_s=-3), RematArgumentError, "time_limit_s must be a positive number of seconds"),
    (dict(budget_gb=1, time_limit_s=NAN), RematArgumentError, "time_limit_s must be a finite positive number"),
    (dict(budget_gb=1, time_limit_s="60"), RematArgumentTypeError, "time_limit_s must be a number, got str"),
    (dict(budget_gb=1, fused_attention="yes"), RematArgumentError, "fused_attention must be True, False, 'exact'"),
    (dict(budget_gb=1, fused_attention=1), RematArgumentError, "fused_attention must be True, False, 'exact'"),
    (dict(budget_gb=1, fused_attention=None), RematArgumentError, "fused_attention must be True, False, 'exact'"),
    (dict(budget_gb=1, example_kwargs=[1]), RematArgumentTypeError, "example_kwargs must be a dict"),
    (dict(budget_gb=1, example_kwargs={1: X}), RematArgumentTypeError, "example_kwargs' keys must be argument names"),
    (dict(budget_gb=1, plan=42), RematArgumentTypeError, "plan must be a remat.Plan or the path of a saved plan"),
    (dict(budget_gb=1, time_limit=5), RematArgumentError, "solver 'checkmate' takes no option time_limit"),
    (dict(budget_gb=1, solver="keep_all", coarsen_to=10), RematArgumentError,
     "solver 'keep_all' takes no option coarsen_to"),
]


def _case_id(kwargs: dict) -> str:
    """The case's arguments, a tensor written as its name: ids must not change between collections
    (pytest-xdist collects once per worker)."""
    return repr(kwargs).replace(repr(X), "X")


@pytest.mark.parametrize("kwargs,error,message", OPTIMIZE_CASES, ids=[_case_id(k) for k, _, _ in OPTIMIZE_CASES])
def test_optimize_refuses_bad_arguments_before_tracing(kwargs, error, message):
    t0 = time.perf_counter()
    with pytest.raises(error) as e:
        remat.optimize(Untouchable(), example_inputs=(X,), **kwargs)
    assert time.perf_counter() - t0 < 2.0  # a check, not a trace (Untouchable proves none ran)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)  # RematArgumentTypeError is a ValueError and a TypeError


@pytest.mark.parametrize("example_inputs,error,message", [
    (None, RematArgumentError, "example_inputs is required"),
    ("x", RematArgumentTypeError, "example_inputs must be a tensor or a tuple of arguments, got str"),
    ({"x": X}, RematArgumentTypeError, "example_inputs must be a tensor or a tuple of arguments, got dict"),
])
def test_bad_example_inputs(example_inputs, error, message):
    with pytest.raises(error, match=message):
        remat.optimize(Untouchable(), budget_gb=1, example_inputs=example_inputs)
    with pytest.raises(error, match=message):
        remat.capture(Untouchable(), example_inputs)


@pytest.mark.parametrize("model", ["model", None, lambda x: x, torch.randn(3)], ids=["str", "None", "fn", "tensor"])
def test_model_must_be_a_module(model):
    with pytest.raises(RematArgumentTypeError, match="model must be a torch.nn.Module, got"):
        remat.optimize(model, budget_gb=1, example_inputs=(X,))
    with pytest.raises(RematArgumentTypeError, match="model must be a torch.nn.Module, got"):
        remat.capture(model, (X,))


def test_capture_refuses_bad_fused_attention_and_kwargs():
    with pytest.raises(RematArgumentError, match="fused_attention must be"):
        remat.capture(Untouchable(), (X,), fused_attention="sometimes")
    with pytest.raises(RematArgumentTypeError, match="example_kwargs must be a dict"):
        remat.capture(Untouchable(), (X,), example_kwargs=(("a", 1),))


@pytest.mark.parametrize("budget,args,error,message", [
    (NAN, {}, RematArgumentError, "budget_bytes must be a finite positive number, got nan"),
    (INF, {}, RematArgumentError, "budget_bytes must be a finite positive number, got inf"),
    ("100", {}, RematArgumentTypeError, "budget_bytes must be a number, got str"),
    (12.5, {}, RematArgumentError, "budget_bytes must be a whole number of bytes"),
    (0, {}, RematArgumentError, "budget_bytes must be positive"),
    (100, dict(solver="magic"), RematArgumentError, "unknown solver 'magic'"),
    (100, dict(time_limit_s=INF), RematArgumentError, "time_limit_s must be a finite positive number"),
    (100, dict(time_limit_s=0.0), RematArgumentError, "time_limit_s must be a positive number of seconds"),
    (100, dict(solver="equal_spacing", k=3), RematArgumentError, "solver 'equal_spacing' takes no option k"),
])
def test_solve_refuses_bad_arguments(budget, args, error, message):
    g = training_chain(6)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        remat.solve(g, budget, **args)


def test_solve_wants_a_graph():
    with pytest.raises(RematArgumentTypeError, match="graph must be a TrainingGraph"):
        remat.solve(Untouchable(), 100)


def test_budget_conversion():
    assert _budget(None, None) is None
    b = _budget(None, 12.5e6)  # an integral float: 12500000 bytes, as an int (once a TypeError in >>)
    assert b == 12_500_000 and type(b) is int
    assert _budget(2.5, None) == 2_500_000_000 and type(_budget(2.5, None)) is int
    import numpy as np

    assert _budget(None, np.int64(4096)) == 4096 and type(_budget(None, np.int64(4096))) is int
    assert _budget(np.float32(0.5), None) == 500_000_000


def test_integral_float_budget_bytes_optimizes():
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(4, 8)
    opt = remat.optimize(model, budget_bytes=float(2**40), example_inputs=(x,), solver="keep_all")
    assert opt.plan.budget_bytes == 2**40 and type(opt.plan.budget_bytes) is int
    loss = opt(x)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    model(x).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))


# ---- Plan files ----------------------------------------------------------------------------

def _plan() -> Plan:
    return Plan(strategy="equal_spacing", budget_bytes=1000, schedule=["a", "b", "a"], predicted_peak_bytes=900,
                total_cost=10.0, extra_cost=1.5, extra_flops=7, status="heuristic", solve_time_s=0.1,
                gap=None, graph_fingerprint="abc", details={"k": 2})


def test_plan_round_trip_and_atomic_save(tmp_path):
    p = tmp_path / "plan.json"
    _plan().save(p)
    assert Plan.load(p) == _plan()
    assert Plan.load(str(p)) == _plan()
    assert os.listdir(tmp_path) == ["plan.json"]


def test_a_failed_save_leaves_the_old_plan_whole(tmp_path, monkeypatch):
    p = tmp_path / "plan.json"
    _plan().save(p)
    before = p.read_text()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    other = dataclasses.replace(_plan(), schedule=["x"] * 1000)
    with pytest.raises(OSError, match="No space left"):
        other.save(p)
    assert p.read_text() == before and Plan.load(p) == _plan()
    assert os.listdir(tmp_path) == ["plan.json"]  # the temporary file is gone too


def test_missing_plan_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(PlanFileError, match=r"plan file '.*nope\.json' does not exist"):
        Plan.load(path)
    with pytest.raises(FileNotFoundError):  # what it raised before, still true
        Plan.load(path)


def test_plan_file_is_a_directory(tmp_path):
    with pytest.raises(PlanFileError, match="is a directory"):
        Plan.load(tmp_path)


def _good_json() -> dict:
    return json.loads(_plan().to_json())


@pytest.mark.parametrize("text,message", [
    ("", "is empty: not a saved plan"),
    ("  \n", "is empty: not a saved plan"),
    (_plan().to_json()[:40], "is not valid JSON"),
    (_plan().to_json()[:-1], "is not valid JSON"),
    ("plan", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not a plan"),
    ("null", "holds a JSON NoneType, not a plan"),
    (json.dumps({"strategy": "x"}), "is not a plan: it lacks budget_bytes, schedule"),
    (json.dumps({**_good_json(), "favourite": 3}), "fields this version of remat does not know: favourite"),
    (json.dumps({**_good_json(), "schedule": "abc"}), "schedule must be a list of node names"),
    (json.dumps({**_good_json(), "schedule": [1, 2]}), "schedule must be a list of node names"),
    (json.dumps({**_good_json(), "budget_bytes": "1000"}), "budget_bytes must be a non-negative integer or null"),
    (json.dumps({**_good_json(), "budget_bytes": 1.5}), "budget_bytes must be a non-negative integer or null"),
    (json.dumps({**_good_json(), "predicted_peak_bytes": None}), "predicted_peak_bytes must be a non-negative"),
    (json.dumps({**_good_json(), "total_cost": "NaN"}), "total_cost must be a finite number"),
    (json.dumps({**_good_json(), "details": []}), "details must be an object"),
])
def test_bad_plan_files(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PlanFileError) as e:
        Plan.load(path)
    assert message in str(e.value)
    assert "bad.json" in str(e.value)  # names the file
    assert isinstance(e.value, ValueError)


def test_binary_plan_file(tmp_path):
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PlanFileError, match="bin.json"):
        Plan.load(path)


# ---- the default model's config ------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(n_embd=64, n_head=3), "GPTConfig.n_embd (64) must be divisible by n_head (3)"),
    (dict(n_embd=30, n_head=10), "the head dimension n_embd / n_head = 3 must be even"),
    (dict(n_layer=0), "GPTConfig.n_layer must be at least 1, got 0"),
    (dict(batch_size=-1), "GPTConfig.batch_size must be at least 1"),
    (dict(dropout=1.0), "GPTConfig.dropout must be in [0, 1), got 1.0"),
    (dict(dropout=NAN), "GPTConfig.dropout must be in [0, 1), got nan"),
    (dict(attn_dropout=-0.5), "GPTConfig.attn_dropout must be in [0, 1)"),
    (dict(attention="flash"), "GPTConfig.attention must be 'explicit' or 'sdpa'"),
])
def test_gpt_config_checks_itself(kwargs, message):
    with pytest.raises(RematArgumentError) as e:
        GPTConfig(**kwargs)
    assert message in str(e.value)


def test_gpt_config_types():
    with pytest.raises(RematArgumentTypeError, match="GPTConfig.n_layer must be an integer, got float"):
        GPTConfig(n_layer=2.0)
    assert GPTConfig().n_embd == 128 and GPTConfig(attn_dropout=0.0).attn_dropout == 0.0
