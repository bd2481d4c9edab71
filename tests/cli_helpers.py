"""Shared helpers of the command-line tests: run mpifusion in-process or under mpiexec."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from mpifusion.cli import main


def run_cli(capsys, *argv: str) -> tuple:
    """(exit code, stdout, stderr) of ``mpifusion ARGV`` run in this process."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def mpiexec(n: int, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``mpiexec -n N python -m mpifusion ARGV`` in a fresh job (bounded by ``timeout``)."""
    exe = shutil.which("mpiexec")
    if exe is None:
        pytest.skip("mpiexec not on PATH")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    return subprocess.run([exe, "-n", str(n), sys.executable, "-m", "mpifusion", *argv],
                          capture_output=True, text=True, timeout=timeout, env=env)
