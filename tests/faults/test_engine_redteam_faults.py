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


MIDWAY = textwrap.dedent('''
    """Rank 1's collective fails after the order check passed (its pre-scaling raises, as a
    MemoryError widening a segment would); the peers are inside its data call. Rank 1's next
    collective must be refused: started, its order check would pair with that data call."""
    import os, sys, time
    import numpy as np
    from mpi4py import MPI
    from mpifusion.comm import Communicator
    from mpifusion.config import CommOptions
    from mpifusion.errors import AbandonedError, CommError, CommTimeoutError

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    c = Communicator(comm, CommOptions(timeout=3.0))
    buf = np.ones(4, np.float32)  # 16 bytes: the size of the order check's words

    def boom():
        raise MemoryError("simulated: no memory for the segment")

    task = c.allreduce(buf, prepare=boom if rank == 1 else None)
    try:
        task.wait()
        sys.exit(f"rank {rank}: the first collective completed")
    except CommTimeoutError:
        print(f"rank {rank}: timed out", flush=True)
    except CommError as exc:
        print(f"rank {rank}: failed: {exc}", flush=True)
    if rank == 1:
        try:
            c.allreduce(np.ones(4, np.float32))
            print("rank 1: second collective started", flush=True)
        except AbandonedError as exc:
            print(f"rank 1: refused: {exc}", flush=True)
        time.sleep(6.0)  # the peers time out and look at their buffers before this exits
    else:
        time.sleep(2.0)  # time for rank 1's next collective to reach this rank
        print(f"rank {rank}: buffer {'untouched' if (buf == 1).all() else buf}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # rank 0's collective can never finish: do not wait for it at exit
''')


@pytest.mark.timeout(HARD_LIMIT + 30)
@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("strategy", ["thread", "nonblocking"])
def test_a_collective_failed_midway_refuses_the_next_on_that_rank(tmp_path, strategy,
                                                                    nranks):
    """Before: rank 1 started its next collective (no refusal), whose 16-byte order check
    could pair with the peers' pending 16-byte data all-reduce (MPI does not compare types)."""
    driver = tmp_path / "midway.py"
    driver.write_text(MIDWAY)
    proc = run_job(nranks, [sys.executable, "-m", "mpi4py", str(driver)], timeout=HARD_LIMIT,
                   stderr_to_stdout=True, env={"MPIFUSION_COMM_STRATEGY": strategy})
    out = proc.stdout
    assert "rank 1: failed:" in out and "simulated: no memory" in out, out[-3000:]
    assert "rank 1: refused:" in out and "failed on this rank after the ranks" in out, \
        out[-3000:]
    assert "second collective started" not in out, out[-3000:]
    assert out.count(": buffer untouched") == nranks - 1, out[-3000:]
    assert out.count(": timed out") == nranks - 1, out[-3000:]
