"""GPU buffers and MPI: is this MPI CUDA-aware, and host staging when it is not.

Communication code calls these around every collective on a cupy buffer: ``synchronize``
before MPI reads device memory (kernels writing the grads may still be queued); when the MPI
cannot read device memory, ``staging.py`` pipelines segments through pinned host slots.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from typing import Any, Optional


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
staging_stats = {"pinned_bytes": 0}


def reset_staging_stats() -> None:
    staging_stats.update(pinned_bytes=0)


def gpu_available() -> bool:
    """True when cupy is importable and sees at least one GPU (tests skip otherwise)."""
    cp = backend.cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
