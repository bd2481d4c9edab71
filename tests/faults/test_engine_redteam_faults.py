"""Red-team jobs for the engines that need a whole process's life (a late rank, the exit):
each runs under ``mpiexec -n N python -m mpi4py`` in a subprocess with a hard limit."""
from __future__ import annotations

import sys
import textwrap

import pytest

from tests.helpers import run_job

HARD_LIMIT = 90

RECOVERED = textwrap.dedent('''
    """Rank 1 is late once; rank 0's wait times out and a second wait succeeds (the late rank
    was only slow). Then an all-gather that rank 0 starts and never waits for: exit drains it."""
    import sys, time
    import numpy as np
    from mpi4py import MPI
    from mpifusion import CommTimeoutError, FusedCommBuffer, Param

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    params = [Param("w", np.zeros(3840, np.float32))]
    buf = FusedCommBuffer(0, params, comm, act="reduce_scatter", timeout=1.0)
    if rank == 1:
        time.sleep(2.5)
    buf.add_grad(params[0], grad=np.full(3840, rank + 1.0, np.float32))
    for attempt in range(20):
        try:
            buf.scale_grads()  # succeeds once the late rank arrived
            break
        except CommTimeoutError:
            pass
    if rank != 1 and attempt == 0:
        sys.exit(f"rank {rank}: expected a CommTimeoutError first")
    lo, hi = buf.layout.shard_range(rank)
    assert (buf.grad_storage[lo:hi] == (size + 1) / 2).all(), buf.grad_storage[lo:hi]
    buf.param_storage[lo:hi] = rank + 1
    if rank == 0:
        buf.sync_params(sync=False)  # never waited for: exit must drain it
        print("rank 0: leaving", flush=True)
    else:
        time.sleep(0.5)  # rank 0 reaches its exit first
        buf.sync_params(sync=False).wait()
        want = np.repeat(np.arange(1, size + 1, dtype=np.float32), 3840 // size)
        assert (buf.param_storage[:3840] == want).all()
        print(f"rank {rank}: ok", flush=True)
''')


@pytest.mark.timeout(HARD_LIMIT + 30)
@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("strategy", ["thread", "nonblocking"])
def test_a_recovered_timeout_still_drains_at_exit(tmp_path, strategy, nranks):
    """A timeout that a later wait() recovered from marked the engine stuck for good: at
    exit the thread strategy's process said a collective 'timed out, was abandoned or was
    never joined' and exited with status 1 without MPI_Finalize (the nonblocking one did not
    drain its all-gather), though nothing was stuck any more."""
    driver = tmp_path / "recovered.py"
    driver.write_text(RECOVERED)
    proc = run_job(nranks, [sys.executable, "-m", "mpi4py", str(driver)], timeout=HARD_LIMIT,
                   stderr_to_stdout=True, env={"MPIFUSION_COMM_STRATEGY": strategy})
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "without MPI_Finalize" not in out, out[-3000:]
    assert out.count(": ok") == nranks - 1 and "rank 0: leaving" in out, out[-3000:]
