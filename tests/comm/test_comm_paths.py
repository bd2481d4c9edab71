"""The fast communication path (``thread``) gives the same results as the plain one
(``nonblocking``), at every rank count, for every action, in fp32 and bf16.

Gradients are dyadic numbers with few significant bits, so every sum over ranks is exact in
fp32 whatever order MPI adds in: each result can be compared *bit for bit* with a float64
reference rounded the way the half-precision rule says (sum in fp32, scale by the fp32
``1/n`` in fp32, round once to the buffer dtype).

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests/comm/test_comm_paths.py``.
"""
import numpy as np
import pytest

from mpifusion import FusedCommBuffer, HookAction, Param
from mpifusion.comm import Communicator
from mpifusion.config import SEGMENT_ENV, STRATEGY_ENV, CommOptions
from mpifusion.errors import OptionError
from mpifusion.dtypes import bfloat16, float16, float32

from tests.reference import exact_values

pytestmark = pytest.mark.mpi

STRATEGIES = ["thread", "nonblocking"]
# 0: one segment per buffer; 256 bytes: many segments, and pieces that split params
SEGMENTS = [0, 256]


def contribution(rank, size, seed=0):
    """Rank ``rank``'s values: 8 significant bits (exact in bf16), exponents in [-2, 2].
    Sums over <= 8 ranks need <= 14 bits: exact in fp32, but *not* in bf16."""
    i = np.arange(size)
    mant = 1.0 + ((i * 7 + rank * 3 + seed) % 128) / 128.0
    sign = np.where((i + rank) % 3 == 0, -1.0, 1.0)
    return sign * mant * 2.0 ** ((i + rank + seed) % 5 - 2)


def exact_sum(nranks, size, seed=0):
    return sum(contribution(r, size, seed) for r in range(nranks))


def rounded(exact, dtype, scale=None):
    """float64 exact sum -> what the rule gives: fp32 value, fp32 scaling, one rounding."""
    value = exact.astype(np.float32)
    assert np.array_equal(value.astype(np.float64), exact)  # the test's own premise
    if scale is not None:
        value = (value.astype(np.float64) * np.float64(np.float32(scale))).astype(np.float32)
    return value.astype(dtype)


def bits_equal(a, b):
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("segment", SEGMENTS)
@pytest.mark.parametrize("dtype", [float32, bfloat16, float16], ids=lambda d: d.name)
def test_collectives_are_exact(comm, strategy, segment, dtype):
    n, rank = comm.Get_size(), comm.Get_rank()
    c = Communicator(comm, strategy=strategy, segment_bytes=segment)
    shard = 97  # odd, so segments and shards never line up
    size = shard * n
    mine = contribution(rank, size).astype(dtype)
    exact = exact_sum(n, size)

    a = mine.copy()
    ta = c.allreduce(a, scale=1.0 / n, name="test allreduce")
    b = mine.copy()
    tb = c.reduce(b, root=n - 1)
    rs = mine.copy()
    tr = c.reduce_scatter(rs, rs[rank * shard:(rank + 1) * shard], scale=1.0 / n)
    g = np.zeros(size, dtype)
    g[rank * shard:(rank + 1) * shard] = mine[rank * shard:(rank + 1) * shard]
    tg = c.allgather_inplace(g)
    # finish out of order: the engine must still issue them in start order on every rank
    tg.wait(timeout=60)
    while not tr.is_completed():
        c.poll()
    tb.wait()
    ta.wait()

    assert bits_equal(a, rounded(exact, dtype, 1.0 / n))
    assert bits_equal(b, rounded(exact, dtype) if rank == n - 1 else mine)
    own = slice(rank * shard, (rank + 1) * shard)
    assert bits_equal(rs[own], rounded(exact[own], dtype, 1.0 / n))
    others = np.ones(size, bool)
    others[own] = False
    assert bits_equal(rs[others], mine[others])  # regions this rank does not own are untouched
    everyone = np.concatenate([contribution(r, size)[r * shard:(r + 1) * shard] for r in range(n)])
    assert bits_equal(g, everyone.astype(dtype))


