"""Leaving is never blocked: whatever rank 1 does to leave a job, at whatever moment of a step,
the job ends within seconds, under every strategy.

Rank 1 leaves by ``sys.exit(3)``, an uncaught exception, a KeyboardInterrupt (SIGINT to
itself), SIGTERM (as a launcher sends) or ``os._exit(3)``; ``before`` any collective (the
peers then wait in the step's collective), ``during`` (its last add_grad started its own
collective, then it leaves without waiting for it; the peers wait for theirs) or ``after`` a
full step on every rank (it leaves while the peers run a second step). The other ranks run
the step and wait.

Under ``python -m mpi4py`` every case ends the whole job within start-up plus a few seconds
with the leaving rank's code (mpi4py aborts on SystemExit/exceptions, 128+2 for SIGINT; the
launcher reports a rank killed by SIGTERM as 15 (MPICH's hydra) or 143 (Open MPI's prterun),
and hydra may report 9 where it SIGKILLed the other ranks first: tests/docs/
test_launcher_exit.py). The deadline (MPIFUSION_TIMEOUT, when given) is far longer than that:
it must not be what ends the job.

Under plain ``mpiexec ... python`` a rank that dies (``os._exit``, SIGTERM) ends the job, but
``sys.exit``, an exception and KeyboardInterrupt run mpi4py's MPI_Finalize at exit, which
waits for the peers: docs/troubleshooting.md. There every strategy must do what ``thread``
does (PLAIN_THREAD, measured): the same exit code where thread ends the job.

Cost: each job is 1-3 s here. The whole way x moment x strategy product runs at 2 ranks under
``-m mpi4py`` with MPICH; 3 ranks, plain ``mpiexec``, a deadline and Open MPI each run a
covering subset (tests/faults/strategies.py ``covering``: every way, moment and strategy at
least once).
"""
from __future__ import annotations

import itertools
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.faults.strategies import NAMES, covering, openmpi_python, strategy_env
from tests.faults.test_faults import kill_leftovers
from tests.helpers import HYDRA_LOST_EXIT, hydra_lost_an_exit, mpiexec_path, run_cmd

WAYS = ("exit", "raise", "sigint", "sigterm", "_exit")
MOMENTS = ("before", "during", "after")
#: MPIFUSION_TIMEOUT where a case has a deadline: far beyond ENDS_WITHIN, so never what ends it
DEADLINE = 60.0
#: start-up of 2-3 oversubscribed ranks on 2 busy cores plus a few seconds (jobs took 0.4-2.3 s
#: in a quiet run); a job still running at HARD_LIMIT is killed and fails as a hang
ENDS_WITHIN = 20.0
HARD_LIMIT = 30.0
#: how often a job lost to hydra's race (tests/helpers.py HYDRA_LOST_EXIT) is run again
HYDRA_RETRIES = 2

#: the exit code under ``-m mpi4py``, per way (3: hydra may report 9 for the ranks it killed)
M_CODES = {"exit": (3, 9), "raise": (1,), "sigint": (130,), "_exit": (3, 9)}
#: a rank killed by SIGTERM, as each launcher reports it (measured: hydra 15, prterun 143)
SIGTERM_CODES = {"mpich": (15, 9), "openmpi": (143,)}

#: What ``thread`` does under plain ``mpiexec ... python`` (measured 2026-12-06 at 2 ranks,
#: with and without a deadline, MPICH 5.0.2; Open MPI 5.0.11 the same but for SIGTERM's
#: code; a hang: still running after 12 s): (way, moment) -> the exit codes it ends with.
#: The cells left out -- ``sys.exit``, an exception or KeyboardInterrupt ``before`` or
#: ``after`` -- are where thread itself leaves the job waiting (the leaving rank in
#: MPI_Finalize, the peers in the collective; a deadline does not end it either): they are
#: not run, as the docs say.
#: ``during``, the leaving rank's own collective was started, and its exit path ends the job.
#: KeyboardInterrupt during: 1 where the rank exits past a collective still on its thread
#: (mpifusion's exit without MPI_Finalize); where every rank's part of the step had finished
#: first, the rank finalizes and Python ends itself with SIGINT, as it does for an uncaught
#: KeyboardInterrupt: hydra reports 2, prterun 130 (seen once in 3 ranks, hierarchical)
PLAIN_THREAD = {
    **{(way, "during"): codes for way, codes in
       (("exit", (3, 9)), ("raise", (1,)), ("sigint", (1, 2, 130)))},
    **{(way, moment): None for way in ("sigterm", "_exit") for moment in MOMENTS},
}
PLAIN_THREAD_DIES = {"_exit": (3, 9)}  # None above: os._exit's code, or SIGTERM's

