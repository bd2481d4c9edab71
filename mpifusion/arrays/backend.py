"""The one place where the array module (numpy or cupy) is chosen.

Everything else asks this module for arrays, so a buffer lives where its params live: host
params give numpy buffers, GPU params give cupy buffers on the same device.
"""
from __future__ import annotations

import ctypes
import sys
from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from .. import dtypes
from ..dtypes import as_dtype

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


# DLPack device types (dlpack.h): where a producer's memory lives.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_ROCM, _DL_ROCM_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 10, 11, 13
_DL_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                    9: "vpi", 10: "rocm", 11: "rocm_host", 13: "cuda_managed", 14: "oneapi"}
_GPU_DEVICES = (_DL_CUDA, _DL_ROCM, _DL_CUDA_MANAGED)


def _dlpack_device(obj: Any) -> Optional[tuple]:
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None:
        return None
    try:
        kind, index = dev()
        return int(kind), int(index)
    except Exception:
        return None


def _is_cuda_producer(obj: Any) -> bool:
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dev = _dlpack_device(obj)
    return dev is not None and dev[0] in _GPU_DEVICES


def lazy_bits(obj: Any) -> Optional[str]:
    """Which of PyTorch's lazy bits ``obj`` has set ("negation", "conjugation"), else None.

    A tensor with one (``x.conj().imag``, ``torch._neg_view(x)``, ``z.conj()``) holds other
    values than its memory: DLPack exports the memory and drops the bit (numpy and cupy
    read ``-x`` as ``x``), so such a tensor cannot be shared, only resolved into a copy.
    """
    torch = sys.modules.get("torch")  # a torch tensor implies torch was imported
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    bits = [what for what, is_set in (("negation", obj.is_neg), ("conjugation", obj.is_conj))
            if is_set()]
    return " and ".join(bits) or None


def asarray(obj: Any, resolve_lazy: bool = True) -> Any:
    """An ndarray sharing memory with ``obj`` (numpy, cupy, or any DLPack producer).

    Nothing is copied: a framework tensor handed in (PyTorch, JAX, CuPy, ...) and the array
    returned are the same memory. bfloat16, which numpy and cupy cannot import through
    DLPack, is read from the DLPack capsule directly.

    The exception: a PyTorch tensor with its negation or conjugation bit set (see
    :func:`lazy_bits`), whose memory is not its value. With ``resolve_lazy`` (for a value
    read once, such as a grad handed to ``add_grad``) it is resolved into a copy first;
    without (an array that must stay shared, such as a ``Param``'s) it is a ``TypeError``.

    Whatever cannot be imported is a ``TypeError``, with the producer's own words: a numpy
    masked array (its masked elements have no value, yet arithmetic on its memory would use
    them), and any failure of a producer's export (a ragged list, a ``__dlpack__`` raising
    ``ValueError``/``KeyError`` or returning no capsule), which would otherwise escape as
    whatever the producer raised.
    """
    if isinstance(obj, np.ndarray) or is_cupy(obj):
        if isinstance(obj, np.ma.MaskedArray):
            raise TypeError("a numpy masked array was given: its masked elements have no "
                            "value, but its memory would be used as it is; expected a plain "
                            "array (.filled(0) gives one with zeros under the mask)")
        return obj
    try:
        return _import(obj, resolve_lazy)
    except TypeError:
        raise
    except Exception as exc:  # the producer's own error, of any type
        words = (str(exc) if isinstance(exc, (BufferError, RuntimeError, ValueError))
                 else f"{type(exc).__name__}: {exc}")
        raise TypeError(f"could not import a {type(obj).__name__}: {words}") from None


def shared_array(obj: Any) -> Any:
    """The ndarray sharing memory with ``obj`` (see :func:`asarray`), or None when ``obj``
    cannot be shared (None, not an array, a tensor with a lazy bit, a failing producer):
    to ask whether an object someone set (a param's grad) is a view of a buffer."""
    if obj is None:
        return None
    try:
        return asarray(obj, resolve_lazy=False)
    except TypeError:
        return None


