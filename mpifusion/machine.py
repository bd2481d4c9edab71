"""This machine's cache sizes and tuned defaults: the default segment size comes from here.

Segments are the pieces a buffer is reduced in. Each is summed by MPI, then scaled (and
rounded back for half precision) while still in cache, so the best size depends on the
cache: on a Xeon with 2 MiB of L2 per core, 4 MiB segments ran at 0.95-0.98x of the best raw
collective and 8 MiB ones at 1.3-2.2x; the rule is :func:`segment_rule`, BENCHMARKS.md has
the sweeps.
``mpifusion tune`` measures instead of guessing and records the winner per machine type in a
small JSON file that :func:`default_segment_bytes` prefers. Precedence, highest first:
``segment_bytes=``/``CommOptions``, ``$MPIFUSION_SEGMENT_BYTES``, the tune file, the rule.
config.py says where the tune file is (``$MPIFUSION_TUNE_FILE``) and holds the options; this
module resolves the options' defaults that depend on the machine (:func:`segment_for`).
"""
from __future__ import annotations

import errno
import functools
import json
import logging
import os
import platform
import secrets
import stat
import warnings
from typing import Any, Dict, Mapping, Optional, Tuple

from .config import CommOptions, tune_path
from .limits import loads_json, read_text

MiB = 1 << 20
#: when the cache sizes cannot be read
FALLBACK_SEGMENT_BYTES = 4 * MiB
#: the rule's bounds: smaller segments pay per-call latency, larger ones leave the cache
MIN_SEGMENT_BYTES, MAX_SEGMENT_BYTES = 2 * MiB, 16 * MiB
TUNE_VERSION = 1
#: where ``mpifusion tune`` records the segment size per machine type


def _parse_size(text: str) -> Optional[int]:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    try:
        return int(digits) * mult if digits else None
    except ValueError:
        return None


@functools.lru_cache(maxsize=None)
def cache_sizes() -> Dict[str, int]:
    """Bytes per cache level of CPU 0 (``{'L1d': ..., 'L2': ..., 'L3': ...}``), from Linux's
    sysfs, else ``os.sysconf``; empty when neither says."""
    sizes: Dict[str, int] = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        entries = []
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(base, entry, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(base, entry, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(base, entry, "size")) as f:
                size = _parse_size(f.read())
        except OSError:
            continue
        if size and kind != "Instruction":
            sizes[f"L{level}" + ("d" if kind == "Data" else "")] = size
    for key, name in (("L2", "SC_LEVEL2_CACHE_SIZE"), ("L3", "SC_LEVEL3_CACHE_SIZE")):
        if key not in sizes and name in getattr(os, "sysconf_names", {}):
            try:
                value = os.sysconf(name)
            except (OSError, ValueError):
                value = 0
            if value and value > 0:
                sizes[key] = int(value)
    return sizes


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """What a tuned value is filed under: the CPU model and its cache sizes, so every node
    of one type (sharing a home directory) reuses one calibration."""
    sizes = cache_sizes()
    return "|".join([cpu_model(), platform.machine()]
                    + [f"{k}={v}" for k, v in sorted(sizes.items())])


def segment_rule(sizes: Optional[Dict[str, int]] = None) -> int:
    """Twice the per-core L2 size (as sysfs reports it for CPU 0), rounded down to a power
    of two, within [2, 16] MiB. Measured (BENCHMARKS.md, 2 ranks): Xeon with 2 MiB L2 per
    core: 4 MiB best, 8 MiB 1.3-2.2x slower; EPYC with 1 MiB L2 per core (32 MiB L3): 2-6 MiB
    within 1.06x of the best, 1 MiB 1.37x, 8-16 MiB 1.3x. Smaller segments pay MPI's per-call
    cost, larger ones are evicted before they are scaled (or rounded back)."""
    sizes = cache_sizes() if sizes is None else sizes
    l2 = sizes.get("L2")
    if not l2:
        return FALLBACK_SEGMENT_BYTES
    pow2 = 1 << (int(2 * l2).bit_length() - 1)
    return max(MIN_SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, pow2))


#: what a tune file may hold: a few machines' entries, and segment sizes ``tune`` can write
TUNE_MAX_BYTES = 1 << 20
TUNE_MIN_SEGMENT, TUNE_MAX_SEGMENT = 4096, 1 << 40


