"""Small collectives on the thread strategy: a caller waiting for one the thread has not
picked up yet runs it itself (no thread wake-up); the thread still issues it when the caller
does not wait, start order is kept, and the bits are those of the queued path."""
import threading

import numpy as np
import pytest

from mpifusion.comm import tuning
from mpifusion.comm.communicator import Communicator
from mpifusion.config import CommOptions
from mpifusion.errors import CommTimeoutError

pytestmark = pytest.mark.mpi

INLINE_MAX_BYTES = tuning.current().inline_max_bytes


def _runners(c):
    """Record which thread runs each task of ``c``'s engine."""
    engine = c._engine
    seen = []
    execute = engine._execute

    def spy(task):
        seen.append((task.plan.name, threading.current_thread() is threading.main_thread()))
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


def _caller_polls(c):
    """Record the tasks a caller ran under its deadline (non-blocking calls, polled)."""
    engine = c._engine
    seen = []
    run_steps = engine._run_steps

    def spy(task, deadline):
        finished = run_steps(task, deadline)
        if deadline is not None:  # the caller's polled run, not the thread's
            seen.append((task.plan.name, finished))
        return finished

    engine._run_steps = spy
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [None, 60.0])
def test_fresh_engines_run_what_no_caller_waits_for(comm, timeout):
    """Two new communicators, a small collective on each, waited for in opposite orders on
    even and odd ranks: each rank's caller runs the one it waits for, so the other must be
    run by its comm thread -- also by a thread that never ran anything yet (it used to sleep
    until rung, and an inline start did not ring it: a deadlock)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    dups = [comm.Dup(), comm.Dup()]
    try:
        cs = [Communicator(d, CommOptions(strategy="thread", timeout=timeout)) for d in dups]
        bufs = [np.full(5, rank + 1.0 + i, np.float32) for i in range(2)]
        tasks = [c.allreduce(b) for c, b in zip(cs, bufs)]
        for i in ([0, 1] if rank % 2 == 0 else [1, 0]):
            tasks[i].wait()
        for i, b in enumerate(bufs):
            assert (b == n * (n + 1) / 2 + n * i).all()
    finally:
        for c in cs:
            c.close()
        for d in dups:
            d.Free()


def test_with_a_deadline_the_caller_runs_it_polling(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    c = Communicator(comm, CommOptions(strategy="thread", timeout=60))
    blocking, polled = _runners(c), _caller_polls(c)
    buf = np.full(16, rank + 1.0, np.float32)
    task = c.allreduce(buf, scale=1.0 / n, name="dl")
    assert task._op.plan.polled
    task.wait()
    assert (buf == (n + 1) / 2).all()
    assert polled == [("dl", True)] and blocking == []
    big = np.full(INLINE_MAX_BYTES, rank + 1.0, np.float32)  # above the limit: the thread's
    task = c.allreduce(big, name="big")
    assert not task._op.plan.polled
    task.wait()
    assert (big == n * (n + 1) / 2).all() and polled == [("dl", True)]


def test_a_deadline_missed_hands_the_rest_to_the_thread(comm):
    """Rank 0 runs a small collective itself and misses its deadline (the others start it
    later): it raises, the comm thread finishes the call left in flight and the rest of the
    task, a later wait() returns the right sum, and the stream stays aligned."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    c = Communicator(comm, CommOptions(strategy="thread", timeout=60))
    blocking, polled = _runners(c), _caller_polls(c)
    buf = np.full(1000, rank + 1.0, np.float32)
    comm.Barrier()
    if rank == 0:
        task = c.allreduce(buf, scale=1.0 / n, name="late")
        with pytest.raises(CommTimeoutError, match="late"):
            task.wait(timeout=0.3)
        assert polled == [("late", False)]
        comm.Barrier()  # only now do the others start it: the thread must finish it
        task.wait(timeout=60)
        assert ("late", False) in blocking  # finished on the comm thread
    else:
        comm.Barrier()
        c.allreduce(buf, scale=1.0 / n, name="late").wait()
    assert (buf == (n + 1) / 2).all()
    again = np.full(7, rank + 1.0, np.float32)
    c.allreduce(again, name="next").wait()
    assert (again == n * (n + 1) / 2).all()



@pytest.mark.timeout(120)
@pytest.mark.parametrize("timeout", [None, 60.0])
def test_shm_collectives_up_to_a_mebibyte_may_run_on_the_waiting_caller(comm, timeout):
    """shm: an all-reduce of up to SHM_INLINE_MAX_BYTES (above the thread strategy's 64 KiB)
    is left for a waiting caller to run, polled under a deadline; one above it goes to the
    comm thread; one that a rank starts and then leaves for a barrier that the others reach
    first is finished by its thread. Every result is the exact sum, on every rank."""
    SHM_INLINE_MAX_BYTES = tuning.current().shm_inline_max_bytes

    n, rank = comm.Get_size(), comm.Get_rank()
    c = Communicator(comm, CommOptions(strategy="shm", timeout=timeout))
    assert c.strategy == "shm", c.shm_fallback
    seen = _runners(c)
    mid, big = SHM_INLINE_MAX_BYTES // 4, SHM_INLINE_MAX_BYTES // 4 + 1024
    assert mid * 4 > INLINE_MAX_BYTES
    region = c.reserve([(big, np.float32)], np.empty(0, np.float32))[0]
    for name, count in (("mid", mid), ("big", big)):
        x = region[:count]
        x[...] = np.arange(count, dtype=np.float32) % 7 + rank
        task = c.allreduce(x, name=name)
        # by size and "deadline set", the same on every rank: a waiting caller polls it
        assert task._op.plan.polled == (timeout is not None and name == "mid"), name
        task.wait()
        want = (np.arange(count) % 7 * n + n * (n - 1) / 2).astype(np.float32)
        assert np.array_equal(x, want), name
    assert ("big", True) not in seen  # above the limit: always the comm thread
    x = region[:mid]
    x[...] = rank + 1.0
    if rank == 0:
        task = c.allreduce(x, name="left")
        comm.Barrier()
    else:
        comm.Barrier()
        task = c.allreduce(x, name="left")
    task.wait()
    assert (x == n * (n + 1) / 2).all()
