"""GPU buffers and MPI: is this MPI CUDA-aware, and host staging when it is not.

Communication code calls these around every collective on a cupy buffer: ``synchronize``
before MPI reads device memory (kernels writing the grads may still be queued), and, when
the MPI cannot read device memory, ``stage`` / ``unstage`` through pinned host memory.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from . import backend

#: "1"/"0" forces the answer of :func:`is_cuda_aware` (for MPIs that cannot be asked).
CUDA_AWARE_ENV = "MPIFUSION_CUDA_AWARE"

_cuda_aware: Optional[bool] = None


def query_cuda_aware() -> bool:
    """What the MPI library says of itself (MPIX_Query_cuda_support in Open MPI / MPICH)."""
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)  # mpi4py >= 4 exposes MPIX's query
    if query is not None:
        try:
            return bool(query())
        except Exception:
            return False
    return False


def is_cuda_aware() -> bool:
    global _cuda_aware
    override = os.environ.get(CUDA_AWARE_ENV, "").strip().lower()
    if override in ("1", "true", "yes", "on"):
        return True
    if override in ("0", "false", "no", "off"):
        return False
    if _cuda_aware is None:
        _cuda_aware = query_cuda_aware()
    return _cuda_aware


def synchronize(arr: Any) -> None:
    """Wait for queued work on the current stream of ``arr``'s device before MPI touches it."""
    if backend.is_cupy(arr):
        with arr.device:
            backend.cupy_module().cuda.get_current_stream().synchronize()


def stage(arr: Any) -> Any:
    """A pinned host copy of a device array (the array itself when it is on the host)."""
    if not backend.is_cupy(arr):
        return arr
    cp = backend.cupy_module()
    mem = cp.cuda.alloc_pinned_memory(arr.nbytes)
    host = np.frombuffer(mem, dtype=arr.dtype, count=arr.size).reshape(arr.shape)
    arr.get(out=host)
    return host


def unstage(host: Any, arr: Any) -> None:
    """Copy a staged host result back into its device array."""
    if host is not arr:
        arr.set(host)
