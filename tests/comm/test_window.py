"""Pipelined collectives (``nonblocking`` with a window, ``thread``) against float64 numpy
references computed here, at awkward sizes: a buffer smaller than one segment, segments that
do not divide it, a window larger than the number of segments, window 1. Also the GPU
staging pipeline (allreduce, reduce-scatter, allgather) driven by the real engine and MPI
through a fake device.

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests/comm/test_window.py``.
"""
import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion.comm import Communicator
from mpifusion.comm import order as order_mod
from mpifusion.comm.collectives import allgather_steps, allreduce_steps, reduce_scatter_steps
from mpifusion.config import CommOptions
from mpifusion.dtypes import bfloat16, float16, float32

from tests.reference import exact_values

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

WAYS = [("thread", 1), ("nonblocking", 1), ("nonblocking", 2), ("nonblocking", 3),
        ("nonblocking", 8)]
DTYPES = [float32, np.float64, float16, bfloat16]
SEGMENT = 64  # bytes: 16 fp32 / 8 fp64 elements per segment (half: widened to fp32)
SIZES = [1, 7, 100, 1001]  # below one segment, one, many not dividing, many


def values(rank, numel, dtype):
    """Multiples of 1/8 in [-8, 8): exact in every dtype, sums over <= 8 ranks exact in
    fp32 (so only the final scale and rounding differ from the float64 reference)."""
    return exact_values(numel, dtype, rank, numel)


def expected(numel, dtype, size, scale):
    total = np.sum([values(r, numel, dtype).astype(np.float64) for r in range(size)], axis=0)
    if np.dtype(dtype) == np.float64:
        return total * scale
    # summed exactly, scaled in fp32, rounded once to the buffer's dtype
    return (total.astype(np.float32) * np.float32(scale)).astype(dtype)


