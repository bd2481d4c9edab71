"""``mpifusion tune``: measure the best segment size on this machine and record it.

Under ``mpiexec -n N`` (N >= 2, ideally the ranks per node of real jobs), every rank
all-reduces and averages one buffer through mpifusion's own ``thread`` path at each segment
size in turn, in rounds (one run of each size per round, so drifting load hits all alike).
Rank 0 prints the table, marks the fastest and the size the L2 rule would pick, and records the
fastest for this machine type in the tune file (``~/.cache/mpifusion/tune.json``, or
``$MPIFUSION_TUNE_FILE``) that the library then takes as its default segment size.
An explicit ``segment_bytes`` or ``$MPIFUSION_SEGMENT_BYTES`` still wins over it.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from typing import Any, Dict, List, Optional, Sequence

MiB = 1 << 20
DEFAULT_SEGMENTS = "0.25,0.5,1,2,4,8,16,32"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=float, default=128.0,
                   help="buffer size in MiB (default 128: real fusion groups are 256)")
    p.add_argument("--segments", default=DEFAULT_SEGMENTS, metavar="MIB,MIB,...",
                   help=f"segment sizes in MiB to try (default {DEFAULT_SEGMENTS})")
    p.add_argument("--dtype", default="float32", help="buffer dtype (default float32)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--output", metavar="FILE",
                   help="tune file to update (default: $MPIFUSION_TUNE_FILE, else "
                        "~/.cache/mpifusion/tune.json)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")


def _segments(text: str) -> List[int]:
    from ..config import OptionError

    out = []
    for item in text.split(","):
        try:
            mib = float(item)
        except ValueError:
            raise OptionError(f"--segments: expected MiB numbers like 1,4,8, got {item!r}") \
                from None
        if not mib > 0:
            raise OptionError(f"--segments: expected sizes > 0, got {item!r}")
        out.append(max(4096, int(mib * MiB)))
    return sorted(set(out))


def _fmt(nbytes: int) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"


def run(args: argparse.Namespace, say: Any = print) -> int:
    """Measure, print (rank 0) and record; returns the exit code (same on every rank)."""
    import numpy as np
    from mpi4py import MPI

    from .. import __version__, machine
    from ..comm.communicator import Communicator
    from ..config import CommOptions, OptionError
    from ..dtypes import as_dtype
    from .bench import mpi_name, timeit_many

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    segments = _segments(args.segments)
    if args.rounds < 1 or not args.mb > 0:
        raise OptionError("expected --rounds >= 1 and --mb > 0")
    if n < 2:
        raise OptionError("a single rank measures no communication; run it under "
                          "mpiexec -n 2 (or the ranks per node of your jobs)")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise OptionError("MPI is not at MPI_THREAD_MULTIPLE, so the thread strategy "
                          "(the only one that uses segments) cannot run")
    dtype = as_dtype(args.dtype)
    numel = max(n, int(args.mb * MiB) // dtype.itemsize)
    buf = np.ones(numel, dtype)
    comms = {seg: Communicator(comm, CommOptions(strategy="thread", segment_bytes=seg))
             for seg in segments}
    fns = {seg: (lambda c=c: c.allreduce(buf, scale=1.0 / n).wait())
           for seg, c in comms.items()}
    res = timeit_many(fns, comm, args.rounds, 1)
    med = {seg: r["median_s"] for seg, r in res.items()}
    best = min(med, key=med.get)
    rule = machine.segment_rule()
    if rank == 0:
        sizes = machine.cache_sizes()
        say(f"# mpifusion tune: {n} ranks, {numel * dtype.itemsize / MiB:g} MiB {dtype.name}, "
            f"allreduce + 1/n (thread strategy), median of {args.rounds} rounds")
        say(f"# {machine.cpu_model()}; caches "
            + (", ".join(f"{k} {_fmt(v)}" for k, v in sorted(sizes.items())) or "unknown")
            + f"; {mpi_name()}")
        say(f"{'segment':>10} {'ms':>9} {'GB/s':>7} {'/ best':>7}")
        for seg in segments:
            mark = (" <- fastest" if seg == best else "") + (" (L2 rule)" if seg == rule else "")
            say(f"{_fmt(seg):>10} {med[seg] * 1e3:9.2f} "
                f"{buf.nbytes / med[seg] / 1e9:7.2f} {med[seg] / med[best]:7.2f}{mark}")
    entry: Dict[str, Any] = {
        "segment_bytes": int(best),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nranks": n, "buffer_bytes": int(buf.nbytes), "dtype": dtype.name,
        "mpi": mpi_name(), "mpifusion": __version__, "rule_segment_bytes": int(rule),
        "times_ms": {str(seg): round(med[seg] * 1e3, 3) for seg in segments},
    }
    error: Optional[str] = None
    if rank == 0 and not args.dry_run:
        try:
            path = machine.write_tune(entry, args.output)
            say(f"recorded segment_bytes={best} ({_fmt(best)}) for this machine type in {path}")
        except OSError as exc:
            error = f"tune: cannot write the tune file: {exc}"
    elif rank == 0:
        say(f"dry run: fastest segment {_fmt(best)}; nothing written")
    error = comm.bcast(error, root=0)
    if error:
        if rank == 0:
            print(f"mpifusion {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="mpifusion tune", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
