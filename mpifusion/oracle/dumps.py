"""Reading dumps (``rank{r}.npz``) safely: one-line ``DumpError`` naming the file and field.

A dump comes from another program, so nothing in it is trusted: only regular files are
opened (a FIFO or ``/dev/zero`` named ``rank0.npz`` would block or never end), and every
member's ``.npy`` header (shape, dtype) is read and compared with the spec, and its size in
the archive with what that shape needs, before any array is allocated or decompressed. A
file that is not a zip archive of ``.npy`` members is "not a valid .npz", in our words.
"""
from __future__ import annotations

import math
import os
import re
import zipfile
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..errors import FusionError
from ..limits import memory_problem, open_regular, shape_too_large
from .bound import as_float64, as_native

#: longest ``.npy`` header read (numpy's own default limit)
MAX_HEADER_BYTES = 10000
#: deflate expands at most ~1032-fold; a member declaring more is not a real .npy
MAX_DEFLATE_RATIO = 1100
#: work arrays per element while one param is checked (``ExactStream``): the running
#: float64 sum and sum|x| and the smallest |x| (float32), then the reference in the grad
#: dtype and two byte marks: 26 bytes for fp32 grads, 34 for fp64 ones, rounded up to 4
#: float64 (comparisons run in 1M-element chunks). The inputs are read one at a time and
#: counted as they are read (each member's check compares with the memory available then);
#: elements that fail the fast path's proof (fp64 grads, exponents far apart) add their
#: gathered terms, at most half the inputs' bytes a batch.
CHECK_BYTES_PER_ELEMENT = 4 * 8
#: bytes read per chunk when copying a member's data into its array
_CHUNK = 16 << 20


class DumpError(FusionError, ValueError):
    """A dump that cannot be checked (missing file or key, wrong shape, not a .npz): one line
    naming the file and the field."""


def rank_files(directory: str, nranks: int) -> list:
    """``rank0.npz .. rank{n-1}.npz`` in ``directory``, all present, no extra ones. Works
    from one listing of the directory, so a huge ``nranks`` costs nothing."""
    if not os.path.isdir(directory):
        raise DumpError(f"{directory}: not a directory (expected rank0.npz ... "
                        f"rank{nranks - 1}.npz in it)")
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise DumpError(f"{directory}: cannot list: {exc.strerror or exc}") from None
    # ASCII digits: \d takes any Unicode digit, and int() reads 'rank1\u0663.npz' as rank 13
    ranks = {int(f[4:-4]) for f in names
             if re.fullmatch(r"rank(0|[1-9][0-9]{0,8})\.npz", f, flags=re.ASCII)}
    present = sorted(r for r in ranks if r < nranks)
    if len(present) < nranks:
        missing = next(r for r, have in enumerate(present + [nranks]) if r != have)
        raise DumpError(f"{os.path.join(directory, f'rank{missing}.npz')}: missing "
                        f"(nranks={nranks} expects rank0.npz ... rank{nranks - 1}.npz)")
    extra = sorted(r for r in ranks if r >= nranks)
    if extra:
        raise DumpError(f"{os.path.join(directory, f'rank{extra[0]}.npz')}: unexpected (spec "
                        f"field nranks={nranks}; is nranks wrong?)")
    return [os.path.join(directory, f"rank{r}.npz") for r in range(nranks)]


