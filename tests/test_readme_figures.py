"""README.md's result figures are current with benchmarks/results/ (benchmarks/readme_figures.py).

If the first test fails, a benchmark was rerun without regenerating the README, or a figure was
edited by hand: run `python benchmarks/readme_figures.py` and commit the README it writes."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "benchmarks" / "readme_figures.py")
figures = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = figures  # dataclasses look their module up there
_spec.loader.exec_module(figures)

RESULT = """run  0: rc 0  noise
machine: test box, 2 cores
strategy  peak
keep_all  10.00
checkmate  5.00
"""


def _readme(tmp_path: Path, body: str, marker_args: str = 'r.txt cmd="python bench.py"') -> Path:
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n<!-- results: {marker_args} -->\n{body}<!-- /results -->\n\nafter\n")
    return readme


@pytest.mark.parametrize("page", figures.pages(), ids=lambda p: p.name)
def test_real_readme_and_docs_figures_are_current(page):
    stale = figures.check_readme(page)
    assert stale == "", f"{page.name}'s figures are stale; run `python benchmarks/readme_figures.py`:\n" + stale


def test_real_readme_has_figures():
    texts = [page.read_text() for page in figures.pages()]
    assert "<!-- results: " in texts[0]  # README.md shows at least one
    assert sum(t.count("<!-- results: ") for t in texts) >= 5
    assert all(t.count("<!-- results: ") == t.count("<!-- /results -->") for t in texts)


def test_stale_block_is_caught_then_regenerated(tmp_path):
    (tmp_path / "r.txt").write_text(RESULT)
    readme = _readme(tmp_path, "```\nmachine: test box, 2 cores\nkeep_all  9.99\n```\n")
    stale = figures.check_readme(readme)
    assert "-keep_all  9.99" in stale and "+keep_all  10.00" in stale
    assert figures.main(["--check", "--readme", str(readme)]) == 1
    assert figures.update_readme(readme) == []
    text = readme.read_text()
    assert text.startswith("# title\n\n<!-- results: r.txt") and text.endswith("<!-- /results -->\n\nafter\n")
    assert "`python bench.py` → [`r.txt`](r.txt):" in text
    assert "checkmate  5.00" in text and "9.99" not in text and "run  0" in text
    assert figures.check_readme(readme) == ""
    assert figures.main(["--check", "--readme", str(readme)]) == 0
    (tmp_path / "r.txt").write_text(RESULT.replace("5.00", "4.00"))  # the benchmark is rerun
    assert "+checkmate  4.00" in figures.check_readme(readme)


def test_selectors_keep_the_machine_line(tmp_path):
    (tmp_path / "r.txt").write_text(RESULT)
    readme = _readme(tmp_path, "", 'r.txt cmd="python bench.py" lines=3 grep=\'^checkmate\'')
    assert figures.update_readme(readme) == []
    block = readme.read_text().split("```")[1].strip().splitlines()
    assert block == ["machine: test box, 2 cores", "strategy  peak", "checkmate  5.00"]
    assert "(excerpt)" in readme.read_text()


def test_missing_file_is_named_and_nothing_is_written(tmp_path):
    readme = _readme(tmp_path, "old\n")
    before = readme.read_text()
    assert "missing results file r.txt" in figures.check_readme(readme)
    assert figures.update_readme(readme) and readme.read_text() == before
    assert figures.main(["--readme", str(readme)]) == 1


@pytest.mark.parametrize("args, message", [
    ("r.txt", "cmd="),
    ('r.txt cmd=x lines=9', "outside"),
    ('r.txt cmd=x lines=2-a', "is not N, A-B or A-"),
    ("r.txt cmd=x grep='^nothing'", "matches no line"),
    ('r.txt cmd=x colour=red', "unknown option"),
])
def test_bad_markers_are_reported(tmp_path, args, message):
    (tmp_path / "r.txt").write_text(RESULT)
    assert message in figures.check_readme(_readme(tmp_path, "", args))


def test_file_without_machine_line_is_refused(tmp_path):
    (tmp_path / "r.txt").write_text("keep_all 1\n")
    assert "no 'machine:' line" in figures.check_readme(_readme(tmp_path, ""))


def test_unclosed_marker_is_reported(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text('<!-- results: r.txt cmd="x" -->\ntext\n')
    assert "without its closing" in figures.check_readme(readme)
