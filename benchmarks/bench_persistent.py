"""The same in-place fp32 all-reduce three ways, as mpifusion's ``thread`` strategy would run
a small one on the waiting caller: blocking ``Allreduce``, ``Iallreduce`` + ``Wait``, and a
persistent request (``Allreduce_init`` once) ``Start`` + ``Wait``. Rank 0 prints the best of
``--rounds`` means, in microseconds (BENCHMARKS.md, "Small messages").

    mpiexec -n 2 python benchmarks/bench_persistent.py [--kib 4,16,64] [--iters 2000]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import record  # benchmarks/record.py: results go to benchmarks/results/


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kib", default="4,16,64")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    record.add_arguments(ap)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    with record.recorded(args, "bench_persistent", "persistent",
                         "in-place fp32 all-reduce: Allreduce, Iallreduce + Wait, "
                         "persistent Start + Wait",
                         rank=comm.Get_rank(), job_info=record.job(comm)):
        run(args)


def run(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_rank() == 0:
        print(f"# {MPI.get_vendor()[0]}, {comm.Get_size()} ranks, us per all-reduce")
        print("| size | Allreduce | Iallreduce + Wait | Start + Wait |")
        print("| --- | --- | --- | --- |")
    for kib in (int(k) for k in args.kib.split(",")):
        buf = np.ones(kib * 256, np.float32)
        spec = [buf, MPI.FLOAT]
        request = comm.Allreduce_init(MPI.IN_PLACE, spec, op=MPI.SUM)

        def persistent() -> None:
            request.Start()
            request.Wait()

        ways = [lambda: comm.Allreduce(MPI.IN_PLACE, spec, op=MPI.SUM),
                lambda: comm.Iallreduce(MPI.IN_PLACE, spec, op=MPI.SUM).Wait(),
                persistent]
        best = []
        for fn in ways:
            times = []
            for _ in range(args.rounds):
                for _ in range(200):
                    fn()
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn()
                times.append((time.perf_counter() - t0) / args.iters * 1e6)
            best.append(min(times))
        request.Free()
        if comm.Get_rank() == 0:
            print(f"| {kib} KiB | " + " | ".join(f"{t:.2f}" for t in best) + " |")


if __name__ == "__main__":
    main()
