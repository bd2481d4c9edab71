"""The blocks of docs/oracle.md's "Use mpifusion as the oracle in your tests" run as written
(each as a script, with a hard timeout) and say what they promise; each is skipped where its
framework is not installed. So does the page's opening example (the README's, included)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cmd, run_job

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Use mpifusion as the oracle in your tests"


def blocks() -> dict:
    text = (ROOT / "docs" / "oracle.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else len(text)]
    found = {}
    for code in re.findall(r"```python\n(.*?)```", section, re.S):
        for name in ("megatron", "torch", "paddle", "jax"):  # Megatron's block imports torch
            if re.search(rf"^\s*(import|from) {name}\b", code, re.M):
                found[name] = code
                break
    return found


def opening_example() -> str:
    """The page's first example: the README's block it includes (test_shared_blocks.py)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    part = readme.split("<!-- oracle-example:start -->")[1].split("<!-- oracle-example:end -->")[0]
    return re.search(r"```python\n(.*?)```", part, re.S).group(1)


def test_the_opening_example_runs_and_passes(tmp_path):
    script = tmp_path / "oracle_opening.py"
    script.write_text(opening_example(), encoding="utf-8")
    out = run_cmd([sys.executable, str(script)], timeout=120, cwd=str(tmp_path))  # no MPI
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "PASS: 1 params bit-exact (exact inputs)"
    assert "PASS: 1 params bit-exact (exact inputs)" in (ROOT / "docs" / "oracle.md").read_text()


def test_the_section_has_a_block_per_framework():
    assert sorted(blocks()) == ["jax", "megatron", "paddle", "torch"]


@pytest.mark.parametrize("framework, last", [
    ("torch", r"^0\.weight [\d.e-]+ of the bound; 4 all-gathers exact$"),
    ("paddle", r"^PASS: 4 params within the bound$"),
    ("jax", r"^PASS: 2 params within the bound$"),
    ("megatron", r"^PASS: 2 step\(s\), 4 params each within the bound$"),
])
def test_oracle_block_runs(tmp_path, framework, last):
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed (pip install -e '.[{framework}]')")
    script = tmp_path / f"oracle_{framework}.py"
    script.write_text(blocks()[framework], encoding="utf-8")
    out = run_job(1, [sys.executable, str(script)], timeout=150, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert re.match(last, lines[-1]), out.stdout[-2000:]
