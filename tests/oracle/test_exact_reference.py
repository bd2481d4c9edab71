"""The exact reference (``mpifusion.oracle.exact``) against rational arithmetic.

Every expected value is computed here with ``fractions.Fraction`` (exact sums and means)
and a rounding to nearest even written out with Python integers, never by the code under
test: random and adversarial inputs, every grad dtype, means over 3, 5, 6, 7 and 8 ranks.
"""
from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpifusion.oracle import check, error_bound
from mpifusion.oracle.exact import ExactStream, ExactSum, exact_sum

from tests.forge import FUZZ

#: (precision, smallest subnormal exponent, largest exponent) of each grad dtype
FORMAT = {"float64": (53, -1074, 1023), "float32": (24, -149, 127),
          "float16": (11, -24, 15), "bfloat16": (8, -133, 127)}
NUMPY = {"float64": np.float64, "float32": np.float32, "float16": np.float16,
         "bfloat16": ml_dtypes.bfloat16}
INF = math.inf


def rn(value: Fraction, dtype: str) -> float:
    """``value`` rounded to nearest, ties to even, in ``dtype`` (inf past the largest)."""
    p, emin, emax = FORMAT[dtype]
    if value == 0:
        return 0.0
    sign = -1.0 if value < 0 else 1.0
    mag = abs(value)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    if Fraction(2) ** e > mag:
        e -= 1
    if Fraction(2) ** (e + 1) <= mag:
        e += 1
    ulp = max(e - p + 1, emin)            # exponent of the ulp at this magnitude
    scaled = mag / Fraction(2) ** ulp
    kept, rest = divmod(scaled.numerator, scaled.denominator)
    rest = Fraction(rest, scaled.denominator)
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and kept % 2):
        kept += 1
    result = Fraction(kept) * Fraction(2) ** ulp
    largest = (2 - Fraction(2) ** (1 - p)) * Fraction(2) ** emax
    return sign * INF if result > largest else sign * float(result)


def expected(columns: np.ndarray, dtype: str, n: int = 1) -> list:
    """Per column (element): RN(sum of the exact inputs / n)."""
    values = np.asarray(columns, dtype=np.float64)
    return [rn(sum((Fraction(float(v)) for v in values[:, i]), Fraction(0)) / n, dtype)
            for i in range(values.shape[1])]


def same(got: np.ndarray, want: list) -> bool:
    """Equal as numbers (the sign of a zero is checked separately)."""
    return all(g == w or (math.isnan(g) and math.isnan(w)) for g, w in zip(got, want))


def terms_of(values, dtype: str) -> list:
    """Rows of ``values`` as arrays of ``dtype`` (each value must be one of ``dtype``)."""
    rows = []
    for row in values:
        arr = np.asarray(row, dtype=np.float64)
        cast = arr.astype(NUMPY[dtype])
        assert np.array_equal(cast.astype(np.float64), arr, equal_nan=True), row
        rows.append(cast)
    return rows


@pytest.mark.parametrize("dtype", list(FORMAT))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 8])
def test_random_sums_and_means_are_exactly_rounded(dtype, n):
    rng = np.random.default_rng(hash((dtype, n)) % 2 ** 32)
    span = {"float64": 60, "float32": 40, "float16": 6, "bfloat16": 40}[dtype]
    nterms = 8
    x = rng.standard_normal((nterms, 400)) * 2.0 ** rng.integers(-span, span, (nterms, 400))
    x = x.astype(NUMPY[dtype]).astype(np.float64)
    x[:, :20] = x[:, :20] * 2.0 ** -100 if dtype != "float16" else x[:, :20] * 2.0 ** -14
    x[1, 20:40] = -x[0, 20:40]                      # cancellation down to the other terms
    if dtype == "float64":
        x[:, 40:60] = rng.standard_normal((nterms, 20)) * 2.0 ** rng.integers(-1070, 1000,
                                                                              (nterms, 20))
    x = x.astype(NUMPY[dtype]).astype(np.float64)
    got = exact_sum(terms_of(x, dtype), dtype, n).value
    assert same(got, expected(x, dtype, n))


