"""GPU staging, pipelined: device buffers through a ring of pinned host slots.

For an MPI that cannot read device memory, each segment ``k`` of a buffer goes device ->
host, through MPI, and host -> device. The three overlap: while MPI reduces segment ``k``,
the copy of segment ``k + 1`` to the host and the copy of segment ``k - 1`` back to the
device run on their own streams. Half precision is widened to fp32 on the device before its
copy to the host and rounded back on the device after its copy back (the GPU casts at memory
speed; the host would take longer than the copies).

The same pipeline runs the collectives whose send and receive differ, in rounds
(``comm/collectives.py`` builds them; one :class:`StagedSegments` runs them all):

- allreduce / reduce: round ``k`` is segment ``k`` of the buffer, reduced in place in its
  host slot and copied back to where it came from;
- reduce-scatter: round ``k`` packs piece ``k`` of every rank's shard (a strided view) into
  a contiguous block on the device, widened for half precision, copies the block to the host,
  ``Reduce_scatter_block`` lands this rank's piece in a receive slot, and the piece goes back
  into the shard (rounded on the device for half precision);
- in-place allgather: round ``k`` copies piece ``k`` of this rank's shard to the host,
  ``Allgather`` (not in place: send and receive slots) collects piece ``k`` of every shard,
  and the block goes back and is scattered into the pieces of every shard on the device. No
  arithmetic, so half precision moves as it is (no widening). One plain ``Allgather`` per
  round, so the rounds pipeline like the others (no ``Allgatherv`` or ring needed).

Rules, each enforced by one event:

- MPI reads host slot ``s`` only after its device -> host copy finished (``wait(ready[s])``
  on the host before the call is handed to MPI);
- a slot (send, receive and device scratch) is refilled only after its previous contents
  went back to the device (the copy to
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
from typing import Any, Callable, Iterator, List, Optional, Tuple

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
        """On the device -> host stream, once ``after`` happened: write ``part`` into
        ``work`` when given (widening half precision, packing a strided ``part``), then copy
        (``work`` or ``part``) into ``host``. ``host`` and ``work`` have ``part``'s shape
        and are contiguous. The event."""
        raise NotImplementedError

    def to_device(self, host: Any, part: Any, work: Any = None) -> Any:
        """On the host -> device stream: copy ``host`` into (``work`` or ``part``), then write
        ``work`` into ``part`` when given (rounding to half precision, scattering into a
        strided ``part``). ``host`` and ``work`` have ``part``'s shape. The event."""
        raise NotImplementedError

    def wait(self, event: Any) -> None:
        """Block the host until ``event`` happened."""
        raise NotImplementedError


