"""Red-team of the persistent order check (commit 0e0bbdd): each case runs as a whole job
under ``mpiexec`` (a broken stream must not hang or abort the pytest run), every result
against a float64 reference.

* ``handoff``: the thread strategy, a deadline set, two small collectives A and B started, A
  waited for while the last rank is late. The caller polls A's check past its deadline and
  hands it back to the comm thread at todo's front, but the thread had already taken B from
  ``todo`` (it waits only ``HANDOFF_S`` for a caller) and was blocked on ``running``: it runs
  B first, whose ``CHECK`` starts the still-active persistent request ("Persistent request
  passed to MPI_Start ... is already active" with MPICH, MPI_ERR_REQUEST with Open MPI; B's
  fingerprint also overwrote A's send buffer in flight). The ranks' streams end up one
  collective apart: every later collective is an OrderError, or a hang.
* ``release``: ``release(comm)`` right after starting two negotiated collectives; release
  promises to finish started collectives first, but drain() waits only for a snapshot of the
  engine's tasks: the next negotiation round (started from the stream) and the buffers queued
  in the negotiator are missed, the duplicate is freed under them ("Invalid communicator" on
  one rank, a missed deadline -- or a hang without one -- on the other).
"""
from __future__ import annotations

import re
import sys
import textwrap

import pytest

from tests.helpers import run_job

DRIVER = textwrap.dedent(r'''
    import sys, time
    import numpy as np
    from mpi4py import MPI
    from mpifusion import CommOptions
    from mpifusion.comm import release
    from mpifusion.comm.communicator import Communicator
    from mpifusion.errors import CommTimeoutError

    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    case, strategy, trials = sys.argv[1], sys.argv[2], int(sys.argv[3])
    bad = 0

    def check(label, task, arr, want):
        global bad
        try:
            task.wait(timeout=5)
        except Exception as exc:
            bad += 1
            print(f"rank {rank}: {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        if not np.array_equal(arr, want):
            bad += 1
            print(f"rank {rank}: {label}: WRONG {arr[:3]} want {want[:3]}", flush=True)

    if case == "handoff":
        c = Communicator(comm, CommOptions(strategy=strategy, timeout=0.3))
        for t in range(trials):
            a = np.full(1000, rank + 1.0 + t, np.float64)
            b = np.arange(50, dtype=np.float64) + rank
            ra = np.sum([np.full(1000, r + 1.0 + t) for r in range(n)], axis=0)
            rb = np.sum([np.arange(50, dtype=np.float64) + r for r in range(n)], axis=0)
            if rank == n - 1:
                time.sleep(0.6)
            A, B = c.allreduce(a), c.allreduce(b)
            try:
                A.wait()
            except CommTimeoutError:
                pass  # the late rank's peers
            except Exception as exc:
                print(f"rank {rank}: trial {t} first wait: {type(exc).__name__}", flush=True)
            check(f"trial {t} A", A, a, ra)
            check(f"trial {t} B", B, b, rb)
        for k in range(30):
            x = np.full(7, rank + 1.0 + k, np.float64)
            check(f"after {k}", c.allreduce(x), x, np.full(7, n * (n + 1) / 2 + n * k))
    elif case == "release":
        for t in range(trials):
            sub = comm.Dup()
            c1 = Communicator(sub, CommOptions(strategy=strategy, order="negotiated"))
            c2 = Communicator(sub, CommOptions(strategy=strategy, order="negotiated"))
            a = np.full(10, rank + 1.0, np.float64)
            b = np.full(20, rank + 2.0, np.float64)
            ta, tb = c1.allreduce(a), c2.allreduce(b)
            release(sub)  # started collectives are finished first
            sub.Free()
            check(f"trial {t} a", ta, a, np.full(10, n * (n + 1) / 2))
            check(f"trial {t} b", tb, b, np.full(20, n * (n + 3) / 2))
    print(f"rank {rank}: {case} bad={bad}", flush=True)
''')


def _job(tmp_path, nranks, *args, timeout=90):
    script = tmp_path / "persistent_check_driver.py"
    script.write_text(DRIVER)
    proc = run_job(nranks, [sys.executable, "-m", "mpi4py", str(script), *args],
                   timeout=timeout, stderr_to_stdout=True, env={"MPIFUSION_TIMEOUT": ""},
                   hang_ok=True)
    return proc.returncode, proc.stdout or ""


def _all_ok(out, case, nranks):
    return set(re.findall(rf"rank (\d+): {case} bad=0(?!\d)", out)) == {str(r) for r in range(nranks)}


@pytest.mark.parametrize("nranks", (2, 3))
def test_handoff_nonblocking_exact(tmp_path, nranks):
    rc, out = _job(tmp_path, nranks, "handoff", "nonblocking", "3")
    assert rc == 0 and _all_ok(out, "handoff", nranks), out[-4000:]


@pytest.mark.parametrize("nranks", (2, 3))
def test_handoff_thread_exact(tmp_path, nranks):
    rc, out = _job(tmp_path, nranks, "handoff", "thread", "3")
    assert rc == 0 and _all_ok(out, "handoff", nranks), out[-4000:]


def test_release_negotiated_thread_exact(tmp_path):
    rc, out = _job(tmp_path, 2, "release", "thread", "10")
    assert rc == 0 and _all_ok(out, "release", 2), out[-4000:]


def test_release_negotiated_nonblocking_exact(tmp_path):
    rc, out = _job(tmp_path, 2, "release", "nonblocking", "10")
    assert rc == 0 and _all_ok(out, "release", 2), out[-4000:]
