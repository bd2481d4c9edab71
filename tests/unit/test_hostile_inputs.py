"""Hostile input, library level: the oracle's rule for Inf/NaN and overflow, strict timeouts,
and dumps/specs that would crash, hang or exhaust memory. Every hostile file is generated
here (``forge_zip`` writes zip archives byte by byte, so a "2 GiB" member costs a few KiB).

The non-finite expectations are written out by hand from IEEE arithmetic (inf + 1 = inf,
inf + -inf = NaN), not computed by the code under test.
"""
from __future__ import annotations

import io
import json
import math
import os
import struct
import threading
import time
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpifusion.config import CommOptions, parse_timeout
from mpifusion.errors import FusionError, OptionError
from mpifusion.oracle import ErrorStats, error_bound, summed
from mpifusion.oracle.dumps import DumpError, DumpFile, _array, _rank_files
from mpifusion.limits import InputLimitError, json_depth, loads_json, open_regular
from mpifusion.spec import SpecError, load_spec

INF, NAN = math.inf, math.nan

# --------------------------------------------------------------------------- file forgery


def npy_bytes(shape, descr: str = "<f4", fortran: bool = False, data: bytes = b"") -> bytes:
    """A .npy header (numpy's own writer) declaring ``shape`` and ``descr``, then ``data``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": descr, "fortran_order": fortran, "shape": tuple(shape)})
    return buf.getvalue() + data


def _zeros_deflated(prefix: bytes, zeros: int) -> tuple:
    """(raw deflate stream, crc32) of ``prefix`` followed by ``zeros`` zero bytes, built from
    one compressed MiB repeated (a full flush makes every repetition byte-identical)."""
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    parts = [co.compress(prefix), co.flush(zlib.Z_FULL_FLUSH)]
    crc = zlib.crc32(prefix)
    mib = b"\0" * (1 << 20)
    whole, rest = divmod(zeros, 1 << 20)
    if whole:
        block = co.compress(mib) + co.flush(zlib.Z_FULL_FLUSH)
        parts.append(block * whole)
        crc = _crc_zeros(crc, whole)
    parts.append(co.compress(b"\0" * rest) + co.flush(zlib.Z_FINISH))
    crc = zlib.crc32(b"\0" * rest, crc)
    return b"".join(parts), crc


_CRC_CACHE: dict = {}


def _crc_zeros(crc: int, mibs: int) -> int:
    key = (crc, mibs)
    if key not in _CRC_CACHE:
        mib = b"\0" * (1 << 20)
        value = crc
        for _ in range(mibs):
            value = zlib.crc32(mib, value)
        _CRC_CACHE[key] = value
    return _CRC_CACHE[key]


def forge_zip(path, members) -> str:
    """Write a zip archive by hand. ``members``: dicts with ``name`` and ``data`` (bytes),
    optionally ``zeros`` (zero bytes appended, deflated), ``method`` (8 deflate, 0 stored),
    ``declared`` (uncompressed size written in the headers instead of the real one) and
    ``crc`` (written instead of the real one)."""
    out = bytearray()
    central = bytearray()
    for m in members:
        name = m["name"].encode()
        method = m.get("method", 8)
        zeros = m.get("zeros", 0)
        if method == 8:
            payload, crc = _zeros_deflated(m["data"], zeros)
        else:
            raw = m["data"] + b"\0" * zeros
            payload, crc = raw, zlib.crc32(raw)
        size = m.get("declared", len(m["data"]) + zeros)
        crc = m.get("crc", crc)
        offset = len(out)
        out += struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, 0, method, 0, 33, crc,
                           len(payload), size, len(name), 0) + name + payload
        central += struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, 0, method, 0,
                               33, crc, len(payload), size, len(name), 0, 0, 0, 0, 0,
                               offset) + name
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members),
                       len(central), len(out), 0)
    with open(path, "wb") as f:
        f.write(bytes(out + central + eocd))
    return str(path)


def write_spec(path, shape, dtype: str = "float32", nranks: int = 1, **fields) -> str:
    path.write_text(json.dumps({"params": [{"name": "w", "shape": list(shape), "dtype": dtype}],
                                "act": "all_reduce", "nranks": nranks, **fields}))
    return str(path)


def good_member(key: str, arr: np.ndarray) -> dict:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr)
    return {"name": f"{key}.npy", "data": buf.getvalue()}


def hostile_dumps(folder) -> dict:
    """name -> (rank0.npz path, expected words in the one-line error); spec shape [3] fp32."""
    folder.mkdir(exist_ok=True)
    ok_in = good_member("in/w/0", np.ones(3, np.float32))
    cases = {
        "2e9 elements": ([{"name": "out/w.npy", "data": npy_bytes((2_000_000_000,))}],
                         "shape [2000000000] disagrees"),
        "1e13 elements": ([{"name": "out/w.npy", "data": npy_bytes((10 ** 13,))}],
                          "shape [10000000000000] disagrees"),
        "malformed header": ([{"name": "out/w.npy",
                               "data": b"\x93NUMPY\x01\x00" + struct.pack("<H", 40)
                               + b"{'descr': '<f4', 'shape': (3,  'fortr\n"}],
                             "not a valid .npz member"),
        "2 GiB bomb, big header": ([{"name": "out/w.npy", "data": npy_bytes(((2 << 30) // 4,)),
                                     "zeros": 2 << 30}], "disagrees with the spec"),
        "2 GiB bomb, right header": ([{"name": "out/w.npy", "data": npy_bytes((3,)),
                                       "zeros": 2 << 30}], "not a valid .npz member"),
        "declares 2 GiB": ([{"name": "out/w.npy", "data": npy_bytes((3,), data=b"\0" * 12),
                             "declared": 2 << 30}], "not a valid .npz member"),
        "truncated data": ([{"name": "out/w.npy", "data": npy_bytes((3,), data=b"\0" * 4),
                             "method": 0}], "not a valid .npz member"),
        "bad crc": ([{"name": "out/w.npy", "data": npy_bytes((3,), data=b"\1" * 12),
                      "crc": 1234}], "not a valid .npz member"),
        "object dtype": ([{"name": "out/w.npy", "data": npy_bytes((3,), descr="|O")}],
                         "is not a floating dtype"),
        "huge void dtype": ([{"name": "out/w.npy", "data": npy_bytes((3,), descr="|V1000000000")}],
                            "is not a floating dtype"),
    }
    out = {}
    for i, (label, (members, words)) in enumerate(cases.items()):
        sub = folder / f"case{i}"
        sub.mkdir(exist_ok=True)
        forge_zip(sub / "rank0.npz", [ok_in] + members)
        out[label] = (str(sub), words)
    return out


# --------------------------------------------------------------------------- oracle: Inf/NaN


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


# --------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("value", [INF, 1e300, "inf", "1e300", 10 ** 400, "1e9999"])
def test_timeout_huge_means_no_deadline(value):
    assert parse_timeout(value, "timeout") is None
    assert CommOptions(timeout=value).timeout is None


@pytest.mark.parametrize("value", [NAN, -1, 0, "abc", "nan", "-1", "0", True, [1]])
def test_timeout_bad_values_are_refused_by_name(value):
    with pytest.raises(OptionError) as info:
        parse_timeout(value, "MPIFUSION_TIMEOUT")
    assert str(info.value).startswith("MPIFUSION_TIMEOUT: expected")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, ok", [("inf", True), ("1e300", True), ("nan", False),
                                      ("-1", False), ("0", False), ("abc", False)])
def test_timeout_from_the_environment(text, ok):
    if ok:
        assert CommOptions.from_env({"MPIFUSION_TIMEOUT": text}).timeout is None
    else:
        with pytest.raises(OptionError, match="MPIFUSION_TIMEOUT"):
            CommOptions.from_env({"MPIFUSION_TIMEOUT": text})


@pytest.mark.parametrize("value, ok", [(INF, True), (1e300, True), (1e9, True), (NAN, False),
                                       (-1, False), (0, False), ("abc", False)])
def test_buffer_timeout_keyword(value, ok):
    """FusedCommBuffer(timeout=...) on one rank: a huge value runs a full step (no
    OverflowError in any wait); a bad one is refused before anything is built."""
    from mpi4py import MPI

    from mpifusion import FusedCommBuffer, Param

    p = Param("w", np.zeros(3, np.float32))
    if not ok:
        with pytest.raises(OptionError, match="timeout"):
            FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce", timeout=value)
        return
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce", timeout=value)
    buf.add_grad(p, grad=np.full(3, 1.5, np.float32))
    buf.scale_grads()
    assert np.array_equal(p.grad, np.full(3, 1.5, np.float32))
    assert buf.timeout == (None if value > 1e9 else value)


def test_longest_deadline_fits_every_wait():
    """The largest finite deadline parse_timeout keeps is accepted by threading and time."""
    from mpifusion.config import MAX_TIMEOUT

    assert MAX_TIMEOUT <= threading.TIMEOUT_MAX
    ev = threading.Event()
    ev.set()
    assert ev.wait(MAX_TIMEOUT)
    assert math.isfinite(time.monotonic() + MAX_TIMEOUT)


# --------------------------------------------------------------------------- dumps


def test_every_hostile_dump_is_one_line_bounded_in_memory_and_time(tmp_path):
    cases = hostile_dumps(tmp_path)
    for label, (folder, words) in cases.items():
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            with pytest.raises(DumpError) as info:
                with DumpFile(os.path.join(folder, "rank0.npz")) as f:
                    _array(f, "rank0.npz", "in/w/0", (3,), "float32")
                    _array(f, "rank0.npz", "out/w", (3,), "float32")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        elapsed = time.perf_counter() - t0
        msg = str(info.value)
        assert words in msg, (label, msg)
        assert "\n" not in msg and "allow_pickle" not in msg and "max_header_size" not in msg
        assert isinstance(info.value, FusionError) and isinstance(info.value, ValueError)
        assert peak < 32 << 20, (label, peak)
        assert elapsed < 30, (label, elapsed)


@pytest.mark.parametrize("numel", [2_000_000_000, 10 ** 13])
def test_huge_header_matching_a_huge_spec_is_refused_before_allocating(tmp_path, numel):
    """The spec agrees with the header, but the archive holds no data for it (or the machine
    has no memory for it): refused from the header and the archive's sizes alone."""
    forge_zip(tmp_path / "rank0.npz", [{"name": "out/w.npy", "data": npy_bytes((numel,))}])
    tracemalloc.start()
    try:
        with pytest.raises(DumpError) as info:
            with DumpFile(str(tmp_path / "rank0.npz")) as d:
                d.read("out/w", (numel,), "float32")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    assert ("not a valid .npz member" in msg and "archive says" in msg) or "needs about" in msg
    assert peak < 8 << 20


