"""The ``shm`` strategy's memory can never kill the job, and communicators are a budget.

Serially, jobs of ``scripts/shm_memory_check.py`` under both MPIs (Open MPI from
$MPIFUSION_OPENMPI_VENV): in a private /dev/shm too small for every buffer (root and
``unshare --mount``), the buffers that do not fit fall back to private memory, agreed, with a
one-line warning naming the bytes wanted and free, and the sums stay right (no SIGBUS, exit 0);
a region given back and reused when /dev/shm is full falls back too; buffers built and closed
by the hundred, and Split/buffer/step/Free by the hundred, keep descriptors, mappings, RSS,
windows, regions and communicators flat (the full 5,000 / 3,000 run is the script's, see
docs/performance.md); and a job killed mid-run leaves nothing of ours in /dev/shm.

Under mpiexec (``--only-mpi``, 2-3 ranks): regions whose offsets differ between ranks (a grad
kept on one rank only) reduce right, freed extents are reused, and building buffers makes no
MPI window.
"""
import gc
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import FusedCommBuffer, HookAction, Param
from mpifusion.comm import arena, shm
from mpifusion.config import CommOptions

from tests.helpers import REPO, run_cmd

SCRIPT = str(REPO / "scripts" / "shm_memory_check.py")
#: the names our shared memory may have in /dev/shm: the arena's files, the MPIs' window files
OURS = (arena.FILE_PREFIX, "mpich_shar", "osc_sm")


# ------------------------------------------------------------------ serial: whole jobs

def _mpi(which):
    """``(mpiexec, python)`` of MPICH (this venv) or Open MPI ($MPIFUSION_OPENMPI_VENV)."""
    if which == "mpich":
        from tests.helpers import mpiexec_path
        return mpiexec_path(), sys.executable
    from tests.faults.strategies import openmpi_python
    python = openmpi_python()
    return os.path.join(os.path.dirname(python), "mpiexec"), python


_UNSHARE = {}


def _private_shm_works():
    """Whether this process may run a command with a small /dev/shm of its own."""
    if "ok" not in _UNSHARE:
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            _UNSHARE["ok"] = "needs root (a private /dev/shm: unshare --mount)"
        else:
            proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh",
                                   "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                                  capture_output=True, text=True)
            _UNSHARE["ok"] = "" if proc.returncode == 0 else (
                f"needs root with unshare --mount and mount (a private /dev/shm): "
                f"{proc.stderr.strip()[:200]}")
    if _UNSHARE["ok"]:
        pytest.skip(_UNSHARE["ok"])


def in_private_shm(which, ranks, args, free_mib=None, timeout=180, after=""):
    """Run the script's ``args`` at ``ranks`` ranks of MPI ``which`` with a private /dev/shm
    (300 MiB, filled to ``free_mib`` free); then ``after`` (shell) in the same namespace."""
    _private_shm_works()
    mpiexec, python = _mpi(which)
    fill = "" if free_mib is None else \
        f"fallocate -l $(( (300 - {free_mib}) * 1048576 )) /dev/shm/filler && "
    job = " ".join([mpiexec, "-n", str(ranks), python, SCRIPT, *map(str, args)])
    shell = (f"mount -t tmpfs -o size=300m tmpfs /dev/shm && {fill}{job}; rc=$?; {after} "
             f"echo \"job exit $rc\"; exit $rc")
    return run_cmd(["unshare", "--mount", "--propagation", "private", "sh", "-c", shell],
                   timeout=timeout, stderr_to_stdout=True)


