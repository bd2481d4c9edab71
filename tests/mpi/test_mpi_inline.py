"""Small collectives on the thread strategy: a caller waiting for one the thread has not
picked up yet runs it itself (no thread wake-up); the thread still issues it when the caller
does not wait, start order is kept, and the bits are those of the queued path."""
import threading

import numpy as np
import pytest

from mpifusion.comm.communicator import INLINE_MAX_BYTES, Communicator
from mpifusion.config import CommOptions

pytestmark = pytest.mark.mpi


def _runners(c):
    """Record which thread runs each task of ``c``'s engine."""
    engine = c._engine
    seen = []
    execute = engine._execute

    def spy(task):
        seen.append((task.name, threading.current_thread() is threading.main_thread()))
        execute(task)

    engine._execute = spy
    return seen


def test_small_collectives_in_start_order_on_either_thread(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    c = Communicator(comm, CommOptions(strategy="thread"))
    seen = _runners(c)
    small = np.full(INLINE_MAX_BYTES // 4, rank + 1.0, np.float32)
    c.allreduce(small, scale=1.0 / n, name="small").wait()
    assert (small == (n + 1) / 2).all()
    # a large collective in flight: the next small one queues behind it (start order kept)
    big = np.full(INLINE_MAX_BYTES, rank + 1.0, np.float32)
    first = c.allreduce(big, name="big")
    second = c.allreduce(small, name="small2")
    second.wait()
    first.wait()
    assert (big == n * (n + 1) / 2).all() and (small == n * (n + 1) / 2).all()
    assert [name for name, _ in seen] == ["small", "big", "small2"]
    assert not dict(seen)["big"]  # above the size limit: always the comm thread


def test_small_collective_progresses_without_a_waiting_caller(comm):
    """Rank 0 starts it, then waits in a barrier the others reach before they start it:
    only the comm thread can finish it (a collective run at start would deadlock)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    c = Communicator(comm, CommOptions(strategy="thread"))
    buf = np.full(100, rank + 1.0, np.float32)
    if rank == 0:
        task = c.allreduce(buf)
        comm.Barrier()
    else:
        comm.Barrier()
        task = c.allreduce(buf)
    task.wait()
    assert (buf == n * (n + 1) / 2).all()


def test_with_a_deadline_the_thread_runs_it(comm):
    c = Communicator(comm, CommOptions(strategy="thread", timeout=60))
    seen = _runners(c)
    buf = np.ones(16, np.float32)
    c.allreduce(buf, name="dl").wait()
    assert (buf == comm.Get_size()).all()
    assert seen == [("dl", False)]
