"""The ``shm`` strategy's collectives, each a generator of calls like ``collectives.py``.

The only MPI calls are barriers on the stream's private duplicate, so the engines, the
order check, negotiation, deadlines and the abandon rules apply unchanged; the work between
the barriers is loads and stores in MPI-3 shared windows (``shm.py``), run by the stream's
communication thread (so it overlaps ``add_grad``). Every collective:

1. writes this rank's descriptor row (what it runs, where its array lies) and, if its array
   is not in a window, stages the first round into its scratch; barrier;
2. reads every row: ranks that started different collectives raise the same ``OrderError``
   on every rank (after one more barrier) before any data moved (a second check behind the
   order check, and the only one with ``verify_order=False``); a peer's array is mapped from
   its window and offset;
3. one round (every array in a window: no copy at all) or rounds of one scratch's size
   (someone staged), each ended by a barrier: each rank sums *its 1/p slice* of every rank's
   array in fixed rank order 0..p-1, in cache-sized chunks, scales the sum while it is in
   cache, and writes it where it belongs (every rank's array for all-reduce, the root's for
   reduce, its own shard for reduce-scatter); all-gather copies the peers' shards.

One rank computes each element and copies it, so every rank holds the same bits, and a sum
in rank order is the left-to-right sum MPI's reduction describes. Half precision is read as
half, summed and scaled in fp32, and rounded once (``halfcast``); fp32 sums in fp32, fp64
in fp64. Values a collective leaves in place (a reduce's non-roots, a reduce-scatter's other
shards) are scaled only after the last barrier: the peers read them until then.
"""
from __future__ import annotations

from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple

import numpy as np

from ..arrays import backend, halfcast
from ..dtypes import HALF, float32
from ..errors import CommError, OrderError
from .call import Call, Steps
from .order import order_message
from .shm import DESC_WORDS, ShmStream

BARRIER = Call("Barrier")
#: bytes of the fp32/fp64 accumulator a slice is summed in, chunk by chunk (1 MiB: with the
#: p source chunks it stays in a 2-4 MiB L2; the prototype of issue 29 measured it)
CHUNK_BYTES = 1 << 20
#: a slice boundary falls on a multiple of this many elements, so two ranks rarely write
#: one cache line (64 elements: at least 128 bytes in every dtype)
CUT_ELEMENTS = 64

Opened = Generator[Call, None, List[Optional[np.ndarray]]]