def _import(obj: Any, resolve_lazy: bool) -> Any:
    lazy = lazy_bits(obj)
    if lazy is not None:
        if not resolve_lazy:
            raise TypeError(f"a torch tensor with its {lazy} bit set was given: its memory is "
                            f"not its value, so it cannot be shared (DLPack would drop the "
                            f"bit); expected a tensor without it (.resolve_neg() / "
                            f".resolve_conj() make one, a copy)")
        obj = obj.resolve_conj().resolve_neg()
    if _is_cuda_producer(obj):
        if _cupy is None:
            raise TypeError("a GPU tensor was given but cupy is not installed "
                            "(pip install 'mpifusion[cuda]')")
        try:
            return _cupy.from_dlpack(obj)
        except Exception as exc:
            if "bfloat16" in str(getattr(obj, "dtype", "")):
                raise TypeError(f"a bfloat16 GPU tensor was given, but this cupy cannot hold "
                                f"bfloat16 ({exc})") from None
            raise
    if hasattr(obj, "__dlpack__"):
        dev = _dlpack_device(obj)
        if dev is not None and dev[0] not in (_DL_CPU, _DL_CUDA_HOST, _DL_ROCM_HOST):
            raise TypeError(f"a tensor on device {_DL_DEVICE_NAMES.get(dev[0], dev[0])}:{dev[1]} "
                            f"was given: expected a CPU (numpy) or CUDA (cupy) tensor")
        return _host_from_dlpack(obj)
    if isinstance(obj, (np.generic, list, tuple, int, float)):
        return np.asarray(obj)
    raise TypeError(f"expected a numpy/cupy array or a DLPack tensor, got {type(obj).__name__}")


def _host_from_dlpack(obj: Any) -> np.ndarray:
    try:
        return np.from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError):
        # numpy cannot import bfloat16 through DLPack: read the capsule ourselves.
        if "bfloat16" in str(getattr(obj, "dtype", "")):
            return _dlpack_bfloat16(obj)
        raise


# --------------------------------------------------------------------------- DLPack by hand
# numpy refuses DLPack's bfloat16 (kDLBfloat); ml_dtypes' bfloat16 has the same bits. The
# structs below are dlpack.h's (v0.8 legacy and v1.x versioned); only CPU memory is read.


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor)))]


class _DLManagedTensorVersioned(ctypes.Structure):
    pass


_DLManagedTensorVersioned._fields_ = [
    ("version_major", ctypes.c_uint32), ("version_minor", ctypes.c_uint32),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensorVersioned))),
    ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]

_DL_BFLOAT = 4
_DL_FLAG_READ_ONLY = 1
_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype, _capsule_get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule_rename = ctypes.pythonapi.PyCapsule_SetName
_capsule_rename.restype, _capsule_rename.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]


class _DLPackOwner:
    """Keeps a consumed DLPack tensor alive; calls its deleter when the last view dies."""

    def __init__(self, managed: Any, interface: dict) -> None:
        self._managed = managed
        self.__array_interface__ = interface

    def __del__(self) -> None:
        managed, self._managed = self._managed, None
        if managed is not None and managed.contents.deleter:
            managed.contents.deleter(managed)


