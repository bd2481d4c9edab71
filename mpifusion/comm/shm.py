"""Shared memory of one node for the ``shm`` strategy: the buffers' arena, the streams'
control windows, and the rules for freeing both.

With ``strategy="shm"`` the ranks of a communicator that lies on one node keep their fused
buffers in shared memory that every rank of the node maps, so a collective is plain loads and
stores between two barriers (``shm_collectives.py``) instead of messages. Two kinds of
shared memory, both per *node communicator* (the ``shm/memory`` private duplicate of the
user's communicator: the strategy is used only where it holds every rank):

* the buffers' storage (:meth:`NodeMemory.reserve`): regions of an :class:`Arena` that
  mpifusion maps itself, made at buffer construction, so ``add_grad`` writes straight into
  shared memory (no copy-in);
* a stream's *control* window (:class:`ShmStream`, an MPI-3 shared window,
  ``MPI_Win_allocate_shared``): per rank one descriptor row -- which collective it runs and
  where its array lies -- and a scratch segment that stages host arrays that are not in the
  arena (a user's own numpy array), chunk by chunk, and holds a small all-reduce's copy of
  the rank's buffer (:meth:`ShmStream.publish`).

Why the buffers are not MPI windows: every MPI window holds one of the library's
communicators (MPICH has 2,048 context ids) and ``MPI_Win_free`` is collective, so a window
per buffer made the number of buffers a job may build in its life a budget, and freeing them
needed a vote of every rank (hanging a job whose rank left early). And a window's pages are
touched lazily: a check of ``statvfs`` free space counts an earlier window's untouched pages
as free, and the first ``add_grad`` died of SIGBUS. So the only MPI windows are the control
windows, one per stream of a user communicator (a handful), freed when the user communicator
is released; and the arena is built on plain files:

* A *chunk* is one file per rank in /dev/shm, ``mpifusion.<token>.<chunk>.<rank>``, created
  ``O_EXCL`` (the token is agreed over the node communicator when its arena is made: rank
  0's random number), given its blocks at once with ``posix_fallocate`` (no space: ENOSPC
  now, agreed by every rank -> that buffer uses private memory with a warning; never SIGBUS
  later), mapped by its owner and -- after an all-reduce that says every file exists -- by
  every peer (the names are deterministic, nothing is exchanged); after a second all-reduce
  (every rank mapped every file) each owner unlinks its file, so a killed job leaves
  nothing. The owner keeps one descriptor per chunk (to reserve pages again); the peers'
  mappings keep none (mapped with libc's ``mmap``, then closed: Python's ``mmap`` would
  keep a descriptor per mapping).
* A buffer's regions are one extent of this rank's part of a chunk, placed first-fit
  (offsets may differ between ranks: a descriptor row carries each rank's chunk and offset,
  see :meth:`NodeMemory.locate` and :meth:`NodeMemory.peer_array`). Growing the arena is
  collective and agreed (one rank short: every rank adds a chunk of the same size).
* Freeing is local, never collective: when a region's array is gone (a ``weakref``
  finalizer: the buffer, its grads and every view of them were dropped) its pages are given
  back (:func:`punch`) and its extent is reused by a later buffer, after
  ``posix_fallocate`` reserved its pages again (no space then: that buffer falls back as
  above). ``release_grads``, ``clear_grad_storage`` and ``clear_param_storage`` punch a
  region that stays the buffer's; :func:`refill` reserves it again before it is reused
  (``BufferMemory.zeros``). A chunk stays mapped (its free pages given back) until the user
  communicator is released; its mappings go when the last region in it is gone.

So a user communicator costs a constant number of MPI communicators (its private duplicates
and one control window per stream) whatever number of buffers it carries, and nothing of
this module runs at exit: both MPIs finalize cleanly with control windows still allocated
and locked (measured).

Memory ordering: MPI's unified memory model (both MPIs here) makes stores to a window visible
to the other processes, but only ``MPI_Win_sync`` orders them against the barrier that tells
a peer it may read (the standard's shared-memory example: sync, barrier, sync); every control
window is locked once (``Lock_all(MODE_NOCHECK)``: MPICH refuses ``Win_sync`` outside a
passive-target epoch). The collectives sync one window, the stream's, on each side of every
barrier: in the unified model ``Win_sync`` is a full processor memory barrier in both
libraries (MPICH ``MPL_atomic_read_write_barrier``, Open MPI ``opal_atomic_mb``), which
orders every load and store of the process, whichever memory it touches -- a window's or
the arena's, which are the same kind of memory (``MAP_SHARED`` pages of a tmpfs file,
coherent between the processes' cores like a window's). That is why moving the buffers out of
MPI windows changes nothing in the collectives. Each sync is an MPI call that gives up the
GIL; syncing every window involved cost ~20 us per call here once the communication thread
competed for it.
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import os
import secrets
import sys
import tempfile
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ..errors import OptionError
from . import tuning
from .arena import (PAGE, SHM_FOLDER, Arena, Chunk, free_bytes,
                    live_regions, punch, refill, round_up)
from .call import Call
from .health import wait_request
from .poll import never_moves, poll

#: a stream's descriptor row: int64 words per rank (one cache-line pair, so rows never share
#: a line); the fields are ``ROW_FIELDS``
ROW_WORDS = 16
#: the row's fields: the collective as the order check describes it (``order.describe_call``:
#: serial, kind, count, dtype, root, buffer id, step, communicator key), then where this
#: rank's array lies: window number (-1: staged through the scratch) and byte offset
ROW_FIELDS = ("serial", "kind", "count", "dtype", "root", "buffer", "step", "key",
              "window", "offset")
DESC_WORDS = 8
#: the last word of a rank's row (apart from ``ROW_FIELDS``): the ``serial`` of the last
#: small all-reduce whose buffer this rank published in its scratch (:meth:`ShmStream.publish`)
PUBLISHED_WORD = ROW_WORDS - 1
#: where the scratch starts in a rank's segment of the control window
SCRATCH_OFFSET = PAGE


class Work(enum.Enum):
    """The named regions of a stream's work memory (:meth:`ShmStream.work`): arrays private
    to this process, kept and reused from one collective to the next (one task at a time
    runs on a stream), one per region, ring slot and dtype. A *ring* region has one array
    per slot of a pipeline (``shm_collectives.PIPE_SLOTS``), so a chunk's array is reused
    only once its calls landed; the other regions have slot 0 only."""

    #: a chunk's sum over the node's ranks (fp32 for half precision, else the dtype)
    ACCUMULATOR = "accumulator"
    #: one half-precision source chunk widened to fp32, added to the accumulator from here
    WIDE_TMP = "wide tmp"
    #: ``hierarchical`` all-gather: the bytes of one piece of every node's shard
    CROSS_BLOCK = "cross block"
    #: ring, ``hierarchical`` all-reduce and reduce: a chunk's node sum, summed over the
    #: nodes in place
    PIPE_ACC = "pipe acc"
    #: ring, ``hierarchical`` all-reduce: a chunk's block this node sums over the nodes
    PIPE_PART = "pipe part"
    #: ring, ``hierarchical`` reduce-scatter: a round's node sums of this rank's shards
    RS_BLOCK = "rs block"
    #: ring, ``hierarchical`` reduce-scatter: a round's sum of this rank's shard over the
    #: nodes, before it is scaled and written
    RS_OUT = "rs out"


_LOCK = threading.Lock()
#: NodeMemory by the handle of its node communicator (the ``shm/memory`` duplicate)
_MEMORY: Dict[int, "NodeMemory"] = {}


def ranks_on_node(comm: MPI.Comm) -> int:
    """How many ranks of ``comm`` share this rank's node (``Split_type(COMM_TYPE_SHARED)``;
    collective). The ``shm`` strategy runs where this is every rank."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def agree_max(comm: MPI.Comm, values: Sequence[int], what: str,
              timeout: Optional[float]) -> np.ndarray:
    """The element-wise maximum of ``values`` over the ranks of ``comm``: a polled
    Iallreduce bounded by ``timeout`` (a rank that never comes: CommTimeoutError). Every
    decision that changes which calls a rank makes is taken this way, never by one rank."""
    send = np.asarray(values, dtype=np.int64)
    recv = np.empty_like(send)
    if comm.Get_size() == 1:
        return send
    req = comm.Iallreduce([send, MPI.INT64_T], [recv, MPI.INT64_T], op=MPI.MAX)
    wait_request(req, timeout,
                 lambda: (f"rank {comm.Get_rank()}: {what}: not every rank came within "
                          f"{timeout:g} s"), keep=(send, recv))
    return recv