class TuneFileError(OSError):
    """A tune file ``tune`` cannot write (says which and why); nothing was changed."""


_NO_HOME = ("'~' names no home directory here (HOME is unset and this user has none); set "
            "MPIFUSION_TUNE_FILE or XDG_CACHE_HOME to an absolute path")


def _no_home(path: str) -> bool:
    """Whether ``~`` was left unexpanded: the path would be relative to the current folder,
    a different file for ranks (and ``tune`` runs) started in different folders."""
    return path.startswith("~")


def _load_tune(path: str) -> Tuple[Dict[str, Any], Optional[str]]:
    """``(content, None)``, ``({}, None)`` when the file is missing or empty, or ``({}, why it
    is no tune file this version reads)``."""
    if _no_home(path):
        return {}, _NO_HOME
    try:  # a regular file of bounded size and depth: /dev/zero or a FIFO would hang a job
        text = read_text(path, max_bytes=TUNE_MAX_BYTES)
    except FileNotFoundError:
        return {}, None
    except UnicodeDecodeError:
        return {}, "not valid UTF-8"
    except (OSError, ValueError) as exc:
        return {}, f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
    if not text.strip():
        return {}, None
    try:
        data = loads_json(text)
    except (ValueError, RecursionError) as exc:
        return {}, f"not valid JSON ({exc})"
    if isinstance(data, dict) and "version" in data and data["version"] != TUNE_VERSION:
        return {}, f"version {data['version']!r} (this mpifusion reads version {TUNE_VERSION})"
    if not isinstance(data, dict) or not isinstance(data.get("machines"), dict):
        return {}, (f"not a tune file (expected {{\"version\": {TUNE_VERSION}, "
                    f"\"machines\": {{...}}}})")
    return data, None


def read_tune(path: Optional[str] = None) -> Dict[str, Any]:
    """The tune file's content (``{'version': 1, 'machines': {key: entry}}``); empty when it
    is missing or unreadable (a broken file must not stop training: it only sets a default)."""
    return _load_tune(os.path.expanduser(tune_path() if path is None else path))[0]


def _tuned(path: str) -> Tuple[Optional[int], Optional[str]]:
    """``(segment size recorded for this machine type or None, why the file or the entry
    was ignored or None)``."""
    if _no_home(path):
        return None, None  # no home: no tune file, as when it is missing
    data, problem = _load_tune(path)
    entry = data.get("machines", {}).get(machine_key())
    if problem is not None or entry is None:
        return None, problem
    if not isinstance(entry, dict):
        return None, (f"this machine's entry is {type(entry).__name__} {entry!r:.40}, expected "
                      f"an object with segment_bytes")
    value = entry.get("segment_bytes")
    if (isinstance(value, bool) or not isinstance(value, int)
            or not TUNE_MIN_SEGMENT <= value <= TUNE_MAX_SEGMENT):
        # 1 byte made a step 90x slower, 10**30 crashed: not what tune writes
        return None, (f"this machine's entry has segment_bytes {value!r}, expected an int "
                      f"in [{TUNE_MIN_SEGMENT}, {TUNE_MAX_SEGMENT}]")
    return value, None


def tuned_segment_bytes(path: Optional[str] = None) -> Optional[int]:
    """The segment size ``mpifusion tune`` recorded for this machine type, if any."""
    return _tuned(os.path.expanduser(tune_path() if path is None else path))[0]


#: flock errors of file systems that have no locks (Lustre mounted without ``flock``: ENOSYS;
#: NFS without a lock daemon: ENOLCK): the write goes ahead, only atomic
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", -1)}


