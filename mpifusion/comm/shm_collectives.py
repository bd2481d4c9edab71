"""The ``shm`` and ``hierarchical`` strategies' collectives, each a generator of calls like
``collectives.py``.

With ``shm`` the only MPI calls are barriers on the stream's private duplicate, so the
engines, the order check, negotiation, deadlines and the abandon rules apply unchanged; the
work between the barriers is loads and stores in shared memory (``shm.py``), run by
the stream's communication thread (so it overlaps ``add_grad``). Every collective:

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

``hierarchical`` runs the same steps within each node (barriers on the stream's node
communicator) and, between the node sum of each chunk and its scaling, a collective over the
ranks of the same local index on every node (``ShmStream.cross``): a reduce-scatter then an
all-gather of the blocks for all-reduce (each block summed in one place: the same bits on every
node), a reduce for reduce, a reduce-scatter of the node sums of the shards this local index
owns for reduce-scatter; all-gather runs over the nodes first, then within the node. Ranks
are numbered node by node (rank = node * ranks per node + local rank).
"""
from __future__ import annotations

from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ..arrays import backend, halfcast
from ..dtypes import HALF, float32
from ..errors import CommError, OrderError
from .call import Call, Steps
from .order import order_error
from .shm import DESC_WORDS, ShmStream

#: predefined MPI types of the accumulators (fp32, fp64), by dtype.char
_MPI_TYPES = {"f": MPI.FLOAT, "d": MPI.DOUBLE}
#: bytes of the fp32/fp64 accumulator a slice is summed in, chunk by chunk (1 MiB: with the
#: p source chunks it stays in a 2-4 MiB L2; a prototype measured it)
CHUNK_BYTES = 1 << 20
#: a slice boundary falls on a multiple of this many elements, so two ranks rarely write
#: one cache line (64 elements: at least 128 bytes in every dtype)
CUT_ELEMENTS = 64

# IEEE_ONLY: every sum and scaling here runs under ``np.errstate(all="ignore")`` (never
# across a ``yield``: the state would leak into the caller's code): an overflow gives inf,
# as MPI's own sum does, with no warning and no ``FloatingPointError``. A caller's
# ``np.seterr(all="raise")`` (or warnings made errors) would otherwise stop one rank -- the
# one whose slice overflowed -- and leave the others at the next barrier. The gathered
# all-reduce (every rank sums everything, apart from its sources) sums fp32/fp64 in one
# compiled call (``halfcast.sum_wide``, which never consults numpy's error state) and
# otherwise tries numpy without an errstate, since entering one costs as much as summing
# 4 KiB, and sums again under it if numpy raised (after writing the whole result).

#: an all-reduce whose buffers of every rank together hold at most this many bytes gathers
#: them (through the scratch on one node, one MPI_Allgather across nodes) and every rank sums
#: all of them itself, in rank order: the same bits and the same rank-order sum as the
#: window's, where the two barriers and the window's bookkeeping cost more than the bytes
#: (see :func:`_gathered_allreduce`). 2 ranks, MPICH, x thread: a 64 KiB buffer 1.06 by
#: MPI_Allgather, 0.9-1.4 by the window; from a 128 KiB buffer on the window wins (0.70, and
#: 0.44 at 256 KiB)
GATHER_MAX_BYTES = 128 << 10


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
    # the barriers around the row check are non-blocking on every rank, whatever the size:
    # a collective run polled (small, under a deadline) issues the non-blocking forms, and
    # MPI never matches a blocking barrier with a non-blocking one -- ranks that started
    # collectives of different sizes would otherwise wait for each other until the
    # deadline instead of reading each other's rows
    opening = Call("Ibarrier", comm=stream.barrier.comm)
    yield from _barrier(stream, opening)
    rows = stream.rows()
    problem: Optional[Exception] = None
    if (rows[:, :DESC_WORDS] != rows[rank, :DESC_WORDS]).any():
        problem = order_error(rank, rows[:, :DESC_WORDS], name)  # steps named, if they differ
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
        yield from _barrier(stream, opening)
        raise problem
    return arrays


