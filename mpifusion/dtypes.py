"""Dtype names and sizes shared by the planner, the buffers and the CLI.

numpy has no bfloat16; ml_dtypes provides one that numpy arrays (and DLPack) understand.
"""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)

#: every accepted name (lower case) -> its numpy dtype
ALIASES = {
    "float16": float16, "fp16": float16, "half": float16,
    "bfloat16": bfloat16, "bf16": bfloat16,
    "float32": float32, "fp32": float32, "float": float32,
    "float64": float64, "fp64": float64, "double": float64,
}

#: dtypes a fused buffer may hold (Paddle fuses fp16/bf16/fp32; fp64 is here for oracles).
SUPPORTED = (float16, bfloat16, float32, float64)
#: half-precision dtypes: MPI cannot sum them natively (bf16) or fast (fp16).
HALF = (float16, bfloat16)


def as_dtype(value: Any) -> np.dtype:
    """Normalise a name, numpy dtype or framework dtype (torch.bfloat16, ...) to a numpy dtype."""
    if isinstance(value, np.dtype):
        return value
    if isinstance(value, str):
        key = value.lower()
    else:
        key = str(value).lower().rsplit(".", 1)[-1]  # torch.float32 -> float32
    if key in ALIASES:
        return ALIASES[key]
    try:
        return np.dtype(value)
    except TypeError:
        raise ValueError(f"unknown dtype {value!r}: expected one of "
                         f"{sorted(set(d.name for d in SUPPORTED))}") from None


def dtype_name(value: Any) -> str:
    """Canonical name ('bfloat16', 'float32', ...) used in layouts and JSON."""
    return as_dtype(value).name


def itemsize(value: Any) -> int:
    return as_dtype(value).itemsize


def is_half(value: Any) -> bool:
    return as_dtype(value) in HALF
