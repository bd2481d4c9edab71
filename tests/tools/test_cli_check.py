"""``mpifusion check``: good dumps pass, wrong ones fail naming the param, and hostile input
(Inf/NaN where the reference differs, forged dumps, FIFOs and devices as rank files) is one
line on stderr and exit 2, never a pass, a hang or a memory blow-up (also under mpiexec)."""
from __future__ import annotations

import json
import os
import sys

import ml_dtypes
import numpy as np
import pytest

from tests.forge import hostile_dumps, write_spec
from tests.helpers import mpiexec, one_line_error, run_cli, run_cmd
from tests.reference import fp32_reduction, rank_grads

SHAPES = {"w0": (10, 3), "w1": (257,), "w2": (3, 31, 2)}


def _write_spec(tmp_path, **fields) -> str:
    spec = {"params": [{"name": n, "shape": list(s), "dtype": "float32"}
                       for n, s in SHAPES.items()], **fields}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return str(path)


def _inputs(nranks: int, acc: int, seed: int = 0) -> list:
    return rank_grads(nranks, acc, SHAPES, seed)


def _dump(folder, grads: list, outs: list) -> str:
    folder.mkdir(exist_ok=True)
    for r, (g, o) in enumerate(zip(grads, outs)):
        arrays = {f"in/{n}/{k}": x for n, xs in g.items() for k, x in enumerate(xs)}
        arrays.update({f"out/{n}": x for n, x in o.items()})
        np.savez(folder / f"rank{r}.npz", **arrays)
    return str(folder)


@pytest.fixture
def good(tmp_path):
    grads = _inputs(3, 2)
    reduced = fp32_reduction(grads, average=True)
    folder = _dump(tmp_path / "dump", grads, [reduced] * 3)
    spec = _write_spec(tmp_path, act="all_reduce", nranks=3, acc_steps=2, average=True)
    return spec, folder, grads, reduced


def test_good_all_reduce_dump_passes(capsys, good):
    spec, folder, _, _ = good
    code, out, _ = run_cli(capsys, "check", "--spec", spec, folder)
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("PASS: 3 params")
    assert "theta = 1*u(float32) + 4*u(float32)" in out


