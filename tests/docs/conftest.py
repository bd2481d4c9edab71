"""The documentation site, built once per test run and shared by the tests that read it
(test_docs_build.py checks the build, test_reference_complete.py its inventory)."""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import run_cmd

DOCS = Path(__file__).resolve().parents[2] / "docs"


@dataclass
class DocsBuild:
    """A finished build: ``html`` is its output folder, ``returncode`` and ``output`` what
    sphinx-build ended with and printed."""

    html: Path
    returncode: int
    output: str


@pytest.fixture(scope="session")
def docs_build(tmp_path_factory) -> DocsBuild:
    """``sphinx-build -n -W --keep-going``: warnings are errors, and ``-n`` (nitpicky, here
    only: a plain build of the docs stays as the README says) makes every unresolved Python
    cross-reference one too, which a plain build passes silently (a ``{py:func}`` role naming
    nothing renders as code, not a link). ``--keep-going`` still writes the pages and the
    inventory, so the other tests can say what is missing rather than only that it failed."""
    for module in ("sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("docs")
    proc = run_cmd([sys.executable, "-m", "sphinx", "-n", "-W", "--keep-going", "-q",
                    "-b", "html", "-d", out / "doctrees", DOCS, out / "html"], timeout=600)
    return DocsBuild(out / "html", proc.returncode, proc.stdout[-3000:] + proc.stderr[-8000:])
