"""Steps, weak checks and the ranks a failure names (no framework, no MPI: dumps built in
numpy, as a reducer under test would leave them).

* ``Recorder.step(k)`` + ``save`` write ``step{k}/rank{r}.npz``; ``check``, ``check_steps``
  and ``mpifusion check`` check every step and name the failing one, and say when its output
  holds an earlier step's result (an accumulator not zeroed, a stale buffer);
* a PASS on inputs that cannot reveal a missing reduction fails ``assert_matches_reference``
  and the fixture with one line unless ``allow_weak``; a coarse bound warns;
* the per-param line says every rank whose result is wrong, apart from the worst one.
"""
from __future__ import annotations

import json
import re
import sys
import textwrap
import warnings

import ml_dtypes
import numpy as np
import pytest

from mpifusion.capture import CaptureError, Recorder
from mpifusion.errors import OracleMismatch, OracleWarning, WeakCheckError
from mpifusion.oracle import StepsReport, assert_matches_reference, check, check_steps
from mpifusion.oracle.dumps import DumpError
from mpifusion.tools.cli import EXIT_WEAK
from tests.helpers import run_cli, run_cmd

SHAPES = {"w": (3, 5), "b": (5,)}
NRANKS, ACC = 2, 2


def local_grads(rng, nranks=NRANKS, acc=ACC) -> list:
    """grads[rank][micro-step][name], float32, each rank its own."""
    return [[{n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
             for _ in range(acc)] for _ in range(nranks)]


def mean(grads, name) -> np.ndarray:
    return sum(g[name].astype(np.float64) for rank in grads for g in rank) / len(grads)


def save_run(tmp_path, steps: int, output, seed: int = 0) -> dict:
    """Record ``steps`` steps of 2 ranks into ``tmp_path`` (step{k}/rank{r}.npz) as
    ``cap.step(k)`` and ``cap.save`` do; ``output(k, name, means)`` is what every rank held
    (``means[j][name]``: step j's correct result). Returns the spec."""
    rng = np.random.default_rng(seed)
    caps = [Recorder(r, NRANKS) for r in range(NRANKS)]
    for cap in caps:
        for n, s in SHAPES.items():
            cap.declare(n, s, "float32")
    means = []
    for k in range(steps):
        grads = local_grads(rng)
        means.append({n: mean(grads, n) for n in SHAPES})
        for r, cap in enumerate(caps):
            assert cap.step(k) is cap
            for g in grads[r]:
                for n in SHAPES:
                    cap.add_input(n, g[n])
            for n in SHAPES:
                cap.set_output(n, np.asarray(output(k, n, means), np.float32))
            path = cap.save(str(tmp_path))
            assert path == str(tmp_path / f"step{k}" / f"rank{r}.npz")
    return caps[0].spec("all_reduce", average=True)


def test_step_starts_over_and_save_writes_a_step_folder(tmp_path):
    cap = Recorder(0, 1)
    cap.declare("w", (2,), "float32")
    cap.add_input("w", np.ones(2, np.float32))
    cap.set_output("w", np.ones(2, np.float32))
    assert cap.save(str(tmp_path)) == str(tmp_path / "rank0.npz")  # no step: as before
    cap.step(3)
    assert cap.acc_steps == 0 and cap.to_dict() == {}  # forgotten; the param stays declared
    cap.add_input("w", np.ones(2, np.float32))
    cap.set_output("w", np.ones(2, np.float32))
    assert cap.save(str(tmp_path)) == str(tmp_path / "step3" / "rank0.npz")
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(CaptureError, match=r"rank 0: step: expected an int >= 0"):
            cap.step(bad)


def test_correct_steps_pass(tmp_path):
    spec = save_run(tmp_path, 3, lambda k, n, m: m[k][n])
    report = check(spec, str(tmp_path))
    assert isinstance(report, StepsReport) and report.ok and not report.diagnoses
    assert [k for k, _ in report.steps] == [0, 1, 2]
    assert str(report).splitlines()[-1] == "PASS: 3 step(s), 2 params each within the bound"
    assert_matches_reference(spec, str(tmp_path))


def test_an_accumulator_not_zeroed_is_named_stale_at_step_1(tmp_path):
    """The grads are never zeroed: step k holds the results of steps 0..k summed. Before,
    step 1 showed an unexplained excess; now step 0 passes, step 1 is named, with why."""
    spec = save_run(tmp_path, 3, lambda k, n, m: sum(m[j][n] for j in range(k + 1)))
    report = check_steps(spec, str(tmp_path))
    assert report.failing_steps == [1, 2] and report.failing == ["w", "b"]
    assert [(d.step, d.name, d.kind, d.since) for d in report.diagnoses] == [
        (1, "w", "accumulated", 0), (1, "b", "accumulated", 0),
        (2, "w", "accumulated", 0), (2, "b", "accumulated", 0)]
    lines = str(report).splitlines()
    assert lines[1] == "step 0: PASS: 2 params within the bound"
    assert lines[2] == "step 1: FAIL: 2 param(s) beyond the bound: w, b"
    assert lines[3].startswith("step 1: w: stale: holds step 1's result plus step 0's (a "
                               "gradient accumulator not zeroed between steps"), lines[3]
    assert any(ln.startswith("step 2: w: stale: holds the sum of the results of steps 0 .. 2")
               for ln in lines), lines
    assert "--- step 1 ---" in lines  # the first failing step's full report follows
    assert lines[-1] == "FAIL: step 1 of 3: w, b (also failing: step 2)"
    with pytest.raises(OracleMismatch, match=r"^oracle: step 1 does not match the reference "
                       r"\(also failing: step 2\): w \(err/bound .*; stale: holds step 1's "
                       r"result plus step 0's") as exc:
        assert_matches_reference(spec, str(tmp_path))
    assert exc.value.params == ["w", "b"] and exc.value.ranks == [0, 1]
    doc = report.to_json()
    assert doc["verdict"] == "FAIL" and doc["failing_steps"] == [1, 2]
    assert doc["diagnoses"][0] == {"step": 1, "name": "w", "kind": "accumulated", "since": 0,
                                   "text": lines[3]}
    assert [s["step"] for s in doc["steps"]] == [0, 1, 2]


def test_a_buffer_not_updated_holds_the_previous_result(tmp_path):
    spec = save_run(tmp_path, 2, lambda k, n, m: m[0][n] if n == "w" else m[k][n])
    report = check(spec, str(tmp_path))
    assert report.failing_steps == [1] and report.failing == ["w"]
    (d,) = report.diagnoses
    assert (d.step, d.name, d.kind, d.since) == (1, "w", "stale", 0)
    assert str(d) == ("step 1: w: stale: holds step 0's result, not step 1's (the output was "
                      "not updated at step 1)")


def test_an_unrelated_failure_is_not_explained(tmp_path):
    spec = save_run(tmp_path, 2, lambda k, n, m: 2 * m[k][n] if k == 1 else m[k][n])
    report = check(spec, str(tmp_path))
    assert report.failing_steps == [1] and report.diagnoses == []


def test_steps_in_memory_and_bad_steps():
    rng = np.random.default_rng(3)
    steps = {}
    for k in (0, 1):
        grads = local_grads(rng)
        out = {n: mean(grads, n).astype(np.float32) for n in SHAPES}
        steps[k] = [{**{f"in/{n}/{i}": g[n] for i, g in enumerate(rank) for n in SHAPES},
                     **{f"out/{n}": out[n] for n in SHAPES}} for rank in grads]
    spec = {"params": [{"name": n, "shape": list(s), "dtype": "float32"}
                       for n, s in SHAPES.items()],
            "act": "all_reduce", "nranks": 2, "acc_steps": ACC, "average": True}
    assert check_steps(spec, steps).ok
    del steps[1][1]["out/b"]
    with pytest.raises(DumpError, match=r"^step 1: rank 1 \(in memory\): out/b: missing"):
        check_steps(spec, steps)
    with pytest.raises(DumpError, match=r"step key -1: expected an int >= 0"):
        check_steps(spec, {-1: steps[0]})


def test_cli_checks_a_folder_of_steps(tmp_path, capsys):
    spec = save_run(tmp_path, 2, lambda k, n, m: sum(m[j][n] for j in range(k + 1)))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    code, out, _ = run_cli(capsys, "check", "--spec", str(tmp_path / "spec.json"),
                           str(tmp_path))
    assert code == 1 and out.strip().splitlines()[-1] == "FAIL: step 1 of 2: w, b", out
    assert "step 1: b: stale: holds step 1's result plus step 0's" in out
    code, out, _ = run_cli(capsys, "check", "--spec", str(tmp_path / "spec.json"),
                           str(tmp_path), "--json")
    assert code == 1 and json.loads(out)["failing_steps"] == [1]


def same_data(value=None) -> tuple:
    x = np.arange(15, dtype=np.float32).reshape(3, 5) if value is None else value
    spec = {"params": [{"name": "w", "shape": [3, 5], "dtype": "float32"}],
            "act": "all_reduce", "nranks": 2, "acc_steps": 1, "average": True}
    # a reducer that did nothing: each rank holds its own gradient, which is also the mean
    return spec, [{"in/w/0": x.copy(), "out/w": x.copy()} for _ in range(2)]


WEAK_LINE = ("mpifusion oracle: weak check: every rank fed the same inputs (w): these inputs "
             "cannot reveal a missing reduction (a reducer that does nothing passes too); give "
             "each rank its own data (a per-rank seed, e.g. torch.manual_seed(seed + rank), or "
             "mpifusion.oracle.exact_inputs), or pass allow_weak=True")


WEAK_CLI_LINE = ("WEAK: 1 params within the bound, but every rank fed the same inputs (w): these "
                 "inputs cannot reveal a missing reduction (a reducer that does nothing passes "
                 "too); give each rank its own data (a per-rank seed, or "
                 "mpifusion.oracle.exact_inputs), or accept it: --allow-weak (allow_weak=True)")


def test_no_reduction_on_the_same_data_is_a_weak_check(tmp_path, capsys):
    spec, records = same_data()
    report = check(spec, records)
    assert report.ok and report.weak == ["w: every rank fed the same inputs"]
    assert any("every rank fed the same inputs" in n for n in report.notes)  # still a note
    assert report.to_json()["weak"] == ["w: every rank fed the same inputs"]
    with pytest.raises(WeakCheckError) as exc:
        assert_matches_reference(spec, records)
    assert str(exc.value) == WEAK_LINE and isinstance(exc.value, AssertionError)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # accepted, and no warning either
        assert assert_matches_reference(spec, records, allow_weak=True).ok
    for r, rec in enumerate(records):
        np.savez(tmp_path / f"rank{r}.npz", **rec)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    code, out, _ = run_cli(capsys, "check", "--spec", str(tmp_path / "spec.json"),
                           str(tmp_path))
    assert code == EXIT_WEAK == 4  # not a PASS: neither 0, 1 (a mismatch) nor 2 (bad input)
    assert out.strip().splitlines()[-1] == WEAK_CLI_LINE
    code, out, _ = run_cli(capsys, "check", "--spec", str(tmp_path / "spec.json"),
                           str(tmp_path), "--allow-weak")
    assert code == 0
    assert out.strip().splitlines()[-1] == ("PASS (weak, allowed: every rank fed the same "
                                            "inputs (w)): 1 params within the bound")


def test_the_same_inputs_to_a_sum_are_not_weak():
    """A sum shows a missing reduction whatever the inputs: each rank's x is not 2x."""
    spec, records = same_data()
    spec["average"] = False
    report = check(spec, records)
    assert not report.ok and report.weak == []
    for rec in records:
        rec["out/w"] = 2 * rec["in/w/0"]
    assert assert_matches_reference(spec, records).ok


def test_zero_inputs_are_weak_and_a_mismatch_still_fails_first():
    spec, records = same_data(np.zeros((3, 5), np.float32))
    assert check(spec, records).weak == ["w: every input is 0"]
    with pytest.raises(WeakCheckError, match=r"weak check: every input is 0 \(w\)"):
        assert_matches_reference(spec, records)
    records[1]["out/w"] = np.ones((3, 5), np.float32)
    with pytest.raises(OracleMismatch):
        assert_matches_reference(spec, records)


def test_a_bound_coarser_than_one_input_warns():
    rng = np.random.default_rng(1)
    k = 16
    bf16 = ml_dtypes.bfloat16
    x = rng.uniform(0.5, 1, (2, k, 3)).astype(bf16)
    out = (x.astype(np.float64).sum(axis=(0, 1)) / 2).astype(bf16)
    spec = {"params": [{"name": "w", "shape": [3], "dtype": "bfloat16"}],
            "act": "all_reduce", "nranks": 2, "acc_steps": k, "average": True}
    records = [{**{f"in/w/{s}": x[r, s] for s in range(k)}, "out/w": out} for r in range(2)]
    with pytest.warns(OracleWarning, match=r"bfloat16 grads: the bound .* is coarser than one "
                      r"of the 32 inputs .* may pass") as caught:
        report = assert_matches_reference(spec, records)
    assert caught[0].filename == __file__  # pointed at the caller's line
    assert report.coarse and not report.weak


def test_the_param_line_names_every_wrong_rank_apart_from_the_worst():
    """Rank 1 contributed zeros: every rank's result is wrong, rank 0 merely the worst by a
    tie; a bad copy on rank 1 alone is wrong on rank 1 only."""
    rng = np.random.default_rng(5)
    x = [rng.standard_normal(6).astype(np.float32) for _ in range(2)]
    spec = {"params": [{"name": "w", "shape": [6], "dtype": "float32"}],
            "act": "all_reduce", "nranks": 2, "acc_steps": 1, "average": True}
    zeros = (x[0].astype(np.float64) / 2).astype(np.float32)
    report = check(spec, [{"in/w/0": x[r], "out/w": zeros} for r in range(2)])
    assert report.wrong_ranks("w") == [0, 1]
    row = next(ln for ln in report.lines() if ln.startswith("w "))
    assert row.endswith("FAIL: wrong on ranks [0, 1]"), row
    header = next(ln for ln in report.lines() if ln.startswith("param"))
    assert header.split()[-2:] == ["worst", "status"]
    assert report.reasons()["w"].endswith("on ranks [0, 1], worst at rank 0")
    assert report.to_json()["params"][0]["wrong_ranks"] == [0, 1]
    good = ((x[0].astype(np.float64) + x[1]) / 2).astype(np.float32)
    one = check(spec, [{"in/w/0": x[0], "out/w": good}, {"in/w/0": x[1], "out/w": zeros}])
    row = next(ln for ln in one.lines() if ln.startswith("w "))
    assert row.endswith("FAIL: wrong on rank [1]") and one.reasons()["w"].endswith("on rank 1")


def test_fixture_fails_a_weak_check_with_one_line_and_writes_numbered_reports(tmp_path):
    test = tmp_path / "test_user.py"
    test.write_text(textwrap.dedent("""
        import json
        import numpy as np
        import pytest
        X = np.arange(6, dtype=np.float32)
        SPEC = {"params": [{"name": "w", "shape": [6], "dtype": "float32"}],
                "act": "all_reduce", "nranks": 2, "average": True}
        SAME = [{"in/w/0": X.copy(), "out/w": X.copy()} for _ in range(2)]

        def test_weak(mpifusion_oracle):
            mpifusion_oracle(SPEC, SAME)

        def test_weak_allowed(mpifusion_oracle, tmp_path):
            mpifusion_oracle(SPEC, SAME, allow_weak=True)
            mpifusion_oracle(SPEC, SAME, allow_weak=True)
            assert sorted(p.name for p in tmp_path.iterdir()) == [
                "oracle-report-2.json", "oracle-report.json"]
            doc = json.loads((tmp_path / "oracle-report-2.json").read_text())
            assert doc["verdict"] == "PASS" and doc["weak"] == ["w: every rank fed the same inputs"]
    """))
    proc = run_cmd([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                    "mpifusion.oracle.pytest_plugin", "-W", "error", str(test)],
                   timeout=120, cwd=str(tmp_path))
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    # what pytest printed for test_weak: the one line, no traceback
    block = re.search(r"^_+ test_weak _+\n(.*?)^[=_]{5,}", proc.stdout, re.S | re.M).group(1)
    assert block.strip() == WEAK_LINE, block


def test_fixture_raises_oracle_mismatch_that_pytest_raises_can_expect(tmp_path):
    """The fixture raises OracleMismatch (an AssertionError: an unexpected one fails the
    test, shown as the report) and WeakCheckError: ``pytest.raises`` can expect either."""
    test = tmp_path / "test_user.py"
    test.write_text(textwrap.dedent("""
        import numpy as np
        import pytest
        from mpifusion.errors import OracleMismatch, WeakCheckError
        X = np.arange(6, dtype=np.float32)
        SPEC = {"params": [{"name": "w", "shape": [6], "dtype": "float32"}],
                "act": "all_reduce", "nranks": 2, "average": True}
        SUM = [{"in/w/0": X + r, "out/w": 2 * X + 1} for r in range(2)]  # a sum, not the mean
        SAME = [{"in/w/0": X.copy(), "out/w": X.copy()} for _ in range(2)]

        def test_expected_mismatch(mpifusion_oracle):
            with pytest.raises(OracleMismatch) as exc:
                mpifusion_oracle(SPEC, SUM)
            assert isinstance(exc.value, AssertionError)
            assert exc.value.params == ["w"] and exc.value.ranks == [0, 1]
            assert str(exc.value).startswith("mpifusion oracle: FAIL\\n")

        def test_expected_weak(mpifusion_oracle):
            with pytest.raises(WeakCheckError, match="weak check"):
                mpifusion_oracle(SPEC, SAME)

        def test_unexpected_mismatch(mpifusion_oracle):
            mpifusion_oracle(SPEC, SUM)
    """))
    proc = run_cmd([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                    "mpifusion.oracle.pytest_plugin", "-W", "error", str(test)],
                   timeout=120, cwd=str(tmp_path))
    assert "1 failed, 2 passed" in proc.stdout, proc.stdout + proc.stderr
    # the unexpected one: the report, no traceback, as before the fixture raised
    block = re.search(r"^_+ test_unexpected_mismatch _+\n(.*?)^[=_]{5,}", proc.stdout,
                      re.S | re.M).group(1)
    assert block.startswith("mpifusion oracle: FAIL\n"), block
    assert "Traceback" not in block and "raise " not in block, block
    assert block.rstrip().splitlines()[-1].startswith("FAIL: 1 param(s) beyond the bound: w")


def test_fixture_reports_say_weak_unless_allowed(tmp_path):
    """The JSON the fixture writes says WEAK for a weak check it refused, PASS where
    allow_weak accepted it (see the fixture test above)."""
    from mpifusion.oracle.pytest_plugin import mpifusion_oracle

    run = mpifusion_oracle.__wrapped__(tmp_path) if hasattr(mpifusion_oracle, "__wrapped__") \
        else None
    if run is None:
        pytest.skip("this pytest's fixture object does not expose its function")
    spec, records = same_data()
    with pytest.raises(WeakCheckError):
        run(spec, records)
    assert json.loads((tmp_path / "oracle-report.json").read_text())["verdict"] == "WEAK"
    assert run(spec, records, allow_weak=True).ok
    assert json.loads((tmp_path / "oracle-report-2.json").read_text())["verdict"] == "PASS"
    records[1]["out/w"] = records[1]["out/w"] * 2
    with pytest.raises(OracleMismatch):
        run(spec, records)


def test_an_input_below_the_bound_everywhere_is_named_even_if_the_others_are_large():
    """fp32 grads, 3 ranks: the bound is fine on average, but rank 1's gradient is 1e-12 of
    the others', so a result without it passes; the note names rank 1 (and the micro-step,
    when only one of a rank's is hidden), and the fixture's warning says so too."""
    rng = np.random.default_rng(0)
    big = [rng.standard_normal((2, 64)).astype(np.float32) * 1e3 for _ in range(2)]
    tiny = (rng.standard_normal((2, 64)) * 1e-9).astype(np.float32)
    xs = [big[0], tiny, big[1]]  # [rank][micro-step]
    spec = {"params": [{"name": "w", "shape": [64], "dtype": "float32"}],
            "act": "all_reduce", "nranks": 3, "acc_steps": 2, "average": True}

    def records(ranks) -> list:
        out = (sum(xs[r].astype(np.float64).sum(axis=0) for r in ranks) / 3).astype(np.float32)
        return [{"in/w/0": xs[r][0], "in/w/1": xs[r][1], "out/w": out} for r in range(3)]

    report = check(spec, records([0, 2]))  # rank 1 lost, and it passes: the note says why
    assert report.ok
    assert ("note: a lost rank 1 could not be seen here (w: its share of the result is within "
            "the bound on every element): use exact inputs (mpifusion.oracle.exact_inputs, "
            "check --exact)") in report.lines()
    assert report.coarse == ["w: the input of rank 1 is within the bound on every element"]
    with pytest.warns(OracleWarning, match=r"w: the input of rank 1 is within the bound"):
        assert_matches_reference(spec, records([0, 1, 2]))
    xs[1][1] = big[0][1]  # only micro-step 0 of rank 1 is small now
    report = check(spec, records([0, 1, 2]))
    assert report.unseen == {"rank 1 micro-step 0": ["w"]}
    xs[1][0] = big[1][0]  # nothing hidden: no note
    report = check(spec, records([0, 1, 2]))
    assert report.unseen == {} and report.coarse == [] and not report.notes
