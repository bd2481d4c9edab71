"""The conformance matrix (tests/oracle/conformance.py): real peers -- PyTorch DDP, FSDP2, a
hand-written all-reduce loop, a hook reducer and a flat-buffer reducer over gloo, Paddle's
own FusedCommBuffer -- each run as written (PASS) and with the bugs users put in, in the
peer's own code path (no output edited afterwards). Every bug must FAIL naming its params
and the ranks whose output is wrong, and the diagnosis must name the right kind with its key
field. README's table is the matrix as observed here.

Each peer script runs once per module (2 ranks under mpiexec, hard timeout), writing one dump
per case. Skipped, with the reason, where torch, paddle or megatron-core is not
installed.
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


def _padding_offsets(out, case: str) -> dict:
    """param -> the shift the packed read-back makes: minus the padding before it in the
    spec's plan (Paddle's layout)."""
    from mpifusion.spec import load_spec

    shifts = {}
    for planned in load_spec(out / case / "spec.json").plan(cf.NRANKS):
        packed = 0
        for slot in planned.layout.slots:
            shifts[slot.name] = packed - slot.offset
            packed += slot.numel
    return shifts


def _expect_kind(row: cf.Case, name: str, diag: dict, outputs, holders=None) -> None:
    assert diag, f"{row.case}: {name}: no diagnosis in the report"
    if name in row.ambiguous and diag["kind"] != row.kind:
        assert f"({row.kind}:" in diag["text"], (name, diag)  # the other reading named
        return
    assert diag["kind"] == row.kind, (name, diag)
    # the wrong ranks among those holding the param (a sharded output: its pieces' ranks)
    held = holders.get(name) if holders else None
    assert diag["ranks"] == [r for r in row.ranks if held is None or r in held], (name, diag)
    for key, want in row.fields.items():
        if key == "offset" and isinstance(want, str):  # in words: Paddle's padding
            want = _padding_offsets(outputs(row.peer), row.case)[name]
        elif key == "with":
            want = want[name]
        if isinstance(want, float):
            assert diag[key] == pytest.approx(want, rel=1e-6), (name, diag)
        else:
            assert diag[key] == want, (name, diag)


@pytest.mark.parametrize("case", BUGS)
def test_diagnosis_kind(observed, outputs, case):
    """Each failing param's diagnosis: the right kind, the wrong ranks and the key field
    (factor, from_ranks and steps, offset, with, dtype), in every failing step of a peer that
    checks several."""
    row, obs = cf.BY_NAME[case], observed(case)
    for name in obs.failing:
        _expect_kind(row, name, obs.diagnosis[name], outputs, obs.holders)
    for k, diags in obs.steps.items():
        for name, diag in diags.items():
            _expect_kind(row, name, diag, outputs, obs.holders)


def test_readme_table_is_the_observed_matrix(observed):
    """README's conformance table is what this run observed (regenerate it with
    ``python -m tests.oracle.conformance --write``)."""
    table = cf.render({c.case: observed(c.case) for c in cf.MATRIX})
    readme = cf.README.read_text(encoding="utf-8")
    assert cf.readme_table(readme) == table, (
        f"README.md's table differs from the observed matrix; run python -m "
        f"tests.oracle.conformance --write. Observed:\n{table}")
