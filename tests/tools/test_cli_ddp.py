"""scripts/ddp_check_example.py: PyTorch DDP (gloo, 2 ranks) passes ``mpifusion check``;
a corrupted output fails it, naming the param."""
from __future__ import annotations

import pathlib
import sys
from subprocess import CompletedProcess

import pytest

from tests.helpers import run_cmd

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ddp_check_example.py"


def _run(*argv: str) -> CompletedProcess:
    pytest.importorskip("torch")
    for _ in range(2):
        proc = run_cmd([sys.executable, str(SCRIPT), *argv], timeout=280)
        lines = proc.stdout.strip().splitlines()
        # gloo workers occasionally abort under load before any check ran: retry that once;
        # a verdict (PASS/FAIL line from mpifusion check) is never retried
        if lines and lines[-1].startswith(("PASS", "FAIL")):
            break
    return proc


def test_ddp_dump_passes_check():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASS: 8 params")


def test_corrupted_ddp_output_fails_naming_param():
    proc = _run("--corrupt", "fc2.weight")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("FAIL: 1 param(s)") and "fc2.weight" in last
