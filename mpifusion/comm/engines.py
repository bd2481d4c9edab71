"""Engines: who issues a communicator's MPI calls, and in which order.

One engine per private communicator runs the tasks started on it in start order, on every
rank: a task issues its next call only after every earlier task issued all of its calls.
``thread`` runs them as blocking calls on a daemon thread; ``nonblocking`` issues the
non-blocking forms from the caller and progresses them whenever MPI is called.
"""
from __future__ import annotations

import atexit
import collections
import queue
import sys
import threading
import time
from typing import Deque, Dict, Optional

from mpi4py import MPI

from ..errors import CommTimeoutError
from .task import CommTask


class _Engine:
    """Runs the tasks of one private communicator, in the order they were started."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.tasks: Deque[CommTask] = collections.deque()
        self.timed_out = False  # a wait missed its deadline: exit does not wait for us

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


#: the event of a task that ran inline: already set (making an Event costs a few us)
_DONE = threading.Event()
_DONE.set()


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

    def submit(self, task: CommTask, inline: bool = False) -> None:
        """Queue ``task`` for the thread; with ``inline`` (a small collective, no deadline),
        run it at once on the caller when nothing is in flight: waking the thread costs
        70-150 us, more than a 4-64 KiB collective itself, and with an idle queue the calls
        are issued in the same order either way."""
        if inline:
            self.progress()
            if not self.tasks:
                try:
                    for name, args, kwargs in task._steps:
                        getattr(self.comm, name)(*args, **kwargs)
                except Exception as exc:  # reported to the caller by wait(), as on the thread
                    task._error = exc
                task._event = _DONE
                return
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
    if getattr(sys, "last_value", None) is not None:
        return  # exiting on an error: waiting only delays the abort
    for engine in list(_ENGINES.values()):
        if engine.timed_out:
            continue  # after a missed deadline, waiting only delays the abort
        if isinstance(engine, _ThreadEngine):
            engine.stop(timeout=30.0)
        else:
            engine.drain(timeout=30.0)
    _ENGINES.clear()