def test_corrupted_output_fails_naming_the_param(capsys, good, tmp_path):
    spec, folder, grads, reduced = good
    outs = [dict(reduced) for _ in range(3)]
    bad = outs[2]["w1"].copy()
    bad[100] = np.nextafter(np.nextafter(bad[100], np.inf), np.inf)  # a few ulps off
    bad[100] += np.float32(1e-4)
    outs[2]["w1"] = bad
    folder = _dump(tmp_path / "bad", grads, outs)
    code, out, _ = run_cli(capsys, "check", "--spec", spec, folder)
    assert code == 1
    last = out.strip().splitlines()[-1]
    assert last.startswith("FAIL: 1 param(s)") and "w1" in last
    code, out, _ = run_cli(capsys, "check", "--spec", spec, folder, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["verdict"] == "FAIL"
    row = {p["name"]: p for p in doc["params"]}
    assert not row["w1"]["ok"] and row["w1"]["worst_rank"] == 2
    assert row["w0"]["ok"] and row["w2"]["ok"]


def test_sum_not_mean_and_nan_fail(capsys, good, tmp_path):
    spec, folder, grads, reduced = good
    summed = fp32_reduction(grads, average=False)
    folder = _dump(tmp_path / "sum", grads, [summed] * 3)
    assert run_cli(capsys, "check", "--spec", spec, folder)[0] == 1
    spec_sum = _write_spec(tmp_path, act="all_reduce", nranks=3, acc_steps=2, average=False)
    assert run_cli(capsys, "check", "--spec", spec_sum, folder)[0] == 0
    nan = {**reduced, "w0": np.full(SHAPES["w0"], np.nan, np.float32)}
    folder = _dump(tmp_path / "nan", grads, [nan] * 3)
    code, out, _ = run_cli(capsys, "check", "--spec", spec, folder)
    assert code == 1 and "NONFINITE" in out


def test_reduce_checks_the_root_and_dumped_non_roots(capsys, tmp_path):
    """The root holds the reduced grads; a non-root rank that dumps its buffer must hold its
    own grads (Paddle's rule: local values, scaled by 1/n with the rest when averaging)."""
    grads = _inputs(2, 1, seed=3)
    reduced = fp32_reduction(grads, average=False)
    junk = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    spec = _write_spec(tmp_path, act="reduce", nranks=2, dst=1, acc_steps=1)
    omitted = _dump(tmp_path / "omitted", grads, [{}, reduced])
    assert run_cli(capsys, "check", "--spec", spec, omitted)[0] == 0
    own = {n: grads[0][n][0].copy() for n in SHAPES}
    assert run_cli(capsys, "check", "--spec", spec, _dump(tmp_path / "own", grads,
                                                           [own, reduced]))[0] == 0
    folder = _dump(tmp_path / "dump", grads, [junk, reduced])
    code, out, _ = run_cli(capsys, "check", "--spec", spec, folder)
    assert code == 1 and all(n in out.strip().splitlines()[-1] for n in SHAPES)
    spec0 = _write_spec(tmp_path, act="reduce", nranks=2, dst=0, acc_steps=1)
    assert run_cli(capsys, "check", "--spec", spec0, folder)[0] == 1
    # averaged: the root holds the mean, the non-root its own grads times 1/2 ...
    spec_avg = _write_spec(tmp_path, act="reduce", nranks=2, dst=1, acc_steps=1, average=True)
    mean = fp32_reduction(grads, average=True)
    half = {n: (x * np.float32(0.5)).astype(np.float32) for n, x in own.items()}
    avg = _dump(tmp_path / "avg", grads, [half, mean])
    assert run_cli(capsys, "check", "--spec", spec_avg, avg)[0] == 0
    # ... unless the collective averaged (use_reduce_avg): then unscaled
    assert run_cli(capsys, "check", "--spec", spec_avg, avg, "--reduce-avg")[0] == 1
    unscaled = _dump(tmp_path / "unscaled", grads, [own, mean])
    assert run_cli(capsys, "check", "--spec", spec_avg, unscaled, "--reduce-avg")[0] == 0


def test_reduce_scatter_slices(capsys, tmp_path):
    """Each rank holds its 1-D slice of the padded buffer (fp32: 64 x nranks padding)."""
    n = 2
    grads = _inputs(n, 1, seed=5)
    reduced = fp32_reduction(grads, average=True)
    # independent layout: every param padded to a multiple of 128 elements, in order
    flat, offset = [], 0
    for name, shape in SHAPES.items():
        numel = int(np.prod(shape))
        padded = -(-numel // 128) * 128
        flat.append(np.concatenate([reduced[name].ravel(), np.zeros(padded - numel, np.float32)]))
        offset += padded
    full = np.concatenate(flat)
    shard = full.size // n
    outs = []
    for r in range(n):
        o, start = {}, 0
        for name, shape in SHAPES.items():
            padded = -(-int(np.prod(shape)) // 128) * 128
            b, e = max(start, r * shard), min(start + padded, (r + 1) * shard)
            if b < e:
                o[name] = full[b:e]
            start += padded
        outs.append(o)
    folder = _dump(tmp_path / "rs", grads, outs)
    spec = _write_spec(tmp_path, act="reduce_scatter", nranks=n, average=True)
    code, out, _ = run_cli(capsys, "check", "--spec", spec, folder)
    assert code == 0, out
    outs[1] = {k: v.copy() for k, v in outs[1].items()}
    last = list(outs[1])[-1]
    outs[1][last][-1] = 1.0  # padding must stay zero
    folder = _dump(tmp_path / "rs_bad", grads, outs)
    code, out, _ = run_cli(capsys, "check", "--spec", spec, folder)
    assert code == 1 and last in out.strip().splitlines()[-1]


def test_bf16_inputs_stored_as_raw_bits(capsys, tmp_path):
    """numpy's .npz cannot name bfloat16; raw 2-byte data is read with the spec's dtype."""
    rng = np.random.default_rng(1)
    x = [rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16) for _ in range(2)]
    total = (x[0].astype(np.float32) + x[1].astype(np.float32)).astype(ml_dtypes.bfloat16)
    folder = tmp_path / "bf"
    folder.mkdir()
    for r in range(2):
        np.savez(folder / f"rank{r}.npz", **{"in/w/0": x[r].view(np.uint16),
                                              "out/w": total.view(np.uint16)})
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"params": [{"name": "w", "shape": [4, 4], "dtype": "bf16"}],
                                "act": "all_reduce", "nranks": 2}))
    code, out, _ = run_cli(capsys, "check", "--spec", str(spec), str(folder))
    assert code == 0, out


