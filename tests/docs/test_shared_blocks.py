"""A block that several pages show has one source: it is written once, between the marker
comments ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` of its source file, and every
other page shows it with MyST's ``{include}`` (``start-after``/``end-before`` naming the
markers). So the quick start, the API tour, the command table, "make one rank's error end
the job", the torch CPU install line and the spawn SIGABRT note cannot drift apart.

The README is the source of what it shows itself (GitHub renders no includes); a block the
README does not show lives in the docs page that tells its whole story."""
from __future__ import annotations

import re
import pytest

from tests.docs.pages import DOCS, FENCE, ROOT, include_options, rendered_source

#: block name -> (its source, relative to the repository, and the docs pages that include it)
BLOCKS = {
    "quick-start": ("README.md", ["getting-started", "index"]),
    "api-tour": ("README.md", ["api"]),
    "cli-table": ("README.md", ["cli"]),
    "rank-error": ("README.md", ["troubleshooting", "faq"]),
    "torch-install": ("README.md", ["frameworks", "oracle", "patterns-spawn"]),
    "oracle-example": ("README.md", ["oracle"]),
    "paddle-differences": ("README.md", ["paddle-differences"]),
    "conformance-page": ("README.md", ["conformance"]),
    "spawn-sigabrt": ("docs/troubleshooting.md", ["faq", "patterns-spawn"]),
}
#: every file a block could be copied into
FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
MARKER = re.compile(r"<!-- ([\w-]+):(start|end) -->")


def markers(name: str) -> tuple:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def block(name: str) -> str:
    """The text between a block's markers in its source."""
    start, end = markers(name)
    text = (ROOT / BLOCKS[name][0]).read_text(encoding="utf-8")
    return text[text.index(start) + len(start):text.index(end)]


def includes() -> dict:
    """``{(page, block name): count}`` of every marked ``{include}`` in docs/, the block
    named by the source file and markers it gives."""
    found: dict = {}
    for page in sorted(DOCS.glob("*.md")):
        for match in FENCE.finditer(page.read_text(encoding="utf-8")):
            info = match.group("info").strip()
            if not info.startswith("{include}"):
                continue
            options = include_options(match.group("body"))
            if "start-after" not in options:
                continue  # a whole generated file (_generated/environment.md)
            source = (page.parent / info[len("{include}"):].strip()).resolve()
            name = MARKER.fullmatch(options["start-after"]).group(1)
            assert options.get("end-before") == markers(name)[1], (page.name, options)
            assert source == (ROOT / BLOCKS[name][0]).resolve(), (page.name, name, source)
            found[(page.stem, name)] = found.get((page.stem, name), 0) + 1
    return found


def chunks(text: str) -> tuple:
    """The pieces of a block that a copy would repeat: its code lines of 30 characters or
    more, and its prose sentences of 60 or more (white space made single)."""
    code = []
    for match in FENCE.finditer(text):
        code += [" ".join(line.split()) for line in match.group("body").splitlines()
                 if len(line.strip()) >= 30]
    prose = " ".join(FENCE.sub(" ", text).split())
    return code, [s for s in re.split(r"(?<=[.:;])\s+", prose) if len(s) >= 60]


def copied(name: str, text: str) -> list:
    """What of a block ``text`` repeats: any of its sentences, or half or more of its code
    lines (one common line, such as ``rank = comm.Get_rank()``, is no copy)."""
    code, prose = chunks(block(name))
    text = " ".join(text.split())
    found = [s for s in prose if s in text]
    code_found = [line for line in code if line in text]
    if code and 2 * len(code_found) >= len(code):
        found += code_found
    return found


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_each_block_is_marked_once_in_its_source(name):
    text = (ROOT / BLOCKS[name][0]).read_text(encoding="utf-8")
    start, end = markers(name)
    assert text.count(start) == 1 and text.count(end) == 1, (name, BLOCKS[name][0])
    assert text.index(start) < text.index(end)
    assert len(block(name).split()) >= 5, block(name)


def test_every_marked_include_names_a_known_block_and_the_pages_include_theirs():
    expected = {(page, name): 1 for name, (_, pages) in BLOCKS.items() for page in pages}
    assert includes() == expected


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_no_block_is_copied(name):
    code, prose = chunks(block(name))
    assert code or prose, name
    source = (ROOT / BLOCKS[name][0]).resolve()
    for path in FILES:
        if path.resolve() != source:
            repeated = copied(name, path.read_text(encoding="utf-8"))
            assert not repeated, (f"{path.relative_to(ROOT)} copies the {name!r} block: "
                                  f"{repeated[0]}")


@pytest.mark.parametrize("name", sorted(n for n, (src, _) in BLOCKS.items()
                                        if src == "README.md"))
def test_readme_blocks_need_no_links_fixed(name):
    # the README and docs/ resolve relative links differently: an included part holds none
    assert not re.search(r"\]\((?!https?:|#)[^)]+\)", block(name)), name


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_the_including_pages_show_the_block(name):
    for page in BLOCKS[name][1]:
        shown = rendered_source(DOCS / f"{page}.md")
        assert block(name).strip() in shown, (name, page)


def test_the_copy_check_sees_what_a_copy_repeats():
    assert chunks("```bash\npip install torch==2.13.0 --index-url https://x/whl/cpu\n```\n") == (
        ["pip install torch==2.13.0 --index-url https://x/whl/cpu"], [])
    assert chunks("A sentence that is long enough to be a piece of a block, surely. Short.") == (
        [], ["A sentence that is long enough to be a piece of a block, surely."])
    line = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert copied("torch-install", f"Run\n\n    {line}\n") == [line]
    assert copied("api-tour", "rank, nranks = comm.Get_rank(), comm.Get_size()") == []
    assert copied("api-tour", block("api-tour"))
