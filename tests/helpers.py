"""The one place tests start processes: mpiexec jobs and in-process CLI runs.

Every job runs in its own session and is killed whole (launcher and ranks) when it passes its
time limit, so a hanging job fails its test instead of the suite.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Open MPI refuses root and oversubscription unless told (Open MPI 5's launcher, PRRTE,
#: reads the last one; the one before is Open MPI 4's); MPICH ignores these.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def mpiexec_path() -> str:
    """$MPIEXEC, else the mpiexec next to this Python (a venv's MPI wheel), else PATH's."""
    exe = os.environ.get("MPIEXEC") or shutil.which(
        "mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    return exe


def run_job(n: int, argv: Sequence[str], *, timeout: float = 240, env: Optional[dict] = None,
            cwd: Optional[str] = None, stderr_to_stdout: bool = False,
            hang_ok: bool = False) -> subprocess.CompletedProcess:
    """``mpiexec -n N ARGV`` (ARGV after the launcher, e.g. ``[sys.executable, script]``),
    bounded by ``timeout``: past it the whole job is killed and the test fails (or, with
    ``hang_ok``, the result has returncode None)."""
    return run_cmd([mpiexec_path(), "-n", str(n), *map(str, argv)], timeout=timeout, env=env,
                   cwd=cwd, stderr_to_stdout=stderr_to_stdout, hang_ok=hang_ok)


def run_cmd(cmd: Sequence[str], *, timeout: float = 240, env: Optional[dict] = None,
            cwd: Optional[str] = None, stderr_to_stdout: bool = False,
            hang_ok: bool = False) -> subprocess.CompletedProcess:
    """Any command (no launcher added), in its own session, with the same environment,
    time limit and kill as :func:`run_job`."""
    return run_cmds([cmd], timeout=timeout, env=env, cwd=cwd,
                    stderr_to_stdout=stderr_to_stdout, hang_ok=hang_ok)[0]


def run_cmds(cmds: Sequence[Sequence[str]], *, timeout: float = 240,
             env: Optional[dict] = None, cwd: Optional[str] = None,
             stderr_to_stdout: bool = False, hang_ok: bool = False,
             started: Optional[Callable[[], object]] = None
             ) -> List[subprocess.CompletedProcess]:
    """Several commands at once (each as :func:`run_cmd` starts it), for tests of
    concurrent processes; ``started`` runs once all are started (e.g. to release them
    together). ``timeout`` bounds the whole group: past it every command still running is
    killed with its session."""
    cmds = [[str(c) for c in cmd] for cmd in cmds]
    full_env = dict(os.environ, **MPI_ENV)
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env.update(env or {})
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT if stderr_to_stdout else subprocess.PIPE,
                              text=True, env=full_env, cwd=cwd, start_new_session=True)
             for cmd in cmds]
    if started is not None:
        started()
    deadline = time.monotonic() + timeout
    results = []
    for cmd, proc in zip(cmds, procs):
        try:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            snapshot = session_snapshot(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            out = f"{out or ''}\n{snapshot}"
            if not hang_ok:
                for other in procs:  # leave nothing running behind a failed test
                    if other.poll() is None:
                        os.killpg(other.pid, signal.SIGKILL)
                        other.communicate()
                pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{(out or '')[-3000:]}"
                            f"\n{(err or '')[-3000:]}")
            results.append(subprocess.CompletedProcess(cmd, None, out, err))  # type: ignore[arg-type]
            continue
        results.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return results


def session_snapshot(root: int) -> str:
    """What each process and thread under a hung job's launcher ``root`` was doing when it
    was killed (state, the kernel function it sleeps in, its command; the launchers start
    their ranks in sessions of their own), so a hang seen once in a long run says where."""
    proc = subprocess.run(["ps", "-ww", "-e", "-L", "-o",  # -ww: whole command lines
                           "pid=,tid=,ppid=,stat=,wchan:28=,args="],
                          capture_output=True, text=True)
    rows = [line.split(None, 5) for line in proc.stdout.splitlines()]
    tree, grew = {root}, True
    while grew:
        grew = False
        for row in rows:
            if len(row) >= 3 and int(row[2]) in tree and int(row[0]) not in tree:
                tree.add(int(row[0]))
                grew = True
    lines = ["  ".join(row) for row in rows if len(row) >= 3 and int(row[0]) in tree]
    return ("=== the job's processes when it was killed (pid tid ppid stat wchan command):\n"
            + "\n".join(lines))


#: MPICH's hydra proxy (5.0.2 and its main branch, src/pm/hydra/proxy/pmip.c and pmip_cb.c)
#: kills the other ranks when a rank's PMI socket closes before it finalized, unless that
#: rank's exit status is already set, which it takes to mean the kill went out already. Its
#: event loop also reaps exited ranks with waitpid after every event: when a rank's last
#: output wakes the proxy and the rank has exited by the time of that waitpid (a loaded
#: machine), its status is set first, the socket's close then kills nobody, and the job
#: waits for ever (met twice in CI, both on a loaded machine).
HYDRA_LOST_EXIT = "hydra reaped the exited rank before it saw its PMI socket close"


def hydra_lost_an_exit(out: str, pid: int) -> bool:
    """Whether a job that hung after rank ``pid`` left by ``os._exit`` hung in hydra's race
    (HYDRA_LOST_EXIT): the launcher and proxy still there, ``pid`` reaped, other ranks alive."""
    head, sep, snapshot = out.partition("=== the job's processes when it was killed")
    if not sep or pid <= 0:
        return False
    rows = [line.split(None, 5) for line in snapshot.splitlines()[1:]]
    pids = {int(r[0]) for r in rows if len(r) >= 6 and r[0].isdigit()}
    commands = " ".join(r[5] for r in rows if len(r) >= 6)
    return (pid not in pids and "hydra_pmi_proxy" in commands
            and any(int(r[0]) != pid and "python" in r[5] for r in rows
                    if len(r) >= 6 and r[0].isdigit()))


def mpiexec(n: int, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``mpiexec -n N python -m mpifusion ARGV`` in a fresh job."""
    return run_job(n, [sys.executable, "-m", "mpifusion", *argv], timeout=timeout)


def run_cli(capsys, *argv: str) -> tuple:
    """(exit code, stdout, stderr) of ``mpifusion ARGV`` run in this process."""
    from mpifusion.tools.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, command: str) -> str:
    """The one line ``mpifusion COMMAND`` printed on stderr for bad input (no traceback)."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"mpifusion {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def free_ports(count: int) -> int:
    """A base port with ``count`` free ports after it (Paddle's gloo endpoints)."""
    for _ in range(50):
        base = random.randint(20000, 60000)
        try:
            socks = []
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    pytest.skip("no free local ports for gloo")


@pytest.fixture(scope="session", autouse=True)
def isolated_tune_file(tmp_path_factory):
    """A developer's own tune file (``$MPIFUSION_TUNE_FILE``, ``$XDG_CACHE_HOME`` or
    ``~/.cache/mpifusion/tune.json``) or ``$MPIFUSION_SEGMENT_BYTES`` would change the default
    segment size of every test and of every job a test starts: for the whole session both
    point into a fresh folder (no tune file there) and the variable is unset. os.environ is
    changed, not a copy, so :func:`run_cmd`'s jobs inherit it. Registered in conftest.py."""
    folder = tmp_path_factory.mktemp("tune")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPIFUSION_TUNE_FILE", str(folder / "tune.json"))
        mp.setenv("XDG_CACHE_HOME", str(folder / "cache"))
        mp.delenv("MPIFUSION_SEGMENT_BYTES", raising=False)
        yield folder / "tune.json"


@pytest.fixture(autouse=True)
def private_tune_file(tmp_path, monkeypatch):
    """A fresh tune file for one test, for the modules whose tests write one
    (tests/tools/test_tune_file.py, test_cli_tune.py import it as autouse), so that no test
    sees another's entries."""
    path = tmp_path / "tune.json"
    monkeypatch.setenv("MPIFUSION_TUNE_FILE", str(path))
    monkeypatch.delenv("MPIFUSION_SEGMENT_BYTES", raising=False)
    return path