def test_half_precision_is_summed_in_fp32(comm):
    """bf16 pairwise sums would round after each addition; the rule rounds once."""
    n = comm.Get_size()
    if n < 3:
        pytest.skip("needs 3 ranks for a sum that bf16 pairwise addition gets wrong")
    size = 4096
    exact = exact_sum(n, size)
    pairwise = contribution(0, size).astype(bfloat16)
    for r in range(1, n):
        pairwise = (pairwise.astype(np.float32) + contribution(r, size).astype(bfloat16)
                    .astype(np.float32)).astype(bfloat16)
    ref = rounded(exact, bfloat16)
    assert not bits_equal(pairwise, ref)  # the data really tells the two apart
    for strategy in STRATEGIES:
        x = contribution(comm.Get_rank(), size).astype(bfloat16)
        Communicator(comm, strategy=strategy, segment_bytes=512).allreduce(x).wait()
        assert bits_equal(x, ref)


def test_strategy_choice_errors_and_env(comm, monkeypatch):
    with pytest.raises(OptionError, match="strategy: expected one of thread, nonblocking"):
        Communicator(comm, strategy="fastest")
    with pytest.raises(OptionError, match="strategy: expected one of thread, nonblocking"):
        CommOptions(strategy="fastest")
    monkeypatch.setenv(STRATEGY_ENV, "bogus")
    with pytest.raises(OptionError, match=STRATEGY_ENV):
        Communicator(comm)
    monkeypatch.setenv(STRATEGY_ENV, "nonblocking")
    monkeypatch.setenv(SEGMENT_ENV, "-5")
    with pytest.raises(OptionError, match=SEGMENT_ENV):
        Communicator(comm)
    monkeypatch.setenv(SEGMENT_ENV, "4096")
    c = Communicator(comm)
    assert (c.strategy, c.segment_bytes) == ("nonblocking", 4096)
    # explicit options beat the environment
    c = Communicator(comm, CommOptions(strategy="thread", segment_bytes=1024))
    assert (c.strategy, c.segment_bytes) == ("thread", 1024)
    with pytest.raises(OptionError, match=r"root expected a rank in \[0, "):
        c.reduce(np.zeros(4, np.float32), root=comm.Get_size())


SHAPES = [(17, 33), (1,), (3, 5), (64,), (2, 49)]


def build(comm, strategy, act, dtype, tag):
    params = [Param(f"{tag}{i}", np.zeros(shape, dtype)) for i, shape in enumerate(SHAPES)]
    dst = comm.Get_size() - 1 if act == HookAction.REDUCE else -1
    options = CommOptions(strategy=strategy, segment_bytes=512)  # many segments per buffer
    return FusedCommBuffer(0, params, comm, act=act, dst=dst, comm_options=options), params


def grads_for(rank, params, dtype, step):
    """Dyadic grads: multiples of 1/4 in [-1, 1); sums over ranks are exact even in bf16."""
    return [exact_values(p.shape, np.float64, rank, i, step, span=1, den=4)
            for i, p in enumerate(params)]


