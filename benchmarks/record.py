"""Where benchmark results go, and what each one records about itself.

Every script in ``benchmarks/`` writes its results into ``benchmarks/results/`` (``--results
DIR`` elsewhere; ``--no-record`` writes nothing, e.g. for a quick try) under a new name,
``<script>[_<mpi>][_n<ranks>]_<UTC time>.<ext>``, so a new run never overwrites an old one,
and adds one entry to the folder's manifest, ``index.json``: the files, the target the run
measures, the date, the commit (``git rev-parse HEAD``, and whether tracked files differed
from it), the machine (CPU model, cores, memory, MPI library and version) and the strategy a
default buffer took in that job. The format is described in ``benchmarks/results/README.md``;
``benchmarks/report.py`` builds docs/benchmarks.md's tables from the latest entry of each
target.

A result made another way (``mpiexec -n 2 mpifusion bench --json FILE``, a shell loop) is
registered with ``python benchmarks/record.py add FILE... --target T --what TEXT`` (the
files must lie in the results folder; see ``--help``). ``benchmarks/bench_sync.py`` runs
``mpifusion bench`` and records it.

The scripts import this module as ``record`` (they run as ``python benchmarks/x.py``, so
``benchmarks/`` is on ``sys.path``).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
#: the default results folder, and the manifest's name in it
RESULTS = os.path.join(HERE, "results")
INDEX = "index.json"
#: the manifest's format version (benchmarks/results/README.md)
FORMAT = 1
#: what each ``target`` names: the question a result answers (docs/benchmarks.md has one
#: table per target; ``report.py`` knows how to read each one's files)
TARGETS = {
    "default-step": "mpifusion bench: the default sync step against raw MPI, a memcpy, the "
                    "other strategies",
    "half-step": "a half-precision step against the fp32 step",
    "halfcast": "half-precision casts against a memcpy (no MPI)",
    "halfcast-sums": "fp16/bf16 sums per kernel path and kind of data (no MPI)",
    "small-messages": "small all-reduces against raw MPI",
    "segment-size": "the step per segment size",
    "nonblocking-window": "the nonblocking strategy's window against thread",
    "deadline": "collectives with a deadline against none",
    "floors": "each action's step against its raw floor",
    "fused-scaling": "1/n fused into the collective against a separate pass",
    "persistent": "persistent collectives against blocking and non-blocking ones",
    "oracle-check": "mpifusion check's cost (no MPI)",
    "shm-scaling": "one buffer's step per strategy against buffer size and ranks",
    "cluster": "hierarchical across (emulated) nodes against the link floor",
    "hierarchical-model": "a MODEL of hierarchical on 2-64 nodes (not a measurement)",
}
#: the settings a result's default strategy belongs to (``auto`` decides per setting)
SETTINGS = ("one node", "cluster")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def git_commit(root: str = REPO) -> Tuple[Optional[str], Optional[bool]]:
    """(``git rev-parse HEAD``, whether tracked files differ from it), or (None, None) outside
    a git checkout or without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=30)
        if head.returncode != 0:
            return None, None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=60)
        return head.stdout.strip(), (bool(dirty.stdout.strip())
                                     if dirty.returncode == 0 else None)
    except (OSError, subprocess.SubprocessError):
        return None, None


def memory_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine(mpi: Sequence[str] = ()) -> Dict[str, Any]:
    """This machine as a manifest entry records it (``mpi``: the libraries the run used)."""
    from mpifusion.machine import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": memory_gib(),
            "mpi": list(mpi), "python": platform.python_version(),
            "numpy": _version("numpy"), "os": f"{platform.system()} {platform.machine()}",
            "source": "detected by benchmarks/record.py"}


