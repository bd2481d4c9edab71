"""The conformance matrix (tests/oracle/conformance.py): real peers -- PyTorch DDP, FSDP2, a
hand-written all-reduce loop, a hook reducer and a flat-buffer reducer over gloo, Paddle's
own FusedCommBuffer -- each run as written (PASS) and with the bugs users put in, in the
peer's own code path (no output edited afterwards). Every bug must FAIL naming its params
and the ranks whose output is wrong, and the diagnosis must name the right kind with its key
field. README's table is the matrix as observed here.

Each peer script runs once per module (2 ranks under mpiexec, hard timeout), writing one dump
per case. Skipped, with the reason, where torch or paddle is not installed.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.oracle import conformance as cf


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[{module}]')")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """peer -> its output folder, each peer launched once, on first use."""
    done: dict = {}

    def get(peer: str):
        if peer not in done:
            _need(cf.SCRIPTS[peer][2])
            out = tmp_path_factory.mktemp(peer)
            cf.launch(peer, out)
            done[peer] = out
        return done[peer]
    return get


@pytest.fixture(scope="module")
def observed(outputs):
    cache: dict = {}

    def get(case: str) -> cf.Observed:
        if case not in cache:
            row = cf.BY_NAME[case]
            cache[case] = cf.observe(outputs(row.peer), case)
        return cache[case]
    return get


CASES = [pytest.param(c.case, id=c.case) for c in cf.MATRIX]
BUGS = [pytest.param(c.case, id=c.case) for c in cf.MATRIX if c.bug]


@pytest.mark.parametrize("case", CASES)
def test_verdict_params_and_ranks(observed, case):
    """PASS as written; each bug FAILs naming exactly its params and the wrong ranks."""
    row, obs = cf.BY_NAME[case], observed(case)
    assert obs.verdict == row.verdict, obs
    assert obs.failing == list(row.failing), obs
    assert obs.ranks == list(row.ranks), obs
