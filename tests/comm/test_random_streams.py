"""Random streams of collectives through the real engines and MPI, bit-exact against float64.

Each trial draws (the same on every rank, from its seed) the options -- strategy, window,
segment size, all-reduce way, deadline or none -- and one to five collectives of any kind,
dtype and awkward size, started back to back (with rank-skewed pauses between the starts)
and waited for in an order of each rank's own. The values are multiples of 1/8, so every sum
is exact and the expected bits are known: a scratch slot reused too early, a segment landed
twice or in the wrong place, a shard taken from the wrong rank, a scale applied twice or to
the wrong piece all show up as wrong bits. (With the engine no longer keeping a call's arrays
alive until it landed -- the bug found under Open MPI -- this fails at 2, 3 and 4 ranks there;
MPICH reuses the freed memory less eagerly and passed.)

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests/comm/test_random_streams.py``.
"""
import random
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion.comm import Communicator
from mpifusion.config import CommOptions
from mpifusion.dtypes import bfloat16, float16, float32
from mpifusion.errors import OptionError

from tests.reference import exact_values

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

DTYPES = [float32, np.float64, float16, bfloat16]
SIZES = [1, 2, 3, 7, 13, 100, 1001, 4099, 33333]
SEGMENTS = [None, 64, 200, 4096, 65536]
TRIALS = 100
_COMMS = {}


def values(rank, numel, dtype, salt):
    return exact_values(numel, dtype, salt, rank, numel)


def scaled(x, dtype, scale):
    """Exact sums (or own values) scaled as mpifusion scales: in fp32 for fp32 and half
    precision (rounded once to the dtype), in fp64 for fp64."""
    if scale is None:
        return x.astype(dtype)
    if np.dtype(dtype) == np.float64:
        return x.astype(np.float64) * scale
    return (x.astype(np.float32) * np.float32(scale)).astype(dtype)


def total(numel, dtype, salt, size):
    return np.sum([values(r, numel, dtype, salt).astype(np.float64) for r in range(size)], axis=0)


def _communicator(key):
    strategy, window, segment, way, timeout = key
    if key not in _COMMS:
        _COMMS[key] = Communicator(MPI.COMM_WORLD, CommOptions(
            strategy=strategy, window=window, segment_bytes=segment, allreduce=way,
            timeout=timeout))
    return _COMMS[key]


def _start(c, R, salt, rank, size):
    """One random collective: (task, [(got, want, what)])."""
    kind = R.choice(["allreduce", "reduce", "reduce_scatter", "allgather"])
    dtype, numel, scale = R.choice(DTYPES), R.choice(SIZES), R.choice([None, 1.0 / size])
    if kind in ("reduce_scatter", "allgather"):
        numel = max(1, numel // size) * size
    what = f"{kind} of {numel} {np.dtype(dtype).name}, scale {scale}"
    mine = values(rank, numel, dtype, salt)
    if kind == "allreduce":
        buf = mine.copy()
        return c.allreduce(buf, scale=scale), [(buf, scaled(total(numel, dtype, salt, size),
                                                             dtype, scale), what)]
    if kind == "reduce":
        root, sent = R.randrange(size), R.choice([None, 1.0 / size])
        buf = mine.copy()
        want = (scaled(total(numel, dtype, salt, size), dtype, scale) if rank == root
                else scaled(mine, dtype, sent))
        return (c.reduce(buf, root=root, scale=scale, sent_scale=sent),
                [(buf, want, f"{what} to {root}, sent_scale {sent}")])
    shard = numel // size
    lo, hi = rank * shard, (rank + 1) * shard
    if kind == "reduce_scatter":
        others, in_place = R.choice([None, 1.0 / size]), R.random() < 0.5
        send = mine.copy()
        recv = send[lo:hi] if in_place else np.empty(shard, dtype)
        task = c.reduce_scatter(send, recv, scale=scale, others_scale=others)
        rest = np.ones(numel, bool)
        rest[lo:hi] = False
        what += f", others_scale {others}, in place {in_place}"
        return task, [(recv, scaled(total(numel, dtype, salt, size), dtype, scale)[lo:hi], what),
                      (send, scaled(mine, dtype, others), what + " (other shards)", rest)]
    every = np.concatenate([values(r, numel, dtype, salt)[r * shard:(r + 1) * shard]
                            for r in range(size)])
    buf = np.zeros(numel, dtype)
    buf[lo:hi] = every[lo:hi]
    return c.allgather_inplace(buf), [(buf, every, what)]


@pytest.mark.parametrize("trial", range(TRIALS))
def test_random_stream_is_bit_exact(trial):
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    R = random.Random(7919 * trial + size)  # the same draws on every rank
    key = (R.choice(["thread", "nonblocking"]), R.choice([1, 2, 3, 8]), R.choice(SEGMENTS),
           R.choice(["auto", "mpi", "ring"]), R.choice([None, 60.0]))
    if key[0] == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("thread strategy needs MPI_THREAD_MULTIPLE")
    try:
        c = _communicator(key)
    except OptionError as exc:  # ring without MPI_Isendrecv: refused, on every rank alike
        pytest.skip(str(exc))
    started = []
    for j in range(R.randint(1, 5)):
        if R.random() < 0.3:
            time.sleep(R.random() * 2e-3 * (rank + 1) / size)  # ranks start at skewed times
        started.append(_start(c, R, 100 * trial + j, rank, size))
    order = list(range(len(started)))
    random.Random(1000 * trial + rank).shuffle(order)  # each rank waits in its own order
    wrong = []
    for i in order:
        task, checks = started[i]
        task.wait(timeout=120)
        for got, want, what, *mask in checks:
            if mask:
                got, want = got[mask[0]], want[mask[0]]
            if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                bad = np.flatnonzero(got != want)
                wrong.append(f"rank {rank}: {what} with {key}: {bad.size} elements wrong, "
                             f"first at {bad[:3]}: {got[bad[:3]]} for {want[bad[:3]]}")
    assert not wrong, "\n".join(wrong)
