"""Collectives in one verified order: never a silent mix, never a hang, nothing leaked.

Each test runs ``tests/faults/ordering_driver.py`` as a whole job under ``mpiexec`` (2, 3
and 8 ranks; 4 too for the negotiated order), both strategies:

* ``suite``: buffers finished in a different order on rank 0 (equal and different sizes) give
  an OrderError on every rank with the grads untouched, and work after ``reset()``; the
  negotiated order under adversarial per-rank orders against float64 references; a buffer
  built while another's collective is in flight; user communication between a small
  buffer's start and its wait that only completes if the collective progresses without the
  caller; ``add_grad`` of one param from two threads
  (acc_steps=2); a grad that is the param's own view; 50 split communicators freed without
  a thread or duplicate left.
* ``abandon``: after CommTimeoutError and ``reset(abandon=True)`` no later collective pairs
  with the stale one: AbandonedError on every rank (or, on a late rank that started first,
  a timeout naming the ranks that gave up), never a value.
* ``sync``: ``sync_params(sync=False)`` tasks keep the deadline.
* ``agree``: settings given to one rank only (an MPMD launch) give AgreementError everywhere.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.helpers import run_job

DRIVER = str(Path(__file__).with_name("ordering_driver.py"))
STRATEGIES = ("thread", "nonblocking")
HARD_LIMIT = 150
CHECKS = ("equal sizes", "different sizes", "free-grads mismatch", "negotiated", "build-in-flight",
          "interleaved", "threads", "alias", "lifetime")


def _job(nranks: int, *args: str, env: dict = None, timeout: float = HARD_LIMIT):
    proc = run_job(nranks, [sys.executable, "-m", "mpi4py", DRIVER, *args], timeout=timeout,
                   stderr_to_stdout=True, env=env or {})
    return proc.returncode, proc.stdout


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("nranks", (2, 3, 4, 8))
def test_suite(nranks, strategy):
    rc, out = _job(nranks, "suite", strategy, env={"MPIFUSION_TIMEOUT": ""})
    assert rc == 0, out[-4000:]
    for check in CHECKS:  # lines of 8 ranks may interleave: count the matches
        done = set(re.findall(rf"rank (\d+): {check} ok", out))
        assert done == {str(r) for r in range(nranks)}, (check, out[-4000:])
    assert "OrderError" not in out.replace("an OrderError", "")  # caught, never uncaught


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_suite_one_rank(strategy):
    rc, out = _job(1, "suite1", strategy, env={"MPIFUSION_TIMEOUT": ""})
    assert rc == 0, out[-4000:]
    for check in CHECKS[3:]:
        assert re.search(rf"rank 0: {check} ok", out), (check, out[-4000:])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_suite_with_deadline(strategy):
    """The same with MPIFUSION_TIMEOUT set: start announcements and the tracker in play."""
    rc, out = _job(2, "suite", strategy, env={"MPIFUSION_TIMEOUT": "30"})
    assert rc == 0, out[-4000:]
    for check in CHECKS:
        assert len(set(re.findall(rf"rank (\d+): {check} ok", out))) == 2, (check, out[-4000:])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("nranks", (2, 3, 8))
def test_abandoned_collective_never_pairs(nranks, strategy):
    rc, out = _job(nranks, "abandon", strategy, env={"MPIFUSION_TIMEOUT": "1.5"})
    assert rc is not None
    assert "WRONG" not in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    # the ranks that timed out gave up and their next step was refused by name
    for r in [0] + list(range(2, nranks)):
        assert re.search(rf"rank {r}: abandon: timed out: .*did not complete within 1.5 s", out), out
        assert re.search(rf"rank {r}: abandon: refused: rank {r}: .*abandoned .*reset\(abandon=True\)",
                         out), out[-4000:]
    # the late rank: refused at once (it heard of the abandonment) or, if it started before
    # the news arrived, timed out with the news in the message -- then refused too
    late = re.findall(r"rank 1: abandon: (timed out|refused): (.*)", out)
    assert late, out[-4000:]
    assert late[-1][0] == "refused" and "abandon" in late[-1][1], late
    if late[0][0] == "timed out":
        assert "gave up a collective" in late[0][1], late


@pytest.mark.parametrize("blocking", (False, True), ids=("sync=False", "sync=True"))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("nranks", (2, 3, 8))
def test_sync_params_task_keeps_deadline(nranks, strategy, blocking):
    rc, out = _job(nranks, "sync", strategy, env={"MPIFUSION_TIMEOUT": "1.5",
                                                   "MPIFUSION_TEST_SYNC": str(int(blocking))})
    assert "WRONG" not in out, out[-4000:]
    for r in [0] + list(range(2, nranks)):
        m = re.search(rf"rank {r}: sync: timed out after ([0-9.]+) s: .*sync_params "
                      rf"(\(step 0, action REDUCE_SCATTER\) )?did not complete within 1.5 s",
                      out)
        assert m, out[-4000:]
        assert float(m.group(1)) < 15, out  # the deadline, not the 30 s the other rank sleeps
        # either form names the rank that never started it
        assert re.search(rf"rank {r}: sync: timed out[^\n]*rank 1 of the buffer's "
                         rf"communicator has not started it", out), out[-4000:]


SETTINGS = {  # environment on rank 0 only -> the entry the AgreementError names
    "MPIFUSION_TIMEOUT=5": "timeout set True on rank 0",
    "MPIFUSION_COMM_STRATEGY=nonblocking": "strategy nonblocking on rank 0",
    "MPIFUSION_SEGMENT_BYTES=4096": "segment_bytes 4096 on rank 0",
    "MPIFUSION_ORDER=negotiated": "order negotiated on rank 0",
    "MPIFUSION_VERIFY_ORDER=0": "verify_order False on rank 0",
    "MPIFUSION_CHECK_AGREEMENT=0": "check_agreement False on rank 0",
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("nranks", (2, 3, 8))
def test_mpmd_settings_agree(nranks, setting):
    """``mpiexec -n 1 env X=.. python drv : -n N-1 python drv``: AgreementError on every
    rank at construction, naming the setting -- never an MPI error or a hang."""
    py = [sys.executable, "-m", "mpi4py", DRIVER, "agree"]
    argv = ["env", setting, *py, ":", "-n", str(nranks - 1), *py]
    proc = run_job(1, argv, timeout=HARD_LIMIT, stderr_to_stdout=True,
                   env={"MPIFUSION_TIMEOUT": "", "MPIFUSION_COMM_STRATEGY": "",
                        "MPIFUSION_SEGMENT_BYTES": "", "MPIFUSION_ORDER": "",
                        "MPIFUSION_VERIFY_ORDER": "", "MPIFUSION_CHECK_AGREEMENT": ""})
    out = proc.stdout
    assert "WRONG" not in out, out[-4000:]
    for r in range(nranks):
        assert re.search(rf"rank {r}: agree: AgreementError: rank {r}: buffer 0: ranks "
                         rf"disagree", out), out[-4000:]
    assert SETTINGS[setting] in out, out[-4000:]
