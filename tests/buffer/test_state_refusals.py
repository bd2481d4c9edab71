"""Refusals of the buffer's state machine: a call the state does not allow raises a clear
``FusionError`` before anything changes (grads, grad references, counters, buffers), on
every rank, and the step then goes on normally. One-process cases run on COMM_SELF or with
no comm_group; the ``mpi`` ones at every rank count.
"""
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import (FusedCommBuffer, NanInfError, Param, build_reduce_scatter_buffer,
                       flatten_dense_tensors)
from mpifusion.arrays import backend
from mpifusion.errors import CheckInError, GradError, LayoutError, StateError

from tests.refusal import assert_unchanged, snapshot

SELF = MPI.COMM_SELF


def make(n=3, size=6):
    return [Param(f"w{i}", np.zeros(size + i, np.float32)) for i in range(n)]


def ones(p, value=1.0):
    return np.full(p.shape, value, np.float32)


# ------------------------------------------------------------------ finding 5: clear mid-step
@pytest.mark.parametrize("release", [True, False])
@pytest.mark.parametrize("acc_steps", [1, 2])
def test_clear_grad_storage_mid_step_is_refused(release, acc_steps):
    ps = make()
    buf = FusedCommBuffer(0, ps, SELF, act="all_reduce", release_grads=release,
                          acc_steps=acc_steps)
    buf.add_grad(ps[1], grad=ones(ps[1], 3.0))  # w1 has a micro-step (checked in at acc 1)
    before = snapshot(buf, ps)
    with pytest.raises(StateError, match=r"rank 0: buffer 0: clear_grad_storage: step 0 .*"
                                         r"w1.*scale_grads\(\) first"):
        buf.clear_grad_storage()
    assert_unchanged(before, buf, ps)
    for _ in range(acc_steps):  # the step goes on and keeps w1's grad
        for p in ps:
            if not (p is ps[1] and buf._checkin.steps["w1"] == acc_steps):
                buf.add_grad(p, grad=ones(p, 5.0 if p is not ps[1] else 3.0))
    buf.scale_grads()
    np.testing.assert_array_equal(ps[1].grad, 3.0 * acc_steps)
    np.testing.assert_array_equal(ps[0].grad, 5.0 * acc_steps)
    buf.clear_grad_storage()  # between steps: allowed
    assert buf.grad_storage is None


def test_clear_grad_storage_after_reset_is_allowed():
    ps = make()
    buf = FusedCommBuffer(0, ps, SELF, act="all_reduce", release_grads=True)
    buf.add_grad(ps[0], grad=ones(ps[0]))
    buf.reset()  # the step is dropped: nothing to lose
    buf.clear_grad_storage()
    assert buf.grad_storage is None and ps[0].grad is None


# ------------------------------------------------------------------ finding 8: closed / no comm
def test_add_grad_and_mark_unused_after_close_change_nothing():
    ps = make()
    buf = FusedCommBuffer(0, ps, SELF, act="all_reduce")
    buf.add_grad(ps[0], grad=ones(ps[0]))
    buf.close()
    before = snapshot(buf, ps)
    calls = [lambda: buf.add_grad(ps[1], grad=ones(ps[1])),
             lambda: buf.add_grad(ps[1], grad=ones(ps[1]), use_comm=False),
             lambda: buf.mark_unused(ps[1]),
             lambda: buf.mark_unused(ps[1], ps[2])]
    for call in calls:
        with pytest.raises(StateError, match=r"rank 0: buffer 0: (add_grad|mark_unused): "
                                             r"the buffer was closed"):
            call()
        assert_unchanged(before, buf, ps)


def test_last_check_in_of_a_closed_buffer_changes_nothing():
    ps = make(2)
    buf = FusedCommBuffer(0, ps, SELF, act="all_reduce")
    buf.add_grad(ps[0], grad=ones(ps[0]))
    buf.close()
    before = snapshot(buf, ps)
    with pytest.raises(StateError, match="closed"):
        buf.add_grad(ps[1], grad=ones(ps[1]))  # used to be added and checked in first
    assert_unchanged(before, buf, ps)


