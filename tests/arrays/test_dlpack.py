"""DLPack in and out: framework tensors become params and grads without copies, and the
buffers' views go back to a framework sharing memory (DDP's gradient-as-bucket-view)."""
import gc
import weakref

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import FusedCommBuffer, GradError, Param, to_torch
from mpifusion.arrays import backend
from mpifusion.dtypes import bfloat16

torch = pytest.importorskip("torch")


def _shares(a, b) -> bool:
    return backend.data_ptr(backend.asarray(a)) == backend.data_ptr(backend.asarray(b))


class _FakeDevice:
    """A DLPack producer on a device mpifusion cannot reach (Metal)."""

    shape = (2, 3)
    dtype = "float32"

    def __dlpack_device__(self):
        return (8, 0)

    def __dlpack__(self, **kwargs):
        raise BufferError("not reachable")


# --------------------------------------------------------------------------- DLPack in
@pytest.mark.parametrize("tdtype", ["float32", "float16", "bfloat16", "float64"])
def test_param_from_torch_shares_memory(tdtype):
    t = torch.arange(12, dtype=getattr(torch, tdtype)).reshape(3, 4)
    p = Param("w", t)
    assert p.shape == (3, 4) and p.dtype == tdtype and p.device == "cpu"
    p.data[1, 2] = 99          # written through numpy ...
    assert t[1, 2].item() == 99  # ... seen by torch: same memory
    t[0, 0] = -5
    assert float(p.data[0, 0]) == -5


def test_bfloat16_import_follows_strides_and_releases_the_tensor():
    base = torch.arange(20, dtype=torch.bfloat16).reshape(4, 5)
    view = base[1:, ::2]  # non-contiguous
    arr = backend.asarray(view)
    np.testing.assert_array_equal(arr.astype(np.float32), view.float().numpy())
    t = torch.zeros(8, dtype=torch.bfloat16)
    alive = weakref.ref(t)
    arr = backend.asarray(t)
    del t
    gc.collect()
    assert alive() is not None, "the array must keep the producer's memory alive"
    del arr
    gc.collect()
    assert alive() is None, "the DLPack deleter must run when the last view dies"


@pytest.mark.parametrize("jdtype", ["float32", "bfloat16"])
def test_param_and_grad_from_jax(jdtype):
    jnp = pytest.importorskip("jax.numpy")
    w = jnp.arange(6, dtype=jdtype).reshape(2, 3)
    p = Param("w", w)
    np.testing.assert_array_equal(p.data.astype(np.float64), np.arange(6.0).reshape(2, 3))
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce")
    g = jnp.full((2, 3), 0.5, dtype=jdtype)
    buf.add_grad(p, grad=g)
    buf.scale_grads()
    np.testing.assert_array_equal(p.grad.astype(np.float64), np.full((2, 3), 0.5))


@pytest.mark.parametrize("tdtype", ["float32", "bfloat16"])
def test_add_grad_accumulates_torch_grads(tdtype):
    dt = getattr(torch, tdtype)
    params = [Param("a", torch.zeros(5, dtype=dt)), Param("b", torch.zeros(2, 3, dtype=dt))]
    buf = FusedCommBuffer(0, params, MPI.COMM_SELF, acc_steps=2, act="all_reduce")
    for step in (1.0, 2.0):
        for p in params:
            buf.add_grad(p, grad=torch.full(p.shape, step, dtype=dt))
    buf.scale_grads()
    for p in params:
        np.testing.assert_array_equal(p.grad.astype(np.float64), np.full(p.shape, 3.0))
        assert _shares(p.grad, buf.grad_storage[buf.layout[p.name].offset:])


def test_add_grad_into_fp32_main_grad_from_bf16_torch():
    p = Param("w", torch.zeros(4, dtype=torch.bfloat16))
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce", use_main_grad=True)
    assert p.main_grad.dtype == np.float32
    buf.add_grad(p, grad=torch.full((4,), 0.1, dtype=torch.float32))
    buf.scale_grads()
    np.testing.assert_array_equal(p.main_grad, np.full(4, np.float32(0.1)))


# --------------------------------------------------------------------------- DLPack out
@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16])
def test_torch_views_of_the_buffers_share_memory(dtype):
    params = [Param("a", np.ones(3, dtype)), Param("b", np.ones((2, 2), dtype))]
    buf = FusedCommBuffer(0, params, MPI.COMM_SELF, act="all_reduce", fuse_param=True)
    for p in params:
        tg = to_torch(p.grad)
        tp = to_torch(p.data)
        assert tg.shape == torch.Size(p.shape) and str(tg.dtype) == f"torch.{np.dtype(dtype).name}"
        assert tg.data_ptr() == backend.data_ptr(p.grad)
        assert tp.data_ptr() == backend.data_ptr(p.data)
        tg += 2  # a framework accumulating into the bucket
    buf.add_grad(params[0])
    buf.add_grad(params[1])
    buf.scale_grads()
    for p in params:
        slot = buf.layout[p.name]
        np.testing.assert_array_equal(buf.grad_storage[slot.offset:slot.end].astype(np.float64),
                                      np.full(p.numel, 2.0))
        # padding stays zero
        assert not np.any(buf.grad_storage[slot.end:slot.padded_end].astype(np.float64))


def test_plain_torch_from_dlpack_shares_fp32_grad():
    p = Param("w", np.zeros((2, 2), np.float32))
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce")
    t = torch.from_dlpack(p.grad)
    t.add_(1.5)
    assert buf.grad_storage[:4].tolist() == [1.5] * 4


def test_to_torch_none():
    assert to_torch(None) is None


