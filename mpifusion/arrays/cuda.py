"""GPU buffers and MPI: is this MPI CUDA-aware, and host staging when it is not.

Communication code calls these around every collective on a cupy buffer: ``synchronize``
before MPI reads device memory (kernels writing the grads may still be queued), and, when
the MPI cannot read device memory, ``stage`` / ``unstage`` through pinned host memory.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from typing import Any, Optional

import numpy as np

from ..config import CUDA_AWARE_ENV, cuda_aware_from_env  # noqa: F401 (re-exported)
from . import backend

#: "1"/"0" forces the answer of :func:`is_cuda_aware` (for MPIs that cannot be asked).

_cuda_aware: Optional[bool] = None


def query_cuda_aware() -> bool:
    """What the MPI library says of itself: ``MPIX_Query_cuda_support()`` (Open MPI, MPICH).

    mpi4py does not wrap it, so the symbol is looked up in the libmpi this process loaded;
    an MPI without the query counts as not CUDA-aware (staging is always correct).
    """
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)  # in case a later mpi4py wraps it
    if query is not None:
        try:
            return bool(query())
        except Exception:
            return False
    for lib in _loaded_mpi_libraries():
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = []
            return bool(fn())
    return False


def _loaded_mpi_libraries() -> list:
    """The MPI shared libraries mapped into this process (the ones mpi4py is linked to)."""
    paths: list = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if re.search(r"/lib(mpi|mpich|mpi_ibm|msmpi)[^/]*\.so", path) and path not in paths:
                    paths.append(path)
    except OSError:  # not Linux: ask the dynamic loader for the usual names
        paths = [p for p in (ctypes.util.find_library("mpi"),) if p]
    libs = []
    for path in paths:
        try:
            libs.append(ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)))
        except OSError:
            continue
    return libs


def is_cuda_aware() -> bool:
    """Whether MPI may be handed device memory: ``$MPIFUSION_CUDA_AWARE`` if set, else
    :func:`query_cuda_aware` (asked once per process)."""
    global _cuda_aware
    override = cuda_aware_from_env()
    if override is not None:
        return override
    if _cuda_aware is None:
        _cuda_aware = query_cuda_aware()
    return _cuda_aware


def synchronize(arr: Any) -> None:
    """Wait for queued work on the current stream of ``arr``'s device before MPI touches it."""
    if backend.is_cupy(arr):
        with arr.device:
            backend.cupy_module().cuda.get_current_stream().synchronize()


#: what the staged path allocated in this process (pinned host bytes), for memory reports.
staging_stats = {"stages": 0, "pinned_bytes": 0}


def reset_staging_stats() -> None:
    staging_stats.update(stages=0, pinned_bytes=0)


def gpu_available() -> bool:
    """True when cupy is importable and sees at least one GPU (tests skip otherwise)."""
    cp = backend.cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def stage(arr: Any) -> Any:
    """A pinned host copy of a device array (the array itself when it is on the host).

    The copy is complete when this returns; pinned memory comes from cupy's pinned pool, so
    a buffer staged every step reuses the same host pages.
    """
    if not backend.is_cupy(arr):
        return arr
    cp = backend.cupy_module()
    with arr.device:
        mem = cp.cuda.alloc_pinned_memory(arr.nbytes)
        host = np.frombuffer(mem, dtype=arr.dtype, count=arr.size).reshape(arr.shape)
        arr.get(out=host, blocking=True)
    staging_stats["stages"] += 1
    staging_stats["pinned_bytes"] += arr.nbytes
    return host


def unstage(host: Any, arr: Any) -> None:
    """Copy a staged host result back into its device array, finished before returning
    (the pinned pages go back to the pool right after)."""
    if host is arr:
        return
    with arr.device:
        arr.set(host)
        backend.cupy_module().cuda.get_current_stream().synchronize()