@pytest.mark.parametrize("how", ["add_grad", "mark_unused"])
def test_no_comm_group_refuses_the_starting_check_in_before_any_change(how):
    ps = make(2)
    buf = FusedCommBuffer(0, ps, None, act="all_reduce")
    buf.add_grad(ps[0], grad=ones(ps[0], 2.0))  # not the last: accumulates as before
    ps[1].grad[...] = 7.0  # stale values mark_unused would zero
    before = snapshot(buf, ps)
    call = ((lambda: buf.add_grad(ps[1], grad=ones(ps[1])))
            if how == "add_grad" else (lambda: buf.mark_unused(ps[1])))
    with pytest.raises(StateError, match=rf"rank \d+: buffer 0: {how}: .*without a "
                                         rf"comm_group.*use_comm=False"):
        call()
    assert_unchanged(before, buf, ps)
    with pytest.raises(CheckInError, match="missing w1"):
        buf.scale_grads()
    if how == "add_grad":
        buf.add_grad(ps[1], grad=ones(ps[1]), use_comm=False)
    else:
        buf.mark_unused(ps[1], use_comm=False)
    buf.scale_grads()  # one process: nothing to reduce
    np.testing.assert_array_equal(ps[0].grad, 2.0)
    np.testing.assert_array_equal(ps[1].grad, 8.0 if how == "add_grad" else 0.0)


# ------------------------------------------------------------------ finding 9: NaN undone
NAN_CASES = {
    "plain": dict(),
    "second_micro_step": dict(acc_steps=2),
    "release_grads": dict(release_grads=True),
    "release_grads_acc2": dict(release_grads=True, acc_steps=2),
    "reduce_scatter_release": dict(act="reduce_scatter", release_grads=True),
    "free_grads_in_comm": dict(act="reduce_scatter", release_grads=True,
                               free_grads_in_comm=True),
    "main_grad": dict(use_main_grad=True),
}


@pytest.mark.parametrize("case", sorted(NAN_CASES))
@pytest.mark.parametrize("how", ["add_grad", "mark_unused"])
def test_naninf_error_undoes_the_call_and_the_next_step_works(case, how):
    kw = {"act": "all_reduce", "check_naninf": True, **NAN_CASES[case]}
    acc = kw.get("acc_steps", 1)
    ps = make()
    buf = FusedCommBuffer(0, ps, SELF, **kw)
    for step in range(3):  # step 1 finds the NaN; steps 0 and 2 are clean
        bad = step == 1
        for k in range(acc):
            for i, p in enumerate(ps):
                last = i == len(ps) - 1 and k == acc - 1
                if last:
                    break
                g = ones(p, 1.0 + i)
                if bad and i == 0 and how == "mark_unused":
                    g[0] = np.inf  # a bad grad added earlier: found at the last check-in
                buf.add_grad(p, grad=g)
        p = ps[-1]
        if bad:
            if how == "add_grad":
                g = ones(p, 3.0)
                g[1] = np.nan
                call = lambda: buf.add_grad(p, grad=g)  # noqa: E731
            else:
                call = lambda: buf.mark_unused(p)  # noqa: E731
            before = snapshot(buf, ps)
            with pytest.raises(NanInfError, match=r"rank 0: buffer 0: step 1: .*NaN/Inf.*"
                                                  r"this call changed nothing"):
                call()
            assert_unchanged(before, buf, ps)
            assert buf.missing_params() == [p.name]
            if how == "mark_unused":  # the bad grad is still there: drop the step
                buf.reset(zero_grads=True)
                continue
        buf.add_grad(p, grad=ones(p, 3.0))  # a good grad after the error: the step finishes
        assert buf.task is not None
        buf.scale_grads()
        if kw.get("free_grads_in_comm"):
            continue  # the grads are now this rank's shard
        view = buf.grad_storage
        for i, q in enumerate(ps):
            slot = buf.layout[q.name]
            want = (1.0 + i) * acc
            np.testing.assert_array_equal(view[slot.offset:slot.end], want,
                                          err_msg=f"{case} step {step} {q.name}")
        if kw.get("release_grads"):
            buf.clear_grad_storage()
        else:
            buf.grad_storage[...] = 0


def test_naninf_error_from_explicit_comm_grads_changes_nothing():
    ps = make(2)
    buf = FusedCommBuffer(0, ps, SELF, act="all_reduce", check_naninf=True)
    g = ones(ps[1])
    g[0] = np.nan
    buf.add_grad(ps[0], grad=ones(ps[0]), use_comm=False)
    buf.add_grad(ps[1], grad=g, use_comm=False)  # use_comm=False: no check yet
    before = snapshot(buf, ps)
    with pytest.raises(NanInfError, match="w1 \\(1 of 7\\)"):
        buf.comm_grads()
    assert_unchanged(before, buf, ps)