@dataclass(frozen=True)
class Member:
    """A checked ``.npy`` member: what its header says and where its data starts."""

    info: zipfile.ZipInfo
    shape: tuple
    dtype: np.dtype
    fortran_order: bool
    data_offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class DumpFile:
    """One rank's ``.npz``, opened without trusting it (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._file = open_regular(path)
        except OSError as exc:
            raise DumpError(f"{path}: cannot read: {exc.strerror or exc}") from None
        try:
            self._zip = zipfile.ZipFile(self._file)
            members = self._zip.infolist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError,
                NotImplementedError, RuntimeError) as exc:
            self._file.close()
            raise DumpError(f"{path}: not a valid .npz (not a zip archive of .npy arrays: "
                            f"{_short(exc)})") from None
        self._by_key = {}
        for info in members:
            key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            if key in self._by_key:
                # numpy.load reads the last of two same-named members, a reader that keeps
                # the first checks other data than the dumper's own tools show
                self.close()
                raise DumpError(f"{path}: {key}: not a valid .npz (two members named "
                                f"{self._by_key[key].filename!r} and {info.filename!r}; "
                                f"numpy.savez writes each key once)")
            self._by_key[key] = info
        self._checked: dict = {}

    def close(self) -> None:
        self._zip.close()
        self._file.close()

    def __enter__(self) -> "DumpFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def files(self) -> list:
        return list(self._by_key)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def _bad(self, key: str, why: str) -> DumpError:
        return DumpError(f"{self.path}: {key}: not a valid .npz member ({why})")

    def member(self, key: str) -> Member:
        """Read and check ``key``'s header; nothing of its data is decompressed yet."""
        if key in self._checked:
            return self._checked[key]
        info = self._by_key[key]
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise self._bad(key, f"compression method {info.compress_type}; numpy.savez "
                                 f"stores or deflates")
        if info.flag_bits & 0x1:
            raise self._bad(key, "encrypted")
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise self._bad(key, f"stored member of {info.file_size} bytes takes "
                                 f"{info.compress_size} in the archive")
        if info.file_size > MAX_DEFLATE_RATIO * info.compress_size + (1 << 16):
            raise self._bad(key, f"declares {info.file_size} bytes from {info.compress_size} "
                                 f"compressed, more than deflate can expand")
        try:
            with self._zip.open(info) as stream:
                version = np.lib.format.read_magic(stream)
                if version == (1, 0):
                    header = np.lib.format.read_array_header_1_0(
                        stream, max_header_size=MAX_HEADER_BYTES)
                elif version in ((2, 0), (3, 0)):
                    header = np.lib.format.read_array_header_2_0(
                        stream, max_header_size=MAX_HEADER_BYTES)
                else:
                    raise ValueError(f"version {version}")
                offset = stream.tell()
        except Exception as exc:  # noqa: BLE001 - any parser failure on hostile bytes
            raise self._bad(key, f"no readable .npy header: {_short(exc)}") from None
        shape, fortran, dtype = header
        if not all(isinstance(s, int) and s >= 0 for s in shape) or shape_too_large(shape):
            raise self._bad(key, f"header shape {list(shape)[:8]} is no array numpy can hold")
        member = Member(info, tuple(shape), dtype, bool(fortran), offset)
        self._checked[key] = member
        return member

    def check(self, key: str, shape: tuple, dtype: str) -> Member:
        """``key``'s header against the spec: shape, a floating dtype, and a member size in
        the archive that holds exactly that many elements. Raises DumpError."""
        m = self.member(key)
        if m.shape != tuple(shape):
            raise DumpError(f"{self.path}: {key}: shape {list(m.shape)} disagrees with the spec "
                            f"(expected {list(shape)})")
        dt = m.dtype
        problem = _dtype_problem(dt, dtype)
        if problem:
            raise DumpError(f"{self.path}: {key}: {problem}")
        need = m.numel * (dt.itemsize + CHECK_BYTES_PER_ELEMENT)
        if need > (64 << 20):
            problem = memory_problem(need, f"checking {key} ({m.numel} elements)")
            if problem:
                raise DumpError(f"{self.path}: {problem}")
        return m

    def __getitem__(self, key: str) -> np.ndarray:
        """``key``'s array as stored (any plain numeric dtype, e.g. the ints of a range),
        after checking that the archive holds exactly what its header declares."""
        m = self.member(key)
        if m.dtype.hasobject or m.dtype.kind not in "biufV" or m.dtype.fields is not None:
            raise DumpError(f"{self.path}: {key}: dtype {m.dtype} is not a plain numeric dtype")
        return self._raw(key, m)

    def read(self, key: str, shape: tuple, dtype: str, native: bool = False) -> np.ndarray:
        """The array of ``key`` as float64 (``native``: in its stored float dtype, raw 2-byte
        values as bfloat16), after :meth:`check`."""
        raw = self._raw(key, self.check(key, shape, dtype))
        return as_native(raw, dtype) if native else as_float64(raw, dtype)

    def _raw(self, key: str, m: Member) -> np.ndarray:
        need = m.data_offset + m.numel * m.dtype.itemsize
        if m.info.file_size != need:
            raise DumpError(f"{self.path}: {key}: not a valid .npz member (its header says "
                            f"{m.numel} elements of {m.dtype}, {need} bytes with the header, "
                            f"but the archive says {m.info.file_size})")
        raw = np.empty(m.numel, dtype=m.dtype)
        buf = memoryview(raw.view(np.uint8)).cast("B") if raw.size else memoryview(b"")
        try:
            with self._zip.open(m.info) as stream:
                stream.seek(m.data_offset)
                pos = 0
                while pos < len(buf):
                    chunk = stream.read(min(_CHUNK, len(buf) - pos))
                    if not chunk:
                        raise EOFError(f"data ends after {pos} of {len(buf)} bytes")
                    buf[pos:pos + len(chunk)] = chunk
                    pos += len(chunk)
                stream.read(1)  # reach the end, so zipfile checks the CRC
        except Exception as exc:  # noqa: BLE001 - zlib, CRC and truncation errors alike
            raise self._bad(key, f"cannot read its data: {_short(exc)}") from None
        return raw.reshape(m.shape[::-1]).T if m.fortran_order else raw.reshape(m.shape)


