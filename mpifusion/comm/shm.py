"""Shared memory of one node for the ``shm`` strategy: MPI-3 shared windows, who owns them,
and the rules for freeing them.

With ``strategy="shm"`` the ranks of a communicator that lies on one node keep their fused
buffers in MPI-3 shared windows (``MPI_Win_allocate_shared``): every rank maps every other
rank's segment, so a collective is plain loads and stores between two barriers
(``shm_collectives.py``) instead of messages. Two kinds of windows, both made on the
``shm/memory`` private duplicate of the user's communicator (the *node* communicator: the
strategy is used only where it holds every rank, see :func:`ranks_on_node`):

* a buffer's storage (:meth:`NodeMemory.reserve`): its grad and param storage, made at buffer
  construction, so ``add_grad`` writes straight into shared memory (no copy-in);
* a stream's *control* window (:class:`ShmStream`): per rank one descriptor row -- which
  collective it runs and where its array lies -- and a scratch segment that stages host
  arrays that are not in a window (a user's own numpy array), chunk by chunk, and holds a
  small all-reduce's copy of the rank's buffer (:meth:`ShmStream.publish`).

Every window is made collectively, in an order all ranks share (buffer construction order,
which the agreement check enforces), and gets a number from one counter: the *same* window
has the same number on every rank, which is how a descriptor names it.

Lifetime (``MPI_Win_free`` is collective, so every rank must free the same windows in the
same order): nothing is freed when a buffer is closed or dropped -- its grads and params
stay readable, and they are views of the window. :func:`release_memory` (run by
``mpifusion.comm.release(comm)`` and when the user frees ``comm``) frees, in creation order,
the windows whose memory no rank still holds an array of (one agreed all-reduce); the others
stay mapped until exit, where :func:`free_at_exit` frees every window left, in creation order,
if every rank votes that it exits cleanly (one that exits on an error, stuck or after an
abandoned collective votes no: MPI_Finalize or the abort cleans up). So with ``shm`` a
buffer's window stays mapped for the buffer's lifetime: ``release_grads``,
``clear_grad_storage`` and ``clear_param_storage`` give the region's pages back
(:func:`punch`, local), and the next allocation reuses the same region, zeroed. Both MPIs here back a window with a file in /dev/shm that
they unlink as soon as every rank mapped it (MPICH ``mpich_shar_tmp*``, Open MPI
``osc_sm.*``), so a killed job leaves nothing of mpifusion's there (measured: issue 29).

Memory ordering: MPI's unified memory model (both MPIs here) makes stores to a window visible
to the other processes, but only ``MPI_Win_sync`` orders them against the barrier that tells
a peer it may read (the standard's shared-memory example: sync, barrier, sync); every window
is locked once (``Lock_all(MODE_NOCHECK)``: MPICH refuses ``Win_sync`` outside a
passive-target epoch). The collectives sync one window, the stream's, on each side of every
barrier: in the unified model
``Win_sync`` is a full processor memory barrier in both libraries (MPICH
``MPL_atomic_read_write_barrier``, Open MPI ``opal_atomic_mb``), which orders every load and
store of the process, whichever window it touches. Each sync is an MPI call that gives up the
GIL; syncing every window involved cost ~20 us per call here once the communication thread
competed for it.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import sys
import tempfile
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ..errors import OptionError
from .call import Call
from .health import wait_request
from .poll import never_moves, poll

#: every window's segment (and every region in it) starts on its own page: aligned for any
#: dtype (and backend.BASE_ALIGNMENT), and its first touch by the owner places it on the
#: owner's NUMA node
PAGE = 4096
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
#: bytes of a stream's scratch per rank: arrays outside the windows are staged through it in
#: rounds of this size (1 MiB: the size the prototype of issue 29 ran its chunks at)
SCRATCH_BYTES = 1 << 20
#: where the scratch starts in a rank's segment of the control window
SCRATCH_OFFSET = PAGE
#: where the MPI libraries put shared windows (MPICH and Open MPI: a file in /dev/shm)
SHM_FOLDER = "/dev/shm"

_SERIAL = itertools.count()  # creation order of the NodeMemory objects of this process
_LOCK = threading.Lock()
#: released node communicators whose windows a rank still held arrays of: freed at exit
_KEPT: List["NodeMemory"] = []
#: NodeMemory by the handle of its node communicator (the ``shm/memory`` duplicate)
_MEMORY: Dict[int, "NodeMemory"] = {}


def round_up(n: int, unit: int = PAGE) -> int:
    return -(-n // unit) * unit


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


def free_bytes(folder: str = SHM_FOLDER) -> Optional[int]:
    """Bytes free in the file system that backs shared windows (None: unknown). A window
    larger than that maps fine and then kills the process with SIGBUS at the first touch of a
    missing page (a container's /dev/shm is often 64 MiB), so it is checked beforehand."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


_MADV_REMOVE = 9  # Linux: free a shared mapping's pages and their backing store


def _libc_madvise() -> Optional[Callable[..., int]]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise() if sys.platform.startswith("linux") else None


def punch(region: np.ndarray) -> bool:
    """Give a window region's pages back to the system (``madvise(MADV_REMOVE)``: the
    shared memory behind them is freed and they read as zeros when touched again), so
    ``release_grads`` saves memory with ``shm`` as it does with fresh arrays. Local: the
    window stays mapped on every rank. ``region`` starts on a page and owns the rest of its
    last page (``NodeMemory.reserve``). False where the system refused (then nothing
    changed and the region keeps its values)."""
    addr = region.ctypes.data
    if _MADVISE is None or addr % PAGE or region.nbytes == 0:
        return False
    return _MADVISE(addr, round_up(region.nbytes), _MADV_REMOVE) == 0


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
    byte array (``segments[r]``). ``internal``: mpifusion's own (a stream's control window),
    never handed out; ``serial``: its place in its node communicator's creation order, which
    is what names it across ranks (a process-wide count would differ between ranks that
    built windows on other communicators: a rank would then map another window)."""

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

    def held(self) -> bool:
        """Whether an array of this rank's segment is still alive outside this object (a
        buffer's grads, params, or a view a user kept): freeing would unmap it."""
        if self.internal:
            return False
        # references: self.segments, self.mine, getrefcount's argument
        return sys.getrefcount(self.mine) > 3

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
    collectives: its control window (a descriptor row and a scratch segment per rank), the
    count of shm collectives it ran (the ``serial`` of the rows), and the accumulators of its
    reductions (private to this process, reused: one task at a time runs on a stream)."""

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
        self.serial = 0
        self._work: Dict[Tuple[Any, int], np.ndarray] = {}
        self._rows = [seg[:ROW_WORDS * 8].view(np.int64)[:len(ROW_FIELDS)]
                      for seg in window.segments]
        self._read = np.empty((self.size, len(ROW_FIELDS)), np.int64)
        self._scratch: Dict[Tuple[int, Any], np.ndarray] = {}
        self._gathered: Dict[Tuple[int, Any], Tuple[np.ndarray, Tuple[np.ndarray, ...]]] = {}
        self._published = [seg[PUBLISHED_WORD * 8:(PUBLISHED_WORD + 1) * 8].view(np.int64)
                           for seg in window.segments]
        self._scratches: Dict[Tuple[int, Any], Tuple[np.ndarray, ...]] = {}
        self._arrived = Call("Iarrived", comm=_Arrivals(self))

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

    def publish(self, flat: np.ndarray) -> Tuple[Call, Tuple[np.ndarray, ...]]:
        """An all-gather through the window, for one node (``shm``): ``flat`` copied into
        this rank's scratch and marked published for this collective (``serial``); the
        call waits until every rank's is, and the tuple holds every rank's copy.

        Only behind the order check: a rank writes its scratch once every rank started this
        collective, so every peer finished reading it in the one before."""
        sources = self.scratches(flat.nbytes, flat.dtype)
        np.copyto(sources[self.rank], flat)
        self.window.sync()  # the copy lands before the word that tells the peers to read it
        self._published[self.rank][0] = self.serial
        return self._arrived, sources

    def work(self, slot: int, n: int, dtype: Any) -> np.ndarray:
        """Accumulator ``slot`` of at least ``n`` elements of ``dtype`` (grown, never shrunk)."""
        key = (np.dtype(dtype), slot)
        arr = self._work.get(key)
        if arr is None or arr.size < n:
            arr = self._work[key] = np.empty(max(n, 1), dtype=dtype)
        return arr[:n]


class _Arrivals:
    """The request-like wait of :meth:`ShmStream.publish` (``Test``/``Wait``, as an MPI
    request: the engines poll it, deadlines and hand-over included); ``Iarrived`` is the
    call's method, so every engine takes it as already non-blocking."""

    __slots__ = ("stream", "serial")

    def __init__(self, stream: "ShmStream") -> None:
        self.stream = stream
        self.serial = 0

    def Iarrived(self) -> "_Arrivals":
        """Start the wait for this collective (one runs at a time on a stream)."""
        self.serial = self.stream.serial
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


