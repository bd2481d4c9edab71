"""Fault tests: each runs a whole job under ``mpiexec -n N python -m mpi4py`` in a subprocess.

Every case must end within its deadline with a non-zero exit, the stated error text, and no
process left behind -- never a hang. A hard ``subprocess`` timeout turns a hang into a
failure (and the test then kills the job's process group).

Every test runs under every strategy of tests/faults/strategies.py (set through the job's
environment): a promise that ``thread`` keeps, ``shm`` (what ``auto`` picks on one node),
``nonblocking`` and ``hierarchical`` keep too.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, Optional

import pytest

from tests.faults.strategies import (NAMES, openmpi_python, strategy_env, strategy_param,
                                     with_openmpi)
from tests.helpers import mpiexec_path, run_cmd

DEADLINE = 4.0          # MPIFUSION_TIMEOUT given to the jobs, seconds
HARD_LIMIT = 90         # per job, start-up of 8 oversubscribed ranks included
#: 2 and 3 ranks (an odd count: shards and trees that do not divide); 8 only where the size of
#: the job is the point (a dead rank among many still ends it within the deadline)
RANKS = (2, 3)

DRIVER = textwrap.dedent('''
    \"\"\"One faulty training step; argv: scenario, token (marks this job's processes).\"\"\"
    import os, re, signal, sys, time
    import numpy as np
    from mpi4py import MPI
    from mpifusion import FusedCommBuffer, Param

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    scenario = sys.argv[1]
    bad = 1  # the rank at fault


    def keep(text):
        """Keep a line in this rank's file: an abort drops output that the launcher has not
        forwarded yet (seen: a rank's line, or a whole job's output, missing under load)."""
        folder = os.environ.get("FAULT_SAY_DIR")
        if folder:
            with open(os.path.join(folder, f"rank{rank}.txt"), "a") as f:
                f.write(f"rank {rank}: {text}" + chr(10))


    def say(text):
        print(f"rank {rank}: {text}", flush=True)
        keep(text)


    def kept_excepthook(kind, value, tb, shown=sys.excepthook):
        keep(f"uncaught {kind.__name__}: {value}")
        shown(kind, value, tb)


    sys.excepthook = kept_excepthook


    def caught(exc, expected):
        \"\"\"Every rank says what it raised, then (all said) the job ends: 4 when this rank's
        error was an expected one, 5 otherwise (a timeout, a wrong result).\"\"\"
        text = str(exc).replace(chr(10), " ")
        say(f"caught {type(exc).__name__}: {text}")
        comm.Barrier()  # a plain MPI barrier: the buffer's own communicator is a duplicate
        time.sleep(0.3)  # let the launcher forward every rank's line before the abort
        code = 4 if isinstance(exc, expected) else 5
        comm.Abort(code)
        os._exit(code)  # (MPI_Abort was seen to return on a rank while the launcher ended it)


    if scenario == "dropstep":
        # Step 1 of rank 1 holds a NaN: it drops the step (reset(zero_grads=True)) while the
        # peers wait for theirs. Every rank loops until N steps, checking each result it gets
        # against the exact mean of that step's inputs; an OrderError resets the step.
        from mpifusion import NanInfError, OrderError
        N = 4
        params = [Param(n, np.zeros((3, 5), np.float32)) for n in ("w0", "w1")]
        comm.Barrier()
        buf = FusedCommBuffer(0, params, comm, act="all_reduce")
        has_step = isinstance(getattr(type(buf), "step", None), property)
        counted = 0  # until buf.step exists: steps counted here (what a user would do)
        serial = lambda: buf.step if has_step else counted
        value = lambda r, s, j: 100.0 * s + 10.0 * r + j + 1  # exact in fp32
        order_errors = []
        try:
            while serial() < N:
                s = serial()
                for p in params:  # optimizer.clear_grad(): add_grad accumulates into them
                    if p.grad is not None:
                        p.grad[...] = 0
                try:
                    for j, p in enumerate(params):
                        g = np.full((3, 5), value(rank, s, j), np.float32)
                        if rank == bad and s == 1 and j == len(params) - 1:
                            g[1, 2] = np.nan
                        buf.add_grad(p, grad=g)
                    buf.scale_grads()
                except NanInfError as exc:
                    say(f"step {s}: dropped: {type(exc).__name__}")
                    buf.reset(zero_grads=True)
                    counted += 1
                    continue
                except OrderError as exc:
                    order_errors.append(str(exc).replace(chr(10), " "))
                    say(f"step {s}: OrderError: {order_errors[-1]}")
                    buf.reset()
                    counted += 1
                    continue
                counted += 1
                for j, p in enumerate(params):
                    mean = sum(value(r, s, j) for r in range(size)) / size
                    if not np.allclose(p.grad, mean, rtol=1e-6, atol=0):
                        say(f"step {s}: wrong result {p.grad.ravel()[:3]} for {p.name} "
                            f"(expected {mean})")
                        sys.exit(6)
                say(f"step {s}: good")
        except Exception as exc:
            caught(exc, ())
        say(f"done after {serial()} steps, {len(order_errors)} OrderError")
        sys.exit(0)

    names = ["w0", "w1"]
    if scenario == "mismatch" and rank == bad:
        names = ["w0", "w1", "extra"]
    shape = (3, 5)
    if scenario == "inline":  # either side of the strategy's inline limit (shm: 1 MiB)
        big = 300_000 if os.environ["MPIFUSION_COMM_STRATEGY"] in ("shm", "hierarchical") \\
            else 30_000
        names, shape = ["w0"], ((big,) if rank == bad else (1000,))
    params = [Param(n, np.zeros(shape, np.float32)) for n in names]
    comm.Barrier()  # start-up skew of oversubscribed ranks must not eat the deadline
    if scenario == "nobuffer" and rank == bad:  # never builds its buffer
        time.sleep(20 * float(os.environ["MPIFUSION_TIMEOUT"]))
    if scenario in ("nodesize", "inline"):  # every rank says what it raised
        from mpifusion import AgreementError, OrderError
        expected = AgreementError if scenario == "nodesize" else OrderError
        try:
            buf = FusedCommBuffer(0, params, comm, act="all_reduce")
            for p in params:
                buf.add_grad(p, grad=np.full(shape, rank + 1.0, np.float32))
            buf.scale_grads()
        except Exception as exc:
            caught(exc, expected)
        say("ok")
        sys.exit(0)
    buf = FusedCommBuffer(0, params, comm, act="all_reduce")
    for p in params:
        g = np.full((3, 5), rank + 1.0, np.float32)
        if rank == bad:
            if scenario == "withhold" and p.name == "w1":
                continue
            if scenario == "exit" and p.name == "w1":
                os._exit(3)
            if scenario == "stall" and p.name == "w1":
                os.kill(os.getpid(), signal.SIGSTOP)  # alive to the launcher, gone to MPI
            if scenario == "nan" and p.name == "w1":
                g[0, 1] = np.nan
                g[2, 4] = np.inf
            if scenario == "shape" and p.name == "w1":
                g = np.zeros((5, 3), np.float32)
        buf.add_grad(p, grad=g)
    if scenario == "withhold" and rank == bad:
        time.sleep(20 * float(os.environ["MPIFUSION_TIMEOUT"]))  # the others give up first
    buf.scale_grads()
    expect = sum(range(1, size + 1)) / size
    if not np.array_equal(params[0].grad, np.full((3, 5), expect, np.float32)):
        sys.exit(f"rank {rank}: wrong result {params[0].grad[0, 0]} (expected {expect})")
    print(f"rank {rank}: ok", flush=True)
''')

# scenario -> substrings that the job's output must hold (rank 1 is the rank at fault)
EXPECTED = {
    "mismatch": ["AgreementError", "ranks disagree", "param #2", "'extra'", "on rank 1",
                 "number of params"],
    "withhold": ["CommTimeoutError", f"did not complete within {DEADLINE:g} s",
                 "2/2 params checked in", "rank 1 of the buffer's communicator has not started"],
    "exit": [],  # the launcher's own report, or a survivor's timeout: checked in the test
    "stall": ["CommTimeoutError", f"did not complete within {DEADLINE:g} s",
              "rank 1 of the buffer's communicator has not started"],
    "nobuffer": ["CommTimeoutError", "duplicating comm_group for mpifusion",
                 f"did not complete within {DEADLINE:g} s"],
    "nan": ["NanInfError", "rank 1: buffer 0: step 0", "w1 (2 of 15)", "2 NaN/Inf"],
    "shape": ["GradError", "rank 1: buffer 0: param 'w1': grad shape expected (3, 5), "
                           "got (5, 3)"],
}


def _processes_with(token: str) -> list:
    """PIDs whose command line mentions ``token`` (this job's driver path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def kill_leftovers(token: str) -> list:
    """The processes of a job (``token``: its driver's path) still alive once the launcher had
    a moment to reap them; each is killed, so it does not leak into later tests, and the
    caller still fails its test."""
    leftover = _processes_with(token)
    for _ in range(50):
        if not leftover:
            break
        time.sleep(0.1)
        leftover = _processes_with(token)
    for pid in leftover:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return leftover


def _run_job(tmp_path: Path, scenario: str, nranks: int, strategy: str = "thread",
             rank1_env: Optional[Dict[str, str]] = None, mpi: str = "mpich", **env_extra: str):
    """Run DRIVER's ``scenario`` under ``strategy`` and ``mpi`` (``openmpi``: the venv of
    $MPIFUSION_OPENMPI_VENV); ``rank1_env``: settings of rank 1 only (an MPMD launch:
    ``mpiexec -n 1 CMD : -n 1 env X=.. CMD : -n N-2 CMD``)."""
    driver = tmp_path / f"fault_driver_{scenario}_{nranks}_{strategy}.py"
    driver.write_text(DRIVER)
    if mpi == "openmpi":
        python = openmpi_python()
        launcher = str(Path(python).parent / "mpiexec")
    else:
        python, launcher = sys.executable, mpiexec_path()
    cmd = [python, "-m", "mpi4py", str(driver), scenario]
    if rank1_env:
        per_rank = ["env", *(f"{k}={v}" for k, v in rank1_env.items()), *cmd]
        argv = [*cmd, ":", "-n", "1", *per_rank]
        if nranks > 2:
            argv += [":", "-n", str(nranks - 2), *cmd]
        count = 1
    else:
        argv, count = cmd, nranks
    said = tmp_path / f"said_{scenario}_{nranks}_{strategy}"
    said.mkdir()
    start = time.monotonic()
    proc = run_cmd([launcher, "-n", str(count), *argv], timeout=HARD_LIMIT, stderr_to_stdout=True,
                   env={"MPIFUSION_TIMEOUT": str(DEADLINE), **strategy_env(strategy),
                        "FAULT_SAY_DIR": str(said), **env_extra})
    out = proc.stdout
    kept = "".join(f.read_text() for f in sorted(said.iterdir()))
    if kept:  # what the ranks said, whole, after the launcher's output
        out += "\n--- per rank ---\n" + kept
    elapsed = time.monotonic() - start
    leftover = kill_leftovers(str(driver))
    assert not leftover, f"{scenario} at {nranks} ranks left processes running: {leftover}"
    return proc.returncode, out, elapsed


def _per_rank(out: str, nranks: int, what: str) -> Dict[int, str]:
    """rank -> the line in which it said ``what`` (``caught ...``), for every rank saying it."""
    lines = {}
    for line in out.splitlines():
        m = re.search(r"rank (\d+): (.*)", line)
        if m and m.group(2).startswith(what) and int(m.group(1)) < nranks:
            lines.setdefault(int(m.group(1)), m.group(2))
    return lines


SCENARIOS = ("mismatch", "withhold", "stall", "nobuffer", "nan", "shape")
#: (nranks, strategy) of the tests below, under MPICH all, under Open MPI a covering few
JOBS = [(n, s) for n in RANKS for s in NAMES]


@pytest.mark.parametrize("scenario, nranks, strategy, mpi",
                         with_openmpi([(c, n, s) for c in SCENARIOS for n, s in JOBS]))
def test_fault_ends_with_error(tmp_path, scenario, nranks, strategy, mpi):
    env = {"MPIFUSION_CHECK_NANINF": "1"} if scenario == "nan" else {}
    rc, out, elapsed = _run_job(tmp_path, scenario, nranks, strategy, mpi=mpi, **env)
    where = f"{scenario} at {nranks} ranks under {strategy} ({mpi})"
    assert rc != 0, f"{where} exited 0:\n{out[-3000:]}"
    for text in EXPECTED[scenario]:
        assert text in out, f"{where}: {text!r} not in output:\n{out[-3000:]}"
    assert "ok" not in [line.split(": ")[-1] for line in out.splitlines()]
    # start-up plus one deadline (with room for 8 ranks on 2 cores), far below the 80 s the
    # withholding rank sleeps: the job was aborted, not left to run out
    assert elapsed < 10 * DEADLINE, f"{where} took {elapsed:.1f} s"


@strategy_param
@pytest.mark.parametrize("nranks", RANKS + (8,))
def test_dead_rank_ends_job_within_deadline(tmp_path, nranks, strategy):
    rc, out, elapsed = _run_job(tmp_path, "exit", nranks, strategy)
    assert rc != 0, f"a rank died but the job exited 0:\n{out[-3000:]}"
    # Either the launcher noticed the dead rank and killed the job (MPICH's hydra does, and
    # passes the dead rank's exit code 3 on, or reports the ranks it killed), or a survivor's
    # deadline expired and its error aborted the job.
    assert rc == 3 or "BAD TERMINATION" in out or "did not complete within" in out, (rc, out)
    # start-up plus one deadline, with room for 8 ranks on 2 cores; never the hard limit
    assert elapsed < 10 * DEADLINE, f"took {elapsed:.1f} s"


@strategy_param
@pytest.mark.parametrize("nranks", (2, 3))
def test_healthy_job_passes(tmp_path, nranks, strategy):
    """The same driver without a fault: the checks do not get in the way of a good step."""
    rc, out, _ = _run_job(tmp_path, "none", nranks, strategy)
    assert rc == 0, out[-3000:]
    assert out.count(": ok") == nranks


@pytest.mark.parametrize("nranks, strategy, mpi", with_openmpi(JOBS, salt=1))
def test_dropped_step_is_refused_not_mixed(tmp_path, nranks, strategy, mpi):
    """Rank 1 drops step 1 (a NaN, ``reset(zero_grads=True)``) while its peers wait in theirs:
    its next collective (step 2) must not pair with their step 1. Every rank raises an
    ``OrderError`` naming both step serials, resets, and goes on; no rank ever gets a result
    that is not the exact mean of one step's inputs, and the job ends with exit 0."""
    rc, out, elapsed = _run_job(tmp_path, "dropstep", nranks, strategy, mpi=mpi,
                                MPIFUSION_CHECK_NANINF="1")
    where = f"dropstep at {nranks} ranks under {strategy}"
    wrong = [line for line in out.splitlines() if "wrong result" in line]
    assert not wrong, f"{where}: ranks mixed steps silently:\n" + "\n".join(wrong) + \
        f"\n{out[-3000:]}"
    assert "caught" not in out, f"{where}: a rank failed:\n{out[-3000:]}"
    assert rc == 0, f"{where}: exit {rc}:\n{out[-3000:]}"
    for r in range(nranks):
        lines = [m.group(1) for m in re.finditer(rf"rank {r}: step \d+: OrderError: (.*)", out)]
        assert lines, f"{where}: rank {r} raised no OrderError:\n{out[-3000:]}"
        # e.g. "... at different steps (rank 1 at step 2; ranks 0, 2 at step 1) ...", or
        # order.describe_call's "... started buffer 0 (...) step 2 ALL_REDUCE of 30 ..."
        serials = set(re.findall(r"\bstep (\d+)\b", lines[0]))
        assert {"1", "2"} <= serials, f"{where}: rank {r}'s OrderError names steps {serials}:" \
                                      f" {lines[0]}"
        assert f"rank {r}: done after" in out, f"{where}: rank {r} did not finish:\n{out}"
    assert elapsed < 10 * DEADLINE, f"{where} took {elapsed:.1f} s"


@pytest.mark.parametrize("nranks, strategy, mpi", with_openmpi(JOBS, salt=2))
def test_node_size_disagreement_is_an_agreement_error(tmp_path, nranks, strategy, mpi):
    """Rank 1 alone is told another node size (one that does not divide the job): every rank
    raises an ``AgreementError`` naming node_size at construction -- not an OptionError on
    rank 1 while the others time out. Under every strategy: the options are compared
    whether or not the strategy uses them."""
    wrong = "3" if nranks == 2 else "2"
    rc, out, elapsed = _run_job(tmp_path, "nodesize", nranks, strategy, mpi=mpi,
                                rank1_env={"MPIFUSION_NODE_SIZE": wrong})
    where = f"nodesize at {nranks} ranks under {strategy}"
    said = _per_rank(out, nranks, "caught ")
    assert "CommTimeoutError" not in out, f"{where}: a rank timed out:\n{out[-3000:]}"
    assert sorted(said) == list(range(nranks)), \
        f"{where}: ranks {sorted(said)} raised:\n{out[-3000:]}"
    for r, line in sorted(said.items()):
        assert line.startswith("caught AgreementError") and "node_size" in line, \
            f"{where}: rank {r}: {line}\n{out[-3000:]}"
    assert rc == 4, f"{where}: exit {rc}:\n{out[-3000:]}"
    assert elapsed < 10 * DEADLINE, f"{where} took {elapsed:.1f} s"


@pytest.mark.parametrize("nranks, strategy, mpi", with_openmpi(JOBS, salt=3))
def test_sizes_either_side_of_inline_limit_are_an_order_error(tmp_path, nranks, strategy,
                                                               mpi):
    """With the construction check and the order check off, rank 1's buffer is larger than the
    inline limit and rank 0's smaller (shm: 1 MiB, thread: 64 KiB): the ranks would run
    different collectives; every rank raises an ``OrderError`` within the deadline."""
    rc, out, elapsed = _run_job(tmp_path, "inline", nranks, strategy, mpi=mpi,
                                MPIFUSION_CHECK_AGREEMENT="0", MPIFUSION_VERIFY_ORDER="0")
    where = f"inline at {nranks} ranks under {strategy}"
    said = _per_rank(out, nranks, "caught ")
    assert sorted(said) == list(range(nranks)), \
        f"{where}: ranks {sorted(said)} raised:\n{out[-3000:]}"
    for r, line in sorted(said.items()):
        assert line.startswith("caught OrderError"), f"{where}: rank {r}: {line}\n{out[-3000:]}"
    assert rc == 4, f"{where}: exit {rc}:\n{out[-3000:]}"
    assert elapsed < 10 * DEADLINE, f"{where} took {elapsed:.1f} s"
