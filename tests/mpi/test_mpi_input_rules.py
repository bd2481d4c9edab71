"""Red-team inputs at every rank count: non-float params are refused at construction on every
rank (they used to reach the collective and fail there with a KeyError text), float64 main
grads are summed in float64 (they used to be rounded to fp32), and a negated torch view is
summed with its sign."""
import numpy as np
import pytest

from mpifusion import FusedCommBuffer, LayoutError, Param, fused_parameters

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.complex64, np.bool_],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act", ["all_reduce", "reduce", "reduce_scatter"])
def test_non_float_params_refused_on_every_rank(comm, dtype, act):
    p = Param("w", np.zeros(4, dtype))
    with pytest.raises(LayoutError, match=rf"^rank {comm.Get_rank()}: param 'w': dtype "
                                          rf"{np.dtype(dtype).name} cannot be fused; expected "
                                          rf"one of float64, float32, bfloat16, float16$"):
        FusedCommBuffer(0, [p], comm, act=act, dst=0 if act == "reduce" else -1)
    assert p.grad is None
    # the communicator is still usable: a float buffer built after it reduces correctly
    q = Param("v", np.zeros(4, np.float32))
    buf = FusedCommBuffer(1, [q], comm, act="all_reduce")
    buf.add_grad(q, grad=np.full(4, comm.Get_rank() + 1.0, np.float32))
    buf.scale_grads()
    n = comm.Get_size()
    np.testing.assert_array_equal(q.grad, np.full(4, (n + 1) / 2, np.float32))


def test_fused_parameters_refuses_an_int_param_on_every_rank(comm):
    params = [Param("a", np.zeros(4, np.float32)), Param("step", np.zeros(1, np.int64))]
    with pytest.raises(LayoutError, match=r"param 'step': dtype int64 cannot be fused"):
        fused_parameters(params, comm_group=comm, act="all_reduce", comm_overlap=True)
    assert params[0].grad is None and not params[0]._backward_hooks


@pytest.mark.parametrize("act", ["all_reduce", "reduce", "reduce_scatter"])
@pytest.mark.parametrize("avg", [False, True])
def test_float64_main_grads_are_summed_in_float64(comm, act, avg):
    rank, n = comm.Get_rank(), comm.Get_size()
    p = Param("w", np.zeros(64, np.float64), main_grad=np.zeros(64, np.float64))
    buf = FusedCommBuffer(0, [p], comm, act=act, dst=0 if act == "reduce" else -1,
                          use_reduce_avg=avg)
    assert buf.use_main_grad and buf.grad_dtype == np.float64
    tiny = 2.0 ** -40  # lost in fp32: 1 + 2^-40 rounds to 1
    buf.add_grad(p, grad=np.full(64, 1.0 + (rank + 1) * tiny))
    buf.scale_grads()
    total = n + tiny * n * (n + 1) / 2  # exact in float64 for these rank counts
    want = total / n  # scale_after_comm (the default) or use_reduce_avg: the mean
    if act == "reduce_scatter":
        lo, hi = buf.layout.shard_range(rank)
        got = buf.grad_storage[lo:min(hi, 64)]
    elif act == "reduce" and rank != 0:
        return
    else:
        got = p.main_grad
    assert got.dtype == np.float64
    # fp32 would give exactly 1.0, off by tiny * (n + 1) / 2, far beyond this tolerance
    np.testing.assert_allclose(got, want, rtol=4 * 2.0 ** -53 * n, atol=0)


def test_negated_torch_grads_keep_their_sign(comm):
    torch = pytest.importorskip("torch")
    rank, n = comm.Get_rank(), comm.Get_size()
    for dt in (torch.float32, torch.bfloat16):
        p = Param("w", torch.zeros(8, dtype=dt))
        buf = FusedCommBuffer(0, [p], comm, act="all_reduce")
        g = torch._neg_view(torch.full((8,), float(rank + 1), dtype=dt))  # value -(rank+1)
        buf.add_grad(p, grad=g)
        buf.scale_grads()
        np.testing.assert_array_equal(p.grad.astype(np.float64), np.full(8, -(n + 1) / 2))
