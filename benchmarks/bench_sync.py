"""``mpifusion bench`` with its results recorded: the tables as ``.txt``, every round as
``.json`` and the plot as ``.png`` in ``benchmarks/results/``, under a new name
(``bench_sync_<mpi>_n<ranks>_<UTC time>``), with an entry in that folder's index.json: the
date, the commit, the machine and the strategy a default buffer took (benchmarks/record.py).
This is how the figures of docs/benchmarks.md's first tables are made:

    mpiexec -n 2 python benchmarks/bench_sync.py --no-torch
    python benchmarks/report.py --write        # the docs' tables from the latest results

Every argument but ``--results DIR`` and ``--no-record`` goes to ``mpifusion bench``
(``mpifusion bench --help`` lists them); ``--json``/``--png`` given there are written where
they say, and not recorded.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from mpi4py import MPI

from mpifusion.tools import bench

import record  # benchmarks/record.py: results go to benchmarks/results/


def main(argv: Optional[List[str]] = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    record.add_arguments(own)
    args, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "-h" in rest or "--help" in rest:
        bench.build_parser().print_help()
        print("\nbenchmarks/bench_sync.py also takes --results DIR (default "
              f"{record.RESULTS}) and --no-record")
        return 0
    world = MPI.COMM_WORLD
    info = record.job(world)
    given = {a.split("=")[0] for a in rest}
    with record.recorded(args, "bench_sync", "default-step",
                         " ".join(["mpifusion bench", *rest]).strip(),
                         rank=world.Get_rank(), job_info=info,
                         extra=(".json", ".png", "_cluster.png")) as prefix:
        prefix = world.bcast(prefix, root=0)  # every rank passes the same arguments
        files: List[str] = []
        for option, ext in (("--json", ".json"), ("--png", ".png")):
            if option not in given:
                files += [option, prefix + ext if prefix else ""]
        return bench.main(rest + files)


if __name__ == "__main__":
    sys.exit(main())
