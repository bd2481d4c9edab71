"""Half precision <-> float32 at memory speed, bit-identical to numpy's and ml_dtypes' casts.

Half-precision buffers are widened to fp32 one segment at a time, reduced, and rounded back
(round to nearest even), so each sync step pays two casts over the whole buffer. numpy's fp16
cast runs one element at a time (2M elements: widen 3.7 ms, round 7.7 ms, against 0.25-0.4 ms
for a memcpy of the fp32 segment), ml_dtypes' bf16 cast is 2.5-10x memcpy too.

Why a small C kernel (``_halfcast.c``, built by ``setup.py``, optional):

- numpy bit arithmetic on uint16/uint32 views costs one memory pass per operation even with
  ``out=`` buffers and in-cache blocks (measured: one op ~ one memcpy; bf16 rounding needs 5,
  fp16 rounding ~25); a 65,536-entry lookup table with ``np.take`` is no better (3.7-5 ms: the
  uint16 indices are first converted to intp).
- numba would do it but is a large new dependency that JIT-compiles in every rank at start-up;
  torch's casts are fast but round NaNs differently and bring their own thread pool.
- The C file needs only Python's headers (buffers come in through the buffer protocol) and
  uses integer arithmetic, so the result does not depend on FPU flags set by other libraries.
  On x86-64 with AVX2/F16C it converts fp16 with F16C instructions (rounding mode given in
  the instruction) whenever this thread's MXCSR has flush-to-zero and denormals-are-zero off,
  and sums and rounds bf16 with AVX-512 (vcvtne2ps2bf16 where the CPU has AVX512-BF16) or
  AVX2, picked at run time (:func:`kernel_path`); otherwise it runs portable integer loops
  the compiler vectorises.

The kernels count NaN inputs; when there are any, those elements alone are re-cast with the
reference cast, so NaN payloads and quiet bits are exactly what numpy/ml_dtypes produce (F16C
quiets signalling NaNs, numpy does not). Everything else (Inf, overflow to Inf, subnormals,
ties to even) is exact by construction and checked exhaustively in tests/arrays/test_halfcast.py.

The same module sums fp32/fp64 arrays in rank order and scales them in one call
(:func:`sum_wide`, the shm small all-reduce): numpy's add and multiply cost more in call
overhead than the arithmetic of a few KiB. Same bits, NaNs again left to numpy.

Without the compiled module, for cupy arrays, non-contiguous arrays, or with
``MPIFUSION_HALFCAST=numpy``, :func:`widen` and :func:`narrow` are the plain casts. A source
that overlaps the output (widening or rounding in place) is copied first: numpy's own cast
gets that wrong (it copies forward, overwriting halves it has not read yet).
"""
from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any, Optional, Sequence

import numpy as np

from ..config import HALFCAST_ENV, halfcast_from_env
from ..dtypes import HALF, float16, float32
from . import backend

try:  # built by setup.py (optional extension)
    from . import _halfcast as _kernels
except ImportError:  # pragma: no cover - depends on the install
    _kernels = None

#: why the compiled module is not used although it imports (None: it is, or there is none)
STALE: Optional[str] = None


