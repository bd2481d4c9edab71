"""Timing collectives across ranks, as ``bench`` and ``tune`` report them.

A run's time is the slowest rank's (each run starts after a barrier and ends with a MAX
all-reduce of the elapsed time); figures are medians over runs. Candidates compared with
each other are timed in rounds, one run of each per round, so load that drifts during a
run hits them alike; their ratios are taken within a round.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from mpi4py import MPI


def timeit(fn: Callable[[], Any], comm: MPI.Comm, iters: int, warmup: int,
           setup: Optional[Callable[[], Any]] = None) -> Dict[str, float]:
    """Median/min seconds of ``fn`` over ``iters`` runs, each the slowest rank's time."""
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= warmup:
            times.append(dt)
    return {"median_s": statistics.median(times), "min_s": min(times), "iters": iters}


def timeit_many(fns: Dict[Any, Callable[[], Any]], comm: MPI.Comm, iters: int,
                warmup: int, self_timed: bool = False) -> Dict[Any, Dict[str, Any]]:
    """``timeit`` of several candidates in rounds (one run of each per round), so load that
    drifts during the run hits every candidate alike and their ratios stay fair. The order
    changes from round to round (:func:`balanced_orders`): a candidate that leaves the machine
    busy for a while (a progress thread still polling) then delays each of the others equally
    often, not always the one after it (in a fixed order, ``shm`` right after
    ``nonblocking`` measured 1.1-1.7x ``thread`` at 4-64 KiB, and 0.83-1.26x placed first).
    ``self_timed``: each ``fn`` returns its own seconds (a median of the steps it timed),
    and a run's time is the largest over the ranks."""
    times: Dict[Any, List[float]] = {k: [] for k in fns}
    items = list(fns.items())
    orders = balanced_orders(len(items))
    for i in range(warmup + iters):
        for name, fn in [items[j] for j in orders[i % len(orders)]]:
            comm.Barrier()
            t0 = time.perf_counter()
            own = fn()
            dt = comm.allreduce(own if self_timed else time.perf_counter() - t0, op=MPI.MAX)
            if i >= warmup:
                times[name].append(dt)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "iters": iters,
                "times_s": v} for k, v in times.items()}


def balanced_orders(k: int) -> List[List[int]]:
    """Orders of ``k`` candidates in which each one directly follows each other one equally
    often (a Williams design: ``k`` orders for even ``k``, ``2k`` for odd), the same on every
    rank."""
    if k < 2:
        return [list(range(k))]
    first, lo, hi = [0], 1, k - 1
    while lo <= hi:
        first.append(lo)
        lo += 1
        if lo <= hi:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % k for x in first] for r in range(k)]
    if k % 2:
        rows += [row[::-1] for row in rows]
    return rows


def round_ratio(a: dict, b: dict) -> float:
    """Median over rounds of a/b (both from one ``timeit_many``): robust to drifting load."""
    if "times_s" in a and "times_s" in b and len(a["times_s"]) == len(b["times_s"]):
        return statistics.median(x / y for x, y in zip(a["times_s"], b["times_s"]))
    return a["median_s"] / b["median_s"]


def best_per_round(entries: Sequence[dict]) -> dict:
    """The fastest of several ``timeit_many`` results in each round, as one result."""
    rounds = len(entries[0]["times_s"])
    times = [min(e["times_s"][i] for e in entries) for i in range(rounds)]
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def mpi_name() -> str:
    """'MPICH 5.0.2' / 'Open MPI v5.0.11': the library's first words, without build details
    (the MPI that a report's times belong to)."""
    text = MPI.Get_library_version().replace("\x00", "").splitlines()[0]
    return " ".join(text.replace("Version:", "").split(",")[0].split())
