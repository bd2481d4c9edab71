"""``Collective``: an engine's record of one started collective, and ``finish``, its end.

A record has three parts, each with one writer:

- its :class:`Plan`, what the starter decided (its name, whether a waiting caller may run or
  poll it, whom to tell of a failure): a frozen value, fixed when the record is built;
- the engine's working state (``seq``, ``steps``, ``requests``, ``keep`` and the flags below):
  written by the engine that runs it, from ``submit`` on. The engine stamps the collective
  (its ``seq``, its place in the stream) and only then builds its calls with that serial
  passed in (``build``), so no call generator reads state that is set later;
- its result (``error``, and ``done``, the latch it sets): written once, by :func:`finish`,
  which the engines and the negotiator (for the collectives run inside its rounds) call.

Plain attributes, not properties, because a small collective reads them on every poll;
tests/comm/test_record_writers.py holds every writer to its part, in the source and at run
time.

The caller holds a ``CommTask``, which only reads the record.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Deque, List, NamedTuple, Optional, Sequence, Tuple

from .call import Steps

#: set() calls of every Latch: one release per latch even when two threads finish it
_SETTING = threading.Lock()


class Latch:
    """A one-shot ``threading.Event`` (``set``, ``is_set``, ``wait``): a lock held until set.
    Each collective gets one; ``threading.Event`` builds a Condition, whose cost (~2 us here)
    a 4 KiB collective would pay on every start. ``flag`` is ``is_set()`` without the call
    (read on every progress of a small collective)."""

    __slots__ = ("_lock", "flag")

    def __init__(self) -> None:
        self.flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        with _SETTING:
            if not self.flag:
                self.flag = True
                self._lock.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True once set; False if ``timeout`` seconds passed first (<= 0: do not block)."""
        if self.flag:
            return True
        if timeout is None or timeout > threading.TIMEOUT_MAX:
            got = self._lock.acquire()
        elif timeout > 0:
            got = self._lock.acquire(timeout=timeout)
        else:
            got = self._lock.acquire(blocking=False)
        if got:
            self._lock.release()  # the next waiter passes too
            return True
        return self.flag


#: a call left in flight: (request, its land, its arguments -- kept referenced until it
#: landed, because mpi4py keeps no reference to a non-blocking call's arrays)
InFlight = Tuple[Any, Optional[Callable[[], None]], Any]

#: builds a collective's calls, given its place in the stream (the engine's serial)
Build = Callable[[int], Steps]


class Plan(NamedTuple):
    """What the starter of a collective decided, before any engine sees it (immutable: a
    named tuple, cheap to build on every start of a small collective)."""

    name: str = ""
    rank: int = -1
    #: thread engine: its calls are non-blocking (small, under a deadline), so a caller
    #: waiting with a deadline may run and poll them
    polled: bool = False
    #: thread engine: a small collective, left a moment for a waiting caller to run it
    #: instead of waking the communication thread
    inline: bool = False
    #: told of the failure once the collective finished with one (a negotiation round fails
    #: the collectives queued in it)
    on_fail: Optional[Callable[[BaseException], None]] = None


class Collective:
    """One collective as its engine runs it (see the module docstring)."""

    __slots__ = ("plan", "build", "steps", "requests", "keep", "seq", "blocked", "stopped",
                 "failure", "stealable", "since", "late", "error", "done", "__weakref__")

    def __init__(self, plan: Plan, build: Optional[Build], keep: Sequence[Any] = ()) -> None:
        self.plan = plan
        #: makes its calls once the engine stamped it (consumed then)
        self.build: Optional[Build] = build
        #: its calls, pulled by the engine (None before it was stamped and once finished)
        self.steps: Optional[Steps] = None
        #: calls in flight, oldest first (nonblocking; thread: the one left at a deadline)
        self.requests: Deque[InFlight] = collections.deque()
        #: the arrays MPI reads or writes, alive until the collective finished
        self.keep: List[Any] = list(keep)
        self.seq = -1               # its place in the engine's stream (set on submit)
        self.blocked = False        # the last call was a fence: pull nothing until it landed
        self.stopped = False        # no more calls (steps exhausted, or failed)
        #: why it failed on this rank, once known (its calls in flight still complete);
        #: what :func:`finish` records
        self.failure: Optional[BaseException] = None
        self.stealable = False      # thread engine: left a moment for its caller to run
        self.since = 0.0            # thread engine: when it was started (monotonic)
        self.late = False           # a wait missed its deadline (CommTask.timed_out)
        #: why it failed (None while it runs or once it succeeded): :func:`finish` sets it
        self.error: Optional[BaseException] = None
        #: set by :func:`finish` once the collective finished, with or without an error
        self.done = Latch()

    def finished(self) -> bool:
        return self.done.flag


def finish(op: Collective, error: Optional[BaseException] = None) -> None:
    """End ``op``: record ``error`` (None: it succeeded), let go of its calls and arrays (MPI
    is done with them), tell ``plan.on_fail`` of a failure and set ``done``. The only writer
    of a record's result; a record finishes once (a later call does nothing)."""
    if op.done.flag:
        return
    op.error = error
    op.steps = None
    op.build = None
    op.requests = collections.deque()
    op.keep = []
    hook = op.plan.on_fail
    if error is not None and hook is not None:
        hook(error)
    op.done.set()
