"""The same checks over numpy and cupy buffers: buffers live where their params live, and
grads reduce correctly whether MPI reads device memory (CUDA-aware) or goes through pinned
host staging. The cupy half skips on machines without cupy and a GPU."""
import numpy as np
import pytest

from mpifusion import FusedCommBuffer, Param
from mpifusion.arrays import backend, cuda
from mpifusion.dtypes import finfo, float16, float32

BACKENDS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("cupy", id="cupy", marks=pytest.mark.skipif(
        not cuda.gpu_available(), reason="needs cupy and a GPU")),
]
SHAPES = [(3, 70), (129,), (1,)]


@pytest.fixture(params=BACKENDS)
def xp(request):
    if request.param == "cupy":
        import cupy

        return cupy
    return np


@pytest.fixture
def transfer(request, xp, monkeypatch):
    """How MPI gets device buffers: itself (only on a CUDA-aware MPI) or a pinned copy (device
    buffers only: host buffers are never staged, so numpy has no staged case)."""
    if request.param == "native":
        if xp is not np and not cuda.query_cuda_aware():
            pytest.skip("this MPI is not CUDA-aware")
        monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "1" if xp is not np else "")
    else:
        monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "0")
    return request.param


#: (backend, transfer) pairs that exist
TRANSFERS = [pytest.param(b.values[0], t, id=f"{b.id}-{t}", marks=b.marks)
             for b in BACKENDS for t in ("native", "staged")
             if not (b.values[0] == "numpy" and t == "staged")]


def _params(xp, dtype, rank=0):
    return [Param(f"p{i}", xp.full(s, rank + 1, dtype=dtype)) for i, s in enumerate(SHAPES)]


def test_buffers_live_where_params_live(xp):
    from mpi4py import MPI

    params = _params(xp, np.float32)
    buf = FusedCommBuffer(0, params, MPI.COMM_SELF, act="all_reduce", fuse_param=True)
    for arr in (buf.param_storage, buf.grad_storage):
        assert backend.array_module(arr) is xp
        assert backend.device_of(arr) == params[0].device
        assert backend.data_ptr(arr) % backend.BASE_ALIGNMENT == 0
    for p in params:
        assert backend.array_module(p.grad) is xp
        assert backend.data_ptr(p.data) % 256 == 0  # every slot is 256-byte aligned


def test_ipc_meta(xp):
    from mpi4py import MPI

    params = _params(xp, np.float32)
    buf = FusedCommBuffer(0, params, MPI.COMM_SELF, act="reduce_scatter")
    meta = buf.param_buffer_ipc_meta
    if xp is np:
        assert meta is None
    else:
        assert meta.nbytes == buf.param_storage.nbytes and meta.shape == buf.param_storage.shape
        assert len(meta.handle) == 64 and meta.offset >= 0


def test_cuda_aware_env_override(monkeypatch):
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "1")
    assert cuda.is_cuda_aware() is True
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "off")
    assert cuda.is_cuda_aware() is False
    monkeypatch.delenv(cuda.CUDA_AWARE_ENV)
    assert cuda.is_cuda_aware() is cuda.query_cuda_aware()


@pytest.mark.parametrize("xp", [b for b in BACKENDS if b.values[0] == "cupy"], indirect=True)
def test_grad_on_the_wrong_device_names_the_param(xp):
    from mpi4py import MPI

    from mpifusion import GradError

    params = _params(xp, np.float32)
    buf = FusedCommBuffer(0, params, MPI.COMM_SELF, act="all_reduce")
    other = np.zeros(SHAPES[0], np.float32)  # host memory: another device than cupy's
    with pytest.raises(GradError, match=r"param 'p0': grad device expected cuda:\d, got cpu"):
        buf.add_grad(params[0], grad=other)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [float32, float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("act", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("xp, transfer", TRANSFERS, indirect=True)
def test_reduction_over_ranks(comm, xp, transfer, dtype, act):
    """Rank r contributes (r + 1) * (i + 1) to element i: the float64 mean is known."""
    n, r = comm.Get_size(), comm.Get_rank()
    params = [Param(f"p{i}", xp.zeros(s, dtype=dtype)) for i, s in enumerate(SHAPES)]
    buf = FusedCommBuffer(0, params, comm, act=act)
    for p in params:
        local = (r + 1) * (np.arange(p.numel, dtype=np.float64).reshape(p.shape) % 7 + 1)
        buf.add_grad(p, grad=xp.asarray(local.astype(dtype)))
    buf.scale_grads()
    mean = (n + 1) / 2.0
    u = finfo(dtype).eps
    if act == "all_reduce":
        for p in params:
            want = mean * (np.arange(p.numel, dtype=np.float64).reshape(p.shape) % 7 + 1)
            got = backend.to_host(p.grad).astype(np.float64)
            np.testing.assert_allclose(got, want, rtol=2 * u)
    else:
        full = np.zeros(buf.buffer_size)
        for p in params:
            slot = buf.layout[p.name]
            full[slot.offset:slot.end] = mean * (np.arange(p.numel) % 7 + 1)
        begin, end = buf.layout.shard_range(r)
        got = backend.to_host(buf.grad_storage[begin:end]).astype(np.float64)
        np.testing.assert_allclose(got, full[begin:end], rtol=2 * u)