def _short(exc: BaseException) -> str:
    """An exception as a few words on one line (no advice meant for numpy's own users)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = text.split(" To allow loading")[0]
    return text if len(text) <= 120 else text[:117] + "..."


def read_array(files: Any, path: str, key: str, shape: tuple, dtype: str,
               missing_ok: bool = False, native: bool = False) -> Optional[np.ndarray]:
    """``key`` of ``files`` (a :class:`DumpFile`, or a mapping of arrays with ``files``) as
    float64 (``native``: in its own float dtype, see :func:`~.bound.as_native`), checked
    against ``shape`` and dtype; None when missing and ``missing_ok``."""
    if key not in files.files:
        if missing_ok:
            return None
        raise DumpError(f"{path}: {key}: missing (expected shape {list(shape)})")
    if isinstance(files, DumpFile):
        return files.read(key, shape, dtype, native=native)
    try:
        arr = files[key]
    except DumpError:
        raise
    except ValueError as exc:
        raise DumpError(f"{path}: {key}: cannot read: {exc}") from None
    if tuple(arr.shape) != tuple(shape):
        raise DumpError(f"{path}: {key}: shape {list(arr.shape)} disagrees with the spec "
                        f"(expected {list(shape)})")
    problem = _dtype_problem(arr.dtype, dtype)
    if problem:
        raise DumpError(f"{path}: {key}: {problem}")
    return as_native(arr, dtype) if native else as_float64(arr, dtype)


def _dtype_problem(dt: np.dtype, spec_dtype: str) -> Optional[str]:
    """Why the oracle will not read values of ``dt`` for a ``spec_dtype`` param (None: it
    will)."""
    if dt.hasobject:
        return f"dtype {dt} is not a floating dtype"
    if dt.kind == "f" and dt.itemsize in (2, 4, 8) or dt.name == "bfloat16":
        return None
    raw = (dt.kind == "V" and dt.itemsize == 2 and dt.fields is None and dt.subdtype is None
           or dt == np.uint16)
    if raw and spec_dtype == "bfloat16":
        return None
    if raw:
        return (f"dtype {dt}: raw 2-byte values are read as bfloat16 bits, but the spec says "
                f"{spec_dtype}; store {spec_dtype} values as {spec_dtype}")
    return (f"dtype {dt} is not a floating dtype (bfloat16 may be stored as raw 2-byte "
            f"values)")
