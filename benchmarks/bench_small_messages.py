"""Small all-reduces (4-256 KiB fp32): raw blocking ``Allreduce``, the same plus the 1/n
scaling, and mpifusion's ``thread`` and ``nonblocking`` strategies (with 1/n; by default each
collective is preceded by the order check), and ``thread`` without the check, in rounds.
Rank 0 prints the best round's median per way, in microseconds.

    mpiexec -n 2 python benchmarks/bench_small_messages.py [--iters 300] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpifusion.comm.communicator import Communicator
from mpifusion.config import CommOptions

import record  # benchmarks/record.py: results go to benchmarks/results/


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kib", default="4,16,64,256")
    record.add_arguments(ap)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    with record.recorded(args, "bench_small_messages", "small-messages",
                         "small all-reduces: raw Allreduce, thread, nonblocking, thread "
                         "without the order check",
                         rank=comm.Get_rank(), job_info=record.job(comm)):
        run(args)


def run(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    thread = Communicator(comm, CommOptions(strategy="thread"))
    nonblocking = Communicator(comm, CommOptions(strategy="nonblocking"))
    unverified = Communicator(comm, CommOptions(strategy="thread", verify_order=False))
    raw = comm.Dup()

    def timed(fn) -> float:
        for _ in range(20):
            fn()
        comm.Barrier()
        ts = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    if comm.Get_rank() == 0:
        print(f"# {n} ranks, median us per collective (best of {args.rounds} rounds)")
        print("| size | raw Allreduce | raw + 1/n | thread | nonblocking | thread - raw "
              "| thread, verify_order=False | that - raw |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kib in (int(k) for k in args.kib.split(",")):
        buf = np.ones(kib * 256, np.float32)
        ways = {
            "raw": lambda: raw.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT]),
            "raw+scale": lambda: (raw.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT]),
                                  buf.__imul__(1.0 / n)),
            "thread": lambda: thread.allreduce(buf, scale=1.0 / n).wait(),
            "nonblocking": lambda: nonblocking.allreduce(buf, scale=1.0 / n).wait(),
            "unverified": lambda: unverified.allreduce(buf, scale=1.0 / n).wait(),
        }
        best = {k: min(timed(fn) for _ in range(args.rounds)) for k, fn in ways.items()}
        if comm.Get_rank() == 0:
            print(f"| {kib} KiB | {best['raw']:.1f} | {best['raw+scale']:.1f} | "
                  f"{best['thread']:.1f} | {best['nonblocking']:.1f} | "
                  f"{best['thread'] - best['raw']:+.1f} | {best['unverified']:.1f} | "
                  f"{best['unverified'] - best['raw']:+.1f} |")


if __name__ == "__main__":
    main()
