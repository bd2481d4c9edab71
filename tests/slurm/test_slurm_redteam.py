"""Red-team cases of the Slurm path: ways ``scripts/mpifusion.sbatch`` and
``scripts/slurm_cluster.sh`` failed a user (each test failed before its fix, unless its
docstring says it guards behaviour that was already right).

The jobs run on the cluster of ``test_slurm.py`` (same fixture: started once per session or
reused, skipped where Slurm cannot be started); the ``slurm_cluster.sh`` pid-file case needs
no Slurm, only bash and Linux's ``/proc``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_slurm import (CLUSTER, SBATCH_SCRIPT, _dump, _seconds, run_job,  # noqa: F401
                         slurm_env, wait)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(150)]


def _sbatch_with_args(env: dict, tmp_path: Path, script_args: list, *options: str,
                      **settings: str) -> str:
    """sbatch the script with arguments after its name (as ``sbatch script ARG ...``)."""
    proc = subprocess.run(["sbatch", "--parsable", "--time=2", f"--chdir={tmp_path}",
                           f"--output={tmp_path / 'job-%j.out'}", *options, str(SBATCH_SCRIPT),
                           *script_args],
                          env=dict(env, **settings), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


# ------------------------------------------------------------------ the batch script


def test_missing_venv_is_a_launch_error(slurm_env, tmp_path):
    """MPIFUSION_VENV naming no venv: was bash's 'line 32: .../bin/activate: No such file or
    directory' and exit code 1, which is mpifusion's FAIL verdict (a bad gradient), so
    ``afterok`` chains and scripts reading the code blamed the numbers. Now exit 3 (could not
    start), saying which variable names what."""
    missing = tmp_path / "no such venv"
    job = run_job(slurm_env, tmp_path, "--ntasks=2", MPIFUSION_VENV=str(missing))
    assert (job.state, job.exit_code) == ("FAILED", 3), job
    assert f"mpifusion.sbatch: error: MPIFUSION_VENV={missing}" in job.log, job
    assert "bin/activate" in job.log and "line " not in job.log, job


def test_a_bad_srun_option_is_named_not_a_missing_install(slurm_env, tmp_path):
    """MPIFUSION_SRUN_MPI naming no PMI plugin: srun refuses, and the script's hint asked
    whether mpifusion and mpi4py were installed (they were). Now it names srun's options
    first, where they came from and the variables that set them; still exit 3."""
    job = run_job(slurm_env, tmp_path, "--ntasks=2", MPIFUSION_SRUN_MPI="bogus")
    assert (job.state, job.exit_code) == ("FAILED", 3), job
    assert ("mpifusion info failed on the tasks" in job.log
            and "srun's options (--mpi=bogus from MPIFUSION_SRUN_MPI" in job.log), job.log


def test_script_arguments_are_mpifusion_arguments(slurm_env, tmp_path):
    """``sbatch mpifusion.sbatch check --spec S DIR``: the script ignored its arguments and
    ran the default ``mpifusion run``, which passed: exit 0 and 'PASS' for a dump with a wrong
    element that was never read. Arguments after the script are now mpifusion's, one word
    each, so paths with spaces (which MPIFUSION_ARGS, split on spaces, cannot carry) work."""
    folder = tmp_path / "with spaces" / "run 1"
    spec = _dump(folder, wrong=True)
    job_id = _sbatch_with_args(slurm_env, tmp_path,
                               ["check", "--spec", str(spec), str(folder / "dump")],
                               "--ntasks=1")
    job = wait(slurm_env, tmp_path, job_id)
    assert (job.state, job.exit_code) == ("FAILED", 1), job
    assert re.search(r"^FAIL: 1 param.*\bw\b", job.log, re.M), job
    assert "mpifusion run:" not in job.log, job


def test_script_arguments_and_mpifusion_args_both_set_is_bad_input(slurm_env, tmp_path):
    """Both given: which one runs would be a guess; refused (exit 2) before any srun."""
    job_id = _sbatch_with_args(slurm_env, tmp_path, ["run", "--steps", "1"], "--ntasks=1",
                               MPIFUSION_ARGS="run --steps 2")
    job = wait(slurm_env, tmp_path, job_id)
    assert (job.state, job.exit_code) == ("FAILED", 2), job
    assert ("mpifusion.sbatch: error: mpifusion arguments given both after the script and in"
            " MPIFUSION_ARGS") in job.log, job
    assert "world size" not in job.log, job  # nothing was started


def test_mpifusion_args_are_not_globbed(slurm_env, tmp_path):
    """MPIFUSION_ARGS is split on spaces; its words were also expanded as file patterns in the
    job's folder, so ``--spec spec?.json`` read whichever file matched instead of failing."""
    spec = _dump(tmp_path, wrong=False)
    spec.rename(tmp_path / "spec1.json")
    job = run_job(slurm_env, tmp_path, "--ntasks=1",
                  MPIFUSION_ARGS=f"check --spec spec?.json {tmp_path / 'dump'}")
    assert (job.state, job.exit_code) == ("FAILED", 2), job
    assert "spec?.json" in job.log and "PASS" not in job.log, job


def test_default_deadline_fits_the_time_limit(slurm_env, tmp_path):
    """A rank that stalls in a job with a 1-minute time limit: the default deadline (300 s)
    outlived the job, which ended in Slurm's TIMEOUT after 71 s with no word about which rank
    never started the collective. The script's default deadline is now at most half the job's
    time left, so the survivors raise CommTimeoutError naming rank 1 within the limit."""
    job = run_job(slurm_env, tmp_path, "--ntasks=2", "--time=1",
                  MPIFUSION_TEST_FAULT="stall:1")
    assert job.state == "FAILED" and job.exit_code != 0, job
    assert re.search(r"^\S*CommTimeoutError: rank 0: .*\brank 1\b", job.log, re.M), job
    assert "DUE TO TIME LIMIT" not in job.log, job
    assert re.search(r"^deadline: MPIFUSION_TIMEOUT=\d+ s \(half the job's \d+ s left",
                     job.log, re.M), job
    assert _seconds(job.run_time) < 60, job


def test_explicit_deadline_beyond_the_time_limit_is_warned(slurm_env, tmp_path):
    """A deadline the user set longer than the job's time left is kept, with a warning that a
    stalled rank will then end in Slurm's time limit, not in an error naming it."""
    job = run_job(slurm_env, tmp_path, "--ntasks=2", "--time=1",
                  MPIFUSION_ARGS="run --steps 1", MPIFUSION_TIMEOUT="600")
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job
    assert re.search(r"mpifusion.sbatch: warning: MPIFUSION_TIMEOUT=600 s is longer than the "
                     r"job's time left \(\d+ s\)", job.log), job


def test_killed_rank_ends_the_step(slurm_env, tmp_path):
    """Guard (right before): rank 1 SIGKILLed mid-step (the OOM killer, ``kill -9``) ends the
    whole step at once, srun names the task, the job fails well before the deadline."""
    job = run_job(slurm_env, tmp_path, "--ntasks=3", MPIFUSION_ARGS="run --steps 50",
                  MPIFUSION_TIMEOUT="120", MPIFUSION_TEST_FAULT="kill:1")
    assert job.state == "FAILED" and job.exit_code > 2, job
    assert re.search(r"srun: error: \S+: task 1: Killed", job.log), job
    assert "a rank died or was killed" in job.log and "PASS" not in job.log, job
    assert _seconds(job.run_time) < 60, job


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