def node_layout(comm: MPI.Comm, node_size: Optional[int],
                timeout: Optional[float]) -> Tuple[int, int, int, str]:
    """``(node, local rank, ranks per node, why not)`` of this rank for ``hierarchical``:
    with ``node_size``, consecutive groups of that many ranks are the nodes (emulated);
    else MPI's nodes (``COMM_TYPE_SHARED``), which must hold equally many ranks, numbered
    node by node (rank = node * ranks per node + local rank), agreed over ``comm``; where
    they do not, ``why not`` says so (every rank gets the same answer)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if node_size is not None:
        if size % node_size:
            raise OptionError(f"rank {rank}: node_size: expected a divisor of the "
                              f"communicator's {size} ranks, got {node_size}")
        return rank // node_size, rank % node_size, node_size, ""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local, per = node.Get_rank(), node.Get_size()
        first = node.allreduce(rank, op=MPI.MIN)
    finally:
        node.Free()
    ordered = rank - first == local and first % per == 0
    bad, most, fewest = agree_max(comm, [int(not ordered), per, -per], "node layout",
                                  timeout).tolist()
    if most != -fewest:
        return 0, 0, 0, (f"the nodes hold {-fewest} to {most} ranks; hierarchical needs "
                         f"the same number on every node")
    if bad:
        return 0, 0, 0, ("the ranks are not numbered node by node (rank = node * ranks "
                         "per node + local rank)")
    return rank // per, local, per, ""


#: what Open MPI 5's osc/ucx component prints on every window where UCX was not initialised
#: (its ob1 transport runs), while osc/sm makes the window: harmless, and the only such line
OSC_UCX_NOTICE = "OSC UCX component priority set inside component query failed"


@contextlib.contextmanager
def _without_osc_ucx_notice() -> Iterator[None]:
    """Open MPI: drop its OSC UCX notice (an ``Error:`` line per window and rank) from what
    the call writes to stderr, and pass everything else on. Other MPIs: nothing."""
    if MPI.get_vendor()[0] != "Open MPI":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept, skip_blank = [], False
            for line in caught.read().splitlines(keepends=True):
                if OSC_UCX_NOTICE.encode() in line:
                    skip_blank = True  # the notice is followed by a line of one space
                elif not (skip_blank and not line.strip()):
                    kept.append(line)
                    skip_blank = False
            if kept:
                os.write(2, b"".join(kept))


class SharedWindow:
    """One MPI-3 shared window of ``nbytes`` per rank, with every rank's segment as a numpy
    byte array (``segments[r]``): a stream's control window (the buffers' storage is the
    arena's, see the module doc). ``internal``: mpifusion's own, never handed out (every
    window made here is); ``serial``: its place in its node communicator's creation order,
    the same on every rank."""

    def __init__(self, comm: MPI.Comm, nbytes: int, serial: int,
                 internal: bool = False) -> None:
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each segment on the owner's pages
        try:
            with _without_osc_ucx_notice():
                self.win = MPI.Win.Allocate_shared(nbytes, 1, info=info, comm=comm)
        finally:
            info.Free()
        self.serial = serial
        self.internal = internal
        self.nbytes = nbytes
        self.freed = False
        self.win.Lock_all(MPI.MODE_NOCHECK)  # the epoch Win_sync needs (see the module doc)
        self.segments = [np.frombuffer(self.win.Shared_query(r)[0], dtype=np.uint8)
                         for r in range(comm.Get_size())]
        self.mine = self.segments[comm.Get_rank()]
        # zero, as BufferMemory expects of a fresh region: a buffer's pages given back (no
        # memory until first touched, as np.zeros gives them; the owner's add_grad or param
        # copy touches them first), the small control window written
        if internal or not punch(self.mine):
            self.mine[...] = 0
        self.base = self.mine.ctypes.data

    def sync(self) -> None:
        """Order this process's loads and stores on the window against the barriers."""
        self.win.Sync()

    def free(self) -> None:
        """``MPI_Win_free`` (collective over the node communicator)."""
        if self.freed:
            return
        self.freed = True
        self.segments = []
        self.mine = np.empty(0, np.uint8)
        if not MPI.Is_finalized():
            try:
                self.win.Unlock_all()
                self.win.Free()
            except MPI.Exception:
                pass


