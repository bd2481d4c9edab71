"""Red-team cases for the communication engines: adversarial orders and timings against
float64 references (values are multiples of 1/8, so every sum is exact).

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests/mpi/test_mpi_engine_redteam.py``.
"""
import numpy as np
import pytest

from mpifusion.comm import Communicator, engines, release
from mpifusion.config import CommOptions

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def values(rank, numel, salt):
    rng = np.random.default_rng([salt, rank, numel])
    return (rng.integers(-64, 64, numel) / 8).astype(np.float32)


def total(numel, salt, size):
    return np.sum([values(r, numel, salt).astype(np.float64) for r in range(size)], axis=0)


def _unattended(user_comm, options):
    """A ``nonblocking`` Communicator whose engine has no progress thread, as below
    MPI_THREAD_MULTIPLE (where only the caller's calls move it)."""
    c = Communicator(user_comm, options, open=False)
    dup = engines.private_comm(user_comm, "nonblocking", options.timeout)
    engines._ENGINES[dup.py2f()] = engines._NonBlockingEngine(dup, "nonblocking",
                                                              progress_thread=False)
    c.open()
    assert c._engine.thread is None
    return c


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_unattended_engines_waited_in_opposite_orders(comm, timeout):
    """Without progress threads, two communicators' multi-segment all-reduces waited for in
    opposite orders on even and odd ranks. A wait moved only its own engine, so each rank sat
    on the segment its peer had not issued on the other communicator: a hang (a
    CommTimeoutError with a deadline) for a correct program."""
    n, rank = comm.Get_size(), comm.Get_rank()
    dups = [comm.Dup(), comm.Dup()]
    try:
        opts = CommOptions(strategy="nonblocking", window=1, segment_bytes=64, timeout=timeout)
        cs = [_unattended(d, opts) for d in dups]
        bufs = [values(rank, 1000, i) for i in range(2)]
        tasks = [c.allreduce(b) for c, b in zip(cs, bufs)]
        for i in ([0, 1] if rank % 2 == 0 else [1, 0]):
            tasks[i].wait(timeout=10.0)
        for i, b in enumerate(bufs):
            np.testing.assert_array_equal(b, total(1000, i, n).astype(np.float32))
    finally:
        for d in dups:
            release(d)
            d.Free()