# ------------------------------------------------------------------ finding 11: no data
def released_param():
    p = Param("w", np.ones(4, np.float32))
    holder = FusedCommBuffer(0, [p], SELF, act="reduce_scatter")
    holder.clear_param_storage()
    assert p.data is None
    return p


@pytest.mark.parametrize("kw", [dict(act="all_reduce", fuse_param=True),
                                dict(act="all_reduce"), dict(act="reduce_scatter"),
                                dict(act="all_reduce", release_grads=True)])
def test_a_param_without_data_is_refused_at_construction(kw):
    p = released_param()
    other = Param("v", np.ones(3, np.float32))
    with pytest.raises(LayoutError, match=r"rank 0: buffer 1: param 'w': has no data .*"
                                          r"clear_param_storage"):
        FusedCommBuffer(1, [other, p], SELF, **kw)
    assert p.data is None and p.grad is not None  # nothing adopted, not even NaN
    assert other.grad is None


def test_the_storage_helpers_refuse_a_param_without_data():
    p = released_param()
    with pytest.raises(LayoutError, match="param 'w': has no data"):
        flatten_dense_tensors([p], fuse_param=True)
    with pytest.raises(LayoutError, match="param 'w': has no data"):
        build_reduce_scatter_buffer([p], 1, 0)
    assert p.data is None


# ------------------------------------------------------------------ finding 12: messages
def test_mark_unused_of_one_param_twice_says_given_twice():
    ps = make(2)
    buf = FusedCommBuffer(0, ps, SELF, act="all_reduce")
    before = snapshot(buf, ps)
    with pytest.raises(GradError, match=r"mark_unused: param 'w0' given twice"):
        buf.mark_unused(ps[0], ps[0])
    assert_unchanged(before, buf, ps)
    buf.add_grad(ps[1], grad=ones(ps[1]))
    with pytest.raises(GradError, match=r"param 'w1' already checked in"):
        buf.mark_unused(ps[1], ps[1])


def test_missing_params_say_how_many_micro_steps_they_have():
    ps = make(3)
    buf = FusedCommBuffer(0, ps, SELF, act="all_reduce", acc_steps=2)
    buf.add_grad(ps[0], grad=ones(ps[0]))
    buf.add_grad(ps[1], grad=ones(ps[1]))
    buf.add_grad(ps[1], grad=ones(ps[1]))
    with pytest.raises(CheckInError, match=r"1/3 params checked in: missing "
                                           r"w0 \(1 of 2 micro-steps\), w2 \(expected"):
        buf.scale_grads()


# ------------------------------------------------------------------ finding 13: device choice
def spy_zeros(monkeypatch):
    likes = []
    real = backend.zeros

    def zeros(numel, dtype, like=None):
        likes.append(like)
        return real(numel, dtype, like)

    monkeypatch.setattr(backend, "zeros", zeros)
    return likes


def test_reset_param_storage_allocates_like_the_construction_device(monkeypatch):
    """grad_storage is None with release_grads (and after clear_grad_storage): allocating
    like it would put a GPU buffer's params on the host."""
    ps = make(2)
    buf = FusedCommBuffer(0, ps, SELF, act="reduce_scatter", release_grads=True)
    assert buf.grad_storage is None
    likes = spy_zeros(monkeypatch)
    buf.clear_param_storage()
    buf.reset_param_storage()
    assert len(likes) == 1 and likes[0] is not None and likes[0] is buf._like
    assert backend.device_of(buf._like) == ps[0].device == "cpu" and buf._like.size == 0


def test_grad_buffer_of_a_param_without_data_allocates_like_the_construction_device(
        monkeypatch):
    """release_grads: the first micro-step allocates the grad buffer; after
    clear_param_storage the param's data (what it was allocated like) is None."""
    ps = make(2)
    buf = FusedCommBuffer(0, ps, SELF, act="reduce_scatter", release_grads=True)
    buf.clear_param_storage()
    likes = spy_zeros(monkeypatch)
    buf.add_grad(ps[0], grad=ones(ps[0], 2.0))
    assert len(likes) == 1 and likes[0] is not None and likes[0] is buf._like
    np.testing.assert_array_equal(ps[0].grad, 2.0)


# ----------------------------------------------------------------------------------- under mpiexec


@pytest.mark.mpi
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


@pytest.mark.mpi
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


@pytest.mark.mpi
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


@pytest.mark.mpi
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
