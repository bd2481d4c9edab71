"""Findings of a third red-team review of ``mpifusion check`` (the oracle): each test fails
on the code before its fix. A right result that failed, a wrong one that passed, or a
traceback where one line naming the file and key was due."""
import json

import numpy as np
import pytest

from mpifusion.oracle import check, error_bound
from mpifusion.oracle.dumps import DumpError


def spec_of(dtype="float32", nranks=2, shape=(3,), **kw):
    return {"params": [{"name": "w", "shape": list(shape), "dtype": dtype}], "nranks": nranks,
            **kw}


# -- pre-scaled half-precision averages that underflow -------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("nranks", [5, 8, 16])
def test_prescaled_half_average_in_the_subnormal_range_passes(dtype, nranks):
    """Paddle's (and FusedCommBuffer's) scale_after_comm=False on fp16/bf16 grads: every rank
    multiplies its buffer by fp32(1/R) in fp32 and rounds to the half dtype, then the ranks
    sum in fp32, rounded once. Where the scaled grads are subnormal, each rank's rounding is
    an absolute error of up to half the smallest subnormal, R of them; the bound's eta
    counted one, so a correct result failed (up to 4x the bound at 8 ranks)."""
    import ml_dtypes

    half = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    tiny = float(np.finfo(half).smallest_subnormal)
    rng = np.random.default_rng(nranks)
    xs = [(rng.integers(1, 12, 64) * tiny).astype(half) for _ in range(nranks)]
    scale = np.float32(1.0 / nranks)
    pre = [(x.astype(np.float32) * scale).astype(half) for x in xs]  # mpifusion's scale_
    out = np.sum([p.astype(np.float32) for p in pre], axis=0, dtype=np.float32).astype(half)
    spec = spec_of(dtype, nranks, shape=(64,), average=True)
    raw = (lambda a: a.view(np.uint16)) if dtype == "bfloat16" else (lambda a: a)
    report = check(spec, [{"in/w/0": raw(x), "out/w": raw(out)} for x in xs])
    assert report.ok, report
    # still the bound of a few roundings: one subnormal step more on every element fails
    worse = (out.astype(np.float32) + np.float32(nranks * tiny)).astype(half)
    assert not check(spec, [{"in/w/0": raw(x), "out/w": raw(worse)} for x in xs]).ok


# -- the float64 reference rounds too ------------------------------------------------------

def _sequential(values, order):
    s = 0.0
    for i in order:
        s = s + values[i]
    return s


def test_float64_sum_in_another_rank_order_passes():
    """For float64 grads the reference (a float64 sum in rank order) rounds as often as the
    implementation does: a correct sum in another order was up to 1.33x the bound at 4
    ranks. The bound now counts the reference's own roundings."""
    x = [2.0 ** -53, 2.0 ** -52, 1.0, -float.fromhex("0x1.ffffffffffff8p-54")]
    out = _sequential(x, (0, 2, 3, 1))  # an MPI library's order
    report = check(spec_of("float64", 4, shape=(1,)),
                   [{"in/w/0": np.array([v]), "out/w": np.array([out])} for v in x])
    assert report.ok, report
    # every permutation of a 4-rank sum, on values built to round both ways
    rng = np.random.default_rng(7)
    import itertools

    for _ in range(200):
        v = [1.0] + [float(rng.choice([-1, 1]) * 2.0 ** -53 * rng.choice([1, 2, 3])
                           * (1 + int(rng.integers(-3, 4)) * 2.0 ** -50)) for _ in range(3)]
        rng.shuffle(v)
        for avg in (False, True):
            spec = spec_of("float64", 4, shape=(1,), average=avg)
            for order in itertools.permutations(range(4)):
                out = _sequential(v, order) * (0.25 if avg else 1.0)
                recs = [{"in/w/0": np.array([a]), "out/w": np.array([out])} for a in v]
                assert check(spec, recs).ok, (v, order, avg)


def test_one_rank_one_step_sum_is_still_bit_exact():
    assert error_bound(np.array([1.0]), grad_dtype="float64", nranks=1, acc_steps=1,
                       average=False)[0] == 0.0
    x = np.array([0.1, 0.2])
    assert not check(spec_of("float64", 1, shape=(2,)),
                     [{"in/w/0": x, "out/w": np.nextafter(x, 1)}]).ok


# -- inputs sharing memory with a result, through a framework tensor -----------------------

