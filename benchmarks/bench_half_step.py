"""The full sync step of a preset in fp32, bf16 and fp16, side by side in rounds, with the
half-precision casts done by mpifusion.arrays.halfcast and by the plain numpy/ml_dtypes casts
(``MPIFUSION_HALFCAST=numpy``). Prints each step's median and its ratio to the fp32 step
measured in the same round (rank 0).

    mpiexec -n 2 python benchmarks/bench_half_step.py [--preset gpt2-small] [--iters 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Callable, Dict

from mpi4py import MPI

from mpifusion.arrays import halfcast
from mpifusion.config import HALFCAST_ENV, CommOptions
from mpifusion.runtime.buffer import HookAction
from mpifusion.tools.bench.workload import auto_strategy, build_buffers, full_step, make_params
from mpifusion.tools.timing import timeit_many

import record  # benchmarks/record.py: results go to benchmarks/results/


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--group-mb", type=float, default=256.0)
    ap.add_argument("--act", default="ALL_REDUCE", choices=[a.name for a in HookAction])
    ap.add_argument("--no-numpy", action="store_true", help="skip the plain-cast rows")
    ap.add_argument("--strategy", default=None, help="default: $MPIFUSION_COMM_STRATEGY, "
                    "else what a default buffer takes here")
    record.add_arguments(ap)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    with record.recorded(args, "bench_half_step", "half-step",
                         "ALL_REDUCE step in fp32, bf16 and fp16 (halfcast and reference casts)",
                         rank=comm.Get_rank(), job_info=record.job(comm)):
        run(args)


def run(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    act = HookAction[args.act]
    strategy = args.strategy or CommOptions.from_env().strategy
    if strategy == "auto":
        strategy = auto_strategy(comm)  # what a default buffer takes here (shm on one node)
    group = int(args.group_mb * (1 << 20))
    bufs = {dt: build_buffers(make_params(args.preset, dt, rank, fill=False), act, group,
                              comm, strategy) for dt in ("fp32", "bf16", "fp16")}
    sync = act == HookAction.REDUCE_SCATTER

    def step(dt: str, mode: str) -> Callable[[], None]:
        def run() -> None:
            os.environ[HALFCAST_ENV] = mode
            full_step(bufs[dt], sync)
        return run

    fns: Dict[str, Callable[[], None]] = {"fp32": step("fp32", "auto")}
    for dt in ("bf16", "fp16"):
        fns[f"{dt}, halfcast"] = step(dt, "auto")
        if not args.no_numpy:
            fns[f"{dt}, numpy casts"] = step(dt, "numpy")
    res = timeit_many(fns, comm, args.iters, args.warmup)
    os.environ.pop(HALFCAST_ENV, None)
    if rank == 0:
        base = res["fp32"]["times_s"]
        seg = getattr(getattr(bufs["fp32"][0], "_comm", None), "segment_bytes", None)
        print(f"# {args.preset} {act.name}, {comm.Get_size()} ranks, strategy {strategy}, "
              f"segment {seg} B, halfcast path {halfcast.path()}, "
              f"{args.iters} rounds; {MPI.Get_library_version().splitlines()[0]}")
        print("| step | ms (median) | / fp32 step (median over rounds, min-max) |")
        print("| --- | --- | --- |")
        for k, r in res.items():
            ratios = [a / b for a, b in zip(r["times_s"], base)]
            print(f"| {k} | {r['median_s'] * 1e3:.1f} | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
