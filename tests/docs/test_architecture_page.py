"""docs/architecture.md's tree is the package as it is: every module of ``mpifusion/`` is
listed, under its package, and each top-level layer imports only from the layers listed
above it (or itself), as the page says. Read from the source (AST), never by importing."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

from tests.test_module_structure import MODULES, all_imports

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
#: the lazy public-name table: ``import mpifusion`` imports nothing until a name is used
LAZY = {"mpifusion"}


def layers() -> List[Tuple[List[str], str]]:
    """The tree's top-level entries under ``mpifusion/``, in order: (names, their text)."""
    text = PAGE.read_text()
    tree = text[text.index("```\nmpifusion/\n") + 4:]
    tree = tree[:tree.index("```")]
    out: List[Tuple[List[str], str]] = []
    for line in tree.splitlines()[1:]:
        if re.match(r"^\S", line):  # examples/, benchmarks/, ...: outside the package
            break
        head = re.match(r"^  (\S.*?)(\s{2,}|$)", line)
        if head and not line.startswith("   "):
            names = [n.strip() for n in head.group(1).split()]
            out.append((names, line))
        elif out:
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
    return out


def layer_of() -> Dict[str, int]:
    """{dotted module: index of its layer on the page}."""
    where: Dict[str, int] = {}
    for i, (names, _) in enumerate(layers()):
        for name in names:
            stem = name.rstrip("/")
            stem = stem[:-3] if stem.endswith(".py") else stem
            for module in MODULES:
                parts = module.split(".")
                if len(parts) > 1 and parts[1] == stem:
                    where[module] = i
    return where


def test_every_module_is_on_the_page_under_its_package():
    blocks = {name.rstrip("/"): text for names, text in layers() for name in names}
    missing = []
    for module in MODULES:
        parts = module.split(".")
        if len(parts) == 1 or parts[-1] == "__main__":  # entry points: ``python -m``
            continue
        top = parts[1][:-3] if parts[1].endswith(".py") else parts[1]
        if len(parts) == 2:  # a top-level module or package: an entry of its own
            if not any(n.rstrip("/") in (top, top + ".py") for n in blocks):
                missing.append(module)
            continue
        block = blocks.get(top, "")
        if not re.search(rf"\b{re.escape(parts[-1])}\b", block):
            missing.append(module)
    assert not missing, f"docs/architecture.md does not list: {missing}"


def test_each_layer_imports_only_from_layers_above_it():
    where = layer_of()
    wrong = []
    for imp in all_imports():
        if imp.typing_only or imp.module in LAZY:
            continue
        a, b = where.get(imp.module), where.get(imp.target)
        if a is None or b is None:
            continue
        if b > a:
            wrong.append(f"{imp.module} (line {imp.line}) imports {imp.target}, listed below it")
    assert not wrong, "\n".join(wrong)


def test_the_page_parser_sees_every_layer():
    """The checks above can fail: the parser finds the layers, and a module of a lower
    layer imported by a higher one would be caught."""
    where = layer_of()
    assert where["mpifusion.errors"] < where["mpifusion.comm.engines"] < where[
        "mpifusion.runtime.buffer"] < where["mpifusion.tools.cli"]
    assert len(layers()) >= 10
