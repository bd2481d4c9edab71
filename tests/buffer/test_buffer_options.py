"""FusedCommBuffer's options have one definition (``BufferOptions``): the keyword arguments
mirror it, the buffer reads it, and the cross-rank agreement entries are derived from it, so
an option added there is agreed on every rank without another list to update.

Run as a script (``mpiexec -n 2 python -m mpi4py THIS_FILE FOLDER``) this file is also the driver of
:func:`test_each_option_mismatch_is_refused_naming_it` (one job for every option).
"""
from __future__ import annotations

import inspect
import json
import sys
from dataclasses import dataclass, fields

import numpy as np
import pytest

from mpifusion.errors import GradError, LayoutError, OptionError, error_context
from mpifusion.runtime.options import SWITCHES, BufferOptions, option
from tests.helpers import run_job

#: options whose value may differ between ranks (each says why in its field metadata)
PER_RANK = {"init_slice_param"}


def _cases(rank: int) -> dict:
    """Per option: FusedCommBuffer keyword arguments that differ on ``rank`` 0 and 1 in that
    option only (each valid on its own), and the values the agreement entry shows."""
    def pick(a, b):
        return a if rank == 0 else b

    from mpifusion import Param

    rs = {"act": "reduce_scatter", "release_grads": True}
    # empty slice params: the buffer makes each one a view of this rank's piece
    slices = {name: Param(f"{name}@slice", np.zeros(0, np.float32)) for name in ("w", "b")}
    return {
        "act": ({"act": pick("all_reduce", "reduce_scatter")},
                ("ALL_REDUCE", "REDUCE_SCATTER")),
        "acc_steps": ({"acc_steps": pick(1, 2)}, (1, 2)),
        "dst": ({"act": "reduce", "dst": pick(0, 1)}, (0, 1)),
        "use_main_grad": ({"use_main_grad": pick(False, True)}, (False, True)),
        "fuse_param": ({"fuse_param": pick(False, True)}, (False, True)),
        "scale_after_comm": ({"scale_after_comm": pick(True, False)}, (True, False)),
        "release_grads": ({"release_grads": pick(False, True)}, (False, True)),
        "use_reduce_avg": ({"use_reduce_avg": pick(False, True)}, (False, True)),
        "free_grads_in_comm": ({**rs, "free_grads_in_comm": pick(False, True)}, (False, True)),
        "check_naninf": ({"check_naninf": pick(False, True)}, (False, True)),
        "init_slice_param": ({"act": "reduce_scatter", "init_slice_param": pick(False, True),
                              "slice_params": pick(None, slices)}, (False, True)),
    }


def _params():
    from mpifusion import Param

    return [Param("w", np.ones((4, 3), np.float32)), Param("b", np.ones(5, np.float32))]


# --------------------------------------------------------------------------- one process
def test_every_option_is_agreed_unless_it_says_why_not():
    opts = BufferOptions()
    agreed = opts.agreed()
    for f in fields(BufferOptions):
        reason = f.metadata["per_rank"]
        assert (f.name in agreed) != bool(reason), f.name
    assert {f.name for f in fields(BufferOptions)} - set(agreed) == PER_RANK


def test_a_new_option_is_agreed_without_another_list():
    """An option added to the options object reaches the buffer's agreement entries."""
    from mpi4py import MPI

    from mpifusion import FusedCommBuffer

    @dataclass(frozen=True)
    class WithMore(BufferOptions):
        bucket_cap: int = option(7, lambda value, where, name: value)
        local_hint: int = option(0, lambda value, where, name: value, per_rank="a hint")

    more = WithMore(act="all_reduce").checked("rank 0: buffer 0", True)
    assert more.agreed()["bucket_cap"] == 7 and "local_hint" not in more.agreed()
    buf = FusedCommBuffer(0, _params(), MPI.COMM_SELF, act="all_reduce")
    object.__setattr__(buf, "options", more)
    entries = dict(buf._agreement_entries())
    assert entries["bucket_cap"] == "7" and "local_hint" not in entries
    for name, value in BufferOptions(act="all_reduce").checked("w", True).agreed().items():
        assert entries[name] == repr(value), name


