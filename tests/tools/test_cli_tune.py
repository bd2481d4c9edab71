"""``mpifusion tune``: bad input is one line on stderr and exit 2 (no traceback, on every
rank), and only segment sizes the buffer can be cut into are timed. Before:
``--mb inf``/``1e12`` and ``--dtype int32`` crashed with tracebacks, and ``--mb 1``
timed 2-32 MiB segments of a 1 MiB buffer (the "best" was the whole buffer)."""
from __future__ import annotations

import pytest

from mpifusion.config import OptionError
from mpifusion.tools import tune

from tests.helpers import mpiexec, private_tune_file, run_cli  # noqa: F401  (autouse)

MiB = 1 << 20


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("mpifusion tune: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, needle", [
    (["--mb", "inf"], "argument --mb: expected a size in MiB > 0 and at most 1048576"),
    (["--mb", "1e12"], "argument --mb: expected a size in MiB > 0 and at most 1048576"),
    (["--mb", "0"], "argument --mb: expected a size in MiB > 0"),
    (["--mb", "-3"], "argument --mb: expected a size in MiB > 0"),
    (["--mb", "nan"], "argument --mb: expected a size in MiB > 0"),
    (["--mb", "lots"], "argument --mb: expected a size in MiB > 0"),
    (["--dtype", "int32"], "argument --dtype: expected float32, bfloat16, float16 or float64"),
    (["--dtype", "complex64"], "argument --dtype: expected float32, bfloat16"),
    (["--rounds", "0"], "argument --rounds: expected an integer >= 1, got '0'"),
    (["--segments", "inf"], "--segments: expected sizes > 0 and at most 1048576 MiB"),
    (["--segments", "nan"], "--segments: expected sizes > 0"),
])
def test_bad_input_is_one_line_naming_the_option(capsys, argv, needle):
    code, out, err = run_cli(capsys, "tune", "--dry-run", *argv)
    assert code == 2 and out == ""
    line = _one_line(err)
    assert needle in line and repr(argv[1]) in line


def test_a_namespace_is_checked_too():
    """Callers that build the namespace (tests, scripts) get the same checks."""
    import argparse

    ns = argparse.Namespace(mb=float("inf"), segments="1,2", dtype="float32", rounds=1,
                            output=None, dry_run=True)
    with pytest.raises(OptionError, match="--mb: expected a size in MiB"):
        tune.run(ns)
    ns.mb, ns.dtype = 4.0, "int32"
    with pytest.raises(OptionError, match="--dtype: expected float32"):
        tune.run(ns)


def test_sweep_times_only_segments_that_fit():
    segs = [256 * 1024, 512 * 1024, MiB, 2 * MiB, 4 * MiB]
    assert tune.sweep(segs, MiB, 4) == ([256 * 1024, 512 * 1024, MiB], [2 * MiB, 4 * MiB])
    assert tune.sweep(segs, 64 * MiB, 2) == (segs, [])
    with pytest.raises(OptionError, match=r"--mb: a buffer of 300 KiB leaves 1 of .* "
                                          r"use --mb 0\.5 or more"):
        tune.sweep(segs, 300 * 1024, 4)
    with pytest.raises(OptionError, match="use --mb 0.5 or more"):
        tune.sweep(segs, 8, 4)
    # the smallest --mb is whole elements: 100001 bytes need 25001 float32 elements
    with pytest.raises(OptionError, match=f"use --mb {100004 / MiB!r} or more"):
        tune.sweep([4096, 100001], 4096, 4)
    with pytest.raises(OptionError, match="--segments: a sweep needs at least two sizes"):
        tune.sweep([MiB], 64 * MiB, 4)


# ------------------------------------------------------------------ under mpiexec


@pytest.mark.parametrize("argv, needle", [
    (["--mb", "inf"], "argument --mb: expected a size in MiB"),
    (["--dtype", "int32"], "argument --dtype: expected float32"),
    (["--mb", "0.3"], "--mb: a buffer of 307.2 KiB leaves 1 of the segment sizes"),
    (["--mb", "0.3"], "use --mb 0.5 or more"),
    # more than this machine has: refused before anything is allocated
    (["--mb", "1048576"], "--mb 1048576: the float32 buffer needs about 1.0 TiB of memory"),
])
def test_bad_input_under_mpiexec_every_rank_exits_2(argv, needle):
    proc = mpiexec(2, "tune", "--dry-run", "--rounds", "1", *argv, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in _one_line(proc.stderr)
    assert proc.stdout == ""


def test_segments_larger_than_the_buffer_are_not_timed():
    proc = mpiexec(2, "tune", "--dry-run", "--rounds", "1", "--mb", "1", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "# not timed, larger than the buffer: 2 MiB, 4 MiB, 8 MiB, 16 MiB, 32 MiB" in out
    rows = [line.split()[:2] for line in out.splitlines() if line.strip().endswith(
        ("fastest", ")")) or line.strip()[:1].isdigit()]
    assert [" ".join(r) for r in rows] == ["256 KiB", "512 KiB", "1 MiB"], out
    assert "dry run: fastest segment" in out
