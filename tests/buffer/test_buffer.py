"""FusedCommBuffer: in one process (COMM_SELF) its layouts, options and bad input that changes
nothing; under mpiexec (1, 2, 3, 4 and 8 ranks) its results against float64 references.
"""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import (HOOK_ACTION, FusedCommBuffer, HookAction, Param, assign_group_by_size,
                       build_reduce_scatter_buffer, filter_params, flatten_dense_tensors,
                       fused_parameters, get_group_size, obtain_storage)
from mpifusion.dtypes import bfloat16
from mpifusion.errors import CheckInError, GradError, LayoutError, NanInfError

from tests.reference import assert_close, bound, grad_for, local_sum, reduced
from tests.refusal import assert_unchanged, snapshot

SELF = MPI.COMM_SELF


def params(dtype=np.float32, shapes=((17, 257), (1,), (3, 5))):
    return [Param(f"w{i}", np.arange(np.prod(s), dtype=np.float64).reshape(s).astype(dtype))
            for i, s in enumerate(shapes)]


def test_public_names_and_alias():
    assert HOOK_ACTION is HookAction
    assert HOOK_ACTION.ALL_REDUCE == 0 and HOOK_ACTION.REDUCE == 1 and HOOK_ACTION.REDUCE_SCATTER == 2
    assert HookAction.parse("reduce-scatter") is HookAction.REDUCE_SCATTER


def test_flatten_dense_tensors_views_and_offsets():
    ps = params()
    originals = [p.data.copy() for p in ps]
    param_buf, grad_buf = flatten_dense_tensors(ps, use_main_grad=False, fuse_param=True)
    assert param_buf.size == grad_buf.size == 4416 + 64 + 64
    assert param_buf.ctypes.data % 256 == 0
    for p, orig in zip(ps, originals):
        np.testing.assert_array_equal(p.data, orig)
        assert np.shares_memory(p.data, param_buf) and np.shares_memory(p.grad, grad_buf)
    p = ps[1]
    p.grad += 3.0
    assert grad_buf[4416] == 3.0 and grad_buf[4417] == 0.0  # padding stays zero
    none, total, offsets = flatten_dense_tensors(params(), release_grad=True)
    assert none is None and total == 4544 and offsets == {"w0": 0, "w1": 4416, "w2": 4480}


def test_main_grad_buffer_keeps_element_offsets():
    ps = params(bfloat16)
    (grad_buf,) = flatten_dense_tensors(ps, use_main_grad=True, fuse_param=False)
    assert grad_buf.dtype == np.float32
    # bf16 aligns to 128 elements: w0 4369 -> 4480, w1 -> 128, w2 -> 128
    assert [p.main_grad.ctypes.data - grad_buf.ctypes.data for p in ps] == [0, 4480 * 4, 4608 * 4]


def test_build_reduce_scatter_buffer_returns_paddles_tuple():
    ps = params()
    views, total, pbuf, gbuf, ipc = build_reduce_scatter_buffer(ps, 4, 2)
    assert total == 4608 + 256 + 256 and pbuf.size == gbuf.size == total and ipc is None
    assert views["w0"].param_begin == 2 * total // 4 and views["w1"].has_effective_slice_param is False


def test_groups_and_group_size_estimate():
    ps = params(shapes=((100,), (100,), (100,)))
    groups = assign_group_by_size(ps, group_size=800)
    assert [[p.name for p in g] for g in groups.values()] == [["w0", "w1"], ["w2"]]
    assert get_group_size(ps, group_size=800) == pytest.approx(
        [800 / 1024 ** 3 * 3, 400 / 1024 ** 3 * 3])


