"""Bounds on what a user can feed in: files, JSON and sizes that fit this machine.

Everything a tool reads from a user is checked here before any large allocation or blocking
call: only regular files are opened (a FIFO or a device named like a spec or dump would block
or never end), JSON is bounded in bytes, nesting depth and integer digits, and a planned run
is compared with the memory this machine has. Each check raises :class:`InputLimitError` (a
``FusionError`` and a ``ValueError``) with one line saying what was expected.
"""
from __future__ import annotations

import json
import os
import re
import stat
from typing import Any, BinaryIO, Callable, Optional

from .errors import InputLimitError  # noqa: F401 (raised here, defined with the others)

#: a spec or layout JSON file larger than this is refused (a GPT-scale spec is ~100 KiB)
MAX_JSON_BYTES = 256 << 20
#: deeper nesting than this is refused before parsing (specs and layouts are 4 deep)
MAX_JSON_DEPTH = 64
#: an integer literal with more digits than this is refused (2**63 has 19)
MAX_INT_DIGITS = 20
#: the largest element count or size a spec may state (numpy indexes with int64)
MAX_INT = (1 << 63) - 1
#: the most elements a param may have: its float64 copies must stay under numpy's 2**63 bytes
#: (zero dims count as 1: numpy refuses such shapes even when empty)
MAX_ELEMENTS = 1 << 59


def shape_too_large(shape: Any) -> bool:
    """True when numpy could not hold a float64 array of ``shape`` (zero dims count as 1)."""
    total = 1
    for dim in shape:
        total *= max(int(dim), 1)
        if total > MAX_ELEMENTS:
            return True
    return len(shape) > 64
#: most (param, rank) slice entries ``mpifusion layout`` lists for a reduce_scatter layout
MAX_LAYOUT_ENTRIES = 1 << 20




def layout_problem(nparams: int, nranks: int) -> Optional[str]:
    """Why a reduce_scatter layout of ``nparams`` params over ``nranks`` ranks is too large
    to list (one slice per param and rank), or None."""
    entries = nparams * nranks
    if entries <= MAX_LAYOUT_ENTRIES:
        return None
    return (f"nranks {nranks}: a reduce_scatter layout lists each param's slice on every rank, "
            f"{nparams} param(s) x {nranks} ranks = {entries} entries, more than the "
            f"{MAX_LAYOUT_ENTRIES} it prints (at most {max(1, MAX_LAYOUT_ENTRIES // nparams)} "
            f"ranks for this model)")


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``1.5 KiB``; powers of 1024 up to EiB."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.3g} EiB"


def open_regular(path: str) -> BinaryIO:
    """Open ``path`` for reading if (after symlinks) it is a regular file.

    The type is checked before opening, the file is opened with ``O_NONBLOCK`` (so a FIFO
    swapped in meanwhile cannot block the open) and checked again on the open descriptor.
    Raises ``OSError`` (``strerror`` says why) for anything else: FIFOs, devices such as
    ``/dev/zero``, directories, sockets.
    """
    st = os.stat(path)  # follows symlinks: a link to /dev/zero is a device
    if not stat.S_ISREG(st.st_mode):
        raise OSError(0, f"not a regular file ({_kind(st.st_mode)})", path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, f"not a regular file ({_kind(st.st_mode)})", path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def read_text(path: str, max_bytes: int = MAX_JSON_BYTES) -> str:
    """A regular file's text (UTF-8), at most ``max_bytes``; ``OSError``/``UnicodeDecodeError``
    for unreadable files, :class:`InputLimitError` for larger ones."""
    with open_regular(path) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputLimitError(f"larger than {format_bytes(max_bytes)} (not a spec or layout)")
    return data.decode("utf-8")


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` in JSON text (strings skipped), in one pass."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub('""', text)):
        if m.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


def _parse_int(literal: str) -> int:
    digits = len(literal.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise InputLimitError(f"an integer with {digits} digits (more than any size or count "
                              f"here: at most {MAX_INT_DIGITS})")
    return int(literal)


def loads_json(text: str, **hooks: Callable) -> Any:
    """``json.loads`` bounded in depth and integer size; every failure is an
    :class:`InputLimitError` or ``json.JSONDecodeError`` with a one-line message
    (``hooks``: ``object_pairs_hook``, ``parse_constant``)."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise InputLimitError(f"not valid JSON here: nested {depth} deep (at most "
                              f"{MAX_JSON_DEPTH})")
    try:
        return json.loads(text, parse_int=_parse_int, **hooks)
    except RecursionError:  # cannot happen below MAX_JSON_DEPTH; kept as a guard
        raise InputLimitError("not valid JSON here: nested too deeply") from None


def loads_strict_json(text: str, error: Callable[[str], Exception]) -> Any:
    """:func:`loads_json` refusing what ``json.loads`` lets through silently: a key twice in
    one object (the last would win) and NaN/Infinity (not JSON). ``error`` builds the
    one-line exception (the caller's own: ``SpecError``, ``LayoutDocError``)."""

    def pairs(items: list) -> dict:
        out: dict = {}
        for key, value in items:
            if key in out:
                raise error(f"duplicate key {json.dumps(key, ensure_ascii=False)} in a JSON "
                            f"object")
            out[key] = value
        return out

    def constant(name: str) -> Any:
        raise error(f"not valid JSON: {name} is not allowed")

    return loads_json(text, object_pairs_hook=pairs, parse_constant=constant)


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> Optional[int]:
    """Room left under a cgroup v2 memory limit (containers, Slurm jobs), if any."""
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            current = int(f.read().strip())
        return max(0, int(limit) - current)
    except (OSError, ValueError):
        return None


def available_memory() -> Optional[int]:
    """Bytes this process could still allocate, as far as the system says (None: unknown):
    the smallest of free memory, a cgroup limit and an address-space rlimit."""
    found = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            found.append(int(soft))
    except (ImportError, ValueError, OSError):
        pass
    return min(found) if found else None


def memory_problem(need: int, what: str, ranks_here: int = 1, detail: str = "",
                   available: Optional[int] = None) -> Optional[str]:
    """A one-line message when ``need`` bytes per rank times the ``ranks_here`` ranks on
    this machine exceed what it has available, else None (also when unknown)."""
    available = available_memory() if available is None else available
    if available is None or need * ranks_here <= available:
        return None
    share = (f" ({format_bytes(available // ranks_here)} for each of its {ranks_here} ranks)"
             if ranks_here > 1 else "")
    detail = f" ({detail})" if detail else ""
    return (f"{what} needs about {format_bytes(need)} of memory per rank{detail}, but this "
            f"machine has {format_bytes(available)} available{share}")
