"""The default step of each action against its raw MPI floor, all in rounds in one run.

The targets of ``mpifusion bench``: the ALL_REDUCE step within 1.10x of the best raw
segmented ``Allreduce`` plus the same 1/n; REDUCE and REDUCE_SCATTER + sync_params within
1.15x of theirs. Every candidate runs once per round; rank 0 prints, per step, the median
over rounds of ``step / best floor of the same round`` (load that drifts during the run hits
both alike).

Floors (no mpifusion; each the best of several ways, chosen per round):

- ALL_REDUCE: blocking ``Allreduce`` in 2, 4 or 8 MiB segments, each scaled by 1/n while in
  cache, or one call then one scaling pass;
- REDUCE (root 0): blocking ``Reduce`` in 2, 4 or 8 MiB segments, or one call, the root
  scaling what it received by 1/n and the other ranks each segment they sent (Paddle scales
  every rank's buffer); a second row, for information, against the same floors where only
  the root scales (less work than the step does);
- REDUCE_SCATTER + sync_params: ``Reduce_scatter_block`` (one call), 1/n on the own shard,
  ``Allgather`` in place (one call) -- the sharded step's minimum traffic.

    mpiexec -n 2 python benchmarks/bench_floors.py [--preset gpt2-small] [--iters 7]
"""
from __future__ import annotations

import argparse
import statistics
from functools import partial
from typing import Callable, Dict, List

import numpy as np
from mpi4py import MPI

from mpifusion import machine
from mpifusion.plan.actions import HookAction
from mpifusion.tools.bench.baselines import (reduce_scatter_allgather, segmented_allreduce,
                                             segmented_reduce)
from mpifusion.tools.bench.workload import (auto_strategy, build_buffers, default_segment,
                                            full_step, grad_bytes, make_params)
from mpifusion.tools.timing import best_per_round, mpi_name, timeit_many

import record  # benchmarks/record.py: results go to benchmarks/results/

MiB = 1 << 20
SEGMENTS = (2 * MiB, 4 * MiB, 8 * MiB)


def _segmented_floors(call: str, runner: Callable[..., Callable[[], None]], note: str = ""
                      ) -> Callable[[MPI.Comm, int], Dict[str, Callable[[], None]]]:
    """The floors of one blocking call: in 2/4/8 MiB segments, or one call, each + 1/n."""
    def floors(comm: MPI.Comm, count: int) -> Dict[str, Callable[[], None]]:
        buf = np.ones(count, np.float32)
        f = 1.0 / comm.Get_size()
        ways = {f"{call} {s // MiB} MiB segments + 1/n{note}": runner(comm, buf, s, f)
                for s in SEGMENTS}
        ways[f"{call} one call + 1/n pass{note}"] = runner(comm, buf, buf.nbytes, f)
        return ways
    return floors


allreduce_floors = _segmented_floors("Allreduce", segmented_allreduce)
reduce_floors = _segmented_floors("Reduce", partial(segmented_reduce, everywhere=True),
                                  " (every rank)")
reduce_root_only = _segmented_floors("Reduce", segmented_reduce, " (root only)")


def reduce_scatter_floors(comm: MPI.Comm, count: int) -> Dict[str, Callable[[], None]]:
    n = comm.Get_size()
    buf = np.ones(count // n * n, np.float32)
    return {"Reduce_scatter_block + 1/n + Allgather (one call each)":
            reduce_scatter_allgather(comm, buf, 1.0 / n)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--actions", default="ALL_REDUCE,REDUCE,REDUCE_SCATTER")
    record.add_arguments(ap)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    with record.recorded(args, "bench_floors", "floors",
                         "each action's default step against raw MPI floors doing the same 1/n",
                         rank=comm.Get_rank(), job_info=record.job(comm)):
        run(args)


def run(args: argparse.Namespace) -> None:
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    targets = {"ALL_REDUCE": 1.10, "REDUCE": 1.15, "REDUCE_SCATTER": 1.15}
    floors_of = {"ALL_REDUCE": allreduce_floors, "REDUCE": reduce_floors,
                 "REDUCE_SCATTER": reduce_scatter_floors}
    fns: Dict[str, Callable[[], None]] = {}
    groups: Dict[str, List[str]] = {}
    info: Dict[str, List[str]] = {}
    keep = []
    auto = auto_strategy(comm)  # the strategy a default buffer takes here
    for name in args.actions.split(","):
        act = HookAction[name]
        bufs = build_buffers(make_params(args.preset, None, rank, fill=False), act,
                             256 * MiB, comm, auto)
        keep.append(bufs)
        sync = act == HookAction.REDUCE_SCATTER
        label = f"{name}{' + sync_params' if sync else ''} step [{auto}]"
        fns[label] = (lambda b=bufs, y=sync: full_step(b, y))
        floors = floors_of[name](comm, grad_bytes(bufs) // 4)
        fns.update(floors)
        groups[label] = list(floors)
        if act == HookAction.REDUCE:  # information: a floor doing less than the step
            fewer = reduce_root_only(comm, grad_bytes(bufs) // 4)
            fns.update(fewer)
            info[label] = list(fewer)
    res = timeit_many(fns, comm, args.iters, args.warmup)
    segment = default_segment(comm)  # collective: before rank 0 goes on alone
    if rank != 0:
        return
    print(f"# {args.preset}, {n} ranks, {mpi_name()}, {args.iters} rounds; "
          f"{machine.cpu_model()}, default segment {segment // MiB} MiB")
    print("| step | ms (median) | best floor (most often) | floor ms | step / floor "
          "(median over rounds, min-max) | target | met |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = [(label, names, True) for label, names in groups.items()]
    rows += [(label, names, False) for label, names in info.items()]
    for label, names, scored in rows:
        step = res[label]["times_s"]
        best = best_per_round([res[k] for k in names])["times_s"]
        ratios = [a / b for a, b in zip(step, best)]
        fastest = [min(names, key=lambda k: res[k]["times_s"][i]) for i in range(len(step))]
        usual = max(set(fastest), key=fastest.count)
        target = targets[label.split(" ")[0]]
        med = statistics.median(ratios)
        verdict = ("yes" if med <= target else "NO") if scored else "(information)"
        print(f"| {label} | {res[label]['median_s'] * 1e3:.1f} | {usual} | "
              f"{res[usual]['median_s'] * 1e3:.1f} | {med:.2f} ({min(ratios):.2f}-"
              f"{max(ratios):.2f}) | <= {target:.2f} | {verdict} |")
    del keep


if __name__ == "__main__":
    main()