def test_bad_inputs_exit_2(capsys, good, tmp_path):
    spec, folder, grads, reduced = good
    # missing rank file
    missing = _dump(tmp_path / "two", grads[:2], [reduced] * 2)
    code, out, err = run_cli(capsys, "check", "--spec", spec, missing)
    assert code == 2 and "rank2.npz: missing" in err and len(err.strip().splitlines()) == 1
    # a shape that disagrees with the spec
    wrong = [dict(reduced) for _ in range(3)]
    wrong[1]["w0"] = wrong[1]["w0"].T.copy()
    folder2 = _dump(tmp_path / "shape", grads, wrong)
    code, _, err = run_cli(capsys, "check", "--spec", spec, folder2)
    assert code == 2 and "rank1.npz: out/w0: shape [3, 10] disagrees" in err
    # a missing input of a micro-step
    short = [{n: xs[:1] for n, xs in g.items()} for g in grads]
    folder3 = _dump(tmp_path / "short", short, [reduced] * 3)
    code, _, err = run_cli(capsys, "check", "--spec", spec, folder3)
    assert code == 2 and "rank0.npz: in/w0/1: missing" in err
    # malformed and inconsistent specs
    bad = tmp_path / "bad.json"
    bad.write_text('{"params": [], "act": "all_reduce"}')
    code, _, err = run_cli(capsys, "check", "--spec", str(bad), folder)
    assert code == 2 and f"{bad}: params" in err
    bad.write_text(json.dumps({"params": [{"name": "w0", "shape": [10, 3], "dtype": "fp32"}],
                               "act": "reduce", "nranks": 2, "dst": 5}))
    code, _, err = run_cli(capsys, "check", "--spec", str(bad), folder)
    assert code == 2 and f"{bad}: dst" in err
    nonr = _write_spec(tmp_path, act="all_reduce")
    code, _, err = run_cli(capsys, "check", "--spec", nonr, folder)
    assert code == 2 and "nranks" in err


# ----------------------------------------------------------------------- Inf/NaN and hostile dumps


INF = np.inf


def _inf_dump(folder, ins, outs, dtype):
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
    folder = _inf_dump(tmp_path / "dump", ins, outs, dtype)
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
    folder = _inf_dump(tmp_path / "d", ins, out, "float32")
    spec = write_spec(tmp_path / "spec.json", (4,), nranks=2)
    code, text, _ = run_cli(capsys, "check", "--spec", spec, folder)
    assert code == 0, text
    ins = [[INF, 1.0], [-INF, 1.0]]
    folder = _inf_dump(tmp_path / "nan", ins, [[np.nan, 2.0]] * 2, "float32")
    spec = write_spec(tmp_path / "spec2.json", (2,), nranks=2)
    assert run_cli(capsys, "check", "--spec", spec, folder)[0] == 0
    folder = _inf_dump(tmp_path / "sign", ins, [[INF, 2.0]] * 2, "float32")
    assert run_cli(capsys, "check", "--spec", spec, folder)[0] == 1


def test_check_hostile_dumps_exit_2_with_one_line(capsys, tmp_path):
    spec = write_spec(tmp_path / "spec.json", (3,), nranks=1)
    for label, (folder, words) in hostile_dumps(tmp_path / "dumps").items():
        code, _, err = run_cli(capsys, "check", "--spec", spec, folder)
        line = one_line_error(err, "check")
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
    line = one_line_error(res.stderr, "check")
    assert res.returncode == 2 and "not a regular file" in line


@pytest.mark.parametrize("n", [2, 3])
def test_check_under_mpiexec_with_a_fifo_exits_2_once(tmp_path, n):
    folder = tmp_path / "dump"
    folder.mkdir()
    os.mkfifo(folder / "rank0.npz")
    spec = write_spec(tmp_path / "spec.json", (3,), nranks=1)
    res = mpiexec(n, "check", "--spec", spec, str(folder), timeout=120)
    line = one_line_error(res.stderr, "check")
    assert res.returncode == 2 and "not a regular file" in line


# ---------------------------------------------------------------- WEAK: not a PASS anywhere
def _same_data_dump(tmp_path, steps: bool = False) -> tuple:
    """Every rank fed the same inputs to a mean, and the "reducer" did nothing: each rank
    holds its own gradient, which is also the mean. Nothing could see a missing reduction."""
    grads = _inputs(1, 2) * 3
    own = fp32_reduction(grads[:1], average=True)  # rank 0's own accumulated gradient
    spec = _write_spec(tmp_path, act="all_reduce", nranks=3, acc_steps=2, average=True)
    if steps:
        for k in range(2):
            _dump(tmp_path / "dump", [], [])  # the parent
            _dump(tmp_path / "dump" / f"step{k}", grads, [own] * 3)
    else:
        _dump(tmp_path / "dump", grads, [own] * 3)
    return spec, str(tmp_path / "dump")