@pytest.mark.parametrize("kwargs, match", [
    (dict(act=None), "act"),
    (dict(act="broadcast"), "act"),
    (dict(act=HookAction.REDUCE), "dst"),
    (dict(act=HookAction.REDUCE, dst=1), r"dst.*global ranks \[0\], got 1"),
    (dict(act=HookAction.ALL_REDUCE, dst=0), "dst"),
    (dict(act=HookAction.REDUCE_SCATTER, dst=0), "dst"),
    (dict(act=HookAction.ALL_REDUCE, fuse_param=True, release_grads=True), "fuse_param and release_grads"),
    (dict(act=HookAction.REDUCE_SCATTER, fuse_param=True), "fuse_param"),
    (dict(act=HookAction.REDUCE_SCATTER, free_grads_in_comm=True), "release_grads"),
    (dict(act=HookAction.ALL_REDUCE, free_grads_in_comm=True, release_grads=True), "REDUCE_SCATTER"),
    (dict(act=HookAction.REDUCE_SCATTER, free_grads_in_comm=True, release_grads=True, acc_steps=2),
     "acc_steps"),
    (dict(act=HookAction.ALL_REDUCE, acc_steps=0), "acc_steps"),
])
def test_invalid_options_are_refused_with_the_option_named(kwargs, match):
    ps = params()
    before = [p.data.copy() for p in ps]
    with pytest.raises(LayoutError, match=match) as err:
        FusedCommBuffer(0, ps, SELF, **kwargs)
    assert "rank 0" in str(err.value)
    for p, b in zip(ps, before):  # nothing was fused
        assert p.grad is None and np.array_equal(p.data, b)


def test_mixed_dtypes_and_untrainable_params_are_refused():
    ps = params() + [Param("h", np.zeros(4, np.float16))]
    with pytest.raises(LayoutError, match="'h'.*float16"):
        FusedCommBuffer(0, ps, SELF, act=HookAction.ALL_REDUCE)
    for flag, value in (("trainable", False), ("stop_gradient", True)):  # one flag, as in Paddle
        ps = params()
        setattr(ps[2], flag, value)
        assert ps[2].trainable is False and ps[2].stop_gradient is True
        for act in HookAction:
            with pytest.raises(LayoutError, match="rank 0: param 'w2'.*trainable.*stop_gradient"):
                FusedCommBuffer(0, ps, SELF, act=act, dst=0 if act == HookAction.REDUCE else -1)
            assert all(p.grad is None for p in ps)


def test_use_main_grad_none_follows_first_param():
    ps = params(bfloat16)
    ps[0].main_grad = np.ones(ps[0].shape, np.float32)
    buf = FusedCommBuffer(0, ps, SELF, act=HookAction.ALL_REDUCE)
    assert buf.use_main_grad and buf.grad_storage.dtype == np.float32
    assert (ps[0].main_grad == 0).all()  # a main_grad held before is dropped: as in Paddle,
    assert (buf.grad_storage == 0).all()  # the buffer starts at zero
    assert all(p.main_grad is not None for p in ps)


@pytest.fixture
def buf_and_params():
    ps = params()
    return FusedCommBuffer(3, ps, SELF, act=HookAction.ALL_REDUCE, acc_steps=2), ps


def test_unknown_param(buf_and_params):
    buf, ps = buf_and_params
    before = snapshot(buf, ps)
    with pytest.raises(GradError, match=r"rank 0: buffer 3: param 'x': not a param"):
        buf.add_grad(Param("x", np.zeros(3, np.float32)))
    with pytest.raises(GradError, match="'w0': not a param"):  # same name, other object
        buf.add_grad(Param("w0", np.zeros((17, 257), np.float32)))
    assert_unchanged(before, buf, ps)


@pytest.mark.parametrize("grad, match", [
    (np.ones((257, 17), np.float32), r"shape expected \(17, 257\), got \(257, 17\)"),
    (np.ones((17, 257), np.float16), "dtype expected float32, got float16"),
    (np.ones(17 * 257, np.float32), "shape"),
])
def test_wrong_grad_changes_nothing(buf_and_params, grad, match):
    buf, ps = buf_and_params
    buf.add_grad(ps[0], grad=np.ones((17, 257), np.float32))
    before = snapshot(buf, ps)
    with pytest.raises(GradError, match=match):
        buf.add_grad(ps[0], grad=grad)
    assert_unchanged(before, buf, ps)


