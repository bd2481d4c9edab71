"""docs/reference.md documents the whole public API, and the guide pages link to it.

The public API is computed here, never copied: the ``__all__`` of ``mpifusion``,
``mpifusion.oracle``, ``mpifusion.capture`` (and of each of its adapter modules),
``mpifusion.comm`` and ``mpifusion.spec``; every pytest fixture and every exception class
the package defines (but the command line's own, which reach a user as exit messages); and
the public methods and properties of each public class, inherited ones included (the
buffer's ``sync_params`` comes from a private base class, which autodoc skips unless told).

Each of them must have a docstring that names every parameter, and must be in the built
reference (the Sphinx inventory of tests/docs/conftest.py's build, ``objects.inv``: what
autodoc documented, a name without a docstring is dropped silently). On the guide pages,
the first mention of a public name in each section is a cross-reference to it (a
``{py:class}`` role and the like), and every such role names something the reference has.
"""
from __future__ import annotations

import enum
import functools
import importlib
import importlib.util
import inspect
import io
import pkgutil
import re
import types
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: the packages whose ``__all__`` lists public names
PACKAGES = ("mpifusion", "mpifusion.oracle", "mpifusion.capture", "mpifusion.comm",
            "mpifusion.spec")
#: a package whose public submodules each declare their public names in ``__all__``
ADAPTERS = "mpifusion.capture"
#: the command line's modules: their errors are turned into exit messages, not raised to
#: a caller
CLI = ("mpifusion.tools", "mpifusion.__main__")
#: where the reference is
REFERENCE = "reference.html"
#: the guide pages whose prose links each public name it mentions to the reference (the
#: first mention per section)
GUIDE_PAGES = ("api.md", "getting-started.md", "oracle.md", "patterns-spawn.md",
               "patterns-steps.md", "patterns-in-rank.md", "frameworks.md",
               "state-machine.md", "troubleshooting.md", "exactness.md", "cli.md")


# ----------------------------------------------------------------------------- the API

def package_modules() -> List[types.ModuleType]:
    """Every module of mpifusion but the command line's, imported (no MPI is started: the
    package imports mpi4py's MPI, which initialises lazily as everywhere else)."""
    root = importlib.import_module("mpifusion")
    found, todo = [root], [root]
    while todo:
        package = todo.pop()
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            private = any(part.startswith("_") for part in info.name.split("."))
            if private or info.name.startswith(CLI):
                continue
            module = importlib.import_module(info.name)
            found.append(module)
            if info.ispkg:
                todo.append(module)
    return found


def is_fixture(obj: object) -> bool:
    """A pytest fixture (pytest 8.4+ wraps it in an object of its own, older ones mark the
    function)."""
    return (getattr(obj, "_fixture_function_marker", None) is not None
            or getattr(obj, "_pytestfixturefunction", None) is not None)


def is_exception(obj: object) -> bool:
    return inspect.isclass(obj) and issubclass(obj, (BaseException, Warning))


@functools.lru_cache(maxsize=None)
def public_names() -> Dict[str, object]:
    """``{dotted public path: object}``."""
    names: Dict[str, object] = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            names[f"{package}.{name}"] = getattr(module, name)
    adapters = importlib.import_module(ADAPTERS)
    for info in pkgutil.iter_modules(adapters.__path__, ADAPTERS + "."):
        if info.name.rpartition(".")[2].startswith("_"):
            continue
        module = importlib.import_module(info.name)
        assert hasattr(module, "__all__"), f"{info.name} lists no public names (__all__)"
        for name in module.__all__:
            names[f"{info.name}.{name}"] = getattr(module, name)
    for module in package_modules():
        for name, obj in vars(module).items():
            if name.startswith("_"):
                continue
            defined_here = getattr(obj, "__module__", None) == module.__name__
            if is_fixture(obj) or (is_exception(obj) and defined_here):
                names.setdefault(f"{module.__name__}.{name}", obj)
    return names


def canonical(obj: object) -> str:
    """Where a class or function is defined (autodoc records a class there too)."""
    if is_fixture(obj):
        obj = getattr(obj, "__wrapped__", None) or getattr(obj, "_get_wrapped_function",
                                                           lambda: obj)()
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else ""


