"""Small collectives on the thread strategy run on the caller when nothing is in flight
(no thread wake-up), and give the same bits as the queued path."""
import numpy as np
import pytest

from mpifusion.comm.communicator import INLINE_MAX_BYTES, Communicator
from mpifusion.comm.engines import _DONE
from mpifusion.config import CommOptions

pytestmark = pytest.mark.mpi


def test_small_collectives_run_inline_in_order(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    c = Communicator(comm, CommOptions(strategy="thread"))
    small = np.full(INLINE_MAX_BYTES // 4, rank + 1.0, np.float32)
    task = c.allreduce(small, scale=1.0 / n)
    assert task._event is _DONE  # ran on the caller: already complete
    task.wait()
    assert (small == (n + 1) / 2).all()
    # a large collective in flight: the next small one queues behind it (start order kept)
    big = np.full(INLINE_MAX_BYTES, rank + 1.0, np.float32)
    first = c.allreduce(big)
    second = c.allreduce(small)
    second.wait()
    first.wait()
    assert (big == n * (n + 1) / 2).all() and (small == n * (n + 1) / 2).all()


def test_with_a_deadline_nothing_runs_inline(comm):
    c = Communicator(comm, CommOptions(strategy="thread", timeout=60))
    buf = np.ones(16, np.float32)
    task = c.allreduce(buf)
    assert task._event is not _DONE
    task.wait()
    assert (buf == comm.Get_size()).all()
