"""``mpifusion tune``: measure the best segment size on this machine and record it.

Under ``mpiexec -n N`` (N >= 2, ideally the ranks per node of real jobs), every rank
all-reduces and averages one buffer through mpifusion's own ``thread`` path at each segment
size up to the buffer's (a larger one is the whole buffer again) in turn, in rounds (one run
of each size per round, so drifting load hits all alike).
Rank 0 prints the table, marks the fastest and the size the L2 rule would pick, and records the
fastest for this machine type in the tune file (``~/.cache/mpifusion/tune.json``, or
``$MPIFUSION_TUNE_FILE``) that the library then takes as its default segment size.
An explicit ``segment_bytes`` or ``$MPIFUSION_SEGMENT_BYTES`` still wins over it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .. import __version__, machine
from ..config import CommOptions
from ..dtypes import ALIAS_NAMES, as_dtype
from ..errors import OptionError
from ..limits import memory_problem
from .argtypes import from_check

MiB = 1 << 20
DEFAULT_SEGMENTS = "0.25,0.5,1,2,4,8,16,32"
#: --mb and --segments are at most 1 TiB (the largest segment size a tune file may record)
MAX_MIB = 1 << 20
#: dtypes the tuner can all-reduce and average (those of fused buffers)
DTYPES = "float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64)"


def _mib(text: Any) -> float:
    """A size in MiB: a finite number > 0 and at most 1 TiB (ValueError otherwise)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value <= MAX_MIB:  # also NaN and inf
        raise ValueError(f"expected a size in MiB > 0 and at most {MAX_MIB} (1 TiB), "
                         f"got {str(text)!r}")
    return value


def _dtype(text: Any) -> str:
    name = ALIAS_NAMES.get(text.lower()) if isinstance(text, str) else None
    if name is None:
        raise ValueError(f"expected {DTYPES}, got {str(text)!r}")
    return name


def _rounds(text: Any) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = 0
    if isinstance(text, bool) or value < 1:
        raise ValueError(f"expected an integer >= 1, got {str(text)!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=from_check(_mib, "mib"), default=128.0,
                   help="buffer size in MiB (default 128: real fusion groups are 256); only "
                        "segment sizes up to it are timed")
    p.add_argument("--segments", default=DEFAULT_SEGMENTS, metavar="MIB,MIB,...",
                   help=f"segment sizes in MiB to try (default {DEFAULT_SEGMENTS})")
    p.add_argument("--dtype", type=from_check(_dtype, "dtype"), default="float32",
                   help=f"buffer dtype: {DTYPES} (default float32)")
    p.add_argument("--rounds", type=from_check(_rounds, "rounds"), default=5,
                   help="timed rounds (default 5)")
    p.add_argument("--output", metavar="FILE",
                   help="tune file to update (default: $MPIFUSION_TUNE_FILE, else "
                        "~/.cache/mpifusion/tune.json)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")


def _segments(text: str) -> List[int]:
    out = []
    for item in str(text).split(","):
        try:
            mib = float(item)
        except ValueError:
            raise OptionError(f"--segments: expected MiB numbers like 1,4,8, got {item!r}") \
                from None
        if not 0 < mib <= MAX_MIB:  # also NaN and inf
            raise OptionError(f"--segments: expected sizes > 0 and at most {MAX_MIB} MiB "
                              f"(1 TiB), got {item!r}")
        out.append(max(4096, int(mib * MiB)))
    return sorted(set(out))


def _fmt(nbytes: int) -> str:
    if nbytes >= MiB:
        return f"{nbytes / MiB:g} MiB"
    return f"{nbytes / 1024:.4g} KiB" if nbytes >= 1024 else f"{nbytes} B"


def _checked(args: argparse.Namespace) -> tuple:
    """``(mb, dtype name, rounds, segment sizes)`` of ``args``, checked again here for
    callers that build the namespace themselves (OptionError naming the option)."""
    values = []
    for option, check in (("--mb", _mib), ("--dtype", _dtype), ("--rounds", _rounds)):
        try:
            values.append(check(getattr(args, option[2:])))
        except ValueError as exc:
            raise OptionError(f"{option}: {exc}") from None
    _output(getattr(args, "output", None))
    return (*values, _segments(args.segments))


