"""Faults across the nodes of an emulated cluster (``scripts/cluster.sh``): a rank killed (or
stopped) on the second node, the second node's link set down in the middle of a collective,
a node whose ranks never build their buffer, and a node whose ranks never even initialise
MPI.

Each job runs 2 nodes of 2 ranks (``auto``: ``hierarchical``) with ``MPIFUSION_TIMEOUT`` =
DEADLINE under ``python -m mpi4py`` (a rank's uncaught error aborts the job). Every rank
writes what happened to a file of its own (a node whose link is down cannot forward its
output). Every case must end: each surviving rank with one of mpifusion's named errors within
its deadline, or the launcher ending the job; never a hang. Afterwards no process is left in
the nodes and nothing of mpifusion's in ``/dev/shm`` (MPICH's own ``mpich_shm_*`` segment,
which it leaves after any abnormal end, is swept and listed).

What happens (measured on 2 busy cores):

- kill -9 of a rank: the launcher sees it die and ends the job (hydra: exit 255 "BAD
  TERMINATION" in 2-4 s; PRTE: 137 in 5-6 s), before any deadline (hydra's proxy on the
  dead rank's node ends that node's other ranks even with ``-disable-auto-cleanup``);
- SIGSTOP of a rank (alive to the launcher): every survivor, the stopped rank's node-mate in
  its node's shared-window stage included, raises CommTimeoutError after DEADLINE;
- link down: every rank, on both nodes, raises CommTimeoutError after DEADLINE ("every rank
  has started it (a rank may have died or stalled inside the collective)") and aborts; hydra
  then ends the job with the link still down; PRTE waits for the unreachable node's daemon
  until the link is back (then ends it within seconds): a PRTE limit, not mpifusion's;
- no buffer on a node: the survivors raise CommTimeoutError ("duplicating comm_group ... some
  rank of the 4 has not built a buffer") after DEADLINE; the first abort ends the job;
- no MPI_Init on a node: the other ranks wait in MPI_Init itself (the launcher's start-up
  barrier), before mpifusion or any Python after the import runs, so no deadline of
  mpifusion's can apply: only the launcher's own limit ends it (``MPIEXEC_TIMEOUT`` for
  hydra, ``--timeout`` for PRTE); hydra's is tested here.

The module is also its own driver: ``python -m mpi4py test_node_faults.py SCENARIO DIR``.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NODES, PER = 2, 2
DEADLINE = 5.0            # MPIFUSION_TIMEOUT of the jobs, seconds
#: params of the driver's buffer (fp32): 5 MiB in all, so a collective is in flight for tens of
#: milliseconds on the 1 Gbit/s links
SIZES = (7, 300007, 1000003)


# ------------------------------------------------------------------ the driver (each rank)


def _driver(scenario: str, folder: str) -> None:
    """One job's ranks; the ranks of the last node are the ones at fault. Each rank appends
    ``TIME WHAT`` lines to ``FOLDER/rank{r}.txt``."""
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
    size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "-1")))

    def say(text: str) -> None:
        with open(os.path.join(folder, f"rank{rank}.txt"), "a") as f:
            f.write(f"{time.time():.3f} {text}\n".replace("\r", " "))

    at_fault = rank >= size - PER
    if scenario == "noinit" and at_fault:
        say("sleeps before MPI_Init")
        time.sleep(600)
    import numpy as np
    from mpi4py import MPI

    from mpifusion import FusedCommBuffer, HookAction, Param

    comm = MPI.COMM_WORLD
    # SIGUSR1 writes every thread's stack to stacks{rank}.txt: what a hung rank waits in
    stacks = open(os.path.join(folder, f"stacks{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    say(f"initialised on {MPI.Get_processor_name()} pid {os.getpid()}")
    try:
        if scenario == "nobuffer" and at_fault:
            say("never builds its buffer")
            time.sleep(600)
        params = [Param(f"w{i}", np.zeros(n, np.float32)) for i, n in enumerate(SIZES)]
        buf = FusedCommBuffer(0, params, comm, act=HookAction.ALL_REDUCE)
        say(f"built {buf.comm.strategy}")
        for step in range(1000):  # linkdown: until the link goes down under a collective
            for p in reversed(params):
                buf.add_grad(p, grad=np.full(p.shape, rank + 1.0, np.float32))
            say(f"step {step} started")  # the last add_grad started the collective
            if scenario in ("kill", "stall") and step == 1 and rank == size - PER:
                os.kill(os.getpid(), signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)
            buf.scale_grads()
            if scenario != "linkdown" and step == 2:
                break
        say("ok")
    except Exception as exc:
        say(f"caught {type(exc).__name__}: {exc}".replace("\n", " "))
        # the other survivors' deadlines pass meanwhile: each says what it raised before the
        # first abort ends them
        time.sleep(float(os.environ.get("FAULT_LINGER", "0")))
        raise  # python -m mpi4py: the error aborts the job


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _driver(sys.argv[1], sys.argv[2])
    sys.exit(0)


# ------------------------------------------------------------------ the tests

import re  # noqa: E402
import subprocess  # noqa: E402
from typing import Dict, List, Optional  # noqa: E402

import pytest  # noqa: E402

from tests import leftovers as shm_leftovers  # noqa: E402
from tests.cluster.conftest import launcher_args, python_of  # noqa: E402
from tests.cluster.test_cluster import cluster, state_root  # noqa: E402
from tests.helpers import MPI_ENV  # noqa: E402

#: a job's hard limit, seconds (start-up of 4 ranks on 2 cores, one deadline, the abort)
HARD_LIMIT = 90
#: mpifusion's errors a surviving rank may end with
NAMED = {"CommTimeoutError", "CommError", "OrderError", "AbandonedError"}
#: what of mpifusion's windows an MPI can leave in /dev/shm (tests/comm/test_shm_strategy.py)
WINDOW_FILES = ("mpich_shar", "osc_sm", "mpifusion")


def _lines(folder: Path) -> Dict[int, List[tuple]]:
    """rank -> [(time, text)] of what it said."""
    said = {}
    for f in folder.glob("rank*.txt"):
        rows = []
        for line in f.read_text().splitlines():
            stamp, _, text = line.partition(" ")
            rows.append((float(stamp), text))
        said[int(f.stem[4:])] = rows
    return said


def _when(said: Dict[int, List[tuple]], rank: int, prefix: str) -> Optional[float]:
    return next((t for t, text in said.get(rank, []) if text.startswith(prefix)), None)


def _node_processes(name: str) -> str:
    """scripts/cluster.sh status's process counts of the nodes that are not 0."""
    out = cluster("status", name).stdout
    return " ".join(line for line in out.splitlines()
                    if re.search(r"processes [1-9]", line))


