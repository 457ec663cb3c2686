"""Solve once, deploy later, for the user's own model (issue #10): `remat solve`, `remat check` and a
deployment each in a fresh process, on a model file written into a temporary folder; fingerprints
stable across processes and different for another shape, dtype or layer; every bad plan file and
every plan for something else refused with one line; `remat inspect` and `remat max-batch`.

Tiny models and equal_spacing (the solver does not matter here) keep this file well under a minute.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import remat
import remat.cli as cli
from remat.deployment import rejudge
from remat.core.plan import PlanMismatchError
from remat.core.plan import Plan
from tests.conftest import transformer_like

MODEL = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self, width=128, depth=4, act=nn.GELU):
            super().__init__()
            self.inp = nn.Linear(32, width)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), act(), nn.Dropout(0.1))
                                        for _ in range(depth))
            self.out = nn.Linear(width, 10)

        def forward(self, x, y):
            h = self.inp(x)
            for b in self.blocks:
                h = h + b(h)
            return F.cross_entropy(self.out(h), y)

    def build_model():
        torch.manual_seed(0)
        return Net()

    def build_relu_model():
        torch.manual_seed(0)
        return Net(act=nn.ReLU)

    def build_wider_model():
        torch.manual_seed(0)
        return Net(width=160)

    def example_batch(batch_size=512):
        g = torch.Generator().manual_seed(1)
        return torch.randn(batch_size, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g)

    def no_batch():
        return example_batch(512)
''')

# the third process: deploys the plan file with remat.optimize(plan=path), as a training script would
DEPLOY = textwrap.dedent('''
    import json, sys, torch, remat
    from tinymodel import build_model, example_batch
    model, (x, y) = build_model(), example_batch()
    opt = remat.optimize(model, example_inputs=(x, y), plan=sys.argv[1])
    params = list(model.parameters())
    torch.manual_seed(0)
    model(x, y).backward()
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    peak = remat.measure_peak(lambda: opt(x, y).backward(), resident=[model, x, y])
    for p in params:
        p.grad = None
    torch.manual_seed(0)
    opt(x, y).backward()
    print(json.dumps({"fingerprint": opt.graph.fingerprint(), "measured": peak, "budget": opt.plan.budget_bytes,
                      "predicted": opt.plan.predicted_peak_bytes, "budget_of_file": remat.load_plan(sys.argv[1]).budget_bytes,
                      "grads_equal": all(torch.equal(p.grad, r) for p, r in zip(params, ref))}))
''')

BOOM = textwrap.dedent('''
    def build():
        raise AssertionError("the model was built before the arguments were checked")

    def batch(batch_size=4):
        raise AssertionError("the inputs were built before the arguments were checked")

    def no_batch():
        raise AssertionError("the inputs were built before the arguments were checked")
''')


def _start(args: list[str], cwd, seed: int) -> subprocess.Popen:
    """A fresh process, with its own hash seed (fingerprints must not depend on set order)."""
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    """solve, check and deploy, each in a fresh process (on fake tensors, then real ones)."""
    d = tmp_path_factory.mktemp("offline")
    (d / "tinymodel.py").write_text(MODEL)
    (d / "deploy.py").write_text(DEPLOY)
    (d / "boom.py").write_text(BOOM)
    factories = ["--model", "tinymodel.py:build_model", "--inputs", "tinymodel.py:example_batch"]
    remat_cli = [sys.executable, "-m", "remat.cli"]
    solve = _finish(_start([*remat_cli, "solve", *factories, "--budget-frac", "0.8", "--solver", "equal_spacing",
                            "--out", "plan.json"], d, seed=1))
    assert solve.returncode == 0, solve.stderr
    # both only read the plan file: run side by side
    check = _start([*remat_cli, "check", *factories, "--plan", "plan.json", "--steps", "1"], d, seed=2)
    deploy = _start([sys.executable, "deploy.py", "plan.json"], d, seed=3)
    check, deploy = _finish(check), _finish(deploy)
    return d, factories, solve, check, deploy


def test_solve_check_deploy_in_fresh_processes(workflow):
    d, _, solve, check, deploy = workflow
    assert "captured the training step with fake tensors" in solve.stdout
    assert "equal_spacing: heuristic" in solve.stdout and "-> plan.json" in solve.stdout
    assert check.returncode == 0, check.stdout + check.stderr
    assert "loss and 12 gradients equal the unmodified model's bit for bit" in check.stdout
    assert "<= budget" in check.stdout and ": OK" in check.stdout
    assert deploy.returncode == 0, deploy.stderr
    r = json.loads(deploy.stdout.splitlines()[-1])
    assert r["measured"] <= r["budget"] == r["budget_of_file"]
    assert r["measured"] == r["predicted"]  # CPU: the simulator is exact
    assert r["grads_equal"]
    plan = Plan.load(d / "plan.json")
    assert plan.recomputed and plan.context["captured_with"] == "fake tensors"
    assert plan.context["inputs"] == [{"arg": "args[0]", "shape": [512, 32], "dtype": "float32"},
                                      {"arg": "args[1]", "shape": [512], "dtype": "int64"}]
    assert plan.context["torch"] == torch.__version__ and plan.context["device"] == "cpu"
    assert plan.context["model"] == "tinymodel.Net"


def test_fingerprint_is_the_same_in_three_processes(workflow):
    d, _, _, check, deploy = workflow
    solved = Plan.load(d / "plan.json").graph_fingerprint
    checked = next(line.split()[2].rstrip(":") for line in check.stdout.splitlines()
                   if line.startswith("graph fingerprint"))
    deployed = json.loads(deploy.stdout.splitlines()[-1])["fingerprint"]
    assert solved == checked == deployed  # hash seeds 1, 2, 3; fake tensors in the first, real ones after


def test_fingerprint_changes_with_shape_dtype_and_layer(workflow):
    d = workflow[0]
    sys.path.insert(0, str(d))
    try:
        import tinymodel
    finally:
        sys.path.remove(str(d))

    def fp(model, inputs):
        return remat.capture(model, inputs).fingerprint()

    x, y = tinymodel.example_batch(16)
    base = fp(tinymodel.build_model(), (x, y))  # the same in three processes: the test above
    others = [fp(tinymodel.build_model(), tinymodel.example_batch(8)),  # shape
              fp(tinymodel.build_model().double(), (x.double(), y)),  # dtype
              fp(tinymodel.build_relu_model(), (x, y))]  # a layer
    assert len({base, *others}) == 4


def _one_line_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("remat") and ": error: " in lines[0]
    return lines[0]


def test_plans_for_something_else_are_refused_with_one_line(workflow, capsys, monkeypatch):
    d, factories, *_ = workflow
    monkeypatch.chdir(d)
    msg = _one_line_error(["check", *factories, "--batch", "256", "--plan", "plan.json"], capsys)
    assert "plan file 'plan.json' was made for other inputs" in msg
    assert "args[0] (256, 32) float32 here, args[0] (512, 32) float32 in the plan" in msg and "solve for" in msg
    msg = _one_line_error(["check", "--model", "tinymodel.py:build_wider_model", "--inputs",
                           "tinymodel.py:example_batch", "--plan", "plan.json"], capsys)
    assert "was made for another model (tinymodel.Net" in msg and "inp.weight is (160, 32) float32 here" in msg
    # the API says the same, before tracing
    sys.path.insert(0, str(d))
    try:
        import tinymodel
    finally:
        sys.path.remove(str(d))
    x, y = tinymodel.example_batch(256)
    with pytest.raises(PlanMismatchError, match="was made for other inputs"):
        remat.optimize(tinymodel.build_model(), example_inputs=(x, y), plan="plan.json")
    # another device: a plan for a GPU deployed on the CPU
    plan = remat.load_plan("plan.json")
    plan.context["device"] = "cuda"
    plan.save("cuda_plan.json")
    x, y = tinymodel.example_batch()
    with pytest.raises(PlanMismatchError, match=r"was solved for device cuda, but the model and inputs are on cpu: "
                                                r"solve for this device \(remat solve --device cpu\)"):
        remat.optimize(tinymodel.build_model(), example_inputs=(x, y), plan="cuda_plan.json")
    # a graph that differs although everything else matched: the torch version, or the model's code
    other = transformer_like(blocks=1)
    plan.context["torch"] = "2.12.0"
    with pytest.raises(PlanMismatchError, match="it was made with torch 2.12.0, this is torch"):
        rejudge(plan, other)
    plan.context["torch"] = torch.__version__
    with pytest.raises(PlanMismatchError, match="the model's code .* changed since: solve again"):
        rejudge(plan, other)


def test_bad_plan_files_in_the_cli(workflow, capsys, monkeypatch):
    d, factories, *_ = workflow
    monkeypatch.chdir(d)
    text = (d / "plan.json").read_text()
    data = json.loads(text)
    bad = {"truncated.json": (text[: len(text) // 2], "is not valid JSON"),
           "v9.json": (json.dumps({**data, "schema_version": 9}),
                       "has schema version 9; this remat reads versions 1 to 2: solve again"),
           "edited.json": (json.dumps({**data, "schedule": data["schedule"][1:] + data["schedule"][:1]}),
                           "its schedule cannot run on its graph: step 0"),
           "empty.json": ("", "is empty")}
    for name, (content, message) in bad.items():
        (d / name).write_text(content)
        for argv in (["inspect", name], ["check", *factories, "--plan", name]):
            msg = _one_line_error(argv, capsys)
            assert message in msg and name in msg, msg
        with pytest.raises(remat.PlanFileError, match=message.replace("(", r"\(")):
            remat.optimize(torch.nn.Linear(2, 2), example_inputs=(torch.zeros(1, 2),), plan=str(d / name))


def test_arguments_are_checked_before_anything_is_built(workflow, capsys, monkeypatch):
    d, *_ = workflow
    monkeypatch.chdir(d)
    (d / "broken.py").write_text("def build(:\n")
    boom = ["--model", "boom.py:build", "--inputs", "boom.py:batch"]
    cases = [
        (["solve", "--model", "nocolon", "--inputs", "boom.py:batch", "--budget-gb", "1"], "expected module:function"),
        (["solve", "--model", "missing.py:f", "--inputs", "boom.py:batch", "--budget-gb", "1"], "is not a file"),
        (["solve", "--model", "boom.py:nope", "--inputs", "boom.py:batch", "--budget-gb", "1"], "has no 'nope'"),
        (["solve", "--model", "no_such_pkg_xyz.models:f", "--inputs", "boom.py:batch", "--budget-gb", "1"],
         "no module 'no_such_pkg_xyz.models'"),
        (["solve", "--model", "broken.py:build", "--inputs", "boom.py:batch", "--budget-gb", "1"],
         "importing 'broken.py' failed: SyntaxError"),
        (["solve", *boom, "--budget-gb", "1", "--budget-mib", "3"], "not allowed with argument"),
        (["solve", *boom, "--budget-gb", "nan"], "argument --budget-gb: expected a finite number"),
        (["solve", *boom, "--budget-frac", "1.5"], "argument --budget-frac: expected a fraction in (0, 1]"),
        (["solve", *boom, "--budget-gb", "1", "--option", "oops"], "expected name=value"),
        (["solve", *boom, "--budget-gb", "1", "--solver", "keep_all", "--option", "coarsen_to=3"],
         "solver 'keep_all' takes no option coarsen_to"),
        (["solve", *boom, "--budget-gb", "1", "--out", "/nonexistent/p.json"], "does not exist"),
        (["solve", "--model", "boom.py:build", "--inputs", "boom.py:no_batch", "--batch", "4", "--budget-gb", "1"],
         "takes no batch size argument"),
        (["check", *boom, "--plan", "missing.json"], "plan file 'missing.json' does not exist"),
        (["inspect", "plan.json", "--png", "/nonexistent/t.png"], "does not exist"),
        (["max-batch", "--model", "boom.py:build", "--inputs", "boom.py:no_batch", "--budget-gb", "1"],
         "must take the batch size as its argument"),
        (["max-batch", *boom, "--budget-frac", "0.5"], "give --batch"),
    ]
    if not torch.cuda.is_available():
        cases.append((["check", *boom, "--plan", "plan.json", "--device", "cuda"], "this machine has no usable GPU"))
    for argv, message in cases:
        msg = _one_line_error(argv, capsys)
        assert message in msg, (argv, msg)


def test_inspect_prints_the_table_and_plots(workflow, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    d, *_ = workflow
    monkeypatch.chdir(d)
    assert cli.main(["inspect", "plan.json", "--png", "memory.png", "--depth", "2"]) == 0
    out = capsys.readouterr().out
    for text in ("equal_spacing plan", "model:    tinymodel.Net", "inputs:   args[0] (512, 32) float32",
                 "keep_all peak", "this plan's peak", "blocks.0", "recomp MiB", "plot -> memory.png"):
        assert text in out, text
    assert (d / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_max_batch_finds_the_largest_batch_that_fits(workflow, capsys, monkeypatch):
    d, factories, *_ = workflow
    monkeypatch.chdir(d)
    assert cli.main(["max-batch", *factories, "--budget-frac", "0.6", "--batch", "256", "--solver", "equal_spacing",
                     "--multiple-of", "32", "--max-batch", "512", "--out", "mb.json"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("keep_all", "equal_spacing") and len(line.split()) == 6}
    keep, es = int(rows["keep_all"][1]), int(rows["equal_spacing"][1])
    assert 32 <= keep < es <= 512 and keep % 32 == 0 == es % 32
    assert f"  keep_all batch {keep + 32}: no plan fits" in out
    assert f"  equal_spacing batch {es + 32}: no plan fits" in out or es == 512
    plan = Plan.load(d / "mb.json")
    assert plan.strategy == "equal_spacing" and plan.fits
    assert plan.context["inputs"][0]["shape"] == [es, 32]


def test_check_fails_when_the_measured_peak_exceeds_the_budget(workflow, capsys, monkeypatch):
    """A plan whose budget this machine cannot meet (here: a budget lowered below its peak by hand,
    as a plan made where op workspaces are smaller would be): exit code 1, saying so."""
    d, factories, *_ = workflow
    monkeypatch.chdir(d)
    plan = remat.load_plan("plan.json")
    plan = dataclasses.replace(plan, budget_bytes=plan.predicted_peak_bytes - 1)
    plan.save("tight.json")
    with pytest.warns(UserWarning, match="over its budget"):
        assert cli.main(["check", *factories, "--plan", "tight.json", "--steps", "1"]) == 1
    out = capsys.readouterr().out
    assert "bit for bit" in out and "> budget" in out and "OVER BUDGET" in out