def _comm(strategy, window):
    if strategy == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("thread strategy needs MPI_THREAD_MULTIPLE")
    return Communicator(MPI.COMM_WORLD, CommOptions(strategy=strategy, window=window,
                                                    segment_bytes=SEGMENT))


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("strategy,window", WAYS)
def test_allreduce_and_reduce(strategy, window, dtype):
    comm = _comm(strategy, window)
    rank, size = comm.rank, comm.size
    scale = 1.0 / size
    dst = size - 1  # a non-zero root wherever there are two ranks
    for numel in SIZES:
        buf = values(rank, numel, dtype)
        comm.allreduce(buf, scale=scale).wait(timeout=60)
        np.testing.assert_array_equal(buf, expected(numel, dtype, size, scale),
                                      err_msg=f"allreduce of {numel}")
        buf = values(rank, numel, dtype)
        comm.reduce(buf, root=dst, scale=scale).wait(timeout=60)
        want = expected(numel, dtype, size, scale) if rank == dst else values(rank, numel, dtype)
        np.testing.assert_array_equal(buf, want, err_msg=f"reduce of {numel} to {dst}")
    comm.barrier()
    assert repr(comm).endswith(f"window={window})")


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("strategy,window", WAYS)
def test_reduce_scatter(strategy, window, dtype):
    comm = _comm(strategy, window)
    rank, size = comm.rank, comm.size
    for shard in (1, 5, 37):  # pieces of SEGMENT // size elements: not dividing the shard
        numel = shard * size
        send = values(rank, numel, dtype)
        recv = np.empty(shard, dtype)
        comm.reduce_scatter(send, recv, scale=0.5).wait(timeout=60)
        want = expected(numel, dtype, size, 0.5)[rank * shard:(rank + 1) * shard]
        np.testing.assert_array_equal(recv, want, err_msg=f"shard of {shard}")
        send = values(rank, numel, dtype)  # in place: the shard is this rank's part of send
        comm.reduce_scatter(send, send[rank * shard:(rank + 1) * shard]).wait(timeout=60)
        want = expected(numel, dtype, size, 1.0)[rank * shard:(rank + 1) * shard]
        np.testing.assert_array_equal(send[rank * shard:(rank + 1) * shard], want)
    comm.barrier()


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", [float32, bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("strategy,window", WAYS)
def test_staging_pipeline_through_the_engine(strategy, window, dtype):
    """allreduce_steps with a (fake) staging device, run by the real engine and MPI."""
    from tests.comm.test_pipeline import FakeDevice

    comm = _comm(strategy, window)
    rank, size = comm.rank, comm.size
    for lazy in (True, False):
        for numel in (7, 1001):
            buf = values(rank, numel, dtype)
            steps = allreduce_steps(buf, 1.0 / size, 16, None, rank, window=window,
                                    device=FakeDevice(lazy))
            task = comm._start(lambda seq: steps, (buf,), "staged allreduce",
                               (order_mod.ALLREDUCE, numel, order_mod.dtype_code(buf.dtype), -1,
                                -1, -1))
            task.wait(timeout=60)
            np.testing.assert_array_equal(buf, expected(numel, dtype, size, 1.0 / size))
    comm.barrier()


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("strategy,window", WAYS)
def test_staged_reduce_scatter_through_the_engine(strategy, window, dtype):
    """reduce_scatter_steps with a (fake) staging device -- rounds packed and widened on the
    device, Reduce_scatter_block on host slots -- run by the real engine and MPI, into a
    separate shard and in place."""
    from tests.comm.test_pipeline import FakeDevice

    comm = _comm(strategy, window)
    rank, size = comm.rank, comm.size
    for lazy in (True, False):
        for shard in (1, 5, 37):  # pieces of 16 // size elements: not dividing the shard
            for inplace in (False, True):
                numel = shard * size
                send = values(rank, numel, dtype)
                recv = send[rank * shard:(rank + 1) * shard] if inplace else np.empty(shard, dtype)
                steps = reduce_scatter_steps(send, recv, 0.5, 16, size, rank, window=window,
                                             device=FakeDevice(lazy))
                task = comm._start(lambda seq: steps, (send, recv), "staged reduce_scatter",
                                   (order_mod.REDUCE_SCATTER, numel,
                                    order_mod.dtype_code(send.dtype), -1, -1, -1))
                task.wait(timeout=60)
                want = expected(numel, dtype, size, 0.5)[rank * shard:(rank + 1) * shard]
                np.testing.assert_array_equal(recv, want, err_msg=f"shard of {shard}, "
                                              f"lazy={lazy}, in place={inplace}")
    comm.barrier()


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("strategy,window", WAYS)
def test_allgather_staged_and_whole(strategy, window, dtype):
    """In-place allgather: through a (fake) staging device in rounds (one Allgather per
    round, pipelined) and whole through the communicator; raw bytes, NaN and -0 included."""
    from tests.comm.test_pipeline import FakeDevice

    comm = _comm(strategy, window)
    rank, size = comm.rank, comm.size
    for shard in (1, 5, 37):
        numel = shard * size
        want = np.concatenate([values(r, shard, dtype) for r in range(size)])
        want[0], want[-1] = np.nan, -0.0
        for how in ("lazy", "eager", "whole"):
            buf = np.full(numel, 99, dtype)  # only this rank's shard is current
            buf[rank * shard:(rank + 1) * shard] = want[rank * shard:(rank + 1) * shard]
            if how == "whole":
                task = comm.allgather_inplace(buf)
            else:
                steps = allgather_steps(buf, 16, size, rank, window=window,
                                        device=FakeDevice(how == "lazy"))
                task = comm._start(lambda seq: steps, (buf,), "staged allgather",
                                   (order_mod.ALLGATHER, numel, order_mod.dtype_code(buf.dtype),
                                    -1, -1, -1))
            task.wait(timeout=60)
            assert buf.tobytes() == want.tobytes(), f"{how} allgather of {shard} per rank"
    comm.barrier()


def test_window_disagreement_is_refused():
    """Ranks built with different windows would pipeline differently: the agreement check
    names the window."""
    world = MPI.COMM_WORLD
    if world.Get_size() < 2:
        pytest.skip("needs two ranks")
    from mpifusion.errors import AgreementError

    with pytest.raises(AgreementError, match="window"):
        Communicator(world, CommOptions(strategy="nonblocking", segment_bytes=SEGMENT,
                                        window=2 if world.Get_rank() == 0 else 3, timeout=30))