DRIVER = textwrap.dedent('''
    """Rank 1 leaves the job; argv: way, moment. The other ranks run the step and wait."""
    import os, signal, sys, time
    import numpy as np
    from mpi4py import MPI
    from mpifusion import FusedCommBuffer, Param

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    way, moment = sys.argv[1], sys.argv[2]
    bad = 1  # the rank that leaves
    params = [Param(n, np.zeros((3, 5), np.float32)) for n in ("w0", "w1")]
    comm.Barrier()  # start-up skew of oversubscribed ranks
    buf = FusedCommBuffer(0, params, comm, act="all_reduce")
    print(f"rank {rank}: pid {os.getpid()}", flush=True)

    def leave():
        print(f"rank {rank}: leaving by {way} {moment}", flush=True)
        if way == "exit":
            sys.exit(3)
        if way == "raise":
            raise RuntimeError(f"rank {rank} fails")
        if way == "_exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGINT if way == "sigint" else signal.SIGTERM)
        time.sleep(600)  # a KeyboardInterrupt is raised here; SIGTERM's default ends us
        print(f"rank {rank}: still here after {way}", flush=True)


    def step(start_only=False):
        for p in params:
            buf.add_grad(p, grad=np.full((3, 5), rank + 1.0, np.float32))
        if not start_only:
            buf.scale_grads()


    if rank == bad and moment == "before":
        leave()
    if moment == "after":
        step()
        print(f"rank {rank}: first step done", flush=True)
    if rank == bad:
        if moment == "during":
            step(start_only=True)  # its collective is started by the last add_grad
        leave()
    step()
    print(f"rank {rank}: step done", flush=True)
''')


def _cells(plain: bool) -> list:
    """(way, moment, strategy) cells a launch runs: under plain ``mpiexec`` only those where
    thread ends the job (PLAIN_THREAD)."""
    return [(w, m, s) for w, m, s in itertools.product(WAYS, MOMENTS, NAMES)
            if not plain or (w, m) in PLAIN_THREAD]


#: thinned families: (mpi, launch, nranks, deadline) -> the covering subset's salt (a
#: different salt per family, so the families pair ways, moments and strategies differently)
THINNED = {
    ("mpich", "m", 3, False): 1,
    ("mpich", "m", 2, True): 2,
    ("mpich", "m", 3, True): 3,
    ("mpich", "plain", 2, False): 4,
    ("mpich", "plain", 2, True): 5,
    ("mpich", "plain", 3, False): 6,
    ("openmpi", "m", 2, False): 7,
    ("openmpi", "m", 3, True): 8,
    ("openmpi", "plain", 2, False): 9,
}


def _cases() -> list:
    cases = [pytest.param("mpich", "m", 2, False, w, m, s,
                          id=f"mpich-m-2-nodeadline-{w}-{m}-{s}")
             for w, m, s in _cells(plain=False)]
    for (mpi, launch, nranks, deadline), salt in THINNED.items():
        for w, m, s in covering(_cells(launch == "plain"), salt * 7):
            dl = "deadline" if deadline else "nodeadline"
            cases.append(pytest.param(mpi, launch, nranks, deadline, w, m, s,
                                      id=f"{mpi}-{launch}-{nranks}-{dl}-{w}-{m}-{s}"))
    return cases


def _pid_of(out: str, rank: int) -> int:
    """The pid the driver printed for ``rank`` (-1 where it printed none)."""
    for line in out.splitlines():
        if line.startswith(f"rank {rank}: pid "):
            return int(line.split()[-1])
    return -1


def _expected_codes(mpi: str, launch: str, way: str, moment: str) -> tuple:
    if way == "sigterm":
        return SIGTERM_CODES[mpi]
    if launch == "m":
        return M_CODES[way]
    codes = PLAIN_THREAD[(way, moment)] or PLAIN_THREAD_DIES[way]
    # hydra may report 9 (the SIGKILL it sent the waiting ranks): seen at 3 ranks, as
    # tests/docs/test_launcher_exit.py accepts for os._exit
    return codes + (9,) if mpi == "mpich" else codes


