"""The package's import structure, read from the source (AST), never by importing it.

Four rules, each assertion naming the offending modules:

1. No import cycle between mpifusion modules, counting imports inside functions too (a
   function-level import that closes a cycle only hides it). Imports under
   ``if TYPE_CHECKING:`` never run and are not counted.
2. No private name (``_x``) is imported from another module: what a module shares is public.
   Aliases (``import numpy as _np``) and private *modules* (the compiled ``_halfcast``
   kernel) are not private names.
3. No module is longer than :data:`MAX_LINES` unless its docstring says why, in a line
   starting with ``Size:``.
4. ``benchmarks/`` uses public mpifusion names only: no ``_x`` imported, and no ``mod._x``
   read through an imported mpifusion module.
"""
from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
PACKAGE = "mpifusion"
MAX_LINES = 800
#: extensions a module may be built from or shipped as (the C kernel is a module too)
MODULE_SUFFIXES = (".py", ".c", ".so", ".pyd")


@dataclass(frozen=True)
class Import:
    """One imported name: ``source`` the module it comes from, ``name`` the name taken from
    it (None for ``import x``), ``target`` the mpifusion module the import runs."""

    module: str
    line: int
    source: str
    name: Optional[str]
    target: str
    typing_only: bool


def _module_files(top: str) -> Dict[str, str]:
    """``{dotted module name: path}`` of every ``.py`` file under ``top`` (a package)."""
    out = {}
    base = os.path.dirname(top)
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, f), base)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(folder, f)
    return out


MODULES = _module_files(os.path.join(ROOT, PACKAGE))