def test_memoryview_inputs_sharing_memory_with_a_result_are_refused():
    """The aliasing refusal looked at numpy arrays only: an input handed over as any other
    array-like sharing the result's memory (here a memoryview; a torch tensor below) was
    read after the in-place collective had overwritten it, and a sum-instead-of-mean
    passed."""
    grads = [np.array([1.0, 2, 3], np.float32), np.array([5.0, 6, 7], np.float32)]
    recs = [{"in/w/0": memoryview(g), "out/w": g} for g in grads]
    for g in grads:
        g[:] = [6, 8, 10]  # summed, not averaged
    with pytest.raises(DumpError, match=r"in/w/0: shares memory with out/w"):
        check(spec_of(average=True), recs)


def test_torch_tensor_inputs_sharing_memory_with_a_result_are_refused():
    torch = pytest.importorskip("torch")
    grads = [torch.tensor([1.0, 2, 3]), torch.tensor([5.0, 6, 7])]
    recs = [{"in/w/0": g, "out/w": g} for g in grads]
    for g in grads:  # an in-place all-reduce that summed instead of averaging
        g[:] = torch.tensor([6.0, 8, 10])
    with pytest.raises(DumpError, match=r"in/w/0: shares memory with out/w"):
        check(spec_of(average=True), recs)
    # numpy input, torch result of the same memory
    arrays = [np.array([1.0, 2, 3], np.float32), np.array([5.0, 6, 7], np.float32)]
    recs = [{"in/w/0": a, "out/w": torch.from_numpy(a)} for a in arrays]
    for a in arrays:
        a[:] = [6, 8, 10]
    with pytest.raises(DumpError, match="shares memory"):
        check(spec_of(average=True), recs)
    # copies pass (and a wrong mean still fails)
    xs = [torch.tensor([1.0, 2, 3]), torch.tensor([5.0, 6, 7])]
    good = [{"in/w/0": x.clone(), "out/w": (xs[0] + xs[1]) / 2} for x in xs]
    assert check(spec_of(average=True), good).ok
    bad = [{"in/w/0": x.clone(), "out/w": xs[0] + xs[1]} for x in xs]
    assert not check(spec_of(average=True), bad).ok


# -- micro-step keys with non-ASCII digits -------------------------------------------------

