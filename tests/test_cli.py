"""The command line: every bad argument is refused while parsing (one line on stderr, exit code 2,
nothing traced or solved), a tiny valid `remat plan` (an alias of `remat solve`, whose model is the
built-in GPT unless --model says otherwise) writes a plan that loads, and the profiler does not
flood stderr with Kineto's USDT lines."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import remat
import remat.cli as cli
from remat.graph_capture.profiling import _without_usdt_lines
from remat.core.plan import Plan

TINY_GPT = """
from remat.default_model import GPTConfig, default_inputs, default_model

CFG = GPTConfig(n_layer=1, block_size=16, batch_size=1, n_embd=16, n_head=2)

def build():
    return default_model(CFG)

def batch():
    return default_inputs(CFG)
"""


@pytest.fixture
def tiny(tmp_path):
    """--model and --inputs of a one-layer GPT written into a file."""
    (tmp_path / "tinygpt.py").write_text(TINY_GPT)
    return ["--model", f"{tmp_path}/tinygpt.py:build", "--inputs", f"{tmp_path}/tinygpt.py:batch"]


@pytest.fixture
def nothing_runs(monkeypatch):
    """Building the model is the first thing a command does: make it fail loudly."""

    def boom(*a, **k):
        raise AssertionError("the command started working before its arguments were checked")

    import remat.cli_offline

    monkeypatch.setattr(cli, "default_model", boom)
    monkeypatch.setattr(remat.cli_offline, "build", boom)


BAD = [
    (["demo", "--embd", "64", "--heads", "3"], "--embd 64 is not divisible by --heads 3"),
    (["demo", "--embd", "30", "--heads", "10"], "3 channels per head; it must be even"),
    (["demo", "--seq", "0"], "argument --seq: expected a positive integer, got 0"),
    (["demo", "--layers", "-2"], "argument --layers: expected a positive integer"),
    (["demo", "--batch", "two"], "argument --batch: expected a positive integer, got 'two'"),
    (["demo", "--heads", "1.5"], "argument --heads: expected a positive integer"),
    (["demo", "--budget-frac", "0"], "argument --budget-frac: expected a fraction in (0, 1]"),
    (["demo", "--budget-frac", "1.5"], "argument --budget-frac: expected a fraction in (0, 1]"),
    (["demo", "--budget-frac", "nan"], "argument --budget-frac: expected a finite number"),
    (["demo", "--budget-mib", "-3"], "argument --budget-mib: expected a positive number"),
    (["demo", "--budget-mib", "0"], "argument --budget-mib: expected a positive number"),
    (["demo", "--budget-mib", "1e-9"], "argument --budget-mib: 1e-09 MiB is less than one byte"),
    (["demo", "--time-limit", "inf"], "argument --time-limit: expected a finite number"),
    (["demo", "--time-limit", "0"], "argument --time-limit: expected a positive number"),
    (["demo", "--dropout", "1"], "argument --dropout: expected a dropout probability in [0, 1)"),
    (["demo", "--dropout", "-0.1"], "argument --dropout: expected a dropout probability in [0, 1)"),
    (["demo", "--attn-dropout", "2"], "argument --attn-dropout: expected a dropout probability in [0, 1)"),
    (["demo", "--steps", "-1"], "argument --steps: expected a non-negative integer"),
    (["demo", "--fused-attention", "maybe"], "argument --fused-attention: invalid choice"),
    (["demo", "--json", "/nonexistent/dir/r.json"], "argument --json: the directory '/nonexistent/dir' does not exist"),
    (["plan", "--out", "/nonexistent/dir/p.json"], "argument --out: the directory '/nonexistent/dir' does not exist"),
    (["plan", "--solver", "magic"], "argument --solver: invalid choice: 'magic'"),
    (["plan", "--bogus"], "unrecognized arguments: --bogus"),
    (["solve", "--budget-frac", "2"], "argument --budget-frac: expected a fraction in (0, 1]"),
    ([], "required: {demo,solve,inspect,check,max-batch}"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) or "no-command" for a, _ in BAD])
def test_bad_argument_exits_2_with_one_line(argv, message, nothing_runs, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert message in lines[0]
    assert lines[0].startswith("remat") and ": error: " in lines[0]


def test_out_that_is_a_directory_is_refused(tmp_path, nothing_runs, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_out_in_a_read_only_directory_is_refused(tmp_path, nothing_runs, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(["plan", "--out", str(ro / "p.json")])
    finally:
        ro.chmod(0o700)
    assert e.value.code == 2
    assert "is not writable" in capsys.readouterr().err


def test_default_out_is_checked_too(tmp_path, monkeypatch, nothing_runs, capsys):
    """argparse runs the type check on the default 'plan.json' as well (in the current folder)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").mkdir()
    with pytest.raises(SystemExit) as e:
        cli.main(["plan"])
    assert e.value.code == 2
    assert "argument --out: 'plan.json' is a directory" in capsys.readouterr().err


