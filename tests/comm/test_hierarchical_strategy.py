"""The ``hierarchical`` strategy on emulated nodes (``node_size``): ``shm`` within each node,
MPI between the ranks holding the same slice on every node.

Under mpiexec, on a sub-communicator of the first ``nodes x per`` ranks (2x2, 2x4, 4x2 and
3x2 where the run has enough ranks): every action of real FusedCommBuffers against float64
references (inputs are multiples of 1/8, so only the final 1/n and rounding differ, and the
comparison is bit for bit), the same bytes on every rank, and arrays outside the windows
staged through a one-page scratch. Serially: a node size that does not divide the ranks.

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi
tests/comm/test_hierarchical_strategy.py``.
"""
from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import HookAction
from mpifusion.comm import Communicator, release
from mpifusion.comm import shm, tuning
from mpifusion.config import CommOptions
from mpifusion.dtypes import bfloat16, float16, float32
from mpifusion.errors import OptionError

from tests.comm.test_shm_strategy import (SEGMENT, check_grads, exact_values, grads, make,
                                          rounded, same_on_every_rank, total)

LAYOUTS = [(2, 2), (2, 4), (4, 2), (3, 2)]  # nodes x ranks per node
#: action and grad dtype of each buffer: every action, every dtype
BUFFERS = [(HookAction.ALL_REDUCE, float32), (HookAction.REDUCE, bfloat16),
           (HookAction.REDUCE_SCATTER, float16), (HookAction.ALL_REDUCE, np.dtype(np.float64))]


def sub_comm(comm, nodes, per):
    """The first ``nodes * per`` ranks (None on the others); skips where there are fewer."""
    need = nodes * per
    if comm.Get_size() < need:
        pytest.skip(f"{nodes}x{per} nodes need {need} ranks")
    sub = comm.Split(0 if comm.Get_rank() < need else MPI.UNDEFINED, comm.Get_rank())
    return None if sub == MPI.COMM_NULL else sub


def hier(per, **kw):
    return CommOptions(strategy="hierarchical", node_size=per, segment_bytes=SEGMENT, **kw)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("nodes,per", LAYOUTS, ids=lambda v: str(v))
