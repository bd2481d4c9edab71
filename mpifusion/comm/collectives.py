"""Each collective written once, as a generator of MPI calls.

A generator yields a :class:`~.call.Call` of mpi4py's blocking method (``call.py`` has the
rules); the engine decides whether to run it blocking (thread) or as the ``I`` form
(nonblocking, up to ``window`` segments in flight). Code after a fence's ``yield`` runs once
that call has completed; a pipelined call's ``land`` runs once it completed, in issue order:
that is where each reduced segment is scaled (and rounded back, for half precision) while it
is still in cache. Scratch that a pipelined call reads or writes comes from a ring of
``window`` slots (``_ring``), reused only after its call landed.

A device buffer on an MPI that is not CUDA-aware goes through ``staging.StagedSegments``
for every collective: allreduce/reduce by segment, reduce-scatter and in-place allgather in
rounds of piece ``k`` of every rank's shard (``_pieces``); no collective stages a whole buffer.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterator, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ..arrays import backend, cuda, halfcast
from ..dtypes import HALF, float32
from ..arrays.staging import CupyDevice, Device, StagedSegments
from .call import FENCE, Call, Steps, pipelined

#: the predefined MPI type of each accumulator dtype (fp32, fp64), by dtype.char: cheaper than
#: .name; the one table of every collective here and in shm_collectives.py
MPI_TYPES = {"f": MPI.FLOAT, "d": MPI.DOUBLE}


def mpi_spec(arr: Any) -> list:
    """mpi4py buffer spec for a flat fp32/fp64 array (predefined types, so MPI_SUM applies)."""
    return [arr, MPI_TYPES[arr.dtype.char]]


def _staged(buf: Any) -> bool:
    return backend.is_cupy(buf) and not cuda.is_cuda_aware()


def _ring(slots: int, n: int, dtype: Any, like: Any) -> list:
    """``slots`` scratch arrays of ``n`` elements on ``like``'s device: the scratch of the
    pipelined calls, slot ``k % slots`` for call ``k`` (reused once call ``k`` landed)."""
    device = like if backend.is_cupy(like) else None
    return [backend.empty(n, dtype, device) for _ in range(slots)]


class _HostSegments:
    """The segments of an array MPI can read: fp32/fp64 in place, half precision widened
    into a ring of ``window`` fp32 slots. Same interface as ``staging.StagedSegments``
    (in place: no receive array)."""

    def __init__(self, flat: Any, seg: int, window: int, scale: Optional[float],
                 lands: bool) -> None:
        self.flat, self.seg, self.scale, self.lands = flat, seg, scale, lands
        count = -(-flat.size // seg) if flat.size else 0
        self.work = (_ring(min(window, count), min(seg, flat.size), float32, flat)
                     if flat.dtype in HALF else None)

    def segments(self) -> Iterator[Tuple[Any, None, Any]]:
        flat, seg, work = self.flat, self.seg, self.work
        for k, start in enumerate(range(0, flat.size, seg)):
            part = flat[start:start + seg]
            if work is not None:
                w = work[k % len(work)][:part.size]
                halfcast.widen(part, w)  # memory speed; the same bits as w[...] = part
                cuda.synchronize(w)  # a device widening kernel must finish before MPI reads w
            else:
                w = part
            land = None
            if self.lands and (self.scale is not None or work is not None):
                land = partial(_land, w, self.scale, part if work is not None else None)
            yield w, None, land

    def finish(self) -> None:
        pass


def _land(w: Any, scale: Optional[float], out: Any) -> None:
    """A reduced segment, still in cache: scale it, round it back into ``out`` (half)."""
    if scale is not None:
        backend.scale_(w, scale)
    if out is not None:
        halfcast.narrow(w, out)  # round to nearest even, as out[...] = w


def _reduce_call(w: Any, root: Optional[int], lands: bool, land: Any) -> Call:
    """The in-place sum of segment ``w`` (pipelined): to every rank, or to ``root``
    (``lands``: this is the root)."""
    if root is None:
        return pipelined("Allreduce", (MPI.IN_PLACE, mpi_spec(w)), {"op": MPI.SUM}, land)
    if lands:
        return pipelined("Reduce", (MPI.IN_PLACE, mpi_spec(w)), {"op": MPI.SUM, "root": root},
                         land)
    return pipelined("Reduce", (mpi_spec(w), None), {"op": MPI.SUM, "root": root}, land)


def allreduce_steps(buf: Any, scale: Optional[float], seg: int, root: Optional[int],
                     rank: int, window: int = 1, device: Optional[Device] = None,
                     sent_scale: Optional[float] = None, ring: int = 0) -> Steps:
    """Allreduce (``root is None``) or reduce to ``root``, one segment at a time, pipelined:
    up to ``window`` segments in flight; each reduced segment is scaled (and rounded back,
    for half precision) while it is still in cache. ``sent_scale``: a reduce's non-root
    ranks scale their own values by it, each segment once it was sent (still in cache), so
    a caller that scales every rank's buffer after a reduce (Paddle does) makes no second
    pass over it. A device buffer on an MPI that is not CUDA-aware (or any buffer, given a
    staging ``device``) goes through ``staging.StagedSegments``: its copies overlap the
    reduction of other segments. ``ring``: the number of ranks, to all-reduce a host buffer
    by :func:`_ring_allreduce` instead of the library's Allreduce (0)."""
    flat = buf if buf.ndim == 1 else buf.reshape(-1)
    lands = root is None or root == rank
    own = None if lands else sent_scale
    host = device is None and not backend.is_cupy(flat)
    if ring and root is None and host:
        return _ring_allreduce(flat, scale, seg, rank, ring)
    if host and flat.size <= seg and flat.dtype.char in MPI_TYPES:
        # one host segment in place (most small buffers): the same call, made now -- a
        # generator would cost a small collective ~1 us more (BENCHMARKS.md, small messages)
        factor = scale if lands else own
        return iter((_reduce_call(flat, root, lands, None if factor is None
                                  else backend.scaling(flat, factor)),))
    return _segmented(flat, buf, scale, seg, root, lands, own, window, device)


