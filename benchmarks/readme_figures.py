"""README figures generated from benchmarks/results/: rewrite them, or check that they are current.

    python benchmarks/readme_figures.py           # rewrite the marked blocks of README.md and docs/*.md
    python benchmarks/readme_figures.py --check   # exit 1 and print a diff if any block is stale

A marked block in README.md is a marker line, the generated text, and a closing line:

    <!-- results: benchmarks/results/core_cpu.txt cmd="python benchmarks/core.py" -->
    ... generated, do not edit by hand ...
    <!-- /results -->

The marker's words are split like a shell command line (quotes group, single quotes keep
backslashes). The first word is the results file, relative to the README's folder; then:

    cmd="..."       required: the command that wrote the file (shown in the block's caption)
    lines=SPEC      keep these lines (1-based): N, A-B or A- (to the end), comma-separated
    grep='REGEX'    keep the lines that REGEX matches (Python `re.search`)

With neither `lines` nor `grep` the whole file is shown; with both, the lines either selects, in
file order. The file's `machine:` line is always kept, so every block says where it was measured
(a file without one is an error). The block is a caption naming the command and the file, then
the selected lines, right-stripped, in a fenced code block. A selector that selects nothing, a
line number past the end of the file, or a missing file is an error: --check names it and exits 1,
and a rewrite writes nothing.

tests/test_readme_figures.py runs the check on the real README, so the test suite fails when a
benchmark is rerun without regenerating the README, or a figure is edited by hand.
"""
from __future__ import annotations

import argparse
import difflib
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["README", "pages", "Figure", "FigureError", "check_readme", "main", "parse_line_spec", "parse_marker",
           "regenerate", "render_figure", "select_lines", "update_readme"]

README = Path(__file__).resolve().parents[1] / "README.md"


def pages() -> list[Path]:
    """The Markdown pages with figures: README.md and every page of docs/ (paths in a page's markers
    are relative to its own folder)."""
    return [README, *sorted((README.parent / "docs").glob("*.md"))]
OPEN = re.compile(r"^<!-- results: (?P<args>.*?) -->$")
CLOSE = "<!-- /results -->"
MACHINE = re.compile(r"^\s*machine:")  # may be indented (a Markdown results file quotes it)


class FigureError(ValueError):
    """A marker that cannot be rendered: malformed, or naming a missing file or lines it lacks."""


@dataclass(frozen=True)
class Figure:
    """One marked block: which results file, which command wrote it, which of its lines to show."""
    path: str
    cmd: str
    lines: str | None = None
    grep: str | None = None


def parse_marker(args: str) -> Figure:
    """The Figure a marker line's arguments (the text after `results:`) describe."""
    try:
        words = shlex.split(args)
    except ValueError as e:
        raise FigureError(f"marker {args!r}: {e}") from None
    if not words or "=" in words[0]:
        raise FigureError(f"marker {args!r}: the first word must be the results file")
    options = dict(word.partition("=")[::2] for word in words[1:])
    unknown = set(options) - {"cmd", "lines", "grep"}
    if unknown:
        raise FigureError(f"marker {args!r}: unknown option(s) {', '.join(sorted(unknown))}")
    if not options.get("cmd"):
        raise FigureError(f"marker {args!r}: cmd=\"...\" (the command that wrote the file) is required")
    return Figure(words[0], options["cmd"], options.get("lines"), options.get("grep"))


def parse_line_spec(spec: str, n_lines: int) -> set[int]:
    """0-based indices of the lines a `lines=` spec (1-based N, A-B, A-; comma-separated) names."""
    picked = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:(-)\s*(\d*)\s*)?", part)
        if not m:
            raise FigureError(f"lines={spec!r}: {part!r} is not N, A-B or A-")
        first = int(m[1])
        last = (int(m[3]) if m[3] else n_lines) if m[2] else first
        if not 1 <= first <= last <= n_lines:
            raise FigureError(f"lines={spec!r}: {part.strip()!r} is outside the file's lines 1-{n_lines}")
        picked.update(range(first - 1, last))
    return picked


def grep_lines(pattern: str, lines: list[str]) -> set[int]:
    """0-based indices of the lines `pattern` matches; an error when it matches none."""
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise FigureError(f"grep={pattern!r}: {e}") from None
    picked = {i for i, line in enumerate(lines) if regex.search(line)}
    if not picked:
        raise FigureError(f"grep={pattern!r} matches no line")
    return picked