def test_the_rules_see_the_whole_package():
    """The rules below pass vacuously on an empty module list (a wrong ROOT once did)."""
    import mpifusion.comm.engines
    assert MODULES.get("mpifusion.comm.engines") == mpifusion.comm.engines.__file__
    assert len(MODULES) > 40, sorted(MODULES)


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` names an mpifusion module or package (a ``.py`` file, a package
    folder, or a compiled extension such as ``mpifusion.arrays._halfcast``)."""
    if dotted in MODULES:
        return True
    path = os.path.join(ROOT, *dotted.split("."))
    folder, stem = os.path.split(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(n.split(".")[0] == stem and n.endswith(MODULE_SUFFIXES) for n in names)


def _is_extension(dotted: str) -> bool:
    """Whether ``dotted`` is a compiled module (built from C): private by name, but a module
    a script may time directly, as ``benchmarks/bench_halfcast.py`` does."""
    folder, stem = os.path.split(os.path.join(ROOT, *dotted.split(".")))
    return any(os.path.exists(os.path.join(folder, stem + ext)) for ext in (".c",))


def _package_of(module: str, path: str) -> str:
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _typing_only_lines(tree: ast.AST) -> Set[int]:
    """Lines of the statements under ``if TYPE_CHECKING:`` (never run)."""
    lines: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    for sub in ast.walk(stmt):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def _resolve(module: str, path: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = _package_of(module, path).split(".")
    base = parts[:len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: str) -> Iterator[Import]:
    """Every mpifusion import of ``module``, at any depth of its code."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    typing_only = _typing_only_lines(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield Import(module, node.lineno, alias.name, None, alias.name,
                                 node.lineno in typing_only)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path, node)
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                target = sub if _is_module(sub) else source
                yield Import(module, node.lineno, source, alias.name, target,
                             node.lineno in typing_only)


def all_imports() -> List[Import]:
    return [imp for module, path in sorted(MODULES.items()) for imp in imports_of(module, path)]


def import_cycles(imports: List[Import]) -> List[List[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself), each sorted; Tarjan's algorithm."""
    graph: Dict[str, Set[str]] = {m: set() for m in MODULES}
    for imp in imports:
        if not imp.typing_only and imp.target in graph and imp.target != imp.module:
            graph[imp.module].add(imp.target)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _cycle_edges(imports: List[Import], component: List[str]) -> List[str]:
    members = set(component)
    return sorted({f"{imp.module}:{imp.line} -> {imp.target}" for imp in imports
                   if not imp.typing_only and imp.module in members
                   and imp.target in members and imp.target != imp.module})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(imports: List[Import]) -> List[str]:
    """``module:line imports _x from other`` for every private name taken across modules
    (a private module, such as the compiled kernel, is not a name)."""
    out = []
    for imp in imports:
        if imp.name is None or not _private(imp.name) or imp.target == f"{imp.source}.{imp.name}":
            continue
        if imp.source != imp.module:
            out.append(f"{imp.module}:{imp.line} imports {imp.name} from {imp.source}")
    return out


def _docstring(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read(), path)) or ""


def oversized_modules() -> List[str]:
    """Modules over :data:`MAX_LINES` lines whose docstring gives no ``Size:`` reason."""
    out = []
    for module, path in sorted(MODULES.items()):
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES and not any(line.strip().startswith("Size:")
                                     for line in _docstring(path).splitlines()):
            out.append(f"{module} ({n} lines)")
    return out


def private_uses_in_script(path: str) -> List[str]:
    """Private mpifusion names a script imports, or reads through a module it imported
    (``bench._table``)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    rel = os.path.relpath(path, ROOT)
    out = []
    modules: Dict[str, str] = {}  # local name -> the mpifusion module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != PACKAGE:
                    continue
                if not _is_extension(alias.name) and any(_private(p)
                                                         for p in alias.name.split(".")):
                    out.append(f"{rel}:{node.lineno} imports {alias.name}")
                if alias.asname:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] == PACKAGE:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if (_private(alias.name) and not _is_extension(full)) or any(
                        _private(p) for p in node.module.split(".")):
                    out.append(f"{rel}:{node.lineno} imports {alias.name} from {node.module}")
                if _is_module(full):
                    modules[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            out.append(f"{rel}:{node.lineno} reads {modules[node.value.id]}.{node.attr}")
    return sorted(set(out))


def benchmark_scripts() -> List[str]:
    folder = os.path.join(ROOT, "benchmarks")
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]


# ----------------------------------------------------------------------------------- tests

def test_no_import_cycle():
    imports = all_imports()
    cycles = import_cycles(imports)
    assert not cycles, "import cycles between mpifusion modules:\n" + "\n".join(
        f"  {' <-> '.join(c)}\n    " + "\n    ".join(_cycle_edges(imports, c))
        for c in cycles)


def test_no_private_name_imported_across_modules():
    found = private_imports(all_imports())
    assert not found, "private names imported from another module:\n  " + "\n  ".join(found)


def test_no_module_over_the_size_limit_without_a_reason():
    found = oversized_modules()
    assert not found, (f"modules over {MAX_LINES} lines with no 'Size:' line in their "
                       f"docstring:\n  " + "\n  ".join(found))


def test_benchmarks_use_public_names_only():
    found = [use for path in benchmark_scripts() for use in private_uses_in_script(path)]
    assert not found, "benchmarks/ uses private mpifusion names:\n  " + "\n  ".join(found)


# ------------------------------------------------------- the checks themselves find faults

def _tree(tmp_path, files: Dict[str, str]) -> Dict[str, str]:
    pkg = tmp_path / PACKAGE
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return _module_files(str(pkg))


def test_a_cycle_behind_a_function_level_import_is_found(tmp_path, monkeypatch):
    modules = _tree(tmp_path, {
        "__init__.py": "",
        "tools/__init__.py": "",
        "tools/a.py": "from .b import run\n",
        "tools/b.py": "def run():\n    from .c import go\n",
        "tools/c.py": "def go():\n    from . import a\n",
        "tools/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from .a import run\n",
        "solo.py": "from .tools import a\n",
    })
    monkeypatch.setattr(sys.modules[__name__], "MODULES", modules)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    imports = [i for m, p in sorted(modules.items()) for i in imports_of(m, p)]
    assert import_cycles(imports) == [["mpifusion.tools.a", "mpifusion.tools.b",
                                       "mpifusion.tools.c"]]
    assert "mpifusion.tools.c:2 -> mpifusion.tools.a" in _cycle_edges(
        imports, ["mpifusion.tools.a", "mpifusion.tools.b", "mpifusion.tools.c"])


def test_private_names_are_found_but_aliases_and_private_modules_are_not(tmp_path,
                                                                          monkeypatch):
    modules = _tree(tmp_path, {
        "__init__.py": "__version__ = '1'\n",
        "arrays/__init__.py": "",
        "arrays/_kernel.c": "",
        "arrays/cast.py": "from . import _kernel as _k\nfrom .. import __version__\n"
                          "import mpifusion.arrays.util as _util\n",
        "arrays/util.py": "def _helper(): pass\ndef helper(): pass\n",
        "arrays/user.py": "from .util import _helper, helper as _h\n",
    })
    monkeypatch.setattr(sys.modules[__name__], "MODULES", modules)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    imports = [i for m, p in sorted(modules.items()) for i in imports_of(m, p)]
    assert private_imports(imports) == [
        "mpifusion.arrays.user:1 imports _helper from mpifusion.arrays.util"]


def test_private_uses_in_a_script_are_found(tmp_path, monkeypatch):
    _tree(tmp_path, {"__init__.py": "", "tools/__init__.py": "", "tools/bench.py": "",
                     "arrays/__init__.py": "", "arrays/_kernel.c": "", "arrays/_util.py": ""})
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    script = tmp_path / "bench_x.py"
    script.write_text("from mpifusion.tools import bench\n"
                      "from mpifusion.tools.bench import _DEFAULT, table\n"
                      "import numpy as np\n"
                      "bench._print_table(np._private, bench.table)\n"
                      "from mpifusion.arrays import _kernel as k, _util\n"
                      "k.run(k._slow)\n")
    assert private_uses_in_script(str(script)) == [
        "bench_x.py:2 imports _DEFAULT from mpifusion.tools.bench",
        "bench_x.py:4 reads mpifusion.tools.bench._print_table",
        "bench_x.py:5 imports _util from mpifusion.arrays",
        "bench_x.py:6 reads mpifusion.arrays._kernel._slow"]
