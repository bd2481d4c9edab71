"""The ``shm`` strategy: buffers in MPI-3 shared windows, reduced by loads and stores.

Under mpiexec (1, 2, 3, 4, 8 ranks) every action of real FusedCommBuffers against float64
references computed here, bit for bit (the inputs are multiples of 1/8, so every sum is exact
and only the final 1/n and rounding happen, as the reference does them), the same bytes on
every rank, grads that land in the window, arrays outside the windows (staged through the
scratch, also mixed with window arrays across ranks), two buffers interleaved, the negotiated
order, a deadline naming the late rank, the rows' own order check, the agreed fallback, and the
release rule for windows. Serially: the option, the environment and the thread level.

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests/comm/test_shm_strategy.py``.
"""
import gc
import hashlib
import logging
import os
import re
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import FusedCommBuffer, HookAction, Param
from mpifusion.comm import Communicator, release
from mpifusion.arrays import halfcast
from mpifusion.comm import shm, tuning
from mpifusion.config import STRATEGIES, CommOptions
from mpifusion.dtypes import bfloat16, float16, float32
from mpifusion.errors import CommTimeoutError, OptionError, OrderError

from tests.reference import exact_values

SEGMENT = 4096  # bytes: 1024-element chunks, so a slice of the larger params spans several
DTYPES = [float32, np.dtype(np.float64), float16, bfloat16]
SHAPES = [(1,), (7,), (13, 17), (20011,)]  # one element, primes, bigger than a chunk
#: the scratch of the staging tests (one page): arrays of BIG elements take several rounds
SCRATCH = 4096
BIG = 2503


def opts(**kw):
    return CommOptions(strategy="shm", segment_bytes=SEGMENT, **kw)


def grads(rank, step, dtype, shapes=SHAPES, salt=0):
    return [exact_values(s, dtype, rank, step, i, salt) for i, s in enumerate(shapes)]


def rounded(x64, dtype, scale):
    """``x64 * scale`` as the implementation computes it: fp64 in fp64; else in fp32 (the
    sum of multiples of 1/8 is exact there), rounded once to ``dtype``."""
    if np.dtype(dtype) == np.float64:
        return x64 * scale
    return (x64.astype(np.float32) * np.float32(scale)).astype(dtype)


def total(n, step, dtype, i, shape, salt=0):
    return np.sum([exact_values(shape, dtype, r, step, i, salt).astype(np.float64)
                   for r in range(n)], axis=0)


def same_on_every_rank(comm, arr, what):
    digests = comm.allgather(hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest())
    assert len(set(digests)) == 1, f"{what}: bytes differ across ranks: {digests}"


def make(comm, act, dtype, ident, shapes=SHAPES, **kw):
    params = [Param(f"p{ident}_{i}", np.full(s, 0.25 * (i + 1), dtype=dtype))
              for i, s in enumerate(shapes)]
    dst = comm.Get_size() - 1 if act == HookAction.REDUCE else -1
    kw.setdefault("comm_options", opts())
    return FusedCommBuffer(ident, params, comm, act=act, dst=dst, **kw), params


def check_grads(buf, params, step, dtype, salt=0):
    """The grad of every param (reduced, or kept and scaled) as the reference says."""
    n, rank = buf.nranks, buf.rank
    act = buf.act
    lo, hi = buf.layout.shard_range(rank) if act == HookAction.REDUCE_SCATTER else (0, 0)
    for i, p in enumerate(params):
        reduced = rounded(total(n, step, dtype, i, p.shape, salt), dtype, 1.0 / n)
        kept = rounded(exact_values(p.shape, dtype, rank, step, i, salt).astype(np.float64),
                       dtype, 1.0 / n)
        if act == HookAction.ALL_REDUCE or (act == HookAction.REDUCE and rank == n - 1):
            want = reduced
        elif act == HookAction.REDUCE:
            want = kept
        else:  # reduce-scatter: this rank's shard reduced, the rest kept
            at = buf.layout[p.name].offset + np.arange(p.numel).reshape(p.shape)
            want = np.where((at >= lo) & (at < hi), reduced, kept)
        slot = buf.layout[p.name]
        got = buf.grad_storage[slot.offset:slot.end].reshape(p.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} step {step} "
                                      f"{act.name} {np.dtype(dtype).name} {p.name}")