def is_code(obj: object) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj) or is_fixture(obj)


@functools.lru_cache(maxsize=None)
def public_objects() -> List[Tuple[object, Tuple[str, ...]]]:
    """Each public object once, with every path it is public under (one object exported
    by two packages, such as ``CommTask``, is documented once)."""
    by_key: Dict[object, Tuple[object, set]] = {}
    for path, obj in public_names().items():
        key = id(obj) if is_code(obj) else path
        by_key.setdefault(key, (obj, set()))[1].add(path)
    out = []
    for obj, paths in by_key.values():
        if is_code(obj) and canonical(obj):
            paths.add(canonical(obj))
        out.append((obj, tuple(sorted(paths))))
    return out


def first_path(paths: Tuple[str, ...]) -> str:
    public = [p for p in paths if p in public_names()]
    return min(public or paths, key=len)


def own_doc(obj: object) -> str:
    """The docstring written for ``obj`` itself (a class does not inherit its base's)."""
    if inspect.isclass(obj):
        return obj.__dict__.get("__doc__") or ""
    if isinstance(obj, property):
        return (obj.fget.__doc__ if obj.fget else "") or ""
    if isinstance(obj, (classmethod, staticmethod)):
        return obj.__func__.__doc__ or ""
    return getattr(obj, "__doc__", None) or ""


@functools.lru_cache(maxsize=None)
def attribute_docs(module: str) -> dict:
    """``{(class qualname or "", name): comment}``: the ``#:`` comments and docstrings of
    variables, as autodoc reads them."""
    if importlib.util.find_spec("sphinx") is None:
        pytest.skip("sphinx is not installed (pip install -e '.[docs]')")
    from sphinx.pycode import ModuleAnalyzer

    try:
        return ModuleAnalyzer.for_module(module).find_attr_docs()
    except Exception:  # noqa: BLE001 - no source: nothing documented
        return {}


def data_doc(path: str) -> str:
    module, _, name = path.rpartition(".")
    return "\n".join(attribute_docs(module).get(("", name), []))


def members(cls: type) -> Dict[str, Tuple[type, object]]:
    """``{name: (class that defines it, value)}``: the public methods, properties and
    nested classes of ``cls``, its own and those inherited from mpifusion's classes (not
    Python's: ``Exception.with_traceback``, ``Enum.name`` ...)."""
    out = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is None or not owner.__module__.startswith("mpifusion"):
            continue
        value = owner.__dict__[name]
        if (inspect.isfunction(value) or inspect.isclass(value)
                or isinstance(value, (property, classmethod, staticmethod,
                                      functools.cached_property))):
            out[name] = (owner, value)
    return out


def public_classes() -> Iterator[Tuple[type, Tuple[str, ...]]]:
    """The public classes, exceptions included (``SpecError.within`` is public too)."""
    for obj, paths in public_objects():
        if inspect.isclass(obj):
            yield obj, paths


def paths_of(cls: type) -> Tuple[str, ...]:
    """Where a class is documented if it is public (its public paths), else nowhere."""
    for obj, paths in public_objects():
        if obj is cls:
            return paths
    return ()


def signature_params(func: object) -> List[str]:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    return [n for n in sig.parameters if n not in ("self", "cls")]


def constructor(cls: type) -> Tuple[object, str]:
    """The ``__init__`` that builds ``cls`` if mpifusion wrote it (or a dataclass made it),
    and the docstrings that describe its arguments."""
    if issubclass(cls, enum.Enum):
        return None, ""
    owner = next((c for c in cls.__mro__ if "__init__" in c.__dict__), object)
    if not owner.__module__.startswith("mpifusion"):
        return None, ""
    init = owner.__dict__["__init__"]
    return init, own_doc(cls) + "\n" + (init.__doc__ or "")


#: a Google-style section of arguments, and its entries (``name:`` or ``name (type):``)
ARGS_SECTION = re.compile(r"^([ \t]*)(?:Args|Arguments|Parameters):[ \t]*$"
                          r"((?:\n(?:\1[ \t]+\S.*|[ \t]*$))*)", re.M)
ARGS_ENTRY = re.compile(r"^[ \t]+\**(\w+)(?: \(.*?\))?:", re.M)


