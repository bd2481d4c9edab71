"""Every field of a collective's record has one writer: the plan is fixed when the record is
built, the engine writes its working state, and only ``record.finish`` writes the result.
Checked twice: in the source (every assignment to a record field in mpifusion/comm/), and
at run time (a record that reports each write, driven through real collectives of every
engine and both orders, a failure included)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest

from mpifusion.comm import communicator as communicator_mod
from mpifusion.comm import release
from mpifusion.comm.communicator import Communicator
from mpifusion.comm.record import Collective, Plan, finish
from mpifusion.config import CommOptions

COMM_DIR = Path(communicator_mod.__file__).resolve().parent

#: the engine's working state: written in engines.py, or by the record's own methods
ENGINE_FIELDS = {"build", "steps", "requests", "keep", "seq", "blocked", "stopped", "failure",
                 "stealable", "since", "late"}
#: the result: written by finish() only (and set up by __init__)
RESULT_FIELDS = {"error", "done"}
ALL_FIELDS = ENGINE_FIELDS | RESULT_FIELDS | {"plan"}


def _writers():
    """{field: {(module, enclosing function)}} for every ``x.field = ...`` in comm/, where
    ``x`` is not ``self`` outside the record class (engines keep fields of their own)."""
    found = {}
    for path in sorted(COMM_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for cls_or_fn in ast.walk(tree):
            if not isinstance(cls_or_fn, (ast.FunctionDef, ast.ClassDef)):
                continue
            for node in ast.walk(cls_or_fn):
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                           else [])
                for target in targets:
                    for t in ast.walk(target):
                        if not (isinstance(t, ast.Attribute) and t.attr in ALL_FIELDS):
                            continue
                        owner = t.value.id if isinstance(t.value, ast.Name) else ""
                        if owner == "self" and path.name != "record.py":
                            continue
                        if isinstance(cls_or_fn, ast.FunctionDef):
                            found.setdefault(t.attr, set()).add((path.stem, cls_or_fn.name))
    return found


def test_source_has_one_writer_per_record_field():
    writers = _writers()
    for field, where in writers.items():
        modules = {m for m, _ in where}
        if field in RESULT_FIELDS:
            assert where <= {("record", "__init__"), ("record", "finish")}, (field, where)
        elif field == "plan":
            assert where == {("record", "__init__")}, (field, where)
        else:
            assert modules <= {"engines", "record"}, (field, where)
    # the result is written somewhere: the walk sees the record's functions
    assert ("record", "finish") in writers["error"]
    assert ("engines", "_stamp") in writers["steps"]


def test_the_plan_is_frozen():
    op = Collective(Plan(name="t", rank=0), lambda seq: iter(()))
    with pytest.raises(AttributeError):
        op.plan.polled = True


def test_finish_records_the_result_once_and_tells_on_fail_once():
    told = []
    op = Collective(Plan(name="t", on_fail=told.append), lambda seq: iter(()), keep=[1])
    first, second = RuntimeError("first"), RuntimeError("second")
    finish(op, first)
    finish(op, second)
    assert op.error is first and op.done.is_set() and told == [first]
    assert op.keep == [] and op.steps is None and not op.requests


def test_the_engine_stamps_then_builds_the_calls_with_the_serial_passed_in():
    from mpi4py import MPI

    from mpifusion.comm.engines import Engine

    seen = []

    def build(seq):
        seen.append(seq)
        return iter(())

    dup = MPI.COMM_SELF.Dup()
    try:
        engine = Engine(dup)
        engine.seq = 7
        ops = [Collective(Plan(), build) for _ in range(2)]
        assert seen == []
        for op in ops:
            engine._stamp(op)
        assert seen == [7, 8] and [op.seq for op in ops] == [7, 8]
        assert all(op.build is None and op.steps is not None for op in ops)
        engine.free_check()
    finally:
        dup.Free()


class _Watched(Collective):
    """A record that notes who writes each field (module, function)."""

    writes: list = []

    def __setattr__(self, name, value):
        frame = sys._getframe(1)
        module = Path(frame.f_code.co_filename).stem
        _Watched.writes.append((name, module, frame.f_code.co_name))
        super().__setattr__(name, value)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["thread", "nonblocking", "shm"])
@pytest.mark.parametrize("order", ["strict", "negotiated"])
def test_run_time_writers_of_every_record_field(comm, monkeypatch, strategy, order):
    monkeypatch.setattr(communicator_mod, "Collective", _Watched)
    _Watched.writes = []
    n, rank = comm.Get_size(), comm.Get_rank()
    own = comm.Dup()  # the failure below refuses later collectives on its communicator
    c = Communicator(own, CommOptions(strategy=strategy, order=order, timeout=60.0,
                                      segment_bytes=4096))
    try:
        for numel in (16, 5000):  # inline and segmented
            buf = np.full(numel, rank + 1.0, np.float32)
            c.allreduce(buf, scale=1.0 / n, tag=(0, numel)).wait()
            np.testing.assert_array_equal(buf, np.float32((n + 1) / 2))
        if n > 1:  # a failure: the landing of a segment raises on every rank
            bad = np.ones(64, np.float32)

            def boom():
                raise ValueError("prepare failed")

            task = c.allreduce(bad, tag=(1, 64), prepare=boom)
            with pytest.raises(Exception, match="prepare failed"):
                task.wait()
    finally:
        c.close()
        release(own)
        own.Free()
    assert _Watched.writes, "no record was written: the spy was not used"
    for name, module, function in _Watched.writes:
        if name in RESULT_FIELDS:
            assert (module, function) in {("record", "__init__"), ("record", "finish")}, (
                name, module, function)
        elif name == "plan":
            assert (module, function) == ("record", "__init__"), (name, module, function)
        else:
            assert module in {"engines", "record"}, (name, module, function)
    assert any(name == "error" and function == "finish" for name, _, function
               in _Watched.writes)
