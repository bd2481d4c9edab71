"""Findings of a red-team review of the oracle (2026-12-04): each was a wrong result that
passed, or a check that could not see what it claimed to. Every test fails on the code before."""
import zipfile

import ml_dtypes
import numpy as np
import pytest

from mpifusion.errors import OptionError
from mpifusion.oracle import check
from mpifusion.oracle.dumps import DumpError

BF16 = ml_dtypes.bfloat16


def spec_of(dtype="float32", nranks=2, **kw):
    return {"params": [{"name": "w", "shape": [3], "dtype": dtype}], "nranks": nranks, **kw}


# -- raw 2-byte values are bfloat16 bits only for a bfloat16 param ------------------------

def test_raw_two_byte_values_of_an_fp16_param_are_refused_not_read_as_bf16():
    a = np.array([1.0, 2.0, 3.0], np.float16)
    # a wrong fp16 result built to look right when its bytes are read as bfloat16
    fake = (a.view(BF16).astype(np.float32) * 2).astype(BF16).view(np.uint16)
    for raw in (fake.view("V2"), fake):
        with pytest.raises(DumpError, match=r"out/w: dtype .*raw 2-byte .*spec says float16"):
            check(spec_of("float16"), [{"in/w/0": a, "out/w": raw}] * 2)


def test_raw_two_byte_values_in_an_npz_of_an_fp32_param_are_refused(tmp_path):
    x = np.array([1.0, 2.0, 3.0], np.float32)
    for r in range(2):
        np.savez(tmp_path / f"rank{r}.npz", **{"in/w/0": x,
                                              "out/w": (2 * x).astype(BF16).view("V2")})
    with pytest.raises(DumpError, match=r"rank0.npz: out/w: dtype .*spec says float32"):
        check(spec_of(), str(tmp_path))


def test_raw_two_byte_values_of_a_bf16_param_are_still_read():
    x = np.array([1.0, 2.0, 3.0], np.float32).astype(BF16)
    out = (2 * x.astype(np.float32)).astype(BF16)
    report = check(spec_of("bfloat16"),
                   [{"in/w/0": x.view("V2"), "out/w": out.view(np.uint16)}] * 2)
    assert report.ok, report


# -- a bound as large as the result checks nothing ----------------------------------------

def test_a_bound_that_would_pass_zero_is_refused():
    rng = np.random.default_rng(0)
    k = 128
    x = rng.uniform(0.5, 1, (2, k, 3)).astype(BF16)
    recs = [{**{f"in/w/{s}": x[r, s] for s in range(k)}, "out/w": np.zeros(3, BF16)}
            for r in range(2)]
    with pytest.raises(OptionError, match="even 0 would pass"):
        check(spec_of("bfloat16", acc_steps=k, average=True), recs)


def test_a_bound_too_coarse_to_see_one_lost_input_says_so():
    rng = np.random.default_rng(1)
    k = 16
    x = rng.uniform(0.5, 1, (2, k, 3)).astype(BF16)
    # one rank's last micro-step left out of the result: within this (worst-case) bound
    wrong = (x.astype(np.float64).sum(axis=(0, 1)) - x[1, -1].astype(np.float64)) / 2
    recs = [{**{f"in/w/{s}": x[r, s] for s in range(k)}, "out/w": wrong.astype(BF16)}
            for r in range(2)]
    report = check(spec_of("bfloat16", acc_steps=k, average=True), recs)
    assert report.ok  # the worst-case bound cannot tell, and the report says so
    assert any("missing one rank's or one micro-step's gradient may pass" in n
               for n in report.notes), report.notes
    assert "note: bfloat16 grads: the bound allows" in str(report)
    assert report.to_json()["notes"] == report.notes
    # fp32 at 2 ranks has no such note
    y = rng.uniform(0.5, 1, (2, 3)).astype(np.float32)
    fine = check(spec_of(), [{"in/w/0": y[r], "out/w": y.sum(axis=0)} for r in range(2)])
    assert fine.ok and not fine.notes


# -- nothing checked is no PASS -----------------------------------------------------------

def test_a_spec_without_fused_params_is_refused():
    spec = {"params": [{"name": "w", "shape": [3], "dtype": "float32", "stop_gradient": True}],
            "nranks": 2, "average": True}
    recs = [{"in/w/0": np.ones(3, np.float32) * (r + 1), "out/w": np.full(3, 123.0, np.float32)}
            for r in range(2)]
    with pytest.raises(DumpError, match="no param is fused.*nothing to check"):
        check(spec, recs)


def test_keys_of_unfused_params_are_named_as_not_checked():
    spec = {"params": [{"name": "w", "shape": [3], "dtype": "float32"},
                       {"name": "frozen", "shape": [2], "dtype": "float32",
                        "stop_gradient": True}], "nranks": 2}
    x = np.array([1.0, 2.0, 3.0], np.float32)
    recs = [{"in/w/0": x, "out/w": 2 * x, "out/frozen": np.full(2, 99.0, np.float32)}] * 2
    report = check(spec, recs)
    assert report.ok and any("out/frozen" in n and "not checked" in n for n in report.notes)