RING_SIZES = [16385, 40000]  # just over the 64 KiB below which the library's call is kept


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("strategy,window", [("thread", 1), ("nonblocking", 1),
                                             ("nonblocking", 2), ("nonblocking", 8)])
def test_ring_allreduce_against_float64(strategy, window, dtype):
    """allreduce='ring' through the real engines and MPI: the float64 reference (exact on
    these values, then one scaling and rounding), and the same bits on every rank."""
    if strategy == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("thread strategy needs MPI_THREAD_MULTIPLE")
    try:
        comm = Communicator(MPI.COMM_WORLD, CommOptions(strategy=strategy, window=window,
                                                        segment_bytes=8192, allreduce="ring"))
    except Exception as exc:  # an MPI without Isendrecv refuses ring + nonblocking
        assert "Isendrecv" in str(exc)
        pytest.skip(str(exc))
    assert comm.allreduce_way == "ring"
    rank, size = comm.rank, comm.size
    for numel in RING_SIZES:
        buf = values(rank, numel, dtype)
        comm.allreduce(buf, scale=1.0 / size).wait(timeout=60)
        np.testing.assert_array_equal(buf, expected(numel, dtype, size, 1.0 / size),
                                      err_msg=f"rank {rank}, {numel} elements")
        digests = MPI.COMM_WORLD.allgather(hashlib.sha1(buf.tobytes()).hexdigest())
        assert len(set(digests)) == 1, f"ranks hold different bits: {digests}"


def test_allreduce_auto_picks_ring_for_nonblocking_on_open_mpi_only():
    from mpifusion.comm.communicator import allreduce_way, has_isendrecv

    open_mpi = MPI.get_vendor()[0] == "Open MPI"
    assert allreduce_way("auto", "thread") == "mpi"
    assert allreduce_way("auto", "nonblocking") == (
        "ring" if open_mpi and has_isendrecv() else "mpi")
    assert allreduce_way("mpi", "nonblocking") == "mpi"
    assert allreduce_way("ring", "thread") == "ring"


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_shm_collectives_in_arena_regions(dtype):
    """``shm``: arrays in the node's shared arena (``Communicator.reserve``: regions of
    chunks mapped by every rank, at offsets that differ between ranks once one rank keeps a
    region alive) reduce in place, against the float64 reference, at the awkward sizes."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("shm strategy needs MPI_THREAD_MULTIPLE")
    comm = Communicator(MPI.COMM_WORLD, CommOptions(strategy="shm", segment_bytes=SEGMENT))
    if comm.strategy != "shm":
        pytest.skip(f"shm unavailable here: {comm.shm_fallback}")
    rank, size = comm.rank, comm.size
    skew = comm.reserve([(777, np.float64)], np.empty(0))  # rank 0 only keeps it
    if rank != 0:
        del skew
    for numel in SIZES:
        (buf,) = comm.reserve([(numel, dtype)], np.empty(0))
        assert comm.in_shared_window(buf)
        buf[...] = values(rank, numel, dtype)
        comm.allreduce(buf, scale=1.0 / size).wait(timeout=60)
        np.testing.assert_array_equal(buf, expected(numel, dtype, size, 1.0 / size),
                                      err_msg=f"allreduce of {numel}")
    for shard in (1, 5, 37):
        numel = shard * size
        send, recv = comm.reserve([(numel, dtype), (shard, dtype)], np.empty(0))
        send[...] = values(rank, numel, dtype)
        comm.reduce_scatter(send, recv, scale=0.5).wait(timeout=60)
        want = expected(numel, dtype, size, 0.5)[rank * shard:(rank + 1) * shard]
        np.testing.assert_array_equal(recv, want, err_msg=f"shard of {shard}")
        (buf,) = comm.reserve([(numel, dtype)], np.empty(0))
        full = np.concatenate([values(r, shard, dtype) for r in range(size)])
        buf[rank * shard:(rank + 1) * shard] = full[rank * shard:(rank + 1) * shard]
        comm.allgather_inplace(buf).wait(timeout=60)
        assert buf.tobytes() == full.tobytes(), f"allgather of {shard} per rank"
    comm.barrier()
