"""Every file of the repository that the README, BENCHMARKS.md, CHANGELOG.md or a docs page
names (``tests/...``, ``scripts/...``, ``examples/...``, ``mpifusion/...``,
``benchmarks/...``) exists, so a renamed test or script cannot leave the docs pointing at
nothing (the test files were renamed by subject once, and the pages named the old files)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md",
         *sorted((ROOT / "docs").glob("*.md"))]
#: a path in the repository: a known top folder, then path characters, ending in a file name
#: with an extension (``::test_name`` after it is allowed and dropped)
PATH = re.compile(r"(?<![\w/.-])((?:tests|scripts|examples|mpifusion|benchmarks)/"
                  r"[\w./-]*\w\.(?:py|sh|json|txt|png|sbatch|md))\b")


def named_paths() -> dict:
    found: dict = {}
    for page in PAGES:
        for match in PATH.finditer(page.read_text(encoding="utf-8")):
            found.setdefault(match.group(1), page.name)
    return found


def test_the_pages_name_files():
    assert len(named_paths()) > 20


def test_every_named_file_exists():
    missing = {path: page for path, page in named_paths().items()
               if not (ROOT / path).exists()}
    assert not missing, "\n".join(f"{page}: {path}" for path, page in sorted(missing.items()))