# -- a .npz with two members of one name ---------------------------------------------------

def test_a_duplicate_npz_member_is_refused(tmp_path):
    x = np.array([1.0, 2.0, 3.0], np.float32)
    for r in range(2):
        path = tmp_path / f"rank{r}.npz"
        np.savez(path, **{"in/w/0": x, "out/w": 2 * x})
        with pytest.warns(UserWarning, match="Duplicate name"):  # zipfile says so, and writes
            with zipfile.ZipFile(path, "a") as z, z.open("out/w.npy", "w") as f:
                np.lib.format.write_array(f, np.zeros(3, np.float32))
    with pytest.raises(DumpError, match=r"out/w: not a valid .npz \(two members"):
        check(spec_of(), str(tmp_path))
    assert np.load(tmp_path / "rank0.npz")["out/w"].tolist() == [0, 0, 0]  # what numpy shows


# -- in-memory records whose inputs are the result -------------------------------------------

def test_inputs_sharing_memory_with_a_result_are_refused():
    grads = [np.array([1.0, 2, 3], np.float32), np.array([5.0, 6, 7], np.float32)]
    recs = [{"in/w/0": g, "out/w": g} for g in grads]
    for g in grads:  # an in-place all-reduce that got it wrong, inputs overwritten
        g[:] = [100, 200, 300]
    with pytest.raises(DumpError, match=r"in/w/0: shares memory with out/w .*copies"):
        check(spec_of(average=True), recs)
    # a view of another rank's result is caught too
    buf = np.zeros(6, np.float32)
    with pytest.raises(DumpError, match="shares memory"):
        check(spec_of(), [{"in/w/0": buf[:3], "out/w": np.ones(3, np.float32)},
                          {"in/w/0": np.ones(3, np.float32), "out/w": buf[1:4]}])


def test_interleaved_views_of_one_buffer_do_not_share_memory():
    buf = np.arange(12, dtype=np.float32)
    ins, outs = buf[0::2][:3], buf[1::2][:3]   # spans overlap, elements do not
    ins[:] = [1, 2, 3]
    outs[:] = [2, 4, 6]
    other = np.array([1.0, 2, 3], np.float32)
    report = check(spec_of(), [{"in/w/0": ins, "out/w": outs},
                               {"in/w/0": other, "out/w": outs.copy()}])
    assert report.ok, report


# -- inputs that cannot reveal a missing reduction ------------------------------------------

def test_identical_inputs_of_a_mean_and_zero_inputs_are_noted():
    x = np.array([1.0, 2.0, 3.0], np.float32)
    same = check(spec_of(average=True), [{"in/w/0": x.copy(), "out/w": x.copy()}
                                         for _ in range(2)])
    assert same.ok and any("every rank fed the same inputs" in n for n in same.notes)
    zero = check(spec_of(), [{"in/w/0": np.zeros(3, np.float32),
                              "out/w": np.zeros(3, np.float32)} for _ in range(2)])
    assert zero.ok and any("every input is 0" in n for n in zero.notes)
    # a sum of identical inputs reveals a skipped reduction, not inputs that were recorded
    # already reduced (a data-parallel hook ahead of the capture's): noted too
    total = check(spec_of(), [{"in/w/0": x.copy(), "out/w": 2 * x} for _ in range(2)])
    assert total.ok and any("after a reduction" in n for n in total.notes), total.notes
    differ = check(spec_of(), [{"in/w/0": x * (r + 1), "out/w": 3 * x} for r in range(2)])
    assert differ.ok and not differ.notes


# -- small API misuses get the error that names them ----------------------------------------

def test_values_and_arguments_of_the_wrong_kind():
    x = np.ones(3, np.float32)
    for bad in (None, "1,2,3", {"a": 1}):
        with pytest.raises(DumpError, match=r"rank 0 \(in memory\): out/w: expected an array"):
            check(spec_of(), [{"in/w/0": x, "out/w": bad}, {"in/w/0": x, "out/w": 2 * x}])
    with pytest.raises(DumpError, match="dumps: expected a directory"):
        check(spec_of(), b"/tmp")
    with pytest.raises(DumpError, match="reduce_avg: expected True or False, got 'no'"):
        check(spec_of(), [{"in/w/0": x, "out/w": 2 * x}] * 2, reduce_avg="no")


def test_a_not_convertible_value_names_its_key_once():
    class Bad:
        def __array__(self, *a, **k):
            raise RuntimeError("on a device")

    x = np.ones(3, np.float32)
    with pytest.raises(DumpError) as err:
        check(spec_of(), [{"in/w/0": x, "out/w": Bad()}, {"in/w/0": x, "out/w": 2 * x}])
    assert str(err.value).count("rank 0 (in memory): out/w") == 1, str(err.value)