@pytest.mark.parametrize("mpi, launch, nranks, deadline, way, moment, strategy", _cases())
def test_leaving_ends_the_job(tmp_path: Path, mpi, launch, nranks, deadline, way, moment,
                              strategy):
    if mpi == "openmpi":
        python = openmpi_python()
        launcher = str(Path(python).parent / "mpiexec")
    else:
        python, launcher = sys.executable, mpiexec_path()
    driver = tmp_path / f"leaving_driver_{way}_{moment}.py"
    driver.write_text(DRIVER)
    env = strategy_env(strategy)
    if deadline:
        env["MPIFUSION_TIMEOUT"] = str(DEADLINE)
    else:
        env["MPIFUSION_TIMEOUT"] = "inf"  # no deadline, whatever the caller has set
    cmd = [launcher, "-n", str(nranks), python, *(["-m", "mpi4py"] if launch == "m" else []),
           str(driver), way, moment]
    where = (f"rank 1 leaving by {way} {moment} the step, {strategy}, {nranks} ranks, "
             f"{mpi} {'-m mpi4py' if launch == 'm' else 'plain mpiexec'}, "
             f"{'deadline' if deadline else 'no deadline'}")
    lost = []  # outputs of runs lost to hydra's race, which is the launcher's, not ours
    while True:
        start = time.monotonic()
        proc = run_cmd(cmd, timeout=HARD_LIMIT, env=env, stderr_to_stdout=True, hang_ok=True)
        elapsed = time.monotonic() - start
        leftover = kill_leftovers(str(driver))
        out = proc.stdout or ""
        if (proc.returncode is None and mpi == "mpich" and way == "_exit"
                and len(lost) < HYDRA_RETRIES and "rank 1: leaving by _exit" in out
                and hydra_lost_an_exit(out, _pid_of(out, 1))):
            lost.append(out)
            continue
        break
    assert proc.returncode is not None, (
        f"{where}: the job hung ({HARD_LIMIT:g} s)"
        f"{f' (and {len(lost)} run(s) before, each {HYDRA_LOST_EXIT})' if lost else ''}:"
        f"\n{out[-3000:]}")
    assert not leftover, f"{where}: left processes running: {leftover}"
    codes = _expected_codes(mpi, launch, way, moment)
    assert proc.returncode in codes, \
        f"{where}: exit {proc.returncode}, expected {codes}:\n{out[-3000:]}"
    assert "did not complete within" not in out, f"{where}: the deadline ended it:\n{out[-3000:]}"
    assert "still here" not in out
    assert elapsed < ENDS_WITHIN, f"{where}: took {elapsed:.1f} s:\n{out[-3000:]}"


SNAPSHOT = """rank 1: pid 8569
rank 1: leaving by _exit after
=== the job's processes when it was killed (pid tid ppid stat wchan command):
8566  8566  6674  Ss  poll_schedule_timeout.constp  /v/bin/mpiexec -n 2 /v/bin/python -m mpi4py d.py
8567  8567  8566  Ss  poll_schedule_timeout.constp  /v/bin/hydra_pmi_proxy --control-port 10.0.0.1:1
8568  8568  8567  Rsl  -  /v/bin/python -m mpi4py d.py _exit after
8568  8590  8567  Ssl  do_epoll_wait  /v/bin/python -m mpi4py d.py _exit after"""


def test_hydras_lost_exit_is_told_apart_from_other_hangs():
    """Only a hang with the leaving rank reaped and the proxy alive is hydra's race: a hang
    where the leaving rank is still there, or nothing was recorded, stays a failure."""
    assert _pid_of(SNAPSHOT, 1) == 8569
    assert hydra_lost_an_exit(SNAPSHOT, 8569)
    assert not hydra_lost_an_exit(SNAPSHOT, 8568)  # the rank is still alive: not the race
    assert not hydra_lost_an_exit(SNAPSHOT, _pid_of("no pid printed", 1))
    assert not hydra_lost_an_exit(SNAPSHOT.split("===")[0], 8569)  # no snapshot taken
    no_proxy = "\n".join(line for line in SNAPSHOT.splitlines() if "proxy" not in line)
    assert not hydra_lost_an_exit(no_proxy, 8569)