@pytest.mark.parametrize("k", ["\u00b2", "1" * 5000])
def test_a_micro_step_key_of_odd_digits_is_one_line(tmp_path, capsys, k):
    """``in/w/²`` ('²'.isdigit() is True, int('²') raises) and a 5000-digit micro-step
    (int() refuses more than 4300 digits) crashed the check with a ValueError traceback,
    exit 1 (the FAIL code), instead of bad input (exit 2, one line)."""
    from mpifusion.tools.cli import main

    x = np.ones(3, np.float32)
    recs = [{"in/w/0": x, f"in/w/{k}": x, "out/w": 2 * x}] * 2
    with pytest.raises(DumpError, match=r"in/w/.*micro-step"):
        check(spec_of(), recs)
    for r in range(2):
        np.savez(tmp_path / f"rank{r}.npz", **recs[r])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_of()))
    assert main(["check", "--spec", str(spec), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "micro-step" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_rank_file_named_with_non_ascii_digits_is_not_a_rank(tmp_path):
    """``rank1\u0663.npz`` matched the rank pattern (``\\d`` takes any Unicode digit) and was
    read as rank 13: the error named a file ``rank13.npz`` that does not exist."""
    x = np.ones(3, np.float32)
    for r in range(2):
        np.savez(tmp_path / f"rank{r}.npz", **{"in/w/0": x, "out/w": 2 * x})
    np.savez(tmp_path / "rank1\u0663.npz", **{"in/w/0": x, "out/w": 2 * x})
    assert check(spec_of(), str(tmp_path)).ok  # not a rank file: ignored like notes.txt


# -- shards with no element of the param ---------------------------------------------------

@pytest.mark.parametrize("act", ["all_reduce", "reduce_scatter"])
def test_an_empty_param_gather_is_not_called_missing(act):
    """A 0-element param's shards (shape (0,), range [0, 0)) were given on every rank, but
    the check said 'shard/e: missing on every rank' and refused a correct dump."""
    spec = {"params": [{"name": "e", "shape": [0], "dtype": "float32"},
                       {"name": "w", "shape": [4], "dtype": "float32"}], "nranks": 2, "act": act}
    full = np.arange(4, dtype=np.float32)
    recs = [{"shard/e": np.zeros(0, np.float32), "param/e": np.zeros(0, np.float32),
             "range/e": np.array([0, 0]), "shard/w": full[2 * r:2 * r + 2], "param/w": full,
             "range/w": np.array([2 * r, 2 * r + 2])} for r in range(2)]
    report = check(spec, recs)
    assert report.ok, report
    # the real param is still checked
    recs[1]["param/w"] = full[::-1].copy()
    assert not check(spec, recs).ok


def test_shards_that_hold_only_padding_are_a_gap_not_missing():
    """Paddle's cut of a 3-element fp32 param over 2 ranks gives rank 1 only padding; a dump
    of rank 1's shard alone was refused as 'missing on every rank' (it is there, and holds
    none of the param: a gap)."""
    spec = {"params": [{"name": "w", "shape": [3], "dtype": "float32"}], "nranks": 2,
            "act": "reduce_scatter"}
    from mpifusion.spec import Spec

    lay = {p.name: b.layout for b in Spec.from_dict(spec).plan(2) for p in b.params}["w"]
    lo, hi = lay.slice_of("w", 1)
    recs = [{}, {"shard/w": np.zeros(hi - lo, np.float32), "param/w": np.ones(3, np.float32)}]
    report = check(spec, recs)
    assert not report.ok and any(c.kind == "gap" for c in report.coverage), report


# -- results that nothing checks ------------------------------------------------------------

def test_out_keys_of_a_dump_without_inputs_are_noted_as_not_checked(tmp_path, capsys):
    """A dump with out/, shard/ and param/ but no in/ (a dumper that forgot the inputs):
    the gather was checked and the report said 'PASS: 1 gathered params exact', with no word
    that out/w (here garbage) was never compared: without inputs there is no reference."""
    spec = {"params": [{"name": "w", "shape": [4], "dtype": "float32"}], "nranks": 2}
    full = np.arange(4, dtype=np.float32)
    recs = [{"out/w": np.full(4, 123.0, np.float32), "shard/w": full[2 * r:2 * r + 2],
             "range/w": np.array([2 * r, 2 * r + 2]), "param/w": full} for r in range(2)]
    report = check(spec, recs)
    assert report.ok  # the all-gather is right
    assert any("out/w" in n and "not checked" in n and "in/" in n for n in report.notes), \
        report.notes
    assert "note: not checked" in str(report)


# -- inputs that are not values of the grad dtype ------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_inputs_not_representable_in_the_grad_dtype_are_refused(dtype):
    """float64 inputs recorded for a lower-precision param: the implementation rounded them
    to its grad dtype and summed those, the reference summed the unrounded ones, and a
    correct result FAILed with a misleading excess. Now a DumpError naming the key, the
    count and the first value; inputs that are values of the grad dtype (stored wider)
    pass, and fp32 inputs of a bf16 param with main grads are fine."""
    import ml_dtypes

    low = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(8) for _ in range(2)]  # float64, not values of `low`
    out = np.mean([x.astype(low).astype(np.float32) for x in xs], axis=0).astype(low)
    raw = (lambda a: a.view(np.uint16)) if dtype == "bfloat16" else (lambda a: a)
    spec = spec_of(dtype, 2, shape=(8,), average=True)
    with pytest.raises(DumpError, match=rf"rank 0 \(in memory\): in/w/0: 8 value\(s\) not representable in "
                                        rf"{dtype}, the grad dtype of the spec \(first at flat "
                                        rf"index 0: {float(xs[0][0])!r}\); expected the grads"):
        check(spec, [{"in/w/0": x, "out/w": raw(out)} for x in xs])
    # the same values rounded first, then stored as float64: accepted and right
    rounded = [x.astype(low).astype(np.float64) for x in xs]
    assert check(spec, [{"in/w/0": x, "out/w": raw(out)} for x in rounded]).ok


def test_fp32_inputs_of_a_bf16_param_with_main_grads_are_accepted():
    """With use_main_grad the grad dtype is float32: float32 inputs of a bfloat16 param are
    values of it (no refusal); a NaN input stays allowed (NaN is a value of every dtype)."""
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(8).astype(np.float32) for _ in range(2)]
    xs[1][3] = np.nan
    out = np.mean(xs, axis=0, dtype=np.float32)
    spec = spec_of("bfloat16", 2, shape=(8,), average=True, use_main_grad=True)
    report = check(spec, [{"in/w/0": x, "out/w": out} for x in xs])
    assert report.ok, report
