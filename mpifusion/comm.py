"""All of mpifusion's MPI traffic goes through here.

``CommTask`` is the one handle for in-flight collectives (Paddle's ``task``): it owns the MPI
requests *and* every array they touch, because mpi4py does not keep non-blocking buffers
alive. ``Communicator`` wraps a private duplicate of the user's communicator, so the
library's collectives never interleave with the user's own traffic on COMM_WORLD.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
from mpi4py import MPI

from . import backend
from .dtypes import HALF, float32
from .errors import CommError, CommTimeoutError


class CommTask:
    """An in-flight collective: ``wait()`` finishes it, ``is_completed()`` polls it.

    ``finish`` runs exactly once, after MPI is done (e.g. to land a result or undo widening);
    ``keep`` holds the arrays MPI reads or writes until then.
    """

    __slots__ = ("name", "_requests", "_keep", "_finish", "_done")

    def __init__(self, requests: Sequence[MPI.Request] = (), keep: Sequence[Any] = (),
                 finish: Optional[Callable[[], None]] = None, name: str = "") -> None:
        self.name = name
        self._requests = list(requests)
        self._keep = list(keep)
        self._finish = finish
        self._done = False

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
        if timeout is None:
            MPI.Request.Waitall(self._requests)
        else:
            deadline = time.monotonic() + timeout
            pause = 1e-5
            while not MPI.Request.Testall(self._requests):
                if time.monotonic() >= deadline:
                    raise CommTimeoutError(f"{self.name or 'collective'} did not complete "
                                           f"within {timeout:g} s")
                time.sleep(pause)
                pause = min(pause * 2, 1e-2)
        self._complete()

    def _complete(self) -> None:
        self._done = True
        finish, self._finish = self._finish, None
        self._requests = []
        if finish is not None:
            finish()
        self._keep = []

    def __repr__(self) -> str:
        return f"CommTask({self.name!r}, completed={self._done})"


_DUPS: dict = {}


def private_comm(comm: MPI.Comm) -> MPI.Comm:
    """A duplicate of ``comm`` made once per communicator (collective on first use)."""
    key = comm.py2f()
    dup = _DUPS.get(key)
    if dup is None:
        dup = comm.Dup()
        _DUPS[key] = dup
    return dup


_MPI_TYPES = {"float32": MPI.FLOAT, "float64": MPI.DOUBLE}


def _spec(arr: Any) -> list:
    """mpi4py buffer spec for a flat fp32/fp64 array (predefined types, so MPI_SUM applies)."""
    return [arr, _MPI_TYPES[arr.dtype.name]]


class Communicator:
    """The collectives a fused buffer needs, on a private communicator.

    Half-precision buffers are widened to fp32 for the reduction and rounded back once:
    MPI has no bfloat16 type, and summing in fp32 makes the result depend only on the order
    of additions MPI chose, with one final rounding (see README, "How exact").
    """

    def __init__(self, comm: MPI.Comm) -> None:
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm_group: expected an mpi4py communicator, got {type(comm).__name__}")
        self.user_comm = comm
        self.comm = private_comm(comm)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    # -- reductions: SUM, then ``scale`` (1/n for an average) applied to the result only
    def allreduce(self, buf: Any, scale: Optional[float] = None,
                  name: str = "allreduce") -> CommTask:
        work = _widen(buf)
        req = self.comm.Iallreduce(MPI.IN_PLACE, _spec(work), op=MPI.SUM)
        return CommTask([req], keep=(buf, work), finish=_landing(work, buf, scale), name=name)

    def reduce(self, buf: Any, root: int, scale: Optional[float] = None,
               name: str = "reduce") -> CommTask:
        work = _widen(buf)
        if self.rank == root:
            req = self.comm.Ireduce(MPI.IN_PLACE, _spec(work), op=MPI.SUM, root=root)
            finish = _landing(work, buf, scale)
        else:
            req = self.comm.Ireduce(_spec(work), None, op=MPI.SUM, root=root)
            finish = None
        return CommTask([req], keep=(buf, work), finish=finish, name=name)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, scale: Optional[float] = None,
                       name: str = "reduce_scatter") -> CommTask:
        """Sum ``sendbuf`` over ranks; this rank's equal share lands in ``recvbuf``."""
        if sendbuf.size != recvbuf.size * self.size:
            raise CommError(f"rank {self.rank}: reduce_scatter: expected a send buffer of "
                            f"{recvbuf.size * self.size} elements, got {sendbuf.size}")
        work_send = _widen(sendbuf)
        if work_send is not sendbuf:
            work_recv = backend.empty(recvbuf.size, float32, recvbuf)
        elif _overlaps(sendbuf, recvbuf):  # MPI forbids aliased buffers: land via a shard
            work_recv = backend.empty(recvbuf.size, recvbuf.dtype, recvbuf)
        else:
            work_recv = recvbuf
        req = self.comm.Ireduce_scatter_block(_spec(work_send), _spec(work_recv), op=MPI.SUM)
        return CommTask([req], keep=(sendbuf, recvbuf, work_send, work_recv),
                        finish=_landing(work_recv, recvbuf, scale), name=name)

    def allgather_inplace(self, buf: Any, name: str = "allgather") -> CommTask:
        """Every rank's equal share of ``buf`` (its own shard, in place) to every rank."""
        raw = buf.view(np.uint8)  # no arithmetic: move bytes, whatever the dtype
        req = self.comm.Iallgather(MPI.IN_PLACE, [raw, MPI.BYTE])
        return CommTask([req], keep=(buf, raw), name=name)

    def poll(self) -> None:
        """Called on every add_grad: a hook for driving MPI progress while grads arrive.
        Nothing to do for the plain non-blocking path."""

    def barrier(self) -> None:
        self.comm.Barrier()


def _overlaps(a: Any, b: Any) -> bool:
    a0, b0 = backend.data_ptr(a), backend.data_ptr(b)
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def _widen(buf: Any) -> Any:
    return buf.astype(float32) if buf.dtype in HALF else buf


def _landing(work: Any, dest: Any, scale: Optional[float]) -> Optional[Callable[[], None]]:
    """What to do once MPI is done: scale the (still wide) result, then round it into dest."""
    if work is dest and scale is None:
        return None

    def finish() -> None:
        if scale is not None:
            backend.scale_(work, scale)
        if work is not dest:
            dest[...] = work

    return finish