def test_more_add_grad_than_acc_steps(buf_and_params):
    buf, ps = buf_and_params
    buf.add_grad(ps[1], grad=np.ones(1, np.float32))
    buf.add_grad(ps[1], grad=np.ones(1, np.float32))
    before = snapshot(buf, ps)
    with pytest.raises(GradError, match="'w1': already checked in 2 time"):
        buf.add_grad(ps[1], grad=np.ones(1, np.float32))
    assert_unchanged(before, buf, ps)
    assert ps[1].grad[0] == 2.0


def test_replaced_grad_is_refused(buf_and_params):
    buf, ps = buf_and_params
    ps[2].grad = ps[2].grad + 1.0  # not in place: the view is lost
    before = snapshot(buf, ps)
    with pytest.raises(GradError, match="'w2': the address of its grad changed"):
        buf.add_grad(ps[2])
    assert_unchanged(before, buf, ps)


def test_comm_before_all_checked_in_names_missing_params(buf_and_params):
    buf, ps = buf_and_params
    for p in ps[:2]:
        buf.add_grad(p)
        buf.add_grad(p)
    buf.add_grad(ps[2])
    before = snapshot(buf, ps)
    with pytest.raises(CheckInError, match=r"rank 0: buffer 3: .*2/3 params checked in: missing w2"):
        buf.comm_grads()
    with pytest.raises(CheckInError, match="missing w2"):
        buf.scale_grads()
    assert_unchanged(before, buf, ps)
    buf.add_grad(ps[2])  # the step can still finish
    buf.scale_grads()


def test_use_comm_false_then_explicit_comm(buf_and_params):
    buf, ps = buf_and_params
    for _ in range(2):
        for p in ps:
            buf.add_grad(p, use_comm=False, grad=np.full(p.shape, 2.0, np.float32))
    assert buf.task is None
    buf.comm_grads()
    buf.scale_grads()
    assert (ps[0].grad == 4.0).all()


def test_naninf_check_names_param_and_changes_nothing(monkeypatch):
    monkeypatch.setenv("MPIFUSION_CHECK_NANINF", "1")
    ps = params()
    buf = FusedCommBuffer(0, ps, SELF, act=HookAction.ALL_REDUCE, scale_after_comm=False)
    bad = np.zeros((3, 5), np.float32)
    bad[1, 2], bad[2, 2] = np.nan, np.inf
    buf.add_grad(ps[0], grad=np.ones((17, 257), np.float32))
    buf.add_grad(ps[1], grad=np.ones(1, np.float32))
    with pytest.raises(NanInfError, match=r"rank 0: buffer 0: step 0: .*w2 \(2 of 15\)"):
        buf.add_grad(ps[2], grad=bad)
    assert (ps[0].grad == 1.0).all()  # not pre-scaled: the check runs before anything else


def test_all_stop_gradient_skips_communication():
    ps = params()
    buf = FusedCommBuffer(0, ps, SELF, act=HookAction.ALL_REDUCE, scale_after_comm=False)
    for p in ps:  # frozen after fusing (fusing a frozen param is refused)
        p.stop_gradient = True
    for p in ps:
        buf.add_grad(p, grad=np.full(p.shape, 3.0, np.float32))
    assert buf.task is None
    buf.scale_grads()
    assert (ps[0].grad == 3.0).all() and buf.checked_in == 0