# --------------------------------------------------------------------------- mismatches
def test_grad_dtype_mismatch_names_the_param():
    p = Param("layer0.weight", torch.zeros(4))
    buf = FusedCommBuffer(3, [p], MPI.COMM_SELF, act="all_reduce")
    with pytest.raises(GradError, match=r"rank 0: buffer 3: param 'layer0.weight': grad dtype "
                                        r"expected float32, got float64"):
        buf.add_grad(p, grad=torch.zeros(4, dtype=torch.float64))
    assert buf.checked_in == 0 and not buf.grad_storage.any()


def test_grad_shape_mismatch_names_the_param():
    p = Param("w", torch.zeros(2, 3))
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce")
    with pytest.raises(GradError, match=r"param 'w': grad shape expected \(2, 3\), got \(3, 2\)"):
        buf.add_grad(p, grad=torch.zeros(3, 2))
    assert buf.checked_in == 0


def test_grad_on_unreachable_device_names_the_param():
    p = Param("w", torch.zeros(2, 3))
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce")
    with pytest.raises(GradError, match=r"param 'w': grad: a tensor on device metal:0"):
        buf.add_grad(p, grad=_FakeDevice())
    assert buf.checked_in == 0


def test_param_from_unreachable_device_names_the_param():
    with pytest.raises(TypeError, match=r"Param 'emb': array: a tensor on device metal:0"):
        Param("emb", _FakeDevice())


def test_param_grad_must_match_its_data():
    with pytest.raises(ValueError, match=r"Param 'w': grad: expected shape \(4,\) like its "
                                         r"data, got \(5,\)"):
        Param("w", torch.zeros(4), grad=torch.zeros(5))


def test_not_a_tensor_names_the_param():
    with pytest.raises(TypeError, match=r"Param 'w': array: expected a numpy/cupy array or a "
                                        r"DLPack tensor, got object"):
        Param("w", object())


# --------------------------------------------------------------------------- lazy bits
# A torch tensor with its negation (or conjugation) bit set holds other values than its
# memory; DLPack exports the memory and drops the bit, so np.from_dlpack reads -x as x.
def _negated_views(dt):
    """(what, tensor whose *value* is -1 everywhere while its memory holds +1)."""
    if dt == torch.float32:  # (torch has no bf16 complex)
        yield "conj().imag", torch.complex(torch.zeros(4), torch.ones(4)).conj().imag
    yield "_neg_view", torch._neg_view(torch.ones(4, dtype=dt))


@pytest.mark.parametrize("tdtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("release_grads", [False, True])
def test_add_grad_resolves_the_torch_negation_bit(tdtype, release_grads):
    dt = getattr(torch, tdtype)
    for what, g in _negated_views(dt):
        assert g.is_neg() and torch.equal(g.float(), torch.full((4,), -1.0)), what
        p = Param("w", torch.zeros(4, dtype=dt))
        buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce", acc_steps=2,
                              release_grads=release_grads)
        buf.add_grad(p, grad=g)
        buf.add_grad(p, grad=torch.full((4,), 3.0, dtype=dt))
        buf.scale_grads()
        np.testing.assert_array_equal(p.grad.astype(np.float64), np.full(4, 2.0),
                                      err_msg=f"{what}: the sign of the negated grad was lost")
        assert g.is_neg(), "the caller's tensor is left as it was"


def test_add_grad_resolves_the_negation_bit_into_a_main_grad():
    p = Param("w", torch.zeros(4, dtype=torch.bfloat16))
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce", use_main_grad=True)
    buf.add_grad(p, grad=torch._neg_view(torch.full((4,), 0.5)))
    buf.scale_grads()
    np.testing.assert_array_equal(p.main_grad, np.full(4, -0.5, np.float32))


def test_asarray_resolves_or_refuses_lazy_bits():
    neg = torch._neg_view(torch.arange(4.0))
    np.testing.assert_array_equal(backend.asarray(neg), -np.arange(4.0, dtype=np.float32))
    z = torch.complex(torch.arange(3.0), torch.ones(3)).conj()
    assert z.is_conj()
    np.testing.assert_array_equal(backend.asarray(z), np.arange(3.0) - 1j)
    assert backend.lazy_bits(torch.ones(2)) is None and backend.lazy_bits(np.ones(2)) is None
    with pytest.raises(TypeError, match="negation bit set"):
        backend.asarray(neg, resolve_lazy=False)
    with pytest.raises(TypeError, match="conjugation bit set"):
        backend.asarray(z, resolve_lazy=False)
    plain = torch.ones(3)
    assert _shares(backend.asarray(plain, resolve_lazy=False), plain)  # still zero-copy


@pytest.mark.parametrize("field", ["array", "grad", "main_grad"])
@pytest.mark.parametrize("tdtype", ["float32", "bfloat16"])
def test_param_refuses_a_torch_tensor_with_the_negation_bit(field, tdtype):
    dt = getattr(torch, tdtype)
    neg = torch._neg_view(torch.ones(4, dtype=dt))
    kwargs = {"array": torch.zeros(4, dtype=dt)}
    kwargs[field] = neg
    array = kwargs.pop("array")
    with pytest.raises(TypeError, match=rf"Param 'w': {field}: a torch tensor with its "
                                        rf"negation bit set.*\.resolve_neg\(\)"):
        Param("w", array, **kwargs)


def test_torch_capture_reads_negated_views_with_their_sign():
    from mpifusion.capture.torch import to_numpy

    for dt in (torch.float32, torch.bfloat16):
        out = to_numpy(torch._neg_view(torch.ones(3, dtype=dt)))
        np.testing.assert_array_equal(out.astype(np.float64), np.full(3, -1.0))
