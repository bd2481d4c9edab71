"""``mpifusion check`` and the error bound it states."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from mpifusion.oracle import error_bound

from tests.helpers import run_cli

SHAPES = {"w0": (10, 3), "w1": (257,), "w2": (3, 31, 2)}


def _write_spec(tmp_path, **fields) -> str:
    spec = {"params": [{"name": n, "shape": list(s), "dtype": "float32"}
                       for n, s in SHAPES.items()], **fields}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return str(path)


def _inputs(nranks: int, acc: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [{n: [rng.standard_normal(s).astype(np.float32) for _ in range(acc)]
             for n, s in SHAPES.items()} for _ in range(nranks)]


def _fp32_sum(grads: list, acc: int, average: bool) -> dict:
    """What a correct fp32 implementation holds: per-rank fp32 accumulation, fp32 sum."""
    out = {}
    for n in SHAPES:
        local = [sum(g[n][1:], start=g[n][0].copy()) for g in grads]
        total = local[0].copy()
        for x in local[1:]:
            total += x
        if average:
            total *= np.float32(1.0 / len(grads))
        out[n] = total
    return out


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
    reduced = _fp32_sum(grads, 2, average=True)
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
    summed = _fp32_sum(grads, 2, average=False)
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
    reduced = _fp32_sum(grads, 1, average=False)
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
    mean = _fp32_sum(grads, 1, average=True)
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
    reduced = _fp32_sum(grads, 1, average=True)
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


# ------------------------------------------------------------------ the bound itself


def test_bound_is_zero_when_nothing_rounds():
    b = error_bound(np.array([1.0, 5.0]), grad_dtype="float32", nranks=1, acc_steps=1,
                    average=False)
    assert np.all(b == 0)


@pytest.mark.parametrize("nranks, acc", [(2, 1), (8, 4), (64, 1)])
def test_fp32_summation_stays_within_bound_in_any_order(nranks, acc):
    rng = np.random.default_rng(nranks * 10 + acc)
    x = (rng.standard_normal((nranks, acc, 4000)) * 10.0 ** rng.integers(-3, 3, (1, 1, 4000)))
    x = x.astype(np.float32)
    exact = x.astype(np.float64).sum(axis=(0, 1)) / nranks
    bound = error_bound(np.abs(x.astype(np.float64)).sum(axis=(0, 1)), grad_dtype="float32",
                        nranks=nranks, acc_steps=acc, average=True)
    for order in (np.arange(nranks), np.arange(nranks)[::-1], rng.permutation(nranks)):
        local = [sum(x[r, 1:], start=x[r, 0].copy()) for r in order]
        total = local[0].copy()
        for v in local[1:]:
            total += v
        total *= np.float32(1.0 / nranks)
        assert np.all(np.abs(total.astype(np.float64) - exact) <= bound)


def test_bf16_cross_rank_sum_breaks_the_fp32_reduce_bound():
    """Summing across ranks in bf16 (instead of fp32, rounding once) is caught."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 20000)).astype(ml_dtypes.bfloat16)
    exact = x.astype(np.float64).sum(axis=0)
    bound = error_bound(np.abs(x.astype(np.float64)).sum(axis=0), grad_dtype="bfloat16",
                        nranks=8, acc_steps=1, average=False)
    good = x.astype(np.float32).sum(axis=0).astype(ml_dtypes.bfloat16)
    assert np.all(np.abs(good.astype(np.float64) - exact) <= bound)
    naive = x[0].copy()
    for v in x[1:]:
        naive = (naive + v).astype(ml_dtypes.bfloat16)
    assert np.any(np.abs(naive.astype(np.float64) - exact) > bound)