def _barrier(stream: ShmStream, call: Optional[Call] = None) -> Steps:
    """A barrier of the node's ranks (``call``: the stream's, else this form of it) with the
    memory fences around it (see ``shm.py``, memory ordering)."""
    stream.window.sync()
    yield stream.barrier if call is None else call
    stream.window.sync()


Cross = Optional[Callable[[np.ndarray], Steps]]


def _sum_into(stream: ShmStream, sources: Sequence[np.ndarray], dests: Sequence[np.ndarray],
              lo: int, hi: int, scale: Optional[float], chunk: int,
              cross: Cross = None) -> Steps:
    """``dests[lo:hi] = scale * sum(sources[lo:hi])``: summed in rank order (the order of
    ``sources``), chunk by chunk in the stream's accumulator (fp32 for half precision, read
    as half and rounded once where a dest is half), the same bits whoever computes it.
    ``cross``: the calls that sum each chunk's accumulator over the nodes, in place, before
    it is scaled (``hierarchical``; its chunks are the same on every node)."""
    if hi <= lo:
        return
    dtype = sources[0].dtype
    half = dtype in HALF
    # fp32/fp64 summed straight into the first dest where the first two sums read it first
    # (a source of the first two ranks, or none): no accumulator, one pass less per chunk;
    # this rank alone touches its slice there until the closing barrier
    direct = (not half and cross is None and len(sources) > 1 and len(dests) > 0
              and (dests[0] is sources[0] or dests[0] is sources[1]))
    # half in and out: widened, summed, scaled and rounded in one compiled pass per few
    # sources (halfcast.sum_half: the same bits), unless a NaN or no kernel stops it
    fused = (half and cross is None and len(dests) > 0
             and all(d.dtype == dtype for d in dests))
    step = min(chunk, hi - lo)
    acc_all = None if direct else stream.work(0, step, float32 if half else dtype)
    tmp_all = stream.work(1, step, float32) if half else None
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        with np.errstate(all="ignore"):  # see IEEE_ONLY
            if fused:
                a += halfcast.sum_half([src[a:b] for src in sources], [d[a:b] for d in dests],
                                       scale, acc_all[:b - a])
                if a == b:
                    continue
            acc = dests[0][a:b] if direct else acc_all[:b - a]
            if half:
                halfcast.widen(sources[0][a:b], acc)
                tmp = tmp_all[:b - a]
                for src in sources[1:]:
                    halfcast.widen(src[a:b], tmp)
                    np.add(acc, tmp, out=acc)
            else:
                _add_in_rank_order([src[a:b] for src in sources], acc)
        if cross is not None:
            yield from cross(acc)
        with np.errstate(all="ignore"):
            if scale is not None:
                backend.scale_(acc, scale)
            if not dests:
                continue
            first = acc if direct else dests[0][a:b]
            if first.dtype in HALF:
                halfcast.narrow(acc, first)
            elif not direct:
                first[...] = acc
            for dest in dests[1:]:
                dest[a:b] = first


def _add_in_rank_order(sources: Sequence[np.ndarray], out: np.ndarray) -> None:
    """``out = sum(sources)``, fp32/fp64, left to right in rank order; ``out`` may be the
    first or second source (each element is read before it is written) or apart from all."""
    if len(sources) > 1:
        np.add(sources[0], sources[1], out=out)
        for src in sources[2:]:
            np.add(out, src, out=out)
    else:
        out[...] = sources[0]


def _rounds(n: int, step: int) -> List[Tuple[int, int]]:
    """``[a, b)`` of every round (one empty round for nothing: its barrier still ends it)."""
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


def _spec(arr: np.ndarray) -> list:
    return [arr, _MPI_TYPES[arr.dtype.char]]