def machine_index(lines: list[str]) -> int:
    """Index of the file's `machine:` line; an error when it has none."""
    for i, line in enumerate(lines):
        if MACHINE.match(line):
            return i
    raise FigureError("the file has no 'machine:' line")


def select_lines(text: str, figure: Figure) -> list[str]:
    """The lines of a results file a Figure shows, right-stripped, machine line included."""
    lines = [line.rstrip() for line in text.splitlines()]
    picked = {machine_index(lines)}
    if figure.lines is None and figure.grep is None:
        picked.update(range(len(lines)))
    if figure.lines is not None:
        picked |= parse_line_spec(figure.lines, len(lines))
    if figure.grep is not None:
        picked |= grep_lines(figure.grep, lines)
    return [lines[i] for i in sorted(picked)]


def fence_for(lines: list[str]) -> str:
    """A backtick fence longer than any backtick run in the lines."""
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    return "`" * max(3, longest + 1)


def caption(figure: Figure) -> str:
    """The line above the code block: the command, the file, and whether this is an excerpt."""
    excerpt = "" if figure.lines is None and figure.grep is None else " (excerpt)"
    return f"`{figure.cmd}` → [`{figure.path}`]({figure.path}){excerpt}:"


def render_figure(figure: Figure, root: Path) -> list[str]:
    """The generated lines between a marker and its closing line."""
    path = root / figure.path
    if not path.is_file():
        raise FigureError(f"missing results file {figure.path}")
    try:
        shown = select_lines(path.read_text(), figure)
    except FigureError as e:
        raise FigureError(f"{figure.path}: {e}") from None
    fence = fence_for(shown)
    return [caption(figure), "", fence, *shown, fence]


def find_close(lines: list[str], start: int) -> int:
    """Index of the closing line of the block whose marker is at `start`."""
    for j in range(start + 1, len(lines)):
        if lines[j].strip() == CLOSE:
            return j
        if OPEN.match(lines[j].strip()):
            break
    raise FigureError(f"README line {start + 1}: marker without its closing {CLOSE}")


def regenerate(readme_text: str, root: Path) -> tuple[str, list[str]]:
    """README text with every marked block regenerated, and the problems met on the way.

    A block that cannot be rendered keeps its old content and adds a problem."""
    lines = readme_text.splitlines()
    out, problems, i = [], [], 0
    while i < len(lines):
        m = OPEN.match(lines[i].strip())
        if not m:
            out.append(lines[i])
            i += 1
            continue
        close = find_close(lines, i)
        try:
            body = render_figure(parse_marker(m["args"]), root)
        except FigureError as e:
            problems.append(f"README line {i + 1}: {e}")
            body = lines[i + 1:close]
        out += [lines[i], *body, lines[close]]
        i = close + 1
    return "\n".join(out) + ("\n" if readme_text.endswith("\n") else ""), problems


def stale_diff(old: str, new: str, name: str) -> str:
    """Unified diff from the README as it is to the README as it would be regenerated."""
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        fromfile=f"{name} (as is)", tofile=f"{name} (regenerated)"))


def check_readme(readme: Path = README) -> str:
    """What is stale or broken in the README's figures: a diff and problem lines; '' when current."""
    old = readme.read_text()
    try:
        new, problems = regenerate(old, readme.parent)
    except FigureError as e:
        return str(e)
    return "".join([stale_diff(old, new, readme.name), *(p + "\n" for p in problems)])


def update_readme(readme: Path = README) -> list[str]:
    """Rewrite the README's figures from the results files; the problems (nothing written if any)."""
    old = readme.read_text()
    try:
        new, problems = regenerate(old, readme.parent)
    except FigureError as e:
        return [str(e)]
    if not problems and new != old:
        readme.write_text(new)
    return problems


def main(argv: list[str] | None = None) -> int:
    """Command line: rewrite (default) or --check; exit 1 on stale figures or any problem."""
    ap = argparse.ArgumentParser(description="Generate README.md's result figures from benchmarks/results/.")
    ap.add_argument("--check", action="store_true", help="do not write: print a diff of stale figures, exit 1 if any")
    ap.add_argument("--readme", type=Path, default=None,
                    help="the page to work on (default: README.md and every page of docs/)")
    a = ap.parse_args(argv)
    failed = False
    for page in [a.readme] if a.readme else pages():
        if a.check:
            report = check_readme(page)
            sys.stdout.write(report or f"{page}: figures are current\n")
            failed |= bool(report)
            continue
        problems = update_readme(page)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print(f"{page}: not written", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
