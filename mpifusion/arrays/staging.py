"""GPU staging, pipelined: device buffers through a ring of pinned host slots.

For an MPI that cannot read device memory, each segment ``k`` of a buffer goes device ->
host, through MPI, and host -> device. The three overlap: while MPI reduces segment ``k``,
the copy of segment ``k + 1`` to the host and the copy of segment ``k - 1`` back to the
device run on their own streams. Half precision is widened to fp32 on the device before its
copy to the host and rounded back on the device after its copy back (the GPU casts at memory
speed; the host would take longer than the copies).

Rules, each enforced by one event:

- MPI reads host slot ``s`` only after its device -> host copy finished (``wait(ready[s])``
  on the host before the call is handed to MPI);
- a slot is refilled only after its previous contents went back to the device (the copy to
  the host waits for ``free[s]`` on the device) -- and after MPI finished with it, which
  the engines guarantee: the next call is prepared only while fewer than ``window`` calls
  are in flight, and the ring has ``window + 2`` slots (one in MPI per in-flight call, one
  being filled, one going back);
- the collective is finished only after every copy back finished (:meth:`finish`).

The logic is written against :class:`Device` (pinned slots, two copies, a host wait), so a
CPU test drives it with a fake device that records the order of events and runs copies late
or early; :class:`CupyDevice` is the real one.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Iterator, List, Optional, Tuple

from ..dtypes import HALF, float32
from . import backend


class Device:
    """What the pipeline needs from a GPU. Events are opaque; ``None`` means "no event"."""

    def pinned(self, n: int, dtype: Any) -> Any:
        """A host array of ``n`` elements in page-locked memory."""
        raise NotImplementedError

    def scratch(self, n: int, dtype: Any, like: Any) -> Any:
        """A device array of ``n`` elements (on ``like``'s device)."""
        raise NotImplementedError

    def to_host(self, part: Any, host: Any, work: Any = None, after: Any = None) -> Any:
        """On the device -> host stream, once ``after`` happened: widen ``part`` into
        ``work`` when given, then copy (``work`` or ``part``) into ``host``. The event."""
        raise NotImplementedError

    def to_device(self, host: Any, part: Any, work: Any = None) -> Any:
        """On the host -> device stream: copy ``host`` into (``work`` or ``part``), then round
        ``work`` into ``part`` when given. The event."""
        raise NotImplementedError

    def wait(self, event: Any) -> None:
        """Block the host until ``event`` happened."""
        raise NotImplementedError


class StagedSegments:
    """One collective's segments of the device array ``flat``, staged through ``window + 2``
    pinned host slots. ``segments()`` yields ``(host array for MPI, land or None)``;
    ``land`` scales the reduced host segment (``scale``) and starts its copy back; call
    :meth:`finish` after the last call landed. ``lands=False`` (a non-root rank of a reduce):
    nothing comes back."""

    def __init__(self, flat: Any, seg: int, window: int, scale: Optional[float], lands: bool,
                 device: Device) -> None:
        self.flat, self.seg, self.scale, self.lands, self.dev = flat, seg, scale, lands, device
        self.count = -(-flat.size // seg) if flat.size else 0
        nslots = min(window + 2, self.count)
        width = min(seg, flat.size)
        half = flat.dtype in HALF
        self.host = [device.pinned(width, float32 if half else flat.dtype)
                     for _ in range(nslots)]
        self.work = ([device.scratch(width, float32, flat) for _ in range(nslots)] if half
                     else None)
        self.ready: List[Any] = [None] * nslots  # the slot's copy to the host
        self.free: List[Any] = [None] * nslots   # the slot's copy back (it may be refilled)
        self.back: List[Any] = []                # every copy back, for finish()

    def _slot(self, k: int) -> Tuple[int, slice, int]:
        start = k * self.seg
        stop = min(start + self.seg, self.flat.size)
        return k % len(self.host), slice(start, stop), stop - start

    def _fetch(self, k: int) -> None:
        s, where, n = self._slot(k)
        work = self.work[s][:n] if self.work is not None else None
        self.ready[s] = self.dev.to_host(self.flat[where], self.host[s][:n], work, self.free[s])

    def segments(self) -> Iterator[Tuple[Any, Any]]:
        if self.count:
            self._fetch(0)
        for k in range(self.count):
            if k + 1 < self.count:
                self._fetch(k + 1)  # runs while MPI works on segment k
            s, _where, n = self._slot(k)
            self.dev.wait(self.ready[s])
            yield self.host[s][:n], (partial(self._land, k) if self.lands else None)

    def _land(self, k: int) -> None:
        s, where, n = self._slot(k)
        host = self.host[s][:n]
        if self.scale is not None:
            backend.scale_(host, self.scale)
        work = self.work[s][:n] if self.work is not None else None
        self.free[s] = self.dev.to_device(host, self.flat[where], work)
        self.back.append(self.free[s])

    def finish(self) -> None:
        for event in self.back:
            self.dev.wait(event)
        self.back = []


class CupyDevice(Device):
    """The real device: cupy streams (one per direction), events and pinned memory."""

    def __init__(self, like: Any) -> None:
        cp = backend.cupy_module()
        self.cp = cp
        self.device = like.device
        with self.device:
            self.d2h = cp.cuda.Stream(non_blocking=True)
            self.h2d = cp.cuda.Stream(non_blocking=True)
            # the grads were written on the current stream: copies start after that work
            self.start = cp.cuda.get_current_stream().record()

    def pinned(self, n: int, dtype: Any) -> Any:
        import numpy as np

        from . import cuda

        dtype = np.dtype(dtype)
        mem = self.cp.cuda.alloc_pinned_memory(max(1, n * dtype.itemsize))
        cuda.staging_stats["pinned_bytes"] += n * dtype.itemsize
        return np.frombuffer(mem, dtype=dtype, count=n)

    def scratch(self, n: int, dtype: Any, like: Any) -> Any:
        return backend.empty(n, dtype, like)

    def to_host(self, part: Any, host: Any, work: Any = None, after: Any = None) -> Any:
        from . import halfcast

        with self.device, self.d2h:
            self.d2h.wait_event(self.start)
            if after is not None:
                self.d2h.wait_event(after)
            if work is not None:
                halfcast.widen(part, work)  # a cupy kernel on this stream
                part = work
            part.get(out=host, stream=self.d2h, blocking=False)
            return self.d2h.record()

    def to_device(self, host: Any, part: Any, work: Any = None) -> Any:
        from . import halfcast

        with self.device, self.h2d:
            (part if work is None else work).set(host, stream=self.h2d)
            if work is not None:
                halfcast.narrow(work, part)
            return self.h2d.record()

    def wait(self, event: Any) -> None:
        event.synchronize()
