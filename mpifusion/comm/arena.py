"""The buffers' shared memory for the ``shm`` strategy: an arena of files that mpifusion maps
itself, sub-allocated into page-aligned regions (``shm.py``'s module docstring says why it is
not made of MPI windows, and the rules it keeps).

Everything here is local to a rank except :meth:`Arena.grow`, which the node's ranks run
together (its agreements go through the owning :class:`~mpifusion.comm.shm.NodeMemory`).
Pages are reserved with ``posix_fallocate`` whenever a region is made or reused, so a full
/dev/shm is an agreed fallback at construction, never a SIGBUS at the first write; a dead
region gives its pages back (``MADV_REMOVE``) and its room is reused.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import numpy as np

if TYPE_CHECKING:
    from .shm import NodeMemory

#: every region starts on its own page: aligned for any dtype (and backend.BASE_ALIGNMENT),
#: and its first touch by the owner places it on the owner's NUMA node
PAGE = 4096
#: where the arena's files live (where the MPI libraries put their shared windows too)
SHM_FOLDER = "/dev/shm"
#: the prefix of the arena's files in ``SHM_FOLDER`` (what a leftovers check looks for)
FILE_PREFIX = "mpifusion."


def round_up(n: int, unit: int = PAGE) -> int:
    return -(-n // unit) * unit


def free_bytes(folder: str = SHM_FOLDER) -> Optional[int]:
    """Bytes free in the file system that backs shared memory (None: unknown). A mapping
    larger than that maps fine and then kills the process with SIGBUS at the first touch of a
    missing page (a container's /dev/shm is often 64 MiB): the arena reserves its pages
    (``posix_fallocate``), and a control window is checked against this (its pages are all
    written at once, and the arena's are reserved, so the figure is real)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


_MADV_REMOVE = 9  # Linux: free a shared mapping's pages and their backing store
_PROT_RW, _MAP_SHARED, _MAP_FAILED = 3, 1, ctypes.c_void_p(-1).value


def _libc() -> Tuple[Optional[Callable[..., int]], Optional[Callable[..., int]],
                     Optional[Callable[..., int]]]:
    """libc's ``madvise``, ``mmap`` and ``munmap`` (Nones where there is no such libc)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise, mmap_fn, munmap_fn = libc.madvise, libc.mmap, libc.munmap
    except (OSError, AttributeError):
        return None, None, None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    mmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                        ctypes.c_int, ctypes.c_long]
    mmap_fn.restype = ctypes.c_void_p
    munmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    munmap_fn.restype = ctypes.c_int
    return madvise, mmap_fn, munmap_fn


_MADVISE, _MMAP, _MUNMAP = _libc()
if not sys.platform.startswith("linux"):
    _MADVISE = None  # MADV_REMOVE is Linux's


def _give_back(addr: int, nbytes: int) -> bool:
    """``madvise(MADV_REMOVE)`` the pages from ``addr`` (a page start) to the page end past
    ``nbytes``: True where they went back to the system."""
    if _MADVISE is None or addr % PAGE or nbytes == 0:
        return False
    return _MADVISE(addr, round_up(nbytes), _MADV_REMOVE) == 0


def punch(region: np.ndarray) -> bool:
    """Give an arena region's pages back to the system (they read as zeros when touched
    again), so ``release_grads`` saves memory with ``shm`` as it does with fresh arrays.
    Local: the chunk stays mapped on every rank. ``region`` starts on a page and owns the
    rest of its last page (``NodeMemory.reserve``). False where the system refused (then
    nothing changed and the region keeps its values). Before the region is written again its
    pages must be reserved again (:func:`refill`): a touch of a missing page with /dev/shm
    full is SIGBUS."""
    return _give_back(region.ctypes.data, region.nbytes)


class _Mapping:
    """One file mapped shared, read-write (libc ``mmap``: no descriptor kept, unlike Python's
    ``mmap``); unmapped when the last array of it is gone (``__del__``). Its
    ``__array_interface__`` makes it the base of :attr:`array`, so any array over the
    mapping keeps it alive."""

    def __init__(self, fd: int, nbytes: int) -> None:
        if _MMAP is None:
            raise OSError(errno.ENOSYS, "no libc mmap")
        addr = _MMAP(None, nbytes, _PROT_RW, _MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {nbytes} bytes: {os.strerror(err)}")
        self.addr, self.nbytes = addr, nbytes
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def array(self) -> np.ndarray:
        return np.asarray(self)

    def __del__(self) -> None:
        if _MUNMAP is not None and self.addr:
            _MUNMAP(self.addr, self.nbytes)
            self.addr = 0


class Chunk:
    """One chunk of an arena: ``nbytes`` of shared memory per rank of the node (rank r's in
    its own file, mapped by every rank: ``segments[r]``). ``serial`` names it across the
    ranks (chunks are added together, in the same order, on every rank). ``fd``: the
    owner's descriptor of its own file, kept to reserve punched pages again (:func:`refill`);
    closed with the chunk."""

    def __init__(self, serial: int, nbytes: int, fd: int, segments: List[np.ndarray],
                 rank: int) -> None:
        self.serial, self.nbytes, self.fd = serial, nbytes, fd
        self.segments = segments
        self.mine = segments[rank]
        self.base = self.mine.ctypes.data
        #: free extents of this rank's part, ``[offset, length]``, sorted, merged
        self.free: List[List[int]] = [[0, nbytes]]

    def take(self, nbytes: int) -> Optional[int]:
        """First fit: the offset of ``nbytes`` taken from the free extents, or None."""
        for i, (off, length) in enumerate(self.free):
            if length >= nbytes:
                if length == nbytes:
                    del self.free[i]
                else:
                    self.free[i] = [off + nbytes, length - nbytes]
                return off
        return None

    def give(self, off: int, nbytes: int) -> None:
        """Put an extent back (merged with its neighbours)."""
        free = self.free
        i = 0
        while i < len(free) and free[i][0] < off:
            i += 1
        free.insert(i, [off, nbytes])
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i][1] += free.pop(i + 1)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1][1] += free.pop(i)[1]

    def reserve_pages(self, off: int, nbytes: int) -> int:
        """``posix_fallocate`` the extent (its pages exist from now on: no SIGBUS at the
        first touch); 0, or the errno (ENOSPC: /dev/shm is full)."""
        try:
            os.posix_fallocate(self.fd, off, nbytes)
        except OSError as exc:
            return exc.errno or errno.EIO
        return 0

    def close(self) -> None:
        """Close the owner's descriptor (its pages can no longer be reserved again)."""
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    __del__ = close


def _region_gone(chunk: Chunk, off: int, nbytes: int, freed: List[Tuple[Chunk, int, int]]
                 ) -> None:
    """A region's last array is gone (weakref finalizer: any thread, inside a garbage
    collection too): give its pages back now, and queue its extent for the arena (taken under
    its lock at the next reservation). Nothing collective, nothing that can block."""
    if nbytes and not _give_back(chunk.base + off, nbytes):
        ctypes.memset(chunk.base + off, 0, nbytes)  # not given back: zero, as reuse expects
    freed.append((chunk, off, nbytes))


class Arena:
    """The buffers' shared memory of one node communicator: chunks added collectively, regions
    placed and freed locally (see the module doc)."""

    def __init__(self, memory: "NodeMemory", token: int) -> None:
        self.memory = memory
        self.token = token
        self.chunks: Dict[int, Chunk] = {}
        self._serials = itertools.count()
        #: extents of regions whose arrays are gone, put back under the lock by :meth:`_collect`
        self._freed: List[Tuple[Chunk, int, int]] = []
        self._lock = threading.Lock()

    def path(self, serial: int, rank: int) -> str:
        return os.path.join(SHM_FOLDER, f"{FILE_PREFIX}{self.token:012x}.{serial}.{rank}")

    def _collect(self) -> None:
        while self._freed:
            chunk, off, nbytes = self._freed.pop()
            if self.chunks.get(chunk.serial) is chunk:
                chunk.give(off, nbytes)

    def place(self, nbytes: int) -> Tuple[Optional[Chunk], int, int]:
        """``(chunk, offset, 0)`` of ``nbytes`` taken first-fit from this rank's chunks, pages
        reserved; ``(None, 0, 0)`` where no chunk has room; ``(None, 0, errno)`` where the
        room's pages could not be reserved again (local: the caller agrees)."""
        with self._lock:
            self._collect()
            for chunk in self.chunks.values():
                off = chunk.take(nbytes)
                if off is None:
                    continue
                err = chunk.reserve_pages(off, nbytes)
                if err:
                    chunk.give(off, nbytes)
                    return None, 0, err
                return chunk, off, 0
        return None, 0, 0

    def take(self, chunk: Chunk, nbytes: int) -> int:
        """The offset of ``nbytes`` taken from ``chunk``, just made by :meth:`grow` for them
        (its pages reserved already)."""
        with self._lock:
            off = chunk.take(nbytes)
        if off is None:
            raise RuntimeError(f"a new chunk of {chunk.nbytes} bytes has no room for {nbytes}")
        return off

    def unplace(self, chunk: Chunk, off: int, nbytes: int) -> None:
        """Undo :meth:`place` (the ranks agreed not to use the region)."""
        _give_back(chunk.base + off, nbytes)
        with self._lock:
            chunk.give(off, nbytes)

    def grow(self, nbytes: int, where: str) -> Tuple[Optional[Chunk], str]:
        """A new chunk of ``nbytes`` per rank (collective over the node, agreed: two
        all-reduces), or ``(None, reason)`` on every rank where some rank could not make or
        map its part (no space: the reason names the bytes wanted and free)."""
        serial = next(self._serials)
        size = self.memory.size
        path = self.path(serial, self.memory.rank)
        fd, error = -1, 0
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            error = exc.errno or errno.EIO
        free = free_bytes()
        failed, nospace, most_free = self.memory.agree_max(
            [int(bool(error)), int(error == errno.ENOSPC), -(free if free is not None else -1)],
            f"{where}: shared memory")
        segments: List[np.ndarray] = []
        if not failed:  # every file exists at its full size: map them all
            try:
                for q in range(size):
                    if q == self.memory.rank:
                        segments.append(_Mapping(fd, nbytes).array())
                        continue
                    peer = os.open(self.path(serial, q), os.O_RDWR)
                    try:
                        segments.append(_Mapping(peer, nbytes).array())
                    finally:
                        os.close(peer)
            except OSError as exc:
                error = exc.errno or errno.EIO
            failed = self.memory.agree_max([int(bool(error))], f"{where}: shared memory")[0]
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(path)  # every rank mapped it (or gave up): nothing stays in /dev/shm
        if failed:
            if fd >= 0:
                os.close(fd)
            if nospace:
                least = -int(most_free)
                return None, (f"{nbytes * size} bytes of shared memory wanted on the node "
                              f"({nbytes} per rank), {SHM_FOLDER} has "
                              f"{'?' if least < 0 else least} free")
            return None, (f"rank {self.memory.rank}: shared memory: "
                          f"{os.strerror(error) if error else 'failed on another rank'}")
        chunk = self.chunks[serial] = Chunk(serial, nbytes, fd, segments, self.memory.rank)
        return chunk, ""

    def region(self, chunk: Chunk, off: int, nbytes: int) -> memoryview:
        """This rank's bytes ``[off, off + nbytes)`` of ``chunk``."""
        return memoryview(chunk.mine)[off:off + nbytes]

    def track(self, region: np.ndarray, chunk: Chunk, off: int, nbytes: int) -> None:
        """``region`` (an array of its own over ``[off, off + nbytes)`` of ``chunk``) gives
        its room back to this arena when its last array dies."""
        _REGION_OF[id(region)] = (chunk, off, round_up(nbytes))
        weakref.finalize(region, _forget_region, id(region), chunk, off, round_up(nbytes),
                         self._freed)

    def locate(self, ptr: int, end: int) -> Tuple[int, int]:
        for serial, chunk in list(self.chunks.items()):
            if chunk.base <= ptr and end <= chunk.base + chunk.nbytes:
                return serial, ptr - chunk.base
        return -1, 0


#: ``id`` of a live region array -> (chunk, offset, bytes): what :func:`refill` reserves
#: again, and the regions alive for leak checks (removed by the region's finalizer, so an
#: id is never stale)
_REGION_OF: Dict[int, Tuple[Chunk, int, int]] = {}


def refill(region: np.ndarray) -> str:
    """Reserve the pages of an arena region again before it is reused (after :func:`punch`):
    "" where they are reserved (or ``region`` is not in an arena), else why not (no space:
    the bytes wanted and free) -- then the caller must not touch it (SIGBUS)."""
    found = _REGION_OF.get(id(region))
    if found is None:
        return ""
    chunk, off, nbytes = found
    if chunk.fd < 0:
        return "its shared memory was released"
    err = chunk.reserve_pages(off, nbytes)
    if not err:
        return ""
    return (f"{nbytes} bytes of shared memory wanted again, {SHM_FOLDER} has "
            f"{free_bytes()} free ({os.strerror(err)})")


def _forget_region(key: int, chunk: Chunk, off: int, nbytes: int,
                   freed: List[Tuple[Chunk, int, int]]) -> None:
    _REGION_OF.pop(key, None)
    _region_gone(chunk, off, nbytes, freed)


def live_regions() -> int:
    """Arena regions whose arrays are still alive (for leak checks and tests)."""
    return len(_REGION_OF)
