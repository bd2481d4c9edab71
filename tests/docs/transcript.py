"""Reading and matching the transcripts of the README and the docs pages.

A fenced block whose first line starts with ``$ `` is a transcript: each ``$ `` line is a
command, the lines after it are what it prints (stdout and stderr together). In those lines:

- a line ``...`` stands for any number of lines, ``...`` inside a line for any text;
- decimal numbers (times, errors, bandwidths: ``0.487``, ``3.18e-07``) stand for any decimal
  number, since they vary from run to run;
- ``<machine>`` stands for a value that depends on the machine (a cache size or a segment
  size derived from one, a core count, a CPU name, a hostname, a path, a user): any
  non-empty text. Every such value is marked, so the transcripts hold on any machine
  (``test_transcripts.py`` runs them under faked cache sizes to prove it);
- everything else (counts, offsets, names, messages, verdicts) must match exactly and in
  order. Blank lines are ignored on both sides.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
DECIMAL = r"[-+]?(?:\d+\.\d*|\.\d+|\d+(?=e))(?:e[-+]?\d+)?"
GAP = "..."
MACHINE = "<machine>"


def pages() -> List[Path]:
    """The pages that may hold transcripts: the README and the docs' Markdown pages."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def transcripts(text: str) -> List[List[tuple]]:
    """[(command, [expected lines])] per transcript block of ``text``. Every fenced block is
    read whatever its info string (``{include} ...`` too), so fences pair as Markdown pairs
    them."""
    blocks = re.findall(r"^```[^`\n]*\n(.*?)^```", text, re.S | re.M)
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


def all_transcripts() -> Dict[str, List[tuple]]:
    """``{"PAGE: first command": block}`` over every page."""
    found = {}
    for page in pages():
        for block in transcripts(page.read_text(encoding="utf-8")):
            found[f"{page.name}: {block[0][0][:60]}"] = block
    return found


def spec_example() -> str:
    """The JSON spec example that the transcripts call ``spec.json``: the first ``json``
    block after a heading ``Command line`` on any page."""
    for page in pages():
        text = page.read_text(encoding="utf-8")
        heading = re.search(r"^#+ Command line\b", text, re.M)
        block = heading and re.search(r"```json\n(.*?)```", text[heading.start():], re.S)
        if block:
            return block.group(1)
    raise LookupError("no page has a 'Command line' heading with a json block")


def line_pattern(line: str) -> "re.Pattern":
    parts = re.split(rf"(\.\.\.|{re.escape(MACHINE)}|{DECIMAL})", line)
    regex = "".join((".*" if p == GAP else ".+" if p == MACHINE else DECIMAL) if i % 2
                    else re.escape(p) for i, p in enumerate(parts))
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


def clean(output: str) -> List[str]:
    """Output lines without tqdm's progress-bar redraws (stderr, carriage returns)."""
    lines = []
    for line in output.split("\n"):
        parts = [p for p in line.split("\r") if p.strip() and "%|" not in p]
        if parts:
            lines.append(parts[-1])
    return lines


def make_scratch(path: Path) -> Path:
    """``path`` with spec.json and a bin/ that puts this Python's tools first."""
    (path / "spec.json").write_text(spec_example())
    bindir = path / "bin"
    bindir.mkdir()
    script = Path(sys.executable).parent / "mpifusion"
    if not script.exists():  # not installed as a console script: the module does the same
        (bindir / "mpifusion").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mpifusion "$@"\n')
        (bindir / "mpifusion").chmod(0o755)
    return path


def scratch_env(scratch: Path, mpiexec: str) -> dict:
    """PATH with this Python's tools first, and none of the user's settings: every
    ``MPIFUSION_*`` variable blanked (an empty value reads as unset) and a tune file and
    cache folder of the scratch folder's own (none exists), so a developer's tune file or
    ``MPIFUSION_STRATEGY`` never changes what the transcripts print."""
    dirs = [str(scratch / "bin"), os.path.dirname(sys.executable), os.path.dirname(mpiexec)]
    env = {k: "" for k in os.environ if k.startswith("MPIFUSION_")}
    env.update({"PATH": os.pathsep.join(dirs + [os.environ.get("PATH", "")]),
                "COLUMNS": "100",
                "MPIFUSION_TUNE_FILE": str(scratch / "no-tune.json"),
                "XDG_CACHE_HOME": str(scratch / "cache")})
    return env


#: ``sitecustomize.py`` of a faked machine: Python loads it at start-up when its folder is
#: first on PYTHONPATH; it replaces the cache sizes and CPU name mpifusion reads, in every
#: rank, once ``mpifusion.machine`` is imported (the pattern of tests/slurm/fault_hook).
FAKE_MACHINE = '''\
import importlib.abc
import importlib.machinery
import sys

SIZES = {sizes!r}
CPU = {cpu!r}


def _patch(module):
    module.cache_sizes = lambda: dict(SIZES)
    module.cpu_model = lambda: CPU


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "mpifusion.machine":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


def fake_machine(folder: Path, sizes: Dict[str, int], cpu: str) -> dict:
    """Write a faked machine's ``sitecustomize.py`` into ``folder``; the environment
    entries that load it in every process of a job."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(FAKE_MACHINE.format(sizes=sizes, cpu=cpu))
    return {"PYTHONPATH": os.pathsep.join(
        p for p in (str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
