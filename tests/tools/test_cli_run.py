"""``mpifusion run``: the job passes on a correct core, fails on a broken one, and exits 2
(every rank, one message) on bad input: bounds, huge specs, timeouts given to one rank only,
running out of memory mid-run."""
from __future__ import annotations

import json
import sys

import pytest

from mpifusion.runtime.buffer import FusedCommBuffer
from mpifusion.spec import Spec
from mpifusion.tools import runjob
from mpifusion.tools.runjob import RunOptions

from tests.forge import write_spec
from tests.helpers import mpiexec, one_line_error, run_cli, run_job


def _passed(proc) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS"), proc.stdout
    return proc.stdout


@pytest.mark.parametrize("n, argv", [
    (1, ["--steps", "2"]),
    (2, ["--act", "reduce_scatter", "--preset", "tiny-bf16", "--steps", "2"]),
    (3, ["--act", "reduce", "--dst", "2", "--release-grads", "--group-size", "20K"]),
    (3, ["--act", "reduce_scatter", "--reduce-avg", "--release-grads", "--group-size", "16K"]),
    (2, ["--preset", "tiny-fp16", "--no-main-grad", "--scale-after-comm", "--acc-steps", "3"]),
])
def test_run_passes(n, argv):
    out = _passed(mpiexec(n, "run", "--no-progress", *argv))
    assert f"mpifusion run: {n} rank(s)" in out
    assert "algbw" in out and "busbw" in out and "max error" in out and "error bound" in out
    if "reduce_scatter" in argv:
        assert "sync_params: exact" in out


def test_default_run_at_8_ranks():
    """The quick start's command (``mpiexec -n 8 mpifusion run``), as a new user runs it."""
    out = _passed(mpiexec(8, "run", timeout=280))
    assert "act all_reduce, acc_steps 2" in out and "on 8 rank(s)" in out


@pytest.mark.parametrize("n, argv, needle", [
    (3, ["--preset", "nope"], "unknown preset 'nope'"),
    (2, ["--act", "reduce", "--dst", "5"], "--dst: expected a rank of this job, in [0, 2)"),
    # before: --dst -1 quietly meant rank 0, and a --dst past the job's
    # ranks was accepted when the act has no root
    (2, ["--act", "reduce", "--dst", "-1"],
     "--dst: expected a rank of this job, in [0, 2) (2 rank(s)), got -1"),
    (3, ["--act", "reduce", "--dst", "3"],
     "--dst: expected a rank of this job, in [0, 3) (3 rank(s)), got 3"),
    (2, ["--dst", "2"], "--dst: expected a rank of this job, in [0, 2) (2 rank(s)), got 2"),
    (2, ["--steps", "0"], "--steps: expected an integer >= 1"),
])
def test_bad_input_every_rank_exits_2_one_message(n, argv, needle):
    proc = mpiexec(n, "run", *argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count(needle) == 1, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # no usage block
    assert "PASS" not in proc.stdout and "FAIL" not in proc.stdout


def test_spec_for_other_rank_count_exits_2(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"params": [{"name": "w", "shape": [5, 5], "dtype": "fp32"}],
                                "nranks": 4}))
    proc = mpiexec(2, "run", "--spec", str(spec))
    assert proc.returncode == 2
    assert proc.stderr.count(f"{spec}: nranks: the spec says 4 ranks, but the job has 2") == 1


def _spec(act: str = "all_reduce", **kw) -> Spec:
    return Spec.from_preset("tiny", act=act, acc_steps=2, **kw)


@pytest.mark.mpi
def test_run_job_in_process_passes(comm):
    assert runjob.run_job(_spec("reduce_scatter", group_size=16 * 1024),
                   RunOptions(steps=2, progress=False), comm) == 0


@pytest.mark.mpi
def test_run_job_fails_when_a_result_is_off(comm, monkeypatch, capsys):
    """One element off by far less than a gradient, on every rank: FAIL naming the param."""
    real = FusedCommBuffer.scale_grads

    def scale_then_break(self):
        real(self)
        slot = self.layout["fc2.weight"] if "fc2.weight" in self.layout else None
        if slot is not None:
            self.grad_storage[slot.offset + 3] += 1e-3

    monkeypatch.setattr(FusedCommBuffer, "scale_grads", scale_then_break)
    code = runjob.run_job(_spec(), RunOptions(steps=1, progress=False), comm)
    out = capsys.readouterr().out
    assert code == 1
    if comm.Get_rank() == 0:
        last = out.strip().splitlines()[-1]
        assert last.startswith("FAIL: 1 param(s) beyond the error bound: fc2.weight"), out


@pytest.mark.mpi(min_size=2)
def test_run_job_fails_when_sync_params_is_skipped(comm, monkeypatch, capsys):
    monkeypatch.setattr(FusedCommBuffer, "sync_params", lambda self, *a, **k: None)
    code = runjob.run_job(_spec("reduce_scatter"), RunOptions(steps=1, progress=False), comm)
    out = capsys.readouterr().out
    assert code == 1
    if comm.Get_rank() == 0:
        assert "wrong after sync_params" in out.strip().splitlines()[-1]