def test_good_members_read_exactly(tmp_path):
    """Fortran order, big-endian and raw bfloat16 bits come back as numpy would read them."""
    import ml_dtypes

    a = np.arange(12, dtype=">f4").reshape(3, 4)
    f = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    b = np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16)
    path = tmp_path / "rank0.npz"
    np.savez(path, a=a, f=f, b=b.view(np.uint16))
    with DumpFile(str(path)) as d:
        assert np.array_equal(d.read("a", (3, 4), "float32"), a.astype(np.float64))
        assert np.array_equal(d.read("f", (2, 3), "float64"), f)
        assert np.array_equal(d.read("b", (2,), "bfloat16"), [1.5, -2.25])
    np.savez_compressed(path, a=a)
    with DumpFile(str(path)) as d:
        assert np.array_equal(d.read("a", (3, 4), "float32"), a.astype(np.float64))


@pytest.mark.parametrize("content", [b"", b"PK\x05\x06" + b"\0" * 18, b"not a zip at all",
                                     b"\x93NUMPY\x01\x00"])
def test_corrupt_npz_is_not_a_valid_npz_in_our_words(tmp_path, content):
    path = tmp_path / "rank0.npz"
    path.write_bytes(content)
    with pytest.raises(DumpError) as info:
        with DumpFile(str(path)) as d:
            _array(d, str(path), "out/w", (3,), "float32")
    msg = str(info.value)
    assert ("not a valid .npz" in msg or "out/w: missing" in msg) and "allow_pickle" not in msg


