"""The oracle's error bound and its rule for Inf/NaN and overflow (``ErrorStats``,
``error_bound``), and the bound against real summation orders.

The non-finite expectations are written out by hand from IEEE arithmetic (inf + 1 = inf,
inf + -inf = NaN), not computed by the code under test.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpifusion.errors import OptionError
from mpifusion.oracle import ErrorStats, error_bound, summed

from tests.forge import FUZZ

INF, NAN = math.inf, math.nan


def _stats(inputs, out, dtype="float32", average=False):
    """ErrorStats of ``out`` against the reference of ``inputs`` (list of 1-D float64)."""
    ref, absolute = summed([np.asarray(x, dtype=np.float64) for x in inputs])
    if average:
        ref = ref / len(inputs)
    bound = error_bound(absolute, grad_dtype=dtype, nranks=len(inputs), acc_steps=1,
                        average=average)
    s = ErrorStats("w")
    s.update(np.asarray(out, dtype=np.float64), ref, bound, rank=0)
    return s


@pytest.mark.parametrize("inputs, out, ok", [
    # the cases: each passed before
    ([[INF, 1.0], [0.0, 1.0]], [0.0, 2.0], False),        # inf in one rank, zero output
    ([[INF, 1.0], [-INF, 1.0]], [0.0, 2.0], False),       # +inf/-inf: reference NaN
    ([[INF, 1.0], [0.0, 1.0]], [1e30, 2.0], False),       # finite where the reference is inf
    # the same class passes: inf + 1 = inf, inf + -inf = NaN, NaN + 1 = NaN
    ([[INF, 1.0], [0.0, 1.0]], [INF, 2.0], True),
    ([[-INF, 1.0], [5.0, 1.0]], [-INF, 2.0], True),
    ([[INF, 1.0], [-INF, 1.0]], [NAN, 2.0], True),
    ([[NAN, 1.0], [0.0, 1.0]], [NAN, 2.0], True),
    # wrong sign, NaN for inf, inf for NaN
    ([[INF, 1.0], [0.0, 1.0]], [-INF, 2.0], False),
    ([[INF, 1.0], [0.0, 1.0]], [NAN, 2.0], False),
    ([[NAN, 1.0], [0.0, 1.0]], [INF, 2.0], False),
    # a non-finite output where the reference is finite
    ([[1.0, 1.0], [1.0, 1.0]], [INF, 2.0], False),
    ([[1.0, 1.0], [1.0, 1.0]], [NAN, 2.0], False),
])
def test_nonfinite_reference_needs_the_same_class(inputs, out, ok):
    s = _stats(inputs, out)
    assert s.ok is ok, s
    if not ok:
        assert s.reason and "Inf/NaN" in s.reason
        assert not (s.max_ratio <= 1.0)


@pytest.mark.parametrize("inputs, out", [
    ([[1e308, 1.0], [1e308, 1.0]], [INF, 2.0]),     # the sum overflows float64
    ([[1e308, 1.0], [1e308, 1.0]], [0.0, 2.0]),
    ([[1e308, 1.0], [-1e308, 1.0]], [0.0, 2.0]),    # the sum is 0, sum|x| overflows
    ([[1e308, 1.0], [-1e308, 1.0]], [5.0, 2.0]),
])
def test_float64_overflow_is_reported_never_an_infinite_bound(inputs, out):
    ref, absolute = summed([np.array(x) for x in inputs])
    bound = error_bound(absolute, grad_dtype="float64", nranks=2, acc_steps=1, average=False)
    assert not np.isinf(bound[0])  # no infinite tolerance for an element that overflowed
    s = _stats(inputs, out, dtype="float64")
    assert not s.ok and s.overflow == 1 and "overflows" in s.reason


def test_beyond_ratio_is_the_finite_elements_own():
    """A NaN output and a finite element off by a known amount: the report names both, and
    the "beyond the bound" ratio is that element's, not the NaN's inf."""
    s = _stats([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [NAN, 2.0, 2.5])
    _, absolute = summed([np.ones(3), np.ones(3)])
    want = 0.5 / float(error_bound(absolute, grad_dtype="float32", nranks=2, acc_steps=1,
                                   average=False)[2])
    assert not s.ok and s.nonfinite == 1 and s.beyond == 1
    assert math.isinf(s.max_ratio) and s.beyond_ratio == pytest.approx(want)
    assert "1 Inf/NaN output(s)" in s.reason and "(worst inf" not in s.reason
    total = ErrorStats("w")
    total.merge(s)
    assert total.beyond_ratio == s.beyond_ratio


def test_average_of_an_overflowing_sum_is_not_passed():
    s = _stats([[1.5e308], [1.5e308]], [1.5e308], dtype="float64", average=True)
    assert not s.ok and s.overflow == 1


def test_nan_ratio_fails_and_merge_keeps_it():
    """A NaN err/bound (max() would drop it) fails, and survives merging across ranks."""
    s = ErrorStats("w")
    s.update(np.array([1.0]), np.array([0.0]), np.array([NAN]), rank=1)
    assert not s.ok
    total = ErrorStats("w")
    good = ErrorStats("w")
    good.update(np.array([1.0]), np.array([1.0]), np.array([0.0]), rank=0)
    total.merge(good)
    total.merge(s)
    assert good.ok and not total.ok and total.worst_rank == 1
    assert total.compared == 2


def test_finite_values_still_follow_the_bound():
    x = np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32)
    exact = x.astype(np.float64).sum(axis=0)
    good = (x[0] + x[1] + x[2]).astype(np.float64)
    assert _stats(list(x), good).ok
    bad = good.copy()
    bad[7] += 1e-3
    s = _stats(list(x), bad)
    assert not s.ok and s.beyond == 1 and "element 7" in s.reason
    assert np.allclose(exact, good, atol=1e-5)


def test_bound_model_refuses_too_many_roundings_by_name():
    from mpifusion.oracle import bound_model

    with pytest.raises(OptionError, match="acc_steps 100000000"):
        bound_model(grad_dtype="float32", nranks=2, acc_steps=100_000_000, average=True)


@FUZZ
@given(data=st.lists(st.tuples(st.floats(-1e6, 1e6), st.floats(-1e6, 1e6),
                               st.sampled_from([0.0, 1e-12, 1e-3, 1.0, 10.0])),
                     min_size=1, max_size=40),
       special=st.sampled_from([None, INF, -INF, NAN]))
def test_error_stats_match_a_plain_reference(data, special):
    """ErrorStats against the rule written out element by element in Python (finite values,
    plus one Inf/NaN reference matched by the same output, which must not change anything)."""
    out = np.array([d[0] for d in data])
    ref = np.array([d[1] for d in data])
    bound = np.array([d[2] for d in data])
    ratios = []
    for o, r, b in data:
        e = abs(o - r)
        ratios.append(e / b if b > 0 else (0.0 if e == 0 else INF))
    if special is not None:
        out, ref, bound = (np.append(out, special), np.append(ref, special),
                           np.append(bound, INF))
    s = ErrorStats("w")
    s.update(out, ref, bound, rank=0)
    assert s.beyond == sum(r > 1.0 for r in ratios)
    assert s.ok == all(r <= 1.0 for r in ratios)
    assert s.max_ratio == max(ratios)
    assert s.max_abs == max(abs(o - r) for o, r, _ in data)
    assert s.nonfinite == s.mismatched == s.overflow == 0
    assert s.nonfinite_ref == (special is not None)


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


# --------------------------------------------------------------------------- exact reference


def test_exact_reference_bound_drops_the_float64_roundings():
    """With the exact reference the model has no n_ref term: a smaller theta, and a formula
    that names the reference's one rounding instead of float64 roundings."""
    from mpifusion.oracle import bound_model

    old = bound_model(grad_dtype="float64", nranks=8, acc_steps=4, average=True)
    new = bound_model(grad_dtype="float64", nranks=8, acc_steps=4, average=True,
                      exact_reference=True)
    assert new.rel < old.rel and new.absolute <= old.absolute
    old = bound_model(grad_dtype="float32", nranks=8, acc_steps=4, average=True)
    new = bound_model(grad_dtype="float32", nranks=8, acc_steps=4, average=True,
                      exact_reference=True)
    assert new.rel < old.rel and new.absolute <= old.absolute
    assert "u(float64)" in old.formula and "u(float64)" not in new.formula
    assert "rounded once" in new.formula