class ShmStream:
    """What one stream (a private duplicate with its own engine) needs to run shm
    collectives: its control window (a descriptor row and a scratch segment per rank) and
    the accumulators of its reductions (private to this process, reused: one task at a time
    runs on a stream). The ``serial`` of the rows is the collective's place in the stream,
    passed in by whoever builds its calls (the engine, after stamping it)."""

    def __init__(self, memory: "NodeMemory", window: SharedWindow) -> None:
        self.memory = memory
        self.window = window
        self.rank, self.size = memory.rank, memory.size
        #: bytes of each rank's scratch (the same on every rank: the window's size)
        self.scratch_bytes = window.nbytes - SCRATCH_OFFSET
        #: the node's barrier: on the engine's own communicator (``shm``: one node), or on
        #: the stream's node communicator (``hierarchical``, see :meth:`span`)
        self.barrier = Call("Barrier")
        #: ``hierarchical``: the ranks of this local index on every node, this node's index
        #: and the number of nodes (``shm``: None, 0, 1)
        self.cross: Optional[MPI.Comm] = None
        self.node, self.nodes = 0, 1
        self._work: Dict[Tuple[Any, Work, int], np.ndarray] = {}
        self._rows = [seg[:ROW_WORDS * 8].view(np.int64)[:len(ROW_FIELDS)]
                      for seg in window.segments]
        self._read = np.empty((self.size, len(ROW_FIELDS)), np.int64)
        self._scratch: Dict[Tuple[int, Any], np.ndarray] = {}
        self._gathered: Dict[Tuple[int, Any], Tuple[np.ndarray, Tuple[np.ndarray, ...]]] = {}
        self._published = [seg[PUBLISHED_WORD * 8:(PUBLISHED_WORD + 1) * 8].view(np.int64)
                           for seg in window.segments]
        self._scratches: Dict[Tuple[int, Any], Tuple[np.ndarray, ...]] = {}
        self._arrivals = _Arrivals(self)

    def span(self, node_comm: MPI.Comm, cross: MPI.Comm) -> None:
        """Make this a ``hierarchical`` stream: barriers on ``node_comm`` (the stream's own
        copy of the node's ranks), the cross-node step on ``cross`` (ranked by node)."""
        self.barrier = Call("Barrier", comm=node_comm)
        self.cross = cross
        self.node, self.nodes = cross.Get_rank(), cross.Get_size()

    def row(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s descriptor row (int64 words, ``ROW_FIELDS``)."""
        return self._rows[rank]

    def rows(self) -> np.ndarray:
        """Every rank's row, copied (read after a barrier; valid until the next read)."""
        read = self._read
        for q, row in enumerate(self._rows):
            read[q] = row
        return read

    def scratch(self, rank: int, dtype: Any) -> np.ndarray:
        """Rank ``rank``'s scratch as ``dtype`` elements."""
        key = (rank, dtype)
        arr = self._scratch.get(key)
        if arr is None:
            arr = self._scratch[key] = self.window.segments[rank][SCRATCH_OFFSET:].view(dtype)
        return arr

    def gathered(self, nbytes: int, dtype: Any) -> Tuple[np.ndarray, Tuple[np.ndarray, ...]]:
        """The receive rows of a gathered all-reduce of ``nbytes`` of ``dtype`` per rank (of
        every node), and every rank's row as a ``dtype`` array: kept per size, since making
        the views took longer than summing a 4 KiB buffer."""
        key = (nbytes, dtype)
        found = self._gathered.get(key)
        if found is None:
            if len(self._gathered) >= 64:  # many sizes: keep the memory bounded
                self._gathered.clear()
            rows = np.empty((self.size * self.nodes, nbytes), np.uint8)
            found = self._gathered[key] = (rows, tuple(row.view(dtype) for row in rows))
        return found

    def scratches(self, nbytes: int, dtype: Any) -> Tuple[np.ndarray, ...]:
        """Every rank's first ``nbytes`` of scratch as ``dtype`` (kept per size, as
        :meth:`gathered`'s; a tuple, which the compiled sum takes as it is)."""
        key = (nbytes, dtype)
        found = self._scratches.get(key)
        if found is None:
            if len(self._scratches) >= 64:
                self._scratches.clear()
            count = nbytes // np.dtype(dtype).itemsize
            found = self._scratches[key] = tuple(self.scratch(q, dtype)[:count]
                                                 for q in range(self.size))
        return found

    def publish(self, flat: np.ndarray,
                serial: int) -> Tuple[Call, Tuple[np.ndarray, ...]]:
        """An all-gather through the window, for one node (``shm``): ``flat`` copied into
        this rank's scratch and marked published for the collective ``serial`` (its place
        in the stream, counted from 1 and rising, so a peer's word from an earlier one is
        smaller); the call waits until every rank's is, and the tuple holds every rank's
        copy.

        Only behind the order check: a rank writes its scratch once every rank started this
        collective, so every peer finished reading it in the one before."""
        sources = self.scratches(flat.nbytes, flat.dtype)
        np.copyto(sources[self.rank], flat)
        self.window.sync()  # the copy lands before the word that tells the peers to read it
        self._published[self.rank][0] = serial
        return Call("start", (serial,), comm=self._arrivals, nonblocking=True), sources

    def work(self, region: Work, n: int, dtype: Any, slot: int = 0) -> np.ndarray:
        """``n`` elements of ``dtype`` of work region ``region`` (:class:`Work`), ring slot
        ``slot``: one array per region, slot and dtype, grown, never shrunk."""
        key = (np.dtype(dtype), region, slot)
        arr = self._work.get(key)
        if arr is None or arr.size < n:
            arr = self._work[key] = np.empty(max(n, 1), dtype=dtype)
        return arr[:n]


class _Arrivals:
    """The request-like wait of :meth:`ShmStream.publish` (``Test``/``Wait``, as an MPI
    request: the engines poll it, deadlines and hand-over included); its call's method is
    :meth:`start`, marked ``nonblocking`` so that every engine takes what it returns as a
    request."""

    __slots__ = ("stream", "serial")

    def __init__(self, stream: "ShmStream") -> None:
        self.stream = stream
        self.serial = 0

    def start(self, serial: int) -> "_Arrivals":
        """Start the wait for the collective ``serial`` (one runs at a time on a stream)."""
        self.serial = serial
        return self

    def Test(self) -> bool:
        serial = self.serial
        for word in self.stream._published:
            if word[0] < serial:
                return False
        self.stream.window.sync()  # the peers' copies are read after their words
        return True

    def Wait(self) -> None:
        if not self.Test():
            poll(self.Test, moves=never_moves)


# ---------------------------------------------------------------------------- the arena

class NodeMemory:
    """The shared memory of one user communicator, made on its node communicator ``comm``
    (a private duplicate holding the same ranks, all on one node): the buffers' arena and
    the streams' control windows."""

    def __init__(self, comm: MPI.Comm, timeout: Optional[float] = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        self.windows: Dict[int, SharedWindow] = {}   # control windows, by serial
        self.streams: Dict[str, ShmStream] = {}      # by stream tag
        self._window_serials = itertools.count()     # windows made on ``comm``, in order
        self._arena: Optional[Arena] = None

    # -- agreement (every decision that changes the calls is taken by all ranks together)
    def agree_max(self, values: Sequence[int], what: str, bounded: bool = True) -> np.ndarray:
        """:func:`agree_max` over the node, bounded by the communicator's timeout (``bounded``
        False: unbounded)."""
        return agree_max(self.comm, values, what, self.timeout if bounded else None)

    def arena(self, where: str) -> Arena:
        """The buffers' arena (made on first use: one all-reduce agrees on rank 0's token,
        which names the files)."""
        if self._arena is None:
            mine = (secrets.randbits(47) | 1) if self.rank == 0 else 0
            token = int(self.agree_max([mine], f"{where}: shared memory")[0])
            self._arena = Arena(self, token)
        return self._arena

    # -- control windows (MPI windows: one per stream)
    def allocate(self, nbytes: int, internal: bool = True) -> SharedWindow:
        """A new window of ``nbytes`` per rank (collective, in the shared order)."""
        win = SharedWindow(self.comm, round_up(max(nbytes, 1)), next(self._window_serials),
                           internal)
        self.windows[win.serial] = win
        return win

    def allocate_agreed(self, nbytes: int, where: str, wanted: bool = True,
                        internal: bool = True) -> Tuple[Optional[SharedWindow], str]:
        """A new MPI window of ``nbytes`` per rank, or ``(None, reason)`` where the ranks
        agreed not to make one (collective: an all-reduce, the allocation, an all-reduce).
        Refused where a rank does not want it, or where /dev/shm lacks space for every rank's
        segment (its pages are written now, and the arena's are reserved, so the check
        holds); given up where ``MPI_Win_allocate_shared`` fails on a rank (a library limit
        such as MPICH's 2,048 communicators included)."""
        total = round_up(max(nbytes, 1))
        free = free_bytes()
        short = int(free is not None and total * self.size > free)
        unwanted, short = self.agree_max([int(not wanted), short], f"{where}: shared window")
        if unwanted:
            return None, "not every rank's arrays are host arrays"
        if short:
            return None, (f"{total * self.size} bytes of shared windows wanted on the node, "
                          f"{SHM_FOLDER} has less free on some rank ({free} on rank "
                          f"{self.rank})")
        error = ""
        win = None
        try:
            win = self.allocate(total, internal)
        except MPI.Exception as exc:
            error = f"rank {self.rank}: MPI_Win_allocate_shared failed: {exc}"
        if self.agree_max([int(bool(error))], f"{where}: shared window")[0]:
            # a collective that failed on some rank cannot be undone collectively: a window
            # made here stays mapped, never freed (the peers have none to free it with)
            if win is not None:
                self.windows.pop(win.serial, None)
            return None, error or "MPI_Win_allocate_shared failed on another rank"
        return win, ""

    # -- the buffers' regions
    def reserve(self, sizes: Sequence[Tuple[int, Any]], where: str,
                wanted: bool = True) -> Tuple[List[Any], str]:
        """Regions of the arena for arrays of ``(numel, dtype)``, each zeroed, on its own
        page, its pages reserved (collective: one all-reduce, two more where the arena grows);
        or ``([], reason)`` where the ranks agreed not to (no reason where there is nothing
        to place or a rank's arrays are not host arrays)."""
        offsets, total = [], 0
        for numel, dtype in sizes:
            offsets.append(total)
            total += round_up(int(numel) * np.dtype(dtype).itemsize)
        if total == 0:  # the same on every rank: the sizes are agreed
            return [], ""
        arena = self.arena(where)
        chunk, off, err = arena.place(total) if wanted else (None, 0, 0)
        # one all-reduce: does every rank want it, has every rank room, could every rank
        # reserve its room's pages again (a reused extent), and the least space free
        unwanted, grow, refused, most_free = self.agree_max(
            [int(not wanted), int(chunk is None and not err), int(err != 0),
             -(free_bytes() or 0)], f"{where}: shared memory")
        if unwanted or refused:
            if chunk is not None:
                arena.unplace(chunk, off, total)
            if unwanted:
                return [], ""
            return [], (f"{total * self.size} bytes of shared memory wanted on the node "
                        f"({total} per rank), {SHM_FOLDER} has {-int(most_free)} free "
                        f"on some rank")
        if grow:  # some rank has no room: every rank adds a chunk (the same size)
            new, reason = arena.grow(max(total, tuning.ACTIVE.arena_chunk_bytes), where)
            if new is None:
                if chunk is not None:
                    arena.unplace(chunk, off, total)
                return [], reason
            if chunk is None:
                chunk, off = new, arena.take(new, total)
        regions = []
        pages = arena.region(chunk, off, total)
        for o, (numel, dtype) in zip(offsets, sizes):
            nbytes = int(numel) * np.dtype(dtype).itemsize
            region = np.frombuffer(pages[o:o + nbytes], dtype=dtype)
            # each region is an array of its own (its base a memoryview, not another array):
            # views of it keep *it* as their base, so its reference count says whether
            # anything still uses it (``BufferMemory.release``), and it dies with the last
            arena.track(region, chunk, off + o, nbytes)
            regions.append(region)
        return regions, ""

    def stream(self, tag: str, where: str) -> Tuple[Optional[ShmStream], str]:
        """The shm state of stream ``tag`` (made on first use: collective, in the shared
        order of Communicator construction), or ``(None, reason)``."""
        state = self.streams.get(tag)
        if state is None:
            win, reason = self.allocate_agreed(
                SCRATCH_OFFSET + tuning.ACTIVE.scratch_bytes, where)
            if win is None:
                return None, reason
            state = self.streams[tag] = ShmStream(self, win)
        return state, ""

    def locate(self, arr: Any) -> Tuple[int, int]:
        """``(chunk serial, byte offset)`` of a C-contiguous numpy array that lies in this
        rank's part of one of the arena's chunks, else ``(-1, 0)``."""
        if type(arr) is not np.ndarray or not arr.flags.c_contiguous or self._arena is None:
            return -1, 0
        ptr = arr.__array_interface__["data"][0]
        return self._arena.locate(ptr, ptr + arr.nbytes)

    def peer_array(self, serial: int, rank: int, offset: int, count: int,
                   dtype: Any) -> Optional[np.ndarray]:
        """Rank ``rank``'s array of ``count`` ``dtype`` elements at ``offset`` of chunk
        ``serial``; None where that does not lie inside the chunk (a bad descriptor)."""
        chunk = self._arena.chunks.get(serial) if self._arena is not None else None
        nbytes = count * np.dtype(dtype).itemsize
        if chunk is None or offset < 0 or offset + nbytes > chunk.nbytes:
            return None
        return chunk.segments[rank][offset:offset + nbytes].view(dtype)

    def release(self) -> None:
        """The user communicator is being freed (collective; the engines of the streams were
        closed first): free the control windows, in creation order (nothing else uses them),
        and forget the arena -- its chunks are unmapped as their last regions go (a buffer a
        user keeps stays readable; it cannot communicate any more)."""
        self.streams = {}
        for serial in sorted(self.windows):
            self.windows[serial].free()
        self.windows = {}
        if self._arena is not None:
            # no collective runs on these chunks any more: the peers' mappings and this
            # rank's descriptors go now; this rank's part stays mapped while a region of it
            # is alive (a grad a user kept), and goes with the last one
            for chunk in self._arena.chunks.values():
                chunk.segments = [chunk.mine]
                chunk.close()
            self._arena.chunks = {}
            self._arena = None


def memory_for(comm: MPI.Comm, timeout: Optional[float] = None) -> NodeMemory:
    """The NodeMemory of a node communicator (made on first use)."""
    with _LOCK:
        memory = _MEMORY.get(comm.py2f())
        if memory is None:
            memory = _MEMORY[comm.py2f()] = NodeMemory(comm, timeout)
    return memory


def release_memory(comm: MPI.Comm) -> None:
    """``comm`` is about to be freed: free its control windows, forget its arena
    (collective; see :meth:`NodeMemory.release`)."""
    with _LOCK:
        memory = _MEMORY.pop(comm.py2f(), None)
    if memory is not None and not MPI.Is_finalized():
        memory.release()


def live_windows() -> int:
    """MPI windows not freed yet (the streams' control windows: for leak checks and tests)."""
    with _LOCK:
        return sum(len(m.windows) for m in _MEMORY.values())


__all__ = ["Arena", "Chunk", "NodeMemory", "SharedWindow", "ShmStream", "Work", "agree_max",
           "free_bytes", "live_regions", "live_windows", "memory_for",
           "node_layout", "punch", "ranks_on_node", "refill", "release_memory"]