def _link_of_last_node(name: str) -> str:
    """The bridge side of the last node's veth (the third field of the state's nodes)."""
    rows = (state_root() / name / "nodes").read_text().split("\n")
    return [r for r in rows if r.strip()][-1].split()[2]


class Job:
    """A fault job on the cluster: started, watched through the ranks' files, ended."""

    def __init__(self, name: str, mpi: str, scenario: str, folder: Path, env: dict):
        self.folder = folder
        folder.mkdir()
        cmd = [*launcher_args(name, PER, mpi), python_of(mpi), "-m", "mpi4py", __file__,
               scenario, str(folder)]
        full = dict(os.environ, **MPI_ENV, **env, MPIFUSION_TIMEOUT=str(DEADLINE))
        full["PYTHONPATH"] = str(REPO)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=full, cwd=str(REPO), start_new_session=True)

    def until(self, ready, limit: float) -> bool:
        """Poll ``ready(said)`` until True (True), the job ended or ``limit`` s passed."""
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if ready(_lines(self.folder)):
                return True
            if self.proc.poll() is not None:
                return bool(ready(_lines(self.folder)))
            time.sleep(0.05)
        return False

    def wait(self, limit: float) -> Optional[int]:
        """The job's exit code once it ended within ``limit`` s, else None (still running)."""
        try:
            self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            return None
        return self.finish(1)

    def finish(self, limit: float) -> Optional[int]:
        """The job's exit code once it ended within ``limit`` s; None (and its session
        killed) where it did not."""
        try:
            self.out, _ = self.proc.communicate(timeout=limit)
            return self.proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.out, _ = self.proc.communicate()
            return None

    def report(self) -> str:
        kept = "".join(f"--- {f.name}\n{f.read_text()}" for f in sorted(self.folder.iterdir()))
        return f"{getattr(self, 'out', '')[-4000:]}\n{kept}"