@pytest.mark.parametrize("dtype", list(FORMAT))
@pytest.mark.parametrize("n", [1, 3, 8])
def test_the_streamed_sum_is_exactly_rounded_and_gathers_only_what_it_needs(dtype, n):
    """:class:`ExactStream` (one term in memory at a time, as ``check`` reads them): the
    elements whose exponents are far apart take the integer path from the terms given
    again, and every value is the exactly rounded one (in the grad dtype itself)."""
    rng = np.random.default_rng(hash(("stream", dtype, n)) % 2 ** 32)
    span = {"float64": 60, "float32": 40, "float16": 6, "bfloat16": 40}[dtype]
    x = rng.standard_normal((8, 300)) * 2.0 ** rng.integers(-span, span, (8, 300))
    x[1, :30] = -x[0, :30]                          # cancellation down to the other terms
    x[:, 30:40] = 0.0
    x = x.astype(NUMPY[dtype]).astype(np.float64)
    terms = terms_of(x, dtype)
    stream = ExactStream(x.shape[1], chunk=64)
    for t in terms:
        stream.add(t)
    asked = []

    def again():
        asked.append(1)
        return iter(terms)

    res = stream.result(dtype, n, again, native=True)
    assert res.value.dtype == (np.float64 if dtype == "float64" else NUMPY[dtype])
    assert same(res.value.astype(np.float64), expected(x, dtype, n))
    whole = exact_sum(terms, dtype, n)
    assert np.array_equal(res.inexact, whole.inexact)
    assert np.array_equal(res.absolute, whole.absolute)
    # some elements failed the fast path's proof (fp64: all; fp16's range is too narrow)
    assert bool(asked) == (dtype != "float16")
    if asked:  # without the terms again, those elements cannot be summed: refused
        lacking = ExactStream(x.shape[1])
        for t in terms:
            lacking.add(t)
        with pytest.raises(ValueError, match="terms again"):
            lacking.result(dtype, n)


@pytest.mark.parametrize("dtype, values, n, want", [
    # exponents 200 apart: the small term survives only in an exact sum
    ("float64", [2.0 ** 100, 2.0 ** -100, -(2.0 ** 100)], 1, 2.0 ** -100),
    ("float32", [2.0 ** 100, 2.0 ** -100, -(2.0 ** 100)], 1, 2.0 ** -100),
    ("float64", [1e308, 1e308, -1e308], 1, 1e308),     # float64 partial sums overflow
    # ties to even, and a tie broken by a term far below it
    ("float32", [1.0, 2.0 ** -24], 1, 1.0),
    ("float32", [1.0 + 2.0 ** -23, 2.0 ** -24], 1, 1.0 + 2.0 ** -22),
    ("float32", [1.0, 2.0 ** -24, 2.0 ** -80], 1, 1.0 + 2.0 ** -23),
    ("float32", [1.0, 2.0 ** -24, -(2.0 ** -80)], 1, 1.0),
    ("bfloat16", [1.0, 2.0 ** -8, 2.0 ** -60], 1, 1.0 + 2.0 ** -7),
    ("float16", [1.0, 2.0 ** -11, 2.0 ** -24], 1, 1.0 + 2.0 ** -10),
    # subnormal results
    ("float32", [2.0 ** -126, -(2.0 ** -126) + 2.0 ** -149], 1, 2.0 ** -149),
    ("float32", [2.0 ** -149, 2.0 ** -149, 2.0 ** -149], 2, 2.0 ** -148),   # 1.5 -> 2
    ("float32", [2.0 ** -149], 2, 0.0),                                    # 0.5 -> 0
    ("float32", [2.0 ** -149, 2.0 ** -149, 2.0 ** -149], 6, 0.0),          # 0.5 -> 0
    ("float32", [2.0 ** -149, 2.0 ** -149, 2.0 ** -149, 2.0 ** -149], 7, 2.0 ** -149),
    ("float16", [2.0 ** -24, 2.0 ** -24, 2.0 ** -24], 2, 2.0 ** -23),
    ("bfloat16", [2.0 ** -133, 2.0 ** -133], 4, 0.0),
    ("float64", [5e-324, 5e-324, 5e-324], 2, 1e-323),
    # overflow of the exact result (inputs finite)
    ("float32", [2.0 ** 127, 2.0 ** 127], 1, INF),
    ("float16", [65504.0, 15.0], 1, 65504.0),          # below the half-ulp past max
    ("float16", [65504.0, 16.0], 1, INF),              # on it: the tie goes to inf (IEEE)
    ("float16", [65504.0, 16.0, -(2.0 ** -24)], 1, 65504.0),  # just below it
    ("float16", [65504.0, 65504.0], 2, 65504.0),       # the mean is back in range
    # means over 3, 5, 6, 7 ranks: one rounding of the exact quotient
    ("float32", [1.0, 0.0, 0.0], 3, float(np.float32(1 / 3))),
    ("float32", [1.0, 1.0, 0.0, 0.0, 0.0], 5, float(np.float32(2 / 5))),
    ("float64", [1.0] + [0.0] * 6, 7, 1 / 7),
])
def test_adversarial_cases(dtype, values, n, want):
    x = np.array(values, dtype=np.float64).reshape(-1, 1)
    assert expected(x, dtype, n) == [want]           # the test's own arithmetic agrees
    res = exact_sum(terms_of(x, dtype), dtype, n)
    assert res.value[0] == want
    # uncheckable: the result overflows, or sum|x| (the bound's scale) overflows float64
    assert bool(res.overflow[0]) == (math.isinf(want) or sum(map(abs, values)) == INF)


