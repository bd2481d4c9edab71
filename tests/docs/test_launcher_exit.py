"""What the launcher does when one rank of a job exits early, as docs/troubleshooting.md
("Make one rank's error end the job") says.

Rank 1 leaves (``sys.exit(3)``, an uncaught exception, or ``os._exit(3)``) while rank 0
waits in a ``Barrier`` that can never complete. Under ``python -m mpi4py`` every case ends
the job at once with a non-zero code. Under plain ``python``, a rank that dies without
``MPI_Finalize`` (``os._exit``) ends it too, but ``sys.exit`` and an exception run mpi4py's
``MPI_Finalize`` at exit, which waits for rank 0, and the job never ends by itself.
(Measured 2026-12-04, MPICH 5.0.2 and Open MPI 5.0.11 wheels: the hanging cases held until
a 15 s kill, the others ended within 1-3 s; the docs once said the launcher ends the job
on any non-zero exit.)
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.faults.strategies import impi_python
from tests.helpers import run_cmd, run_job

SCRIPT = """\
import os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
if comm.Get_rank() == 1:
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(3)
    if mode == "raise":
        raise RuntimeError("rank 1 fails")
    os._exit(3)
comm.Barrier()
print("rank 0 passed the barrier", flush=True)
"""
#: how long a job that should end by itself may take (the launcher's start-up under load)
ENDS_WITHIN = 120
#: how long a job that should hang is watched
WATCH = 6


@pytest.mark.parametrize("mode, code", [("exit", 3), ("raise", 1), ("_exit", 3)])
def test_python_m_mpi4py_ends_the_job(tmp_path, mode, code):
    script = tmp_path / "x.py"
    script.write_text(SCRIPT)
    out = run_job(2, [sys.executable, "-m", "mpi4py", script, mode], timeout=ENDS_WITHIN)
    assert out.returncode == code, out.stdout + out.stderr
    assert "passed the barrier" not in out.stdout


def test_a_rank_dying_without_finalize_ends_the_job(tmp_path):
    script = tmp_path / "x.py"
    script.write_text(SCRIPT)
    out = run_job(2, [sys.executable, script, "_exit"], timeout=ENDS_WITHIN)
    # the dead rank's code, or 9 where hydra reports the SIGKILL it sent rank 0 first
    assert out.returncode in (3, 9), out.stdout + out.stderr
    assert "passed the barrier" not in out.stdout


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_plain_python_exit_leaves_the_job_waiting(tmp_path, mode):
    script = tmp_path / "x.py"
    script.write_text(SCRIPT)
    out = run_job(2, [sys.executable, script, mode], timeout=WATCH, hang_ok=True)
    assert out.returncode is None, (
        f"the job ended by itself (exit {out.returncode}); the docs say it waits:\n"
        + out.stdout + out.stderr)


#: Intel MPI's hydra (impi-rt 2021.18): a dead rank's job ends with 255 ("BAD TERMINATION"),
#: the others with the rank's own code (measured 2026-12-06)
IMPI_CODES = {("m", "exit"): 3, ("m", "raise"): 1, ("m", "_exit"): 255, ("plain", "_exit"): 255}


@pytest.mark.parametrize("launch, mode", sorted(IMPI_CODES))
def test_intel_mpi_ends_the_job(tmp_path, launch, mode):
    """The cases that end the job under MPICH end it under Intel MPI too, as
    docs/getting-started.md says ($MPIFUSION_IMPI_VENV)."""
    python = impi_python()
    script = tmp_path / "x.py"
    script.write_text(SCRIPT)
    mpiexec = str(Path(python).parent / "mpiexec")
    cmd = [mpiexec, "-n", "2", python, *(["-m", "mpi4py"] if launch == "m" else []),
           str(script), mode]
    out = run_cmd(cmd, timeout=ENDS_WITHIN)
    assert out.returncode == IMPI_CODES[(launch, mode)], out.stdout + out.stderr
    assert "passed the barrier" not in out.stdout
