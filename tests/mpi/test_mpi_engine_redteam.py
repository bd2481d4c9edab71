"""Red-team cases for the communication engines: adversarial orders and timings against
float64 references (values are multiples of 1/8, so every sum is exact).

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests/mpi/test_mpi_engine_redteam.py``.
"""
import numpy as np
import pytest

from mpifusion.comm import Communicator, engines, release
from mpifusion.config import CommOptions
from mpifusion.errors import OrderError

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


@pytest.mark.parametrize("unattended", [False, True])
@pytest.mark.parametrize("trial", range(6))
def test_streams_interleaved_per_rank(comm, trial, unattended):
    """Guard: four streams on two communicators (strict and negotiated, with and without a
    deadline, windows 1-8, 64-byte to whole-buffer segments, sizes around the 64 KiB inline
    limit), interleaved in an order of each rank's own (each Communicator's own collectives in
    one order), with is_completed() polls, waited for in each rank's own order."""
    import random
    import time

    n, rank = comm.Get_size(), comm.Get_rank()
    R, me = random.Random(trial), random.Random(1000 * trial + rank)
    dups = [comm.Dup(), comm.Dup()]
    try:
        streams = []
        for k, (d, order) in enumerate([(dups[0], "strict"), (dups[0], "negotiated"),
                                        (dups[1], "strict"), (dups[1], "negotiated")]):
            strategy = "nonblocking" if unattended else R.choice(["thread", "nonblocking"])
            opts = CommOptions(strategy=strategy, order=order, window=R.randint(1, 8),
                               segment_bytes=R.choice([64, 4096, 0]),
                               timeout=R.choice([None, 60.0]))
            if unattended and k % 2 == 0:
                streams.append(_unattended(d, opts))
            elif unattended:  # the negotiated stream of the same dup, also thread-less
                c = Communicator(d, opts, open=False)
                dup = engines.private_comm(d, "nonblocking/negotiated", opts.timeout)
                engines._ENGINES[dup.py2f()] = engines._NonBlockingEngine(
                    dup, "nonblocking/negotiated", progress_thread=False)
                c.open()
                streams.append(c)
            else:
                streams.append(Communicator(d, opts))
        ops = [(k, j, R.choice([7, 16383, 16384, 16385, 40000])) for k in range(4)
               for j in range(R.randint(1, 3))]
        mine = list(ops)
        me.shuffle(mine)
        for k in range(4):  # one Communicator's collectives start in the same order everywhere
            where = [i for i, op in enumerate(mine) if op[0] == k]
            for i, op in zip(where, [op for op in ops if op[0] == k]):
                mine[i] = op
        started = []
        for k, j, numel in mine:
            buf = values(rank, numel, 10 * k + j)
            started.append((streams[k].allreduce(buf, scale=0.5), buf, numel, 10 * k + j))
            if me.random() < 0.3:
                time.sleep(me.random() * 0.005)
            elif me.random() < 0.3:
                started[-1][0].is_completed()
        me.shuffle(started)
        for task, buf, numel, salt in started:
            task.wait(timeout=60)
            want = (total(numel, salt, n).astype(np.float32) * np.float32(0.5))
            np.testing.assert_array_equal(buf, want, err_msg=f"stream {salt // 10} #{salt % 10}")
    finally:
        for d in dups:
            release(d)
            d.Free()


@pytest.mark.parametrize("strategy", ["thread", "nonblocking"])
def test_negotiated_collectives_of_one_communicator_that_differ_are_an_order_error(comm,
                                                                               strategy):
    """order='negotiated' pairs the collectives of one Communicator (one slot) in the order
    each rank started them: two all-reduces of 100 floats (buffers 0 and 1) started in
    opposite orders on even and odd ranks were summed against each other, silently (wrong
    sums, no error; different sizes aborted in MPI with 'Message truncated'). The strict
    order's check now runs before each negotiated collective too: OrderError on every rank,
    nothing exchanged, and the stream goes on."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    dup = comm.Dup()
    try:
        c = Communicator(dup, CommOptions(strategy=strategy, order="negotiated", timeout=60.0))
        bufs = [values(rank, 100, 1), values(rank, 100, 2)]
        order = [0, 1] if rank % 2 == 0 else [1, 0]
        tasks = [c.allreduce(bufs[i], tag=(i, 0)) for i in order]
        for task in tasks:
            with pytest.raises(OrderError, match="ranks started different collectives"):
                task.wait()
        for i in (0, 1):  # nothing exchanged
            np.testing.assert_array_equal(bufs[i], values(rank, 100, i + 1))
        c.allreduce(bufs[0], tag=(0, 1)).wait()
        np.testing.assert_array_equal(bufs[0], total(100, 1, n).astype(np.float32))
    finally:
        release(dup)
        dup.Free()


@pytest.mark.parametrize("strategy", ["thread", "nonblocking"])
@pytest.mark.parametrize("numel", [4, 1000, 40000])
def test_verified_and_unverified_communicators_do_not_share_a_stream(comm, strategy, numel):
    """A Communicator with verify_order=False next to a verified one on the same comm and
    strategy shared its stream: where ranks started them in different orders, one rank's
    order check met the other's data call (an all-reduce of 16 bytes of fingerprints against
    the grads). Each setting now has its own stream, so the verified one keeps its check
    and the two run independently."""
    n, rank = comm.Get_size(), comm.Get_rank()
    user = comm.Dup()
    try:
        verified = Communicator(user, CommOptions(strategy=strategy, timeout=30.0))
        plain = Communicator(user, CommOptions(strategy=strategy, timeout=30.0,
                                               verify_order=False))
        a, b = values(rank, numel, 1), values(rank, numel, 2)
        if rank % 2 == 0:
            tasks = [verified.allreduce(a), plain.allreduce(b)]
        else:
            tasks = [plain.allreduce(b), verified.allreduce(a)]
        for t in tasks:
            t.wait()
        np.testing.assert_array_equal(a, total(numel, 1, n).astype(np.float32))
        np.testing.assert_array_equal(b, total(numel, 2, n).astype(np.float32))
    finally:
        release(user)
        user.Free()
