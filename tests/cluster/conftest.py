"""What the tests across the emulated cluster's nodes share (``scripts/cluster.sh``): clusters
of any number of nodes, started once per module on demand and always stopped, and jobs run on
them with a hard time limit.

A test skips only where ``scripts/cluster.sh`` exits 3 (it cannot run here: not root, no
``ip netns``, no Open MPI launcher for ``--mpi openmpi``); every other failure of the script
fails the test.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from tests.cluster.test_cluster import CLUSTER, REPO, cluster, leftovers, start, state_root
from tests.helpers import run_cmd


def _skip_or_fail(proc: subprocess.CompletedProcess, what: str) -> None:
    """Exit 3 of scripts/cluster.sh is a skip (its message says what is missing)."""
    if proc.returncode == 3:
        message = (proc.stderr or proc.stdout).strip()
        if "Open MPI" in message:
            pytest.skip(f"Open MPI: scripts/cluster.sh cannot run it here (exit 3): {message}")
        pytest.skip(f"needs root and working ip netns: scripts/cluster.sh exit 3: {message}")
    if what:
        pytest.fail(f"scripts/cluster.sh {what} failed (exit {proc.returncode}):\n"
                    f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def start_cluster(name: str, nodes: int) -> str:
    """Start ``name`` with ``nodes`` nodes on a free subnet; its subnet (``test_cluster.start``:
    a skip where the script cannot run here)."""
    return start(name, nodes)


@pytest.fixture(scope="module")
def clusters():
    """``clusters(nodes)``: the name of a cluster of ``nodes`` nodes, started on first use
    (one per node count for the module), all stopped at the end whatever happened, and
    checked to leave nothing behind."""
    made: Dict[int, str] = {}
    cannot: List[str] = []  # why no cluster can run here (not root, ...): every test skips
    prefix = f"mfn{os.getpid()}"

    def get(nodes: int) -> str:
        if cannot:
            pytest.skip(cannot[0])
        if nodes not in made:
            name = f"{prefix}x{nodes}"
            cluster("stop", name)
            made[nodes] = name  # stopped at the end even if its start fails half-way
            try:
                start_cluster(name, nodes)
            except pytest.skip.Exception as exc:  # nothing was made: nothing to stop
                del made[nodes]
                cannot.append(str(exc))
                raise
        return made[nodes]

    try:
        yield get
    finally:
        stopped = {name: cluster("stop", name) for name in made.values()}
    for name, proc in stopped.items():
        assert proc.returncode == 0, proc.stderr
        assert leftovers(name, state_root() / name) == []


def python_of(mpi: str) -> str:
    """The Python of the venv whose MPI the job uses: this one for MPICH; for Open MPI the
    venv scripts/cluster.sh takes ($MPIFUSION_OPENMPI_VENV, else the repository's
    .venv-ompi). Missing, the job is still run: scripts/cluster.sh then exits 3 (a skip)."""
    if mpi == "mpich":
        return sys.executable
    venv = os.environ.get("MPIFUSION_OPENMPI_VENV") or str(REPO / ".venv-ompi")
    return str(Path(venv) / "bin" / "python")


def launcher_args(name: str, per: int, mpi: str) -> List[str]:
    """``bash scripts/cluster.sh mpiexec NAME PER --mpi MPI [--mpiexec PATH] --``."""
    exe = Path(python_of(mpi)).parent / "mpiexec"
    return ["bash", str(CLUSTER), "mpiexec", name, str(per), "--mpi", mpi,
            *(["--mpiexec", str(exe)] if exe.exists() else []), "--"]


def run_on(name: str, per: int, mpi: str, argv: List[str], timeout: float,
           env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``argv`` (after the venv's python) on every node of ``name``, ``per`` ranks each; a
    skip where scripts/cluster.sh cannot run it (exit 3). Past ``timeout`` the job's whole
    session is killed and the test fails (tests.helpers.run_cmd)."""
    proc = run_cmd([*launcher_args(name, per, mpi), python_of(mpi), *argv], timeout=timeout,
                   cwd=str(REPO), env=env)
    if proc.returncode == 3 and "cluster:" in (proc.stderr or ""):
        _skip_or_fail(proc, "")
    return proc
