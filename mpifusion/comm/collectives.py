"""Each collective written once, as a generator of MPI calls.

A generator yields ``(method, args, kwargs)`` for mpi4py's blocking method; the engine
decides whether to run it blocking (thread) or as the ``I`` form (nonblocking). Code after a
``yield`` runs once that call has completed: that is where each reduced segment is scaled
(and rounded back, for half precision) while it is still in cache.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ..arrays import backend, cuda, halfcast
from ..dtypes import HALF, float32
from .task import Steps

_MPI_TYPES = {"f": MPI.FLOAT, "d": MPI.DOUBLE}  # by dtype.char: cheaper than .name


def _spec(arr: Any) -> list:
    """mpi4py buffer spec for a flat fp32/fp64 array (predefined types, so MPI_SUM applies)."""
    return [arr, _MPI_TYPES[arr.dtype.char]]


def _on_host(buf: Any) -> Tuple[Any, bool]:
    """(array MPI may read, staged?): device buffers go through pinned host memory when the
    MPI is not CUDA-aware."""
    if backend.is_cupy(buf) and not cuda.is_cuda_aware():
        return cuda.stage(buf), True
    return buf, False


def _scratch(n: int, like: Any) -> Any:
    return backend.empty(n, float32, like if backend.is_cupy(like) else None)


def allreduce_steps(buf: Any, scale: Optional[float], seg: int, root: Optional[int],
                     rank: int) -> Steps:
    """Allreduce (``root is None``) or reduce to ``root``, one segment at a time; each reduced
    segment is scaled (and rounded back, for half precision) while it is still in cache."""
    flat, staged = _on_host(buf.reshape(-1))
    half = flat.dtype in HALF
    lands = root is None or root == rank
    work = _scratch(min(seg, flat.size), flat) if half else None
    for start in range(0, flat.size, seg):
        part = flat[start:start + seg]
        if half:
            w = work[:part.size]
            halfcast.widen(part, w)  # memory speed; the same bits as w[...] = part
            cuda.synchronize(w)  # a device widening kernel must finish before MPI reads w
        else:
            w = part
        if root is None:
            yield ("Allreduce", (MPI.IN_PLACE, _spec(w)), {"op": MPI.SUM})
        elif lands:
            yield ("Reduce", (MPI.IN_PLACE, _spec(w)), {"op": MPI.SUM, "root": root})
        else:
            yield ("Reduce", (_spec(w), None), {"op": MPI.SUM, "root": root})
        if lands:
            if scale is not None:
                backend.scale_(w, scale)
            if half:
                halfcast.narrow(w, part)  # round to nearest even, as part[...] = w
    if staged and lands:
        cuda.unstage(flat, buf.reshape(-1))
    cuda.synchronize(buf)


def reduce_scatter_steps(sendbuf: Any, recvbuf: Any, scale: Optional[float], seg: int,
                          nranks: int, rank: int) -> Steps:
    """Reduce-scatter in rounds: round k packs piece k of every rank's shard (widened to fp32
    for half precision) into one scratch, reduce-scatters it, and lands this rank's piece.
    Scratch memory: (nranks + 1) pieces, whatever the buffer size; aliasing is allowed."""
    send, staged = _on_host(sendbuf.reshape(-1))
    recv_dev = recvbuf.reshape(-1)
    # staged: land in host memory, copied to the device once at the end
    recv = np.empty(recv_dev.size, recv_dev.dtype) if staged else recv_dev
    shard = recv.size
    if send.dtype not in HALF and seg >= send.size:
        # one call, zero-copy; MPI forbids aliasing, so an in-place shard lands via a copy
        direct = recv if not _overlaps(send, recv) else backend.empty(shard, recv.dtype, recv)
        yield ("Reduce_scatter_block", (_spec(send), _spec(direct)), {"op": MPI.SUM})
        if scale is not None:
            backend.scale_(direct, scale)
        if direct is not recv:
            recv[...] = direct
        if staged:
            cuda.unstage(recv, recv_dev)
        cuda.synchronize(recvbuf)
        return
    piece = max(1, min(seg // nranks, shard))
    wdtype = float32 if send.dtype in HALF else send.dtype
    pack = backend.empty(nranks * piece, wdtype, send if backend.is_cupy(send) else None)
    out = backend.empty(piece, wdtype, send if backend.is_cupy(send) else None)
    grid = send.reshape(nranks, shard)
    for start in range(0, shard, piece):
        n = min(piece, shard - start)
        block = pack[:nranks * n].reshape(nranks, n)
        if send.dtype not in HALF:
            block[...] = grid[:, start:start + n]
        else:  # half: widen row by row (each row is contiguous)
            for r in range(nranks):
                halfcast.widen(grid[r, start:start + n], block[r])
        cuda.synchronize(block)  # a device packing kernel must finish before MPI reads it
        o = out[:n]
        yield ("Reduce_scatter_block", (_spec(block.reshape(-1)), _spec(o)), {"op": MPI.SUM})
        if scale is not None:
            backend.scale_(o, scale)
        if recv.dtype not in HALF:
            recv[start:start + n] = o
        else:
            halfcast.narrow(o, recv[start:start + n])
    if staged:
        cuda.unstage(recv, recv_dev)
    cuda.synchronize(recvbuf)


def allgather_steps(buf: Any) -> Steps:
    """In-place allgather of raw bytes: no arithmetic, so any dtype moves as it is."""
    flat, staged = _on_host(buf.reshape(-1))
    raw = flat.view(np.uint8)
    yield ("Allgather", (MPI.IN_PLACE, [raw, MPI.BYTE]), {})
    if staged:
        cuda.unstage(flat, buf.reshape(-1))
    cuda.synchronize(buf)


def barrier_steps() -> Steps:
    yield ("Barrier", (), {})


def _overlaps(a: Any, b: Any) -> bool:
    a0, b0 = backend.data_ptr(a), backend.data_ptr(b)
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes

