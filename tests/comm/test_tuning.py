"""The communication layer's thresholds live in one frozen ``Tuning``: each says why, tests
override them for a ``with`` block, the collectives follow them, ranks that differ refuse
to build a buffer, and ``mpifusion info`` prints them."""
from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpifusion.comm import tuning
from mpifusion.comm.communicator import Communicator
from mpifusion.config import CommOptions
from mpifusion.errors import AgreementError, OptionError

COMM_DIR = Path(tuning.__file__).resolve().parent


def test_every_threshold_says_why_and_the_value_is_frozen():
    t = tuning.current()
    rows = t.rows()
    assert [name for name, _, _ in rows] == [f.name for f in dataclasses.fields(t)]
    for name, value, why in rows:
        assert len(why.split()) >= 8, f"{name}: say what it decides and what chose it"
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.inline_max_bytes = 1
    assert t.changed() == ""


def test_override_is_scoped_and_validated():
    before = tuning.current()
    with tuning.override(scratch_bytes=4096, handoff_s=0.5) as t:
        assert tuning.current() is t and t.scratch_bytes == 4096
        assert t.changed() == "handoff_s=0.5, scratch_bytes=4096"
    assert tuning.current() is before
    with pytest.raises(OptionError, match="Tuning.chunk_bytes"):
        tuning.Tuning(chunk_bytes=-1)
    with pytest.raises(OptionError, match="pipe_slots"):
        tuning.Tuning(pipe_slots=1)
    with pytest.raises(OptionError, match="no_such"):
        with tuning.override(no_such=1):
            pass
    with pytest.raises(OptionError, match="Tuning"):
        tuning.use({"inline_max_bytes": 1})
    assert tuning.current() is before


def test_no_threshold_constant_is_left_in_comm():
    """The thresholds are fields of Tuning, not module constants beside their users."""
    names = {f.name.upper() for f in dataclasses.fields(tuning.Tuning)}
    names |= {"INLINE_MAX_BYTES", "SHM_INLINE_MAX_BYTES", "HANDOFF_S", "HOT_S", "MAX_PAUSE"}
    for path in sorted(COMM_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assert target.id not in names, f"{path.name}: {target.id}"


def test_info_prints_the_thresholds():
    out = subprocess.run([sys.executable, "-m", "mpifusion", "info", "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    info = json.loads(out)
    assert info["tuning"] == {name: value for name, value, _ in tuning.current().rows()}
    text = subprocess.run([sys.executable, "-m", "mpifusion", "info"], capture_output=True,
                          text=True, timeout=120, check=True).stdout
    assert "tuning:" in text and "inline_max_bytes" in text


@pytest.mark.mpi
def test_inline_follows_the_threshold(comm):
    """A collective at most ``inline_max_bytes`` is planned inline (its caller may run it);
    a threshold of 0 plans it for the communication thread; the sum is the same."""
    n, rank = comm.Get_size(), comm.Get_rank()
    for limit, inline in ((64 << 10, True), (0, False)):
        with tuning.override(inline_max_bytes=limit):
            c = Communicator(comm, CommOptions(strategy="thread"))
            buf = np.full(256, rank + 1.0, np.float32)
            task = c.allreduce(buf, scale=1.0 / n)
            assert task._op.plan.inline is inline
            task.wait(timeout=60)
            np.testing.assert_array_equal(buf, np.float32((n + 1) / 2))
            c.close()


@pytest.mark.mpi(min_size=2)
def test_ranks_with_other_thresholds_refuse_to_build(comm):
    """Thresholds decide which calls a collective makes: a rank with others would pair its
    calls with different ones, so the agreement check refuses on every rank, naming it."""
    changes = {"gather_max_bytes": 0} if comm.Get_rank() == 0 else {}
    with tuning.override(**changes):
        with pytest.raises(AgreementError, match="tuning"):
            Communicator(comm, CommOptions(strategy="thread", timeout=60.0))