def undescribed(params: List[str], doc: str) -> List[str]:
    """The parameters ``doc`` does not describe: with an ``Args:`` section, those without an
    entry there; without one, those the prose never names."""
    sections = [body for _, body in ARGS_SECTION.findall(inspect.cleandoc(doc))]
    if sections:
        entries = set()
        for body in sections:  # entries at the section's first indent (not continuations)
            indent = min(len(ln) - len(ln.lstrip()) for ln in body.split("\n") if ln.strip())
            entries |= {m.group(1) for m in ARGS_ENTRY.finditer(body)
                        if len(m.group()) - len(m.group().lstrip()) == indent}
        return [p for p in params if p not in entries]
    return [p for p in params if not re.search(rf"(?<![\w-]){re.escape(p)}(?![\w-])", doc)]


# ----------------------------------------------------------------------------- the build

def read_inventory(html: Path) -> Dict[str, str]:
    """``{name: uri}`` of every Python object of a build's ``objects.inv``."""
    from sphinx.util.inventory import InventoryFile

    raw = (html / "objects.inv").read_bytes()
    if hasattr(InventoryFile, "loads"):  # Sphinx 8.2+
        inv = InventoryFile.loads(raw, uri="")
        data = getattr(inv, "data", inv)
    else:
        data = InventoryFile.load(io.BytesIO(raw), "", lambda base, uri: uri)
    return {name: (item.uri if hasattr(item, "uri") else item[2])
            for kind, items in data.items() if kind.startswith("py:")
            for name, item in items.items()}


@pytest.fixture(scope="module")
def inventory(docs_build) -> Dict[str, str]:
    if not (docs_build.html / "objects.inv").exists():
        pytest.fail("the docs build wrote no objects.inv:\n" + docs_build.output)
    return {name: uri for name, uri in read_inventory(docs_build.html).items()
            if uri.partition("#")[0] == REFERENCE}


def in_reference(inventory: Dict[str, str], paths: Tuple[str, ...]) -> bool:
    return any(p in inventory for p in paths)


# ----------------------------------------------------------------------------- the tests

def test_the_public_api_is_computed():
    """The computation finds what it is meant to (else every other test passes on nothing):
    a name of each package, a capture adapter's function, the fixture, an exception that
    only its module defines, and the buffer's methods from its private base."""
    names = public_names()
    for package in PACKAGES:
        assert any(p.startswith(package + ".") for p in names), package
    assert "mpifusion.capture.torch.spawn" in names
    assert any(is_fixture(o) for o in names.values())
    assert any(is_exception(o) and p.startswith("mpifusion.errors.") for p, o in names.items())
    from mpifusion import FusedCommBuffer

    assert "sync_params" in members(FusedCommBuffer)


def test_every_public_name_has_a_docstring():
    missing = []
    for obj, paths in public_objects():
        if is_code(obj):
            doc = own_doc(obj)
        else:  # data: its ``#:`` comment where it is public
            doc = "".join(data_doc(p) for p in paths)
        if not doc.strip():
            missing.append(first_path(paths))
    assert not missing, "no docstring (autodoc leaves them out): " + ", ".join(sorted(missing))


def test_every_public_member_has_a_docstring():
    missing = set()
    for cls, paths in public_classes():
        for name, (owner, value) in members(cls).items():
            if not own_doc(value).strip():
                missing.add(f"{canonical(owner)}.{name}")
    assert not missing, "no docstring: " + ", ".join(sorted(missing))


def test_every_parameter_is_described():
    """Each argument of a public function, method or constructor is named in its docstring
    (an ``Args:`` entry, or the prose), or for a dataclass field in its ``#:`` comment."""
    gaps = []
    for obj, paths in public_objects():
        where = first_path(paths)
        if is_fixture(obj):
            continue  # its arguments are fixtures; the function it returns is described
        if inspect.isroutine(obj):
            gaps += [f"{where}({p})" for p in undescribed(signature_params(obj), own_doc(obj))]
        if not inspect.isclass(obj):
            continue
        init, doc = constructor(obj)
        if init is not None:
            fields = {name for c in obj.__mro__ if c.__module__.startswith("mpifusion")
                      for (qual, name) in attribute_docs(c.__module__)
                      if qual == c.__qualname__}
            params = [p for p in signature_params(init) if p not in fields]
            gaps += [f"{where}({p})" for p in undescribed(params, doc)]
        for name, (owner, value) in members(obj).items():
            func = getattr(value, "__func__", value)
            if inspect.isfunction(func):
                gaps += [f"{canonical(owner)}.{name}({p})"
                         for p in undescribed(signature_params(func), own_doc(value))]
    assert not gaps, "arguments their docstring does not name:\n" + "\n".join(sorted(set(gaps)))


