"""``check`` streams: one rank's input of a param in memory at a time, not all of them.

The peak of ``check`` on ``rank{r}.npz`` files is measured with ``tracemalloc`` (numpy
reports its arrays to it) and compared with limits computed here from the sizes: the
issue's limit (every rank's inputs of the param plus a float64 reference) and a bound that
does not grow with the number of ranks. A param whose elements fail the fast path's proof
(exponents far apart) still gets the exactly rounded reference, gathered from the files
again.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from mpifusion.oracle import check
from mpifusion.oracle.exact import ExactStream, exact_sum


def _write(tmp_path, inputs: list, outputs: list) -> str:
    for r, (x, out) in enumerate(zip(inputs, outputs)):
        np.savez(tmp_path / f"rank{r}.npz", **{"in/w/0": x, "out/w": out})
    return str(tmp_path)


def _spec(nranks: int, numel: int, act: str = "all_reduce") -> dict:
    return {"params": [{"name": "w", "shape": [numel], "dtype": "float32"}],
            "act": act, "nranks": nranks, "acc_steps": 1, "average": True,
            **({"dst": 0} if act == "reduce" else {})}


def _peak(fn) -> tuple:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("nranks", [16])
def test_check_of_files_holds_one_input_at_a_time(tmp_path, monkeypatch, nranks):
    """16 ranks of a 256K-element fp32 param: the peak stays within 10 inputs' bytes (the
    running sum and sum|x|, the smallest |x|, the reference, the bound, one input and one
    output), where holding every rank's inputs alone would take 16. The comparison's
    chunk is made small, as it is small next to a large param."""
    import importlib

    check_module = importlib.import_module("mpifusion.oracle.check")

    monkeypatch.setattr(check_module, "_COMPARE_CHUNK", 1 << 14)
    numel = 1 << 18
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(numel, dtype=np.float32) for _ in range(nranks)]
    mean = exact_sum(xs, "float32", nranks).value.astype(np.float32)
    folder = _write(tmp_path, xs, [mean] * nranks)
    one = numel * 4
    xs = mean = None
    report, peak = _peak(lambda: check(_spec(nranks, numel), folder))
    assert report.ok, report.text()
    limit = nranks * one + numel * 8  # the issue's: every input plus a float64 reference
    assert peak <= limit, (peak, limit)
    assert peak <= 10 * one, f"peak {peak / one:.1f} inputs' bytes: not streaming"


def test_a_failing_param_keeps_one_copy_of_the_same_wrong_output(tmp_path):
    """Every rank holds the same wrong output (an all-reduce bug): the check keeps it once
    for the diagnosis, and the diagnosis still names every rank."""
    nranks, numel = 8, 1 << 16
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(numel, dtype=np.float32) for _ in range(nranks)]
    total = exact_sum(xs, "float32").value.astype(np.float32)  # a sum, not the mean
    folder = _write(tmp_path, xs, [total] * nranks)
    report = check(_spec(nranks, numel), folder)
    assert not report.ok
    d = report.diagnoses["w"]
    assert d.kind == "scale" and d.ranks == list(range(nranks)), d


def _far_apart(nranks: int, numel: int, seed: int) -> list:
    """fp32 inputs whose exponents are far apart on every other element (2^60 and 2^-60
    terms next to normal ones): those fail the fast path's proof."""
    rng = np.random.default_rng(seed)
    xs = []
    for r in range(nranks):
        x = rng.standard_normal(numel).astype(np.float32)
        x[::2] *= np.float32(2.0 ** (60 if r % 2 else -60))
        xs.append(x)
    return xs


def test_elements_that_need_the_integer_path_get_the_exact_reference(tmp_path):
    """The streamed reference of far-apart terms, gathered again for the integer path (in
    several batches), is the exactly rounded mean, bit for bit; ``check`` of those dumps
    passes the exact result."""
    nranks, numel = 6, 4096
    xs = _far_apart(nranks, numel, 2)
    want = exact_sum(xs, "float32", nranks)
    stream = ExactStream(numel, chunk=512)
    for x in xs:
        stream.add(x)
    calls = []

    def again():
        calls.append(1)
        return iter(xs)

    got = stream.result("float32", nranks, again, native=True)
    assert got.value.dtype == np.float32
    assert np.array_equal(got.value.astype(np.float64), want.value)
    assert np.array_equal(got.inexact, want.inexact)
    assert np.array_equal(got.absolute, want.absolute)
    assert len(calls) >= 2  # batches of at most half the terms' bytes
    mean = want.value.astype(np.float32)
    assert check(_spec(nranks, numel), _write(tmp_path, xs, [mean] * nranks)).ok


def test_reduce_off_the_root_streams_each_ranks_own_sum(tmp_path):
    """REDUCE: non-root ranks keep their own gradient scaled by 1/n (Paddle's rule), the
    root the mean; both read from the files one input at a time, a wrong own buffer
    fails on its rank only."""
    nranks, numel = 4, 1 << 12
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(numel, dtype=np.float32) for _ in range(nranks)]
    mean = exact_sum(xs, "float32", nranks).value.astype(np.float32)
    outs = [mean] + [exact_sum([x], "float32", nranks).value.astype(np.float32)
                     for x in xs[1:]]
    spec = _spec(nranks, numel, act="reduce")
    assert check(spec, _write(tmp_path, xs, outs)).ok
    outs[2] = outs[2] * np.float32(2)
    (tmp_path / "bad").mkdir()
    report = check(spec, _write(tmp_path / "bad", xs, outs))
    assert not report.ok
    assert [r for r, s in report.rank_stats["w"].items() if not s.ok] == [2]