# ------------------------------------------------------------------ buffers, every action


@pytest.mark.matrix
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act", list(HookAction), ids=lambda a: a.name)
def test_buffer_actions_in_the_window(comm, act, dtype):
    n, rank = comm.Get_size(), comm.Get_rank()
    sharded = act == HookAction.REDUCE_SCATTER
    # reduce-scatter with release_grads: the grads are allocated at the first add_grad and
    # dropped after each step, and must come back in the same window region
    buf, params = make(comm, act, dtype, 1, release_grads=sharded)
    c = buf.comm
    assert c.strategy == "shm" and c.shm_fallback is None
    places = set()
    for step in range(2 if sharded else 1):
        for p, g in reversed(list(zip(params, grads(rank, step, dtype)))):
            buf.add_grad(p, grad=g)
            assert c.in_shared_window(p.grad), f"{p.name}: grad not in the window"
        assert c.in_shared_window(buf.grad_storage)
        places.add(buf.grad_storage.ctypes.data)
        buf.scale_grads()
        check_grads(buf, params, step, dtype)
        if act == HookAction.ALL_REDUCE:
            same_on_every_rank(comm, buf.grad_storage, f"{act.name} step {step}")
        if sharded:
            lo, hi = buf.layout.shard_range(rank)
            # the optimizer updates this rank's shard; sync_params gathers every shard
            assert c.in_shared_window(buf.param_storage)
            buf.param_storage[lo:hi] = exact_values(hi - lo, dtype, rank, step, 99)
            buf.sync_params()
            shard = buf.layout.shard_numel
            want = np.concatenate([exact_values(shard, dtype, r, step, 99) for r in range(n)])
            np.testing.assert_array_equal(buf.param_storage, want)
            same_on_every_rank(comm, buf.param_storage, f"sync_params step {step}")
            buf.clear_grad_storage()
        else:
            buf.grad_storage[...] = 0
    assert len(places) == 1, "the grads moved out of the buffer's window region"
    buf.close()


@pytest.mark.mpi(min_size=2)
def test_windows_made_on_another_communicator_do_not_rename_these(comm):
    """A window is named by its place among its own communicator's windows: ranks that built
    shm buffers on a sub-communicator (here the lower half) and ranks that did not still name
    the world's windows alike. A process-wide count made rank 4 name another window than
    rank 3 at 8 ranks, once emulated-node tests on 4 of them had run."""
    rank, n = comm.Get_rank(), comm.Get_size()
    lower = rank < n // 2 or n == 1
    sub = comm.Split(0 if lower else 1, rank)
    try:
        if lower:
            for ident in (80, 81):  # windows on the lower ranks only
                make(sub, HookAction.ALL_REDUCE, float32, ident, shapes=[(5,)])
        buf, params = make(comm, HookAction.ALL_REDUCE, float32, 82)
        for p, g in zip(params, grads(rank, 0, float32)):
            buf.add_grad(p, grad=g)
        buf.scale_grads()
        check_grads(buf, params, 0, float32)
    finally:
        release(sub)
        sub.Free()


