"""The full ALL_REDUCE step of a preset at several segment sizes against the best raw way
(blocking ``Allreduce`` of the same bytes in segments, no 1/n), all in rounds in one run.
Rank 0 prints each step's median and its ratio to the best raw way of the same round, and
marks the size the machine's default would pick.

    mpiexec -n 2 python benchmarks/bench_segments.py [--preset gpt2-small] [--iters 5]
"""
from __future__ import annotations

import argparse
import statistics
from typing import Callable, Dict

import numpy as np
from mpi4py import MPI

from mpifusion import machine
from mpifusion.config import CommOptions
from mpifusion.runtime.buffer import FusedCommBuffer, HookAction
from mpifusion.runtime.fusion import assign_group_by_size
from mpifusion.tools.bench.baselines import segmented_allreduce
from mpifusion.tools.bench.workload import full_step, grad_bytes, make_params
from mpifusion.tools.timing import best_per_round, timeit_many

import record  # benchmarks/record.py: results go to benchmarks/results/

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--segments-mb", default="1,2,4,8,16")
    ap.add_argument("--raw-mb", default="2,4,8", help="segment sizes of the raw candidates")
    record.add_arguments(ap)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    with record.recorded(args, "bench_segments", "segment-size",
                         "the ALL_REDUCE step per segment size against the best raw way",
                         rank=comm.Get_rank(), job_info=record.job(comm)):
        run(args)


def run(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    segs = [int(float(s) * MiB) for s in args.segments_mb.split(",")]
    fns: Dict[str, Callable[[], None]] = {}
    nbytes = 0
    for seg in segs:
        params = make_params(args.preset, None, rank, fill=False)
        options = CommOptions(strategy="thread", segment_bytes=seg)
        groups = assign_group_by_size(list(params), group_size=256 * MiB)
        bufs = [FusedCommBuffer(i, plist, comm, act=HookAction.ALL_REDUCE,
                                comm_options=options) for i, plist in groups.items()]
        for b in bufs:  # real pages with real values, as after a backward pass
            b.grad_storage[...] = 1
        nbytes = grad_bytes(bufs)
        fns[f"step, {seg // MiB} MiB"] = (lambda b=bufs: full_step(b, False))
    flat = np.ones(nbytes // 4, np.float32)
    for mb in (int(float(s) * MiB) for s in args.raw_mb.split(",")):
        fns[f"raw Allreduce, {mb // MiB} MiB segments"] = segmented_allreduce(comm, flat, mb)
    res = timeit_many(fns, comm, args.iters, 1)
    if rank == 0:
        raws = [k for k in res if k.startswith("raw")]
        best_raw = best_per_round([res[k] for k in raws])["times_s"]
        rule = machine.segment_rule()
        print(f"# {args.preset} ALL_REDUCE, {n} ranks, {nbytes / 1e6:.1f} MB fp32, thread "
              f"strategy, {args.iters} rounds; {machine.cpu_model()}, "
              f"L2 {machine.cache_sizes().get('L2', 0) // 1024} KiB/core; rule: "
              f"{rule // MiB} MiB")
        print("| way | ms (median) | / best raw of the round (median, min-max) |")
        print("| --- | --- | --- |")
        for k, r in res.items():
            ratios = [a / b for a, b in zip(r["times_s"], best_raw)]
            mark = " (default)" if k == f"step, {rule // MiB} MiB" else ""
            print(f"| {k}{mark} | {r['median_s'] * 1e3:.1f} | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
