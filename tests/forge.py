"""Hostile files forged byte by byte, for the tests of dump and spec reading: ``forge_zip``
writes zip archives by hand, so a "2 GiB" member costs a few KiB.
"""
from __future__ import annotations

import io
import json
import struct
import threading
import zlib

import numpy as np
from hypothesis import HealthCheck, settings


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


def refused_without_blocking(fn) -> BaseException:
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


FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])
