"""The site stands alone: its front page sends readers to its own pages (not to the README),
every page is in a toctree, and the README links into the site's pages, new ones included."""
from __future__ import annotations

import re
from pathlib import Path

from tests.docs.pages import rendered_source

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
INDEX = DOCS / "index.md"
NEW_PAGES = ("concepts", "glossary", "faq", "environment", "paddle-differences", "conformance")


def toctree_entries() -> list:
    entries = []
    for block in re.findall(r"```\{toctree\}\n(.*?)```", INDEX.read_text(), re.S):
        entries += [line.strip() for line in block.splitlines()
                    if line.strip() and not line.startswith(":")]
    return entries


def test_every_page_is_in_the_toctree_once():
    entries = toctree_entries()
    assert len(entries) == len(set(entries)), entries
    pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
    assert pages <= set(entries), sorted(pages - set(entries))
    assert set(entries) <= pages, sorted(set(entries) - pages)


def test_the_front_page_does_not_send_readers_to_the_readme():
    # what the reader sees: the quick start it includes from the README names no README
    text = rendered_source(INDEX)
    assert "README" not in text
    for page in ("concepts", "paddle-differences", "glossary", "faq"):
        assert f"]({page}.md)" in text, page


def test_the_readme_links_into_the_site():
    readme = (ROOT / "README.md").read_text()
    links = set(re.findall(r"\]\(docs/([\w-]+)\.md(?:#[\w-]+)?\)", readme))
    assert set(NEW_PAGES) <= links, sorted(set(NEW_PAGES) - links)
    missing = [page for page in links if not (DOCS / f"{page}.md").exists()]
    assert not missing, missing
