"""The user pages read as pages for users: their sentences are short, and they cite no test
file and no issue number (what the tests check, and the history, live in docs/development.md
and CHANGELOG.md).

The user pages are every page of docs/ but development.md, architecture.md and the generated
benchmarks.md (tests/docs/pages.py, ``user_pages``), each read as its reader sees it: with
its ``{include}`` directives resolved.

**How sentence length is measured** (tests/docs/pages.py). First the prose is taken from the
Markdown: fenced blocks (code, ``{eval-rst}``, ``{toctree}``, ``{include}`` options) are
removed, except a glossary's definitions and a figure's caption; so are indented code
blocks, tables, headings, HTML comments, targets, colon-fence lines and directive options,
and the parts ``benchmarks/report.py`` generates (between ``<!-- report.py: NAME -->`` and
``<!-- report.py: end NAME -->``). A MyST role keeps the text it shows, a link its text, and
URLs are dropped. Each inline code span counts as one word, so a long command or a JSON
schema in backticks is not a long sentence, and the full stops inside it end nothing. Then
every paragraph and list item is split into sentences after ``.``, ``!`` or ``?`` (closing
brackets and quotes may follow) when white space and a capital, digit, bracket, quote or
code span come next, but not after an abbreviation such as ``e.g.``; a paragraph or list
item always ends a sentence, so a bullet without a full stop is one. A sentence's length is
its number of white-space-separated tokens holding a letter or digit. A page fails when the
median over its sentences is above :data:`MAX_MEDIAN_WORDS`."""
from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest

from tests.docs.pages import (FENCE, ROOT, prose, rendered_source, sentences, user_pages,
                              words)

#: the longest median sentence a user page may have, in words
MAX_MEDIAN_WORDS = 25
#: a file of the repository's tests: a path under tests/, a module of the tests package, or
#: a test file's name
TEST_FILE = re.compile(r"(?<![\w./-])(?:tests/[\w./-]*\w|tests\.\w[\w.]*\w|test_\w+\.py)\b")
#: an issue, pull-request or ticket number: "issue 28", "issue #28", "PR 72551", "GH-28" (a
#: bare "#2" is left alone: error messages number params and collectives so)
ISSUE = re.compile(r"\b(?:issues?|PRs?|pull requests?|tickets?)\s*#?\d+\b|\bGH-\d+\b", re.I)


def median_words(page: Path) -> float:
    lengths = [words(s) for s in sentences(prose(rendered_source(page)))]
    return statistics.median(lengths) if lengths else 0


def outside_code_blocks(page: Path) -> str:
    """What a page shows outside its fenced blocks (a user's own test file in a code block,
    ``def test_x``, is no citation), inline code included."""
    return FENCE.sub("", rendered_source(page))


def page_ids() -> list:
    return [p.name for p in user_pages()]


def test_there_are_user_pages():
    names = set(page_ids())
    assert {"getting-started.md", "oracle.md", "api.md"} <= names
    assert not names & {"development.md", "architecture.md", "benchmarks.md"}


@pytest.mark.parametrize("page", user_pages(), ids=page_ids())
def test_sentences_are_short(page):
    median = median_words(page)
    assert median <= MAX_MEDIAN_WORDS, (
        f"docs/{page.name}: the median sentence has {median} words (at most "
        f"{MAX_MEDIAN_WORDS}): split the long sentences")


@pytest.mark.parametrize("page", user_pages(), ids=page_ids())
def test_no_test_file_is_cited(page):
    cited = sorted(set(TEST_FILE.findall(outside_code_blocks(page))))
    assert not cited, (f"docs/{page.name} cites test files {cited}: say what is guaranteed, "
                       "and map it to its test in docs/development.md")


@pytest.mark.parametrize("page", user_pages(), ids=page_ids())
def test_no_issue_number_is_cited(page):
    cited = sorted(set(ISSUE.findall(outside_code_blocks(page))))
    assert not cited, f"docs/{page.name} cites issue numbers {cited}"


def test_the_measure():
    text = """# Title

The first sentence, with `a.b(c). D` in code, e.g. this, ends here. A second one
follows [with a link](x.md) and {py:func}`a role <mpifusion.x>`!

- a bullet without a full stop
- another. And two sentences

| a table | row. Not counted. |

```python
x = 1. Not prose
```
<!-- report.py: headline -->
Generated. Not counted either.
<!-- report.py: end headline -->
"""
    found = sentences(prose(text))
    assert found == [
        "The first sentence, with  CODE  in code, e.g. this, ends here.",
        "A second one follows with a link and  CODE !",
        "a bullet without a full stop", "another.", "And two sentences"], found
    assert [words(s) for s in found] == [11, 9, 6, 1, 3]


def test_the_citation_checks_see_what_they_look_for():
    assert TEST_FILE.findall("as `tests/oracle/test_x.py` runs; tests.oracle.conformance") == [
        "tests/oracle/test_x.py", "tests.oracle.conformance"]
    assert TEST_FILE.findall("see test_layout.py") == ["test_layout.py"]
    assert not TEST_FILE.findall("the tests. Then scripts/test.sh and the test suite")
    assert ISSUE.findall("measured in issue 28, Paddle PR 72551, ticket #3 and GH-12") == [
        "issue 28", "PR 72551", "ticket #3", "GH-12"]
    assert not ISSUE.findall("param #2 'extra'; [x](oracle.md#diagnosis); 64 ranks")


def test_the_pages_are_read_with_their_includes():
    page = ROOT / "docs" / "getting-started.md"
    assert "{include}" in page.read_text()
    assert "{include}" not in rendered_source(page)