def test_tiny_plan_writes_a_loadable_plan(tmp_path, tiny, capfd):
    out = tmp_path / "p.json"
    assert cli.main(["plan", *tiny, "--solver", "equal_spacing", "--budget-frac", "0.9", "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.strategy == "equal_spacing" and plan.fits and plan.schedule
    stdout, stderr = capfd.readouterr()  # fd level: what the profiler's C++ side writes is seen too
    assert "USDT" not in stderr and "profiler_start" not in stderr, stderr
    assert "captured" in stdout and "solving equal_spacing" in stdout and str(out) in stdout
    assert sorted(f.name for f in tmp_path.iterdir() if f.suffix != ".py") == ["p.json"]  # no temporary file left


def test_solve_with_the_chunked_loss_head_saves_it_and_check_deploys_it(tmp_path, tiny, capfd):
    """--chunked-loss on: the plan is made on the chunked head, records it, and `remat check`
    deploys that head (measured = predicted, under the budget, gradients close to eager's)."""
    out = tmp_path / "p.json"
    assert cli.main(["solve", *tiny, "--solver", "equal_spacing", "--budget-frac", "1", "--chunked-loss", "on",
                     "--out", str(out)]) == 0
    assert "loss head: chunked" in capfd.readouterr().out
    plan = Plan.load(out)
    assert plan.context["loss_head"] == "chunked" and plan.fits
    assert any(n.op.startswith("chunked_linear_cross_entropy") for n in plan.graph.nodes)
    assert cli.main(["check", *tiny, "--plan", str(out), "--steps", "1"]) == 0
    stdout = capfd.readouterr().out
    assert ": OK" in stdout and ("match the unmodified model's" in stdout or "equal the unmodified" in stdout), stdout
    assert cli.main(["solve", *tiny, "--solver", "equal_spacing", "--budget-frac", "0.9", "--out", str(out)]) == 0
    assert Plan.load(out).context["loss_head"] == "unchunked"


def test_plan_is_solve_with_the_built_in_gpt_by_default(nothing_runs):
    a = cli._parser().parse_args(["plan"])
    b = cli._parser().parse_args(["solve"])
    assert a.fn is b.fn and a.model.spec == b.model.spec == "remat.offline:default_gpt"
    assert a.budget_frac is None and a.budget_gb is None  # solve then takes DEFAULT_FRAC of keep_all


def test_profiler_prints_no_usdt_lines():
    """A fresh process (Kineto prints its USDT lines from its first use on): capture (which
    probes op workspaces with the profiler) and measure_peak leave stderr empty."""
    code = textwrap.dedent("""
        import torch, remat
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        x = torch.randn(4, 8)
        class Loss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = m
            def forward(self, x):
                return self.m(x).sum()
        g = remat.capture(Loss(), (x,))
        peak = remat.measure_peak(lambda: Loss()(x).backward(), resident=[m, x])
        print(len(g.nodes), peak)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    n, peak = map(int, r.stdout.split())
    assert n > 0 and peak > 0


def test_usdt_filter_keeps_every_other_line(capfd):
    with _without_usdt_lines():
        os.write(2, b"USDT:2026-11-30 03:14:35 4681:4681 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR:2026-11-30 03:14:35 4681:4681 Foo.cpp:1] a real error\n")
        print("a Python warning", file=sys.stderr)
        os.write(2, b"USDT:2026-11-30 03:14:35 4681:4681 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    # (order aside: under capfd, sys.stderr does not write to fd 2 itself)
    lines = capfd.readouterr().err.splitlines()
    assert sorted(lines) == ["ERROR:2026-11-30 03:14:35 4681:4681 Foo.cpp:1] a real error", "a Python warning"]


def test_package_exports_the_errors():
    assert issubclass(remat.RematArgumentError, ValueError)
    assert issubclass(remat.RematArgumentTypeError, TypeError)
    assert issubclass(remat.PlanFileError, ValueError)
