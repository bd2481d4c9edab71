#!/usr/bin/env bash
# GPU checks on a machine with one GPU, in under 5 minutes: the cupy half of the backend,
# memory and half-precision tests (serial and at 2 ranks sharing the GPU), then a GPU
# benchmark of one gradient sync (staged through pinned host memory, and native when the
# MPI is CUDA-aware) with the bytes each buffer holds. Needs cupy (pip install '.[cuda]').
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
PYTHON=${PYTHON:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
"$PYTHON" -c "from mpifusion.arrays import cuda; assert cuda.gpu_available(), 'no cupy GPU'; \
print('CUDA-aware MPI:', cuda.query_cuda_aware())"
TESTS="tests/test_backends.py tests/test_memory.py tests/test_dlpack.py"
echo "=== GPU tests, serial"
timeout 120 "$PYTHON" -m pytest -q -rs $TESTS
echo "=== GPU tests, 2 ranks"
timeout 120 "$MPIEXEC" -n 2 "$PYTHON" -m mpi4py -m pytest --only-mpi -q -rs tests/test_backends.py tests/test_mpi_half.py
echo "=== GPU benchmark: one all-reduce sync of a 128 MiB fp32 buffer, 2 ranks"
BENCH=$(mktemp --suffix=.py)
trap 'rm -f "$BENCH"' EXIT
cat > "$BENCH" <<'PY'
import os, time
import cupy as cp
from mpi4py import MPI
from mpifusion import FusedCommBuffer, Param
from mpifusion.arrays import cuda

comm = MPI.COMM_WORLD
cp.cuda.Device(comm.Get_rank() % cp.cuda.runtime.getDeviceCount()).use()
shapes = [(4096, 4096)] * 2  # 2 x 64 MiB fp32
modes = ["staged"] + (["native"] if cuda.query_cuda_aware() else [])
for mode in modes:
    os.environ[cuda.CUDA_AWARE_ENV] = "1" if mode == "native" else "0"
    params = [Param(f"w{i}", cp.zeros(s, cp.float32)) for i, s in enumerate(shapes)]
    buf = FusedCommBuffer(0, params, comm, act="all_reduce", fuse_param=True)
    grads = [cp.ones(s, cp.float32) for s in shapes]
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
        buf.grad_storage[...] = 0
    if comm.Get_rank() == 0:
        lay = buf.layout
        pad = lay.padding * 4
        print(f"{mode:>6}: {1e3 * min(times[1:]):8.2f} ms/sync (best of 5), "
              f"params {buf.param_storage.nbytes - pad} B + grads {buf.grad_storage.nbytes - pad} B "
              f"+ padding 2x{pad} B, pinned staging {cuda.staging_stats['pinned_bytes']} B/step")
PY
timeout 120 "$MPIEXEC" -n 2 "$PYTHON" -m mpi4py "$BENCH"
echo "GPU checks passed"