#: a colon outside code and roles (napoleon's rule) with words after it: napoleon reads
#: the words before it as the type
TYPE_COLON = re.compile(r"(?<!:):(?!:)\s*\S")
INLINE_CODE = re.compile(r"``.+?``|(?::[\w+.:-]+:)?`.+?`")


def attribute_first_lines() -> Iterator[Tuple[str, str]]:
    """``(where, first line)`` of the docstring of each public property, documented
    attribute (a ``#:`` comment) and documented module variable."""
    for cls, paths in public_classes():
        for name, (owner, value) in members(cls).items():
            if isinstance(value, (property, functools.cached_property)):
                doc = own_doc(value) if isinstance(value, property) else value.__doc__ or ""
                yield f"{canonical(owner)}.{name}", doc.strip().split("\n")[0]
        for c in cls.__mro__:
            if c.__module__.startswith("mpifusion"):
                for (qual, name), lines in attribute_docs(c.__module__).items():
                    if qual == c.__qualname__ and lines:
                        yield f"{canonical(c)}.{name}", lines[0]
    for obj, paths in public_objects():
        if not is_code(obj):
            for path in paths:
                lines = data_doc(path).split("\n")
                yield path, lines[0]


def test_attribute_docstrings_do_not_start_with_a_type():
    """napoleon reads the first line of an attribute's or property's docstring as ``type:
    description`` when it holds a colon: "The step serial: 0 at construction" rendered as
    the type "The step serial". Such a line is rephrased (a colon inside code is fine)."""
    bad = sorted({f"{where}: {line}" for where, line in attribute_first_lines()
                  if TYPE_COLON.search(INLINE_CODE.sub("``", line))})
    assert not bad, "napoleon makes a type of the words before the colon:\n" + "\n".join(bad)


def test_every_public_name_is_in_the_reference(inventory):
    missing = [first_path(paths) for _, paths in public_objects()
               if not in_reference(inventory, paths)]
    assert not missing, f"not in {REFERENCE}: " + ", ".join(sorted(missing))


def test_every_public_member_is_in_the_reference(inventory):
    """A method is documented with its class or, inherited from a public class, with that
    one (``TorchCapture.save`` is ``Recorder.save``)."""
    missing = set()
    for cls, paths in public_classes():
        for name, (owner, _) in members(cls).items():
            where = [f"{p}.{name}" for p in paths]
            if owner is not cls:
                where += [f"{p}.{name}" for p in paths_of(owner)]
            if not in_reference(inventory, tuple(where)):
                missing.add(f"{first_path(paths)}.{name}")
    assert not missing, f"not in {REFERENCE}: " + ", ".join(sorted(missing))


def test_the_buffer_shows_what_its_private_bases_define(inventory):
    """``FusedCommBuffer``'s methods from its private bases (``sync_params`` and the other
    param-buffer calls) are on the page, under the buffer's name."""
    from mpifusion import FusedCommBuffer

    inherited = {name for name, (owner, _) in members(FusedCommBuffer).items()
                 if owner is not FusedCommBuffer and not paths_of(owner)}
    assert inherited, "FusedCommBuffer inherits nothing public from a private base any more"
    missing = sorted(n for n in inherited if f"mpifusion.FusedCommBuffer.{n}" not in inventory)
    assert not missing, f"not in {REFERENCE} (:inherited-members:?): {missing}"


# ----------------------------------------------------------------------------- the pages

#: a MyST role naming a Python object: ``{py:class}`~mpifusion.Param```, with an optional
#: title (``{py:func}`spawn <mpifusion.capture.torch.spawn>```)
ROLE = re.compile(r"\{py:(\w+)\}`([^`]+)`")
#: a role or a code span, left to right (a span never starts inside a role)
TOKEN = re.compile(r"\{py:\w+\}`(?P<role>[^`]+)`|``(?P<code2>[^`]+)``|`(?P<code>[^`\n]+)`")
HEADING = re.compile(r"^#{1,6} ", re.M)
FENCE = re.compile(r"^(```|:::).*?^\1[^\n]*$", re.S | re.M)