@pytest.fixture
def clean(clusters):
    """The 2-node cluster, and after the test: no process left in its nodes, none of
    mpifusion's files in /dev/shm (MPICH's own segment swept and listed)."""
    before = shm_leftovers.snapshot()
    name = clusters(NODES)
    yield name
    deadline = time.monotonic() + 10  # the launcher's last processes may still be exiting
    while _node_processes(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _node_processes(name)
    stale = shm_leftovers.leftovers(before, min_age=0.0)
    ours = [p.name for p in stale if p.parent == shm_leftovers.SHM
            and p.name.startswith(WINDOW_FILES)]
    swept = shm_leftovers.remove([p for p in stale if p.name.startswith("mpich_shm_")])
    if swept:
        print(f"MPICH's own segments left by the job, swept: {[p.name for p in swept]}")
    assert not left, f"processes left in the nodes: {left}"
    assert not ours, f"mpifusion's shared windows left in /dev/shm: {ours}"


def _survivors_named(said: Dict[int, List[tuple]], ranks, started: float,
                     everyone: bool) -> List[str]:
    """What is wrong with the ranks' ends: a rank that says 'ok', raised something not
    mpifusion's, or (``everyone``) did not raise CommTimeoutError within DEADLINE (+3 s for
    2 busy cores) of ``started``; at least one rank must have."""
    problems, timed_out = [], 0
    for r in ranks:
        texts = [text for _, text in said.get(r, [])]
        if "ok" in texts:
            problems.append(f"rank {r} says ok")
        for text in texts:
            m = re.match(r"caught (\w+): (.*)", text)
            if m and m.group(1) not in NAMED:
                problems.append(f"rank {r} raised {m.group(1)}, not a named error of "
                                f"mpifusion's: {m.group(2)[:300]}")
        caught = _when(said, r, "caught CommTimeoutError")
        if caught is not None:
            timed_out += 1
            if not DEADLINE - 0.5 <= caught - started <= DEADLINE + 3:
                problems.append(f"rank {r}: CommTimeoutError {caught - started:.1f} s after "
                                f"the fault's collective started, expected about {DEADLINE}")
        elif everyone:
            problems.append(f"rank {r}: no CommTimeoutError: {texts[-1:]}")
    if not timed_out:
        problems.append("no rank raised CommTimeoutError")
    return problems


MPIS = ["mpich", "openmpi"]


@pytest.mark.timeout(HARD_LIMIT + 60)
@pytest.mark.parametrize("mpi", MPIS)
def test_a_rank_killed_on_the_second_node_ends_the_job(clean, tmp_path, mpi):
    """kill -9 of the second node's first rank right after it started a collective: the
    launcher ends the job (before the survivors' deadline, or a survivor's CommTimeoutError
    does); no survivor says ok or raises anything unnamed."""
    job = Job(clean, mpi, "kill", tmp_path / "said", {})
    rc = job.finish(HARD_LIMIT)
    said = _lines(job.folder)
    assert rc is not None, f"the job ran past {HARD_LIMIT} s:\n{job.report()}"
    assert rc != 0, job.report()
    assert _when(said, NODES * PER - PER, "step 1 started") is not None, job.report()
    killed_at = _when(said, NODES * PER - PER, "step 1 started")
    ended_by_launcher = ("BAD TERMINATION" in job.out or rc == 137
                         or "terminated" in job.out.lower())
    survivors = [r for r in range(NODES * PER) if r != NODES * PER - PER]
    for r in survivors:
        texts = [text for _, text in said.get(r, [])]
        assert "ok" not in texts, job.report()
        assert all(re.match(r"caught (\w+)", t).group(1) in NAMED
                   for t in texts if t.startswith("caught")), job.report()
    if not ended_by_launcher:  # then the survivors' deadline ended it
        assert not _survivors_named(said, survivors, killed_at, everyone=False), job.report()
    assert time.time() - killed_at < 30, job.report()


@pytest.mark.timeout(HARD_LIMIT + 60)
@pytest.mark.parametrize("mpi", MPIS)
def test_a_rank_stopped_on_the_second_node_is_a_timeout_on_every_survivor(clean, tmp_path,
                                                                          mpi):
    """SIGSTOP instead of a kill (alive to the launcher, gone to MPI: a launcher that does
    not end a job when one rank dies leaves the survivors the same wait): every survivor --
    the stopped rank's node-mate, waiting in its node's shared-window stage, and the other
    node's ranks, waiting across the nodes -- raises CommTimeoutError within its deadline,
    and the aborts end the job, the stopped rank too."""
    job = Job(clean, mpi, "stall", tmp_path / "said", {"FAULT_LINGER": "3"})
    rc = job.finish(HARD_LIMIT)
    said = _lines(job.folder)
    assert rc is not None and rc != 0, f"exit {rc}:\n{job.report()}"
    victim = NODES * PER - PER
    assert _when(said, victim, "step 1 started") is not None, job.report()
    for r in range(NODES * PER):
        if r != victim:
            problems = _survivors_named(said, [r], _when(said, r, "step 1 started"),
                                        everyone=True)
            assert not problems, "\n".join(problems) + "\n" + job.report()


@pytest.mark.timeout(HARD_LIMIT + 60)
@pytest.mark.parametrize("mpi, strategy", [("mpich", "auto"), ("mpich", "thread"),
                                           ("openmpi", "auto")])
def test_a_link_down_mid_collective_is_a_timeout_on_every_rank(clean, tmp_path, mpi,
                                                               strategy):
    """The second node's link goes down once every rank started its first collective (5 MiB
    at 1 Gbit/s: still in flight): every rank, on both nodes, raises CommTimeoutError within
    its deadline of the collective it waits for (each waits FAULT_LINGER before its abort,
    so that one rank's abort does not end the others just before their own deadline).
    Hydra then ends the job with the link still down; PRTE waits for the unreachable node's
    daemon, so the link comes back after a grace period and the job must end then."""
    link = _link_of_last_node(clean)
    job = Job(clean, mpi, "linkdown", tmp_path / "said",
              {"MPIFUSION_COMM_STRATEGY": strategy, "FAULT_LINGER": "3"})
    down_at = None
    try:
        ready = job.until(lambda said: len(said) == NODES * PER and all(
            _when(said, r, "step 0 started") for r in range(NODES * PER)), HARD_LIMIT / 2)
        assert ready, f"the job did not start its steps:\n{job.report()}"
        subprocess.run(["ip", "link", "set", link, "down"], check=True, timeout=10)
        down_at = time.time()
        everyone = job.until(lambda said: all(_when(said, r, "caught")
                                              for r in range(NODES * PER)), DEADLINE + 15)
        if mpi == "mpich":
            rc = job.finish(DEADLINE + 10)
        else:
            rc = job.wait(5)
            if rc is None:  # PRTE's daemon on the far node is unreachable: give it back
                subprocess.run(["ip", "link", "set", link, "up"], check=True, timeout=10)
                rc = job.finish(30)
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], timeout=10)
        if job.proc.poll() is None:
            job.finish(0.1)
    said = _lines(job.folder)
    assert everyone, f"not every rank raised an error:\n{job.report()}"
    assert rc is not None and rc != 0, f"the job did not end (exit {rc}):\n{job.report()}"
    assert down_at is not None
    for r in range(NODES * PER):
        # the collective it timed out on: the last one it started before raising
        caught = _when(said, r, "caught")
        started = max(t for t, text in said[r] if text.startswith("step ") and t <= caught)
        problems = _survivors_named(said, [r], started, everyone=True)
        assert not problems, "\n".join(problems) + "\n" + job.report()
        assert "did not complete within 5 s" in said[r][-1][1], job.report()


