"""The README's "Differences from Paddle" section and its conformance text are pages of the site
too, with one source: docs/paddle-differences.md and docs/conformance.md include the README
between marker comments ({include} with start-after/end-before), so nothing is written twice
and neither copy can drift."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: page -> the README marker name it includes
PAGES = {"paddle-differences": "paddle-differences", "conformance": "conformance-page"}
INCLUDE = re.compile(r"```\{include\} \.\./README\.md\n:start-after: (.+)\n:end-before: (.+)\n```")


def markers(name: str) -> tuple:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def included(page: str) -> str:
    """The README text the page includes (between its markers), checked to be there once."""
    text = (DOCS / f"{page}.md").read_text()
    found = INCLUDE.findall(text)
    assert found == [markers(PAGES[page])], f"docs/{page}.md: {found}"
    start, end = found[0]
    readme = README.read_text()
    assert readme.count(start) == 1 and readme.count(end) == 1, (start, end)
    assert readme.index(start) < readme.index(end)
    return readme[readme.index(start) + len(start):readme.index(end)]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_page_includes_a_marked_part_of_the_readme(page):
    part = included(page)
    assert len(part.split()) > 100, part[:200]
    # the page itself does not copy the README's text
    page_text = (DOCS / f"{page}.md").read_text()
    for line in part.splitlines():
        if len(line) > 60:
            assert line not in page_text, f"docs/{page}.md copies the README: {line[:80]}"


def test_the_differences_section_is_included_whole():
    readme = README.read_text()
    section = readme[readme.index("## Differences from Paddle\n"):]
    section = section[:section.index("\n## ", 1)]
    body = section[len("## Differences from Paddle\n"):].strip()
    start, end = markers("paddle-differences")
    assert body.startswith(start) and body.endswith(end), "text outside the included part"
    assert "| what | Paddle 3.3.1 | mpifusion | why |" in included("paddle-differences")


def test_the_conformance_page_holds_the_whole_table():
    part = included("conformance")
    table_start, table_end = markers("conformance")  # what tests/oracle/conformance.py writes
    assert table_start in part and table_end in part
    assert part.strip().startswith("**Conformance.**")
    rows = [line for line in part.splitlines() if line.startswith("| ")]
    assert len(rows) > 10


def test_the_included_parts_need_no_links_fixed():
    # the README and docs/ resolve relative links differently: an included part holds none
    for page in PAGES:
        assert not re.search(r"\]\((?!https?:)[^)]+\)", included(page)), page