def _refused_without_blocking(fn) -> BaseException:
    """Run ``fn`` in a thread; it must raise within 20 s (a blocked open fails the test)."""
    box: list = []

    def target():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "blocked"
    assert box, "no error"
    return box[0]


def test_fifo_and_device_dumps_do_not_block(tmp_path):
    fifo = tmp_path / "a_fifo"
    os.mkfifo(fifo)
    for name, target in (("fifo", str(fifo)), ("zero", "/dev/zero"), ("dir", str(tmp_path))):
        d = tmp_path / name
        d.mkdir()
        os.symlink(target, d / "rank0.npz")
        exc = _refused_without_blocking(lambda: DumpFile(str(d / "rank0.npz")))
        assert isinstance(exc, DumpError) and "not a regular file" in str(exc), exc
    try:  # release the FIFO in case an open did block
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_spec_and_layout_files_must_be_regular(tmp_path):
    fifo = tmp_path / "spec.json"
    os.mkfifo(fifo)
    exc = _refused_without_blocking(lambda: load_spec(str(fifo)))
    assert isinstance(exc, SpecError) and "not a regular file (a FIFO)" in str(exc)
    exc = _refused_without_blocking(lambda: open_regular("/dev/zero"))
    assert isinstance(exc, OSError) and "character device" in str(exc)