def _dlpack_bfloat16(obj: Any) -> np.ndarray:
    """A zero-copy ml_dtypes bfloat16 view of a CPU DLPack bfloat16 tensor."""
    try:
        capsule, name, kind = obj.__dlpack__(max_version=(1, 0)), b"dltensor_versioned", _DLManagedTensorVersioned
    except TypeError:
        capsule, name, kind = obj.__dlpack__(), b"dltensor", _DLManagedTensor
    if ctypes.pythonapi.PyCapsule_IsValid(ctypes.py_object(capsule), name) != 1:
        name, kind = b"dltensor", _DLManagedTensor  # an old producer ignoring max_version
    managed = ctypes.cast(_capsule_get(capsule, name), ctypes.POINTER(kind))
    dl = managed.contents.dl_tensor
    readonly = kind is _DLManagedTensorVersioned and bool(managed.contents.flags & _DL_FLAG_READ_ONLY)
    if (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) != (_DL_BFLOAT, 16, 1):
        raise TypeError(f"expected a bfloat16 DLPack tensor, got type code {dl.dtype.code} "
                        f"with {dl.dtype.bits} bits x {dl.dtype.lanes} lanes")
    if dl.device.device_type not in (_DL_CPU, _DL_CUDA_HOST, _DL_ROCM_HOST):
        raise TypeError(f"expected a CPU bfloat16 tensor, got DLPack device {dl.device.device_type}")
    shape = tuple(dl.shape[i] for i in range(dl.ndim))
    strides = None if not dl.strides else tuple(2 * dl.strides[i] for i in range(dl.ndim))
    interface = {"shape": shape, "typestr": "<u2", "strides": strides, "version": 3,
                 "data": ((dl.data or 0) + dl.byte_offset, readonly)}
    # Now ours: rename so the capsule's destructor leaves the tensor to _DLPackOwner.
    _capsule_rename(capsule, b"used_" + name)
    return np.asarray(_DLPackOwner(managed, interface)).view(dtypes.bfloat16)


def device_of(arr: Any) -> str:
    """Where an array lives, as frameworks write it: ``"cpu"`` or ``"cuda:N"``."""
    if is_cupy(arr):
        return f"cuda:{arr.device.id}"
    return "cpu"


