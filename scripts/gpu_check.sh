#!/usr/bin/env bash
# GPU checks on a machine with one GPU, in under 5 minutes: the cupy half of the backend,
# memory, half-precision and pipeline tests (serial and at 2 ranks sharing the GPU), then a
# GPU benchmark of one gradient sync (staged through pinned host memory, pipelined per
# segment -- arrays/staging.py -- at windows 1, 2 and 4, against the old whole-buffer
# staging cost; and native when the MPI is CUDA-aware) with the bytes each buffer holds, and
# the staged in-place reduce-scatter and allgather (rounds through the same pipeline).
# Needs cupy (pip install '.[cuda]').
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
PYTHON=${PYTHON:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
"$PYTHON" -c "from mpifusion.arrays import cuda; assert cuda.gpu_available(), 'no cupy GPU'; \
print('CUDA-aware MPI:', cuda.query_cuda_aware())"
TESTS="tests/arrays/test_backends.py tests/buffer/test_memory.py tests/arrays/test_dlpack.py tests/comm/test_pipeline.py"
echo "=== GPU tests, serial"
timeout 120 "$PYTHON" -m pytest -q -rs $TESTS
echo "=== GPU tests, 2 ranks"
timeout 120 "$MPIEXEC" -n 2 "$PYTHON" -m mpi4py -m pytest --only-mpi -q -rs tests/arrays/test_backends.py tests/buffer/test_half_precision.py tests/comm/test_window.py
echo "=== GPU benchmark: one all-reduce sync of 128 MiB of fp32 and of bf16 grads, 2 ranks"
BENCH=$(mktemp --suffix=.py)
trap 'rm -f "$BENCH"' EXIT
cat > "$BENCH" <<'PY'
import os, time
import cupy as cp
from mpi4py import MPI
from mpifusion import CommOptions, FusedCommBuffer, Param
from mpifusion.arrays import cuda

comm = MPI.COMM_WORLD
cp.cuda.Device(comm.Get_rank() % cp.cuda.runtime.getDeviceCount()).use()
shapes = [(4096, 4096)] * 2  # 2 x 64 MiB fp32 (2 x 32 MiB bf16)
ways = [("staged", "nonblocking", w) for w in (1, 2, 4)] + [("staged", "thread", 1)]
if cuda.query_cuda_aware():
    ways.append(("native", "thread", 1))


def sync_ms(mode, strategy, window, dtype):
    os.environ[cuda.CUDA_AWARE_ENV] = "1" if mode == "native" else "0"
    params = [Param(f"w{i}", cp.zeros(s, dtype)) for i, s in enumerate(shapes)]
    opts = CommOptions(strategy=strategy, window=window, segment_bytes=8 << 20)
    buf = FusedCommBuffer(0, params, comm, act="all_reduce", fuse_param=True,
                          comm_options=opts)
    grads = [cp.ones(s, dtype) for s in shapes]
    times = []
    for it in range(6):
        cuda.reset_staging_stats()
        comm.Barrier()
        t0 = time.perf_counter()
        for p, g in zip(params, grads):
            buf.add_grad(p, grad=g)
        buf.scale_grads()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
        assert float(buf.grad_storage[0]) == 1.0, "wrong result"
        buf.grad_storage[...] = 0
    return buf, 1e3 * min(times[1:])


def sharded_ms(strategy, window, dtype):
    """Staged in-place reduce-scatter then allgather of the same 128 MiB (fp32) buffer, in
    rounds through the pipeline (packed/widened on the device): ms of each, best of 5."""
    from mpifusion.comm import Communicator

    os.environ[cuda.CUDA_AWARE_ENV] = "0"
    c = Communicator(comm, CommOptions(strategy=strategy, window=window,
                                       segment_bytes=8 << 20))
    size, rank = comm.Get_size(), comm.Get_rank()
    buf = cp.ones(2 * 4096 * 4096, dtype)
    shard = buf.size // size
    rs, ag = [], []
    for it in range(6):
        buf[...] = 1
        cp.cuda.Device().synchronize()
        cuda.reset_staging_stats()
        comm.Barrier()
        t0 = time.perf_counter()
        c.reduce_scatter(buf, buf[rank * shard:(rank + 1) * shard], scale=1.0 / size).wait()
        t1 = time.perf_counter()
        c.allgather_inplace(buf).wait()
        t2 = time.perf_counter()
        rs.append(t1 - t0)
        ag.append(t2 - t1)
        assert float(buf[0]) == 1.0 and float(buf[-1]) == 1.0, "wrong result"
    return 1e3 * min(rs[1:]), 1e3 * min(ag[1:])


def copies_ms(dtype):
    """What the old whole-buffer staging cost on top of MPI: one D2H and one H2D."""
    x = cp.ones(2 * 4096 * 4096, dtype)
    host = cp.cuda.alloc_pinned_memory(x.nbytes)
    h = __import__("numpy").frombuffer(host, x.dtype, x.size)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    x.get(out=h)
    x.set(h)
    cp.cuda.Device().synchronize()
    return 1e3 * (time.perf_counter() - t0)


for dtype in (cp.float32, "bfloat16"):
    try:
        dt = cp.dtype(dtype) if dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
        cp.zeros(1, dt)
    except Exception as exc:  # cupy without bfloat16 arrays
        if comm.Get_rank() == 0:
            print(f"  {dtype}: skipped ({exc})")
        continue
    for mode, strategy, window in ways:
        buf, ms = sync_ms(mode, strategy, window, dt)
        if comm.Get_rank() == 0:
            lay = buf.layout
            pad = lay.padding * buf.grad_storage.itemsize
            print(f"{cp.dtype(dt).name if dtype != 'bfloat16' else 'bf16':>8} {mode:>6} "
                  f"{strategy:>11} window {window}: {ms:8.2f} ms/sync (best of 5), "
                  f"grads {buf.grad_storage.nbytes - pad} B + padding {pad} B, pinned staging "
                  f"{cuda.staging_stats['pinned_bytes']} B/step")
    for strategy, window in [("nonblocking", 1), ("nonblocking", 2), ("nonblocking", 4),
                             ("thread", 1)]:
        rs_ms, ag_ms = sharded_ms(strategy, window, dt)
        if comm.Get_rank() == 0:
            print(f"{cp.dtype(dt).name if dtype != 'bfloat16' else 'bf16':>8} staged "
                  f"{strategy:>11} window {window}: reduce-scatter {rs_ms:8.2f} ms, allgather "
                  f"{ag_ms:8.2f} ms (best of 5), pinned staging "
                  f"{cuda.staging_stats['pinned_bytes']} B")
    if comm.Get_rank() == 0:
        print(f"  one D2H + one H2D of the whole buffer ({dtype}): {copies_ms(dt):.2f} ms "
              f"(what whole-buffer staging added; the pipeline hides most of it)")
PY
timeout 180 "$MPIEXEC" -n 2 "$PYTHON" -m mpi4py "$BENCH"
echo "GPU checks passed"