def test_release_grads_moves_own_grad_into_fresh_buffer():
    ps = params()
    ps[0].grad = np.full((17, 257), 5.0, np.float32)
    buf = FusedCommBuffer(0, ps, SELF, act=HookAction.ALL_REDUCE, release_grads=True, acc_steps=2)
    assert buf.grad_storage is None and buf.param_storage is None
    buf.add_grad(ps[0])
    assert np.shares_memory(ps[0].grad, buf.grad_storage) and (ps[0].grad == 5.0).all()
    ps[0].grad += 1.0  # second micro-step accumulates in the view
    buf.add_grad(ps[0])
    for p in ps[1:]:
        buf.add_grad(p, grad=np.ones(p.shape, np.float32))
        buf.add_grad(p, grad=np.ones(p.shape, np.float32))
    buf.scale_grads()
    assert (ps[0].grad == 6.0).all() and (ps[1].grad == 2.0).all()
    buf.clear_grad_storage()
    assert buf.grad_storage is None and ps[0].grad is None


def test_release_grads_refuses_a_misfit_own_grad_and_changes_nothing():
    ps = params()
    buf = FusedCommBuffer(0, ps, SELF, act=HookAction.ALL_REDUCE, release_grads=True)
    ps[0].grad = np.ones((3, 3), np.float32)  # rebound by the user to the wrong shape
    for call in (lambda: buf.add_grad(ps[0]), lambda: buf.mark_unused(ps[1], ps[0])):
        with pytest.raises(GradError, match="w0.*shape"):
            call()
        assert buf.grad_storage is None and buf.checked_in == 0 and ps[1].grad is None


def test_add_grad_after_clear_grad_storage_is_refused():
    ps = params()
    buf = FusedCommBuffer(0, ps, SELF, act=HookAction.ALL_REDUCE)
    buf.clear_grad_storage()
    with pytest.raises(GradError, match="rank 0.*w0.*clear_grad_storage"):
        buf.add_grad(ps[0], grad=np.ones(ps[0].shape, np.float32))
    assert buf.checked_in == 0 and buf.missing_params() == [p.name for p in ps]


def test_fuse_param_gives_one_flat_param_with_flat_grad():
    ps = params()
    storage, buffers = obtain_storage(ps, fuse_param=True, comm_overlap=True,
                                      act=HookAction.ALL_REDUCE, comm_group=SELF, clip=False, dist=True)
    assert len(storage) == 1 and len(buffers) == 1
    fused = storage[0]
    assert fused.need_clip is False and fused.is_distributed is True
    assert np.shares_memory(fused.data, ps[0].data) and np.shares_memory(fused.grad, ps[2].grad)
    for p in reversed(ps):
        p.backward(np.ones(p.shape, np.float32))  # emulated backward hooks
    buffers[0].scale_grads()
    assert fused.grad[:4369].sum() == 4369


def test_fused_parameters_split_order_and_decay():
    ps = [Param("a.fp32", np.zeros(4, np.float32)),
          Param("b.bf16", np.zeros(4, bfloat16)),
          Param("c.fp32.dist", np.zeros(4, np.float32), is_distributed=True),
          Param("d.fp32.noclip", np.zeros(4, np.float32), need_clip=False),
          Param("e.fp32.bias", np.zeros(4, np.float32))]
    decay_fn = lambda name: not name.endswith("bias")  # noqa: E731
    decay, fused, buffers = fused_parameters(ps, act=HookAction.ALL_REDUCE, comm_overlap=True,
                                             comm_group=SELF, apply_decay_param_fun=decay_fn)
    members = [[p.name for p in b.params] for b in buffers]
    # (fp32, dist, clip) in product([True, False]) order, decay before other in each split
    assert members == [["c.fp32.dist"], ["a.fp32"], ["e.fp32.bias"], ["d.fp32.noclip"], ["b.bf16"]]
    assert len(decay) == 4 and len(fused) == 5
    assert [f.is_distributed for f in fused] == [True, False, False, False, False]
    assert [f.need_clip for f in fused] == [True, True, True, False, True]


