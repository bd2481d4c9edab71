"""Dtype names and sizes shared by the planner, the buffers and the CLI.

numpy has no bfloat16; ml_dtypes provides one that numpy arrays (and DLPack) understand.
Dtype objects (numpy's, and ml_dtypes' bfloat16, whose import alone takes about a second)
are built on first use, so planning by name (``mpifusion layout``, spec files) imports
neither numpy nor ml_dtypes.
"""
from __future__ import annotations

from typing import Any

#: every accepted name (lower case) -> its canonical name
ALIAS_NAMES = {
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float64": "float64", "fp64": "float64", "double": "float64",
}
#: canonical name -> bytes per element, for every dtype a fused buffer may hold
ITEMSIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
HALF_NAMES = ("float16", "bfloat16")

_LAZY = ("float16", "bfloat16", "float32", "float64", "ALIASES", "SUPPORTED")


def __getattr__(name: str) -> Any:
    """The dtype objects and the tables that hold them, built on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import numpy as np

    float16, float32, float64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
    globals().update(float16=float16, float32=float32, float64=float64)
    if name in ("float16", "float32", "float64"):
        return globals()[name]
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    by_name = {"float16": float16, "bfloat16": bf16, "float32": float32, "float64": float64}
    globals().update(
        bfloat16=bf16,
        #: every accepted name (lower case) -> its numpy dtype
        ALIASES={alias: by_name[canon] for alias, canon in ALIAS_NAMES.items()},
        #: dtypes a fused buffer may hold (Paddle fuses fp16/bf16/fp32; fp64 for oracles)
        SUPPORTED=(float16, bf16, float32, float64))
    return globals()[name]


class _HalfDtypes:
    """The half-precision dtypes (MPI cannot sum bf16 natively, nor fp16 fast), tested by
    name: ``x.dtype in HALF`` must not import ml_dtypes for an fp32 buffer. Its import takes
    0.6 s of CPU with ml_dtypes 0.7 (60 ms with 0.6), paid by every rank of every job; an
    array that is bf16 already had it imported."""

    def __init__(self) -> None:
        self._seen: "dict[Any, bool]" = {}  # numpy builds a dtype's name in Python: 6 us

    def __contains__(self, value: Any) -> bool:
        try:
            return self._seen[value]
        except (KeyError, TypeError):  # TypeError: unhashable
            pass
        answer = is_half(value)
        try:
            self._seen[value] = answer
        except TypeError:
            pass
        return answer

    def __iter__(self) -> Any:
        return iter((__getattr__("float16"), __getattr__("bfloat16")))

    def __repr__(self) -> str:
        return "HALF(float16, bfloat16)"


HALF = _HalfDtypes()


def as_dtype(value: Any) -> Any:
    """Normalise a name, numpy dtype or framework dtype (torch.bfloat16, ...) to a numpy dtype."""
    import numpy as np

    if isinstance(value, np.dtype):
        return value
    if isinstance(value, str):
        key = value.lower()
    else:
        key = str(value).lower().rsplit(".", 1)[-1]  # torch.float32 -> float32
    canon = ALIAS_NAMES.get(key)
    if canon == "bfloat16":
        return __getattr__("bfloat16")
    if canon is not None:
        return np.dtype(canon)
    try:
        return np.dtype(value)
    except TypeError:
        raise ValueError(f"unknown dtype {value!r}: expected one of "
                         f"{sorted(ITEMSIZES)}") from None


def _known_name(value: Any) -> Any:
    """The canonical name of a dtype given by one of our names, else None (no import)."""
    return ALIAS_NAMES.get(value.lower()) if isinstance(value, str) else None


def dtype_name(value: Any) -> str:
    """Canonical name ('bfloat16', 'float32', ...) used in layouts and JSON."""
    return _known_name(value) or as_dtype(value).name


def itemsize(value: Any) -> int:
    canon = _known_name(value)
    return ITEMSIZES[canon] if canon else as_dtype(value).itemsize


def is_half(value: Any) -> bool:
    return dtype_name(value) in HALF_NAMES


def finfo(value: Any) -> Any:
    """Machine limits of a float dtype, bfloat16 included: numpy's ``finfo`` refuses
    bfloat16 with ml_dtypes before 0.7 (the newest on Python 3.9 is 0.5), ml_dtypes' own
    ``finfo`` gives the same fields for it."""
    import numpy as np

    dtype = as_dtype(value)
    if dtype.name == "bfloat16":
        import ml_dtypes  # loaded already: a bfloat16 dtype came from it

        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)