def role_target(text: str) -> str:
    target = text.rsplit("<", 1)[1].rstrip(">").strip() if text.rstrip().endswith(">") \
        else text
    return target.lstrip("~!.").strip()


def page_text(page: Path) -> str:
    """The page without its fenced blocks (code and transcripts name things, they do not
    link)."""
    return FENCE.sub("", page.read_text(encoding="utf-8"))


def short_names() -> Dict[str, set]:
    """``{name as prose writes it: public paths}``: each public path, and its last part
    where that cannot be an ordinary word (it has an underscore or a capital)."""
    out: Dict[str, set] = {}
    for obj, paths in public_objects():
        for path in paths:
            out.setdefault(path, set()).update(paths)
            last = path.rpartition(".")[2]
            if "_" in last.strip("_") or last != last.lower():
                out.setdefault(last, set()).update(paths)
    return out


def mentions(section: str, names: Dict[str, set]) -> Iterator[Tuple[int, bool, frozenset]]:
    """``(offset, is a role, paths)`` of each mention of a public name in ``section``."""
    for m in TOKEN.finditer(section):
        if m.group("role") is not None:
            target = role_target(m.group("role"))
            yield m.start(), True, frozenset(names.get(target, {target}))
            continue
        text = re.sub(r"\(.*\)$", "", (m.group("code") or m.group("code2")).strip())
        if text in names:
            yield m.start(), False, frozenset(names[text])


def sections(text: str) -> Iterator[Tuple[str, str]]:
    """``(heading, body)`` per section; the heading line itself is not searched (headings
    keep plain code: their anchors are linked to)."""
    starts = [m.start() for m in HEADING.finditer(text)]
    for begin, end in zip([0] + starts, starts + [len(text)]):
        heading, _, body = text[begin:end].partition("\n")
        if not HEADING.match(heading):
            heading, body = "(top)", text[begin:end]
        yield heading, body


def test_guide_pages_link_the_first_mention_of_each_public_name():
    names = short_names()
    unlinked = []
    for page in GUIDE_PAGES:
        for heading, body in sections(page_text(DOCS / page)):
            seen = set()
            for _, is_role, paths in sorted(mentions(body, names), key=lambda m: m[0]):
                if paths in seen:
                    continue
                seen.add(paths)
                if not is_role:
                    unlinked.append(f"{page}: {heading.strip()}: {first_path(tuple(paths))}")
    assert not unlinked, ("the first mention in a section is plain code, not a link to the "
                          "reference (e.g. {py:class}`~mpifusion.Param`):\n"
                          + "\n".join(unlinked))


def test_every_role_of_the_pages_is_in_the_reference(inventory):
    """Every ``{py:...}`` role of a docs page names an object of the reference (a plain
    build renders an unresolved one as code, silently; the nitpicky build fails on it)."""
    broken = []
    for page in sorted(DOCS.glob("*.md")):
        for m in ROLE.finditer(page_text(page)):
            if role_target(m.group(2)) not in inventory:
                broken.append(f"{page.name}: {m.group(0)}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("text, target", [
    ("~mpifusion.Param", "mpifusion.Param"),
    ("spawn <mpifusion.capture.torch.spawn>", "mpifusion.capture.torch.spawn"),
    ("mpifusion.oracle.check", "mpifusion.oracle.check"),
])
def test_role_target(text, target):
    assert role_target(text) == target


def test_a_plain_first_mention_is_found():
    names = {"Param": {"mpifusion.Param"}, "mpifusion.Param": {"mpifusion.Param"}}
    body = ("Wrap it in `Param(name, array)`, then {py:class}`~mpifusion.Param` and "
            "`Param` again.")
    found = sorted(mentions(body, names))
    assert [is_role for _, is_role, _ in found] == [False, True, False]
    # the text between a role and a code span is not a code span
    assert [m.group("code") for m in TOKEN.finditer("{py:func}`a` and `b`")] == [None, "b"]
