"""The nonblocking window sweep of ``mpifusion bench`` alone (GPT-2-small by default):
``mpiexec -n 2 python benchmarks/bench_window.py --iters 7 [--windows 1,2,4,8]``.
The ALL_REDUCE full step, ``thread`` and ``nonblocking`` at each window, timed in rounds.
Rank 0 prints the table and records it (``.txt``, and every round in ``.json``) in
``benchmarks/results/`` (benchmarks/record.py)."""
import json
import sys

from mpi4py import MPI

from mpifusion.tools.bench import measure, workload
# the package's names ``settings`` and ``report`` are its functions: take the modules' names
from mpifusion.tools.bench.report import print_table, table_window_sweep
from mpifusion.tools.bench.settings import build_parser, settings

import record  # benchmarks/record.py: results go to benchmarks/results/


def main(argv):
    parser = build_parser()
    parser.add_argument("--progress-thread", choices=("auto", "off"), default="auto",
                        help="off: no progress thread even at MPI_THREAD_MULTIPLE (progress "
                        "from the caller and the library only; an experiment)")
    parser.add_argument("--segment-mb", type=float, default=None,
                        help="segment size of every strategy (default: the machine's)")
    record.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.segment_mb is not None:
        import functools

        workload.CommOptions = functools.partial(workload.CommOptions,
                                                 segment_bytes=int(args.segment_mb * (1 << 20)))
    if args.progress_thread == "off":
        from mpifusion.comm import engines

        engines.NonBlockingEngine.__init__.__defaults__ = ("", False)
    world = MPI.COMM_WORLD
    with record.recorded(args, "bench_window", "nonblocking-window",
                         "nonblocking windows against the thread step, ALL_REDUCE full step",
                         rank=world.Get_rank(), job_info=record.job(world),
                         extra=(".json",)) as prefix:
        b = measure.Bench(settings(args, world.Get_size()), world, world.Dup())
        measure.measure_meta(b)
        measure.measure_window_sweep(b)
        if b.rank == 0:
            print_table(*table_window_sweep(b.res))
            path = args.json or (prefix + ".json" if prefix else None)
            if path:
                with open(path, "w") as fh:
                    json.dump(b.res, fh, indent=1, default=str)
        b.comm.Free()


if __name__ == "__main__":
    main(sys.argv[1:])
