"""The README's transcripts run as written and print what the README shows.

A fenced block whose first line starts with ``$ `` is a transcript: each ``$ `` line is a
command, run with bash in a scratch folder that holds the README's spec example as
``spec.json``, with this Python's ``mpifusion`` and ``mpiexec`` first on PATH; the lines
after it are what it prints (stdout and stderr together). In the README's lines, a line
``...`` stands for any number of lines, ``...`` inside a line for any text, and decimal
numbers (times, errors, bandwidths: ``0.487``, ``3.18e-07``) for any decimal number, since
they vary from run to run; everything else (counts, offsets, names, messages, verdicts) must
match exactly and in order. Blank lines are ignored on both sides.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import List, Optional

import pytest

from tests.helpers import mpiexec_path, run_cmd

README = Path(__file__).resolve().parents[2] / "README.md"
DECIMAL = r"[-+]?(?:\d+\.\d*|\.\d+|\d+(?=e))(?:e[-+]?\d+)?"
GAP = "..."


def transcripts(text: str) -> List[List[tuple]]:
    """[(command, [expected lines])] per transcript block of the README."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
    out = []
    for block in blocks:
        lines = block.rstrip("\n").split("\n")
        if not lines[0].startswith("$ "):
            continue
        steps: list = []
        for line in lines:
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                steps[-1][1].append(line.rstrip())
        out.append(steps)
    return out


def spec_example(text: str) -> str:
    """The JSON spec example of "Command line"."""
    section = text[text.index("## Command line"):]
    return re.search(r"```json\n(.*?)```", section, re.S).group(1)


def line_pattern(line: str) -> "re.Pattern":
    parts = re.split(rf"(\.\.\.|{DECIMAL})", line)
    regex = "".join(".*" if p == GAP else DECIMAL if i % 2 else re.escape(p)
                    for i, p in enumerate(parts))
    return re.compile(regex)


def _find(pats: list, lines: List[str], start: int, anchored: bool) -> Optional[int]:
    """Index after the first place at or after ``start`` where ``pats`` match consecutive
    lines (only at ``start`` when ``anchored``), or None."""
    last = start if anchored else len(lines) - len(pats)
    for at in range(start, last + 1):
        if at + len(pats) <= len(lines) and all(
                p.fullmatch(lines[at + k]) for k, p in enumerate(pats)):
            return at + len(pats)
    return None


def matches(expected: List[str], actual: List[str]) -> bool:
    """``expected`` (with ``...`` gap lines) against ``actual``, blank lines dropped."""
    expected = [e for e in expected if e.strip()]
    actual = [a.rstrip() for a in actual if a.strip()]
    if not expected:
        return True
    segments: List[list] = [[]]
    for e in expected:
        if e.strip() == GAP:
            segments.append([])
        else:
            segments[-1].append(line_pattern(e))
    pos: Optional[int] = 0
    for i, seg in enumerate(segments):
        if not seg:
            continue
        first, last = i == 0, i == len(segments) - 1  # they start / end the output
        at = max(pos, len(actual) - len(seg)) if last else pos
        if first and last and at != 0:
            return False
        pos = _find(seg, actual, at, anchored=first or last)
        if pos is None:
            return False
    return pos == len(actual) or not segments[-1]


def _clean(output: str) -> List[str]:
    """Output lines without tqdm's progress-bar redraws (stderr, carriage returns)."""
    lines = []
    for line in output.split("\n"):
        parts = [p for p in line.split("\r") if p.strip() and "%|" not in p]
        if parts:
            lines.append(parts[-1])
    return lines


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder with spec.json and a bin/ that puts this Python's tools first."""
    path = tmp_path_factory.mktemp("readme")
    (path / "spec.json").write_text(spec_example(README.read_text()))
    bindir = path / "bin"
    bindir.mkdir()
    script = Path(sys.executable).parent / "mpifusion"
    if not script.exists():  # not installed as a console script: the module does the same
        (bindir / "mpifusion").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mpifusion "$@"\n')
        (bindir / "mpifusion").chmod(0o755)
    return path


def _env(scratch: Path) -> dict:
    dirs = [str(scratch / "bin"), os.path.dirname(sys.executable),
            os.path.dirname(mpiexec_path())]
    return {"PATH": os.pathsep.join(dirs + [os.environ.get("PATH", "")]), "COLUMNS": "100"}


CASES = transcripts(README.read_text())


def test_the_readme_has_transcripts():
    commands = [cmd for block in CASES for cmd, _ in block]
    assert any(c.startswith("mpifusion layout") for c in commands), commands
    assert any(" mpifusion run" in c for c in commands), commands
    assert any("error" in " ".join(out) for block in CASES for _, out in block)


@pytest.mark.parametrize("block", CASES, ids=[b[0][0][:60] for b in CASES])
def test_transcript(block, scratch):
    if shutil.which("bash") is None:
        pytest.skip("bash not found")
    for command, expected in block:
        proc = run_cmd(["bash", "-c", command], timeout=240, cwd=str(scratch),
                       env=_env(scratch), stderr_to_stdout=True)
        actual = _clean(proc.stdout)
        assert "Traceback" not in proc.stdout, proc.stdout
        assert matches(expected, actual), (
            f"$ {command}\nREADME shows:\n" + "\n".join(expected)
            + "\n\nit printed:\n" + "\n".join(actual))


@pytest.mark.parametrize("expected, actual, ok", [
    (["a 1.5 b", "...", "z"], ["a 2.25 b", "x", "y", "z"], True),
    (["a 1.5 b", "z"], ["a 2.25 b", "x", "z"], False),       # no gap: lines are adjacent
    (["a 1 b"], ["a 2 b"], False),                           # integers are exact
    (["head ...", "..."], ["head tail", "more"], True),
    (["...", "PASS: 3 ok"], ["x", "PASS: 3 ok"], True),
    (["...", "PASS: 3 ok"], ["PASS: 3 ok", "extra"], False),  # the last line is the last
    (["x 3.18e-07 abs"], ["x 1.5e-06 abs"], True),
])
def test_matcher(expected, actual, ok):
    assert matches(expected, actual) is ok
