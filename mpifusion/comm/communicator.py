"""``Communicator``: the collectives a fused buffer needs, on a private communicator.

How a buffer is handed to MPI changes the time of a sync by up to 8x (see BENCHMARKS.md), so
the way collectives run is a *strategy* (``CommOptions.strategy``):

``thread`` (default)
    A daemon thread per communicator runs blocking collectives in segments of
    ``segment_bytes`` (blocking calls take MPI's fastest algorithms; segments stay in cache,
    so the ``1/n`` scaling and half-precision rounding of each segment are cheap). It
    progresses on its own while the caller keeps calling ``add_grad`` or computing. Needs
    ``MPI_THREAD_MULTIPLE`` (mpi4py's default level).
``nonblocking``
    The plain way: ``Iallreduce``/``Ireduce``/... issued from the calling thread; progress
    happens whenever ``poll()`` (every ``add_grad``), ``is_completed()`` or ``wait()`` calls
    into MPI.

Every collective is written once, as a generator of MPI calls (``collectives.py``); a
strategy only decides whether each call is blocking (on the thread) or non-blocking.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..arrays import cuda
from ..config import CommOptions, DEFAULT_SEGMENT_BYTES
from ..dtypes import HALF
from ..errors import OptionError
from .collectives import (allgather_steps, allreduce_steps, barrier_steps,
                          reduce_scatter_steps)
from .engines import _ENGINES, _NonBlockingEngine, _ThreadEngine, private_comm
from .task import CommTask, Steps

logger = logging.getLogger("mpifusion")

#: ``thread`` strategy: collectives of buffers up to this size run on the caller when nothing
#: else is in flight on the communicator (measured: BENCHMARKS.md, small messages)
INLINE_MAX_BYTES = 64 << 10


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

    def __init__(self, comm: MPI.Comm, options: Optional[CommOptions] = None,
                 **overrides: Any) -> None:
        """``options`` (default: :meth:`CommOptions.from_env`); keyword ``overrides``
        (``strategy``, ``segment_bytes``, ``timeout``) replace single fields."""
        if not isinstance(comm, MPI.Comm):
            raise OptionError(f"comm_group: expected an mpi4py communicator, "
                              f"got {type(comm).__name__}")
        if options is None:
            options = CommOptions.from_env(**overrides)
        elif overrides:
            options = options.with_(**overrides)
        if options.strategy == "auto":
            threads = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
            options = options.with_(strategy="thread" if threads else "nonblocking")
            if not threads:
                logger.info("rank %d: MPI is not at MPI_THREAD_MULTIPLE; using the "
                            "'nonblocking' strategy", comm.Get_rank())
        if options.strategy == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise OptionError(f"rank {comm.Get_rank()}: strategy 'thread': expected MPI "
                              f"initialised at MPI_THREAD_MULTIPLE, got level "
                              f"{MPI.Query_thread()} (set mpi4py.rc.thread_level = 'multiple' "
                              f"before importing MPI, or use strategy='nonblocking')")
        self.options = options
        self.strategy = options.strategy
        self.segment_bytes = options.segment
        self.timeout = options.timeout
        self.user_comm = comm
        self.comm = private_comm(comm, self.strategy, self.timeout)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        key = self.comm.py2f()
        engine = _ENGINES.get(key)
        if engine is None:
            engine = (_ThreadEngine if self.strategy == "thread" else _NonBlockingEngine)(self.comm)
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
        task = CommTask(steps, self._engine, keep=keep, name=name, rank=self.rank)
        if (self.timeout is None and isinstance(self._engine, _ThreadEngine)
                and sum(getattr(a, "nbytes", 0) for a in keep) <= INLINE_MAX_BYTES):
            self._engine.submit(task, inline=True)  # without a deadline only: it blocks
        else:
            self._engine.submit(task)
        return task

    # -- reductions: SUM, then ``scale`` (1/n for an average) applied to the result only
    def allreduce(self, buf: Any, scale: Optional[float] = None,
                  name: str = "allreduce") -> CommTask:
        cuda.synchronize(buf)
        steps = allreduce_steps(buf, scale, self._segment(buf.dtype), root=None, rank=self.rank)
        return self._start(steps, (buf,), name)

    def reduce(self, buf: Any, root: int, scale: Optional[float] = None,
               name: str = "reduce") -> CommTask:
        if (isinstance(root, bool) or not isinstance(root, (int, np.integer))
                or not 0 <= root < self.size):
            raise OptionError(f"rank {self.rank}: {name}: root expected a rank in [0, {self.size}), "
                            f"got {root!r}")
        cuda.synchronize(buf)
        steps = allreduce_steps(buf, scale, self._segment(buf.dtype), root=int(root),
                                 rank=self.rank)
        return self._start(steps, (buf,), name)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, scale: Optional[float] = None,
                       name: str = "reduce_scatter") -> CommTask:
        """Sum ``sendbuf`` over ranks; this rank's equal share lands in ``recvbuf`` (which may
        be that share of ``sendbuf`` itself)."""
        if sendbuf.size != recvbuf.size * self.size:
            raise OptionError(f"rank {self.rank}: {name}: expected a send buffer of "
                            f"{recvbuf.size * self.size} elements, got {sendbuf.size}")
        if sendbuf.dtype != recvbuf.dtype:
            raise OptionError(f"rank {self.rank}: {name}: expected the receive buffer in the send "
                            f"buffer's dtype {sendbuf.dtype}, got {recvbuf.dtype}")
        cuda.synchronize(sendbuf)
        steps = reduce_scatter_steps(sendbuf, recvbuf, scale, self._segment(sendbuf.dtype),
                                      self.size, self.rank)
        return self._start(steps, (sendbuf, recvbuf), name)

    def allgather_inplace(self, buf: Any, name: str = "allgather") -> CommTask:
        """Every rank's equal share of ``buf`` (its own shard, in place) to every rank."""
        if buf.size % self.size:
            raise OptionError(f"rank {self.rank}: {name}: expected a buffer that splits evenly "
                            f"over {self.size} ranks, got {buf.size} elements")
        cuda.synchronize(buf)
        return self._start(allgather_steps(buf), (buf,), name)

    def poll(self) -> None:
        """Called on every add_grad: drives MPI progress (``nonblocking``) or retires tasks
        the communication thread finished (``thread``)."""
        if self._engine.tasks:
            self._engine.progress()

    def barrier(self) -> None:
        """A barrier ordered after every collective this communicator started."""
        self._start(barrier_steps(), (), "barrier").wait()