@pytest.mark.mpi
def test_free_grads_in_comm_and_reset_param_storage(comm):
    """The shard of free_grads_in_comm is ordinary memory (only its owner writes it); the
    param storage reset after clear_param_storage is the window region again, zeroed."""
    n, rank = comm.Get_size(), comm.Get_rank()
    buf, params = make(comm, HookAction.REDUCE_SCATTER, float32, 2, release_grads=True,
                       free_grads_in_comm=True)
    region = buf.param_storage.ctypes.data
    for p, g in zip(params, grads(rank, 0, float32)):
        buf.add_grad(p, grad=g)
    buf.scale_grads()
    lo, hi = buf.layout.shard_range(rank)
    full = np.zeros(buf.buffer_size)
    for i, p in enumerate(params):
        slot = buf.layout[p.name]
        full[slot.offset:slot.end] = rounded(total(n, 0, float32, i, p.shape), float32,
                                             1.0 / n).ravel()
    np.testing.assert_array_equal(buf.grad_storage, full[lo:hi].astype(np.float32))
    buf.clear_param_storage()
    buf.reset_param_storage()
    assert buf.param_storage.ctypes.data == region and not buf.param_storage.any()
    assert buf.comm.in_shared_window(params[0].data)


def shared_rss(comm):
    """This process's resident shared memory, in bytes, once every rank got here."""
    comm.Barrier()
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))
    return kib * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
@pytest.mark.mpi(min_size=2)
def test_released_storage_gives_its_pages_back(comm):
    """release_grads / clear_grad_storage / clear_param_storage save memory with shm too:
    the region's pages go back to the system (the window stays mapped); a grad the user
    kept keeps its values instead; the next step is exact again in the same region."""
    rank = comm.Get_rank()
    shapes = [(1 << 18,), (3, 70001)]  # 1 MiB and 0.8 MiB of fp32
    buf, params = make(comm, HookAction.REDUCE_SCATTER, float32, 3, shapes=shapes,
                       release_grads=True)
    grad_bytes = buf.buffer_size * 4
    region = None
    for step in range(3):
        for p, g in zip(params, grads(rank, step, float32, shapes)):
            buf.add_grad(p, grad=g)
        assert buf.comm.in_shared_window(buf.grad_storage)
        region = region or buf.grad_storage.ctypes.data
        assert buf.grad_storage.ctypes.data == region, "the grads left their region"
        buf.scale_grads()
        check_grads(buf, params, step, float32)
        kept = params[0].grad if step == 1 else None
        want = kept.copy() if step == 1 else None
        before = shared_rss(comm)
        buf.clear_grad_storage()
        dropped = before - shared_rss(comm)
        if step == 1:  # a live view keeps the region's values, and its pages
            np.testing.assert_array_equal(kept, want)
            assert dropped < grad_bytes, f"rank {rank}: {dropped} bytes went back"
            del kept
        else:
            assert dropped >= grad_bytes, (f"rank {rank} step {step}: {dropped} bytes of "
                                           f"shared memory went back, expected >= {grad_bytes}")
    lo, hi = buf.layout.shard_range(rank)
    buf.param_storage[lo:hi] = 1.0
    buf.sync_params()
    before = shared_rss(comm)
    buf.clear_param_storage()
    dropped = before - shared_rss(comm)
    assert dropped >= buf.buffer_size * 4, f"rank {rank}: {dropped} bytes of params went back"
    buf.reset_param_storage()
    assert not buf.param_storage.any()
    buf.param_storage[...] = 1.0  # touched: its pages are memory again
    before = shared_rss(comm)
    del buf, params, kept, p, g
    gc.collect()
    dropped = before - shared_rss(comm)
    assert dropped >= grad_bytes, f"rank {rank}: {dropped} bytes went back with the buffer"


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
@pytest.mark.mpi(min_size=2)
def test_a_new_buffer_costs_no_memory_until_its_grads_are_written(comm):
    """Fresh window regions read as zeros without being touched, as np.zeros' pages do: a
    buffer's grads take memory when add_grad writes them, not at construction."""
    shapes = [(1 << 19,)]  # 2 MiB of fp32 grads
    before = shared_rss(comm)
    buf, params = make(comm, HookAction.ALL_REDUCE, float32, 4, shapes=shapes)
    grown = shared_rss(comm) - before
    assert buf.comm.in_shared_window(buf.grad_storage) and not buf.grad_storage.any()
    assert grown < buf.grad_storage.nbytes // 2, f"{grown} bytes at construction"
    buf.add_grad(params[0], grad=np.ones(shapes[0], np.float32))
    buf.scale_grads()
    assert shared_rss(comm) - before >= buf.grad_storage.nbytes