def _counts(m: int, n: int) -> Tuple[list, list]:
    """``n`` block sizes (differing by at most one) of ``m`` elements, and their offsets."""
    cuts = [m * i // n for i in range(n + 1)]
    return [cuts[i + 1] - cuts[i] for i in range(n)], cuts[:-1]


def _cross_allreduce(stream: ShmStream) -> Callable[[np.ndarray], Steps]:
    """Sum a node's accumulator over the nodes so that every node holds the same bits: a
    reduce-scatter (each block summed in one place) then an all-gather of the blocks."""
    def steps(acc: np.ndarray) -> Steps:
        counts, displs = _counts(acc.size, stream.nodes)
        part = stream.work(2, counts[stream.node], acc.dtype)
        yield Call("Reduce_scatter", (_spec(acc), _spec(part)),
                   {"recvcounts": counts, "op": MPI.SUM}, comm=stream.cross)
        blocks = [acc, (counts, displs), _MPI_TYPES[acc.dtype.char]]
        yield Call("Allgatherv", (_spec(part), blocks), comm=stream.cross)
    return steps


def _cross_reduce(stream: ShmStream, node: int) -> Callable[[np.ndarray], Steps]:
    """Sum a node's accumulator over the nodes into node ``node``'s."""
    def steps(acc: np.ndarray) -> Steps:
        send = MPI.IN_PLACE if stream.node == node else _spec(acc)
        recv = _spec(acc) if stream.node == node else None
        yield Call("Reduce", (send, recv), {"op": MPI.SUM, "root": node}, comm=stream.cross)
    return steps


def _gathered_allreduce(stream: ShmStream, flat: np.ndarray, scale: Optional[float],
                        seg: int) -> Steps:
    """A small all-reduce as an all-gather of every rank's buffer; every rank then sums all
    of them in rank order as :func:`_sum_into` sums a slice, so every rank computes, and
    holds, the same bits. On one node the buffers go through the ranks' scratch
    (``ShmStream.publish``: a copy and a word per rank, no MPI call); ``hierarchical`` runs
    one ``MPI_Allgather`` over the whole communicator. Only behind the order check (see
    :func:`allreduce_steps`), which compares what the window's rows would, and which is
    what makes reusing the scratch safe. 2 ranks, 4 KiB: two barriers and the window's
    bookkeeping took 60-80 us a step, ``thread`` 27-47 us; the ``Allgather`` cost Open MPI
    4.2 us where its ``Allreduce`` takes 1.7 us, the scratch about 1.5 us."""
    stream.serial += 1  # in step with the window's rows on every rank
    if stream.nodes == 1 and flat.nbytes <= stream.scratch_bytes:
        arrived, sources = stream.publish(flat)
        yield arrived
    else:
        rows, sources = stream.gathered(flat.nbytes, flat.dtype)
        yield Call("Allgather", ([flat.view(np.uint8), MPI.BYTE], [rows, MPI.BYTE]))
    if flat.dtype in HALF:
        yield from _sum_into(stream, sources, [flat], 0, flat.size, scale,
                             chunk_elements(seg, flat.dtype))
    else:  # apart from every source: summed in the buffer itself, as _sum_into's direct sum
        try:  # an errstate costs as much as the sum here; see IEEE_ONLY
            _sum_scaled(sources, flat, scale)
        except (FloatingPointError, RuntimeWarning):
            with np.errstate(all="ignore"):  # the caller made numpy raise: again, quietly
                _sum_scaled(sources, flat, scale)


def _sum_scaled(sources: Sequence[np.ndarray], out: np.ndarray, scale: Optional[float]) -> None:
    """``out = scale * sum(sources)`` (``out`` apart from every source): the compiled sum
    where it runs, numpy from where it stopped (a NaN: numpy decides its payload)."""
    done = halfcast.sum_wide(sources, out, scale)
    if done < out.size:
        rest = out[done:]
        _add_in_rank_order([s[done:] for s in sources], rest)
        if scale is not None:
            backend.scale_(rest, scale)


def allreduce_steps(stream: ShmStream, buf: np.ndarray, scale: Optional[float],
                    root: Optional[int], desc: Sequence[int], seg: int, name: str,
                    sent_scale: Optional[float] = None, gather: bool = False) -> Steps:
    """All-reduce (``root`` None) or reduce to ``root`` of a host array, summed in chunks of
    :func:`chunk_elements` of ``seg``. ``sent_scale``: a reduce's other ranks scale their own
    values by it once the peers are done reading.

    ``hierarchical`` (``stream.cross``): the node's sum of each chunk of this rank's slice is
    summed over the nodes by the ranks holding the same slice on every node, then written to
    every rank of the node (or the root's); its rounds are always a scratch's size, so every
    node cuts the same slices whether or not it stages.

    ``gather``: a small all-reduce may take :func:`_gathered_allreduce`, where the order
    check runs before it (``verify_order``): it compares what the rows would, and without it
    a peer that started another collective would meet the ``Allgather`` with a barrier."""
    flat = buf.reshape(-1)
    rank, p = stream.rank, stream.size
    if gather and root is None and p * stream.nodes * flat.nbytes <= GATHER_MAX_BYTES:
        yield from _gathered_allreduce(stream, flat, scale, seg)
        return
    chunk = chunk_elements(seg, flat.dtype)
    me = stream.node * p + rank
    root_node, root_local = (-1, -1) if root is None else divmod(root, p)
    lands = root is None or root == me
    cap = stream.scratch_bytes // flat.itemsize
    mine = stream.scratch(rank, flat.dtype)
    arrays = yield from _opening(
        stream, desc, flat, lambda: np.copyto(mine[:min(cap, flat.size)], flat[:cap]), name)
    staged = [q for q in range(p) if arrays[q] is None]
    cross: Cross = None
    if stream.cross is not None:
        cross = _cross_allreduce(stream) if root is None else _cross_reduce(stream, root_node)
    rounds = _rounds(flat.size, cap if staged or cross else max(flat.size, 1))
    for i, (a, b) in enumerate(rounds):
        m = b - a
        if i and staged:
            if rank in staged:
                mine[:m] = flat[a:b]
            yield from _barrier(stream)
        parts = [arrays[q][a:b] if arrays[q] is not None
                 else stream.scratch(q, flat.dtype)[:m] for q in range(p)]
        dests = (parts if root is None else
                 [parts[root_local]] if stream.node == root_node else [])
        yield from _sum_into(stream, parts, dests, _cut(m, rank, p), _cut(m, rank + 1, p),
                             scale, chunk, cross)
        if staged or i == len(rounds) - 1:
            yield from _barrier(stream)
        if rank in staged and lands:
            flat[a:b] = mine[:m]
    if not lands and sent_scale is not None:
        with np.errstate(all="ignore"):
            backend.scale_(flat, sent_scale)


def reduce_scatter_steps(stream: ShmStream, sendbuf: np.ndarray, recvbuf: np.ndarray,
                         scale: Optional[float], desc: Sequence[int], chunk: int, name: str,
                         others_scale: Optional[float] = None) -> Steps:
    """This rank's shard of the sum of every rank's ``sendbuf`` into ``recvbuf`` (which may
    be that shard of ``sendbuf``); the other shards of ``sendbuf`` keep this rank's values,
    scaled by ``others_scale`` after the last barrier. A staged round packs piece ``k`` of
    every shard that a node peer sums (not this rank's own, which it reads in place).

    ``hierarchical``: local rank ``l`` sums, over its node, the shards that local rank ``l``
    of every node owns, then a reduce-scatter over those ranks gives each its own shard."""
    send, recv = sendbuf.reshape(-1), recvbuf.reshape(-1)
    rank, p, nodes = stream.rank, stream.size, stream.nodes
    shard = recv.size
    everyone = p * nodes
    mine = stream.scratch(rank, send.dtype)
    piece_staged = max(1, min(stream.scratch_bytes // send.itemsize // everyone, shard))
    owned = [k * p + rank for k in range(nodes)]  # the shards this rank sums on its node

    def stage(a: int, b: int) -> None:
        w = b - a
        for s in range(everyone):
            if s % p != rank:
                mine[s * w:(s + 1) * w] = send[s * shard + a:s * shard + b]

    arrays = yield from _opening(
        stream, desc, send, lambda: stage(0, min(piece_staged, shard)), name)
    staged = any(arr is None for arr in arrays)
    hier = stream.cross is not None
    rounds = _rounds(shard, piece_staged if staged or hier else max(shard, 1))
    wide = float32 if send.dtype in HALF else send.dtype
    for i, (a, b) in enumerate(rounds):
        w = b - a
        if i and staged:
            if arrays[rank] is None:
                stage(a, b)
            yield from _barrier(stream)

        def parts(s: int) -> List[np.ndarray]:
            at = slice(s * shard + a, s * shard + b)
            return [send[at] if q == rank else arrays[q][at] if arrays[q] is not None
                    else stream.scratch(q, send.dtype)[s * w:(s + 1) * w] for q in range(p)]

        if not hier:
            yield from _sum_into(stream, parts(owned[0]), [recv[a:b]], 0, w, scale, chunk)
        else:
            block = stream.work(3, nodes * w, wide).reshape(nodes, w)
            for k, s in enumerate(owned):
                yield from _sum_into(stream, parts(s), [block[k]], 0, w, None, chunk)
            out = stream.work(4, w, wide)
            yield Call("Reduce_scatter_block", (_spec(block.reshape(-1)), _spec(out)),
                       {"op": MPI.SUM}, comm=stream.cross)
            with np.errstate(all="ignore"):
                if scale is not None:
                    backend.scale_(out, scale)
                if recv.dtype in HALF:
                    halfcast.narrow(out, recv[a:b])
                else:
                    recv[a:b] = out
        if staged or i == len(rounds) - 1:
            yield from _barrier(stream)
    if others_scale is not None:
        with np.errstate(all="ignore"):
            for s in range(everyone):
                if s != stream.node * p + rank:
                    backend.scale_(send[s * shard:(s + 1) * shard], others_scale)


def _cross_allgather(stream: ShmStream, flat: np.ndarray, shard: int) -> Steps:
    """``hierarchical``: this rank's shard to the ranks of the same local index on every
    node, and theirs into this rank's array, in pieces of at most :data:`CHUNK_BYTES`."""
    nodes, p, rank = stream.nodes, stream.size, stream.rank
    me = stream.node * p + rank
    piece = max(1, min(shard, CHUNK_BYTES // max(flat.itemsize, 1) // nodes))
    for a in range(0, shard, piece):
        b = min(a + piece, shard)
        block = stream.work(5, nodes * (b - a) * flat.itemsize, np.uint8)
        yield Call("Allgather", ([flat[me * shard + a:me * shard + b].view(np.uint8), MPI.BYTE],
                                 [block, MPI.BYTE]), comm=stream.cross)
        rows = block.view(flat.dtype).reshape(nodes, b - a)
        for k in range(nodes):
            if k != stream.node:
                s = k * p + rank
                flat[s * shard + a:s * shard + b] = rows[k]


def allgather_steps(stream: ShmStream, buf: np.ndarray, desc: Sequence[int],
                    name: str) -> Steps:
    """Every rank's shard of ``buf`` (its own, in place) into every rank's ``buf``: raw
    copies, any dtype. ``hierarchical``: first over the nodes (each rank gathers the shards
    of its local index), then within the node (each rank copies its peers' shards)."""
    flat = buf.reshape(-1)
    rank, p, nodes = stream.rank, stream.size, stream.nodes
    shard = flat.size // (p * nodes)
    if stream.cross is not None:
        yield from _cross_allgather(stream, flat, shard)
    mine = stream.scratch(rank, flat.dtype)
    piece_staged = max(1, min(stream.scratch_bytes // flat.itemsize // nodes, shard))

    def stage(a: int, b: int) -> None:
        w = b - a
        for k in range(nodes):
            s = k * p + rank
            mine[k * w:(k + 1) * w] = flat[s * shard + a:s * shard + b]

    arrays = yield from _opening(
        stream, desc, flat, lambda: stage(0, min(piece_staged, shard)), name)
    staged = any(arr is None for arr in arrays)
    rounds = _rounds(shard, piece_staged if staged else max(shard, 1))
    for i, (a, b) in enumerate(rounds):
        w = b - a
        if i:
            if arrays[rank] is None:
                stage(a, b)
            yield from _barrier(stream)
        for q in range(p):
            if q == rank:
                continue
            for k in range(nodes):
                s = k * p + q
                src = (arrays[q][s * shard + a:s * shard + b] if arrays[q] is not None
                       else stream.scratch(q, flat.dtype)[k * w:(k + 1) * w])
                flat[s * shard + a:s * shard + b] = src
        yield from _barrier(stream)