def chunk_elements(seg: int, dtype: Any) -> int:
    """Elements per accumulator chunk for ``dtype`` buffers: the communicator's segment,
    at most :data:`CHUNK_BYTES` of the accumulator."""
    wide = 4 if np.dtype(dtype) in HALF else np.dtype(dtype).itemsize
    return max(1, min(seg, CHUNK_BYTES // wide))


def _cut(m: int, i: int, p: int) -> int:
    """Start of rank ``i``'s slice of ``m`` elements (``i == p``: the end)."""
    if i >= p:
        return m
    return min(m, -(-(m * i // p) // CUT_ELEMENTS) * CUT_ELEMENTS)


def _opening(stream: ShmStream, desc: Sequence[int], flat: np.ndarray,
             stage_first: Callable[[], None], name: str) -> Opened:
    """Steps 1-2 of the module docstring; returns every rank's array (None: staged in its
    scratch)."""
    memory, rank = stream.memory, stream.rank
    stream.serial += 1
    serial, offset = memory.locate(flat)
    if serial < 0:
        stage_first()
    row = stream.row(rank)
    row[0] = stream.serial
    row[1:DESC_WORDS] = desc
    row[DESC_WORDS], row[DESC_WORDS + 1] = serial, offset
    yield from _barrier(stream)
    rows = stream.rows()
    problem: Optional[Exception] = None
    if (rows[:, :DESC_WORDS] != rows[rank, :DESC_WORDS]).any():
        problem = OrderError(order_message(rank, rows[:, :DESC_WORDS], name))
    arrays: List[Optional[np.ndarray]] = []
    for q in range(stream.size):
        where, off = int(rows[q, DESC_WORDS]), int(rows[q, DESC_WORDS + 1])
        arr = (None if where < 0 or problem is not None else flat if q == rank
               else memory.peer_array(where, q, off, flat.size, flat.dtype))
        if where >= 0 and arr is None and problem is None:
            problem = CommError(f"rank {rank}: {name}: rank {q} named an array outside its "
                                f"shared window {where} (offset {off}, {flat.size} "
                                f"{flat.dtype})")
        arrays.append(arr)
    if problem is not None:
        # every rank read the same rows, so every rank raises this; but only after a barrier:
        # a rank that raised at once could start its next collective and rewrite its row
        # while a slower peer has not read this one yet
        yield from _barrier(stream)
        raise problem
    return arrays


def _barrier(stream: ShmStream) -> Steps:
    """A barrier with the memory fences around it (see ``shm.py``, memory ordering)."""
    stream.window.sync()
    yield BARRIER
    stream.window.sync()


def _sum_into(stream: ShmStream, sources: Sequence[np.ndarray], dests: Sequence[np.ndarray],
              lo: int, hi: int, scale: Optional[float], chunk: int) -> None:
    """``dests[lo:hi] = scale * sum(sources[lo:hi])``: summed in rank order (the order of
    ``sources``), chunk by chunk in the stream's accumulator (fp32 for half precision, read
    as half and rounded once), the same bits whoever computes it."""
    if hi <= lo:
        return
    dtype = sources[0].dtype
    half = dtype in HALF
    step = min(chunk, hi - lo)
    acc_all = stream.work(0, step, float32 if half else dtype)
    tmp_all = stream.work(1, step, float32) if half else None
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        acc = acc_all[:b - a]
        if half:
            halfcast.widen(sources[0][a:b], acc)
            tmp = tmp_all[:b - a]
            for src in sources[1:]:
                halfcast.widen(src[a:b], tmp)
                np.add(acc, tmp, out=acc)
        elif len(sources) > 1:
            np.add(sources[0][a:b], sources[1][a:b], out=acc)
            for src in sources[2:]:
                np.add(acc, src[a:b], out=acc)
        else:
            acc[...] = sources[0][a:b]
        if scale is not None:
            backend.scale_(acc, scale)
        first = dests[0][a:b]
        if half:
            halfcast.narrow(acc, first)
        else:
            first[...] = acc
        for dest in dests[1:]:
            dest[a:b] = first


def _rounds(n: int, step: int) -> List[Tuple[int, int]]:
    """``[a, b)`` of every round (one empty round for nothing: its barrier still ends it)."""
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


def allreduce_steps(stream: ShmStream, buf: np.ndarray, scale: Optional[float],
                    root: Optional[int], desc: Sequence[int], chunk: int, name: str,
                    sent_scale: Optional[float] = None) -> Steps:
    """All-reduce (``root`` None) or reduce to ``root`` of a host array. ``sent_scale``: a
    reduce's other ranks scale their own values by it once the peers are done reading."""
    flat = buf.reshape(-1)
    rank, p = stream.rank, stream.size
    lands = root is None or root == rank
    cap = stream.scratch_bytes // flat.itemsize
    mine = stream.scratch(rank, flat.dtype)
    arrays = yield from _opening(
        stream, desc, flat, lambda: np.copyto(mine[:min(cap, flat.size)], flat[:cap]), name)
    staged = [q for q in range(p) if arrays[q] is None]
    rounds = _rounds(flat.size, cap if staged else max(flat.size, 1))
    for i, (a, b) in enumerate(rounds):
        m = b - a
        if i:
            if rank in staged:
                mine[:m] = flat[a:b]
            yield from _barrier(stream)
        parts = [arrays[q][a:b] if arrays[q] is not None
                 else stream.scratch(q, flat.dtype)[:m] for q in range(p)]
        _sum_into(stream, parts, parts if root is None else [parts[root]],
                  _cut(m, rank, p), _cut(m, rank + 1, p), scale, chunk)
        yield from _barrier(stream)
        if rank in staged and lands:
            flat[a:b] = mine[:m]
    if not lands and sent_scale is not None:
        backend.scale_(flat, sent_scale)


def reduce_scatter_steps(stream: ShmStream, sendbuf: np.ndarray, recvbuf: np.ndarray,
                         scale: Optional[float], desc: Sequence[int], chunk: int, name: str,
                         others_scale: Optional[float] = None) -> Steps:
    """This rank's shard of the sum of every rank's ``sendbuf`` into ``recvbuf`` (which may
    be that shard of ``sendbuf``); the other shards of ``sendbuf`` keep this rank's values,
    scaled by ``others_scale`` after the last barrier. A staged round packs piece ``k`` of
    every shard but this rank's own (which only this rank reads, in place)."""
    send, recv = sendbuf.reshape(-1), recvbuf.reshape(-1)
    rank, p = stream.rank, stream.size
    shard = recv.size
    mine = stream.scratch(rank, send.dtype)
    piece_staged = max(1, min(stream.scratch_bytes // send.itemsize // p, shard))

    def stage(a: int, b: int) -> None:
        w = b - a
        for s in range(p):
            if s != rank:
                mine[s * w:(s + 1) * w] = send[s * shard + a:s * shard + b]

    arrays = yield from _opening(
        stream, desc, send, lambda: stage(0, min(piece_staged, shard)), name)
    staged = any(arr is None for arr in arrays)
    for i, (a, b) in enumerate(_rounds(shard, piece_staged if staged else max(shard, 1))):
        w = b - a
        if i:
            if arrays[rank] is None:
                stage(a, b)
            yield from _barrier(stream)
        own = slice(rank * shard + a, rank * shard + b)
        parts = [send[own] if q == rank else arrays[q][own] if arrays[q] is not None
                 else stream.scratch(q, send.dtype)[rank * w:(rank + 1) * w]
                 for q in range(p)]
        _sum_into(stream, parts, [recv[a:b]], 0, w, scale, chunk)
        yield from _barrier(stream)
    if others_scale is not None:
        for s in range(p):
            if s != rank:
                backend.scale_(send[s * shard:(s + 1) * shard], others_scale)


def allgather_steps(stream: ShmStream, buf: np.ndarray, desc: Sequence[int],
                    name: str) -> Steps:
    """Every rank's shard of ``buf`` (its own, in place) into every rank's ``buf``: raw
    copies, any dtype."""
    flat = buf.reshape(-1)
    rank, p = stream.rank, stream.size
    shard = flat.size // p
    mine = stream.scratch(rank, flat.dtype)
    piece_staged = max(1, min(stream.scratch_bytes // flat.itemsize, shard))

    def stage(a: int, b: int) -> None:
        mine[:b - a] = flat[rank * shard + a:rank * shard + b]

    arrays = yield from _opening(
        stream, desc, flat, lambda: stage(0, min(piece_staged, shard)), name)
    staged = any(arr is None for arr in arrays)
    for i, (a, b) in enumerate(_rounds(shard, piece_staged if staged else max(shard, 1))):
        if i:
            if arrays[rank] is None:
                stage(a, b)
            yield from _barrier(stream)
        for q in range(p):
            if q != rank:
                src = (arrays[q][q * shard + a:q * shard + b] if arrays[q] is not None
                       else stream.scratch(q, flat.dtype)[:b - a])
                flat[q * shard + a:q * shard + b] = src
        yield from _barrier(stream)
