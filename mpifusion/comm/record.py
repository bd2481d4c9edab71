"""``Collective``: an engine's record of one started collective.

Whoever starts a collective (``Communicator``, the negotiator's rounds) fills in its calls,
``window`` and ``polled``; from ``submit`` on the engine owns it: it pulls the calls, keeps
what is in flight with its arrays, marks a missed deadline (``late``) and sets ``done`` once
the collective finished, with or without an ``error``. The caller holds a ``CommTask``,
which reads the record and clears it once complete (``Collective.clear``). Keeping this
state out of the handle leaves one writer per field: the engine.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

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


class Collective:
    """One collective as its engine runs it (see the module docstring)."""

    __slots__ = ("name", "rank", "steps", "requests", "keep", "done", "error", "seq",
                 "window", "blocked", "stopped", "stealable", "since", "polled", "on_fail",
                 "late", "__weakref__")

    def __init__(self, steps: Optional[Steps], name: str = "", rank: int = -1,
                 keep: Sequence[Any] = (), window: int = 1) -> None:
        self.name = name
        self.rank = rank
        #: its calls, pulled by the engine (None once complete)
        self.steps: Optional[Steps] = steps
        #: calls in flight, oldest first (nonblocking; thread: the one left at a deadline)
        self.requests: Deque[InFlight] = collections.deque()
        #: the arrays MPI reads or writes, alive until the collective is complete
        self.keep: List[Any] = list(keep)
        self.done = Latch()         # set by the engine once finished
        self.error: Optional[BaseException] = None
        self.seq = -1               # its place in the engine's stream (set on submit)
        self.window = window        # pipelined calls in flight at most (nonblocking engine)
        self.blocked = False        # the last call was a fence: pull nothing until it landed
        self.stopped = False        # no more calls (steps exhausted, or failed)
        self.stealable = False      # thread engine: left a moment for its caller to run
        self.since = 0.0            # thread engine: when it was started (monotonic)
        #: thread engine: its calls are non-blocking (small, under a deadline), so a caller
        #: waiting with a deadline may run and poll them
        self.polled = False
        #: told of the failure (the negotiation round fails the collectives queued in it)
        self.on_fail: Optional[Callable[[BaseException], None]] = None
        self.late = False           # a wait missed its deadline (CommTask.timed_out)

    def fail(self, exc: BaseException) -> None:
        """Record why it failed (the engine sets ``done`` afterwards); the first error wins."""
        if self.error is None:
            self.error = exc
        hook, self.on_fail = self.on_fail, None
        if hook is not None:
            hook(exc)

    def finished(self) -> bool:
        return self.done.flag

    def clear(self) -> None:
        """Complete: let go of its calls and arrays (MPI is done with them)."""
        self.requests = collections.deque()
        self.steps = None
        self.keep = []