WEAK_WHY = "every rank fed the same inputs (w0, w1, w2)"
WEAK_TAIL = (f"but {WEAK_WHY}: these inputs cannot reveal a missing reduction (a reducer "
             f"that does nothing passes too); give each rank its own data (a per-rank seed, "
             f"or mpifusion.oracle.exact_inputs), or accept it: --allow-weak (allow_weak=True)")


@pytest.mark.parametrize("steps", [False, True], ids=["one_step", "step_dirs"])
def test_a_weak_check_is_not_a_pass(capsys, tmp_path, steps):
    """Exit 4 (neither 0 nor the documented 1 and 2), WEAK and its reason on the last line
    and in --json; --allow-weak accepts it (exit 0) and still says it was weak."""
    from mpifusion.tools.cli import EXIT_WEAK

    spec, folder = _same_data_dump(tmp_path, steps)
    code, out, err = run_cli(capsys, "check", "--spec", spec, folder)
    assert (code, err) == (EXIT_WEAK, "") and EXIT_WEAK == 4, out + err
    lines = out.strip().splitlines()
    what = "2 step(s), 3 params each within the bound" if steps else "3 params within the bound"
    assert lines[-1] == f"WEAK: {what}, {WEAK_TAIL}"
    assert not any(line.startswith("PASS") for line in lines), out
    if steps:  # each step's line says it briefly; the fix once, on the last line
        assert lines[1] == f"step 0: WEAK ({WEAK_WHY}): 3 params within the bound", out

    code, out, _ = run_cli(capsys, "check", "--json", "--spec", spec, folder)
    doc = json.loads(out)
    assert code == EXIT_WEAK and doc["verdict"] == "WEAK" and len(doc["weak"]) == 3
    if steps:
        assert [s["verdict"] for s in doc["steps"]] == ["WEAK", "WEAK"]

    code, out, _ = run_cli(capsys, "check", "--allow-weak", "--spec", spec, folder)
    assert code == 0, out
    assert out.strip().splitlines()[-1] == f"PASS (weak, allowed: {WEAK_WHY}): {what}"
    code, out, _ = run_cli(capsys, "check", "--allow-weak", "--json", "--spec", spec, folder)
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "PASS" and len(doc["weak"]) == 3


def test_a_mismatch_on_weak_inputs_is_a_fail(capsys, tmp_path):
    spec, folder = _same_data_dump(tmp_path)
    with np.load(os.path.join(folder, "rank1.npz")) as z:
        arrays = dict(z)
    arrays["out/w1"] = arrays["out/w1"] * 2
    np.savez(os.path.join(folder, "rank1.npz"), **arrays)
    for extra in ([], ["--allow-weak"]):
        code, out, _ = run_cli(capsys, "check", *extra, "--spec", spec, folder)
        assert code == 1 and out.strip().splitlines()[-1].startswith("FAIL: "), out


def test_exact_says_bit_exact_on_the_last_line(capsys, tmp_path):
    """--exact: the last line says bit-exact, as each step's line does (one step and
    step{k}/ folders)."""
    from mpifusion.oracle import exact_inputs, exact_sum

    doc = {"params": [{"name": n, "shape": list(s), "dtype": "float32"}
                      for n, s in SHAPES.items()],
           "act": "all_reduce", "nranks": 2, "acc_steps": 2, "average": True}
    (tmp_path / "spec.json").write_text(json.dumps(doc))
    spec = str(tmp_path / "spec.json")
    grads = [{n: [exact_inputs(doc, r, k)[n] for k in range(2)] for n in SHAPES}
             for r in range(2)]
    outs = {n: (exact_sum(doc, n)[0] / 2).astype(np.float32) for n in SHAPES}
    _dump(tmp_path / "one", grads, [outs] * 2)
    for k in range(2):
        _dump(tmp_path / "steps", [], [])
        _dump(tmp_path / "steps" / f"step{k}", grads, [outs] * 2)
    code, out, _ = run_cli(capsys, "check", "--exact", "--spec", spec, str(tmp_path / "one"))
    assert code == 0 and out.strip().splitlines()[-1] == "PASS: 3 params bit-exact (exact inputs)"
    code, out, _ = run_cli(capsys, "check", "--exact", "--spec", spec, str(tmp_path / "steps"))
    lines = out.strip().splitlines()
    assert code == 0, out
    assert lines[1] == "step 0: PASS: 3 params bit-exact (exact inputs)", out
    assert lines[-1] == "PASS: 2 step(s), 3 params each bit-exact (exact inputs)"
    code, out, _ = run_cli(capsys, "check", "--spec", spec, str(tmp_path / "steps"))
    assert out.strip().splitlines()[-1] == "PASS: 2 step(s), 3 params each within the bound"
