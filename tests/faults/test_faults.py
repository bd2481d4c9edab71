"""Fault tests: each runs a whole job under ``mpiexec -n N python -m mpi4py`` in a subprocess.

Every case must end within its deadline with a non-zero exit, the stated error text, and no
process left behind -- never a hang. A hard ``subprocess`` timeout turns a hang into a
failure (and the test then kills the job's process group).
"""
from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import run_job

DEADLINE = 4.0          # MPIFUSION_TIMEOUT given to the jobs, seconds
HARD_LIMIT = 90         # per job, start-up of 8 oversubscribed ranks included
#: 2 and 3 ranks (an odd count: shards and trees that do not divide); 8 only where the size of
#: the job is the point (a dead rank among many still ends it within the deadline)
RANKS = (2, 3)

DRIVER = textwrap.dedent('''
    """One faulty training step; argv: scenario, token (marks this job's processes)."""
    import os, signal, sys, time
    import numpy as np
    from mpi4py import MPI
    from mpifusion import FusedCommBuffer, Param

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    scenario = sys.argv[1]
    bad = 1  # the rank at fault
    names = ["w0", "w1"]
    if scenario == "mismatch" and rank == bad:
        names = ["w0", "w1", "extra"]
    params = [Param(n, np.zeros((3, 5), np.float32)) for n in names]
    comm.Barrier()  # start-up skew of oversubscribed ranks must not eat the deadline
    if scenario == "nobuffer" and rank == bad:  # never builds its buffer
        time.sleep(20 * float(os.environ["MPIFUSION_TIMEOUT"]))
    buf = FusedCommBuffer(0, params, comm, act="all_reduce")
    for p in params:
        g = np.full((3, 5), rank + 1.0, np.float32)
        if rank == bad:
            if scenario == "withhold" and p.name == "w1":
                continue
            if scenario == "exit" and p.name == "w1":
                os._exit(3)
            if scenario == "stall" and p.name == "w1":
                os.kill(os.getpid(), signal.SIGSTOP)  # alive to the launcher, gone to MPI
            if scenario == "nan" and p.name == "w1":
                g[0, 1] = np.nan
                g[2, 4] = np.inf
            if scenario == "shape" and p.name == "w1":
                g = np.zeros((5, 3), np.float32)
        buf.add_grad(p, grad=g)
    if scenario == "withhold" and rank == bad:
        time.sleep(20 * float(os.environ["MPIFUSION_TIMEOUT"]))  # the others give up first
    buf.scale_grads()
    expect = sum(range(1, size + 1)) / size
    if not np.array_equal(params[0].grad, np.full((3, 5), expect, np.float32)):
        sys.exit(f"rank {rank}: wrong result {params[0].grad[0, 0]} (expected {expect})")
    print(f"rank {rank}: ok", flush=True)
''')

# scenario -> substrings that the job's output must hold (rank 1 is the rank at fault)
EXPECTED = {
    "mismatch": ["AgreementError", "ranks disagree", "param #2", "'extra'", "on rank 1",
                 "number of params"],
    "withhold": ["CommTimeoutError", f"did not complete within {DEADLINE:g} s",
                 "2/2 params checked in", "rank 1 of the buffer's communicator has not started"],
    "exit": [],  # the launcher's own report, or a survivor's timeout: checked in the test
    "stall": ["CommTimeoutError", f"did not complete within {DEADLINE:g} s",
              "rank 1 of the buffer's communicator has not started"],
    "nobuffer": ["CommTimeoutError", "duplicating comm_group for mpifusion",
                 f"did not complete within {DEADLINE:g} s"],
    "nan": ["NanInfError", "rank 1: buffer 0: step 0", "w1 (2 of 15)", "2 NaN/Inf"],
    "shape": ["GradError", "rank 1: buffer 0: param 'w1': grad shape expected (3, 5), "
                           "got (5, 3)"],
}


def _processes_with(token: str) -> list:
    """PIDs whose command line mentions ``token`` (this job's driver path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def _run_job(tmp_path: Path, scenario: str, nranks: int, **env_extra: str):
    driver = tmp_path / f"fault_driver_{scenario}_{nranks}.py"
    driver.write_text(DRIVER)
    start = time.monotonic()
    proc = run_job(nranks, [sys.executable, "-m", "mpi4py", str(driver), scenario],
                   timeout=HARD_LIMIT, stderr_to_stdout=True,
                   env={"MPIFUSION_TIMEOUT": str(DEADLINE), **env_extra})
    out = proc.stdout
    elapsed = time.monotonic() - start
    leftover = _processes_with(str(driver))
    for _ in range(50):  # the launcher may take a moment to reap its children
        if not leftover:
            break
        time.sleep(0.1)
        leftover = _processes_with(str(driver))
    for pid in leftover:  # do not leak into later tests, but still fail this one
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not leftover, f"{scenario} at {nranks} ranks left processes running: {leftover}"
    return proc.returncode, out, elapsed


@pytest.mark.parametrize("nranks", RANKS)
@pytest.mark.parametrize("scenario", ["mismatch", "withhold", "stall", "nobuffer", "nan",
                                      "shape"])
def test_fault_ends_with_error(tmp_path, scenario, nranks):
    env = {"MPIFUSION_CHECK_NANINF": "1"} if scenario == "nan" else {}
    rc, out, elapsed = _run_job(tmp_path, scenario, nranks, **env)
    assert rc != 0, f"{scenario} at {nranks} ranks exited 0:\n{out[-3000:]}"
    for text in EXPECTED[scenario]:
        assert text in out, f"{scenario} at {nranks} ranks: {text!r} not in output:\n{out[-3000:]}"
    assert "ok" not in [line.split(": ")[-1] for line in out.splitlines()]
    # start-up plus one deadline (with room for 8 ranks on 2 cores), far below the 80 s the
    # withholding rank sleeps: the job was aborted, not left to run out
    assert elapsed < 10 * DEADLINE, f"{scenario} at {nranks} ranks took {elapsed:.1f} s"


@pytest.mark.parametrize("nranks", RANKS + (8,))
def test_dead_rank_ends_job_within_deadline(tmp_path, nranks):
    rc, out, elapsed = _run_job(tmp_path, "exit", nranks)
    assert rc != 0, f"a rank died but the job exited 0:\n{out[-3000:]}"
    # Either the launcher noticed the dead rank and killed the job (MPICH's hydra does, and
    # passes the dead rank's exit code 3 on, or reports the ranks it killed), or a survivor's
    # deadline expired and its error aborted the job.
    assert rc == 3 or "BAD TERMINATION" in out or "did not complete within" in out, (rc, out)
    # start-up plus one deadline, with room for 8 ranks on 2 cores; never the hard limit
    assert elapsed < 10 * DEADLINE, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("nranks", (2, 3))
def test_healthy_job_passes(tmp_path, nranks):
    """The same driver without a fault: the checks do not get in the way of a good step."""
    rc, out, _ = _run_job(tmp_path, "none", nranks)
    assert rc == 0, out[-3000:]
    assert out.count(": ok") == nranks
