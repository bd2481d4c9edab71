"""The documentation site builds with warnings as errors (a broken cross-reference, an
unreadable image, a docstring autodoc cannot import or parse fails here; the build is
tests/docs/conftest.py's, nitpicky, so an unresolved Python reference fails too)."""
from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_docs_build_without_warnings(docs_build):
    assert docs_build.returncode == 0, docs_build.output
    pages = {p.stem for p in docs_build.html.glob("*.html")}
    expected = {p.stem for p in DOCS.glob("*.md")}
    assert expected <= pages, sorted(expected - pages)
    # autodoc found the docstrings (an import failure is a warning, but say it plainly)
    assert "FusedCommBuffer" in (docs_build.html / "reference.html").read_text()