def _source_digest(directory: str) -> Optional[str]:
    """sha256 prefix of the ``_halfcast.c`` next to this file, as setup.py computes it (None
    in an install that ships no source: the built module is then trusted)."""
    try:
        with open(os.path.join(directory, "_halfcast.c"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return None


def _stale(kernels: Any, digest: Optional[str]) -> Optional[str]:
    """Why ``kernels`` must not run: built from another ``_halfcast.c`` than the one here. An
    optional extension whose rebuild failed (no compiler, refused flags) keeps the old .so,
    whose conversions may differ from the source's."""
    built = getattr(kernels, "SOURCE", None)
    if kernels is None or digest is None or built == digest:
        return None
    return (f"mpifusion.arrays._halfcast was built from another _halfcast.c (built "
            f"{built or 'before builds were recorded'}, source {digest}); using numpy's and "
            f"ml_dtypes' casts (same results, slower). Rebuild: pip install -e .")


STALE = _stale(_kernels, _source_digest(os.path.dirname(os.path.abspath(__file__))))
if STALE is not None:
    warnings.warn(STALE, RuntimeWarning, stacklevel=2)
    _kernels = None

_u16, _u32 = np.dtype(np.uint16), np.dtype(np.uint32)


def _enabled() -> bool:
    mode = halfcast_from_env()
    if mode == "kernel" and _kernels is None:
        if STALE is not None:
            raise ImportError(f"${HALFCAST_ENV}=kernel: {STALE}")
        raise ImportError(f"${HALFCAST_ENV}=kernel but mpifusion.arrays._halfcast is not "
                          "built (reinstall with a C compiler: pip install -e .)")
    return _kernels is not None and mode != "numpy"


def path() -> str:
    """Which conversion runs here: ``'f16c'`` (x86 F16C/AVX2), ``'integer'`` (portable C
    loops) or ``'numpy'`` (the plain casts: no compiled module, or ``$MPIFUSION_HALFCAST``)."""
    if not _enabled():
        return "numpy"
    return str(_kernels.f16_path())


def kernel_path() -> str:
    """Which bf16 kernel :func:`sum_half` and :func:`narrow` run here, picked at run time
    from the CPU: ``'avx512bf16'`` (AVX-512 with vcvtne2ps2bf16), ``'avx512'``, ``'avx2'``,
    ``'generic'`` (portable C loops) or ``'numpy'`` (no compiled module, or
    ``$MPIFUSION_HALFCAST``). Every path gives the same bits."""
    if not _enabled():
        return "numpy"
    return str(_kernels.bf16_path())


def kernel_paths() -> tuple:
    """Every bf16 kernel path this CPU and build have (empty without the compiled module)."""
    return tuple(_kernels.bf16_paths()) if _kernels is not None else ()


def _fast(src: Any, out: Any) -> bool:
    """True when the compiled kernel may run on these two arrays."""
    return (type(src) is np.ndarray and type(out) is np.ndarray
            and src.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable
            and _enabled())


def _detached(src: Any, out: Any) -> Any:
    """``src``, or a copy of it where it overlaps ``out``: numpy's cast of an overlapping
    1-D pair copies forward element by element, so widening in place overwrote halves not
    yet read ([1, 2, 3, 4] -> [1, 1.875, 0, 1.984375]); the kernel needs disjoint buffers."""
    return src.copy() if backend.overlaps(src, out) else src


def _check(src: Any, out: Any, src_dtypes: tuple, out_dtypes: tuple, what: str) -> None:
    if src.dtype not in src_dtypes:
        raise TypeError(f"{what}: source dtype {src.dtype} is not one of "
                        f"{', '.join(str(d) for d in src_dtypes)}")
    if out.dtype not in out_dtypes:
        raise TypeError(f"{what}: output dtype {out.dtype} is not one of "
                        f"{', '.join(str(d) for d in out_dtypes)}")
    if src.size != out.size:
        raise ValueError(f"{what}: source has {src.size} elements, output {out.size}")


def widen(src: Any, out: Optional[Any] = None) -> Any:
    """Widen an fp16/bf16 array to fp32 into ``out`` (same number of elements; allocated when
    None) and return it; exact, like ``src.astype(np.float32)``."""
    if out is None:
        if not isinstance(src, np.ndarray):
            return src.astype(float32)  # cupy and others: their own cast
        out = np.empty(src.shape, float32)
    _check(src, out, HALF, (float32,), "widen")
    src = _detached(src, out)
    if not _fast(src, out):
        out[...] = src.reshape(out.shape)  # reshaping the source, never the output (a copy)
        return out
    s16, o32 = src.reshape(-1).view(_u16), out.reshape(-1).view(_u32)
    kernel = _kernels.widen_f16 if src.dtype == float16 else _kernels.widen_bf16
    if kernel(s16, o32):  # NaNs: re-cast those with the reference cast
        flat, o = src.reshape(-1), out.reshape(-1)
        nan = np.isnan(flat)
        o[nan] = flat[nan].astype(float32)
    return out


def narrow(src: Any, out: Any) -> Any:
    """Round an fp32 array to nearest even into the fp16/bf16 array ``out`` (same number of
    elements) and return it; bit-identical to numpy's (fp16) and ml_dtypes' (bf16) casts."""
    _check(src, out, (float32,), HALF, "narrow")
    src = _detached(src, out)
    if not _fast(src, out):
        # as the kernel: no warning or error from the caller's np.seterr (numpy flags an fp16
        # subnormal result as underflow, a finite value rounding to inf as overflow)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            out[...] = src.reshape(out.shape)  # never reshape the output: it may copy
        return out
    s32, o16 = src.reshape(-1).view(_u32), out.reshape(-1).view(_u16)
    kernel = _kernels.narrow_f16 if out.dtype == float16 else _kernels.narrow_bf16
    if kernel(s32, o16):  # NaNs: re-cast those with the reference cast
        flat, o = src.reshape(-1), out.reshape(-1)
        nan = np.isnan(flat)
        with np.errstate(invalid="ignore"):
            o[nan] = flat[nan].astype(out.dtype)
    return out


def sum_half(sources: Sequence[Any], dests: Sequence[Any], scale: Optional[float],
             acc: Any) -> int:
    """``dests[:] = half(fp32(scale) * sum(widen(sources)))`` for fp16 or bf16 arrays (all
    of one dtype), one pass per few sources (the shm reduction of a chunk), bit for bit what
    :func:`widen`, ``np.add`` in the order of ``sources``, ``np.multiply`` by
    ``np.float32(scale)`` (skipped for None or 1) and :func:`narrow` give. ``acc``: fp32
    scratch of the same length. Returns how many leading elements were done: all of them,
    or fewer where a result is NaN (the caller finishes from there with the casts above,
    which decide NaN payloads), or 0 where the compiled kernel does not run here."""
    if not (_enabled() and all(_contiguous(a) for a in (*sources, *dests, acc))):
        return 0
    kernel = _kernels.sum_f16 if sources[0].dtype == float16 else _kernels.sum_bf16
    factor = None if scale is None else float(np.float32(scale))
    return int(kernel(tuple(s.reshape(-1).view(_u16) for s in sources),
                      tuple(d.reshape(-1).view(_u16) for d in dests), factor,
                      acc.reshape(-1).view(_u32)))


def sum_wide(sources: Sequence[Any], out: Any, scale: Optional[float]) -> int:
    """``out[:] = scale * sum(sources)`` for fp32 or fp64 arrays (all of one dtype, ``out``
    apart from every source) in one compiled call, bit for bit what ``np.add`` in the order
    of ``sources`` and ``np.multiply`` by ``dtype(scale)`` (skipped for None or 1) give:
    numpy's calls cost more than the sum of a small buffer (1024 fp32, 2 sources: 0.69 us
    against 1.3 us). Returns how many leading elements were done, as :func:`sum_half` (a NaN
    result stops it; 0 without the module, for other dtypes, or for arrays it cannot take:
    not C-contiguous, of other sizes, or overlapping).
    Not switched off by ``$MPIFUSION_HALFCAST``: reading it costs twice the sum, and there
    is no cast here whose rounding could differ."""
    kind = out.dtype.char
    if _kernels is None or kind not in "fd":
        return 0
    try:
        return (_kernels.sum_f32 if kind == "f" else _kernels.sum_f64)(tuple(sources), out,
                                                                        scale)
    except (BufferError, ValueError):  # not C-contiguous, other sizes, an overlap: numpy's
        return 0


def _sum_bf16_on(kernel: str, sources: Sequence[Any], dests: Sequence[Any],
                 scale: Optional[float], acc: Any) -> int:
    """:func:`sum_half` for bf16 on the named path of :func:`kernel_paths` (for tests)."""
    factor = None if scale is None else float(np.float32(scale))
    return int(_kernels.sum_bf16_at(kernel, tuple(s.reshape(-1).view(_u16) for s in sources),
                                    tuple(d.reshape(-1).view(_u16) for d in dests), factor,
                                    acc.reshape(-1).view(_u32)))


def _narrow_bf16_on(kernel: str, src: Any, out: Any) -> Any:
    """:func:`narrow` of contiguous fp32 to bf16 on the named path (for tests)."""
    s32, o16 = src.reshape(-1).view(_u32), out.reshape(-1).view(_u16)
    if _kernels.narrow_bf16_at(kernel, s32, o16):
        flat, o = src.reshape(-1), out.reshape(-1)
        nan = np.isnan(flat)
        with np.errstate(invalid="ignore"):
            o[nan] = flat[nan].astype(out.dtype)
    return out


def _contiguous(arr: Any) -> bool:
    return type(arr) is np.ndarray and arr.flags.c_contiguous


__all__ = ["widen", "narrow", "path", "kernel_path", "kernel_paths", "sum_half", "sum_wide"]
