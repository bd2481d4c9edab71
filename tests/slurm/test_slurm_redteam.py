"""Red-team cases of the Slurm path: ways ``scripts/mpifusion.sbatch`` and
``scripts/slurm_cluster.sh`` failed a user (each test failed before its fix, unless its
docstring says it guards behaviour that was already right).

The jobs run on the cluster of ``test_slurm.py`` (same fixture: started once per session or
reused, skipped where Slurm cannot be started); the ``slurm_cluster.sh`` pid-file case needs
no Slurm, only bash and Linux's ``/proc``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_slurm import CLUSTER

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(150)]


# ------------------------------------------------------------------ slurm_cluster.sh


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="needs Linux /proc")
def test_cluster_stop_spares_a_stale_pids_new_owner(tmp_path):
    """A daemon that died without removing its pid file (kill -9, a crash, a reboot with /tmp
    kept) leaves a pid that the system later gives to another process: ``status`` called it
    'slurmd: running' and ``stop`` (which ``start`` also runs first, to clear leftovers)
    SIGTERMed it. Only a process of the daemon's name is now taken for the daemon."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        for name in ("slurmd", "munged"):
            (tmp_path / f"{name}.pid").write_text(f"{bystander.pid}\n")
        env = dict(os.environ, MPIFUSION_SLURM_DIR=str(tmp_path))
        status = subprocess.run(["bash", str(CLUSTER), "status"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 1, status
        assert "slurmd: not running" in status.stdout, status
        assert "munged: not running" in status.stdout, status
        stop = subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert stop.returncode == 0, stop
        time.sleep(0.5)
        assert bystander.poll() is None, f"stop killed an unrelated process: {stop}"
        assert not (tmp_path / "slurmd.pid").exists(), stop  # the stale file is cleared
    finally:
        bystander.kill()
        bystander.wait()


def _processes_mentioning(text: str) -> list:
    """Pids whose command line or environment contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            blob = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in blob:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="needs Linux /proc")
def test_cluster_start_with_its_port_taken(tmp_path):
    """Another program on SlurmctldPort: slurmctld exits at once, and ``start`` ended
    silently with exit code 1 (a failing sinfo under ``set -e -o pipefail``) after 10 s,
    leaving munged and slurmd running. It now says which daemon exited and why (the log's
    'Address already in use'), and stops what it started. A cluster of its own (folder and
    ports), so the session's cluster is not touched."""
    import socket
    import shutil

    if os.geteuid() != 0 or not all(shutil.which(d) for d in ("slurmctld", "slurmd", "munged",
                                                                "sinfo")):
        pytest.skip("needs root and an installed Slurm (scripts/slurm_cluster.sh start)")
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    with socket.socket() as free:
        free.bind(("0.0.0.0", 0))
        slurmd_port = free.getsockname()[1]
    env = dict(os.environ, MPIFUSION_SLURM_DIR=str(tmp_path),
               MPIFUSION_SLURMCTLD_PORT=str(holder.getsockname()[1]),
               MPIFUSION_SLURMD_PORT=str(slurmd_port))
    env.pop("SLURM_CONF", None)
    try:
        began = time.monotonic()
        proc = subprocess.run(["bash", str(CLUSTER), "start"], env=env, capture_output=True,
                              text=True, timeout=120)
        took = time.monotonic() - began
        assert proc.returncode == 1, proc
        assert "slurm_cluster: error: slurmctld exited right after starting" in proc.stderr, proc
        assert "Address already in use" in proc.stderr, proc
        assert took < 40, (took, proc)
        time.sleep(0.5)
        assert _processes_mentioning(str(tmp_path)) == [], proc  # nothing left running
    finally:
        holder.close()
        subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True,
                       timeout=120)