MPIS = ["mpich", "openmpi"]
#: (MiB free in /dev/shm, buffers, MiB each): more than fits, at 2 ranks
TIGHT = [(100, 2, 30), (100, 4, 14), (48, 1, 40)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which", MPIS)
def test_too_little_shared_memory_falls_back_instead_of_sigbus(which):
    for free, nbuf, mib in TIGHT:
        proc = in_private_shm(which, 2, ["tight", nbuf, mib], free_mib=free)
        out = proc.stdout
        assert proc.returncode == 0, f"{free} MiB free, {nbuf} x {mib} MiB: {out[-3000:]}"
        shared = int(re.search(r"buffers in shared memory: (\d+) of", out).group(1))
        assert shared < nbuf, out[-3000:]  # they do not all fit
        warnings = re.findall(r"^rank (\d): buffer \d+: storage not in shared memory "
                              r"\((\d+) bytes of shared memory wanted on the node \(\d+ per "
                              r"rank\), /dev/shm has (\d+) free\)", out, re.M)
        # every rank says so for each buffer that did not fit (agreed), in one line
        assert len(warnings) == 2 * (nbuf - shared), out[-3000:]
        assert all(int(wanted) > int(left) for _, wanted, left in warnings), warnings


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", MPIS)
def test_a_region_given_back_and_reused_when_shm_is_full_falls_back(which):
    proc = in_private_shm(which, 2, ["reuse", 20], free_mib=100)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert len(re.findall(r"grad storage: its shared-memory region cannot be reused "
                          r"\(20971520 bytes of shared memory wanted again, /dev/shm has "
                          r"\d+ free", out)) == 2, out[-3000:]
    assert out.count("after refilling: grads in shared memory: False") == 2, out[-3000:]


#: iterations in the suite (the full 5,000 / 3,000: the script, docs/performance.md)
CHURN, SPLITS = 600, 300


def ran_flat(which, mode, n, timeout):
    """Run the script's ``mode`` for ``n`` iterations at 2 ranks; check every rank's resources
    stayed flat from the warm-up to the end."""
    proc = in_private_shm(which, 2, [mode, n], timeout=timeout)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    # each rank prints one JSON object; the launcher may join two ranks' lines into one
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(out, m.start())[0] for m in re.finditer(r'\{"rank"', out)]
    assert len(rows) == 2, out[-3000:]
    for row in rows:
        assert row["mode"] == mode and row["n"] == n
        warm, end = row["warm"], row["end"]
        assert end["fds"] <= warm["fds"] + 2, row
        assert end["maps"] <= warm["maps"] + 4, row
        assert end["rss_kib"] <= warm["rss_kib"] + 2048, row
        for key in ("windows", "regions", "comms"):
            assert end[key] <= warm[key], row
    return rows


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which", MPIS)
def test_buffers_built_and_closed_keep_resources_flat(which):
    ran_flat(which, "churn", CHURN, timeout=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which", MPIS)
def test_split_buffer_step_free_keeps_resources_flat(which):
    ran_flat(which, "split", SPLITS, timeout=400)


KILLED = """
import os, sys, time
import numpy as np
from mpi4py import MPI
from mpifusion import FusedCommBuffer, HookAction, Param
from mpifusion.config import CommOptions
comm = MPI.COMM_WORLD
bufs = []
for i in range(3):
    p = [Param(f"w{i}", np.ones(1 << 20, np.float32))]
    buf = FusedCommBuffer(i, p, comm, act=HookAction.ALL_REDUCE,
                          comm_options=CommOptions(strategy="shm"))
    assert buf.comm.in_shared_window(buf.grad_storage)
    buf.add_grad(p[0], grad=np.ones(1 << 20, np.float32))
    buf.scale_grads()
    bufs.append((buf, p))
comm.Barrier()
if comm.Get_rank() == 1:
    os.kill(os.getpid(), 9)
time.sleep(60)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", MPIS)
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_nothing_of_ours_is_left_in_dev_shm(which, how, tmp_path):
    """After a clean job (exit 0, nothing collective at exit) and after one whose rank was
    killed with SIGKILL mid-run, /dev/shm (a private one: only this job's) holds no file of
    ours: the arena's files are unlinked once every rank mapped them."""
    if how == "kill":
        script = tmp_path / "killed.py"
        script.write_text(KILLED)
        args = [str(script)]
    else:
        args = ["churn", 50]
    _private_shm_works()
    mpiexec, python = _mpi(which)
    job = " ".join([mpiexec, "-n", "2", python, *(args if how == "kill" else [SCRIPT, *map(
        str, args)])])
    shell = (f"mount -t tmpfs -o size=300m tmpfs /dev/shm && {job}; rc=$?; sleep 1; "
             f"echo \"left: $(ls /dev/shm | tr '\\n' ' ')\"; echo \"job exit $rc\"")
    proc = run_cmd(["unshare", "--mount", "--propagation", "private", "sh", "-c", shell],
                   timeout=240, stderr_to_stdout=True)
    out = proc.stdout
    rc = int(re.search(r"job exit (\d+)", out).group(1))
    assert (rc == 0) == (how == "exit"), out[-3000:]
    left = re.search(r"^left: (.*)$", out, re.M).group(1).split()
    assert [name for name in left if name.startswith(OURS)] == [], out[-3000:]


# ------------------------------------------------------------------ under mpiexec


def _buffer(comm, ident, numel):
    params = [Param(f"m{ident}", np.zeros(numel, np.float32))]
    return FusedCommBuffer(ident, params, comm, act=HookAction.ALL_REDUCE,
                           comm_options=CommOptions(strategy="shm")), params


def _step(buf, params, comm, salt):
    rank, n = comm.Get_rank(), comm.Get_size()
    g = np.arange(params[0].data.size, dtype=np.float32) % 8 + rank + salt
    buf.add_grad(params[0], grad=g)
    buf.scale_grads()
    want = sum(np.arange(g.size, dtype=np.float64) % 8 + r + salt for r in range(n))
    got = params[0].grad.astype(np.float64)
    assert np.array_equal(got, want) or np.array_equal(got, want / n), (rank, got[:4])
    buf.grad_storage[...] = 0  # grads accumulate across steps: the next starts from zero


@pytest.mark.mpi(min_size=2)
def test_offsets_that_differ_between_ranks_reduce_right(comm):
    """Rank 0 keeps a grad of a dropped buffer (its region stays taken), the others do
    not: the next buffers lie at other offsets on rank 0 than elsewhere, and reduce right."""
    sub = comm.Dup()
    try:
        rank = comm.Get_rank()
        a, pa = _buffer(sub, 0, 3000)
        _step(a, pa, sub, 0)
        kept = pa[0].grad if rank == 0 else None
        mine = sub.allgather(a.comm._memory.locate(a.grad_storage))
        assert all(m[0] >= 0 for m in mine), mine
        a.close()
        del a, pa
        gc.collect()
        b, pb = _buffer(sub, 1, 3000)
        where = sub.allgather(b.comm._memory.locate(b.grad_storage))
        assert where[0] != where[1], where  # rank 0's old extent is still taken
        assert where[1] == mine[1], where  # the others reuse theirs
        for step in range(3):
            _step(b, pb, sub, step)
        if rank == 0:
            assert kept.size == 3000  # still readable
        windows = shm.live_windows()
        more = [_buffer(sub, 2 + i, 100) for i in range(5)]
        for i, (buf, params) in enumerate(more):
            _step(buf, params, sub, i)
        assert shm.live_windows() == windows  # buffers make no MPI window
    finally:
        sub.Free()


@pytest.mark.mpi(min_size=2)
def test_a_library_limit_is_named_and_auto_falls_back(comm, monkeypatch):
    """Where MPI has no communicator left for the shared memory's duplicate (MPICH's
    'Too many communicators'), ``shm`` raises CommLimitError naming the limit and ``auto``
    runs ``thread``, saying why in ``shm_fallback``."""
    from mpifusion.comm import Communicator, communicator
    from mpifusion.errors import CommLimitError

    real = communicator.private_comm

    def exhausted(user, tag="", timeout=None):
        if tag == "shm/memory":
            raise MPI.Exception(MPI.ERR_OTHER)
        return real(user, tag, timeout)

    monkeypatch.setattr(communicator, "private_comm", exhausted)
    with pytest.raises(CommLimitError, match="limit was reached"):
        Communicator(comm, CommOptions(strategy="shm", timeout=30))
    c = Communicator(comm, CommOptions(strategy="auto", timeout=30))
    assert c.strategy == "thread" and "limit was reached" in c.shm_fallback
    x = np.full(3, comm.Get_rank() + 1.0, np.float32)
    c.allreduce(x).wait(timeout=60)
    n = comm.Get_size()
    assert (x == n * (n + 1) / 2).all()
