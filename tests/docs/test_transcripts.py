"""The transcripts of the README and the docs pages run as written and print what the pages
show (the syntax of a transcript: tests/docs/transcript.py).

Each ``$ `` line runs with bash in a scratch folder that holds the spec example as
``spec.json``, with this Python's ``mpifusion`` and ``mpiexec`` first on PATH, none of the
user's ``MPIFUSION_*`` settings and no tune file. The transcripts that read the machine run
again on faked machines (L2 of 512 KiB to 32 MiB), so a value a page does not mark
``<machine>`` fails here rather than on the next user's computer.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import List

import pytest

from tests.docs import transcript
from tests.docs.transcript import matches
from tests.helpers import mpiexec_path, run_cmd

CASES = transcript.all_transcripts()
#: the commands whose output depends on the machine's caches (the segment size)
MACHINE_COMMANDS = ("mpifusion info",)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return transcript.make_scratch(tmp_path_factory.mktemp("transcripts"))


def run_block(block: List[tuple], scratch: Path, extra_env: dict = None) -> List[str]:
    """Run each command of ``block``, check it prints what the page shows; all output."""
    if shutil.which("bash") is None:
        pytest.skip("bash not found")
    env = dict(transcript.scratch_env(scratch, mpiexec_path()), **(extra_env or {}))
    printed = []
    for command, expected in block:
        proc = run_cmd(["bash", "-c", command], timeout=240, cwd=str(scratch), env=env,
                       stderr_to_stdout=True)
        actual = transcript.clean(proc.stdout)
        assert "Traceback" not in proc.stdout, proc.stdout
        assert matches(expected, actual), (
            f"$ {command}\nthe page shows:\n" + "\n".join(expected)
            + "\n\nit printed:\n" + "\n".join(actual))
        printed += actual
    return printed


def test_the_pages_have_transcripts():
    commands = [cmd for block in CASES.values() for cmd, _ in block]
    assert any(c.startswith("mpifusion layout") for c in commands), commands
    assert any(" mpifusion run" in c for c in commands), commands
    assert any("error" in " ".join(out) for block in CASES.values() for _, out in block)
    assert any(any(m in c for m in MACHINE_COMMANDS) for c in commands), commands


@pytest.mark.parametrize("block", list(CASES.values()), ids=list(CASES))
def test_transcript(block, scratch):
    run_block(block, scratch)


#: L2 per core -> the segment size ``mpifusion info`` reports (machine.segment_rule)
FAKE_L2 = {512 << 10: 2 << 20, 1 << 20: 2 << 20, 2 << 20: 4 << 20, 32 << 20: 16 << 20}
FAKE_CPU = "Faked CPU 9000 (tests/docs/transcript.py)"


@pytest.mark.parametrize("l2", list(FAKE_L2), ids=[f"L2={k >> 10}KiB" for k in FAKE_L2])
def test_machine_transcripts_hold_on_other_machines(l2, scratch, tmp_path):
    """The transcripts that print what the machine's caches decide pass on a machine with
    another L2, and on the largest one every transcript does (the README once pinned this
    machine's 4194304-byte segment, and the suite failed on a machine with 1 MiB of L2)."""
    env = transcript.fake_machine(tmp_path / "machine", {"L1d": 48 << 10, "L2": l2,
                                                         "L3": 64 << 20}, FAKE_CPU)
    blocks = [b for b in CASES.values() if l2 == max(FAKE_L2)
              or any(m in cmd for cmd, _ in b for m in MACHINE_COMMANDS)]
    assert blocks, "no transcript runs " + " or ".join(MACHINE_COMMANDS)
    printed = [line for block in blocks for line in run_block(block, scratch, env)]
    # the faked machine is the one the job saw (else this test proves nothing)
    assert f"segment size:   {FAKE_L2[l2]} bytes (L2 rule (L2 {l2 >> 10} KiB))" in printed, \
        printed


@pytest.mark.parametrize("expected, actual, ok", [
    (["a 1.5 b", "...", "z"], ["a 2.25 b", "x", "y", "z"], True),
    (["a 1.5 b", "z"], ["a 2.25 b", "x", "z"], False),       # no gap: lines are adjacent
    (["a 1 b"], ["a 2 b"], False),                           # integers are exact
    (["head ...", "..."], ["head tail", "more"], True),
    (["...", "PASS: 3 ok"], ["x", "PASS: 3 ok"], True),
    (["...", "PASS: 3 ok"], ["PASS: 3 ok", "extra"], False),  # the last line is the last
    (["x 3.18e-07 abs"], ["x 1.5e-06 abs"], True),
    (["seg <machine> bytes (L2 <machine> KiB)"], ["seg 2097152 bytes (L2 1024 KiB)"], True),
    (["cpu: <machine>"], ["cpu: AMD EPYC 7B13 64-Core"], True),
    (["cpu: <machine>"], ["cpu: "], False),                   # a value is still required
    (["seg <machine> bytes"], ["seg 4 KiB"], False),          # the rest is exact
])
def test_matcher(expected, actual, ok):
    assert matches(expected, actual) is ok