class NodeMemory:
    """The shared windows of one user communicator, made on its node communicator ``comm``
    (a private duplicate holding the same ranks, all on one node), in creation order."""

    def __init__(self, comm: MPI.Comm, timeout: Optional[float] = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        self.windows: Dict[int, SharedWindow] = {}   # by serial (the same on every rank)
        self.streams: Dict[str, ShmStream] = {}      # by stream tag
        self.serial = next(_SERIAL)  # creation order of the NodeMemory objects (exit frees)
        self._window_serials = itertools.count()     # windows made on ``comm``, in order

    # -- agreement (every decision that changes the calls is taken by all ranks together)
    def agree_max(self, values: Sequence[int], what: str, bounded: bool = True) -> np.ndarray:
        """:func:`agree_max` over the node: ``bounded`` by the communicator's timeout at
        construction; unbounded when freeing, as ``MPI_Win_free`` itself is (a rank that gave
        up would leave the request posted, a late peer would complete it and then wait in a
        ``Win_free`` this rank never calls)."""
        return agree_max(self.comm, values, what, self.timeout if bounded else None)

    # -- windows
    def allocate(self, nbytes: int, internal: bool = False) -> SharedWindow:
        """A new window of ``nbytes`` per rank (collective, in the shared order)."""
        win = SharedWindow(self.comm, round_up(max(nbytes, 1)), next(self._window_serials),
                           internal)
        self.windows[win.serial] = win
        return win

    def allocate_agreed(self, nbytes: int, where: str, wanted: bool = True,
                        internal: bool = False) -> Tuple[Optional[SharedWindow], str]:
        """A new window of ``nbytes`` per rank, or ``(None, reason)`` where the ranks agreed
        not to make one (collective: an all-reduce, the allocation, an all-reduce). Refused
        where a rank does not want it, or where the file system behind the windows lacks
        space for every rank's segment (see :func:`free_bytes`); given up where
        ``MPI_Win_allocate_shared`` fails on a rank."""
        total = round_up(max(nbytes, 1))
        free = free_bytes()
        short = int(free is not None and total * self.size > free)
        unwanted, short = self.agree_max([int(not wanted), short], f"{where}: shared window")
        if unwanted:
            return None, "not every rank's arrays are host arrays"
        if short:
            return None, (f"{total * self.size} bytes of shared windows needed on the node, "
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

    def reserve(self, sizes: Sequence[Tuple[int, Any]], where: str,
                wanted: bool = True) -> Tuple[List[Any], str]:
        """Regions of one new window for arrays of ``(numel, dtype)``, each zeroed and on
        its own page; or ``([], reason)`` (see :meth:`allocate_agreed`; no reason where
        there is nothing to place or a rank's arrays are not host arrays)."""
        offsets, total = [], 0
        for numel, dtype in sizes:
            offsets.append(total)
            total += round_up(int(numel) * np.dtype(dtype).itemsize)
        if total == 0:  # the same on every rank: the sizes are agreed
            return [], ""
        win, reason = self.allocate_agreed(total, where, wanted)
        if win is None:
            return [], reason if wanted else ""
        # each region is an array of its own over the window's memory (not a view of
        # ``mine``): views of it then keep *it* as their base, so its reference count says
        # whether anything still uses it (see ``BufferMemory.release``)
        pages = memoryview(win.mine)
        return [np.frombuffer(pages[o:o + int(n) * np.dtype(d).itemsize], dtype=d)
                for o, (n, d) in zip(offsets, sizes)], ""

    def stream(self, tag: str, where: str) -> Tuple[Optional[ShmStream], str]:
        """The shm state of stream ``tag`` (made on first use: collective, in the shared
        order of Communicator construction), or ``(None, reason)``."""
        state = self.streams.get(tag)
        if state is None:
            win, reason = self.allocate_agreed(SCRATCH_OFFSET + SCRATCH_BYTES, where,
                                               internal=True)
            if win is None:
                return None, reason
            state = self.streams[tag] = ShmStream(self, win)
        return state, ""

    def locate(self, arr: Any) -> Tuple[int, int]:
        """``(window serial, byte offset)`` of a C-contiguous numpy array that lies in this
        rank's segment of one of the windows, else ``(-1, 0)``."""
        if type(arr) is not np.ndarray or not arr.flags.c_contiguous:
            return -1, 0
        ptr = arr.__array_interface__["data"][0]
        end = ptr + arr.nbytes
        for serial, win in self.windows.items():
            if not win.internal and win.base <= ptr and end <= win.base + win.mine.nbytes:
                return serial, ptr - win.base
        return -1, 0

    def peer_array(self, serial: int, rank: int, offset: int, count: int,
                   dtype: Any) -> Optional[np.ndarray]:
        """Rank ``rank``'s array of ``count`` ``dtype`` elements at ``offset`` of window
        ``serial``; None where that does not lie inside the window (a bad descriptor)."""
        win = self.windows.get(serial)
        nbytes = count * np.dtype(dtype).itemsize
        if win is None or win.internal or offset < 0 or offset + nbytes > win.nbytes:
            return None
        return win.segments[rank][offset:offset + nbytes].view(dtype)

    def window(self, serial: int) -> Optional[SharedWindow]:
        return self.windows.get(serial)

    def release(self) -> bool:
        """Free (collectively, in creation order) the windows no rank holds arrays of; True
        where some are kept for :func:`free_at_exit` (``comm`` must then stay alive for its
        vote). The engines of the streams were closed first."""
        live = [self.windows[s] for s in sorted(self.windows)]
        self.streams = {}
        if not live:
            return False
        try:
            held = self.agree_max([int(w.held()) for w in live], "releasing shared windows",
                                  bounded=False)
        except MPI.Exception:
            return True  # not agreed: every window waits for the exit
        for win, keep in zip(live, held.tolist()):
            if not keep:
                win.free()
                del self.windows[win.serial]
        return bool(self.windows)

    def free_all(self, clean: bool) -> None:
        """At exit: free every window left, in creation order, if every rank exits cleanly
        (a vote: a rank that votes no leaves them to MPI_Finalize or the abort instead of
        hanging the others in Win_free). The vote waits for every rank as MPI_Finalize does."""
        try:
            troubled = self.agree_max([int(not clean)], "freeing shared windows at exit",
                                      bounded=False)[0]
        except MPI.Exception:
            return
        if not troubled:
            for serial in sorted(self.windows):
                self.windows[serial].free()
        self.windows = {}


def memory_for(comm: MPI.Comm, timeout: Optional[float] = None) -> NodeMemory:
    """The NodeMemory of a node communicator (made on first use: collective)."""
    with _LOCK:
        memory = _MEMORY.get(comm.py2f())
    if memory is None:
        memory = NodeMemory(comm, timeout)
        with _LOCK:
            _MEMORY[comm.py2f()] = memory
    return memory


def release_memory(comm: MPI.Comm) -> bool:
    """``comm`` is about to be freed: release the windows made on it (collective; see
    :meth:`NodeMemory.release`). True where windows were kept until exit: then ``comm``
    must not be freed (the exit's vote runs on it). False for a communicator without any."""
    with _LOCK:
        memory = _MEMORY.pop(comm.py2f(), None)
    if memory is None or MPI.Is_finalized():
        return False
    kept = memory.release()
    if kept:
        with _LOCK:
            _KEPT.append(memory)
    return kept


def free_at_exit(clean: bool) -> None:
    """Free every window left, node communicator by node communicator in creation order
    (collective; see :meth:`NodeMemory.free_all`). ``clean``: this rank exits normally."""
    with _LOCK:
        left = sorted(list(_MEMORY.values()) + _KEPT, key=lambda m: m.serial)
        _MEMORY.clear()
        _KEPT.clear()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        for memory in left:
            memory.free_all(clean)


def live_windows() -> int:
    """Windows not freed yet (for leak checks and tests)."""
    with _LOCK:
        return sum(len(m.windows) for m in list(_MEMORY.values()) + _KEPT)


__all__ = ["NodeMemory", "SharedWindow", "ShmStream", "agree_max", "free_at_exit",
           "free_bytes", "live_windows", "memory_for", "node_layout", "punch",
           "ranks_on_node", "release_memory"]