# ------------------------------------------------------------------ arrays outside the windows


@pytest.fixture
def small_scratch(comm, monkeypatch):
    """A communicator of its own whose shm streams have a one-page scratch (the same on
    every rank), so that staging takes several rounds at small sizes."""
    monkeypatch.setattr(tuning, "ACTIVE", replace(tuning.ACTIVE, scratch_bytes=SCRATCH))
    sub = comm.Dup()
    yield sub
    release(sub)
    sub.Free()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [float32, bfloat16], ids=lambda d: np.dtype(d).name)
def test_arrays_outside_the_windows_are_staged(small_scratch, dtype):
    """Plain numpy arrays go through the scratch in rounds; on odd ranks they do while the
    even ranks' arrays lie in a window (each rank says where its array is)."""
    comm = small_scratch
    n, rank = comm.Get_size(), comm.Get_rank()
    c = Communicator(comm, opts())
    assert c._shm.scratch_bytes == SCRATCH
    root = n - 1
    for numel in (0, 1, 7, BIG):
        region = c.reserve([(numel, dtype)], np.empty(0))
        for mixed in (False, True):
            inside = mixed and rank % 2 == 0 and numel > 0

            def arr(values):
                if not inside:
                    return values.copy()
                region[0][...] = values
                return region[0]

            assert c.in_shared_window(arr(np.zeros(numel, dtype))) == inside
            mine = exact_values(numel, dtype, rank, numel, 1, 0)
            whole = total(n, numel, dtype, 1, numel)
            x = arr(mine)
            c.allreduce(x, scale=1.0 / n).wait(timeout=60)
            np.testing.assert_array_equal(x, rounded(whole, dtype, 1.0 / n))
            same_on_every_rank(comm, x, f"allreduce of {numel}")
            x = arr(mine)
            c.reduce(x, root=root, scale=0.5, sent_scale=0.25).wait(timeout=60)
            np.testing.assert_array_equal(
                x, rounded(whole, dtype, 0.5) if rank == root
                else rounded(mine.astype(np.float64), dtype, 0.25))
    for shard in (0, 1, 5, BIG // n + 1):
        numel = shard * n
        region = c.reserve([(numel, dtype)], np.empty(0))
        mine = exact_values(numel, dtype, rank, numel, 2, 0)
        whole = total(n, numel, dtype, 2, numel)
        inside = rank % 2 == 0 and numel > 0
        send = region[0] if inside else mine.copy()
        send[...] = mine
        recv = send[rank * shard:(rank + 1) * shard]  # in place, as a buffer does
        c.reduce_scatter(send, recv, scale=1.0 / n, others_scale=2.0).wait(timeout=60)
        want = rounded(mine.astype(np.float64), dtype, 2.0)
        want[rank * shard:(rank + 1) * shard] = rounded(whole, dtype, 1.0 / n)[
            rank * shard:(rank + 1) * shard]
        np.testing.assert_array_equal(send, want)
        gathered = region[0] if inside else np.zeros(numel, dtype)
        gathered[...] = 0
        gathered[rank * shard:(rank + 1) * shard] = mine[rank * shard:(rank + 1) * shard]
        c.allgather_inplace(gathered).wait(timeout=60)
        np.testing.assert_array_equal(gathered, np.concatenate(
            [exact_values(numel, dtype, r, numel, 2, 0)[r * shard:(r + 1) * shard]
             for r in range(n)]))


# ------------------------------------------------------------------ order, deadlines


@pytest.mark.mpi
@pytest.mark.parametrize("order", ["strict", "negotiated"])
def test_two_buffers_interleaved(comm, order):
    """Strict: B's collective starts while A's params are still checking in, and the waits
    come in the other order. Negotiated: the ranks start them in different orders."""
    rank = comm.Get_rank()
    a, pa = make(comm, HookAction.ALL_REDUCE, float32, 3, order=order)
    b, pb = make(comm, HookAction.REDUCE, bfloat16, 4, order=order, shapes=SHAPES[:3])
    ga, gb = grads(rank, 0, float32, salt=3), grads(rank, 0, bfloat16, SHAPES[:3], salt=4)
    first, second = ((a, pa, ga), (b, pb, gb)) if order == "strict" or rank % 2 else \
        ((b, pb, gb), (a, pa, ga))
    buf, ps, gs = first
    for p, g in list(zip(ps, gs))[1:]:
        buf.add_grad(p, grad=g)
    for p, g in zip(second[1], second[2]):
        second[0].add_grad(p, grad=g)
    buf.add_grad(ps[0], grad=gs[0])
    a.scale_grads()
    b.scale_grads()
    check_grads(a, pa, 0, float32, salt=3)
    check_grads(b, pb, 0, bfloat16, salt=4)


@pytest.mark.mpi(min_size=2)
def test_deadline_names_the_late_rank_and_a_later_wait_finishes(comm):
    """Small collectives under a deadline are polled by the waiting caller, large ones run
    on the communication thread; both name the rank that has not started, and a later wait
    finishes them. The last rank starts each one 0.8 s late."""
    n, rank = comm.Get_size(), comm.Get_rank()
    bufs = [make(comm, HookAction.ALL_REDUCE, float32, 5 + k, shapes=[(numel,)], timeout=0.2)
            for k, numel in enumerate((64, 20000))]  # polled, on the thread
    comm.Barrier()
    for k, (buf, params) in enumerate(bufs):
        if rank == n - 1:
            time.sleep(0.8)
        buf.add_grad(params[0], grad=grads(rank, 0, float32, [params[0].shape], salt=k)[0])
        errors = []
        for _ in range(300):
            try:
                buf.scale_grads()
                break
            except CommTimeoutError as exc:
                errors.append(str(exc))
        if rank != n - 1:
            assert errors, f"buffer {k}: expected a CommTimeoutError while the last rank sleeps"
            assert re.search(rf"rank {n - 1} of the buffer's communicator has not started it",
                             errors[0]), errors[0]
        check_grads(buf, params, 0, float32, salt=k)


@pytest.mark.mpi(min_size=2)
def test_rows_refuse_different_collectives_without_the_order_check(comm):
    """With verify_order=False only the descriptor rows can tell that the ranks started
    different collectives: every rank raises the same OrderError, nothing moved."""
    n, rank = comm.Get_size(), comm.Get_rank()
    c = Communicator(comm, opts(verify_order=False))
    x = np.full(10 + (rank == 0), rank + 1.0, np.float32)
    with pytest.raises(OrderError, match=r"rank 0 started .* of 11 float32 .*ranks? .* of 10"):
        c.allreduce(x).wait(timeout=60)
    assert (x == rank + 1.0).all()
    y = np.full(9, rank + 1.0, np.float32)
    c.allreduce(y).wait(timeout=60)  # the stream is still aligned
    assert (y == n * (n + 1) / 2).all()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_small_all_reduce_is_the_rank_order_sum_by_gather_and_by_window(comm, dtype,
                                                                       monkeypatch):
    """A small all-reduce (every rank's buffer together at most ``gather_max_bytes``) is an
    all-gather, each rank summing every buffer in rank order itself; with verify_order=False
    it takes the window. Random values (not exact sums): both give the bits of the rank-order
    sum computed here, on every rank, with 1/n applied once."""
    from mpifusion.comm import shm_collectives

    n, rank = comm.Get_size(), comm.Get_rank()
    numel = tuning.ACTIVE.gather_max_bytes // (8 * n)  # fits as fp64 at every rank count
    draws = [np.random.default_rng([r, numel]).standard_normal(numel) for r in range(n)]
    wide = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    acc = draws[0].astype(dtype).astype(wide)
    for r in range(1, n):
        acc = acc + draws[r].astype(dtype).astype(wide)
    want = (acc * wide(1.0 / n)).astype(dtype)
    gathered = []
    real = shm_collectives._gathered_allreduce
    monkeypatch.setattr(shm_collectives, "_gathered_allreduce",
                        lambda *a: (gathered.append(1), (yield from real(*a)))[1])
    fused = []  # elements the compiled half pass summed (halfcast.sum_half)
    real_sum = halfcast.sum_half
    monkeypatch.setattr(halfcast, "sum_half", lambda *a: fused.append(real_sum(*a)) or fused[-1])
    summed = []  # elements the compiled fp32/fp64 sum did (halfcast.sum_wide)
    real_wide = halfcast.sum_wide
    monkeypatch.setattr(halfcast, "sum_wide",
                        lambda *a: summed.append(real_wide(*a)) or summed[-1])
    for verify in (True, False):
        c = Communicator(comm, opts(verify_order=verify))
        x = draws[rank].astype(dtype)
        c.allreduce(x, scale=1.0 / n).wait(timeout=60)
        assert len(gathered) == 1, (verify, gathered)  # gathered with the check, else not
        if not verify and n > 1 and np.dtype(dtype).itemsize == 2 and halfcast.path() != "numpy":
            assert sum(fused) > 0, "the window's half slices were not summed in one pass"
        if verify and np.dtype(dtype).itemsize >= 4 and halfcast._kernels is not None:
            assert sum(summed) == numel, "the gathered sum was not the compiled one"
        np.testing.assert_array_equal(x.view(np.uint8), want.view(np.uint8),
                                      err_msg=f"verify_order={verify}, rank {rank}")
        same_on_every_rank(comm, x, f"verify_order={verify}")


@pytest.mark.mpi(min_size=2)
def test_small_all_reduces_through_the_scratch_under_skewed_starts(comm, monkeypatch):
    """On one node a small all-reduce moves no data through MPI: each rank copies its buffer
    into its scratch and waits until every peer's word says the same (``ShmStream.publish``).
    60 in a row of random sizes, every third a large one of an array outside the windows
    (staged through the same scratch), a random rank starting each up to 3 ms late: every
    result has the bits of the rank-order sum on every rank, so no rank read a scratch that
    a peer had already overwritten for the next collective."""
    from mpifusion.comm import shm_collectives

    n, rank = comm.Get_size(), comm.Get_rank()
    published = []
    real = shm.ShmStream.publish
    monkeypatch.setattr(shm.ShmStream, "publish",
                        lambda self, flat, serial: (published.append(flat.size),
                                                    real(self, flat, serial))[1])
    c = Communicator(comm, opts())
    small = tuning.ACTIVE.gather_max_bytes // (4 * n)
    scale = np.float32(1.0 / n)
    for i in range(60):
        rng = np.random.default_rng([7, i])  # the same draws on every rank
        numel = int(rng.integers(1, small + 1)) if i % 3 else 40000 + i
        draws = [rng.standard_normal(numel).astype(np.float32) for _ in range(n)]
        want = draws[0].copy()
        for r in range(1, n):
            want = want + draws[r]
        want = want * scale
        if rank == int(rng.integers(n)):
            time.sleep(float(rng.uniform(0, 0.003)))
        x = draws[rank].copy()
        c.allreduce(x, scale=1.0 / n).wait(timeout=60)
        np.testing.assert_array_equal(x.view(np.uint32), want.view(np.uint32),
                                      err_msg=f"all-reduce {i} of {numel}, rank {rank}")
    assert len(published) == 40, published  # the small ones, and only they


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("numel", [16, 70000], ids=["gathered", "window"])
def test_an_overflow_is_ieee_on_every_rank_whatever_numpy_is_told(comm, numel):
    """Sums that overflow give inf on every rank, as MPI's own sum does, even where the
    caller made numpy raise (``np.seterr(all="raise")``) and warnings errors: each rank sums
    its own slice in the window, so one rank raising alone would leave the others at the
    barrier."""
    import warnings

    n, rank = comm.Get_size(), comm.Get_rank()
    c = Communicator(comm, opts(timeout=20))
    x = np.ones(numel, np.float32)
    x[-1] = np.float32(3e38)  # the last element overflows: in the last rank's slice
    want = np.full(numel, np.float32(n) * np.float32(1.0 / n), np.float32)
    want[-1] = np.inf
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        c.allreduce(x, scale=1.0 / n).wait()
        c.allreduce(x[:1], scale=1.0 / n).wait()  # and the stream goes on
    np.testing.assert_array_equal(x, want)
    same_on_every_rank(comm, x, "an overflowed sum")


# ------------------------------------------------------------------ fallback, lifetime


@pytest.mark.mpi
def test_fallback_is_agreed_and_says_why(comm, caplog):
    """Only rank 0 is told it shares its node with nobody: every rank falls back to
    ``thread`` (an all-reduce decides, not each rank's own guess), with the reason logged."""
    n, rank = comm.Get_size(), comm.Get_rank()

    def probe(node):
        return 1 if node.Get_rank() == 0 else node.Get_size()

    with caplog.at_level(logging.WARNING, logger="mpifusion"):
        c = Communicator(comm, opts(), node_probe=probe)
    if n == 1:
        assert c.strategy == "shm" and c.shm_fallback is None
    else:
        assert c.strategy == "thread"
        assert "spans nodes" in c.shm_fallback and f"as few as 1 of its {n}" in c.shm_fallback
        assert any("strategy 'shm' unavailable, using 'thread'" in r.getMessage()
                   for r in caplog.records)
        assert c.reserve([(10, float32)], np.empty(0)) == []
    x = np.full(5, rank + 1.0, np.float32)
    c.allreduce(x).wait(timeout=60)
    assert (x == n * (n + 1) / 2).all()


@pytest.mark.mpi
def test_release_frees_the_windows_and_keeps_what_a_rank_holds(comm):
    """Buffers make no MPI window (their storage is in the arena): release() frees the
    stream's control window on every rank, while a buffer still alive on one rank keeps its
    storage mapped and usable there."""
    rank = comm.Get_rank()
    sub = comm.Dup()
    try:
        before = shm.live_windows()
        kept = make(sub, HookAction.ALL_REDUCE, float32, 6, shapes=[(100,)])[0]
        dropped = make(sub, HookAction.ALL_REDUCE, float32, 7, shapes=[(100,)])[0]
        assert shm.live_windows() == before + 1  # the stream's only
        assert kept.comm.in_shared_window(kept.grad_storage)
        del dropped
        if rank != 0:
            del kept
        gc.collect()
        release(sub)
        assert shm.live_windows() == before
        if rank == 0:  # still mapped: its grads stay readable and writable
            kept.grad_storage[...] = 2.0
            assert kept.params[0].grad.sum() == 200.0
    finally:
        sub.Free()


# ------------------------------------------------------------------ serial: what a dead job leaves

#: the files an MPI backs a shared window with while its ranks map it (MPICH, Open MPI's osc
#: sm): the only trace of mpifusion's windows in /dev/shm
WINDOW_FILES = ("mpich_shar", "osc_sm", "mpifusion")

ENDED_JOB = """
import os, sys, time
import numpy as np
from mpi4py import MPI
from mpifusion import FusedCommBuffer, HookAction, Param
from mpifusion.config import CommOptions
comm = MPI.COMM_WORLD
p = [Param("w", np.ones(4096, np.float32))]
buf = FusedCommBuffer(0, p, comm, act=HookAction.ALL_REDUCE,
                      comm_options=CommOptions(strategy="shm"))
assert buf.comm.strategy == "shm" and buf.comm.in_shared_window(buf.grad_storage)
buf.add_grad(p[0], grad=np.ones(4096, np.float32))
buf.scale_grads()
open(f"{sys.argv[2]}/reduced{comm.Get_rank()}", "w").close()
comm.Barrier()
if comm.Get_rank() == 1:
    if sys.argv[1] == "abort":
        comm.Abort(3)
    os.kill(os.getpid(), 9)
time.sleep(60)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["abort", "kill"])
def test_a_job_ended_by_abort_or_kill_leaves_no_window_file(tmp_path, how):
    """After MPI_Abort or a kill -9 of a rank, nothing of the job's shared windows is left in
    /dev/shm: both MPIs unlink a window's file once every rank mapped it (MPICH's own
    transport segment, mpich_shm_*, is its own and is documented as left behind)."""
    from tests import leftovers
    from tests.helpers import run_job

    shm_dir = "/dev/shm"
    before = set(os.listdir(shm_dir))
    script = tmp_path / "ended.py"
    script.write_text(ENDED_JOB)
    proc = run_job(2, [sys.executable, str(script), how, tmp_path], timeout=90,
                   stderr_to_stdout=True)
    assert proc.returncode not in (0, None), proc.stdout[-3000:]
    assert sorted(p.name for p in tmp_path.glob("reduced*")) == ["reduced0", "reduced1"], \
        proc.stdout[-3000:]

    def left() -> list:
        used = leftovers.in_use()
        return [name for name in set(os.listdir(shm_dir)) - before
                if name.startswith(WINDOW_FILES) and f"{shm_dir}/{name}" not in used]

    deadline = time.monotonic() + 10  # the launcher's last processes may still be exiting
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left() == [], f"{how}: window files left in {shm_dir}: {left()}"


# ------------------------------------------------------------------ serial: options


def test_strategy_option_environment_and_cli_choices():
    assert "shm" in STRATEGIES
    assert CommOptions(strategy="shm").strategy == "shm"
    assert CommOptions(strategy="shared-memory").strategy == "shm"
    assert CommOptions.from_env({"MPIFUSION_COMM_STRATEGY": "shm"}).strategy == "shm"
    from mpifusion.tools.cli import build_parser

    args = build_parser().parse_args(["run", "--preset", "tiny", "--strategy", "shm"])
    assert args.strategy == "shm"


def test_below_thread_multiple_is_refused_naming_the_rank(monkeypatch):
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    with pytest.raises(OptionError, match=r"rank 0: strategy 'shm': expected MPI "
                                          r"initialised at MPI_THREAD_MULTIPLE"):
        Communicator(MPI.COMM_SELF, CommOptions(strategy="shm"))


def test_open_mpis_osc_ucx_notice_is_dropped_and_nothing_else(monkeypatch, capfd):
    """Open MPI 5 prints an ``Error:`` line per window and rank where osc/ucx declines;
    only that line (and the blank one after it) goes, whatever else was written."""
    monkeypatch.setattr(MPI, "get_vendor", lambda: ("Open MPI", (5, 0, 11)))
    with shm._without_osc_ucx_notice():
        os.write(2, b"before\n[vm:1] osc_ucx_component.c:375  Error: "
                    + shm.OSC_UCX_NOTICE.encode() + b" \n \nafter\n")
    assert capfd.readouterr().err == "before\nafter\n"
    monkeypatch.setattr(MPI, "get_vendor", lambda: ("MPICH", (5, 0, 2)))
    with shm._without_osc_ucx_notice():
        os.write(2, shm.OSC_UCX_NOTICE.encode() + b"\n")
    assert shm.OSC_UCX_NOTICE in capfd.readouterr().err  # another MPI's text: untouched
