"""Refusals of the buffer's state machine under mpiexec (red-team findings): a call the state
does not allow raises before anything changes, on every rank, and the job goes on.

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests``.
"""
import time

import numpy as np
import pytest

from mpifusion import FusedCommBuffer, NanInfError, Param
from mpifusion.errors import StateError

pytestmark = pytest.mark.mpi


def test_param_storage_is_not_cleared_or_replaced_while_sync_params_is_in_flight(comm):
    """clear/reset_param_storage during sync_params(sync=False) used to be accepted: the
    all-gather then completed into the dropped buffer, and status said READY with zeros."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("one rank: sync_params has nothing to gather")
    p = Param("w", np.zeros(1000, np.float32))
    buf = FusedCommBuffer(0, [p], comm, act="reduce_scatter", timeout=60)
    lo, hi = buf.layout.shard_range(rank)
    buf.param_storage[lo:hi] = rank + 1
    if rank != 0:
        time.sleep(0.3)  # rank 0's all-gather cannot complete before the others start
    task = buf.sync_params(sync=False)
    if rank == 0:
        storage, data = buf.param_storage, p.data
        for call in (buf.clear_param_storage, buf.reset_param_storage):
            with pytest.raises(StateError, match=r"rank 0: buffer 0: (clear|reset)_param_storage"
                                                 r": sync_params is still in flight.*wait\(\)"):
                call()
            assert buf.status == buf.Status.SYNCING
            assert buf.param_storage is storage and p.data is data
    task.wait()
    assert buf.status == buf.Status.READY
    want = np.zeros(buf.buffer_size, np.float32)
    for r in range(n):
        a, b = buf.layout.shard_range(r)
        want[a:b] = r + 1
    np.testing.assert_array_equal(buf.param_storage, want)
    np.testing.assert_array_equal(p.data, want[:1000])
    buf.clear_param_storage()  # once it completed: allowed
    assert p.data is None and buf.status == buf.Status.SHARDED
    buf.reset_param_storage()
    buf.sync_params()
    np.testing.assert_array_equal(p.data, 0.0)  # the fresh buffer's zeros, gathered


@pytest.mark.parametrize("act", ["all_reduce", "reduce_scatter"])
def test_clear_grad_storage_mid_step_keeps_the_checked_in_grads(comm, act):
    """release_grads: clear_grad_storage() after one param checked in used to drop its grad,
    which was then reduced as zero."""
    n, rank = comm.Get_size(), comm.Get_rank()
    a, b = Param("a", np.zeros(8, np.float32)), Param("b", np.zeros(8, np.float32))
    buf = FusedCommBuffer(0, [a, b], comm, act=act, release_grads=True, timeout=60)
    buf.add_grad(b, grad=np.full(8, 3.0 * (rank + 1), np.float32))
    with pytest.raises(StateError, match=rf"rank {rank}: buffer 0: clear_grad_storage: .*b.*"
                                         r"scale_grads\(\) first"):
        buf.clear_grad_storage()
    assert buf.checked_in == 1 and buf.grad_storage is not None
    buf.add_grad(a, grad=np.full(8, 5.0 * (rank + 1), np.float32))
    buf.scale_grads()
    mean = (n + 1) / 2
    got = buf.grad_storage
    for name, value in (("a", 5.0), ("b", 3.0)):
        slot = buf.layout[name]
        lo, hi = slot.offset, slot.end
        if act == "reduce_scatter":  # this rank's shard of the slot holds the mean
            s0, s1 = buf.layout.shard_range(rank)
            lo, hi = max(lo, s0), min(hi, s1)
        if lo < hi:
            np.testing.assert_allclose(got[lo:hi], value * mean, rtol=1e-6)
    buf.clear_grad_storage()
    assert buf.grad_storage is None


def test_naninf_error_undoes_the_add_grad_and_the_next_step_works(comm):
    """A NaN found when the last param checks in used to stay added and checked in; then
    scale_grads said 'communication was not started (use_comm=False ...)'."""
    n, rank = comm.Get_size(), comm.Get_rank()
    ps = [Param(f"w{i}", np.zeros(5 + i, np.float32)) for i in range(3)]
    buf = FusedCommBuffer(0, ps, comm, act="all_reduce", check_naninf=True, timeout=60)
    for p in ps[:2]:
        buf.add_grad(p, grad=np.full(p.shape, rank + 1.0, np.float32))
    kept = buf.grad_storage.copy()
    bad = np.full(ps[2].shape, 1.0, np.float32)
    bad[0] = np.nan  # on every rank: all raise, none waits in the collective
    with pytest.raises(NanInfError, match=rf"rank {rank}: .*w2 \(1 of 7\).*changed nothing"):
        buf.add_grad(ps[2], grad=bad)
    assert buf.grad_storage.tobytes() == kept.tobytes()
    assert buf.missing_params() == ["w2"] and buf.task is None
    buf.add_grad(ps[2], grad=np.full(7, 2.0 * (rank + 1), np.float32))  # repaired
    buf.scale_grads()
    mean = (n + 1) / 2
    np.testing.assert_allclose(ps[0].grad, mean, rtol=1e-6)
    np.testing.assert_allclose(ps[2].grad, 2 * mean, rtol=1e-6)
    buf.grad_storage[...] = 0  # and a clean step after it
    for p in ps:
        buf.add_grad(p, grad=np.full(p.shape, 1.0, np.float32))
    buf.scale_grads()
    np.testing.assert_allclose(ps[1].grad, 1.0, rtol=1e-6)


def test_closed_buffer_refuses_the_last_add_grad_on_every_rank(comm):
    rank = comm.Get_rank()
    a, b = Param("a", np.zeros(4, np.float32)), Param("b", np.zeros(4, np.float32))
    buf = FusedCommBuffer(0, [a, b], comm, act="all_reduce", timeout=60)
    buf.close()
    for p in (a, b):
        with pytest.raises(StateError, match=rf"rank {rank}: buffer 0: add_grad: .*closed"):
            buf.add_grad(p, grad=np.ones(4, np.float32))
    with pytest.raises(StateError, match="mark_unused: .*closed"):
        buf.mark_unused(a, b)
    assert buf.checked_in == 0 and not a.grad.any() and not b.grad.any()
