"""Bit-exact inputs (``mpifusion.oracle.exact_inputs``) and ``check(..., exact=True)``.

What is proven, independently of the module's own reasoning:

* every order of summation, in the grad dtype itself (numpy, ml_dtypes), gives the exact
  (Fraction) sum: all orders for small N, random orders and trees for large N, pre-scaled
  power-of-two means too;
* the values are deterministic in (spec, rank, micro-step, seed) and process-independent;
* a correct reduction in random orders and segmentations passes ``exact=True`` bit for bit
  at 1, 2, 3, 4 and 8 ranks and 1-4 micro-steps, for every act and dtype;
* one dropped, doubled or misplaced contribution, or a sum in a narrower dtype, fails,
  however small; inputs that are not exact are refused in one line;
* ``decode_contributions`` names the contributions an output holds; the README's snippet
  and ``mpifusion check --exact`` work as documented.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import sys
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mpifusion.errors import OptionError, OracleMismatch
from mpifusion.oracle import (assert_matches_reference, check, decode_contributions,
                              decode_inputs, exact_inputs, exact_pattern, exact_sum,
                              exact_tolerance)
from mpifusion.oracle.dumps import DumpError
from mpifusion.spec import Spec

from tests.helpers import one_line_error, run_cli, run_cmd

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"w": (13, 7), "b": (5,), "s": (1,)}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
          "float64": np.float64}
#: (param dtype, use_main_grad) -> the dtype sums run in
CASES = [("float32", False), ("float16", False), ("bfloat16", False), ("float64", False),
         ("float16", True), ("bfloat16", True)]


def _spec(nranks, acc=1, dtype="float32", main_grad=False, act="all_reduce", average=True,
          shapes=SHAPES, **kw):
    dst = 0 if act == "reduce" else -1
    return Spec.from_dict({"params": [{"name": n, "shape": list(s), "dtype": dtype}
                                      for n, s in shapes.items()],
                           "nranks": nranks, "acc_steps": acc, "use_main_grad": main_grad,
                           "act": act, "average": average, "dst": dst, **kw})


def _grad_np(dtype, main_grad):
    return np.float32 if main_grad and dtype in ("float16", "bfloat16") else DTYPES[dtype]


def _all_inputs(spec, seed=0):
    """``x[r][k][name]`` for every rank and micro-step."""
    return [[exact_inputs(spec, r, k, seed=seed) for k in range(spec.acc_steps)]
            for r in range(spec.nranks)]


def _fraction_sum(values):
    return sum((Fraction(float(v)) for v in values), Fraction(0))


def _sum_in(dtype, terms, order):
    """Sequential sum of ``terms`` in ``order``, every addition rounded to ``dtype``."""
    acc = np.zeros_like(terms[0], dtype=dtype)
    for i in order:
        acc = (acc + terms[i].astype(dtype)).astype(dtype)
    return acc


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("dtype, main_grad", CASES)
def test_every_order_of_a_small_sum_is_exact(dtype, main_grad):
    """N = 5 contributions (5 ranks x 1, and 2 x 2 + ... as 5 x 1): all 120 orders, each
    addition rounded to the grad dtype, equal the exact Fraction sum."""
    spec = _spec(5, 1, dtype, main_grad)
    g = _grad_np(dtype, main_grad)
    xs = [x[0] for x in _all_inputs(spec, seed=7)]
    for name in SHAPES:
        terms = [x[name].reshape(-1) for x in xs]
        exact = [_fraction_sum(t[i] for t in terms) for i in range(terms[0].size)]
        for order in itertools.permutations(range(len(terms))):
            got = _sum_in(g, terms, order)
            assert [Fraction(float(v)) for v in got] == exact, (name, order)


@pytest.mark.parametrize("dtype, main_grad", CASES)
def test_random_orders_and_trees_of_a_large_sum_are_exact(dtype, main_grad):
    """N = 8 ranks x 4 micro-steps = 32 > the slots of every dtype: random orders and random
    pairwise trees, in the grad dtype, and pre-scaled by 1/8 first, are all exact."""
    spec = _spec(8, 4, dtype, main_grad)
    g = _grad_np(dtype, main_grad)
    xs = [x for per_rank in _all_inputs(spec, seed=3) for x in per_rank]
    rng = np.random.default_rng(0)
    for name in SHAPES:
        terms = [x[name].reshape(-1) for x in xs]
        exact = np.array([float(_fraction_sum(t[i] for t in terms))
                          for i in range(terms[0].size)])
        assert np.array_equal(exact_sum(spec, name, seed=3)[0].reshape(-1), exact)
        for _ in range(10):
            assert np.array_equal(_sum_in(g, terms, rng.permutation(len(terms))), exact)
            level = [t.astype(g) for t in rng.permutation(np.array(terms, dtype=object))]
            while len(level) > 1:  # a random tree: pair neighbours, in a shuffled list
                rng.shuffle(level)
                level = [(a + b).astype(g) for a, b in zip(level[::2], level[1::2])] + (
                    [level[-1]] if len(level) % 2 else [])
            assert np.array_equal(level[0].astype(np.float64), exact)
            scaled = [(t.astype(g) * g(1 / 8)).astype(g) for t in terms]
            assert np.array_equal(_sum_in(g, scaled, rng.permutation(len(terms))), exact / 8)


@pytest.mark.parametrize("dtype, main_grad", CASES)
def test_the_values_leave_headroom_and_stay_normal(dtype, main_grad):
    """Per element: sum|x| is below 2**(p-2) of its smallest quantum (twice the sum, or one
    contribution doubled, is still exact), and every value / 64 is a normal number of the
    param dtype, twice the sum a value of the grad dtype; every element holds at least one
    contribution."""
    p = {"float32": 24, "float16": 11, "bfloat16": 8, "float64": 53}[
        "float32" if main_grad else dtype]
    spec = _spec(4, 3, dtype, main_grad)
    tiny = float(np.finfo(DTYPES[dtype]).tiny) if dtype != "bfloat16" else 2.0 ** -126
    huge = float(ml_dtypes.finfo(_grad_np(dtype, main_grad)).max)
    xs = [x for per_rank in _all_inputs(spec) for x in per_rank]
    for name in SHAPES:
        vals = np.stack([x[name].astype(np.float64).reshape(-1) for x in xs])
        nonzero = vals != 0
        assert nonzero.any(axis=0).all()
        mags = np.abs(vals[nonzero])
        assert (mags / 64 >= tiny).all() and (2 * np.abs(vals).sum(axis=0) <= huge).all()
        assert np.all(np.log2(mags) == np.round(np.log2(mags)))  # powers of two
        q = np.where(nonzero, np.abs(vals), np.inf).min(axis=0)
        assert (np.abs(vals).sum(axis=0) / q < 2.0 ** (p - 2)).all()


def test_every_contribution_appears_in_many_elements():
    """With more contributions than slots (bf16: 6 of N = 24), they rotate: each appears in
    about 6/24 of the elements, and the first ceil(24/6) elements hold every one."""
    spec = _spec(8, 3, "bfloat16", shapes={"w": (400,)})
    pat = exact_pattern(spec, "w")
    held = np.stack([pat.contribution(j) != 0 for j in range(24)])
    assert (held.sum(axis=0) == 6).all()
    assert held[:, :4].any(axis=1).all()
    assert held.sum(axis=1).min() >= 400 * 6 / 24 - 1


def test_deterministic_and_the_same_in_another_process():
    spec = _spec(3, 2, "bfloat16")
    digest = hashlib.sha256()
    for r in range(3):
        for k in range(2):
            a, b = exact_inputs(spec, r, k, seed=11), exact_inputs(spec.to_dict(), r, k, seed=11)
            for name in SHAPES:
                assert a[name].dtype == DTYPES["bfloat16"] and a[name].shape == SHAPES[name]
                assert a[name].tobytes() == b[name].tobytes()
                digest.update(a[name].tobytes())
    code = ("import hashlib, json, sys\nfrom mpifusion.oracle import exact_inputs\n"
            "spec = json.loads(sys.argv[1])\nd = hashlib.sha256()\n"
            "for r in range(3):\n  for k in range(2):\n"
            "    x = exact_inputs(spec, r, k, seed=11)\n"
            "    for n in ('w', 'b', 's'): d.update(x[n].tobytes())\nprint(d.hexdigest())\n")
    proc = run_cmd([sys.executable, "-c", code, json.dumps(spec.to_dict())], timeout=120,
                   env={"PYTHONHASHSEED": "123"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == digest.hexdigest()
    other = exact_inputs(spec, 0, 0, seed=12)
    assert not np.array_equal(other["w"], exact_inputs(spec, 0, 0, seed=11)["w"])


@pytest.mark.parametrize("kwargs, needle", [
    (dict(rank=3, step=0), "rank: expected an int >= 0 and < 3, got 3"),
    (dict(rank=0, step=2), "step (the micro-step): expected an int >= 0 and < 2, got 2"),
    (dict(rank=0, step=0, seed=-1), "seed: expected an int >= 0, got -1"),
    (dict(rank=True, step=0), "rank: expected an int, got True"),
])
def test_bad_arguments_are_refused_in_one_line(kwargs, needle):
    with pytest.raises(OptionError) as exc:
        exact_inputs(_spec(3, 2), **kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_spec_without_nranks_is_refused():
    spec = Spec.from_dict({"params": [{"name": "w", "shape": [3], "dtype": "float32"}]})
    with pytest.raises(OptionError, match="nranks: exact inputs need the spec's nranks"):
        exact_inputs(spec, 0, 0)


# --------------------------------------------------------------------------- tolerance


def test_the_tolerance_is_zero_for_sums_and_power_of_two_means():
    mean, absolute = np.array([3.0, -0.5, 1e-3]), np.array([5.0, 2.0, 1e-3])
    for n in (1, 2, 4, 8, 64):
        for average in (False, True):
            for dtype in ("float32", "float16", "bfloat16"):
                tol = exact_tolerance(mean, absolute, grad_dtype=dtype, nranks=n,
                                      average=average)
                assert not tol.any()
    assert not exact_tolerance(mean, absolute, grad_dtype="float16", nranks=3,
                               average=False).any()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_one_rounding_of_the_mean_is_below_the_smallest_contribution(dtype, n):
    """After the collective (reduce_avg / scale_after_comm) a non-power-of-two mean may be
    off by its roundings only, and that stays below the smallest contribution / n of every
    element: a dropped one still fails."""
    spec = _spec(n, 2, dtype)
    for name in SHAPES:
        total, absolute = exact_sum(spec, name)
        mean = total / n
        tol = exact_tolerance(mean, absolute, grad_dtype=dtype, nranks=n, average=True,
                              prescaled=False)
        smallest = np.min(np.where(np.stack([exact_inputs(spec, r, k)[name] != 0
                                             for r in range(n) for k in range(2)]),
                                   np.abs(np.stack([exact_inputs(spec, r, k)[name].astype(
                                       np.float64) for r in range(n) for k in range(2)])),
                                   np.inf), axis=0)
        assert (tol > 0).all() and (tol < smallest / n).all()


# --------------------------------------------------------------------------- check


def _reduce(terms, g, rng, nseg):
    """A sum of the flat ``terms`` (one per rank) in the grad dtype: the elements cut into
    ``nseg`` random segments, each summed in its own random rank order."""
    n = terms[0].size
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(nseg, n) - 1, replace=False)) if n > 1 else []
    out = np.empty(n, dtype=g)
    for lo, hi in zip([0, *cuts], [*cuts, n]):
        out[lo:hi] = _sum_in(g, [t[lo:hi] for t in terms], rng.permutation(len(terms)))
    return out


@np.errstate(over="ignore", invalid="ignore")  # a narrower dtype may overflow: a FAIL
def simulate(spec, xs, *, seed=0, prescale=None, reduce_avg=False, narrow=None, edit=None):
    """What a correct implementation dumps (one dict per rank), reducing in random orders
    and segments; ``prescale`` (default: random) scales each rank by fl(1/n) before the
    sum; ``narrow`` sums in that dtype instead; ``edit(name, rank, k, x)`` alters an input
    the implementation uses (not the one it dumps)."""
    rng = np.random.default_rng(seed)
    n, acc = spec.nranks, spec.acc_steps
    recs = [dict() for _ in range(n)]
    for p in spec.fused_params():
        g = _grad_np(p.dtype, spec.use_main_grad)
        s = narrow or g
        local = []
        for r in range(n):
            acc_r = np.zeros(p.numel, dtype=s)
            for k in rng.permutation(acc):
                x = xs[r][k][p.name].reshape(-1)
                recs[r][f"in/{p.name}/{k}"] = xs[r][k][p.name]
                x = edit(p.name, r, k, x.copy()) if edit else x
                acc_r = (acc_r + x.astype(s)).astype(s)
            local.append(acc_r)
        pre = rng.random() < 0.5 if prescale is None else prescale
        pre = pre and spec.average and not reduce_avg
        inv = s(1.0 / n)
        terms = [(t * inv).astype(s) if pre else t for t in local]
        total = _reduce(terms, s, rng, int(rng.integers(1, 5)))
        if spec.average and not pre:
            w = np.float64 if s == np.float64 else np.float32  # mpifusion's rule
            total = (total.astype(w) * w(1.0 / n)).astype(s)
        total = total.astype(g)
        for r in range(n):
            if spec.act == "all_reduce" or (spec.act == "reduce" and r == spec.dst):
                recs[r][f"out/{p.name}"] = total.reshape(p.shape)
            elif spec.act == "reduce":
                own = (local[r] * inv).astype(s) if spec.average and not reduce_avg else local[r]
                recs[r][f"out/{p.name}"] = own.astype(g).reshape(p.shape)
            else:
                lo, hi = r * p.numel // n, (r + 1) * p.numel // n
                recs[r][f"out/{p.name}"] = total[lo:hi]
                recs[r][f"range/{p.name}"] = np.array([lo, hi])
    return recs


def _passes(spec, recs, **kw):
    report = check(spec, recs, exact=True, **kw)
    assert report.ok, str(report)
    return report


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("acc", [1, 2, 3, 4])
def test_a_correct_reduction_passes_bit_exactly(nranks, acc):
    rng = np.random.default_rng(nranks * 10 + acc)
    for act in ("all_reduce", "reduce", "reduce_scatter"):
        dtype, main_grad = CASES[int(rng.integers(len(CASES)))]
        for average in (True, False):
            spec = _spec(nranks, acc, dtype, main_grad, act=act, average=average)
            seed = int(rng.integers(1000))
            xs = _all_inputs(spec, seed=seed)
            for reduce_avg in (False, True):
                report = _passes(spec, simulate(spec, xs, seed=seed, reduce_avg=reduce_avg),
                                 reduce_avg=reduce_avg)
                exact = not average or nranks in (1, 2, 4, 8)
                assert report.to_json()["exact"] is True
                if exact:
                    assert report.lines()[-1].startswith("PASS: 3 params bit-exact")
                    assert all(s.max_abs == 0 for s in report.stats)


def _smallest_element(spec, xs, name, rank, k):
    """An element where contribution (rank, k) is the smallest nonzero one (the hardest
    to see), and its value there."""
    own = np.abs(xs[rank][k][name].astype(np.float64).reshape(-1))
    every = np.stack([np.abs(x[name].astype(np.float64).reshape(-1))
                      for per in xs for x in per])
    smallest = np.where(every > 0, every, np.inf).min(axis=0)
    hits = np.flatnonzero((own > 0) & (own == smallest) & ((every > 0).sum(axis=0) > 1))
    return int(hits[0])


@pytest.mark.parametrize("dtype, main_grad", [("float32", False), ("float16", False),
                                              ("bfloat16", False), ("bfloat16", True)])
@pytest.mark.parametrize("fault", ["drop", "double", "move"])
@pytest.mark.parametrize("nranks, average, reduce_avg", [(4, True, False), (3, False, False),
                                                          (3, True, True)])
def test_one_wrong_contribution_fails_however_small(dtype, main_grad, fault, nranks, average,
                                                    reduce_avg):
    """The smallest contribution of some element, dropped, doubled, or taken from the next
    element: exact=True fails (a non-power-of-two mean after the collective too)."""
    spec = _spec(nranks, 2, dtype, main_grad, average=average)
    xs = _all_inputs(spec, seed=5)
    i = _smallest_element(spec, xs, "w", 1, 1)

    def edit(name, r, k, x):
        if (name, r, k) == ("w", 1, 1):
            x[i] = {"drop": 0, "double": 2 * x[i], "move": x[(i + 1) % x.size]}[fault]
        return x

    recs = simulate(spec, xs, seed=1, edit=edit, prescale=False, reduce_avg=reduce_avg)
    report = check(spec, recs, exact=True, reduce_avg=reduce_avg)
    assert not report.ok and report.failing == ["w"], str(report)
    assert report.stats[0].first_failure.startswith(f"element {i}")


def test_assert_matches_reference_takes_exact():
    spec = _spec(2, 2, "float16", act="reduce_scatter")
    xs = _all_inputs(spec, seed=9)
    report = assert_matches_reference(spec, simulate(spec, xs, seed=9), exact=True)
    assert report.exact and report.ok

    def edit(name, r, k, x):
        return x * 0 if (name, r, k) == ("b", 0, 1) else x

    with pytest.raises(OracleMismatch, match="param.* do not match the reference"):
        assert_matches_reference(spec, simulate(spec, xs, seed=9, edit=edit), exact=True)


def test_a_moved_output_element_fails():
    spec = _spec(2, 1, "float16", average=False)
    recs = simulate(spec, _all_inputs(spec))
    for r in range(2):
        out = recs[r]["out/w"].reshape(-1).copy()
        out[[3, 4]] = out[[4, 3]]
        recs[r]["out/w"] = out.reshape(SHAPES["w"])
    assert check(spec, recs, exact=True).failing == ["w"]


@pytest.mark.parametrize("dtype, narrow", [("float32", ml_dtypes.bfloat16),
                                           ("float32", np.float16), ("float64", np.float32)])
def test_a_sum_in_a_narrower_dtype_fails(dtype, narrow):
    spec = _spec(4, 2, dtype)
    recs = simulate(spec, _all_inputs(spec), narrow=narrow, prescale=False)
    report = check(spec, recs, exact=True)
    assert not report.ok


def test_a_failure_the_bound_lets_pass_is_caught():
    """What exact inputs are for: bf16 grads at 8 ranks x 4 micro-steps, the smallest
    contribution of an element dropped; the rounding bound of random inputs cannot see it."""
    spec = _spec(8, 4, "bfloat16", average=False)
    xs = _all_inputs(spec, seed=2)
    i = _smallest_element(spec, xs, "w", 5, 2)

    def edit(name, r, k, x):
        if (name, r, k) == ("w", 5, 2):
            x[i] = 0
        return x

    recs = simulate(spec, xs, edit=edit)
    assert check(spec, recs).ok
    assert check(spec, recs, exact=True).failing == ["w"]


@pytest.mark.parametrize("nranks, acc", [(2, 1), (3, 3), (4, 2)])
def test_inputs_that_are_not_exact_are_refused_in_one_line(nranks, acc):
    spec = _spec(nranks, acc, "float32")
    xs = _all_inputs(spec)
    rng = np.random.default_rng(0)
    xs[nranks - 1][acc - 1]["b"] = rng.standard_normal(SHAPES["b"]).astype(np.float32)
    recs = simulate(spec, xs)
    with pytest.raises(DumpError) as exc:
        check(spec, recs, exact=True)
    msg = str(exc.value)
    assert "\n" not in msg
    assert re.match(r"exact=True needs inputs whose partial sums are exact in float32 "
                    r"\(mpifusion.oracle.exact_inputs\): param b, element \d, rank ", msg), msg
    assert f"in/b/{acc - 1}" in msg
    assert check(spec, recs).ok  # the rounding bound still takes them


def test_a_mean_that_would_underflow_is_refused():
    spec = _spec(4, 1, "float16", shapes={"w": (2,)})
    xs = [[{"w": np.array([2.0 ** -24, 1.0], np.float16)}] for _ in range(4)]
    recs = simulate(spec, xs, prescale=False)
    with pytest.raises(DumpError, match=r"element 0, rank 0 \(in memory\): in/w/0: its finest "
                       r"bit 5.96046e-08 divided by 4 ranks is below float16's smallest value"):
        check(spec, recs, exact=True)


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("dtype, nranks, acc, average", [("bfloat16", 4, 3, True),
                                                          ("float32", 3, 2, False),
                                                          ("float16", 2, 4, True)])
def test_decoding_names_the_contributions_an_output_holds(dtype, nranks, acc, average):
    spec = _spec(nranks, acc, dtype, average=average)
    xs = _all_inputs(spec, seed=4)
    recs = simulate(spec, xs, seed=4, prescale=False)
    divisor = nranks if average else 1
    full = decode_contributions(spec, "w", recs[0]["out/w"], seed=4, divisor=divisor)
    assert full.valid.all() and np.array_equal(full.present, full.held)
    assert not full.missing().size
    j = 1 * acc + (acc - 1)  # rank 1, last micro-step

    def edit(name, r, k, x):
        return x * 0 if (name, r, k) == ("w", 1, acc - 1) else x

    broken = simulate(spec, xs, seed=4, edit=edit, prescale=False)
    got = decode_contributions(spec, "w", broken[0]["out/w"], seed=4, divisor=divisor)
    assert got.valid.all()
    assert np.array_equal(got.present, got.held & (np.arange(nranks * acc) != j))
    rows = np.flatnonzero(got.held[:, j])
    assert got.missing().tolist() == [[i, j] for i in rows]
    assert f"missing rank 1 k {acc - 1}" in got.describe(int(rows[0]))
    shard = decode_contributions(spec, "w", broken[0]["out/w"].reshape(-1)[10:20], seed=4,
                                 divisor=divisor, offset=10)
    assert np.array_equal(shard.present, got.present[10:20])


def test_the_inputs_alone_decode_an_output():
    """decode_inputs needs no seed: the dumped in/ arrays give the same answer."""
    spec = _spec(3, 2, "bfloat16", average=False)
    xs = _all_inputs(spec, seed=8)

    def edit(name, r, k, x):
        return x * 0 if (name, r, k) == ("w", 2, 0) else x

    recs = simulate(spec, xs, seed=8, edit=edit)
    terms = np.stack([recs[r][f"in/w/{k}"].astype(np.float64).reshape(-1)
                      for r in range(3) for k in range(2)])
    got = decode_inputs(terms, recs[0]["out/w"], acc_steps=2)
    want = decode_contributions(spec, "w", recs[0]["out/w"], seed=8)
    assert np.array_equal(got.present, want.present) and np.array_equal(got.held, want.held)
    assert got.valid.all() and sorted({int(j) for _, j in got.missing()}) == [4]
    rng = np.random.default_rng(0)
    noisy = decode_inputs(rng.standard_normal(terms.shape), recs[0]["out/w"])
    assert not noisy.valid.any()


def test_a_doubled_contribution_does_not_decode_as_a_subset():
    spec = _spec(2, 2, "float32", average=False)
    total, _ = exact_sum(spec, "w")
    x = exact_inputs(spec, 1, 0)["w"].astype(np.float64).reshape(-1)
    got = decode_contributions(spec, "w", total.reshape(-1) + x)
    assert not got.valid[x != 0].any() or not got.present[x != 0].all()
    assert "not a sum of its contributions" in got.describe(int(np.flatnonzero(~got.valid)[0]))


# --------------------------------------------------------------------------- interfaces


def _write(tmp_path, spec, recs):
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    for r, rec in enumerate(recs):
        np.savez(tmp_path / f"rank{r}.npz", **{k: (v.view(np.uint16) if v.dtype ==
                                                   DTYPES["bfloat16"] else v)
                                               for k, v in rec.items()})


def test_cli_check_exact(tmp_path, capsys):
    spec = _spec(4, 2, "bfloat16", act="reduce_scatter")
    xs = _all_inputs(spec)
    _write(tmp_path, spec, simulate(spec, xs))
    code, out, _ = run_cli(capsys, "check", "--exact", "--spec", str(tmp_path / "spec.json"),
                           str(tmp_path))
    assert code == 0, out
    assert "exact inputs: bit-exact (mean over 4 rank(s), a power of two)" in out
    assert out.strip().splitlines()[-1] == "PASS: 3 params bit-exact (exact inputs)"
    code, out, _ = run_cli(capsys, "check", "--exact", "--json", "--spec",
                           str(tmp_path / "spec.json"), str(tmp_path))
    assert code == 0 and json.loads(out)["exact"] is True

    def edit(name, r, k, x):
        return x * 0 if (name, r, k) == ("w", 3, 1) else x

    _write(tmp_path, spec, simulate(spec, xs, edit=edit))
    code, out, _ = run_cli(capsys, "check", "--exact", "--spec", str(tmp_path / "spec.json"),
                           str(tmp_path))
    assert code == 1 and "FAIL" in out.strip().splitlines()[-1]
    rng = np.random.default_rng(0)
    xs[0][0]["w"] = rng.standard_normal(SHAPES["w"]).astype(ml_dtypes.bfloat16)
    _write(tmp_path, spec, simulate(spec, xs))
    code, _, err = run_cli(capsys, "check", "--exact", "--spec", str(tmp_path / "spec.json"),
                           str(tmp_path))
    assert code == 2
    assert "exact=True needs inputs whose partial sums are exact in bfloat16" in \
        one_line_error(err, "check")


def test_the_readme_snippet_runs(tmp_path):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## The oracle"):]
    section = section[:section.index("\n## ", 5)]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 12
    script = tmp_path / "peer_test.py"
    script.write_text(code, encoding="utf-8")
    proc = run_cmd([sys.executable, str(script)], timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASS: ")
    assert "bit-exact" in proc.stdout