def test_fused_parameters_group_params_and_defaults():
    ps = params()
    groups = [{"params": ps[:2], "lr": 0.1}, {"params": ps[2:]}]
    ps[0].optimize_attr = {"learning_rate": 0.5}
    updated, buffers = fused_parameters(groups, act="all_reduce", group_params=True,
                                        comm_overlap=True, comm_group=SELF)
    assert len(updated) == 2 and updated[0]["lr"] == 0.1 and len(buffers) == 2
    assert updated[0]["params"][0].optimize_attr == {"learning_rate": 0.5}
    with pytest.raises(LayoutError, match="dst"):
        fused_parameters(params())  # default act is REDUCE, which needs dst
    with pytest.raises(LayoutError, match="comm_group"):
        fused_parameters(params(), act=HookAction.REDUCE_SCATTER, comm_overlap=True)


def test_filter_params_refuses_two_half_dtypes():
    ps = [Param("x", np.zeros(2, np.float16)), Param("y", np.zeros(2, bfloat16))]
    with pytest.raises(LayoutError, match="'y'"):
        filter_params(ps, is_fp32=False, is_distributed=False, need_clip=True)


@pytest.mark.parametrize("kwargs, expected", [
    ({"timeout": -1}, "timeout: expected a number of seconds"),
    ({"timeout": "soon"}, "timeout: expected"),
    ({"order": "bogus"}, "order: expected one of strict, negotiated"),
    ({"check_naninf": "maybe"}, "check_naninf: expected a boolean"),
    ({"comm_options": {"strategy": "thread"}}, "comm_options: expected a mpifusion.CommOptions"),
])
def test_bad_comm_option_names_rank_buffer_and_option(kwargs, expected):
    from mpifusion.errors import OptionError

    with pytest.raises(OptionError, match=f"^rank 0: buffer 7: {expected}"):
        FusedCommBuffer(7, params(), SELF, act=HookAction.ALL_REDUCE, **kwargs)


# ------------------------------------------------------- under mpiexec, against float64 references


# awkward sizes: a 17x257 matrix, a 1-element param, a small 2-D one, one exactly 64 floats
SHAPES = [(17, 257), (1,), (3, 5), (64,), (2, 33)]


def make_params(dtype, tag="w"):
    return [Param(f"{tag}{i}", np.full(shape, 0.5 + i, dtype=dtype)) for i, shape in enumerate(SHAPES)]


def grad_view(p, main_grad):
    return p.main_grad if main_grad else p.grad


def expected_buffer(buf, params, step, acc, main_grad, grad_dtype, avg, prescale, scale_after):
    """Expected float64 content of the whole grad buffer on this rank, and its tolerance."""
    n, rank = buf.nranks, buf.rank
    exp = np.zeros(buf.buffer_size, np.float64)
    tol = np.full(buf.buffer_size, 1e-30)
    act = buf.act
    lo, hi = buf.layout.shard_range(rank) if act == HookAction.REDUCE_SCATTER else (0, 0)
    for i, p in enumerate(params):
        slot = buf.layout[p.name]
        total, mag = reduced(n, step, acc, i, p.shape, grad_dtype)
        mine = local_sum(rank, step, acc, i, p.shape, grad_dtype)
        # what a region holds when it received the reduction, and when it did not
        got_reduced = total / n if (avg or prescale or scale_after) else total
        kept_local = mine if avg else (mine / n if (prescale or scale_after) else mine)
        full_r = np.zeros(slot.padded_numel)
        full_l = np.zeros(slot.padded_numel)
        full_r[:slot.numel] = got_reduced.ravel()
        full_l[:slot.numel] = kept_local.ravel()
        tol_slot = np.full(slot.padded_numel, 1e-30)
        tol_slot[:slot.numel] = bound(mag, n, acc, grad_dtype).ravel()
        region = slice(slot.offset, slot.padded_end)
        if act == HookAction.ALL_REDUCE or (act == HookAction.REDUCE and rank == buf.dst_rank):
            exp[region] = full_r
        elif act == HookAction.REDUCE:
            exp[region] = full_l
        else:
            idx = np.arange(slot.offset, slot.padded_end)
            exp[region] = np.where((idx >= lo) & (idx < hi), full_r, full_l)
        tol[region] = tol_slot
    return exp, tol


