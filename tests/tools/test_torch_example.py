"""The PyTorch data-parallel example (scripts/torch_dp_example.py) under ``mpiexec -n 2``."""
import subprocess
import sys

import pytest

from tests.helpers import REPO, run_job

pytest.importorskip("torch")

SCRIPT = REPO / "examples" / "torch_dp_example.py"


def _run(*extra: str) -> subprocess.CompletedProcess:
    return run_job(2, [sys.executable, "-m", "mpi4py", str(SCRIPT), *extra], timeout=240)


def test_two_ranks_train_like_one_process_on_the_concatenated_batch():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "2 rank(s)" in out and "EQUAL to single-process training" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(20))
    dp, single = [float(r[1]) for r in rows], [float(r[2]) for r in rows]
    assert dp[-1] < 0.5 * dp[0], "the example should actually learn"
    assert max(abs(a - b) for a, b in zip(dp, single)) < 1e-5


def test_the_example_fails_when_results_differ():
    # two ranks sum grads in another order than one process: no tolerance -> not equal
    proc = _run("--steps", "3", "--rtol", "0", "--atol", "0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DIFFERENT" in proc.stdout