class StagedSegments:
    """One collective's rounds, staged through ``window + 2`` pinned host slots.

    Round ``k`` sends ``source(k)`` -- a device array of any shape, packed (a strided view:
    piece ``k`` of every rank's shard) and widened (half precision, when ``widen``) on the
    device into a scratch slot before its copy to the host -- and, when ``dest`` is given,
    its result lands in ``dest(k)``: copied back from the host, then rounded (half) and
    scattered (a strided view) on the device. ``in_place``: MPI writes the result over the
    send slot (allreduce, reduce); otherwise it lands in a receive slot of its own
    (reduce-scatter, allgather). ``dest=None`` (a non-root rank of a reduce): nothing comes
    back.

    ``segments()`` yields ``(send host array, receive host array or None, land or None)``,
    flat and contiguous, for one MPI call each; ``land`` scales the result on the host
    (``scale``) and starts its copy back; call :meth:`finish` after the last call landed.
    Memory: ``window + 2`` send slots, as many receive slots (not in place) and, where a
    round needs one, as many device scratch slots, each one round wide, whatever the buffer
    size.
    """

    def __init__(self, count: int, source: Callable[[int], Any],
                 dest: Optional[Callable[[int], Any]], window: int, scale: Optional[float],
                 device: Device, widen: bool = True, in_place: bool = False) -> None:
        self.count, self.source, self.dest, self.scale, self.dev = count, source, dest, scale, device
        nslots = min(window + 2, count)
        self.host: List[Any] = []
        self.recv: List[Any] = []
        self.work: Optional[List[Any]] = None
        self.half = False
        if nslots:
            first = source(0)
            back = dest(0) if dest is not None else None
            self.half = widen and first.dtype in HALF
            wide = float32 if self.half else first.dtype
            self.host = [device.pinned(first.size, wide) for _ in range(nslots)]
            self.recv = (self.host if in_place or back is None
                         else [device.pinned(back.size, wide) for _ in range(nslots)])
            # a scratch slot where a round is half precision or strided (the first round is
            # the widest; only the last may be narrower)
            views = [first, source(count - 1)]
            if dest is not None:
                views += [back, dest(count - 1)]
            if self.half or not all(_contiguous(v) for v in views):
                # one scratch slot serves both directions: the copy back of round k uses
                # it only after round k's copy to the host finished (MPI had it), and round
                # k + nslots refills it only after that copy back finished (free[s])
                width = max(first.size, back.size if back is not None else 0)
                self.work = [device.scratch(width, wide, first) for _ in range(nslots)]
        self.ready: List[Any] = [None] * nslots  # the slot's copy to the host
        self.free: List[Any] = [None] * nslots   # the slot's copy back (it may be refilled)
        self.back: List[Any] = []                # every copy back, for finish()

    @classmethod
    def of_buffer(cls, flat: Any, seg: int, window: int, scale: Optional[float], lands: bool,
                  device: Device) -> "StagedSegments":
        """The contiguous segments of ``seg`` elements of ``flat``, reduced in place
        (allreduce, reduce; ``lands=False``: a non-root rank of a reduce)."""
        def part(k: int) -> Any:
            return flat[k * seg:(k + 1) * seg]

        count = -(-flat.size // seg) if flat.size else 0
        return cls(count, part, part if lands else None, window, scale, device, in_place=True)

    def _work(self, s: int, like: Any) -> Any:
        """Slot ``s``'s scratch shaped like ``like``, or None when ``like`` needs none."""
        if self.work is None or (not self.half and _contiguous(like)):
            return None
        return self.work[s][:like.size].reshape(like.shape)

    def _fetch(self, k: int) -> None:
        s = k % len(self.host)
        part = self.source(k)
        host = self.host[s][:part.size].reshape(part.shape)
        self.ready[s] = self.dev.to_host(part, host, self._work(s, part), self.free[s])

    def segments(self) -> Iterator[Tuple[Any, Any, Any]]:
        if self.count:
            self._fetch(0)
        for k in range(self.count):
            s = k % len(self.host)
            size = self.source(k).size
            if k + 1 < self.count:
                self._fetch(k + 1)  # runs while MPI works on round k
            self.dev.wait(self.ready[s])
            if self.dest is None:
                yield self.host[s][:size], None, None
                continue
            out = self.dest(k)
            recv = self.recv[s][:out.size] if self.recv is not self.host else None
            yield self.host[s][:size], recv, partial(self._land, s, out)

    def _land(self, s: int, out: Any) -> None:
        host = self.recv[s][:out.size]
        if self.scale is not None:
            backend.scale_(host, self.scale)
        self.free[s] = self.dev.to_device(host.reshape(out.shape), out, self._work(s, out))
        self.back.append(self.free[s])

    def finish(self) -> None:
        for event in self.back:
            self.dev.wait(event)
        self.back = []


def _contiguous(arr: Any) -> bool:
    return bool(arr.flags.c_contiguous)


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
                if work.dtype != part.dtype:
                    halfcast.widen(part, work)  # a cupy kernel on this stream
                else:
                    work[...] = part  # packs a strided part (a kernel on this stream)
                part = work
            part.get(out=host, stream=self.d2h, blocking=False)
            return self.d2h.record()

    def to_device(self, host: Any, part: Any, work: Any = None) -> Any:
        from . import halfcast

        with self.device, self.h2d:
            (part if work is None else work).set(host, stream=self.h2d)
            if work is not None:
                if work.dtype != part.dtype:
                    halfcast.narrow(work, part)
                else:
                    part[...] = work  # scatters into a strided part
            return self.h2d.record()

    def wait(self, event: Any) -> None:
        event.synchronize()
