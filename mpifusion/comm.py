"""All of mpifusion's MPI traffic goes through here.

``CommTask`` is the one handle for in-flight collectives (Paddle's ``task``): it owns every
array MPI touches until the collective is done, because mpi4py does not keep non-blocking
buffers alive. ``Communicator`` wraps a private duplicate of the user's communicator, so the
library's collectives never interleave with the user's own traffic on COMM_WORLD.

How a buffer is handed to MPI changes the time of a sync by up to 8x (see BENCHMARKS.md), so
the way collectives run is a *strategy*:

``thread`` (default)
    A daemon thread per communicator runs blocking collectives in segments of
    ``segment_bytes`` (blocking calls take MPI's fastest algorithms; segments stay in cache,
    so the ``1/n`` scaling and half-precision rounding of each segment are cheap). It
    progresses on its own while the caller keeps calling ``add_grad`` or computing. Needs
    ``MPI_THREAD_MULTIPLE`` (mpi4py's default level).
``nonblocking``
    The plain way: ``Iallreduce``/``Ireduce``/... issued from the calling thread; progress
    happens whenever ``poll()`` (every ``add_grad``), ``is_completed()`` or ``wait()`` calls
    into MPI. Segments (only used for half precision unless ``segment_bytes`` says so) are
    issued one after another.

Choose with ``Communicator(comm, strategy=...)`` or ``$MPIFUSION_COMM_STRATEGY``; the segment
size with ``segment_bytes=`` or ``$MPIFUSION_SEGMENT_BYTES`` (0: one segment per buffer).

Every collective is written once, as a generator of MPI calls (``_allreduce_steps`` ...);
a strategy only decides whether each call is blocking (on the thread) or non-blocking (in
the caller). Collectives of one communicator are issued in the order they were started, on
every rank: a task issues its next call only after every earlier task issued all of its calls.
"""
from __future__ import annotations

import atexit
import collections
import logging
import os
import queue
import sys
import threading
import time
from typing import Any, Callable, Deque, Dict, Generator, Iterator, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from . import backend, cuda
from .dtypes import HALF, float32
from .errors import CommError, CommTimeoutError

logger = logging.getLogger("mpifusion")

STRATEGY_ENV = "MPIFUSION_COMM_STRATEGY"
SEGMENT_ENV = "MPIFUSION_SEGMENT_BYTES"
STRATEGIES = ("thread", "nonblocking")
DEFAULT_STRATEGY = "thread"
#: 8 MiB: blocking segments of 4-16 MiB reached the best raw speed here (BENCHMARKS.md);
#: smaller ones pay per-call latency, larger ones fall out of cache.
DEFAULT_SEGMENT_BYTES = 8 << 20

#: One MPI call of a collective: (name of the blocking mpi4py method, args, kwargs). The
#: non-blocking form is the same name with an ``I`` in front (Allreduce -> Iallreduce).
Call = Tuple[str, tuple, dict]
Steps = Generator[Call, None, None]