def _version(module: str) -> Optional[str]:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def job(comm: Any) -> Dict[str, Any]:
    """What an MPI job's entry records about the job: its MPI library, ranks, and the strategy
    a default buffer takes on ``comm`` with the setting that decides it. Collective: call it
    on every rank."""
    from mpifusion.tools.bench.workload import auto_strategy
    from mpifusion.tools.timing import mpi_name

    default = auto_strategy(comm)
    return {"mpi": [mpi_name()], "nranks": comm.Get_size(), "default_strategy": default,
            "setting": "cluster" if default == "hierarchical" else "one node"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--results DIR`` and ``--no-record``, the same in every script."""
    ap.add_argument("--results", default=RESULTS, metavar="DIR",
                    help="folder of the results and their manifest index.json")
    ap.add_argument("--no-record", action="store_true",
                    help="write no result files (print only)")


def _slug(text: str) -> str:
    """An MPI library's short name in file names: the ``--mpi`` names of the scripts."""
    low = text.lower()
    for name, slug in (("open mpi", "openmpi"), ("mpich", "mpich"), ("intel", "impi")):
        if name in low:
            return slug
    return "".join(c for c in low.split()[0] if c.isalnum()) if low.split() else ""


def new_prefix(folder: str, stem: str, mpi: Sequence[str] = (),
               nranks: Optional[int] = None) -> str:
    """``folder/<stem>[_<mpi>][_n<ranks>]_<UTC time>``: a name no earlier run has."""
    parts = [stem] + [_slug(m) for m in mpi[:1]] + ([f"n{nranks}"] if nranks else [])
    base = os.path.join(folder, "_".join(p for p in parts if p) + "_"
                        + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    prefix, k = base, 1
    while any(os.path.exists(prefix + ext) for ext in (".txt", ".json", ".png")):
        k += 1
        prefix = f"{base}-{k}"
    return prefix


def entry(files: Sequence[str], target: str, what: str, *, mpi: Sequence[str] = (),
          default_strategy: Optional[str] = None, setting: Optional[str] = None,
          command: Optional[str] = None, note: Optional[str] = None,
          date: Optional[str] = None, folder: str = RESULTS) -> Dict[str, Any]:
    """A manifest entry for ``files`` (paths in ``folder``) measured now, here."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    if setting is not None and setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; known: {', '.join(SETTINGS)}")
    names = []
    for path in files:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(folder))
        if rel.startswith(os.pardir) or os.sep in rel:
            raise ValueError(f"{path}: not a file directly in {folder}")
        names.append(rel)
    commit, dirty = git_commit()
    out: Dict[str, Any] = {
        "id": os.path.splitext(names[0])[0], "files": names, "target": target,
        "what": what, "date": date or utc_now(), "date_source": "the run",
        "commit": commit, "commit_source": "git rev-parse HEAD at the run",
        "machine": machine(mpi), "default_strategy": default_strategy, "setting": setting}
    if dirty:
        out["dirty"] = True
    if command:
        out["command"] = command
    if note:
        out["note"] = note
    return out


def read_index(folder: str = RESULTS) -> Dict[str, Any]:
    path = os.path.join(folder, INDEX)
    if not os.path.exists(path):
        return {"format": FORMAT, "results": []}
    with open(path) as fh:
        return json.load(fh)


def register(new: Dict[str, Any], folder: str = RESULTS) -> str:
    """Append ``new`` to ``folder/index.json`` (written whole, then renamed over the old one)."""
    index = read_index(folder)
    taken = {e["id"] for e in index["results"]}
    if new["id"] in taken:
        raise ValueError(f"{new['id']}: already in {os.path.join(folder, INDEX)}")
    missing = [f for f in new["files"] if not os.path.exists(os.path.join(folder, f))]
    if missing:
        raise ValueError(f"not in {folder}: {', '.join(missing)}")
    index["results"].append(new)
    path = os.path.join(folder, INDEX)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(index, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def header(e: Dict[str, Any]) -> str:
    """The result file's first line: when, at which commit, on what."""
    m = e["machine"]
    commit = e["commit"] or "unknown (not a git checkout)"
    if e.get("dirty"):
        commit += " with uncommitted changes"
    mem = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ""
    mpi = f", {' / '.join(m['mpi'])}" if m.get("mpi") else ", no MPI"
    default = f"; default strategy {e['default_strategy']}" if e.get("default_strategy") else ""
    return (f"# recorded {e['date']} at commit {commit}; {m['cpu']}, {m['cores']} cores{mem}"
            f"{mpi}{default} (entry {e['id']} of {INDEX})")


class _Tee(io.TextIOBase):
    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def command_line(nranks: Optional[int] = None) -> str:
    run = f"mpiexec -n {nranks} " if nranks else ""
    return run + "python " + " ".join(shlex.quote(a) for a in
                                      [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])


def provenance(e: Dict[str, Any]) -> Dict[str, Any]:
    """The part of an entry a result's own JSON repeats (under ``"record"``)."""
    return {k: e[k] for k in ("id", "target", "date", "commit", "dirty", "machine",
                              "default_strategy", "setting") if k in e}


def start(args: argparse.Namespace, stem: str, target: str, what: str,
          job_info: Optional[Dict[str, Any]] = None, note: Optional[str] = None
          ) -> Tuple[str, Dict[str, Any]]:
    """A new prefix in ``args.results`` and the entry its files will get (:func:`finish`
    registers it with the files that exist by then)."""
    info = job_info or {}
    os.makedirs(args.results, exist_ok=True)
    prefix = new_prefix(args.results, stem, info.get("mpi", ()), info.get("nranks"))
    e = entry([prefix + ".txt"], target, what, mpi=info.get("mpi", ()),
              default_strategy=info.get("default_strategy"), setting=info.get("setting"),
              command=command_line(info.get("nranks")), note=note, folder=args.results)
    return prefix, e


def finish(args: argparse.Namespace, prefix: str, e: Dict[str, Any],
           exts: Sequence[str]) -> None:
    """Register ``e`` with the files ``<prefix><ext>`` that exist."""
    e["files"] = [os.path.basename(prefix + ext) for ext in exts
                  if os.path.exists(prefix + ext)]
    register(e, args.results)
    print(f"recorded {', '.join(e['files'])} in {os.path.join(args.results, INDEX)}",
          file=sys.stderr)


def _discard(prefix: str, exts: Sequence[str]) -> None:
    for ext in exts:
        with contextlib.suppress(OSError):
            os.remove(prefix + ext)


@contextlib.contextmanager
def recorded(args: argparse.Namespace, stem: str, target: str, what: str, *,
             rank: int = 0, job_info: Optional[Dict[str, Any]] = None,
             note: Optional[str] = None, extra: Sequence[str] = ()) -> Iterator[Optional[str]]:
    """Tee what rank 0 prints into ``<prefix>.txt`` (after the :func:`header` line) and, when
    the block ends without an error, register it with the files ``<prefix><ext>`` for each
    ``ext`` in ``extra`` that the block wrote; after an error the files go (the results
    folder holds registered results only). Yields the prefix (None on other ranks and with
    ``--no-record``). ``job_info``: :func:`job`'s dict for MPI jobs."""
    if rank != 0 or args.no_record:
        yield None
        return
    prefix, e = start(args, stem, target, what, job_info, note)
    exts = [".txt", *extra]
    old = sys.stdout
    try:
        with open(prefix + ".txt", "w") as fh:
            fh.write(header(e) + "\n")
            sys.stdout = _Tee(old, fh)
            try:
                yield prefix
            finally:
                sys.stdout = old
    except BaseException:
        _discard(prefix, exts)
        raise
    finish(args, prefix, e, exts)


def save(args: argparse.Namespace, stem: str, target: str, what: str, *,
         job_info: Optional[Dict[str, Any]] = None, note: Optional[str] = None,
         text: Optional[str] = None, data: Optional[Dict[str, Any]] = None,
         writers: Optional[Dict[str, Callable[[str], Any]]] = None) -> Optional[str]:
    """Rank 0, after a run: ``text`` as ``<prefix>.txt`` (after the :func:`header` line),
    ``data`` as ``<prefix>.json`` (with :func:`provenance` under ``"record"``), and
    ``writers[ext](path)`` for other files (a plot); then register them. Returns the prefix,
    or None with ``--no-record``."""
    if args.no_record:
        return None
    prefix, e = start(args, stem, target, what, job_info, note)
    exts = [".txt", ".json", *(writers or {})]
    try:
        if text is not None:
            with open(prefix + ".txt", "w") as fh:
                fh.write(header(e) + "\n" + text.rstrip("\n") + "\n")
        if data is not None:
            with open(prefix + ".json", "w") as fh:
                json.dump(dict(data, record=provenance(e)), fh, indent=1, default=str)
        for ext, write in (writers or {}).items():
            write(prefix + ext)
    except BaseException:
        _discard(prefix, exts)
        raise
    finish(args, prefix, e, exts)
    return prefix


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Register result files made another way in the "
                                 "results folder's manifest (benchmarks/results/README.md).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add", help="register FILE... (already in the results folder)")
    add.add_argument("files", nargs="+")
    add.add_argument("--target", required=True, choices=sorted(TARGETS))
    add.add_argument("--what", required=True, help="what was measured, in a line")
    add.add_argument("--mpi", action="append", default=[],
                     help="MPI library and version, e.g. 'MPICH 5.0.2' (repeat for two)")
    add.add_argument("--default-strategy", default=None,
                     help="the strategy a default buffer took (mpifusion info says)")
    add.add_argument("--setting", default=None, choices=SETTINGS)
    add.add_argument("--command", default=None, help="the command that made the files")
    add.add_argument("--date", default=None, help="UTC, YYYY-MM-DDTHH:MM:SSZ (default: now)")
    add.add_argument("--note", default=None)
    add.add_argument("--results", default=RESULTS, metavar="DIR")
    args = ap.parse_args(argv)
    try:
        e = entry(args.files, args.target, args.what, mpi=args.mpi,
                  default_strategy=args.default_strategy, setting=args.setting,
                  command=args.command, note=args.note, date=args.date, folder=args.results)
        if args.date:
            e["date_source"] = "given"
        print(f"registered {e['id']} in {register(e, args.results)}")
    except ValueError as exc:
        print(f"record.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
