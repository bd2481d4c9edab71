"""What the suite's MPI jobs leave behind: shared-memory segments, launcher files, processes.

MPICH (``/dev/shm/mpich_shm_*``, ``mpich_vci_*``; hydra's ``hydra_hwloc_xmlfile_*`` in the
temp folder) and Open MPI (``/dev/shm/sm_segment.*``, ``vader_segment.*``; its session folder
``ompi.<launcher pid>``) remove these at a clean ``MPI_Finalize``. A job that a test kills (a
time limit, a rank's SIGKILL, an abort) leaves them, about 65 per suite run before this
module: a long-lived CI runner or workstation slowly fills its ``/dev/shm``.

A *leftover* is such an entry that (1) did not exist at the snapshot taken when the run began,
(2) belongs to this user, (3) is older than a few seconds (a live job maps its segment right
after creating it), and (4) no live process maps, holds open or names in its command line or
environment (hydra's proxies name their hwloc file there, Open MPI's processes their session
folder). Nothing a live job uses can meet (4), and (1) leaves whatever was there before alone,
so removing leftovers is safe on a machine shared with other jobs and users.

Processes of a run carry ``MPIFUSION_TEST_RUN=<token>`` in their environment (scripts/test.sh
sets it; every launcher and Slurm job passes it on), so :func:`run_processes` finds those that
outlived the run without guessing by name.

Command line (scripts/test.sh)::

    python tests/leftovers.py snapshot FILE          # before the run
    python tests/leftovers.py check FILE [--token T]  # after: list, remove, exit 1 if any
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

SHM = Path("/dev/shm")
#: the MPI libraries' shared-memory segments (MPICH ch4 posix, Open MPI sm/vader, libfabric
#: shm, PSM2) and the chunks of mpifusion's own shared-memory arena (comm/shm.py), unlinked once
#: mapped: one is left only by a job killed while it made a chunk
SHM_PATTERNS = ("mpich_shm_*", "mpich_vci_*", "sm_segment.*", "vader_segment.*", "fi_sm2_*",
                "psm2_shm.*", "mpifusion.*")
#: the launchers' files in the temp folder (hydra's topology file, Open MPI's session folder)
TMP_PATTERNS = ("hydra_hwloc_xmlfile_*", "ompi.*")
#: a segment younger than this may be between its creation and its first mapping
MIN_AGE = 5.0
RUN_ENV = "MPIFUSION_TEST_RUN"
#: set to 1 by scripts/private_shm.sh inside the run's own /dev/shm
PRIVATE_ENV = "MPIFUSION_PRIVATE_SHM"


def _folders() -> List[Tuple[Path, Tuple[str, ...]]]:
    temps = {Path(tempfile.gettempdir()), Path("/tmp")}
    return [(SHM, SHM_PATTERNS)] + [(t, TMP_PATTERNS) for t in sorted(temps)]


def entries() -> List[Path]:
    """Every MPI segment and launcher file present now (any owner)."""
    found = []
    for folder, patterns in _folders():
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        found += [folder / n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    return sorted(set(found))


def snapshot() -> frozenset:
    """The entries present now, as the baseline that :func:`leftovers` compares with."""
    return frozenset(str(p) for p in entries())


def _pids() -> List[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def in_use() -> str:
    """One text holding every path that a live process maps, holds open, or names in its
    command line or environment (processes this user may not inspect add nothing; their
    own files are theirs, and :func:`leftovers` only takes this user's)."""
    parts = []
    for pid in _pids():
        base = f"/proc/{pid}"
        parts.append(_read(f"{base}/maps"))
        parts.append(_read(f"{base}/cmdline").replace("\0", "\n"))
        parts.append(_read(f"{base}/environ").replace("\0", "\n"))
        try:
            fds = os.listdir(f"{base}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                parts.append(os.readlink(f"{base}/fd/{fd}"))
            except OSError:
                pass
    return "\n".join(parts)


def _launcher_alive(path: Path) -> bool:
    """Open MPI's session folder ``ompi.<pid>`` lives as long as its launcher."""
    suffix = path.name.partition(".")[2]
    if path.name.startswith("ompi.") and suffix.isdigit():
        return os.path.exists(f"/proc/{suffix}")
    return False


def leftovers(since: Iterable[str], min_age: float = MIN_AGE) -> List[Path]:
    """Entries made after the snapshot ``since`` that no live process uses (module doc)."""
    before = set(since)
    now = time.time()
    uid = os.geteuid()
    candidates = []
    for path in entries():
        if str(path) in before:
            continue
        try:
            st = path.lstat()
        except OSError:
            continue
        if st.st_uid != uid or now - max(st.st_mtime, st.st_ctime) < min_age:
            continue
        candidates.append(path)
    if not candidates:
        return []
    used = in_use()
    return [p for p in candidates if str(p) not in used and not _launcher_alive(p)]


def remove(paths: Sequence[Path]) -> List[Path]:
    """Remove ``paths`` (files or folders); the ones removed (another sweep may race)."""
    removed = []
    for path in paths:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            sys.stderr.write(f"leftovers: cannot remove {path}: {exc}\n")
            continue
        removed.append(path)
    return removed


def sweep(since: Iterable[str], min_age: float = MIN_AGE, settle: bool = True) -> List[Path]:
    """Remove the leftovers made since the snapshot; the paths removed. With ``settle``, an
    unused entry still younger than ``min_age`` (a job killed in the session's last seconds)
    is waited for once, up to ``min_age``, and removed if no process has taken it by then:
    otherwise the end-of-run check found it, after the session that made it had ended."""
    removed = remove(leftovers(since, min_age))
    if settle and min_age > 0 and leftovers(since, 0.0):
        time.sleep(min_age)
        removed += remove(leftovers(since, min_age))
    return removed


def _ancestors() -> set:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        stat = _read(f"/proc/{pid}/stat")
        try:
            pid = int(stat.rpartition(")")[2].split()[1])
        except (IndexError, ValueError):
            break
    return pids


def run_processes(token: str) -> List[Tuple[int, str]]:
    """Live processes (not this one or its ancestors) whose environment holds
    ``MPIFUSION_TEST_RUN=<token>``: (pid, command line)."""
    mark = f"{RUN_ENV}={token}"
    skip = _ancestors()
    found = []
    for pid in _pids():
        if pid in skip:
            continue
        if mark in _read(f"/proc/{pid}/environ").split("\0"):
            cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
            if cmd:  # zombies have none and hold nothing
                found.append((pid, cmd))
    return found


def _check(args: argparse.Namespace) -> int:
    """List and end what the run left; 1 when a process or a segment was left. Launcher files
    are removed but not counted: the temp folder is shared, and hydra's file names no job."""
    since = json.loads(Path(args.snapshot).read_text())
    procs = run_processes(args.token) if args.token else []
    for pid, cmd in procs:
        print(f"leftovers: process {pid} of this run is still alive (killed): {cmd[:200]}")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if procs:
        time.sleep(1)  # let the killed ones release their segments
    found = remove(leftovers(since, args.min_age))
    for path in found:
        print(f"leftovers: removed {path} (made during this run, used by no process)")
    segments = [p for p in found if p.parent == SHM]
    if os.environ.get(PRIVATE_ENV) != "1" and segments:
        print(f"leftovers: note: {SHM} is shared with the machine's other jobs, so a dead "
              f"segment that another job of this user made during the run counts too "
              f"(scripts/private_shm.sh gives a run its own)")
    if procs or segments:
        print(f"leftovers: FAILED: {len(procs)} process(es) and {len(segments)} shared-memory "
              f"segment(s) of this run were left behind")
        return 1
    print("leftovers: none: no process of this run is alive, no segment of its jobs is left")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/leftovers.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="record the entries present now")
    snap.add_argument("file")
    check = sub.add_parser("check", help="list and remove what the run left; exit 1 if any")
    check.add_argument("snapshot")
    check.add_argument("--token", help=f"the run's {RUN_ENV} value")
    check.add_argument("--min-age", type=float, default=MIN_AGE)
    args = parser.parse_args(argv)
    if args.command == "snapshot":
        Path(args.file).write_text(json.dumps(sorted(snapshot())))
        return 0
    return _check(args)


if __name__ == "__main__":
    sys.exit(main())