class CommTask:
    """An in-flight collective: ``wait()`` finishes it, ``is_completed()`` polls it.

    Built from MPI requests (``requests``), ``finish`` runs exactly once after MPI is done and
    ``keep`` holds the arrays MPI reads or writes until then. Strategies build tasks from
    a generator of MPI calls instead (see the module docstring).
    """

    __slots__ = ("name", "_requests", "_keep", "_finish", "_done", "_steps", "_engine",
                 "_issued_all", "_event", "_error", "_rank")

    def __init__(self, requests: Sequence[MPI.Request] = (), keep: Sequence[Any] = (),
                 finish: Optional[Callable[[], None]] = None, name: str = "") -> None:
        self.name = name
        self._requests = list(requests)
        self._keep = list(keep)
        self._finish = finish
        self._done = False
        self._steps: Optional[Iterator[Call]] = None
        self._engine: Optional["_Engine"] = None
        self._issued_all = True
        self._event: Optional[threading.Event] = None
        self._error: Optional[BaseException] = None
        self._rank = -1

    @classmethod
    def completed(cls, name: str = "") -> "CommTask":
        """A task that has nothing to wait for (one rank, nothing to send)."""
        task = cls(name=name)
        task._done = True
        return task

    def is_completed(self) -> bool:
        """Poll once; this also drives MPI's progress engine."""
        if self._done:
            return True
        if self._engine is not None:
            self._engine.progress()
            if self._engine.finished(self):
                self._complete()
            return self._done
        if MPI.Request.Testall(self._requests):
            self._complete()
            return True
        return False

    test = is_completed

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the task completes (at once if it already has)."""
        if self._done:
            fn()
            return
        first = self._finish

        def chained() -> None:
            if first is not None:
                first()
            fn()

        self._finish = chained

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until done, or raise ``CommTimeoutError`` after ``timeout`` seconds."""
        if self._done:
            return
        if self._engine is not None:
            self._engine.wait_for(self, timeout)
            self._complete()
            return
        if timeout is None:
            MPI.Request.Waitall(self._requests)
        else:
            deadline = time.monotonic() + timeout
            pause = 1e-5
            while not MPI.Request.Testall(self._requests):
                if time.monotonic() >= deadline:
                    raise self._timeout_error(timeout)
                time.sleep(pause)
                pause = min(pause * 2, 1e-2)
        self._complete()

    #: set once any collective missed its deadline (then exit does not wait for collectives)
    timed_out = False

    def _timeout_error(self, timeout: float) -> CommTimeoutError:
        CommTask.timed_out = True
        return CommTimeoutError(f"rank {self._rank}: {self.name or 'collective'} did not "
                                f"complete within {timeout:g} s (another rank may not have "
                                f"started it, or started collectives in a different order)")

    def _complete(self) -> None:
        error, self._error = self._error, None
        self._done = True
        finish, self._finish = self._finish, None
        self._requests = []
        self._steps = None
        self._keep = []
        if error is not None:
            raise CommError(f"rank {self._rank}: {self.name or 'collective'} failed: "
                            f"{error}") from error
        if finish is not None:
            finish()

    def __repr__(self) -> str:
        return f"CommTask({self.name!r}, completed={self._done})"


# --------------------------------------------------------------------------- engines
class _Engine:
    """Runs the tasks of one private communicator, in the order they were started."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.tasks: Deque[CommTask] = collections.deque()

    def submit(self, task: CommTask) -> None:
        raise NotImplementedError

    def progress(self) -> None:
        raise NotImplementedError

    def finished(self, task: CommTask) -> bool:
        raise NotImplementedError

    def wait_for(self, task: CommTask, timeout: Optional[float]) -> None:
        raise NotImplementedError

    def drain(self, timeout: float) -> None:
        """Finish every started task (at exit), giving up after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for task in list(self.tasks):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                self.wait_for(task, left)
            except Exception:  # at exit there is nobody left to tell
                return


