"""The raw baselines ``mpifusion bench`` compares with: the same bytes handed to MPI directly.

Each builder returns a function that runs one step of its way, with its buffers allocated
once, so the timing loop measures the collective and nothing else. The fair floors of a
sync step do the step's 1/n scaling too, the two cheap ways.
"""
from __future__ import annotations

import datetime
import socket
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ...runtime.param import Param
from .workload import MiB, default_segment


def segmented_allreduce(comm: MPI.Comm, buf: np.ndarray, seg_bytes: int,
                        scale: Optional[float] = None) -> Callable[[], None]:
    """Blocking in-place ``Allreduce`` of ``buf`` in segments, each scaled while in cache
    when ``scale`` is given (one segment >= the buffer: one call + one pass)."""
    step = max(1, seg_bytes // buf.itemsize)
    f = None if scale is None else buf.dtype.type(scale)

    def run() -> None:
        for s in range(0, buf.size, step):
            v = buf[s:s + step]
            comm.Allreduce(MPI.IN_PLACE, [v, MPI.FLOAT])
            if f is not None:
                v *= f
    return run


def segmented_reduce(comm: MPI.Comm, buf: np.ndarray, seg_bytes: int,
                     scale: Optional[float] = None, everywhere: bool = False
                     ) -> Callable[[], None]:
    """Blocking in-place ``Reduce`` to rank 0 in segments; the root scales what it received
    when ``scale`` is given, and with ``everywhere`` the other ranks scale each segment they
    sent too (Paddle's REDUCE scales every rank's buffer), so the floor does the same work."""
    step = max(1, seg_bytes // buf.itemsize)
    root = comm.Get_rank() == 0
    f = None if scale is None else buf.dtype.type(scale)
    own = f if everywhere else None

    def run() -> None:
        for s in range(0, buf.size, step):
            v = buf[s:s + step]
            if root:
                comm.Reduce(MPI.IN_PLACE, [v, MPI.FLOAT], root=0)
                if f is not None:
                    v *= f
            else:
                comm.Reduce([v, MPI.FLOAT], None, root=0)
                if own is not None:
                    v *= own
    return run


def reduce_scatter_allgather(comm: MPI.Comm, buf: np.ndarray,
                             scale: Optional[float] = None) -> Callable[[], None]:
    """``Reduce_scatter_block`` + in-place ``Allgather`` of ``buf`` (a multiple of the rank
    count), one call each; with ``scale`` the own shard is scaled in between."""
    n, rank = comm.Get_size(), comm.Get_rank()
    shard = np.empty(buf.size // n, buf.dtype)
    mine = buf[rank * shard.size:(rank + 1) * shard.size]
    f = None if scale is None else buf.dtype.type(scale)

    def run() -> None:
        comm.Reduce_scatter_block([buf, MPI.FLOAT], [shard, MPI.FLOAT])
        if f is not None:
            np.multiply(shard, f, out=mine)
        comm.Allgather(MPI.IN_PLACE, [buf, MPI.FLOAT])
    return run


def raw_candidates(comm: MPI.Comm, nbytes: int, params: Sequence[Param], scale: float,
                   segments: Sequence[int]) -> Dict[str, Callable[[], Any]]:
    """The ways to hand the same bytes to MPI directly (no mpifusion), by name."""
    buf = np.ones(nbytes // 4, np.float32)
    f = np.float32(scale)

    def segmented(seg_bytes: int, with_scale: bool) -> Callable[[], None]:
        return segmented_allreduce(comm, buf, seg_bytes, scale if with_scale else None)

    cands: Dict[str, Callable[[], Any]] = {
        "Allreduce (blocking, one call)": lambda: comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT]),
    }
    for seg in segments:
        cands[f"Allreduce (blocking, {seg // MiB} MiB segments)"] = segmented(seg, False)
    if hasattr(comm, "Allreduce_init"):
        persistent = comm.Allreduce_init(MPI.IN_PLACE, [buf, MPI.FLOAT])

        def run_persistent() -> None:
            persistent.Start()
            persistent.Wait()
        cands["Allreduce_init (persistent, one call)"] = run_persistent

    def iseg() -> None:
        step = 8 * MiB // 4
        MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, [buf[s:s + step], MPI.FLOAT])
                             for s in range(0, buf.size, step)])
    cands["Iallreduce (8 MiB segments, Waitall)"] = iseg
    cands["Iallreduce (naive, one call)"] = (
        lambda: comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.FLOAT]).Wait())
    grads = [np.ones(p.numel, np.float32) for p in params]
    cands["Iallreduce per param (Waitall)"] = lambda: MPI.Request.Waitall(
        [comm.Iallreduce(MPI.IN_PLACE, [g, MPI.FLOAT]) for g in grads])
    # the fair floor of a sync step: the same 1/n scaling on the same bytes, done the two
    # cheap ways, at the segment sizes mpifusion's thread strategy may use
    seg = default_segment(comm)
    for size in sorted({4 * MiB, seg}):
        cands[f"floor+scale: Allreduce {size // MiB} MiB segments, scaled per segment"] = \
            segmented(size, True)

    def scale_pass() -> None:
        segmented(seg, False)()
        buf.__imul__(f)
    cands[f"floor+scale: Allreduce {seg // MiB} MiB segments, then one scale pass"] = scale_pass
    return cands


def raw_other(comm: MPI.Comm, nbytes: int) -> Dict[str, Callable[[], Any]]:
    """Raw floors for REDUCE and REDUCE_SCATTER + allgather on the same bytes, each doing
    its step's 1/n: REDUCE's root scales the result and the other ranks what they sent (as
    Paddle scales every rank's buffer), REDUCE_SCATTER each rank its own shard."""
    n = comm.Get_size()
    f = 1.0 / n
    buf = np.ones((nbytes // 4) // n * n, np.float32)
    ways = {f"REDUCE raw: Reduce (blocking, {seg // MiB} MiB segments) + 1/n":
            segmented_reduce(comm, buf, seg, f, everywhere=True)
            for seg in sorted({8 * MiB, default_segment(comm)})}
    ways["REDUCE raw: Reduce (blocking, one call) + 1/n pass"] = segmented_reduce(
        comm, buf, buf.nbytes, f, everywhere=True)
    ways["REDUCE_SCATTER raw: Reduce_scatter_block + 1/n + Allgather (one call each)"] = \
        reduce_scatter_allgather(comm, buf, f)
    return ways


def gloo_allreduce(comm: MPI.Comm, nbytes: int) -> Optional[dict]:
    """torch.distributed gloo all_reduce of the same bytes: {"fn", "torch", "close"}, or
    {"error"}; None when torch is not installed."""
    try:  # torch is optional and takes seconds to import: only when gloo is measured
        import torch
        import torch.distributed as dist
    except Exception:
        return None
    rank, n = comm.Get_rank(), comm.Get_size()
    host = comm.bcast(socket.gethostname() if rank == 0 else None, root=0)
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=n, timeout=datetime.timedelta(seconds=120))
    except Exception as exc:
        return {"error": f"gloo init failed: {exc}"}
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    return {"fn": lambda: dist.all_reduce(t), "torch": torch.__version__,
            "close": dist.destroy_process_group}