def test_rank_files_with_a_huge_nranks_cost_nothing(tmp_path):
    (tmp_path / "rank0.npz").write_bytes(b"")
    t0 = time.perf_counter()
    with pytest.raises(DumpError, match="rank1.npz: missing"):
        _rank_files(str(tmp_path), 10 ** 9)
    assert time.perf_counter() - t0 < 5
    (tmp_path / "rank1.npz").write_bytes(b"")
    (tmp_path / "rank7.npz").write_bytes(b"")
    with pytest.raises(DumpError, match="rank2.npz: missing"):
        _rank_files(str(tmp_path), 3)
    with pytest.raises(DumpError, match="rank7.npz: unexpected"):
        _rank_files(str(tmp_path), 2)


# --------------------------------------------------------------------------- JSON bounds


def test_json_depth_and_integers_are_bounded():
    assert json_depth('{"a": [1, {"b": "[[[["}]}') == 3
    with pytest.raises(InputLimitError, match="nested 100000 deep"):
        loads_json("[" * 100000 + "]" * 100000)
    with pytest.raises(InputLimitError, match="5000 digits"):
        loads_json("[" + "9" * 5000 + "]")
    assert loads_json('[9223372036854775807, -3, "99999999999999999999999"]')[0] == 2 ** 63 - 1


@pytest.mark.parametrize("text, words", [
    ('{"params": [{"name": "w", "shape": [' + "9" * 5000 + '], "dtype": "fp32"}]}',
     "5000 digits"),
    ("[" * 5000 + "]" * 5000, "nested 5000 deep"),
    ('{"params": [{"name": "w", "shape": [1099511627776, 1099511627776], "dtype": "fp32"}]}',
     "2**59 elements"),
    ('{"params": [{"name": "w", "shape": [3], "dtype": "fp32"}], "acc_steps": '
     '99999999999999999999}', "acc_steps"),
])
def test_hostile_spec_files_are_one_line_spec_errors(tmp_path, text, words):
    path = tmp_path / "spec.json"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert words in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith(str(path))