def test_float64_reference_double_rounds_where_the_exact_one_does_not():
    """A float64 sum cast to fp32 is rounded twice: 1 + 2^-24 + 2^-60 is above the fp32
    midpoint, but its float64 sum lands on the midpoint and ties to even, down to 1."""
    x = [np.float32(1.0), np.float32(2.0 ** -24), np.float32(2.0 ** -60)]
    old = float(np.float32(sum(float(v) for v in x)))
    want = rn(sum(Fraction(float(v)) for v in x), "float32")
    assert want == 1.0 + 2.0 ** -23 and old == 1.0
    assert exact_sum([np.array([v]) for v in x], "float32").value[0] == want


def test_float64_sum_then_division_double_rounds_where_the_exact_mean_does_not():
    """The float64 mean over 3 ranks, cast to fp32, against the exactly rounded mean: they
    differ for some inputs; the exact one matches Fraction every time."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 20000)) * 2.0 ** rng.integers(-30, 30, (3, 20000)))
    x = x.astype(np.float32).astype(np.float64)
    old = (x.sum(axis=0) / 3).astype(np.float32).astype(np.float64)
    got = exact_sum(list(x.astype(np.float32)), "float32", 3).value
    differ = np.flatnonzero(old != got)
    assert differ.size  # the float64 reference is wrong somewhere
    for i in differ[:50]:
        assert got[i] == expected(x[:, i:i + 1], "float32", 3)[0]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_signed_zeros(dtype):
    """An exact 0 is +0 unless every term is -0 (IEEE addition); a nonzero sum that rounds
    to 0 keeps its sign."""
    cases = [([1.0, -1.0], False), ([-0.0, -0.0], True), ([-0.0, 0.0], False),
             ([0.0], False), ([-0.0], True)]
    for values, negative in cases:
        r = exact_sum([np.array([v], dtype=NUMPY[dtype]) for v in values], dtype, 3).value[0]
        assert r == 0 and bool(np.signbit(r)) == negative, (values, r)
    tiny = {"float32": -(2.0 ** -149), "float64": -5e-324}[dtype]
    r = exact_sum([np.array([tiny], dtype=NUMPY[dtype])], dtype, 4).value[0]
    assert r == 0 and np.signbit(r)


@pytest.mark.parametrize("values, want", [
    ([1.0, math.nan], math.nan), ([INF, -INF], math.nan), ([INF, 1.0], INF),
    ([-INF, 5.0, -INF], -INF), ([1e308, 1e308, -INF], -INF),  # no NaN from inf - inf
])
def test_special_values_follow_ieee(values, want):
    res = exact_sum([np.array([v]) for v in values], "float64", 3)
    got = res.value[0]
    assert (math.isnan(got) and math.isnan(want)) or got == want
    assert not res.overflow[0] and res.absolute[0] == INF and res.error[0] == 0


def test_error_is_zero_exactly_where_the_reference_is_exact():
    x = [np.array([1.0, 1.0, 2.0 ** -149], np.float32), np.array([2.0, 2.0 ** -24, 0.0],
                                                                   np.float32)]
    res = exact_sum(x, "float32")
    assert res.error[0] == 0.0 and res.error[2] == 0.0
    assert res.error[1] >= 2.0 ** -24                     # half an ulp of 1, at least
    mean = exact_sum(x, "float32", 3)
    assert mean.error[0] == 0.0                           # 3 / 3 = 1 exactly
    assert mean.error[1] > 0


def test_chunks_and_the_integer_path_agree_with_the_fast_path():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 5000)).astype(np.float32)
    x[2, ::7] = np.float32(2.0 ** -140)                    # exponents far apart: integer path
    a = exact_sum(list(x), "float32", 5, chunk=333).value
    b = exact_sum(list(x), "float32", 5).value
    want = expected(x[:, :300], "float32", 5)
    assert np.array_equal(a, b) and same(a[:300], want)


def test_exact_sum_class_and_bad_input():
    acc = ExactSum()
    acc.add(np.array([[1.0, 2.0]], np.float32))
    acc.add(np.array([[2.0 ** -30, 3.0]], np.float32))
    assert acc.rounded("float32").shape == (1, 2)
    assert acc.rounded("float32")[0, 1] == 5.0
    with pytest.raises(ValueError, match="shape"):
        acc.add(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="float"):
        acc.add(np.zeros((1, 2), np.int32))
    with pytest.raises(ValueError, match="at least one"):
        ExactSum().result("float32")
    with pytest.raises(ValueError, match="divisor"):
        exact_sum([np.zeros(2)], "float64", 0)


finite64 = st.floats(allow_nan=False, allow_infinity=False, width=64)


@FUZZ
@given(values=st.lists(st.one_of(finite64, st.sampled_from([0.0, -0.0, 2.0 ** -1074,
                                                            1.7e308, -1.7e308])),
                       min_size=1, max_size=9),
       n=st.sampled_from([1, 2, 3, 5, 6, 7, 8]),
       dtype=st.sampled_from(["float64", "float32", "float16", "bfloat16"]))
def test_any_float64_terms_are_exactly_rounded(values, n, dtype):
    """Any finite float64 terms, rounded once into any grad dtype."""
    res = exact_sum([np.array([v]) for v in values], dtype, n)
    want = rn(sum((Fraction(v) for v in values), Fraction(0)) / n, dtype)
    assert res.value[0] == want
    assert bool(res.overflow[0]) == (math.isinf(want) or not math.isfinite(res.absolute[0]))


@FUZZ
@given(data=st.data(), dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
       n=st.sampled_from([1, 3, 4, 7]))
def test_any_values_of_the_grad_dtype_are_exactly_rounded(data, dtype, n):
    """Terms of the grad dtype itself (the fast path's domain), bit patterns drawn at
    random so that subnormals, huge values and ties come up."""
    bits = {"float32": (np.uint32, 32), "float16": (np.uint16, 16),
            "bfloat16": (np.uint16, 16)}[dtype]
    raw = data.draw(st.lists(st.lists(st.integers(0, 2 ** bits[1] - 1), min_size=4,
                                      max_size=4), min_size=1, max_size=6))
    x = np.array(raw, dtype=bits[0]).view(NUMPY[dtype])
    x = np.where(np.isfinite(x.astype(np.float64)), x, 0).astype(NUMPY[dtype])
    res = exact_sum(list(x), dtype, n)
    assert same(res.value, expected(x.astype(np.float64), dtype, n))


def test_check_compares_against_the_exactly_rounded_mean():
    """End to end: a correct fp32 mean over 3 ranks passes, the bound carries no float64
    roundings of the reference, and a result one ulp further off than the bound fails."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    spec = {"params": [{"name": "w", "shape": [1000], "dtype": "float32"}],
            "act": "all_reduce", "nranks": 3, "acc_steps": 1, "average": True}
    good = ((xs[0] + xs[1] + xs[2]) * np.float32(1 / 3)).astype(np.float32)
    report = check(spec, [{"in/w/0": x, "out/w": good} for x in xs])
    assert report.ok, report
    assert "u(float64)" not in report.bounds["float32"]
    bad = good.copy()
    bad[3] = np.float32(bad[3] + 1e-3)
    assert not check(spec, [{"in/w/0": x, "out/w": bad} for x in xs]).ok


def test_one_rank_sum_is_bit_exact_with_the_exact_reference():
    """Nothing rounds: the reference equals the input and its error is 0, so the bound
    is 0 and one ulp off fails."""
    x = np.array([0.1, 0.2, 1e-40], np.float32)
    res = exact_sum([x], "float32")
    bound = error_bound(res.absolute, grad_dtype="float32", nranks=1, acc_steps=1,
                        average=False, ref_error=res.error)
    assert np.all(bound == 0)