def test_a_per_rank_option_needs_its_reason_in_words():
    with pytest.raises(TypeError, match="per_rank: expected the reason as a str"):
        option(0, lambda value, where, name: value, per_rank=True)


def test_keyword_arguments_mirror_the_options():
    """FusedCommBuffer keeps Paddle's keyword arguments; each option is one of them, with the
    same default, so the signature cannot drift from the one definition."""
    from mpifusion import FusedCommBuffer

    signature = inspect.signature(FusedCommBuffer.__init__).parameters
    for f in fields(BufferOptions):
        assert f.name in signature, f.name
        assert signature[f.name].default == f.default, f.name
    assert set(SWITCHES) <= set(signature)


@pytest.mark.parametrize("name", [f.name for f in fields(BufferOptions)])
def test_each_option_reaches_the_buffer(name):
    """A non-default value given by keyword is what the buffer reads (``buf.options``)."""
    from mpi4py import MPI

    from mpifusion import FusedCommBuffer

    cases = _cases(1)
    assert set(cases) == {f.name for f in fields(BufferOptions)}
    kwargs, (_, want) = cases[name]
    kwargs = {"act": "all_reduce", **kwargs}
    if name == "dst":
        kwargs["dst"] = 0  # the only global rank COMM_SELF holds in a one-process run
        want = 0
    buf = FusedCommBuffer(3, _params(), MPI.COMM_SELF, **kwargs)
    got = getattr(buf.options, name)
    assert (got.name if name == "act" else got) == want


def test_context_is_added_and_the_cause_kept():
    with pytest.raises(LayoutError, match=r"^rank 2: buffer 5: bad size$") as info:
        with error_context("rank 2: buffer 5", ValueError, kind=LayoutError):
            raise ValueError("bad size")
    assert type(info.value.__cause__) is ValueError


def test_buffer_errors_keep_their_cause():
    from mpi4py import MPI

    from mpifusion import FusedCommBuffer

    with pytest.raises(OptionError, match=r"^rank 0: buffer 4: timeout") as info:
        FusedCommBuffer(4, _params(), MPI.COMM_SELF, act="all_reduce", timeout="soon")
    assert isinstance(info.value.__cause__, OptionError)
    params = _params()
    buf = FusedCommBuffer(4, params, MPI.COMM_SELF, act="all_reduce")
    with pytest.raises(GradError, match=r"^rank 0: buffer 4: param 'w': grad: ") as info:
        buf.add_grad(params[0], grad=object())
    assert isinstance(info.value.__cause__, TypeError)


# --------------------------------------------------------------------------- two ranks
def test_each_option_mismatch_is_refused_naming_it(tmp_path):
    """Two ranks that differ in one option: AgreementError on both, naming that option and
    each rank's value; a per-rank option builds."""
    proc = run_job(2, [sys.executable, "-m", "mpi4py", __file__, tmp_path], timeout=180,
                   env={"MPIFUSION_TIMEOUT": "60"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = {}
    for rank in (0, 1):  # a file per rank: the launcher may interleave the ranks' stdout
        for record in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            seen[(rank, record["option"])] = record
    cases = _cases(0)
    assert {name for _, name in seen} == set(cases)
    for name, (_, (v0, v1)) in cases.items():
        for rank in (0, 1):
            record = seen[(rank, name)]
            if name in PER_RANK:
                assert record["outcome"] == "built", record
                continue
            assert record["outcome"] == "AgreementError", record
            message = record["message"]
            assert message.startswith(f"rank {rank}: buffer 9: ranks disagree"), message
            assert f"{name} {v0!r} on rank 0; {name} {v1!r} on rank 1" in message, message


def _driver(folder: str) -> None:
    """Each option in turn, different on the two ranks: what this rank got, in a JSON file."""
    from mpi4py import MPI

    from mpifusion import AgreementError, FusedCommBuffer

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    records = []
    for name, (kwargs, _) in _cases(rank).items():
        kwargs = {"act": "all_reduce", **kwargs}
        try:
            FusedCommBuffer(9, _params(), world, **kwargs).close()
            outcome, message = "built", ""
        except AgreementError as exc:
            outcome, message = "AgreementError", str(exc)
        records.append({"option": name, "outcome": outcome, "message": message})
    with open(f"{folder}/rank{rank}.json", "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    _driver(sys.argv[1])
