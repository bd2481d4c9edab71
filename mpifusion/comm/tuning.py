"""``Tuning``: every threshold of the communication layer, in one frozen value.

Each field says what it decides and the measurement that chose it (the machines are named in
BENCHMARKS.md). They are thresholds, not options: a user never needs them, but a maintainer
re-measuring on other hardware, or a test that wants the staged path with small buffers,
does. Read them as ``tuning.ACTIVE`` (or :func:`current`); a test changes them with
:func:`override`, on every
rank alike: most decide which calls a collective makes, so the agreement check compares
them (``Communicator``'s ``tuning`` entry) and ranks that differ refuse to build a buffer.
``mpifusion info`` prints them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterator, List, Tuple

from ..errors import OptionError


@dataclass(frozen=True)
class Tuning:
    """The thresholds; defaults are what was measured (see each field's ``why``)."""

    inline_max_bytes: int = field(default=64 << 10, metadata={"why": (
        "thread strategy: a caller waiting for a collective of at most this many bytes runs "
        "it itself instead of waking the communication thread (30-150 us here, more than a "
        "4-64 KiB collective: BENCHMARKS.md, small messages); under a deadline its calls "
        "are then non-blocking on every rank, so that the caller can bound them")})
    shm_inline_max_bytes: int = field(default=1 << 20, metadata={"why": (
        "shm/hierarchical: the same for collectives in a shared window; a 1 MiB one takes "
        "about as long as waking the thread (2 ranks x MPI's Allreduce: 0.78 -> 0.52 "
        "MPICH, 1.41 -> 0.91 Open MPI); one nobody waits for starts handoff_s later")})
    auto_hierarchical_min_bytes: int = field(default=256 << 10, metadata={"why": (
        "auto across nodes takes thread below this many bytes per rank: its one all-reduce "
        "beat hierarchical's node barriers and two inter-node calls (2-4 emulated nodes x 2 "
        "ranks, 1 and 10 Gbit/s: 64 KiB 1.17-1.36x thread's step; from 1 MiB 0.39-0.99x)")})
    handoff_s: float = field(default=0.002, metadata={"why": (
        "thread strategy: how long a small collective is left for its caller's wait() "
        "before the communication thread runs it (a caller that never waits still "
        "progresses)")})
    hot_s: float = field(default=1.0, metadata={"why": (
        "thread strategy: the thread polls for such collectives while its communicator was "
        "used this recently, then sleeps until a start wakes it")})
    chunk_bytes: int = field(default=1 << 20, metadata={"why": (
        "shm: bytes of the fp32/fp64 accumulator a slice is summed in, chunk by chunk; with "
        "the p source chunks it stays in a 2-4 MiB L2 (a prototype measured it); also the "
        "largest piece of hierarchical's inter-node all-gather")})
    cut_elements: int = field(default=64, metadata={"why": (
        "shm: a rank's slice of a buffer starts on a multiple of this many elements, so two "
        "ranks rarely write one cache line (64 elements: at least 128 bytes in any dtype); "
        "which rank sums an element never changes its bits")})
    gather_max_bytes: int = field(default=128 << 10, metadata={"why": (
        "shm: an all-reduce whose buffers of every rank together hold at most this many "
        "bytes is gathered (through the scratch on one node, one MPI_Allgather across "
        "nodes) and summed by every rank in rank order, the window's bits, where two "
        "barriers cost more than the bytes (2 ranks, MPICH, x thread: 64 KiB 1.06 "
        "gathered, 0.9-1.4 in the window; from 128 KiB the window wins, 0.70, and 0.44 at "
        "256 KiB)")})
    scratch_bytes: int = field(default=1 << 20, metadata={"why": (
        "shm: each rank's staging scratch in the stream's window; arrays outside a window "
        "go through it in rounds of this size (1 MiB: the chunk size a prototype ran at)")})
    pipe_min_bytes: int = field(default=256 << 10, metadata={"why": (
        "hierarchical with pipeline=True: from this many bytes per rank the inter-node "
        "step is pipelined; below it each chunk's inter-node calls are blocking, one after "
        "the other, which keeps a small buffer's latency")})
    pipe_slots: int = field(default=4, metadata={"why": (
        "hierarchical pipeline: accumulators in its ring (chunk k in slot k % slots, reused "
        "once it landed); 4 lets a reduce-scatter, an all-gather and the next chunk's sum "
        "overlap")})
    negotiation_max_pause_s: float = field(default=1e-3, metadata={"why": (
        "negotiated order: the longest back-off between two rounds that agreed on nothing")})
    arena_chunk_bytes: int = field(default=2 << 20, metadata={"why": (
        "shm: the smallest chunk of a rank's shared arena: many small buffers share one; "
        "a larger buffer gets a chunk of its own size, so a tight /dev/shm is never "
        "over-reserved")})

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise OptionError(f"Tuning.{f.name}: expected a number >= 0, got {value!r}")
        if self.pipe_slots < 2:
            raise OptionError(f"Tuning.pipe_slots: expected at least 2 (the pipeline's "
                              f"bounds need one slot in flight and one summed), got "
                              f"{self.pipe_slots}")

    def rows(self) -> List[Tuple[str, Any, str]]:
        """``(name, value, why)`` of every threshold, as ``mpifusion info`` prints them."""
        return [(f.name, getattr(self, f.name), f.metadata["why"]) for f in fields(self)]

    def changed(self) -> str:
        """The fields that differ from the defaults, ``name=value, ...`` (empty: none)."""
        default = Tuning()
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                         if getattr(self, f.name) != getattr(default, f.name))


#: the thresholds in use in this process (read on every start: an attribute, no call)
ACTIVE = Tuning()


def current() -> Tuning:
    """The thresholds in use in this process."""
    return ACTIVE


def use(tuning: Tuning) -> Tuning:
    """Use ``tuning`` from now on, on this rank (do it on every rank alike, before the
    buffers are built); returns the one it replaces."""
    global ACTIVE
    if not isinstance(tuning, Tuning):
        raise OptionError(f"tuning: expected a mpifusion.comm.tuning.Tuning, "
                          f"got {type(tuning).__name__}")
    previous, ACTIVE = ACTIVE, tuning
    return previous


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Tuning]:
    """Thresholds changed for the duration of a ``with`` block (tests), e.g.
    ``override(scratch_bytes=4096)`` to run the staged path with small buffers."""
    try:
        changed = replace(ACTIVE, **changes)
    except TypeError as exc:
        raise OptionError(f"tuning: {exc}") from exc
    previous = use(changed)
    try:
        yield changed
    finally:
        use(previous)