def _exact(x, dtype, n):
    from mpifusion.oracle.exact import exact_sum

    return exact_sum(list(x.reshape(-1, x.shape[-1])), dtype, n)


@pytest.mark.parametrize("nranks, acc", [(2, 1), (3, 2), (7, 1), (8, 4)])
def test_fp32_any_order_is_within_the_exact_bound(nranks, acc):
    """Correct fp32 reductions in several orders, pre-scaled or not, against the exactly
    rounded mean: within c*sum|x|*theta/(1-theta) + eta + d, with d the reference's own
    rounding."""
    rng = np.random.default_rng(nranks * 10 + acc)
    x = (rng.standard_normal((nranks, acc, 4000))
         * 10.0 ** rng.integers(-3, 3, (1, 1, 4000))).astype(np.float32)
    res = _exact(x, "float32", nranks)
    bound = error_bound(res.absolute, grad_dtype="float32", nranks=nranks, acc_steps=acc,
                        average=True, ref_error=res.error)
    for order in (np.arange(nranks), np.arange(nranks)[::-1], rng.permutation(nranks)):
        local = [sum(x[r, 1:], start=x[r, 0].copy()) for r in order]
        total = local[0].copy()
        for v in local[1:]:
            total += v
        after = total * np.float32(1.0 / nranks)
        before = sum((v * np.float32(1.0 / nranks) for v in local[1:]),
                     start=local[0] * np.float32(1.0 / nranks))
        for out in (after, before):
            assert np.all(np.abs(out.astype(np.float64) - res.value) <= bound)


def test_float64_grads_any_order_is_within_the_exact_bound():
    """float64 grads: the implementation's own R - 1 roundings suffice now that the
    reference does not round (values built to round both ways)."""
    rng = np.random.default_rng(7)
    x = np.array([[1.0, 2.0 ** -53, 3 * 2.0 ** -53, -(2.0 ** -52)]]).T
    x = np.concatenate([x, rng.standard_normal((4, 500))], axis=1)
    res = _exact(x, "float64", 1)
    bound = error_bound(res.absolute, grad_dtype="float64", nranks=4, acc_steps=1,
                        average=False, ref_error=res.error)
    import itertools

    for order in itertools.permutations(range(4)):
        out = x[order[0]].copy()
        for r in order[1:]:
            out = out + x[r]
        assert np.all(np.abs(out - res.value) <= bound), order


def test_bf16_cross_rank_sum_breaks_the_exact_bound_too():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 20000)).astype(ml_dtypes.bfloat16)
    res = _exact(x, "bfloat16", 1)
    bound = error_bound(res.absolute, grad_dtype="bfloat16", nranks=8, acc_steps=1,
                        average=False, ref_error=res.error)
    good = x.astype(np.float32).sum(axis=0).astype(ml_dtypes.bfloat16)
    assert np.all(np.abs(good.astype(np.float64) - res.value) <= bound)
    naive = x[0].copy()
    for v in x[1:]:
        naive = (naive + v).astype(ml_dtypes.bfloat16)
    assert np.any(np.abs(naive.astype(np.float64) - res.value) > bound)