MATRIX = list(itertools.product(
    [HookAction.ALL_REDUCE, HookAction.REDUCE, HookAction.REDUCE_SCATTER],
    [1, 3],          # acc_steps
    [False, True],   # use_main_grad (bf16 params, fp32 main grads)
    [False, True],   # release_grads
    [False, True],   # use_reduce_avg
    [False, True],   # scale_after_comm
))


@pytest.mark.matrix
@pytest.mark.mpi
@pytest.mark.parametrize("act, acc, main_grad, release, avg, scale_after", MATRIX,
                         ids=lambda v: getattr(v, "name", str(v)))
def test_reduction_matrix(comm, act, acc, main_grad, release, avg, scale_after):
    n = comm.Get_size()
    dtype = "bfloat16" if main_grad else "float32"
    grad_dtype = "float32"
    params = make_params(np.dtype("float32") if not main_grad else _bf16())
    dst = n - 1 if act == HookAction.REDUCE else -1
    buf = FusedCommBuffer(7, params, comm, acc_steps=acc, act=act, dst=dst,
                          use_main_grad=main_grad, release_grads=release,
                          use_reduce_avg=avg, scale_after_comm=scale_after)
    assert buf.layout.dtype == dtype
    prescale = not scale_after and not avg
    for step in range(2):  # a second step proves the reset between steps
        for k in range(acc):
            for i in reversed(range(len(params))):  # backward order
                p = params[i]
                g = grad_for(comm.Get_rank(), step, k, i, p.shape, grad_dtype)
                if i % 2 == 0:
                    buf.add_grad(p, grad=g)                   # framework hands the grad in
                elif release and k == 0:
                    setattr(p, "main_grad" if main_grad else "grad", g.copy())  # own grad
                    buf.add_grad(p)
                else:
                    grad_view(p, main_grad)[...] += g          # backward wrote into the view
                    buf.add_grad(p)
        assert buf.checked_in == len(params)
        assert buf.task is not None
        buf.scale_grads()
        assert buf.checked_in == 0 and buf.task is None
        exp, tol = expected_buffer(buf, params, step, acc, main_grad, grad_dtype, avg,
                                   prescale, scale_after)
        assert_close(buf.grad_storage, exp, tol,
                     f"rank {comm.Get_rank()} step {step} {act.name} grad buffer")
        if act != HookAction.REDUCE_SCATTER:
            for p in params:  # the views see the same memory
                slot = buf.layout[p.name]
                np.testing.assert_array_equal(grad_view(p, main_grad).ravel(),
                                              buf.grad_storage[slot.offset:slot.end])
        # the optimizer step would read the grads here; then grads are cleared
        if release:
            buf.clear_grad_storage()
            assert buf.grad_storage is None and grad_view(params[0], main_grad) is None
        else:
            buf.grad_storage[...] = 0


def _bf16():
    from mpifusion.dtypes import bfloat16

    return bfloat16


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_half_and_double_grads_without_main_grad(comm, dtype):
    n, rank = comm.Get_size(), comm.Get_rank()
    from mpifusion.dtypes import as_dtype

    params = make_params(as_dtype(dtype))
    buf = FusedCommBuffer(1, params, comm, act=HookAction.ALL_REDUCE, acc_steps=2)
    for k in range(2):
        for i, p in reversed(list(enumerate(params))):
            buf.add_grad(p, grad=grad_for(rank, 0, k, i, p.shape, dtype))
    buf.scale_grads()
    for i, p in enumerate(params):
        total, mag = reduced(n, 0, 2, i, p.shape, dtype)
        assert_close(p.grad, total / n, bound(mag, n, 2, dtype), f"{dtype} {p.name}")


