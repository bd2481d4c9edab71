"""Memory honesty: a buffer allocates its params + grads + padding, and nothing hides a
full-buffer copy in construction, add_grad or communication.

numpy reports its data allocations to tracemalloc, so the traced bytes between two points
are exactly the arrays made in between (plus a few small Python objects: ``SLACK``). The
params are 4 MiB, so one hidden copy of a buffer would exceed the slack many times over.
"""
import logging
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import FusedCommBuffer, Param
from mpifusion.arrays import backend, cuda
from mpifusion.dtypes import bfloat16, float32

log = logging.getLogger(__name__)

SHAPES = [(1000, 513), (257,), (333, 999), (7,)]  # odd sizes: every slot is padded
SLACK = 256 << 10  # Python objects, views, requests: far below one buffer (>= 2 MiB)
BASE = backend.BASE_ALIGNMENT  # each buffer over-allocates this much to align its start


def _params(dtype, like=np):
    return [Param(f"w{i}", like.ones(s, dtype=dtype)) for i, s in enumerate(SHAPES)]


def _expected(buf) -> dict:
    """What this buffer should hold, in bytes: params, grads and their padding."""
    psize = np.dtype(buf.layout.dtype).itemsize
    gsize = buf.grad_storage.dtype.itemsize
    numel, pad = buf.layout.numel, buf.layout.padding
    out = {"grads": (numel - pad) * gsize, "grad padding": pad * gsize}
    if buf.param_storage is not None:
        out.update({"params": (numel - pad) * psize, "param padding": pad * psize})
    return out


class _Traced:
    """Bytes allocated (net) and at peak between ``start()`` and ``stop()``."""

    def __enter__(self):
        tracemalloc.start()
        tracemalloc.reset_peak()
        self.base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc):
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.net, self.peak = current - self.base, peak - self.base


