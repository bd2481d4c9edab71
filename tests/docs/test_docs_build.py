"""The documentation site builds with warnings as errors (a broken cross-reference, an
unreadable image, a docstring autodoc cannot import or parse fails here)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cmd

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_docs_build_without_warnings(tmp_path):
    for module in ("sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]')")
    out = run_cmd([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                   "-d", tmp_path / "doctrees", DOCS, tmp_path / "html"], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    pages = {p.stem for p in (tmp_path / "html").glob("*.html")}
    expected = {p.stem for p in DOCS.glob("*.md")}
    assert expected <= pages, sorted(expected - pages)
    # autodoc found the docstrings (an import failure is a warning, but say it plainly)
    assert "FusedCommBuffer" in (tmp_path / "html" / "reference.html").read_text()
