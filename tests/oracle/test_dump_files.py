"""Dump files read within bounds: a hostile ``.npz`` (forged headers, zip bombs, bad CRCs,
FIFOs, devices, huge rank counts) is one line naming the file, costs bounded memory and time,
and never blocks; good members read exactly; JSON depth and integers are bounded.
"""
from __future__ import annotations

import io
import os
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpifusion.errors import FusionError
from mpifusion.limits import InputLimitError, json_depth, loads_json
from mpifusion.oracle.dumps import DumpError, DumpFile
from mpifusion.oracle.dumps import rank_files as _rank_files, read_array as _array

from tests.forge import FUZZ, forge_zip, hostile_dumps, npy_bytes, refused_without_blocking


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


def test_fifo_and_device_dumps_do_not_block(tmp_path):
    fifo = tmp_path / "a_fifo"
    os.mkfifo(fifo)
    for name, target in (("fifo", str(fifo)), ("zero", "/dev/zero"), ("dir", str(tmp_path))):
        d = tmp_path / name
        d.mkdir()
        os.symlink(target, d / "rank0.npz")
        exc = refused_without_blocking(lambda: DumpFile(str(d / "rank0.npz")))
        assert isinstance(exc, DumpError) and "not a regular file" in str(exc), exc
    try:  # release the FIFO in case an open did block
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


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


def test_json_depth_and_integers_are_bounded():
    assert json_depth('{"a": [1, {"b": "[[[["}]}') == 3
    with pytest.raises(InputLimitError, match="nested 100000 deep"):
        loads_json("[" * 100000 + "]" * 100000)
    with pytest.raises(InputLimitError, match="5000 digits"):
        loads_json("[" + "9" * 5000 + "]")
    assert loads_json('[9223372036854775807, -3, "99999999999999999999999"]')[0] == 2 ** 63 - 1


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