@pytest.mark.parametrize("act", ["all_reduce", "reduce_scatter"])
def test_mixed_dtype_spec_passes(tmp_path, act):
    """fp32 and bf16 params in one model: two buffers, each fed grads in its own dtype."""
    spec = tmp_path / "mixed.json"
    spec.write_text('{"params": [{"name": "a", "shape": [2], "dtype": "fp32"},'
                    ' {"name": "b", "shape": [5, 3], "dtype": "bf16"}]}')
    out = _passed(mpiexec(3, "run", "--no-progress", "--spec", str(spec), "--act", act))
    assert "float32 grads" in out and "bfloat16 grads" in out


def test_one_rank_says_so_and_how_to_start_more():
    proc = mpiexec(1, "run", "--no-progress", "--steps", "1")
    out = _passed(proc)
    lines = out.strip().splitlines()
    assert lines[-2].startswith("note: this job has 1 rank") and "mpiexec -n N" in lines[-2]
    out = _passed(mpiexec(2, "run", "--no-progress", "--steps", "1"))
    assert "note:" not in out


def test_dtype_takes_what_spec_files_take():
    out = _passed(mpiexec(2, "run", "--no-progress", "--steps", "1", "--dtype", "float64"))
    # float64 params: float64 grads (no fp32 main grad), bound with fp64's unit roundoff
    assert "dtype float64, grad dtype float64" in out and "use_main_grad False" in out
    out = _passed(mpiexec(2, "run", "--no-progress", "--steps", "1", "--dtype", "fp16"))
    assert "dtype float16, grad dtype float32" in out


@pytest.mark.parametrize("average, code", [(False, 2), (True, 0), (None, 0)])
def test_run_refuses_a_spec_that_asks_for_the_sum(tmp_path, average, code):
    doc = {"params": [{"name": "w", "shape": [5, 7], "dtype": "fp32"}], "acc_steps": 1}
    if average is not None:
        doc["average"] = average
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc))
    proc = mpiexec(2, "run", "--no-progress", "--steps", "1", "--spec", str(spec))
    assert proc.returncode == code, proc.stdout + proc.stderr
    if code == 2:
        assert proc.stderr.count(f"{spec}: average: run always averages") == 1, proc.stderr
        assert "PASS" not in proc.stdout and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize("n", [2, 3])
def test_run_acc_steps_beyond_the_bound_exits_2(n):
    res = mpiexec(n, "run", "--acc-steps", "100000000", "--no-progress", timeout=240)
    line = one_line_error(res.stderr, "run")
    assert res.returncode == 2 and "acc_steps 100000000" in line and "at most" in line


@pytest.mark.parametrize("n", [2, 3])
def test_run_with_a_1e12_element_spec_says_how_much_memory(tmp_path, n):
    spec = write_spec(tmp_path / "spec.json", (10 ** 12,), nranks=n)
    res = mpiexec(n, "run", "--spec", spec, "--no-progress", timeout=240)
    line = one_line_error(res.stderr, "run")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "needs about" in line and "per rank" in line and "available" in line


def _run_with_timeout(n: int, value: str):
    return run_job(n, [sys.executable, "-m", "mpifusion", "run", "--steps", "1",
                       "--no-progress"], timeout=240, env={"MPIFUSION_TIMEOUT": value})


@pytest.mark.parametrize("n, value", [(2, "inf"), (3, "inf"), (2, "1e300")])
def test_run_with_an_infinite_timeout_passes(n, value):
    res = _run_with_timeout(n, value)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "OverflowError" not in res.stderr and res.stdout.strip().splitlines()[-1].startswith(
        "PASS")


@pytest.mark.parametrize("n, value", [(2, "nan"), (3, "nan"), (2, "-1"),
                                      (2, "0"), (2, "abc")])
def test_run_with_a_bad_timeout_exits_2_naming_the_variable(n, value):
    res = _run_with_timeout(n, value)
    line = one_line_error(res.stderr, "run")
    assert res.returncode == 2 and "MPIFUSION_TIMEOUT" in line


@pytest.mark.parametrize("n", [2, 3])
def test_run_with_a_bad_timeout_on_one_rank_only_exits_2_everywhere(n):
    """MPMD: the last rank alone has MPIFUSION_TIMEOUT=nan; every rank exits 2, rank 0 prints
    the last rank's error once."""
    cli = [sys.executable, "-m", "mpifusion", "run", "--steps", "1", "--no-progress"]
    res = run_job(n - 1, [*cli, ":", "-n", "1", "env", "MPIFUSION_TIMEOUT=nan", *cli],
                  timeout=240)
    line = one_line_error(res.stderr, "run")
    assert res.returncode == 2 and f"rank {n - 1}: MPIFUSION_TIMEOUT" in line


def test_run_out_of_memory_mid_run_is_one_line(capsys, monkeypatch):
    """Past the estimate checked before building (one rank here: no abort needed)."""
    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(runjob, "run_job", no_memory)
    code, _, err = run_cli(capsys, "run", "--steps", "1", "--no-progress")
    line = one_line_error(err, "run")
    assert code == 2 and "rank 0: out of memory" in line