class _NonBlockingEngine(_Engine):
    """Non-blocking calls from the caller's thread; progress whenever MPI is called.

    One call is in flight per communicator: a task issues its next call when its previous
    one is done, and a task starts only when every earlier task has finished, so all ranks
    issue the same calls in the same order whatever their timing.
    """

    def submit(self, task: CommTask) -> None:
        task._issued_all = False
        self.tasks.append(task)
        self.progress()

    @staticmethod
    def _advance(task: CommTask) -> None:
        """Issue ``task``'s next call (and run the landing code before it) once the previous
        call is done; mark the task finished after its last landing."""
        while not task._issued_all:
            if task._requests:
                if not task._requests[0].Test():
                    return
                task._requests = []
            try:
                name, args, kwargs = next(task._steps)
            except StopIteration:
                task._issued_all = True
                return
            except Exception as exc:  # an MPI error or a landing error: raised by wait()
                task._error, task._issued_all = exc, True
                return
            try:
                comm = task._engine.comm
                task._requests = [getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kwargs)]
            except Exception as exc:
                task._error, task._issued_all = exc, True
                return

    def progress(self) -> None:
        tasks = self.tasks
        while tasks:
            self._advance(tasks[0])
            if not tasks[0]._issued_all:
                return
            tasks.popleft()

    def finished(self, task: CommTask) -> bool:
        return task._issued_all

    def wait_for(self, task: CommTask, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 1e-6
        while True:
            self.progress()
            if task._issued_all:
                return
            if deadline is None:
                head = self.tasks[0]
                if head._requests:
                    head._requests[0].Wait()  # block on the oldest call: nothing else can move
                continue
            if time.monotonic() >= deadline:
                raise task._timeout_error(timeout)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class _ThreadEngine(_Engine):
    """A daemon thread running each task's calls as blocking MPI calls, in FIFO order."""

    def __init__(self, comm: MPI.Comm) -> None:
        super().__init__(comm)
        self.queue: "queue.SimpleQueue[Optional[CommTask]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="mpifusion-comm", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        comm = self.comm
        while True:
            task = self.queue.get()
            if task is None:
                return
            try:
                for name, args, kwargs in task._steps:
                    getattr(comm, name)(*args, **kwargs)
            except BaseException as exc:  # reported to the caller by wait()
                task._error = exc
            task._event.set()

    def submit(self, task: CommTask) -> None:
        task._event = threading.Event()
        self.tasks.append(task)
        self.queue.put(task)

    def progress(self) -> None:
        tasks = self.tasks
        while tasks and tasks[0]._event.is_set():
            tasks.popleft()

    def finished(self, task: CommTask) -> bool:
        return task._event.is_set()

    def wait_for(self, task: CommTask, timeout: Optional[float]) -> None:
        if not task._event.wait(timeout):
            raise task._timeout_error(timeout)
        self.progress()

    def stop(self, timeout: float) -> None:
        self.drain(timeout)
        self.queue.put(None)
        self.thread.join(timeout=1.0)


#: Engines by the handle of their private communicator (never freed, so never reused).
_ENGINES: Dict[int, _Engine] = {}
#: MPI attribute key under which a communicator caches its private duplicates ({tag: dup}).
#: An attribute, not a dict keyed by handle: MPI reuses the handle of a freed communicator,
#: and a new communicator must not inherit the old one's duplicate (another group).
_DUPS_KEYVAL: Optional[int] = None


def private_comm(comm: MPI.Comm, tag: str = "", timeout: Optional[float] = None) -> MPI.Comm:
    """A duplicate of ``comm`` made once per communicator and ``tag`` (collective on first
    use). Each strategy gets its own duplicate, so their calls can never interleave.
    With ``timeout``, the first use is bounded too: a rank that never builds a buffer on
    ``comm`` gives a ``CommTimeoutError`` instead of a hang."""
    global _DUPS_KEYVAL
    if _DUPS_KEYVAL is None:
        _DUPS_KEYVAL = MPI.Comm.Create_keyval()  # not copied by comm.Dup(), dropped by Free()
    dups = comm.Get_attr(_DUPS_KEYVAL)
    if dups is None:
        dups = {}
        comm.Set_attr(_DUPS_KEYVAL, dups)
    dup = dups.get(tag)
    if dup is None:
        if timeout is None:
            dup = comm.Dup()
        else:
            dup, request = comm.Idup()
            deadline = time.monotonic() + timeout
            while not request.Test():
                if time.monotonic() >= deadline:
                    CommTask.timed_out = True
                    raise CommTimeoutError(
                        f"rank {comm.Get_rank()}: duplicating comm_group for mpifusion (first "
                        f"buffer on it) did not complete within {timeout:g} s: some rank of "
                        f"the {comm.Get_size()} has not built a buffer on this communicator")
                time.sleep(1e-3)
        dups[tag] = dup
    return dup


@atexit.register
def _stop_engines() -> None:
    """Let started collectives finish (bounded) and stop the threads before MPI finalizes."""
    if getattr(sys, "last_value", None) is not None or CommTask.timed_out:
        return  # exiting on an error or after a missed deadline: waiting only delays the abort
    for engine in list(_ENGINES.values()):
        if isinstance(engine, _ThreadEngine):
            engine.stop(timeout=30.0)
        else:
            engine.drain(timeout=30.0)
    _ENGINES.clear()


def resolve_strategy(strategy: Optional[str] = None) -> Tuple[str, bool]:
    """(strategy, explicit): the argument, else ``$MPIFUSION_COMM_STRATEGY``, else the default."""
    where = "strategy"
    explicit = strategy is not None
    if strategy is None:
        env = os.environ.get(STRATEGY_ENV, "").strip()
        explicit, where = bool(env), STRATEGY_ENV
        strategy = env or DEFAULT_STRATEGY
    key = str(strategy).strip().lower().replace("_", "").replace("-", "")
    key = {"nb": "nonblocking", "plain": "nonblocking", "threaded": "thread"}.get(key, key)
    if key not in STRATEGIES:
        raise CommError(f"{where}: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")
    return key, explicit


def resolve_segment_bytes(segment_bytes: Optional[int] = None,
                          strategy: str = DEFAULT_STRATEGY) -> int:
    """The argument, else ``$MPIFUSION_SEGMENT_BYTES``, else the strategy's default (8 MiB
    for ``thread``, 0 for ``nonblocking``); 0 means one segment per buffer."""
    if segment_bytes is None:
        env = os.environ.get(SEGMENT_ENV, "").strip()
        if not env:
            return DEFAULT_SEGMENT_BYTES if strategy == "thread" else 0
        try:
            segment_bytes = int(float(env))
        except ValueError:
            raise CommError(f"{SEGMENT_ENV}: expected a number of bytes, got {env!r}") from None
        what = SEGMENT_ENV
    else:
        what = "segment_bytes"
    if isinstance(segment_bytes, bool) or int(segment_bytes) != segment_bytes or segment_bytes < 0:
        raise CommError(f"{what}: expected an int >= 0 (0: no segments), got {segment_bytes!r}")
    return int(segment_bytes)


# --------------------------------------------------------------------------- communicator
_MPI_TYPES = {"float32": MPI.FLOAT, "float64": MPI.DOUBLE}


def _spec(arr: Any) -> list:
    """mpi4py buffer spec for a flat fp32/fp64 array (predefined types, so MPI_SUM applies)."""
    return [arr, _MPI_TYPES[arr.dtype.name]]


class Communicator:
    """The collectives a fused buffer needs, on a private communicator.

    Half-precision buffers are widened to fp32 one segment at a time, summed in fp32, scaled
    (``scale``) in fp32 and rounded back once: MPI has no bfloat16 type, and summing in fp32
    makes the result depend only on the order of additions MPI chose, with one final
    rounding (see README, "How exact"). Temporary memory stays within a few segments.
    """

    def __init__(self, comm: MPI.Comm, strategy: Optional[str] = None,
                 segment_bytes: Optional[int] = None, timeout: Optional[float] = None) -> None:
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm_group: expected an mpi4py communicator, "
                            f"got {type(comm).__name__}")
        strategy, explicit = resolve_strategy(strategy)
        if strategy == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            rank = comm.Get_rank()
            if explicit:
                raise CommError(f"rank {rank}: strategy 'thread': expected MPI initialised at "
                                f"MPI_THREAD_MULTIPLE, got level {MPI.Query_thread()} "
                                f"(set mpi4py.rc.thread_level = 'multiple' before importing "
                                f"MPI, or use strategy='nonblocking')")
            logger.warning("rank %d: MPI is not at MPI_THREAD_MULTIPLE; using the "
                           "'nonblocking' strategy", rank)
            strategy = "nonblocking"
        self.strategy = strategy
        self.segment_bytes = resolve_segment_bytes(segment_bytes, strategy)
        self.user_comm = comm
        self.comm = private_comm(comm, strategy, timeout)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        key = self.comm.py2f()
        engine = _ENGINES.get(key)
        if engine is None:
            engine = (_ThreadEngine if strategy == "thread" else _NonBlockingEngine)(self.comm)
            _ENGINES[key] = engine
        self._engine = engine

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, strategy={self.strategy!r}, "
                f"segment_bytes={self.segment_bytes})")

    def _segment(self, dtype: Any) -> int:
        """Elements per segment for ``dtype`` buffers (everything at once when 0)."""
        if self.segment_bytes == 0:
            # half precision still goes in bounded pieces: no full-size fp32 copy
            return (DEFAULT_SEGMENT_BYTES // 4) if dtype in HALF else (1 << 62)
        return max(1, self.segment_bytes // (4 if dtype in HALF else np.dtype(dtype).itemsize))

    def _start(self, steps: Steps, keep: Sequence[Any], name: str) -> CommTask:
        task = CommTask(keep=keep, name=name)
        task._rank = self.rank
        task._steps = steps
        task._engine = self._engine
        self._engine.submit(task)
        return task

    # -- reductions: SUM, then ``scale`` (1/n for an average) applied to the result only
    def allreduce(self, buf: Any, scale: Optional[float] = None,
                  name: str = "allreduce") -> CommTask:
        cuda.synchronize(buf)
        steps = _allreduce_steps(buf, scale, self._segment(buf.dtype), root=None, rank=self.rank)
        return self._start(steps, (buf,), name)

    def reduce(self, buf: Any, root: int, scale: Optional[float] = None,
               name: str = "reduce") -> CommTask:
        if (isinstance(root, bool) or not isinstance(root, (int, np.integer))
                or not 0 <= root < self.size):
            raise CommError(f"rank {self.rank}: {name}: root expected a rank in [0, {self.size}), "
                            f"got {root!r}")
        cuda.synchronize(buf)
        steps = _allreduce_steps(buf, scale, self._segment(buf.dtype), root=int(root),
                                 rank=self.rank)
        return self._start(steps, (buf,), name)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, scale: Optional[float] = None,
                       name: str = "reduce_scatter") -> CommTask:
        """Sum ``sendbuf`` over ranks; this rank's equal share lands in ``recvbuf`` (which may
        be that share of ``sendbuf`` itself)."""
        if sendbuf.size != recvbuf.size * self.size:
            raise CommError(f"rank {self.rank}: {name}: expected a send buffer of "
                            f"{recvbuf.size * self.size} elements, got {sendbuf.size}")
        if sendbuf.dtype != recvbuf.dtype:
            raise CommError(f"rank {self.rank}: {name}: expected the receive buffer in the send "
                            f"buffer's dtype {sendbuf.dtype}, got {recvbuf.dtype}")
        cuda.synchronize(sendbuf)
        steps = _reduce_scatter_steps(sendbuf, recvbuf, scale, self._segment(sendbuf.dtype),
                                      self.size, self.rank)
        return self._start(steps, (sendbuf, recvbuf), name)

    def allgather_inplace(self, buf: Any, name: str = "allgather") -> CommTask:
        """Every rank's equal share of ``buf`` (its own shard, in place) to every rank."""
        if buf.size % self.size:
            raise CommError(f"rank {self.rank}: {name}: expected a buffer that splits evenly "
                            f"over {self.size} ranks, got {buf.size} elements")
        cuda.synchronize(buf)
        return self._start(_allgather_steps(buf), (buf,), name)

    def poll(self) -> None:
        """Called on every add_grad: drives MPI progress (``nonblocking``) or retires tasks
        the communication thread finished (``thread``)."""
        if self._engine.tasks:
            self._engine.progress()

    def barrier(self) -> None:
        """A barrier ordered after every collective this communicator started."""
        self._start(_barrier_steps(), (), "barrier").wait()


# --------------------------------------------------------------------------- collectives
def _on_host(buf: Any) -> Tuple[Any, bool]:
    """(array MPI may read, staged?): device buffers go through pinned host memory when the
    MPI is not CUDA-aware."""
    if backend.is_cupy(buf) and not cuda.is_cuda_aware():
        return cuda.stage(buf), True
    return buf, False


def _scratch(n: int, like: Any) -> Any:
    return backend.empty(n, float32, like if backend.is_cupy(like) else None)


def _allreduce_steps(buf: Any, scale: Optional[float], seg: int, root: Optional[int],
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
            w[...] = part
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
                part[...] = w
    if staged and lands:
        cuda.unstage(flat, buf.reshape(-1))
    cuda.synchronize(buf)


def _reduce_scatter_steps(sendbuf: Any, recvbuf: Any, scale: Optional[float], seg: int,
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
        block[...] = grid[:, start:start + n]
        cuda.synchronize(block)  # a device packing kernel must finish before MPI reads it
        o = out[:n]
        yield ("Reduce_scatter_block", (_spec(block.reshape(-1)), _spec(o)), {"op": MPI.SUM})
        if scale is not None:
            backend.scale_(o, scale)
        recv[start:start + n] = o
    if staged:
        cuda.unstage(recv, recv_dev)
    cuda.synchronize(recvbuf)


def _allgather_steps(buf: Any) -> Steps:
    """In-place allgather of raw bytes: no arithmetic, so any dtype moves as it is."""
    flat, staged = _on_host(buf.reshape(-1))
    raw = flat.view(np.uint8)
    yield ("Allgather", (MPI.IN_PLACE, [raw, MPI.BYTE]), {})
    if staged:
        cuda.unstage(flat, buf.reshape(-1))
    cuda.synchronize(buf)


def _barrier_steps() -> Steps:
    yield ("Barrier", (), {})


def _overlaps(a: Any, b: Any) -> bool:
    a0, b0 = backend.data_ptr(a), backend.data_ptr(b)
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes
