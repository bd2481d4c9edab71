"""The docs' user pages as a reader sees them: which pages they are, their Markdown with every
``{include}`` resolved, and their prose (what is left once code, tables, directives and
markup are taken out), split into sentences. Shared by the tests of tests/docs/ that read
the pages' text rather than the built site."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: the pages written for the project's own developers, and the generated one (its tables
#: come from benchmarks/results/): not user pages
NOT_USER_PAGES = {"development.md", "architecture.md", "benchmarks.md"}


def user_pages() -> list:
    return [p for p in sorted(DOCS.glob("*.md")) if p.name not in NOT_USER_PAGES]


#: a fenced block: its fence, its info string (``python``, ``{include} ../README.md``), its body
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$",
                   re.S | re.M)
#: a directive's option line (``:start-after: <!-- x:start -->``)
OPTION = re.compile(r"^:([\w-]+):[ \t]*(.*)$", re.M)


def include_options(body: str) -> dict:
    return {m.group(1): m.group(2).strip() for m in OPTION.finditer(body)}


def included_text(page: Path, target: str, options: dict) -> str:
    """The text an ``{include}`` of ``target`` in ``page`` puts there (its ``start-after`` and
    ``end-before`` applied, as MyST applies them), itself with its includes resolved."""
    path = (page.parent / target).resolve()
    text = (generated_text(path) if path.parent == DOCS / "_generated"
            else path.read_text(encoding="utf-8"))
    if "start-after" in options:
        text = text.split(options["start-after"], 1)[1]
    if "end-before" in options:
        text = text.split(options["end-before"], 1)[0]
    return resolve_includes(text, path)


def load_ext(name: str):
    """A module of the docs build's own extensions (``docs/_ext``), imported as conf.py does."""
    import importlib
    import sys

    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(DOCS / "_ext"))


def generated_text(path: Path) -> str:
    """A page the docs build generates (``docs/_generated/``), made as the build makes it:
    a fresh checkout has none until the site is built."""
    if path.name == "environment.md":
        return load_ext("generated").environment_table()
    raise FileNotFoundError(f"{path}: not a page the docs build generates as text")


def resolve_includes(text: str, page: Path) -> str:
    """``text`` (of ``page``) with each ``{include}`` directive replaced by what it includes."""
    def replace(match: re.Match) -> str:
        info = match.group("info").strip()
        if not info.startswith("{include}"):
            return match.group(0)
        target = info[len("{include}"):].strip()
        return "\n" + included_text(page, target, include_options(match.group("body"))) + "\n"
    return FENCE.sub(replace, text)


def rendered_source(page: Path) -> str:
    """The page's Markdown with its includes resolved: all the text its reader sees."""
    return resolve_includes(page.read_text(encoding="utf-8"), page)


# ---- prose -------------------------------------------------------------------------------

#: a MyST role (``{py:func}`text <target>```, ``{term}`micro-step```): the text it shows
ROLE = re.compile(r"\{(?:py:\w+|term|doc|ref|any|abbr|download|math)\}`([^`]*)`")
CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[([^\]]*)\]\([^)\s]*\)")
URL = re.compile(r"<?https?://[^\s)>]+>?")
#: a part benchmarks/report.py writes into a page (not written by hand)
GENERATED = re.compile(r"<!-- report\.py: ([\w -]+?) -->.*?<!-- report\.py: end \1 -->", re.S)
#: the placeholder one inline code span becomes: one word, no sentence end inside
CODE_WORD = "CODE"


def _fenced_prose(match: re.Match) -> str:
    """What of a fenced block is prose: a glossary's definitions and a figure's caption (their
    option lines and a glossary's term lines dropped); of anything else, nothing."""
    info, body = match.group("info").strip(), match.group("body")
    if info.startswith("{glossary}"):
        # term lines start at the margin, their definitions are indented: one paragraph each
        return "\n" + "\n".join(line.strip() if line.startswith((" ", "\t")) else ""
                                for line in body.splitlines()) + "\n"
    if info.startswith("{figure}"):
        return "\n" + OPTION.sub("", body) + "\n"
    return "\n\n"


def _role_text(match: re.Match) -> str:
    shown = match.group(1)
    shown = re.sub(r"\s*<[^>]*>$", "", shown)  # ``text <target>``: the text
    return f"`{shown}`"


def prose(text: str) -> str:
    """The prose of a page's Markdown: the parts benchmarks/report.py generates removed; fenced blocks (code, ``{eval-rst}``, ``{toctree}``)
    removed except a glossary's definitions and a figure's caption; indented code blocks,
    tables, headings, HTML comments, targets (``(name)=``), colon-fence lines and directive
    options removed; a role keeps the text it shows, a link its text; each inline code span
    becomes the one word ``CODE``; URLs are removed; emphasis markers are dropped."""
    text = GENERATED.sub("", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = FENCE.sub(_fenced_prose, text)
    text = ROLE.sub(_role_text, text)
    text = CODE_SPAN.sub(f" {CODE_WORD} ", text)
    kept, previous_blank, in_list, in_code = [], True, False, False
    for line in text.splitlines():
        stripped = line.strip()
        if re.match(r"\s*([-*+]|\d+[.)])\s", line):
            in_list = True
        elif stripped and not line.startswith((" ", "\t")):
            in_list = False
        # an indented code block: indented 4, after a blank line (or more of it), not in a list
        in_code = bool(stripped) and line.startswith("    ") and not in_list and (
            previous_blank or in_code)
        previous_blank = not stripped
        if (in_code or stripped.startswith(("|", "#", ":::", "```"))
                or re.fullmatch(r"\([\w-]+\)=", stripped) or OPTION.fullmatch(stripped)):
            kept.append("")  # a code line, table row, heading, fence, target or option
            continue
        kept.append(line)
    text = "\n".join(kept)
    text = LINK.sub(r"\1", text)
    text = URL.sub("", text)
    text = re.sub(r"(\*\*|__|\*(?=\S)|(?<=\S)\*)", "", text)
    text = re.sub(r"^\s*>\s?", "", text, flags=re.M)
    return text


#: words that end in a full stop without ending a sentence
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.", "No.", "Fig.", "Eq.")
#: a sentence ends at ``.``, ``!`` or ``?`` (closing brackets and quotes may follow), then
#: white space, then what starts a sentence: a capital, a digit, an opening bracket or quote,
#: or a code span
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z0-9\"'(\[])")


def units(text: str) -> list:
    """The paragraphs and list items of prose: each is one or more whole sentences."""
    found, current = [], []
    for line in text.splitlines():
        item = re.match(r"\s*(?:[-*+]|\d+[.)])\s+(.*)", line)
        if not line.strip() or item:
            if current:
                found.append(" ".join(current))
            current = [item.group(1)] if item else []
        else:
            current.append(line.strip())
    if current:
        found.append(" ".join(current))
    return found


def sentences(text: str) -> list:
    """The sentences of prose (see :func:`prose`): each paragraph or list item split after a
    sentence end (:data:`SENTENCE_END`), but not after an abbreviation (``e.g.``)."""
    found = []
    for unit in units(text):
        start = 0
        for match in SENTENCE_END.finditer(unit):
            before = unit[start:match.start()].rstrip("\"')]")
            if before.endswith(ABBREVIATIONS):
                continue
            found.append(unit[start:match.start()].strip())
            start = match.end()
        found.append(unit[start:].strip())
    return [s for s in found if words(s)]


def words(sentence: str) -> int:
    """The words of a sentence: its white-space-separated tokens that hold a letter or digit
    (an inline code span is one)."""
    return sum(1 for token in sentence.split() if re.search(r"\w", token))