def _output(path: Optional[str]) -> None:
    """Refuse an ``--output`` that can name no file before the sweep, not after it (an empty
    one was "[Errno 21] is a directory: ''" once the measuring was done)."""
    if path is None:
        return
    if not str(path).strip():
        raise OptionError("--output: expected a file name, got ''")
    if os.path.isdir(os.path.expanduser(path)):
        raise OptionError(f"--output: {path!r} is a folder; expected a file name "
                          f"(e.g. {os.path.join(path, 'tune.json')!r})")


def sweep(segments: Sequence[int], buffer_bytes: int, itemsize: int) -> tuple:
    """``(timed, cut)``: the segment sizes a buffer of ``buffer_bytes`` can be cut into
    (at most its size; a larger segment is the whole buffer again), and those left out.
    OptionError when fewer than two remain, naming the smallest --mb that allows a sweep."""
    timed = [seg for seg in segments if seg <= buffer_bytes]
    cut = [seg for seg in segments if seg > buffer_bytes]
    if len(timed) < 2:
        if len(segments) < 2:
            raise OptionError(f"--segments: a sweep needs at least two sizes, got "
                              f"{_fmt(segments[0])} only")
        need = -(-segments[1] // itemsize) * itemsize  # whole elements, as the buffer has
        raise OptionError(f"--mb: a buffer of {_fmt(buffer_bytes)} leaves "
                          f"{len(timed)} of the segment sizes "
                          f"({', '.join(_fmt(seg) for seg in segments)}) to time, and a sweep "
                          f"needs two; use --mb {need / MiB!r} or more (or smaller --segments)")
    return timed, cut


def run(args: argparse.Namespace, say: Any = print) -> int:
    """Measure, print (rank 0) and record; returns the exit code (same on every rank)."""
    # numpy and MPI: only a tune that runs loads them (every command builds tune's parser)
    import numpy as np
    from mpi4py import MPI

    from ..comm.communicator import Communicator
    from .runjob import agree, ranks_on_this_node
    from .timing import mpi_name, timeit_many

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    mb, dtype_name, rounds, segments = _checked(args)
    if n < 2:
        raise OptionError("a single rank measures no communication; run it under "
                          "mpiexec -n 2 (or the ranks per node of your jobs)")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise OptionError("MPI is not at MPI_THREAD_MULTIPLE, so the thread strategy "
                          "(the only one that uses segments) cannot run")
    dtype = as_dtype(dtype_name)
    numel = max(n, int(mb * MiB) // dtype.itemsize)
    segments, cut = sweep(segments, numel * dtype.itemsize, dtype.itemsize)
    # the buffer, and for half precision the fp32 slots a segment is widened into
    need = numel * dtype.itemsize + (2 * 4 * (max(segments) // dtype.itemsize)
                                     if dtype.itemsize == 2 else 0)
    error = memory_problem(need, f"--mb {mb:.10g}: the {dtype.name} buffer",
                           ranks_on_this_node(comm))
    buf = None
    if error is None:
        try:
            buf = np.ones(numel, dtype)
        except MemoryError:
            error = (f"--mb {mb:.10g}: out of memory allocating the "
                     f"{_fmt(numel * dtype.itemsize)} buffer")
    error = agree(comm, error)  # every rank's verdict, so all stop (or go on) together
    if error is not None:
        raise OptionError(error)
    comms = {seg: Communicator(comm, CommOptions(strategy="thread", segment_bytes=seg))
             for seg in segments}
    fns = {seg: (lambda c=c: c.allreduce(buf, scale=1.0 / n).wait())
           for seg, c in comms.items()}
    res = timeit_many(fns, comm, rounds, 1)
    med = {seg: r["median_s"] for seg, r in res.items()}
    best = min(med, key=med.get)
    rule = machine.segment_rule()
    if rank == 0:
        sizes = machine.cache_sizes()
        say(f"# mpifusion tune: {n} ranks, {numel * dtype.itemsize / MiB:g} MiB {dtype.name}, "
            f"allreduce + 1/n (thread strategy), median of {rounds} rounds")
        say(f"# {machine.cpu_model()}; caches "
            + (", ".join(f"{k} {_fmt(v)}" for k, v in sorted(sizes.items())) or "unknown")
            + f"; {mpi_name()}")
        if cut:
            say(f"# not timed, larger than the buffer: {', '.join(_fmt(seg) for seg in cut)}")
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