def test_bound_model_refuses_too_many_roundings_by_name():
    from mpifusion.oracle import bound_model

    with pytest.raises(OptionError, match="acc_steps 100000000"):
        bound_model(grad_dtype="float32", nranks=2, acc_steps=100_000_000, average=True)


# --------------------------------------------------------------------------- fuzzing .npz

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


def _valid_npz_bytes() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{"in/w/0": np.ones(3, np.float32), "out/w": np.ones(3, np.float32)})
    return buf.getvalue()


VALID = _valid_npz_bytes()


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)),
                      min_size=1, max_size=8),
       cut=st.integers(0, len(VALID)))
def test_fuzzed_npz_reads_right_or_raises_dump_error(tmp_path_factory, edits, cut):
    """Flipped bytes and truncation: the right values or a one-line DumpError, never a
    crash, a hang or another exception."""
    raw = bytearray(VALID[:cut] if cut < len(VALID) // 2 else VALID)
    for pos, value in edits:
        if pos < len(raw):
            raw[pos] = value
    path = tmp_path_factory.mktemp("npz") / "rank0.npz"
    path.write_bytes(bytes(raw))
    try:
        with DumpFile(str(path)) as d:
            for key in ("in/w/0", "out/w"):
                got = _array(d, str(path), key, (3,), "float32")
                # a read that succeeds returns exactly three values; only data bytes that
                # escaped the CRC (stored members: none) could differ from ones
                assert got.shape == (3,)
    except DumpError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(shape=st.lists(st.integers(0, 2 ** 62), min_size=0, max_size=4),
       descr=st.sampled_from(["<f4", "<f8", "<f2", "|V2", "<u2", "<i8", "|O", "<c16",
                              "|V7", "<f16", "(2,)<f4"]),
       declared=st.one_of(st.none(), st.integers(0, 2 ** 32 - 1)))
def test_fuzzed_headers_never_allocate_what_they_claim(tmp_path_factory, shape, descr,
                                                      declared):
    try:
        header = npy_bytes(shape, descr=descr)
    except (ValueError, TypeError):
        return  # numpy cannot even write such a header
    path = tmp_path_factory.mktemp("hdr") / "rank0.npz"
    member = {"name": "out/w.npy", "data": header}
    if declared is not None:
        member["declared"] = declared
    forge_zip(path, [member])
    tracemalloc.start()
    try:
        with DumpFile(str(path)) as d:
            got = _array(d, str(path), "out/w", tuple(shape), "float32")
            assert got.size == 0  # only an empty array has no data to read
    except DumpError as exc:
        assert "\n" not in str(exc)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 16 << 20


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


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10 ** 30), 10 ** 30) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["params", "name", "shape", "dtype", "act", "nranks", "acc_steps",
                         "group_size", "dst", "average", "x"]), inner, max_size=5),
    max_leaves=30)


@FUZZ
@given(doc=_JSON, depth=st.integers(0, 300), digits=st.integers(1, 6000))
def test_fuzzed_spec_json_is_a_spec_or_one_line_spec_error(tmp_path_factory, doc, depth,
                                                         digits):
    """Random JSON documents, wrapped in ``depth`` lists, and specs with a ``digits``-digit
    size: a Spec or a one-line SpecError, never another exception."""
    folder = tmp_path_factory.mktemp("spec")
    texts = ["[" * depth + json.dumps(doc) + "]" * depth,
             '{"params": [{"name": "w", "shape": [' + "7" * digits + '], "dtype": "fp32"}]}']
    for i, text in enumerate(texts):
        path = folder / f"spec{i}.json"
        path.write_text(text)
        try:
            load_spec(str(path))
        except SpecError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(str(path))
