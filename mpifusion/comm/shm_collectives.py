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
are numbered node by node (rank = node * ranks per node + local rank). With
``CommOptions.pipeline``, from ``Tuning.pipe_min_bytes`` up the inter-node step is a pipeline
(:class:`_CrossPipe`): chunk k moves between the nodes while the node sums chunk k+1, with the
same calls, sums and bits as one chunk after the other.

The steps, each readable alone: :func:`_opening` (steps 1-2), then a :class:`_Plan` (plain
data: the arrays, rounds, staged ranks, scale, root) that the steps after it read.
All-reduce and reduce (:func:`shm_allreduce_steps`): :func:`_gathered_allreduce` (small), else
:func:`_in_window_reduction` or :func:`_staged_reduction`, each round by
:func:`_reduce_round` (:func:`_sum_into`; ``hierarchical``: :func:`_sum_across` and
:class:`_CrossPipe`). Reduce-scatter (:func:`shm_reduce_scatter_steps`): :func:`_sum_shard`
within a node, :func:`_cross_reduce_scatter_round` over the nodes. All-gather
(:func:`shm_allgather_steps`): :func:`_cross_allgather` over the nodes, then
:func:`_copy_peer_shards` within the node. The stream's private arrays are named regions
(``shm.Work``); the shared scratch's layout is said where a round packs it.

Each builder takes ``desc``, this rank's row as the order check describes the collective:
(serial, kind, count, dtype, root, buffer id, step, communicator key). The serial is the
collective's place in its stream, counted from 1, which the engine passes in once it
stamped the collective: nothing here counts collectives itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ..arrays import backend, halfcast
from ..dtypes import HALF, float32
from ..errors import CommError, OrderError
from .call import FENCE, Call, Steps, pipelined
from .collectives import MPI_TYPES, mpi_spec
from .order import order_error
from . import tuning
from .shm import DESC_WORDS, ShmStream, Work

# IEEE_ONLY: every sum and scaling here runs under ``np.errstate(all="ignore")`` (never
# across a ``yield``: the state would leak into the caller's code): an overflow gives inf,
# as MPI's own sum does, with no warning and no ``FloatingPointError``. A caller's
# ``np.seterr(all="raise")`` (or warnings made errors) would otherwise stop one rank -- the
# one whose slice overflowed -- and leave the others at the next barrier. The gathered
# all-reduce (every rank sums everything, apart from its sources) sums fp32/fp64 in one
# compiled call (``halfcast.sum_wide``, which never consults numpy's error state) and
# otherwise tries numpy without an errstate, since entering one costs as much as summing
# 4 KiB, and sums again under it if numpy raised (after writing the whole result).



Opened = Generator[Call, None, List[Optional[np.ndarray]]]


@dataclass(frozen=True, eq=False)
class _Plan:
    """How one collective runs, decided once after its opening and read by every step after
    it: plain data, passed instead of mode flags."""

    #: this rank's array, flat (a reduce-scatter's send buffer)
    flat: np.ndarray
    #: every node rank's array as its row names it (None: staged through that rank's scratch)
    arrays: Tuple[Optional[np.ndarray], ...]
    #: the node ranks whose arrays are staged (none: every array in the arena)
    staged: Tuple[int, ...]
    #: ``[a, b)`` of every round, of the array (all-reduce, reduce) or of a shard
    rounds: Tuple[Tuple[int, int], ...]
    #: applied once to each sum (None: not scaled)
    scale: Optional[float] = None
    #: elements per accumulator chunk (:func:`chunk_elements`)
    chunk: int = 1
    #: a reduce's root as ``(node, local rank)``; None: an all-reduce
    root: Optional[Tuple[int, int]] = None
    #: whether this rank's array receives the sum (all-reduce: every rank; reduce: the root)
    lands: bool = True
    #: a reduce-scatter's receive buffer, flat: this rank's shard of the sum
    recv: Optional[np.ndarray] = None
    #: a reduce-scatter's inter-node step is a pipeline (the same on every rank)
    overlap: bool = False