def test_buffer_actions_over_emulated_nodes(comm, nodes, per):
    sub = sub_comm(comm, nodes, per)
    if sub is None:
        return
    try:
        rank = sub.Get_rank()
        for ident, (act, dtype) in enumerate(BUFFERS):
            buf, params = make(sub, act, dtype, ident, comm_options=hier(per))
            c = buf.comm
            assert c.strategy == "hierarchical" and c.shm_fallback is None
            assert (c._shm.nodes, c._shm.size, c._shm.node) == (nodes, per, rank // per)
            for p, g in reversed(list(zip(params, grads(rank, 0, dtype)))):
                buf.add_grad(p, grad=g)
                assert c.in_shared_window(p.grad)
            buf.scale_grads()
            check_grads(buf, params, 0, dtype)
            if act == HookAction.ALL_REDUCE:
                same_on_every_rank(sub, buf.grad_storage, f"{nodes}x{per} {act.name}")
            if act == HookAction.REDUCE_SCATTER:
                lo, hi = buf.layout.shard_range(rank)
                buf.param_storage[lo:hi] = exact_values(hi - lo, dtype, rank, 98)
                buf.sync_params()
                shard = buf.layout.shard_numel
                np.testing.assert_array_equal(buf.param_storage, np.concatenate(
                    [exact_values(shard, dtype, r, 98) for r in range(sub.Get_size())]))
            buf.close()
    finally:
        release(sub)
        sub.Free()


@pytest.mark.mpi(min_size=4)
def test_arrays_outside_the_windows_over_emulated_nodes(comm, monkeypatch):
    """2x2 nodes, a one-page scratch: plain arrays on odd ranks, window arrays on even ones,
    sizes from nothing to several rounds; the round structure is the same on every node."""
    monkeypatch.setattr(tuning, "ACTIVE", replace(tuning.ACTIVE, scratch_bytes=4096))
    sub = sub_comm(comm, 2, 2)
    if sub is None:
        return
    try:
        n, rank = sub.Get_size(), sub.Get_rank()
        c = Communicator(sub, hier(2))
        for numel in (0, 7, 2503):
            mine = exact_values(numel, float32, rank, numel, 1, 0)
            region = c.reserve([(numel, float32)], np.empty(0))
            x = region[0] if region and rank % 2 == 0 else np.empty(numel, np.float32)
            x[...] = mine
            c.allreduce(x, scale=1.0 / n).wait(timeout=60)
            np.testing.assert_array_equal(x, rounded(total(n, numel, float32, 1, numel),
                                                     float32, 1.0 / n))
            same_on_every_rank(sub, x, f"allreduce of {numel}")
            x[...] = mine
            c.reduce(x, root=1, scale=0.5).wait(timeout=60)
            if rank == 1:
                np.testing.assert_array_equal(
                    x, rounded(total(n, numel, float32, 1, numel), float32, 0.5))
            else:
                np.testing.assert_array_equal(x, mine)
        for shard in (1, 700):
            numel = shard * n
            mine = exact_values(numel, bfloat16, rank, numel, 2, 0)
            region = c.reserve([(numel, bfloat16)], np.empty(0))
            x = region[0] if rank % 2 == 0 else np.empty(numel, bfloat16)
            x[...] = mine
            c.reduce_scatter(x, x[rank * shard:(rank + 1) * shard], scale=1.0 / n).wait(
                timeout=60)
            np.testing.assert_array_equal(
                x[rank * shard:(rank + 1) * shard],
                rounded(total(n, numel, bfloat16, 2, numel), bfloat16, 1.0 / n)[
                    rank * shard:(rank + 1) * shard])
            c.allgather_inplace(x).wait(timeout=60)
            same_on_every_rank(sub, x, f"all-gather of {numel}")
    finally:
        release(sub)
        sub.Free()


@pytest.mark.mpi(min_size=4)
def test_small_all_reduce_over_emulated_nodes_is_the_rank_order_sum(comm, monkeypatch):
    """A small all-reduce (``Tuning.gather_max_bytes`` over all ranks) gathers every rank's buffer
    across the nodes and each rank sums them in rank order: random values, the bits of that
    sum on every rank, for every dtype; the gathered path is the one that ran."""
    from mpifusion.comm import shm_collectives

    sub = sub_comm(comm, 2, 2)
    if sub is None:
        return
    try:
        n, rank = sub.Get_size(), sub.Get_rank()
        ran = []
        real = shm_collectives._gathered_allreduce
        monkeypatch.setattr(shm_collectives, "_gathered_allreduce",
                            lambda *a: (ran.append(1), (yield from real(*a)))[1])
        c = Communicator(sub, hier(2))
        assert c.strategy == "hierarchical"
        for dtype in (float32, np.dtype(np.float64), float16, bfloat16):
            numel = 999
            draws = [np.random.default_rng([r, 7]).standard_normal(numel) for r in range(n)]
            wide = np.float64 if np.dtype(dtype) == np.float64 else np.float32
            acc = draws[0].astype(dtype).astype(wide)
            for r in range(1, n):
                acc = acc + draws[r].astype(dtype).astype(wide)
            want = (acc * wide(1.0 / n)).astype(dtype)
            x = draws[rank].astype(dtype)
            c.allreduce(x, scale=1.0 / n).wait(timeout=60)
            np.testing.assert_array_equal(x.view(np.uint8), want.view(np.uint8),
                                          err_msg=f"rank {rank} {np.dtype(dtype).name}")
            same_on_every_rank(sub, x, np.dtype(dtype).name)
        assert len(ran) == 4, ran
        c.close()
    finally:
        release(sub)
        sub.Free()


def test_node_size_must_divide_the_ranks():
    with pytest.raises(OptionError, match=r"rank 0: node_size: expected a divisor of the "
                                          r"communicator's 1 ranks, got 2"):
        Communicator(MPI.COMM_SELF, CommOptions(strategy="hierarchical", node_size=2))


def _lazy_land_until(inflight, keep):
    """The engine's landing with no early landing: calls stay in flight as long as their
    ``ahead`` allows, so a chunk's scratch reused too soon shows in the result."""
    while len(inflight) > keep:
        request, land, _args = inflight.popleft()
        request.Wait()
        if land is not None:
            land()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("lazy", [False, True], ids=["landed-early", "landed-late"])
@pytest.mark.parametrize("staged", ["", "odd", "node"],
                         ids=["in-windows", "staged", "one-node-staged"])
@pytest.mark.parametrize("nodes,per", [(2, 2), (3, 2), (2, 4)], ids=lambda v: str(v))
def test_pipelined_inter_node_step_gives_the_same_bits(comm, nodes, per, staged, lazy,
                                                       monkeypatch):
    """The inter-node step as a pipeline (chunk k between the nodes while chunk k+1 is
    summed on the node) against the same collective one chunk at a time: random values,
    every dtype, all-reduce, reduce and reduce-scatter, every array in a window, plain
    arrays on odd ranks (staged: a small scratch, many rounds), or plain arrays on the last
    node only (one node stages, the others do not: their calls between the nodes must
    still match), calls landed as soon as they completed or as late as the pipeline
    allows.
    The bits must match each other and every rank's, and lie within fp32 (fp64) rounding of
    a float64 sum; the pipelined calls must have run with chunks in flight."""
    from mpifusion.comm import engines, shm_collectives

    # a small scratch (many rounds); small buffers pipelined too
    monkeypatch.setattr(tuning, "ACTIVE", replace(tuning.ACTIVE, scratch_bytes=16 << 10,
                                                  pipe_min_bytes=0))
    if lazy:
        monkeypatch.setattr(engines, "_land_until", _lazy_land_until)
    sub = sub_comm(comm, nodes, per)
    if sub is None:
        return
    overlapped = []
    real_flush = shm_collectives._CrossPipe.flush

    def flush(pipe):
        overlapped.append(pipe.overlap and pipe.k > 1)
        return real_flush(pipe)
    monkeypatch.setattr(shm_collectives._CrossPipe, "flush", flush)
    try:
        n, rank = sub.Get_size(), sub.Get_rank()
        plain = staged == "odd" and rank % 2 or staged == "node" and rank // per == nodes - 1
        c = Communicator(sub, CommOptions(strategy="hierarchical", node_size=per,
                                          segment_bytes=2048))
        for dtype in (float32, np.dtype(np.float64), bfloat16, float16):
            for numel, root in ((1, None), (6151, None), (20011, None), (20011, n - 2)):
                draws = [np.random.default_rng([r, numel, 3]).standard_normal(numel)
                         for r in range(n)]
                region = c.reserve([(numel, dtype)], np.empty(0))
                x = region[0] if region and not plain else np.empty(numel, dtype)
                results = []
                for pipeline in (False, True):
                    monkeypatch.setattr(c, "options", c.options.with_(pipeline=pipeline))
                    x[...] = draws[rank].astype(dtype)
                    task = (c.allreduce(x, scale=1.0 / n) if root is None
                            else c.reduce(x, root=root, scale=1.0 / n))
                    task.wait(timeout=60)
                    results.append(x.copy())
                what = f"{np.dtype(dtype).name} {numel} root {root} rank {rank}"
                np.testing.assert_array_equal(results[0].view(np.uint8),
                                              results[1].view(np.uint8), err_msg=what)
                if root is None or rank == root:
                    exact = sum(d.astype(dtype).astype(np.float64) for d in draws) / n
                    wide = np.float64 if np.dtype(dtype) == np.float64 else np.float32
                    eps = np.finfo(wide).eps
                    bound = (n * eps * sum(np.abs(d.astype(dtype).astype(np.float64))
                                           for d in draws) / n
                             + np.abs(exact) * (np.finfo(np.dtype(dtype)).eps
                                                if np.dtype(dtype) != np.float64 else eps))
                    err = np.abs(results[1].astype(np.float64) - exact)
                    assert (err <= bound).all(), (what, float((err - bound).max()))
                if root is None:
                    same_on_every_rank(sub, results[1], what)
            for shard in (1, 3001, 9001):
                numel = shard * n
                draws = [np.random.default_rng([r, numel, 5]).standard_normal(numel)
                         for r in range(n)]
                region = c.reserve([(numel, dtype)], np.empty(0))
                x = region[0] if region and not plain else np.empty(numel, dtype)
                mine = slice(rank * shard, (rank + 1) * shard)
                results = []
                for pipeline in (False, True):
                    monkeypatch.setattr(c, "options", c.options.with_(pipeline=pipeline))
                    x[...] = draws[rank].astype(dtype)
                    c.reduce_scatter(x, x[mine], scale=1.0 / n).wait(timeout=60)
                    results.append(x.copy())
                what = f"reduce-scatter {np.dtype(dtype).name} {numel} rank {rank}"
                np.testing.assert_array_equal(results[0].view(np.uint8),
                                              results[1].view(np.uint8), err_msg=what)
                exact = (sum(d.astype(dtype).astype(np.float64) for d in draws) / n)[mine]
                got = results[1][mine].astype(np.float64)
                scale = np.abs(exact) + sum(np.abs(d.astype(dtype).astype(np.float64))
                                            for d in draws)[mine] / n
                tol = 4 * n * (np.finfo(np.dtype(dtype)).eps if np.dtype(dtype) != np.float64
                               else np.finfo(np.float64).eps)
                assert (np.abs(got - exact) <= tol * scale).all(), what
        assert any(overlapped), "no pipelined inter-node step ran"
        c.close()
    finally:
        release(sub)
        sub.Free()


@pytest.mark.mpi(min_size=2)
def test_ranks_that_differ_on_the_pipeline_option_meet_in_an_agreement_error(comm):
    """Pipelined and unpipelined inter-node calls would not match (non-blocking against
    blocking): a rank that asked otherwise is an AgreementError on every rank, at
    construction."""
    from mpifusion.errors import AgreementError

    with pytest.raises(AgreementError, match="pipeline"):
        Communicator(comm, hier(1, pipeline=comm.Get_rank() == 0, timeout=30.0))
