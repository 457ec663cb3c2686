"""Progress on stderr: shown for stages longer than DELAY_S, with what the stage knows; silent
for short stages and under quiet (API `quiet=True`, CLI `--quiet`)."""
from __future__ import annotations

import time

import pytest

import remat
from remat import cli
from remat.core import progress
from remat.solver import keep_all
from tests.conftest import transformer_like


def _slow_stage(seconds: float = 0.8) -> None:
    with progress.stage("a test stage", total=3, unit="step") as s:
        s.note(bound="1.5%")
        for _ in range(3):
            time.sleep(seconds / 3)
            s.advance()


def test_a_long_stage_shows_its_name_count_and_facts(capsys, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.1)
    monkeypatch.setattr(progress, "LOG_REDRAW_S", 0.1)  # capsys's stderr is not a terminal
    _slow_stage()
    err = capsys.readouterr().err
    assert "remat: a test stage" in err and "bound=1.5%" in err and "step" in err


def test_a_short_stage_and_a_quiet_one_show_nothing(capsys, monkeypatch):
    _slow_stage(0.3)  # shorter than the real DELAY_S
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "DELAY_S", 0.1)
    monkeypatch.setattr(progress, "LOG_REDRAW_S", 0.1)
    with progress.quiet():
        assert progress.is_quiet()
        _slow_stage()
    assert not progress.is_quiet()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("quiet", [False, True])
def test_the_solver_reports_its_search_unless_quiet(capsys, monkeypatch, quiet):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LOG_REDRAW_S", 0.1)
    g = transformer_like(blocks=1)  # the certified search runs at 60% (2 s; four blocks: 11 s)
    budget = int(0.6 * keep_all.solve(g).predicted_peak_bytes)
    plan = remat.solve(g, budget, quiet=quiet)
    err = capsys.readouterr().err
    assert plan.fits
    if quiet:
        assert err == ""
    else:
        assert "checkmate: certified search" in err, err


def test_every_command_takes_quiet():
    parser = cli._parser()
    for cmd in ("demo", "plan", "solve", "inspect", "check", "max-batch"):
        assert "--quiet" in parser._subparsers._group_actions[0].choices[cmd].format_help()
