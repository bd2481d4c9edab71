"""The one place where the array module (numpy or cupy) is chosen.

Everything else asks this module for arrays, so a buffer lives where its params live: host
params give numpy buffers, GPU params give cupy buffers on the same device.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .dtypes import as_dtype, bfloat16

try:  # optional: only on machines with a GPU build of cupy
    import cupy as _cupy  # type: ignore
except Exception:  # pragma: no cover - depends on the machine
    _cupy = None

#: byte alignment of every buffer's first element, so each 256-byte-aligned slot is aligned
#: in memory too (Paddle's allocator gives at least this).
BASE_ALIGNMENT = 256


def cupy_module() -> Any:
    return _cupy


def is_cupy(arr: Any) -> bool:
    return _cupy is not None and isinstance(arr, _cupy.ndarray)


def array_module(arr: Any) -> Any:
    return _cupy if is_cupy(arr) else np


def _is_cuda_producer(obj: Any) -> bool:
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        return int(dev()[0]) in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
    except Exception:
        return False


def asarray(obj: Any) -> Any:
    """An ndarray sharing memory with ``obj`` (numpy, cupy, or any DLPack producer)."""
    if isinstance(obj, np.ndarray) or is_cupy(obj):
        return obj
    if _is_cuda_producer(obj):
        if _cupy is None:
            raise TypeError("a GPU tensor was given but cupy is not installed "
                            "(pip install 'mpifusion[cuda]')")
        return _cupy.from_dlpack(obj)
    if hasattr(obj, "__dlpack__"):
        return _host_from_dlpack(obj)
    if isinstance(obj, (np.generic, list, tuple, int, float)):
        return np.asarray(obj)
    raise TypeError(f"expected a numpy/cupy array or a DLPack tensor, got {type(obj).__name__}")


def _host_from_dlpack(obj: Any) -> np.ndarray:
    try:
        return np.from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError):
        # numpy cannot import bfloat16 through DLPack: reinterpret the bits as uint16.
        if "bfloat16" in str(getattr(obj, "dtype", "")) and hasattr(obj, "view"):
            import torch  # only torch tensors reach here with a bfloat16 dtype and .view

            return np.from_dlpack(obj.view(torch.int16)).view(bfloat16)
        raise


def zeros(numel: int, dtype: Any, like: Any = None) -> Any:
    """A zeroed flat buffer whose first element is ``BASE_ALIGNMENT``-byte aligned."""
    dtype = as_dtype(dtype)
    if like is not None and is_cupy(like):
        with like.device:
            return _cupy.zeros(int(numel), dtype=dtype)  # cupy allocations are 512-aligned
    nbytes = int(numel) * dtype.itemsize
    raw = np.zeros(nbytes + BASE_ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % BASE_ALIGNMENT
    return raw[start:start + nbytes].view(dtype)


def empty(numel: int, dtype: Any, like: Any = None) -> Any:
    if like is not None and is_cupy(like):
        with like.device:
            return _cupy.empty(int(numel), dtype=as_dtype(dtype))
    return np.empty(int(numel), dtype=as_dtype(dtype))


def data_ptr(arr: Any) -> int:
    """Address of an array's first element (Paddle's ``data_ptr``), for the moved-grad check."""
    if arr is None:
        return 0
    if is_cupy(arr):
        return int(arr.data.ptr)
    return int(arr.__array_interface__["data"][0])


def to_host(arr: Any) -> np.ndarray:
    return _cupy.asnumpy(arr) if is_cupy(arr) else np.asarray(arr)


_SCALE_CHUNK = 1 << 20


def scale_(arr: Any, factor: float) -> None:
    """``arr *= factor`` in place, computed in fp32 for half precision (as Paddle's scale
    kernel does) in cache-sized chunks, so no full-size temporary is made."""
    if arr.dtype.itemsize >= 4:
        arr *= arr.dtype.type(factor)
        return
    xp = array_module(arr)
    f = xp.float32(factor)
    flat = arr.reshape(-1)
    for start in range(0, flat.size, _SCALE_CHUNK):
        part = flat[start:start + _SCALE_CHUNK]
        part[...] = part.astype(xp.float32) * f


def nonfinite_count(arr: Any) -> int:
    xp = array_module(arr)
    return int(arr.size - xp.count_nonzero(xp.isfinite(arr)))


def ipc_handle(arr: Any) -> Any:
    """CUDA IPC handle of a device buffer (as Paddle's ``_share_cuda``); None on the host."""
    if arr is None or not is_cupy(arr):
        return None
    return _cupy.cuda.runtime.ipcGetMemHandle(arr.data.ptr)
