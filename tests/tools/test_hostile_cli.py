"""Hostile input to the command line: the oracle never passes a wrong answer, and nothing a
user feeds in crashes, hangs or exhausts memory (one line on stderr, exit 2).

Serial cases run in this process (``run_cli``) or as a bounded process (``run_cmd``, for
files that could block); the run/CLI cases also run under ``mpiexec`` at 2, 3 and 8 ranks,
where every rank must exit with the same code and only rank 0 prints.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from tests.helpers import mpiexec, run_cli, run_cmd, run_job
from tests.unit.test_hostile_inputs import hostile_dumps, write_spec

INF = np.inf


def _one_line_error(err: str, command: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"mpifusion {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------- oracle: Inf/NaN


def _dump(folder, ins, outs, dtype):
    folder.mkdir()
    for r, (i, o) in enumerate(zip(ins, outs)):
        np.savez(folder / f"rank{r}.npz", **{"in/w/0": np.array(i, dtype),
                                              "out/w": np.array(o, dtype)})
    return str(folder)


# each of the cases passed before (error inf, bound inf, ratio dropped)
CASES = {
    "inf in one rank, zero output": ("float32", [[INF, 1, 2], [0, 1, 2]], [[0, 2, 4]] * 2,
                                     "reference is Inf/NaN"),
    "+inf/-inf, zero output": ("float32", [[INF, 1, 2], [-INF, 1, 2]], [[0, 2, 4]] * 2,
                               "reference is Inf/NaN"),
    "finite where the reference is inf": ("float32", [[INF, 1, 2], [0, 1, 2]],
                                          [[1e30, 2, 4]] * 2, "reference is Inf/NaN"),
    "fp64 sum overflows": ("float64", [[1e308, 1, 2], [1e308, 1, 2]], [[0, 2, 4]] * 2,
                           "overflows"),
    "fp64 sum|x| overflows": ("float64", [[1e308, 1, 2], [-1e308, 1, 2]], [[5, 2, 4]] * 2,
                              "overflows"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_never_passes_a_wrong_answer_with_inf(capsys, tmp_path, case):
    dtype, ins, outs, words = CASES[case]
    folder = _dump(tmp_path / "dump", ins, outs, dtype)
    spec = write_spec(tmp_path / "spec.json", (3,), dtype=dtype, nranks=2)
    code, out, _ = run_cli(capsys, "check", "--spec", spec, folder)
    assert code == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FAIL") and "w" in last and words in out
    code, out, _ = run_cli(capsys, "check", "--spec", spec, folder, "--json")
    doc = json.loads(out)
    row = doc["params"][0]
    assert code == 1 and doc["verdict"] == "FAIL" and row["ok"] is False
    assert words in row["reason"]


def test_check_passes_matching_inf_and_nan(capsys, tmp_path):
    """inf + 1 = inf and inf + -inf = NaN: an implementation that got them passes."""
    ins = [[INF, -INF, 1.0, 2.0], [1.0, 1.0, INF, 3.0]]
    out = [[INF, -INF, INF, 5.0]] * 2
    folder = _dump(tmp_path / "d", ins, out, "float32")
    spec = write_spec(tmp_path / "spec.json", (4,), nranks=2)
    code, text, _ = run_cli(capsys, "check", "--spec", spec, folder)
    assert code == 0, text
    ins = [[INF, 1.0], [-INF, 1.0]]
    folder = _dump(tmp_path / "nan", ins, [[np.nan, 2.0]] * 2, "float32")
    spec = write_spec(tmp_path / "spec2.json", (2,), nranks=2)
    assert run_cli(capsys, "check", "--spec", spec, folder)[0] == 0
    folder = _dump(tmp_path / "sign", ins, [[INF, 2.0]] * 2, "float32")
    assert run_cli(capsys, "check", "--spec", spec, folder)[0] == 1


# --------------------------------------------------------------------------- hostile files


def test_check_hostile_dumps_exit_2_with_one_line(capsys, tmp_path):
    spec = write_spec(tmp_path / "spec.json", (3,), nranks=1)
    for label, (folder, words) in hostile_dumps(tmp_path / "dumps").items():
        code, _, err = run_cli(capsys, "check", "--spec", spec, folder)
        line = _one_line_error(err, "check")
        assert code == 2 and words in line, (label, line)
        assert "allow_pickle" not in line and "max_header_size" not in line


@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_check_fifo_or_device_as_rank_file_does_not_block(tmp_path, target):
    folder = tmp_path / "dump"
    folder.mkdir()
    if target == "fifo":
        os.mkfifo(folder / "rank0.npz")
    else:
        os.symlink(target, folder / "rank0.npz")
    spec = write_spec(tmp_path / "spec.json", (3,), nranks=1)
    res = run_cmd([sys.executable, "-m", "mpifusion", "check", "--spec", spec, str(folder)],
                  timeout=60)
    line = _one_line_error(res.stderr, "check")
    assert res.returncode == 2 and "not a regular file" in line


def test_layout_spec_fifo_does_not_block(tmp_path):
    os.mkfifo(tmp_path / "spec.json")
    res = run_cmd([sys.executable, "-m", "mpifusion", "layout", "--spec",
                   str(tmp_path / "spec.json")], timeout=60)
    assert res.returncode == 2 and "not a regular file (a FIFO)" in res.stderr


@pytest.mark.parametrize("text, words", [
    ('{"params": [{"name": "w", "shape": [' + "9" * 5000 + '], "dtype": "fp32"}]}',
     "5000 digits"),
    ("[" * 100000 + "]" * 100000, "nested 100000 deep"),
])
def test_layout_hostile_json_exits_2(capsys, tmp_path, text, words):
    path = tmp_path / "hostile.json"
    path.write_text(text)
    code, _, err = run_cli(capsys, "layout", "--spec", str(path))
    assert code == 2 and words in _one_line_error(err, "layout")
    code, _, err = run_cli(capsys, "layout", "--layout", str(path))
    assert code == 2 and words in _one_line_error(err, "layout")


def test_layout_with_a_billion_ranks_is_refused_at_once(capsys):
    code, _, err = run_cli(capsys, "layout", "--act", "reduce_scatter", "--nranks",
                           "1000000000")
    line = _one_line_error(err, "layout")
    assert code == 2 and "nranks 1000000000" in line and "at most" in line


# --------------------------------------------------------------------------- under mpiexec


@pytest.mark.parametrize("n", [2, 3, 8])
def test_run_acc_steps_beyond_the_bound_exits_2(n):
    res = mpiexec(n, "run", "--acc-steps", "100000000", "--no-progress", timeout=240)
    line = _one_line_error(res.stderr, "run")
    assert res.returncode == 2 and "acc_steps 100000000" in line and "at most" in line


@pytest.mark.parametrize("n", [2, 3, 8])
def test_run_with_a_1e12_element_spec_says_how_much_memory(tmp_path, n):
    spec = write_spec(tmp_path / "spec.json", (10 ** 12,), nranks=n)
    res = mpiexec(n, "run", "--spec", spec, "--no-progress", timeout=240)
    line = _one_line_error(res.stderr, "run")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "needs about" in line and "per rank" in line and "available" in line


def _run_with_timeout(n: int, value: str):
    return run_job(n, [sys.executable, "-m", "mpifusion", "run", "--steps", "1",
                       "--no-progress"], timeout=240, env={"MPIFUSION_TIMEOUT": value})


@pytest.mark.parametrize("n, value", [(2, "inf"), (3, "inf"), (8, "inf"), (2, "1e300")])
def test_run_with_an_infinite_timeout_passes(n, value):
    res = _run_with_timeout(n, value)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "OverflowError" not in res.stderr and res.stdout.strip().splitlines()[-1].startswith(
        "PASS")


@pytest.mark.parametrize("n, value", [(2, "nan"), (3, "nan"), (8, "nan"), (2, "-1"),
                                      (2, "0"), (2, "abc")])
def test_run_with_a_bad_timeout_exits_2_naming_the_variable(n, value):
    res = _run_with_timeout(n, value)
    line = _one_line_error(res.stderr, "run")
    assert res.returncode == 2 and "MPIFUSION_TIMEOUT" in line


@pytest.mark.parametrize("n", [2, 3, 8])
def test_check_under_mpiexec_with_a_fifo_exits_2_once(tmp_path, n):
    folder = tmp_path / "dump"
    folder.mkdir()
    os.mkfifo(folder / "rank0.npz")
    spec = write_spec(tmp_path / "spec.json", (3,), nranks=1)
    res = mpiexec(n, "check", "--spec", spec, str(folder), timeout=120)
    line = _one_line_error(res.stderr, "check")
    assert res.returncode == 2 and "not a regular file" in line


@pytest.mark.parametrize("n", [2, 3, 8])
def test_run_with_a_bad_timeout_on_one_rank_only_exits_2_everywhere(n):
    """MPMD: the last rank alone has MPIFUSION_TIMEOUT=nan; every rank exits 2, rank 0 prints
    the last rank's error once."""
    cli = [sys.executable, "-m", "mpifusion", "run", "--steps", "1", "--no-progress"]
    res = run_job(n - 1, [*cli, ":", "-n", "1", "env", "MPIFUSION_TIMEOUT=nan", *cli],
                  timeout=240)
    line = _one_line_error(res.stderr, "run")
    assert res.returncode == 2 and f"rank {n - 1}: MPIFUSION_TIMEOUT" in line


def test_run_out_of_memory_mid_run_is_one_line(capsys, monkeypatch):
    """Past the estimate checked before building (one rank here: no abort needed)."""
    import mpifusion.tools.runjob as runjob

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(runjob, "run_job", no_memory)
    code, _, err = run_cli(capsys, "run", "--steps", "1", "--no-progress")
    line = _one_line_error(err, "run")
    assert code == 2 and "rank 0: out of memory" in line