@pytest.mark.mpi
def test_free_grads_in_comm_and_slice_grads(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    params = make_params(np.float32)
    buf = FusedCommBuffer(2, params, comm, act=HookAction.REDUCE_SCATTER, release_grads=True,
                          free_grads_in_comm=True)
    for step in range(2):  # the second step must get a full buffer again, not last step's shard
        for i, p in reversed(list(enumerate(params))):
            buf.add_grad(p, grad=grad_for(rank, step, 0, i, p.shape, "float32"))
            assert p.grad is None  # moved into the buffer, not viewed
        buf.scale_grads()
        lo, hi = buf.layout.shard_range(rank)
        assert buf.grad_storage.size == hi - lo  # only this rank's shard is kept
        for i, p in enumerate(params):
            piece = buf.layout.slice_of(p.name, rank)
            sp = Param(p.name + "@slice", np.empty(0, np.float32))  # not yet initialised
            buf.assign_slice_grad(p, sp)
            if piece is None:
                assert sp.grad is None
                continue
            slot = buf.layout[p.name]
            total, mag = reduced(n, step, 1, i, p.shape, "float32")
            full = np.zeros(slot.padded_numel)
            full[:slot.numel] = total.ravel() / n
            part = slice(piece[0] - slot.offset, piece[1] - slot.offset)
            tol = np.full(slot.padded_numel, 1e-30)
            tol[:slot.numel] = bound(mag, n, 1, "float32").ravel()
            assert_close(sp.grad, full[part], tol[part], f"step {step} {p.name}")
            assert np.shares_memory(sp.data, buf.param_storage)
            assert sp.data.shape == (piece[1] - piece[0],)


@pytest.mark.mpi
@pytest.mark.parametrize("sync", [True, False])
def test_sync_params_gathers_every_shard(comm, sync):
    n, rank = comm.Get_size(), comm.Get_rank()
    params = make_params(np.float32)
    buf = FusedCommBuffer(3, params, comm, act=HookAction.REDUCE_SCATTER)
    lo, hi = buf.layout.shard_range(rank)
    # each rank "updates" only its own shard, as a sharded optimizer would
    buf.param_storage[lo:hi] = rank * 1000.0 + np.arange(lo, hi)
    param2task = {}
    task = buf.sync_params(sync=sync, param2task=param2task)
    if not sync and n > 1:
        assert buf.status == FusedCommBuffer.Status.SYNCING
        assert set(param2task) == {p.name for p in params}
        assert all(t is task for t in param2task.values())
        task.wait()
        assert task.is_completed()
    assert buf.status == FusedCommBuffer.Status.READY
    shard = buf.layout.shard_numel
    owner = np.arange(buf.buffer_size) // shard
    np.testing.assert_array_equal(buf.param_storage, owner * 1000.0 + np.arange(buf.buffer_size))
    for p in params:  # params are views of the gathered buffer
        slot = buf.layout[p.name]
        np.testing.assert_array_equal(p.data.ravel(), buf.param_storage[slot.offset:slot.end])


@pytest.mark.mpi
def test_init_slice_param_views_the_param_buffer(comm):
    rank = comm.Get_rank()
    params = make_params(np.float32)
    from mpifusion.plan.layout import plan_sharded

    layout = plan_sharded(params, comm.Get_size())
    slices = {}
    for p in params:
        piece = layout.slice_of(p.name, rank)
        if piece:
            slices[p.name] = Param(p.name + "@slice", np.zeros(piece[1] - piece[0], np.float32))
    originals = [p.data.copy() for p in params]
    buf = FusedCommBuffer(4, params, comm, act=HookAction.REDUCE_SCATTER,
                          init_slice_param=True, slice_params=slices)
    for p, orig in zip(params, originals):
        np.testing.assert_array_equal(p.data, orig)  # values moved into the buffer intact
    for name, sp in slices.items():
        a, b = layout.slice_of(name, rank)
        np.testing.assert_array_equal(sp.data, buf.param_storage[a:b])
        sp.data[...] = 42.0  # an optimizer writes its slice ...
        assert (buf.param_storage[a:b] == 42.0).all()  # ... straight into the param buffer


@pytest.mark.mpi
@pytest.mark.parametrize("act", [HookAction.ALL_REDUCE, HookAction.REDUCE_SCATTER])
def test_fused_parameters_with_overlap_hooks(comm, act):
    """Many buffers (a param larger than the group size), driven by emulated backward hooks."""
    n, rank = comm.Get_size(), comm.Get_rank()
    shapes = [(17, 257), (1,), (300,), (5, 5), (40, 40), (7,)]
    params = [Param(f"layer{i}.weight", np.ones(s, np.float32)) for i, s in enumerate(shapes)]
    _, fused, buffers = fused_parameters(params, comm_overlap=True, comm_group=comm, act=act,
                                         fuse_param=False, scale_after_comm=True,
                                         group_size=2048)
    assert len(buffers) > 2
    assert sum(len(b.params) for b in buffers) == len(params)
    for i, p in reversed(list(enumerate(params))):
        p.backward(grad_for(rank, 0, 0, i, p.shape, "float32"))
    for b in buffers:
        b.scale_grads()
    for i, p in enumerate(params):
        buf = next(b for b in buffers if p in b.params)
        total, mag = reduced(n, 0, 1, i, p.shape, "float32")
        slot = buf.layout[p.name]
        if act == HookAction.ALL_REDUCE:
            assert_close(p.grad, total / n, bound(mag, n, 1, "float32"), p.name)
        else:
            piece = buf.layout.slice_of(p.name, rank)
            if piece is None:
                continue
            a, b = max(piece[0], slot.offset), min(piece[1], slot.end)
            if a < b:
                got = buf.grad_storage[a:b]
                want = (total.ravel() / n)[a - slot.offset:b - slot.offset]
                tol = bound(mag, n, 1, "float32").ravel()[a - slot.offset:b - slot.offset]
                assert_close(got, want, tol, p.name)


@pytest.mark.mpi
def test_reduce_dst_is_a_global_rank(comm):
    """dst is a global rank, as in Paddle: with a split communicator (global ranks of one
    parity, in reverse order), the root is the given global rank wherever it sits in comm_group."""
    n, rank = comm.Get_size(), comm.Get_rank()
    sub = comm.Split(color=rank % 2, key=-rank)
    try:
        p = Param("w", np.zeros((3, 3), np.float32))
        members = [r for r in range(n) if r % 2 == rank % 2]
        root = members[0]  # the last rank of sub
        buf = FusedCommBuffer(5, [p], sub, act=HookAction.REDUCE, dst=root, use_reduce_avg=True)
        assert (buf.dst, buf.dst_rank) == (root, len(members) - 1)
        buf.add_grad(p, grad=np.full((3, 3), rank, np.float32))
        buf.scale_grads()
        if rank == root:
            np.testing.assert_allclose(p.grad, np.mean(members), rtol=1e-6)
        else:
            np.testing.assert_array_equal(p.grad, rank)  # non-roots keep their own grads
    finally:
        sub.Free()


@pytest.mark.mpi
def test_new_communicator_with_a_freed_ones_handle_gets_its_own_group(comm):
    """MPI reuses the handle of a freed communicator: its private duplicate must not be reused."""
    rank = comm.Get_rank()
    for split in (False, True):  # first all ranks, then odd and even ranks apart
        sub = comm.Split(color=rank % 2 if split else 0, key=rank)
        try:
            p = Param("w", np.zeros(3, np.float32))
            buf = FusedCommBuffer(0, [p], sub, act=HookAction.ALL_REDUCE, use_reduce_avg=True)
            assert buf.nranks == sub.Get_size()
            buf.add_grad(p, grad=np.full(3, rank, np.float32))
            buf.scale_grads()
            members = [r for r in range(comm.Get_size()) if not split or r % 2 == rank % 2]
            np.testing.assert_allclose(p.grad, np.mean(members), rtol=1e-6)
        finally:
            sub.Free()
