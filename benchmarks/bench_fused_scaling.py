"""Paddle scales every rank's whole grad buffer by 1/n after a REDUCE or REDUCE_SCATTER,
also the regions that got no result. mpifusion does that inside the collective, each
segment or packed piece while it is in cache (``Communicator.reduce(sent_scale=)``,
``reduce_scatter(others_scale=)``); this times it against the same collective followed by a
separate pass, alternating the order in each round. Rank 0 prints per action the medians
and the median over rounds of fused / separate (barrier to barrier: the slowest rank).

    mpiexec -n 2 python benchmarks/bench_fused_scaling.py [--mib 256] [--rounds 11]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpifusion.arrays import backend
from mpifusion.comm.communicator import Communicator
from mpifusion.config import CommOptions

import record  # benchmarks/record.py: results go to benchmarks/results/


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=11)
    record.add_arguments(ap)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    with record.recorded(args, "bench_fused_scaling", "fused-scaling",
                         "1/n fused into REDUCE / REDUCE_SCATTER against a separate pass",
                         rank=comm.Get_rank(), job_info=record.job(comm)):
        run(args)


def run(args: argparse.Namespace) -> None:
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    comm = Communicator(world, CommOptions(strategy="thread"))
    buf = np.ones((args.mib << 20) // 4 // n * n, np.float32)
    shard = buf.size // n
    own = buf[rank * shard:(rank + 1) * shard]
    f = 1.0 / n

    def reduce_separate() -> None:
        comm.reduce(buf, 0, scale=f).wait()
        if rank != 0:
            backend.scale_(buf, f)

    def rs_separate() -> None:
        comm.reduce_scatter(buf, own, scale=f).wait()
        backend.scale_(buf[:rank * shard], f)
        backend.scale_(buf[(rank + 1) * shard:], f)

    pairs = {
        "REDUCE (root 0)": (lambda: comm.reduce(buf, 0, scale=f, sent_scale=f).wait(),
                            reduce_separate),
        "REDUCE_SCATTER": (lambda: comm.reduce_scatter(buf, own, scale=f,
                                                       others_scale=f).wait(), rs_separate),
    }
    if rank == 0:
        print(f"# {n} ranks, {buf.nbytes >> 20} MiB fp32, {args.rounds} rounds, "
              f"{MPI.Get_library_version().splitlines()[0].strip()}")
        print("| action | fused ms | separate pass ms | fused / separate (median, min-max) |")
        print("| --- | --- | --- | --- |")
    for name, (fused, separate) in pairs.items():
        times: dict = {"fused": [], "separate": []}
        for i in range(args.rounds):
            order = [("fused", fused), ("separate", separate)]
            for key, fn in (order if i % 2 else order[::-1]):
                buf[...] = 1
                world.Barrier()
                t0 = time.perf_counter()
                fn()
                world.Barrier()
                times[key].append(time.perf_counter() - t0)
        if rank == 0:
            ratios = [a / b for a, b in zip(times["fused"], times["separate"])]
            print(f"| {name} | {statistics.median(times['fused']) * 1e3:.1f} | "
                  f"{statistics.median(times['separate']) * 1e3:.1f} | "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