def _segmented(flat: Any, buf: Any, scale: Optional[float], seg: int, root: Optional[int],
               lands: bool, own: Optional[float], window: int,
               device: Optional[Device]) -> Steps:
    """:func:`allreduce_steps` of a buffer in segments (or staged, or half precision)."""
    if device is not None or _staged(flat):
        source: Any = StagedSegments.of_buffer(flat, seg, window, scale if lands else None,
                                               lands, device or CupyDevice(flat))
    else:  # a non-root's sent segment is scaled in place (half: from its fp32 copy, rounded once)
        source = _HostSegments(flat, seg, window, scale if lands else own,
                               lands or own is not None)
    for w, _recv, land in source.segments():
        yield _reduce_call(w, root, lands, land)
    if isinstance(source, StagedSegments) or backend.is_cupy(flat):
        yield FENCE  # every segment landed (its copy back or its kernels were started)
        source.finish()
        if isinstance(source, StagedSegments) and own is not None:
            backend.scale_(flat, own)  # on the device: nothing was copied back to scale
    cuda.synchronize(buf)


#: the ring's point-to-point tag on the private communicator (its collectives never match it)
RING_TAG = 7


def _ring_allreduce(flat: Any, scale: Optional[float], seg: int, rank: int,
                    nranks: int) -> Steps:
    """All-reduce by a ring of ``Sendrecv`` (``Isendrecv`` when non-blocking), one segment at
    a time: the segment cut into ``nranks`` chunks (sizes differing by at most one),
    ``nranks - 1`` rounds of reduce-scatter (send a chunk right, receive the left neighbour's
    into scratch, add it), then ``nranks - 1`` rounds of all-gather, each round a fence (it
    sends what the previous one summed). Every chunk is summed in one place, in ring order,
    and copied to the others, so every rank holds the same bits. Why: point-to-point calls
    are progressed well by every MPI, where Open MPI's non-blocking all-reduce (libnbc) is
    2-6x its blocking one here. Segments side by side (a window) were slower: 1.4-1.6x the
    ``thread`` step at 2-4 in flight against 1.0-1.2x one at a time (BENCHMARKS.md)."""
    source = _HostSegments(flat, seg, 1, scale, True)
    wide = np.float64 if flat.dtype == np.float64 else float32
    scratch = _ring(1, -(-min(seg, flat.size) // nranks), wide, flat)[0]
    right, left = (rank + 1) % nranks, (rank - 1) % nranks
    for w, _recv, land in source.segments():
        cuts = [i * w.size // nranks for i in range(nranks + 1)]

        def chunk(c: int) -> Any:
            return w[cuts[c]:cuts[c + 1]]

        for k in range(nranks - 1):  # reduce-scatter: then chunk (rank + 1) % n is summed here
            mine, theirs = chunk((rank - k - 1) % nranks), chunk((rank - k) % nranks)
            t = scratch[:mine.size]
            yield Call("Sendrecv", (mpi_spec(theirs), right, RING_TAG, mpi_spec(t), left,
                                    RING_TAG))
            np.add(mine, t, out=mine)
        for k in range(nranks - 1):  # all-gather: pass the summed chunks on around the ring
            yield Call("Sendrecv", (mpi_spec(chunk((rank - k + 1) % nranks)), right, RING_TAG,
                                    mpi_spec(chunk((rank - k) % nranks)), left, RING_TAG))
        if land is not None:
            land()


def _pieces(flat: Any, seg: int, nranks: int) -> Tuple[Any, int, Callable[[int], slice]]:
    """``flat`` as one row per rank's shard, the number of rounds, and round ``k``'s columns:
    piece ``k`` of every shard, ``nranks`` pieces making at most ``seg`` elements (at least
    one element per piece)."""
    shard = flat.size // nranks
    piece = max(1, min(seg // nranks, shard))

    def columns(k: int) -> slice:
        return slice(k * piece, min((k + 1) * piece, shard))

    return flat.reshape(nranks, shard), -(-shard // piece), columns


def reduce_scatter_steps(sendbuf: Any, recvbuf: Any, scale: Optional[float], seg: int,
                          nranks: int, rank: int, window: int = 1,
                          device: Optional[Device] = None,
                          others_scale: Optional[float] = None) -> Steps:
    """Reduce-scatter in rounds: round k packs piece k of every rank's shard (widened to fp32
    for half precision) into a scratch slot, reduce-scatters it, and lands this rank's piece;
    up to ``window`` rounds in flight. Scratch memory: ``window`` x (nranks + 1) pieces,
    whatever the buffer size; aliasing is allowed. A device buffer on an MPI that is not
    CUDA-aware (or any buffer, given a staging ``device``) runs the same rounds through
    ``staging.StagedSegments``: packed and widened on the device, its copies overlapping
    the reduction of other rounds. ``others_scale``: the other ranks' shards of ``sendbuf``
    (which keep this rank's own values) are scaled by it, each piece right after it was
    packed, still in cache (Paddle scales the whole buffer afterwards: no second pass)."""
    send, recv = sendbuf.reshape(-1), recvbuf.reshape(-1)
    shard = recv.size
    others = [r for r in range(nranks) if r != rank] if others_scale is not None else []
    if device is not None or _staged(send):
        grid, count, columns = _pieces(send, seg, nranks)
        staged = StagedSegments(count, lambda k: grid[:, columns(k)],
                                lambda k: recv[columns(k)], window, scale,
                                device or CupyDevice(send))
        for w, r, land in staged.segments():
            yield pipelined("Reduce_scatter_block", (mpi_spec(w), mpi_spec(r)),
                            {"op": MPI.SUM}, land)
        yield FENCE  # every round landed (its copy back was started)
        staged.finish()
        for r in others:  # on the device, where they are
            backend.scale_(grid[r], others_scale)
        cuda.synchronize(recvbuf)
        return
    if send.dtype not in HALF and seg >= send.size:
        # one call, zero-copy; MPI forbids aliasing, so an in-place shard lands via a copy
        direct = recv if not backend.overlaps(send, recv) else backend.empty(shard, recv.dtype, recv)
        yield Call("Reduce_scatter_block", (mpi_spec(send), mpi_spec(direct)),
                   {"op": MPI.SUM})
        if scale is not None:
            backend.scale_(direct, scale)
        if direct is not recv:
            recv[...] = direct
        for r in others:  # MPI read them in place: only now
            backend.scale_(send[r * shard:(r + 1) * shard], others_scale)
        cuda.synchronize(recvbuf)
        return
    half = send.dtype in HALF
    wdtype = float32 if half else send.dtype
    grid, count, columns = _pieces(send, seg, nranks)
    piece = columns(0).stop
    slots = min(window, count)
    packs = _ring(slots, nranks * piece, wdtype, send)
    outs = _ring(slots, piece, wdtype, send)
    for k in range(count):
        where = columns(k)
        n = where.stop - where.start
        block = packs[k % slots][:nranks * n].reshape(nranks, n)
        if not half:
            block[...] = grid[:, where]
        else:  # half: widen row by row (each row is contiguous)
            for r in range(nranks):
                halfcast.widen(grid[r, where], block[r])
        for r in others:  # MPI reads the packed copy: the rows themselves are done with
            backend.scale_(grid[r, where], others_scale)
        cuda.synchronize(block)  # a device packing kernel must finish before MPI reads it
        o = outs[k % slots][:n]
        yield pipelined("Reduce_scatter_block", (mpi_spec(block.reshape(-1)), mpi_spec(o)),
                        {"op": MPI.SUM}, partial(_land_piece, o, scale, recv[where]))
    cuda.synchronize(recvbuf)


def _land_piece(o: Any, scale: Optional[float], out: Any) -> None:
    """This rank's reduced piece into its place in the shard (rounded back for half)."""
    if scale is not None:
        backend.scale_(o, scale)
    if out.dtype not in HALF:
        out[...] = o
    else:
        halfcast.narrow(o, out)


def allgather_steps(buf: Any, seg: int = 1 << 62, nranks: int = 1, rank: int = 0,
                    window: int = 1, device: Optional[Device] = None) -> Steps:
    """In-place allgather of raw bytes: no arithmetic, so any dtype moves as it is. One
    ``Allgather`` of the whole buffer where MPI can read it; a device buffer on an MPI that is
    not CUDA-aware (or any buffer, given a staging ``device``) goes in rounds through
    ``staging.StagedSegments``: round k sends piece k of this rank's shard and gathers piece
    k of every shard (``nranks`` pieces of at most ``seg`` elements in all), so each round is
    one plain ``Allgather`` and its copies overlap the other rounds' MPI."""
    flat = buf.reshape(-1)
    if device is not None or _staged(flat):
        grid, count, columns = _pieces(flat, seg, nranks)
        staged = StagedSegments(count, lambda k: grid[rank, columns(k)],
                                lambda k: grid[:, columns(k)], window, None,
                                device or CupyDevice(flat), widen=False)
        for w, r, land in staged.segments():
            yield pipelined("Allgather", ([w.view(np.uint8), MPI.BYTE],
                                          [r.view(np.uint8), MPI.BYTE]), land=land)
        yield FENCE  # every round landed (its copy back was started)
        staged.finish()
    else:
        yield Call("Allgather", (MPI.IN_PLACE, [flat.view(np.uint8), MPI.BYTE]))
    cuda.synchronize(buf)


def barrier_steps() -> Steps:
    yield Call("Barrier")