def _scratch_bytes(buf) -> int:
    """The scratch comm.py documents: half precision is widened to fp32 one segment at a
    time (all-reduce/reduce: one segment; reduce-scatter: nranks + 1 pieces of one)."""
    gdtype = buf.grad_storage.dtype
    wsize = 4 if gdtype.itemsize == 2 else gdtype.itemsize
    seg = buf.comm._segment(gdtype)
    n = buf.nranks
    if buf.act.name == "REDUCE_SCATTER":
        shard = buf.buffer_size // n
        piece = max(1, min(seg // n if seg < (1 << 62) else shard, shard))
        return (n + 1) * piece * wsize
    return min(seg, buf.buffer_size) * wsize if gdtype.itemsize == 2 else 0


CASES = [
    pytest.param(np.float32, dict(act="all_reduce"), id="fp32-allreduce"),
    pytest.param(np.float32, dict(act="all_reduce", fuse_param=True), id="fp32-fused-params"),
    pytest.param(bfloat16, dict(act="all_reduce", fuse_param=True), id="bf16-fused-params"),
    pytest.param(bfloat16, dict(act="all_reduce", use_main_grad=True), id="bf16-fp32-main-grad"),
    pytest.param(np.float16, dict(act="reduce_scatter"), id="fp16-reduce-scatter"),
]


@pytest.mark.parametrize("dtype,kw", CASES)
def test_construction_allocates_exactly_params_grads_and_padding(dtype, kw):
    params = _params(dtype)
    with _Traced() as t:
        buf = FusedCommBuffer(0, params, MPI.COMM_SELF, **kw)
    parts = _expected(buf)
    arrays = 1 + (buf.param_storage is not None)
    expected = sum(parts.values()) + arrays * BASE
    log.info("%s: %s = %d bytes; traced %d (peak %d)", buf, parts, expected, t.net, t.peak)
    assert buf.grad_storage.nbytes == parts["grads"] + parts["grad padding"]
    assert expected <= t.net <= expected + SLACK, (parts, t.net)
    assert t.peak <= expected + SLACK, f"a transient copy: peak {t.peak} > {expected}"
    if kw.get("use_main_grad"):
        assert buf.grad_storage.dtype == float32  # fp32 main grads: 4 bytes per element


@pytest.mark.parametrize("dtype,kw", CASES)
def test_add_grad_and_comm_make_no_full_buffer_copy(dtype, kw):
    params = _params(dtype)
    buf = FusedCommBuffer(0, params, MPI.COMM_SELF, **kw)
    gdtype = buf.grad_storage.dtype
    grads = [np.full(p.shape, 0.5, gdtype) for p in params]
    with _Traced() as t:
        for p, g in zip(params, grads):
            buf.add_grad(p, grad=g)   # accumulates in place; the last one starts comm
        buf.scale_grads()
    scratch = _scratch_bytes(buf)
    log.info("%s: add_grad + comm traced peak %d bytes (buffer %d, documented scratch %d)",
             buf, t.peak, buf.grad_storage.nbytes, scratch)
    assert t.peak <= scratch + SLACK, f"peak {t.peak} bytes: a hidden copy of the buffer?"
    assert t.net <= scratch + SLACK
    np.testing.assert_array_equal(params[0].grad if not buf.use_main_grad
                                  else params[0].main_grad, grads[0])


def test_dlpack_grads_are_not_copied():
    torch = pytest.importorskip("torch")
    params = _params(np.float32)
    buf = FusedCommBuffer(0, params, MPI.COMM_SELF, act="all_reduce")
    grads = [torch.ones(p.shape) for p in params]
    with _Traced() as t:
        for p, g in zip(params, grads):
            buf.add_grad(p, grad=g)
        buf.scale_grads()
    assert t.peak <= SLACK, f"peak {t.peak} bytes: a DLPack grad was copied"


@pytest.mark.skipif(not cuda.gpu_available(), reason="needs cupy and a GPU")
def test_staged_path_pins_a_bounded_ring_per_collective(monkeypatch):
    """Without CUDA-aware MPI, a collective goes through ``window + 2`` pinned slots of one
    segment each (arrays/staging.py), whatever the buffer's size, and keeps no device copy."""
    import cupy as cp

    from mpifusion.config import CommOptions

    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "0")
    params = _params(np.float32, like=cp)
    segment, window = 256 << 10, 2
    buf = FusedCommBuffer(0, params, MPI.COMM_SELF, act="all_reduce",
                          comm_options=CommOptions(segment_bytes=segment, window=window))
    assert buf.grad_storage.nbytes > 4 * (window + 2) * segment  # many segments
    pool = cp.get_default_memory_pool()
    cuda.reset_staging_stats()
    before = pool.used_bytes()
    for p in params:
        buf.add_grad(p, grad=cp.full(p.shape, 0.5, cp.float32))
    buf.scale_grads()
    cp.cuda.Device().synchronize()
    assert 0 < cuda.staging_stats["pinned_bytes"] <= (window + 2) * segment
    assert pool.used_bytes() - before < buf.grad_storage.nbytes  # no device copy kept
    assert float(abs(buf.grad_storage[:1000] - 0.5).max()) == 0.0


@pytest.mark.parametrize("what", ["grad", "param"])
def test_clearing_a_storage_frees_its_memory(what):
    """clear_grad_storage / clear_param_storage free the whole buffer: no view kept inside
    (a param's place in a reduce-scatter buffer kept its param buffer before)."""
    params = _params(np.float32)
    tracemalloc.start()  # before the buffer: only blocks traced from the start count freed
    try:
        buf = FusedCommBuffer(0, params, MPI.COMM_SELF, act="reduce_scatter",
                              release_grads=True)
        for p in params:
            buf.add_grad(p, grad=np.full(p.shape, 0.5, np.float32))
        buf.scale_grads()
        before = tracemalloc.get_traced_memory()[0]
        buf.clear_grad_storage() if what == "grad" else buf.clear_param_storage()
        freed = before - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    nbytes = buf.buffer_size * 4
    log.info("clear %s storage of %d bytes: %d bytes freed", what, nbytes, freed)
    assert freed >= nbytes - SLACK, f"{freed} of {nbytes} bytes freed"
