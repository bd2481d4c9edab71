"""The ``shm`` strategy's memory under pressure: run under mpiexec.

    mpiexec -n 2 python scripts/shm_memory_check.py tight NBUF MIB
        NBUF all-reduce buffers of MIB MiB of fp32 each, built on COMM_WORLD, one step each
        (add_grad into every buffer, then the sums checked). Where /dev/shm is too small for
        all, some buffers fall back to private memory with a one-line warning, none dies of
        SIGBUS. Prints ``buffers in shared memory: K of NBUF``.
    mpiexec -n 2 python scripts/shm_memory_check.py reuse MIB
        A buffer of MIB MiB with release_grads: a step, clear_grad_storage (its pages go
        back), then /dev/shm filled up by rank 0, and another step: the region cannot be
        reserved again, so the grads go to private memory with a warning; the sums stay right.
    mpiexec -n 2 python scripts/shm_memory_check.py churn N
        N tiny buffers built, stepped once and closed on COMM_WORLD.
    mpiexec -n 2 python scripts/shm_memory_check.py split N
        N times: sub = COMM_WORLD.Split(), a tiny buffer on it, one step, sub.Free().

``churn`` and ``split`` print, per rank, one JSON line: the seconds taken, and file
descriptors (/proc/self/fd), mappings (/proc/self/maps lines), RSS (KiB), MPI windows,
arena regions and private communicators alive (after a garbage collection), after a
warm-up of N // 10 iterations and at the end (``warm``, ``end``).
"""
import gc
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpifusion import FusedCommBuffer, HookAction, Param
from mpifusion.comm import registry, shm
from mpifusion.config import CommOptions

OPTS = CommOptions(strategy="shm")


def gauge() -> dict:
    gc.collect()  # what a garbage cycle (a dropped buffer) holds is not a leak
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"fds": len(os.listdir("/proc/self/fd")), "maps": maps, "rss_kib": rss,
            "windows": shm.live_windows(), "regions": shm.live_regions(),
            "comms": registry.live_private_comms()}


def one_step(comm, ident, numel, opts=OPTS, **kw):
    """A buffer of one fp32 param of ``numel``, one step of grads ``rank + 1``, checked."""
    rank, n = comm.Get_rank(), comm.Get_size()
    params = [Param(f"w{ident}", np.zeros(numel, np.float32))]
    buf = FusedCommBuffer(ident, params, comm, act=HookAction.ALL_REDUCE, comm_options=opts,
                          **kw)
    return buf, params


def step(buf, params, comm):
    rank, n = comm.Get_rank(), comm.Get_size()
    for p in params:
        buf.add_grad(p, grad=np.full(p.data.size, rank + 1.0, np.float32))
    buf.scale_grads()
    got = params[0].grad
    want_sum, want_avg = n * (n + 1) / 2, (n + 1) / 2
    assert (got == want_sum).all() or (got == want_avg).all(), \
        f"rank {rank}: buffer {buf.id}: got {got[:4]}, expected {want_sum} or {want_avg}"


def tight(nbuf: int, mib: int) -> None:
    comm = MPI.COMM_WORLD
    numel = mib * (1 << 20) // 4
    bufs = [one_step(comm, i, numel) for i in range(nbuf)]
    for buf, params in bufs:
        step(buf, params, comm)
    shared = sum(buf.comm.in_shared_window(buf.grad_storage) for buf, _ in bufs)
    if comm.Get_rank() == 0:
        print(f"buffers in shared memory: {shared} of {nbuf}", flush=True)


def reuse(mib: int) -> None:
    comm = MPI.COMM_WORLD
    numel = mib * (1 << 20) // 4
    buf, params = one_step(comm, 0, numel, release_grads=True)
    step(buf, params, comm)
    assert buf.comm.in_shared_window(buf.grad_storage)
    buf.clear_grad_storage()
    comm.Barrier()  # every rank's pages went back before rank 0 measures what is free
    filler = "/dev/shm/shm_memory_check.filler"
    if comm.Get_rank() == 0:
        st = os.statvfs("/dev/shm")
        fd = os.open(filler, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(st.f_bavail * st.f_frsize - (1 << 20), 1))
        finally:
            os.close(fd)
    comm.Barrier()
    try:
        step(buf, params, comm)
        shared = buf.comm.in_shared_window(buf.grad_storage)
        print(f"rank {comm.Get_rank()}: after refilling: grads in shared memory: {shared}",
              flush=True)
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            os.unlink(filler)


def churn(n: int, split: bool) -> None:
    world = MPI.COMM_WORLD
    warm = None
    t0 = time.perf_counter()
    for i in range(n):
        comm = world.Split(0, world.Get_rank()) if split else world
        buf, params = one_step(comm, i, 16)
        step(buf, params, comm)
        buf.close()
        del buf, params
        if split:
            comm.Free()
        if i + 1 == max(n // 10, 1):
            warm = gauge()
    took = time.perf_counter() - t0
    print(json.dumps({"rank": world.Get_rank(), "mode": "split" if split else "churn",
                      "n": n, "seconds": round(took, 2), "warm": warm, "end": gauge()}),
          flush=True)


def main(argv) -> None:
    mode = argv[1]
    if mode == "tight":
        tight(int(argv[2]), int(argv[3]))
    elif mode == "reuse":
        reuse(int(argv[2]))
    elif mode in ("churn", "split"):
        churn(int(argv[2]), mode == "split")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main(sys.argv)
