"""What ``mpifusion bench`` measures besides step times: overlap, add_grad cost, peak memory.

Overlap follows OSU's method (a collective started, dummy compute for as long as the
collective alone takes, then the wait); add_grad is timed without communication; memory is
traced (numpy's allocations) during steps of fresh buffers.
"""
from __future__ import annotations

import statistics
import time
import tracemalloc
from typing import Callable, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ...plan.actions import HookAction
from ...runtime.buffer import FusedCommBuffer
from ..timing import timeit
from .workload import build_buffers, full_step, grad_bytes, make_params


def emulate_compute(seconds: float, mode: str, poll: Callable[[], None]) -> None:
    """OSU's dummy compute. ``device``: the host is free (a GPU computes), polling MPI every
    millisecond; ``cpu``: the host itself computes (numpy), polling between chunks."""
    end = time.perf_counter() + seconds
    if mode == "device":
        while True:
            left = end - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(1e-3, left))
            poll()
    x = np.linspace(0, 1, 32768, dtype=np.float32)
    while time.perf_counter() < end:
        np.sin(x, out=x)
        poll()


def overlap(buffers: Sequence[FusedCommBuffer], comm: MPI.Comm, iters: int, warmup: int,
            mode: str) -> dict:
    """OSU iallreduce overlap: pure = start+wait alone; compute for as long; overlap =
    1 - (total - compute) / pure."""
    def start() -> None:
        for b in buffers:
            for p in b.params:
                b.add_grad(p)

    def finish() -> None:
        for b in buffers:
            b.scale_grads()

    pure = timeit(lambda: (start(), finish()), comm, iters, warmup)["median_s"]
    poll = buffers[0].comm.poll
    totals = []
    for i in range(warmup + iters):
        comm.Barrier()
        t0 = time.perf_counter()
        start()
        emulate_compute(pure, mode, poll)
        finish()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= warmup:
            totals.append(dt)
    total = statistics.median(totals)
    pct = max(0.0, 100.0 * (1.0 - (total - pure) / pure)) if pure > 0 else 0.0
    return {"pure_s": pure, "compute_s": pure, "total_s": total, "overlap_pct": min(pct, 100.0)}


def add_grad_cost(buffers: Sequence[FusedCommBuffer], comm: MPI.Comm, iters: int) -> dict:
    """Seconds per ``add_grad(param)`` on the zero-copy path (grads already in the buffer),
    communication excluded (``use_comm=False``, comm started afterwards)."""
    per = []
    nparams = sum(len(b.params) for b in buffers)
    for _ in range(iters + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        for b in buffers:
            for p in b.params:
                b.add_grad(p, use_comm=False)
        per.append((time.perf_counter() - t0) / nparams)
        for b in buffers:
            b.comm_grads()
        for b in buffers:
            b.scale_grads()
    return {"per_param_s": statistics.median(per[1:]), "params": nparams}


def peak_memory(preset: str, dtype: Optional[str], act: HookAction, group_bytes: int,
                comm: MPI.Comm, strategy: str) -> dict:
    """Peak traced (numpy) memory during steps against params + grads + padding."""
    tracemalloc.start()
    try:
        params = make_params(preset, dtype, seed=comm.Get_rank())
        buffers = build_buffers(params, act, group_bytes, comm, strategy)
        full_step(buffers, sync=act == HookAction.REDUCE_SCATTER)
        if act == HookAction.REDUCE_SCATTER:
            ideal = sum(b.param_storage.nbytes for b in buffers)
        else:
            ideal = sum(p.data.nbytes for p in params)
        ideal += grad_bytes(buffers)
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(2):
            full_step(buffers, sync=act == HookAction.REDUCE_SCATTER)
        peak = tracemalloc.get_traced_memory()[1]
        del buffers, params
    finally:
        tracemalloc.stop()
    peak = comm.allreduce(peak, op=MPI.MAX)
    return {"action": act.name, "ideal_bytes": int(ideal), "held_bytes": int(before),
            "peak_bytes": int(peak), "ratio": peak / ideal}