def _lock(path: str) -> Any:
    """An exclusive ``flock`` on ``PATH.lock`` (created next to the tune file, never removed:
    removing it would let two writers lock two different files), held until the returned
    file is closed. Opened read-only: flock needs no more, so a lock file another user
    created (0644) serves every user of a shared tune file. None where there is no
    ``fcntl`` or the file system has no locks (the write is then only atomic, with a warning:
    a home on such a file system made ``tune`` fail after measuring)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    fd = os.open(path + ".lock", os.O_RDONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    lock = os.fdopen(fd, "rb")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    except OSError as exc:
        lock.close()
        if exc.errno not in _NO_FLOCK:
            raise
        warnings.warn(f"{path}: the file system has no file locks ({exc.strerror}); writing "
                      f"without a lock (tune runs writing this file at the same time may "
                      f"drop each other's entries)", RuntimeWarning, stacklevel=3)
        return None
    except BaseException:
        lock.close()
        raise
    return lock


def _temp_beside(path: str) -> Tuple[int, str]:
    """A new file in ``path``'s folder to write and rename over it, with the mode ``path``
    has (else 0666 less the umask, as ``open`` creates files): mkstemp's 0600 made a tune
    file shared by a group unreadable to everyone but the last user who ran ``tune``."""
    try:
        mode: Optional[int] = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    folder = os.path.dirname(path)
    while True:
        tmp = os.path.join(folder, f".tune-{secrets.token_hex(6)}.json")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        break
    if mode is not None:
        try:
            os.chmod(tmp, mode)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
    return fd, tmp


def write_tune(entry: Dict[str, Any], path: Optional[str] = None) -> str:
    """Record ``entry`` (with ``segment_bytes``) for this machine type; other machines'
    entries are kept. Writers of one file take turns (an exclusive lock on ``PATH.lock``,
    under which the file is read again), so concurrent ``tune`` runs of several machine types
    keep each other's entries; the file is written to a temporary file then renamed, so
    readers (who take no lock) never see half a file. A symlink is written through (the
    target is replaced, the link kept) and the file keeps its mode. A file that is no tune
    file of this version (newer, truncated, hand-broken) is :class:`TuneFileError`, not
    replaced: its entries would be lost. Returns the path."""
    path = os.path.expanduser(tune_path() if path is None else path)
    if _no_home(path):
        raise TuneFileError(f"{path}: {_NO_HOME}, or pass --output FILE; nothing was written")
    real = os.path.realpath(path)  # a link to a shared file: update (and lock) the file
    folder = os.path.dirname(real)
    os.makedirs(folder, exist_ok=True)
    if os.path.isdir(real):
        raise IsADirectoryError(21, "is a directory", path)
    lock = _lock(real)
    try:
        data, problem = _load_tune(real)
        if problem is not None:  # rewriting it would drop every entry it holds
            raise TuneFileError(f"{path}: {problem}; nothing was changed: move it away, or "
                                f"record this machine in another file with --output FILE")
        data = data or {"version": TUNE_VERSION, "machines": {}}
        data["machines"][machine_key()] = entry
        fd, tmp = _temp_beside(real)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, real)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    finally:
        if lock is not None:
            lock.close()  # releases the lock
    return path


_WARNED: set = set()


def default_segment_bytes() -> int:
    """The segment size used when neither an option nor ``$MPIFUSION_SEGMENT_BYTES`` gives
    one: the tuned value for this machine type, else :func:`segment_rule`. A tune file (or
    entry) that is ignored is logged once per process and problem: it was silent, so a
    hand-edited ``"4M"`` or a newer mpifusion's file looked used."""
    path = tune_path()
    tuned, problem = _tuned(path)
    if tuned is not None:
        return tuned
    rule = segment_rule()
    if problem is not None and (path, problem) not in _WARNED:
        _WARNED.add((path, problem))
        logging.getLogger("mpifusion").warning(
            "tune file %s ignored: %s; the default segment size is the L2 rule's %d bytes "
            "(fix or move the file, or run mpifusion tune again)", path, problem, rule)
    return rule


def segment_for(options: CommOptions) -> int:
    """The segment size ``options`` runs with, in bytes (0: one segment per buffer): its own
    ``segment_bytes``, else this machine's default for both strategies (``nonblocking`` keeps
    ``window`` of them in flight)."""
    if options.segment_bytes is not None:
        return options.segment_bytes
    return default_segment_bytes()


def default_segment_source() -> str:
    """Where :func:`default_segment_bytes` comes from (for ``mpifusion info``/logs)."""
    if tuned_segment_bytes() is not None:
        return f"tuned ({tune_path()})"
    l2 = cache_sizes().get("L2")
    return f"L2 rule (L2 {l2 // 1024} KiB)" if l2 else "fallback (cache size unknown)"