@pytest.mark.matrix
@pytest.mark.parametrize("act", list(HookAction), ids=lambda a: a.name)
@pytest.mark.parametrize("dtype", [float32, bfloat16], ids=lambda d: d.name)
def test_buffers_fast_path_equals_plain_path(comm, act, dtype):
    """Two buffers in flight at once per strategy, interleaved check-ins, two steps; then
    sync_params for REDUCE_SCATTER. Both strategies end with identical bytes, and reduced
    regions equal the float64 reference."""
    n, rank = comm.Get_size(), comm.Get_rank()
    results = {}
    for strategy in STRATEGIES:
        (b1, p1), (b2, p2) = (build(comm, strategy, act, dtype, "a"),
                              build(comm, strategy, act, dtype, "b"))
        for step in range(2):
            for p in p1 + p2:
                p.grad[...] = 0  # the optimizer's clear_grad, in place
            g1, g2 = grads_for(rank, p1, dtype, step), grads_for(rank, p2, dtype, step + 7)
            for (pa, ga), (pb, gb) in zip(zip(p1, g1), zip(p2, g2)):
                b1.add_grad(pa, grad=ga.astype(dtype))  # b1 starts comm on its last param,
                b2.add_grad(pb, grad=gb.astype(dtype))  # while b2 is still filling
            b2.scale_grads()  # finish in the other order
            b1.scale_grads()
        for buf, params, seed in ((b1, p1, 1), (b2, p2, 8)):
            exact = [sum(g for g in gs) for gs in zip(*(grads_for(r, params, dtype, seed)
                                                       for r in range(n)))]
            for p, e in zip(params, exact):
                want = rounded(e, dtype, 1.0 / n)
                got = p.grad
                if act == HookAction.ALL_REDUCE or (act == HookAction.REDUCE and rank == n - 1):
                    assert bits_equal(got, want), (strategy, p.name)
            if act == HookAction.REDUCE_SCATTER:
                lo, hi = buf.layout.shard_range(rank)
                for p, e in zip(params, exact):
                    slot = buf.layout[p.name]
                    flat = np.zeros(slot.padded_numel)
                    flat[:slot.numel] = e.ravel()
                    a, z = max(lo, slot.offset), min(hi, slot.padded_end)
                    if a < z:
                        want = rounded(flat[a - slot.offset:z - slot.offset], dtype, 1.0 / n)
                        assert bits_equal(buf.grad_storage[a:z], want), (strategy, p.name)
                # each rank writes its own shard of the params; sync_params gathers them all
                buf.param_storage[lo:hi] = (np.arange(lo, hi) % 251 + 1000 * rank).astype(dtype)
        if act == HookAction.REDUCE_SCATTER:
            task = b1.sync_params(sync=False)
            b2.sync_params(sync=True)
            if task is not None:
                task.wait(60)
            shard = b1.layout.numel // n
            idx = np.arange(b1.layout.numel)
            want = (idx % 251 + 1000 * (idx // shard)).astype(dtype)
            assert bits_equal(b1.param_storage, want)
            assert b1.status == FusedCommBuffer.Status.READY
        results[strategy] = [b.grad_storage.copy() for b in (b1, b2)] + \
            ([b.param_storage.copy() for b in (b1, b2)] if act == HookAction.REDUCE_SCATTER else [])
    for fast, plain in zip(results["thread"], results["nonblocking"]):
        assert bits_equal(fast, plain)


@pytest.mark.timeout(120)
def test_release_receives_announcements_still_on_their_way(comm):
    """With a deadline every rank announces its starts with small messages; releasing the
    communicator must first receive those still on their way: a message left on a freed
    communicator was consumed by a later communicator's collective under Open MPI (which
    reuses the context), leaving one rank a collective ahead of its peer (a hang)."""
    from mpifusion.comm import health, release

    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    for round_ in range(3):
        dup = comm.Dup()
        c = Communicator(dup, CommOptions(timeout=60))
        tracker = c.tracker
        if rank == 0:
            for seq in range(1, 6):  # the others never look for them
                tracker.announce(99, seq)
        release(dup)
        assert all(t is not tracker for t in health._TRACKERS.values())  # forgotten
        sent = comm.allgather(tracker._sent.copy())  # what each rank sent to each rank
        assert all(sent[0][r] >= 5 for r in range(1, n))
        assert [int(sent[r][rank]) for r in range(n)] == tracker._got.tolist(), \
            "announcements left unreceived on a freed communicator"
        assert not tracker.broken and not tracker._sends
        dup.Free()
        # a new communicator (same context id, where MPI reuses it) sums right, in step
        fresh = comm.Dup()
        try:
            d = Communicator(fresh, CommOptions(timeout=60, segment_bytes=64))
            for k in range(20):
                buf = np.full(33, rank + k + round_, np.float64)
                d.allreduce(buf).wait()
                assert (buf == n * (n - 1) / 2 + n * (k + round_)).all()
        finally:
            release(fresh)
            fresh.Free()