def chunk_elements(seg: int, dtype: Any) -> int:
    """Elements per accumulator chunk for ``dtype`` buffers: the communicator's segment,
    at most ``Tuning.chunk_bytes`` of the accumulator."""
    wide = 4 if np.dtype(dtype) in HALF else np.dtype(dtype).itemsize
    return max(1, min(seg, tuning.ACTIVE.chunk_bytes // wide))


def _cut(m: int, i: int, p: int) -> int:
    """Start of rank ``i``'s slice of ``m`` elements (``i == p``: the end)."""
    if i >= p:
        return m
    cut = tuning.ACTIVE.cut_elements
    return min(m, -(-(m * i // p) // cut) * cut)


def _rounds(n: int, step: int) -> List[Tuple[int, int]]:
    """``[a, b)`` of every round (one empty round for nothing: its barrier still ends it)."""
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


def _counts(m: int, n: int) -> Tuple[list, list]:
    """``n`` block sizes (differing by at most one) of ``m`` elements, and their offsets."""
    cuts = [m * i // n for i in range(n + 1)]
    return [cuts[i + 1] - cuts[i] for i in range(n)], cuts[:-1]


def _slot(k: int, overlap: bool) -> int:
    """The ring slot of chunk (or round) ``k``: a ring when pipelined, else slot 0. Chunk k
    is summed in slot k % ``Tuning.pipe_slots`` of the ring regions (``Work.PIPE_ACC``,
    ``PIPE_PART``, ``RS_BLOCK``, ``RS_OUT``), which its calls use until it landed; the
    ``ahead`` bounds of the pipelined calls make chunk k - slots land first."""
    return k % tuning.ACTIVE.pipe_slots if overlap else 0


def _staged_ranks(arrays: Sequence[Optional[np.ndarray]]) -> Tuple[int, ...]:
    """The node ranks whose rows named no array in the arena (staged through the scratch)."""
    return tuple(q for q, arr in enumerate(arrays) if arr is None)


# ------------------------------------------------------------------ opening and barriers

def _barrier(stream: ShmStream, call: Optional[Call] = None) -> Steps:
    """A barrier of the node's ranks (``call``: the stream's, else this form of it) with the
    memory fences around it (see ``shm.py``, memory ordering)."""
    stream.window.sync()
    yield stream.barrier if call is None else call
    stream.window.sync()


def _opening(stream: ShmStream, desc: Sequence[int], flat: np.ndarray,
             stage_first: Callable[[], None], name: str) -> Opened:
    """Steps 1-2 of the module docstring: this rank's row written (``stage_first`` run
    before, where ``flat`` is not in the arena), a barrier, every row read. Returns every
    node rank's array (None: staged in its scratch); a problem in the rows is raised on
    every rank alike (:func:`_peer_arrays`)."""
    memory, rank = stream.memory, stream.rank
    chunk, offset = memory.locate(flat)
    if chunk < 0:
        stage_first()
    row = stream.row(rank)
    row[:DESC_WORDS] = desc
    row[DESC_WORDS], row[DESC_WORDS + 1] = chunk, offset
    # the barriers around the row check are non-blocking on every rank, whatever the size:
    # a collective run polled (small, under a deadline) issues the non-blocking forms, and
    # MPI never matches a blocking barrier with a non-blocking one -- ranks that started
    # collectives of different sizes would otherwise wait for each other until the
    # deadline instead of reading each other's rows
    opening = Call("Ibarrier", comm=stream.barrier.comm, nonblocking=True)
    yield from _barrier(stream, opening)
    arrays, problem = _peer_arrays(stream, stream.rows(), flat, name)
    if problem is not None:
        # every rank read the same rows, so every rank raises this; but only after a barrier:
        # a rank that raised at once could start its next collective and rewrite its row
        # while a slower peer has not read this one yet
        yield from _barrier(stream, opening)
        raise problem
    return arrays


def _peer_arrays(stream: ShmStream, rows: np.ndarray, flat: np.ndarray, name: str
                 ) -> Tuple[List[Optional[np.ndarray]], Optional[Exception]]:
    """Every node rank's array as its row names it (None: staged, or a problem found) and
    the problem: ranks that started different collectives (``OrderError``), else the first
    row naming memory outside its window (``CommError``). Every rank reads the same rows,
    so every rank finds the same problem."""
    rank = stream.rank
    problem: Optional[Exception] = None
    if (rows[:, :DESC_WORDS] != rows[rank, :DESC_WORDS]).any():
        problem = order_error(rank, rows[:, :DESC_WORDS], name)  # steps named, if they differ
    arrays: List[Optional[np.ndarray]] = []
    for q in range(stream.size):
        where, off = int(rows[q, DESC_WORDS]), int(rows[q, DESC_WORDS + 1])
        arr = (None if where < 0 or problem is not None else flat if q == rank
               else stream.memory.peer_array(where, q, off, flat.size, flat.dtype))
        if where >= 0 and arr is None and problem is None:
            problem = CommError(f"rank {rank}: {name}: rank {q} named an array outside its "
                                f"shared window {where} (offset {off}, {flat.size} "
                                f"{flat.dtype})")
        arrays.append(arr)
    return arrays, problem


# ------------------------------------------------------------------------------ summing

def _finish(acc: np.ndarray, dests: Sequence[np.ndarray], a: int, b: int,
            scale: Optional[float], direct: bool = False) -> None:
    """``dests[a:b] = scale * acc`` (rounded once where a dest is half; ``direct``: ``acc``
    is ``dests[0][a:b]`` itself)."""
    with np.errstate(all="ignore"):  # see IEEE_ONLY
        if scale is not None:
            backend.scale_(acc, scale)
        if not dests:
            return
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


def _add_chunk(sources: Sequence[np.ndarray], a: int, b: int, acc: np.ndarray,
               tmp: Optional[np.ndarray]) -> None:
    """``acc = sum(sources[a:b])`` in rank order, under the caller's errstate: half
    precision widened to fp32 (one source at a time through ``tmp``, fp32, at least
    ``b - a``), fp32/fp64 in their own dtype (see :func:`_add_in_rank_order`)."""
    if sources[0].dtype not in HALF:
        _add_in_rank_order([src[a:b] for src in sources], acc)
        return
    halfcast.widen(sources[0][a:b], acc)
    wide = tmp[:b - a]
    for src in sources[1:]:
        halfcast.widen(src[a:b], wide)
        np.add(acc, wide, out=acc)


def _sum_into(stream: ShmStream, sources: Sequence[np.ndarray], dests: Sequence[np.ndarray],
              lo: int, hi: int, scale: Optional[float], chunk: int) -> None:
    """``dests[lo:hi] = scale * sum(sources[lo:hi])``: summed in rank order (the order of
    ``sources``), chunk by chunk in the stream's accumulator (fp32 for half precision, read
    as half and rounded once where a dest is half), the same bits whoever computes it."""
    if hi <= lo:
        return
    dtype = sources[0].dtype
    half = dtype in HALF
    # fp32/fp64 summed straight into the first dest where the first two sums read it first
    # (a source of the first two ranks, or none): no accumulator, one pass less per chunk;
    # this rank alone touches its slice there until the closing barrier
    direct = (not half and len(sources) > 1 and len(dests) > 0
              and (dests[0] is sources[0] or dests[0] is sources[1]))
    # half in and out: widened, summed, scaled and rounded in one compiled pass per few
    # sources (halfcast.sum_half: the same bits), unless a NaN or no kernel stops it
    fused = half and len(dests) > 0 and all(d.dtype == dtype for d in dests)
    step = min(chunk, hi - lo)
    acc_all = None if direct else stream.work(Work.ACCUMULATOR, step, float32 if half else dtype)
    tmp = stream.work(Work.WIDE_TMP, step, float32) if half else None
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        with np.errstate(all="ignore"):  # see IEEE_ONLY
            # the compiled half pass finishes the chunk's first ``done`` elements
            done = (halfcast.sum_half([src[a:b] for src in sources], [d[a:b] for d in dests],
                                      scale, acc_all[:b - a]) if fused else 0)
            if done == b - a:
                continue
            start = a + done  # numpy sums the rest
            acc = dests[0][start:b] if direct else acc_all[:b - start]
            _add_chunk(sources, start, b, acc, tmp)
        _finish(acc, dests, start, b, scale, direct)


def _sum_across(stream: ShmStream, sources: Sequence[np.ndarray], dests: Sequence[np.ndarray],
                lo: int, hi: int, scale: Optional[float], chunk: int,
                cross: "_CrossPipe") -> Steps:
    """``hierarchical``'s :func:`_sum_into`: each chunk's node sum, in the pipeline's
    accumulator, is summed over the nodes in place (``cross``) before it is scaled and
    written (when it landed); its chunks are the same on every node."""
    if hi <= lo:
        return
    dtype = sources[0].dtype
    wide = float32 if dtype in HALF else dtype
    step = min(chunk, hi - lo)
    tmp = stream.work(Work.WIDE_TMP, step, float32) if dtype in HALF else None
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        acc = cross.acc(step, wide)[:b - a]
        with np.errstate(all="ignore"):  # see IEEE_ONLY
            _add_chunk(sources, a, b, acc, tmp)
        yield from cross.hand_over(acc, partial(_finish, acc, dests, a, b, scale))


def _sum_scaled(sources: Sequence[np.ndarray], out: np.ndarray, scale: Optional[float]) -> None:
    """``out = scale * sum(sources)`` (``out`` apart from every source): the compiled sum
    where it runs, numpy from where it stopped (a NaN: numpy decides its payload)."""
    done = halfcast.sum_wide(sources, out, scale)
    if done < out.size:
        rest = out[done:]
        _add_in_rank_order([s[done:] for s in sources], rest)
        if scale is not None:
            backend.scale_(rest, scale)


# ------------------------------------------------------------ hierarchical: the hand-over

class _CrossPipe:
    """``hierarchical``'s inter-node step of an all-reduce (``root_node`` None: a
    reduce-scatter over the nodes, then an all-gather of the blocks, so each block is summed
    in one place and every node holds the same bits) or of a reduce (to ``root_node``), for
    every chunk of this rank's slice in turn, in the same order on every node.

    Pipelined (``overlap``): chunk k's reduce-scatter is issued non-blocking and the stream
    sums chunk k+1 on the node while it moves; chunk k's all-gather follows chunk k+1's
    reduce-scatter (it waits for its own reduce-scatter only: ``Call.ahead``), and chunk k
    is scaled and written (``land``) once its all-gather landed, in chunk order. A node
    barrier (the end, or a staged round's end) needs :meth:`flush` first. Not pipelined,
    each chunk's calls are blocking and it lands before the next is summed."""

    def __init__(self, stream: ShmStream, root_node: Optional[int], overlap: bool) -> None:
        self.stream, self.root_node, self.overlap = stream, root_node, overlap
        self.k = 0          # chunks handed over (their ring slots: k % Tuning.pipe_slots)
        self.run = 0        # ... since the last flush, after which nothing is in flight
        self.prev: Optional[tuple] = None   # the chunk whose all-gather comes next

    def acc(self, n: int, dtype: Any) -> np.ndarray:
        """The accumulator of the next chunk."""
        return self.stream.work(Work.PIPE_ACC, n, dtype, _slot(self.k, self.overlap))

    def hand_over(self, acc: np.ndarray, land: Callable[[], None]) -> Steps:
        """Sum ``acc`` (this chunk's node sum) over the nodes, in place; ``land`` once it is
        there."""
        k, run = self.k, self.run
        self.k += 1
        self.run += 1
        if self.root_node is not None:
            yield from self._reduce(acc, land)
        else:
            yield from self._scatter_gather(acc, land, k, run)

    def _reduce(self, acc: np.ndarray, land: Callable[[], None]) -> Steps:
        """A reduce's hand-over: the chunk summed on the root's node, in place there."""
        stream = self.stream
        here = stream.node == self.root_node
        args = ((MPI.IN_PLACE, mpi_spec(acc)) if here else (mpi_spec(acc), None))
        kwargs = {"op": MPI.SUM, "root": self.root_node}
        if not self.overlap:
            yield Call("Reduce", args, kwargs, comm=stream.cross)
            land()
            return
        # chunk k+1 is summed once chunks up to k-2 landed: their slots are free
        yield pipelined("Reduce", args, kwargs, land, comm=stream.cross,
                        ahead=tuning.ACTIVE.pipe_slots - 2)

    def _scatter_gather(self, acc: np.ndarray, land: Callable[[], None], k: int,
                        run: int) -> Steps:
        """An all-reduce's hand-over of chunk ``k`` (``run``: its place since the last
        flush): a reduce-scatter of it over the nodes into its ring slot of ``PIPE_PART``,
        then the all-gather of the blocks (pipelined: chunk k-1's, after chunk k's
        reduce-scatter)."""
        stream = self.stream
        counts, displs = _counts(acc.size, stream.nodes)
        part = stream.work(Work.PIPE_PART, counts[stream.node], acc.dtype,
                           _slot(k, self.overlap))
        scatter = (mpi_spec(acc), mpi_spec(part))
        kwargs = {"recvcounts": counts, "op": MPI.SUM}
        if not self.overlap:
            yield Call("Reduce_scatter", scatter, kwargs, comm=stream.cross)
            yield Call("Allgatherv", self._blocks(acc, part, counts, displs),
                       comm=stream.cross)
            land()
            return
        yield pipelined("Reduce_scatter", scatter, kwargs, comm=stream.cross,
                        ahead=tuning.ACTIVE.pipe_slots - 1)
        if self.prev is not None:
            # issue order since the flush: RS(0), RS(1), AG(0), RS(2), AG(1), ...: AG(k-1)
            # may leave AG(k-2) and RS(k) in flight, not RS(k-1); AG(0) only RS(1)
            yield self._gather(*self.prev, ahead=2 if run >= 2 else 1)
        self.prev = (acc, part, counts, displs, land)

    def _blocks(self, acc: np.ndarray, part: np.ndarray, counts: list,
                displs: list) -> tuple:
        return (mpi_spec(part), [acc, (counts, displs), MPI_TYPES[acc.dtype.char]])

    def _gather(self, acc: np.ndarray, part: np.ndarray, counts: list, displs: list,
                land: Callable[[], None], ahead: int) -> Call:
        return pipelined("Allgatherv", self._blocks(acc, part, counts, displs), land=land,
                         comm=self.stream.cross, ahead=ahead)

    def flush(self) -> Steps:
        """Every chunk handed over has landed when this returns (before a node barrier)."""
        if not self.overlap:
            return
        if self.prev is not None:
            # ..., RS(K-1), AG(K-2), AG(K-1): only AG(K-2) may stay (none after one chunk)
            yield self._gather(*self.prev, ahead=1 if self.run >= 2 else 0)
            self.prev = None
        self.run = 0
        yield FENCE


# ------------------------------------------------------------------ all-reduce and reduce

def shm_allreduce_steps(stream: ShmStream, buf: np.ndarray, scale: Optional[float],
                    root: Optional[int], desc: Sequence[int], seg: int, name: str,
                    sent_scale: Optional[float] = None, gather: bool = False,
                    pipeline: bool = False) -> Steps:
    """All-reduce (``root`` None) or reduce to ``root`` of a host array, summed in chunks of
    :func:`chunk_elements` of ``seg``. ``sent_scale``: a reduce's other ranks scale their own
    values by it once the peers are done reading.

    ``hierarchical`` (``stream.cross``): the node's sum of each chunk of this rank's slice is
    summed over the nodes by the ranks holding the same slice on every node, then written to
    every rank of the node (or the root's); its rounds are always a scratch's size, so every
    node cuts the same slices whether or not it stages.

    ``pipeline``: the inter-node step as a pipeline from ``Tuning.pipe_min_bytes``
    (:class:`_CrossPipe`).

    ``gather``: a small all-reduce may take :func:`_gathered_allreduce`, where the order
    check runs before it (``verify_order``): it compares what the rows would, and without it
    a peer that started another collective would meet the ``Allgather`` with a barrier."""
    flat = buf.reshape(-1)
    if (gather and root is None
            and stream.size * stream.nodes * flat.nbytes
            <= tuning.ACTIVE.gather_max_bytes):
        yield from _gathered_allreduce(stream, desc[0], flat, scale, seg)
        return
    plan = yield from _open_reduction(stream, flat, scale, root, desc, seg, name)
    cross: Optional[_CrossPipe] = None
    if stream.cross is not None:  # the same on every rank: agreed option, same buffer size
        cross = _CrossPipe(stream, None if plan.root is None else plan.root[0],
                           overlap=pipeline and flat.nbytes >= tuning.ACTIVE.pipe_min_bytes)
    if plan.staged:
        yield from _staged_reduction(stream, plan, cross)
    else:
        yield from _in_window_reduction(stream, plan, cross)
    if not plan.lands and sent_scale is not None:
        with np.errstate(all="ignore"):  # see IEEE_ONLY
            backend.scale_(flat, sent_scale)


def _gathered_allreduce(stream: ShmStream, serial: int, flat: np.ndarray,
                        scale: Optional[float], seg: int) -> Steps:
    """A small all-reduce as an all-gather of every rank's buffer; every rank then sums all
    of them in rank order as :func:`_sum_into` sums a slice, so every rank computes, and
    holds, the same bits. On one node the buffers go through the ranks' scratch
    (``ShmStream.publish``: a copy and a word per rank, no MPI call); ``hierarchical`` runs
    one ``MPI_Allgather`` over the whole communicator. Only behind the order check (see
    :func:`shm_allreduce_steps`), which compares what the window's rows would, and which is
    what makes reusing the scratch safe. 2 ranks, 4 KiB: two barriers and the window's
    bookkeeping took 60-80 us a step, ``thread`` 27-47 us; the ``Allgather`` cost Open MPI
    4.2 us where its ``Allreduce`` takes 1.7 us, the scratch about 1.5 us."""
    if stream.nodes == 1 and flat.nbytes <= stream.scratch_bytes:
        arrived, sources = stream.publish(flat, serial)
        yield arrived
    else:
        rows, sources = stream.gathered(flat.nbytes, flat.dtype)
        yield Call("Allgather", ([flat.view(np.uint8), MPI.BYTE], [rows, MPI.BYTE]))
    if flat.dtype in HALF:
        _sum_into(stream, sources, [flat], 0, flat.size, scale,
                  chunk_elements(seg, flat.dtype))
    else:  # apart from every source: summed in the buffer itself, as _sum_into's direct sum
        try:  # an errstate costs as much as the sum here; see IEEE_ONLY
            _sum_scaled(sources, flat, scale)
        except (FloatingPointError, RuntimeWarning):
            with np.errstate(all="ignore"):  # the caller made numpy raise: again, quietly
                _sum_scaled(sources, flat, scale)


def _open_reduction(stream: ShmStream, flat: np.ndarray, scale: Optional[float],
                    root: Optional[int], desc: Sequence[int], seg: int,
                    name: str) -> Generator[Call, None, _Plan]:
    """The opening of an all-reduce or reduce (a plain array's first round staged at the
    start of this rank's scratch) and its plan: one round where every array is in the
    arena, else rounds of a scratch's size; ``hierarchical`` always the latter, so every
    node cuts the same slices whether or not it stages."""
    rank, p = stream.rank, stream.size
    cap = stream.scratch_bytes // flat.itemsize
    mine = stream.scratch(rank, flat.dtype)
    arrays = yield from _opening(
        stream, desc, flat, lambda: np.copyto(mine[:min(cap, flat.size)], flat[:cap]), name)
    staged = _staged_ranks(arrays)
    step = cap if staged or stream.cross is not None else max(flat.size, 1)
    return _Plan(flat, tuple(arrays), staged, tuple(_rounds(flat.size, step)), scale,
                 chunk_elements(seg, flat.dtype),
                 root=None if root is None else divmod(root, p),
                 lands=root is None or root == stream.node * p + rank)


def _in_window_reduction(stream: ShmStream, plan: _Plan,
                         cross: Optional[_CrossPipe]) -> Steps:
    """Every array in the arena: each round summed straight from the peers' arrays, one
    barrier at the end. ``hierarchical``: the inter-node pipeline is flushed at the end of
    every round, as on a node that stages: the nodes' calls between them must be the same
    and in the same order whether or not a node stages (flushed at the end only, a node in
    its windows issued an all-gather after the next round's reduce-scatter where a staging
    node issued it before: a wrong sum at 2 nodes, a hang at 3)."""
    for a, b in plan.rounds:
        yield from _reduce_round(stream, plan, a, b, cross)
        if cross is not None:
            yield from cross.flush()
    yield from _barrier(stream)


def _staged_reduction(stream: ShmStream, plan: _Plan, cross: Optional[_CrossPipe]) -> Steps:
    """Some rank staged: rounds of a scratch's size. A staged rank copies round i > 0 into
    its scratch once round i-1's closing barrier said every peer is done reading it, and
    a barrier says it is there; each round ends with a barrier (after the hand-over's
    flush), then a staged rank that receives the sum copies it back from its scratch."""
    rank, flat = stream.rank, plan.flat
    mine = stream.scratch(rank, flat.dtype)
    for i, (a, b) in enumerate(plan.rounds):
        if i:
            if rank in plan.staged:
                mine[:b - a] = flat[a:b]
            yield from _barrier(stream)
        yield from _reduce_round(stream, plan, a, b, cross)
        if cross is not None:
            yield from cross.flush()
        yield from _barrier(stream)
        if rank in plan.staged and plan.lands:
            flat[a:b] = mine[:b - a]


def _reduce_round(stream: ShmStream, plan: _Plan, a: int, b: int,
                  cross: Optional[_CrossPipe]) -> Steps:
    """Round ``[a, b)``: this rank's slice (:func:`_cut`) of every node rank's piece,
    summed in rank order and written to every rank's piece (all-reduce) or the root's
    (reduce; on another node nowhere: the hand-over carried it). ``hierarchical``
    (``cross``): each chunk summed over the nodes before it is scaled and written."""
    m, rank, p = b - a, stream.rank, stream.size
    parts = [_round_piece(stream, plan, q, a, b) for q in range(p)]
    if plan.root is None:
        dests = parts
    else:
        root_node, root_local = plan.root
        dests = [parts[root_local]] if stream.node == root_node else []
    lo, hi = _cut(m, rank, p), _cut(m, rank + 1, p)
    if cross is None:
        _sum_into(stream, parts, dests, lo, hi, plan.scale, plan.chunk)
    else:
        yield from _sum_across(stream, parts, dests, lo, hi, plan.scale, plan.chunk, cross)


def _round_piece(stream: ShmStream, plan: _Plan, q: int, a: int, b: int) -> np.ndarray:
    """Node rank ``q``'s elements ``[a, b)``: in its array, or staged at the start of its
    scratch."""
    arr = plan.arrays[q]
    return arr[a:b] if arr is not None else stream.scratch(q, plan.flat.dtype)[:b - a]


# -------------------------------------------------------------------------- reduce-scatter

def shm_reduce_scatter_steps(stream: ShmStream, sendbuf: np.ndarray, recvbuf: np.ndarray,
                         scale: Optional[float], desc: Sequence[int], chunk: int, name: str,
                         others_scale: Optional[float] = None,
                         pipeline: bool = False) -> Steps:
    """This rank's shard of the sum of every rank's ``sendbuf`` into ``recvbuf`` (which may
    be that shard of ``sendbuf``); the other shards of ``sendbuf`` keep this rank's values,
    scaled by ``others_scale`` after the last barrier. A staged round packs piece ``k`` of
    every shard that a node peer sums (not this rank's own, which it reads in place).

    ``hierarchical``: local rank ``l`` sums, over its node, the shards that local rank ``l``
    of every node owns, then a reduce-scatter over those ranks gives each its own shard;
    with ``pipeline``, from ``Tuning.pipe_min_bytes`` up round i's reduce-scatter moves while the
    node sums round i+1 (as :class:`_CrossPipe`), and lands (scaled, written) in round
    order."""
    send, recv = sendbuf.reshape(-1), recvbuf.reshape(-1)
    plan = yield from _open_reduce_scatter(stream, send, recv, scale, desc, chunk, name,
                                           pipeline)
    for i, (a, b) in enumerate(plan.rounds):
        if i and plan.staged:  # after round i-1's closing barrier: its pieces were read
            if stream.rank in plan.staged:
                _pack_for_peers(stream, send, recv.size, a, b)
            yield from _barrier(stream)
        if stream.cross is None:
            _sum_shard(stream, plan, a, b)
        else:
            yield from _cross_reduce_scatter_round(stream, plan, i, a, b)
        if plan.staged or i == len(plan.rounds) - 1:
            if plan.overlap:
                yield FENCE  # every round's result landed before the node's barrier
            yield from _barrier(stream)
    if others_scale is not None:
        with np.errstate(all="ignore"):  # see IEEE_ONLY
            for s in range(stream.size * stream.nodes):
                if s != stream.node * stream.size + stream.rank:
                    backend.scale_(send[s * recv.size:(s + 1) * recv.size], others_scale)


def _open_reduce_scatter(stream: ShmStream, send: np.ndarray, recv: np.ndarray,
                         scale: Optional[float], desc: Sequence[int], chunk: int, name: str,
                         pipeline: bool) -> Generator[Call, None, _Plan]:
    """The opening of a reduce-scatter (a plain array's first pieces packed in this rank's
    scratch) and its plan: one round of the shard where every array is in the arena, else
    rounds of a scratch's share per shard; ``hierarchical`` always the latter."""
    shard = recv.size
    everyone = stream.size * stream.nodes
    piece = max(1, min(stream.scratch_bytes // send.itemsize // everyone, shard))
    arrays = yield from _opening(
        stream, desc, send, lambda: _pack_for_peers(stream, send, shard, 0, min(piece, shard)),
        name)
    staged = _staged_ranks(arrays)
    hier = stream.cross is not None
    rounds = _rounds(shard, piece if staged or hier else max(shard, 1))
    return _Plan(send, tuple(arrays), staged, tuple(rounds), scale, chunk, recv=recv,
                 overlap=pipeline and hier and send.nbytes >= tuning.ACTIVE.pipe_min_bytes)


def _pack_for_peers(stream: ShmStream, send: np.ndarray, shard: int, a: int, b: int) -> None:
    """A staged reduce-scatter round: piece ``[a, b)`` of every shard a node peer sums (not
    this rank's own, which it reads in place) into this rank's scratch, shard ``s``'s piece
    at ``s * (b - a)``."""
    mine = stream.scratch(stream.rank, send.dtype)
    w = b - a
    for s in range(stream.size * stream.nodes):
        if s % stream.size != stream.rank:
            mine[s * w:(s + 1) * w] = send[s * shard + a:s * shard + b]


def _shard_pieces(stream: ShmStream, plan: _Plan, s: int, a: int, b: int) -> List[np.ndarray]:
    """Every node rank's piece ``[a, b)`` of shard ``s``, in rank order: this rank's in its
    own array (staged or not), a peer's in its array or where :func:`_pack_for_peers` put
    it."""
    shard, w = plan.recv.size, b - a
    at = slice(s * shard + a, s * shard + b)
    pieces = []
    for q in range(stream.size):
        arr = plan.arrays[q]
        pieces.append(plan.flat[at] if q == stream.rank else arr[at] if arr is not None
                      else stream.scratch(q, plan.flat.dtype)[s * w:(s + 1) * w])
    return pieces


def _sum_shard(stream: ShmStream, plan: _Plan, a: int, b: int) -> None:
    """``shm`` reduce-scatter round ``[a, b)``: this rank's shard summed over every rank's
    piece of it, scaled and written to the receive buffer."""
    pieces = _shard_pieces(stream, plan, stream.rank, a, b)
    _sum_into(stream, pieces, [plan.recv[a:b]], 0, b - a, plan.scale, plan.chunk)


def _cross_reduce_scatter_round(stream: ShmStream, plan: _Plan, i: int, a: int,
                                b: int) -> Steps:
    """``hierarchical`` reduce-scatter round ``i``, ``[a, b)`` of the shards: this rank sums
    over its node the shards its local index owns on every node (one row of ``RS_BLOCK`` per
    node, unscaled), then a reduce-scatter over the nodes leaves this rank's own in
    ``RS_OUT``, scaled and written once it landed (pipelined: in round order)."""
    p, rank, nodes, w = stream.size, stream.rank, stream.nodes, b - a
    wide = float32 if plan.flat.dtype in HALF else plan.flat.dtype
    # round i's slots are free: its reduce-scatter follows round i-4's, and round
    # i-1's left at most two earlier ones in flight
    slot = _slot(i, plan.overlap)
    block = stream.work(Work.RS_BLOCK, nodes * w, wide, slot).reshape(nodes, w)
    for k in range(nodes):
        pieces = _shard_pieces(stream, plan, k * p + rank, a, b)
        _sum_into(stream, pieces, [block[k]], 0, w, None, plan.chunk)
    out = stream.work(Work.RS_OUT, w, wide, slot)
    args = (mpi_spec(block.reshape(-1)), mpi_spec(out))
    land = partial(_finish, out, [plan.recv], a, b, plan.scale)
    if plan.overlap:
        yield pipelined("Reduce_scatter_block", args, {"op": MPI.SUM}, land,
                        comm=stream.cross, ahead=tuning.ACTIVE.pipe_slots - 2)
    else:
        yield Call("Reduce_scatter_block", args, {"op": MPI.SUM}, comm=stream.cross)
        land()


# ------------------------------------------------------------------------------ all-gather

def shm_allgather_steps(stream: ShmStream, buf: np.ndarray, desc: Sequence[int],
                    name: str) -> Steps:
    """Every rank's shard of ``buf`` (its own, in place) into every rank's ``buf``: raw
    copies, any dtype. ``hierarchical``: first over the nodes (each rank gathers the shards
    of its local index), then within the node (each rank copies its peers' shards)."""
    flat = buf.reshape(-1)
    shard = flat.size // (stream.size * stream.nodes)
    if stream.cross is not None:
        yield from _cross_allgather(stream, flat, shard)
    piece = max(1, min(stream.scratch_bytes // flat.itemsize // stream.nodes, shard))
    arrays = yield from _opening(
        stream, desc, flat, lambda: _pack_own_shards(stream, flat, shard, 0, min(piece, shard)),
        name)
    staged = _staged_ranks(arrays)
    plan = _Plan(flat, tuple(arrays), staged,
                 tuple(_rounds(shard, piece if staged else max(shard, 1))))
    for i, (a, b) in enumerate(plan.rounds):
        if i:  # a staged round, after round i-1's closing barrier: its pieces were read
            if stream.rank in plan.staged:
                _pack_own_shards(stream, flat, shard, a, b)
            yield from _barrier(stream)
        _copy_peer_shards(stream, plan, shard, a, b)
        yield from _barrier(stream)


def _cross_allgather(stream: ShmStream, flat: np.ndarray, shard: int) -> Steps:
    """``hierarchical``: this rank's shard to the ranks of the same local index on every
    node, and theirs into this rank's array, in pieces of at most ``Tuning.chunk_bytes``
    (received in ``Work.CROSS_BLOCK``)."""
    nodes, p, rank = stream.nodes, stream.size, stream.rank
    me = stream.node * p + rank
    piece = max(1, min(shard, tuning.ACTIVE.chunk_bytes // max(flat.itemsize, 1) // nodes))
    for a in range(0, shard, piece):
        b = min(a + piece, shard)
        block = stream.work(Work.CROSS_BLOCK, nodes * (b - a) * flat.itemsize, np.uint8)
        yield Call("Allgather", ([flat[me * shard + a:me * shard + b].view(np.uint8), MPI.BYTE],
                                 [block, MPI.BYTE]), comm=stream.cross)
        rows = block.view(flat.dtype).reshape(nodes, b - a)
        for k in range(nodes):
            if k != stream.node:
                s = k * p + rank
                flat[s * shard + a:s * shard + b] = rows[k]


def _pack_own_shards(stream: ShmStream, flat: np.ndarray, shard: int, a: int, b: int) -> None:
    """A staged all-gather round: piece ``[a, b)`` of this rank's shard on every node (the
    pieces its node peers copy) into its scratch, node ``k``'s at ``k * (b - a)``."""
    mine = stream.scratch(stream.rank, flat.dtype)
    w = b - a
    for k in range(stream.nodes):
        s = k * stream.size + stream.rank
        mine[k * w:(k + 1) * w] = flat[s * shard + a:s * shard + b]


def _copy_peer_shards(stream: ShmStream, plan: _Plan, shard: int, a: int, b: int) -> None:
    """All-gather round ``[a, b)`` within the node: every peer's pieces of its shards (one
    per node) copied into this rank's array, from the peer's array or from where
    :func:`_pack_own_shards` put them in its scratch."""
    flat, p, w = plan.flat, stream.size, b - a
    for q in range(p):
        if q == stream.rank:
            continue
        arr = plan.arrays[q]
        for k in range(stream.nodes):
            s = k * p + q
            flat[s * shard + a:s * shard + b] = (
                arr[s * shard + a:s * shard + b] if arr is not None
                else stream.scratch(q, flat.dtype)[k * w:(k + 1) * w])
