"""What a deadline (``timeout=`` / ``MPIFUSION_TIMEOUT``) costs: each strategy's all-reduce
(with 1/n) of a large buffer in segments and of small buffers, without and with a deadline,
in alternating rounds. Rank 0 prints the best round's median per way and the ratio
deadline / none (1.00 = free).

    mpiexec -n 2 python benchmarks/bench_deadline.py [--iters 9] [--rounds 5]
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

CASES = [  # (label, elements, segment bytes, collectives per timing)
    ("16 MiB fp32, 1 MiB segments", 1 << 22, 1 << 20, 1),
    ("128 KiB fp32, 64 B segments (2048 calls)", 1 << 15, 64, 1),
    ("16 KiB fp32, one segment", 1 << 12, None, 20),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=5)
    record.add_arguments(ap)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    with record.recorded(args, "bench_deadline", "deadline",
                         "each strategy's all-reduce without and with a 60 s deadline",
                         rank=comm.Get_rank(), job_info=record.job(comm)):
        run(args)


def run(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    strategies = ["nonblocking"]
    if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
        strategies.insert(0, "thread")
    if comm.Get_rank() == 0:
        print(f"# {n} ranks, {MPI.Get_library_version().splitlines()[0].strip()[:40]}; "
              f"ms per collective, best of {args.rounds} rounds' medians")
        print("| case | strategy | no deadline | deadline 60 s | ratio |")
        print("| --- | --- | --- | --- | --- |")
    for label, numel, segment, reps in CASES:
        buf = np.ones(numel, np.float32)
        for strategy in strategies:
            ways = {t: Communicator(comm, CommOptions(strategy=strategy, segment_bytes=segment,
                                                      timeout=t)) for t in (None, 60.0)}
            best = {t: float("inf") for t in ways}
            for _ in range(args.rounds):
                for t, c in ways.items():
                    c.allreduce(buf, scale=1.0 / n).wait()
                    comm.Barrier()
                    times = []
                    for _ in range(args.iters):
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            c.allreduce(buf, scale=1.0 / n).wait()
                        times.append((time.perf_counter() - t0) / reps)
                    best[t] = min(best[t], statistics.median(times) * 1e3)
            if comm.Get_rank() == 0:
                print(f"| {label} | {strategy} | {best[None]:.3f} | {best[60.0]:.3f} | "
                      f"{best[60.0] / best[None]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
