"""Every importable name the README and the docs pages write out in backticks resolves: each
backticked token of the form ``mpifusion.a.b.c`` (in an inline code span or a MyST role,
shown text and target alike, ``{py:func}`text <mpifusion.x>```), outside fenced blocks,
resolves as Python reads it: each part is an attribute of what comes before it, or else a
submodule of it, imported (``mpifusion.oracle.check`` is the function the package exports).
A reader who types the name gets the thing; a name left behind by a rename fails here, with
the page that names it. File names (``scripts/mpifusion.sbatch``) are not names."""
from __future__ import annotations

import importlib
import re
import types

import pytest

from tests.docs.pages import CODE_SPAN, FENCE, ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: a dotted name starting at ``mpifusion``, not inside a path (``scripts/mpifusion.sbatch``)
#: or a longer word
NAME = re.compile(r"(?<![\w./-])mpifusion(?:\.\w+)+")
#: what ends a file's name rather than a Python name
FILE_SUFFIXES = {"sbatch", "py", "sh", "md", "json", "txt", "toml", "cfg", "npz", "png", "svg",
                 "log", "out", "lock", "c", "so"}


def named(text: str) -> list:
    """The ``mpifusion.*`` names of a page's inline code spans and roles."""
    found = []
    for span in CODE_SPAN.finditer(FENCE.sub("", text)):
        for match in NAME.finditer(span.group(2)):
            name = match.group(0)
            if name.rsplit(".", 1)[1] not in FILE_SUFFIXES:
                found.append(name)
    return found


def resolve(name: str):
    """The object ``name`` names, as Python reads the dotted name after importing its
    modules: from ``mpifusion``, each part is the attribute of that name, else the submodule
    of that name, imported. Raises ImportError or AttributeError when it names nothing."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, types.ModuleType):
            obj = importlib.import_module(".".join(parts[:i]))  # a submodule not yet imported
        else:
            raise AttributeError(f"{'.'.join(parts[:i - 1])} has no attribute {part!r}")
    return obj


def names_by_page() -> dict:
    found: dict = {}
    for page in PAGES:
        for name in named(page.read_text(encoding="utf-8")):
            found.setdefault(name, set()).add(page.relative_to(ROOT).as_posix())
    return found


def test_the_pages_name_many_things():
    names = names_by_page()
    assert len(names) > 40, sorted(names)
    assert "mpifusion.oracle.check" in names and "mpifusion.capture.torch.spawn" in names


def test_every_named_thing_resolves():
    broken = []
    for name, pages in sorted(names_by_page().items()):
        try:
            resolve(name)
        except (ImportError, AttributeError) as err:
            broken.append(f"{name} ({', '.join(sorted(pages))}): {type(err).__name__}: {err}")
    assert not broken, "names in the docs that resolve to nothing:\n" + "\n".join(broken)


def test_the_collector_and_the_resolver():
    text = ("`mpifusion.oracle.check(spec, dumps)`, {py:func}`run <mpifusion.comm.release>`, "
            "`scripts/mpifusion.sbatch`, `mpifusion.sbatch: error`, `python -m mpifusion run`\n"
            "```python\nimport mpifusion.not_a_module\n```\n")
    assert named(text) == ["mpifusion.oracle.check", "mpifusion.comm.release"]
    assert resolve("mpifusion.oracle.check") is importlib.import_module("mpifusion.oracle").check
    for missing in ("mpifusion.oracle.no_such_name", "mpifusion.no_such_module.x"):
        with pytest.raises((ImportError, AttributeError)):
            resolve(missing)