def to_torch(arr: Any) -> Any:
    """A ``torch.Tensor`` sharing memory with ``arr`` (a buffer view: data, grad, main_grad).

    Writing into the tensor (``t += g``, ``t.copy_(g)``) writes into the fused buffer, which
    is how a framework accumulates grads straight into the bucket (DDP's
    ``gradient_as_bucket_view``). bfloat16 goes through its int16 bits.

    Args:
        arr: a numpy or cupy array (None gives None).

    Returns:
        The tensor, on the array's device, or None.
    """
    import torch

    if arr is None:
        return None
    if arr.dtype.name == "bfloat16":
        return torch.from_dlpack(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_dlpack(arr)


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


def byte_span(arr: Any) -> tuple:
    """``[low, high)``: the bytes an array's elements occupy. Not ``data_ptr + nbytes``:
    a view with negative strides lies below its first element, a gapped one beyond."""
    low = high = data_ptr(arr)
    if arr.size == 0:
        return low, low
    for n, stride in zip(arr.shape, arr.strides):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + arr.dtype.itemsize


def overlaps(a: Any, b: Any) -> bool:
    """Whether two arrays' byte spans meet (they may share memory)."""
    a0, a1 = byte_span(a)
    b0, b1 = byte_span(b)
    return a0 < b1 and b0 < a1 and a0 < a1 and b0 < b1


def same_view(a: Any, b: Any) -> bool:
    """Whether two arrays are the same view of the same memory: address, shape, dtype, and
    strides wherever they matter (a dimension of size 1 has none that do; frameworks set
    them freely). The address alone is not: a transposed, reshaped or reinterpreted view
    starts there too."""
    if a is b:
        return True
    if (data_ptr(a) != data_ptr(b) or tuple(a.shape) != tuple(b.shape)
            or a.dtype != b.dtype):
        return False
    return all(n <= 1 or sa == sb for n, sa, sb in zip(a.shape, a.strides, b.strides))


def to_host(arr: Any) -> np.ndarray:
    return _cupy.asnumpy(arr) if is_cupy(arr) else np.asarray(arr)


#: elements per chunk of a half-precision scale: 256 KiB of fp32 scratch, stays in cache.
_SCALE_CHUNK = 1 << 16


def scaling(arr: Any, factor: float) -> Optional[Callable[[], Any]]:
    """:func:`scale_` of ``arr`` by ``factor``, prepared now to run later (None: nothing to
    do): a small collective scales in its last step, where a microsecond counts."""
    if float(factor) == 1.0:
        return None
    if arr.dtype.itemsize >= 4:
        return partial(arr.__imul__, arr.dtype.type(factor))  # what scale_ computes
    return partial(scale_, arr, factor)


def scale_(arr: Any, factor: float) -> None:
    """``arr *= factor`` in place, computed in fp32 for half precision (as Paddle's scale
    kernel does) through one cache-sized fp32 scratch, so no full-size temporary is made."""
    if float(factor) == 1.0:
        return  # x * 1 == x exactly: skip a pass over the buffer
    if arr.dtype.itemsize >= 4:
        arr *= arr.dtype.type(factor)
        return
    if arr.ndim > 1 and not arr.flags.c_contiguous:
        # reshape(-1) would copy, and the copy, not arr, would be scaled
        if arr.flags.f_contiguous:
            scale_(arr.T, factor)
        else:
            for row in arr:
                scale_(row, factor)
        return
    xp = array_module(arr)
    f = xp.float32(factor)
    flat = arr.reshape(-1)
    scratch = xp.empty(min(flat.size, _SCALE_CHUNK), dtype=xp.float32)
    # the rounding back is ours, not the caller's arithmetic: a caller's np.seterr('raise')
    # must not stop it part-way (numpy flags an fp16 subnormal result as underflow)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for start in range(0, flat.size, _SCALE_CHUNK):
            part = flat[start:start + _SCALE_CHUNK]
            tmp = scratch[:part.size]
            tmp[...] = part
            xp.multiply(tmp, f, out=tmp)
            part[...] = tmp


def nonfinite_count(arr: Any) -> int:
    xp = array_module(arr)
    return int(arr.size - xp.count_nonzero(xp.isfinite(arr)))


class IpcMeta(NamedTuple):
    """What another process on the node needs to map a device buffer (Paddle's
    ``_share_cuda`` tuple): the CUDA IPC handle of the allocation holding the buffer, the
    buffer's byte offset in it (cupy's pool carves buffers out of larger allocations), and
    its size, dtype and device."""

    handle: bytes
    offset: int
    nbytes: int
    dtype: str
    shape: tuple
    device: int


def _allocation_base(ptr: int) -> int:
    """Start of the cudaMalloc allocation that holds ``ptr`` (cuMemGetAddressRange)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    fn = getattr(libcuda, "cuMemGetAddressRange_v2", None) or libcuda.cuMemGetAddressRange
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    err = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if err != 0:
        raise RuntimeError(f"cuMemGetAddressRange failed with CUDA error {err}")
    return int(base.value)


def ipc_handle(arr: Any) -> Optional[IpcMeta]:
    """CUDA IPC metadata of a device buffer (as Paddle's ``_share_cuda``); None on the host."""
    if arr is None or not is_cupy(arr):
        return None
    with arr.device:
        ptr = int(arr.data.ptr)
        base = _allocation_base(ptr)
        handle = bytes(_cupy.cuda.runtime.ipcGetMemHandle(base))
    return IpcMeta(handle, ptr - base, int(arr.nbytes), arr.dtype.name, tuple(arr.shape),
                   int(arr.device.id))


def open_ipc(meta: IpcMeta) -> Any:
    """In another process: a cupy array over the buffer ``meta`` describes (no copy).

    Close it with ``cupy.cuda.runtime.ipcCloseMemHandle(arr.data.mem.ptr)`` when done.
    """
    if _cupy is None:
        raise TypeError("open_ipc: needs cupy (pip install 'mpifusion[cuda]')")
    with _cupy.cuda.Device(meta.device):
        base = _cupy.cuda.runtime.ipcOpenMemHandle(meta.handle)
        mem = _cupy.cuda.UnownedMemory(base, meta.offset + meta.nbytes, owner=None,
                                       device_id=meta.device)
        ptr = _cupy.cuda.MemoryPointer(mem, meta.offset)
        return _cupy.ndarray(meta.shape, dtype=as_dtype(meta.dtype), memptr=ptr)