@pytest.mark.timeout(HARD_LIMIT + 60)
@pytest.mark.parametrize("mpi", MPIS)
def test_a_node_that_never_builds_its_buffer(clean, tmp_path, mpi):
    """The second node's ranks initialise MPI and then sleep instead of building their
    buffer: the first node's ranks raise CommTimeoutError naming the missing buffer within
    their deadline, and the abort ends the job (the sleeping ranks too)."""
    job = Job(clean, mpi, "nobuffer", tmp_path / "said", {"FAULT_LINGER": "3"})
    rc = job.finish(HARD_LIMIT)
    said = _lines(job.folder)
    assert rc is not None and rc != 0, f"exit {rc}:\n{job.report()}"
    first = list(range(PER))
    starts = [_when(said, r, "initialised") for r in first]
    assert all(starts), job.report()
    assert not _survivors_named(said, first, max(starts), everyone=True), job.report()
    for r in first:
        caught = [text for _, text in said[r] if text.startswith("caught")]
        assert all("duplicating comm_group for mpifusion" in t and "has not built a buffer"
                   in t for t in caught), job.report()
    assert time.time() - max(starts) < DEADLINE + 20, job.report()


@pytest.mark.timeout(HARD_LIMIT + 60)
def test_a_node_that_never_initialises_mpi_is_ended_by_the_launchers_limit(clean, tmp_path):
    """The second node's ranks sleep before MPI_Init: the others wait inside MPI_Init (hydra's
    start-up barrier), where no deadline of mpifusion's can apply; MPIEXEC_TIMEOUT ends the
    job, and before it the other ranks never got past MPI_Init."""
    limit = 12
    job = Job(clean, "mpich", "noinit", tmp_path / "said", {"MPIEXEC_TIMEOUT": str(limit)})
    rc = job.finish(HARD_LIMIT)
    said = _lines(job.folder)
    assert rc is not None and rc != 0, f"exit {rc}:\n{job.report()}"
    assert "APPLICATION TIMED OUT" in job.out, job.report()
    assert all(_when(said, r, "initialised") is None for r in range(NODES * PER)), \
        job.report()
    assert limit <= time.monotonic() - job.started < limit + 20, job.report()
