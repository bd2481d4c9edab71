"""FusedCommBuffer under mpiexec (1, 2, 3, 4 and 8 ranks) against float64 references.

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests``.
"""
import itertools

import numpy as np
import pytest

from mpifusion import FusedCommBuffer, HookAction, Param, fused_parameters

from tests.reference import assert_close, bound, grad_for, local_sum, reduced

pytestmark = pytest.mark.mpi

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
