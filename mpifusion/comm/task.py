"""``CommTask``: the one handle for in-flight collectives (Paddle's ``task``).

It owns every array MPI touches until the collective is done, because mpi4py does not keep
non-blocking buffers alive, and it carries its own deadline: ``wait()`` without an argument
waits at most the communicator's ``timeout`` (so a task handed out by ``sync_params(sync=False)``
is bounded like every other wait).
"""
from __future__ import annotations

import collections
import math
import threading
from typing import Any, Callable, Optional, Sequence, TYPE_CHECKING

from ..config import MAX_TIMEOUT
from ..errors import CommError, CommTimeoutError, FusionError, OptionError
from .call import Steps

if TYPE_CHECKING:
    from .engines import Engine


def _deadline_seconds(timeout: Any) -> Optional[float]:
    """A wait's timeout: None/inf/huge = forever, 0 = poll once; NaN/negative refused."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise OptionError(f"timeout: expected a number of seconds >= 0, got {timeout!r}")
    try:
        seconds = float(timeout)
    except OverflowError:
        return None
    if math.isnan(seconds) or seconds < 0:
        raise OptionError(f"timeout: expected a number of seconds >= 0, got {timeout!r}")
    return None if seconds > MAX_TIMEOUT else seconds


#: set() calls of every Latch: one release per latch even when two threads finish it
_SETTING = threading.Lock()


class Latch:
    """A one-shot ``threading.Event`` (``set``, ``is_set``, ``wait``): a lock held until set.
    Each collective gets one; ``threading.Event`` builds a Condition, whose cost (~2 us here)
    a 4 KiB collective would pay on every start."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._set = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with _SETTING:
            if not self._set:
                self._set = True
                self._lock.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True once set; False if ``timeout`` seconds passed first (<= 0: do not block)."""
        if self._set:
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
        return self._set


class CommTask:
    """An in-flight collective: ``wait()`` finishes it, ``is_completed()`` polls it.

    ``steps`` is the collective's generator of MPI calls, run by ``engine`` in start order;
    ``keep`` holds the arrays MPI reads or writes until the task is done; ``timeout`` is the
    default deadline of ``wait()``; ``timed_out`` is set when a wait missed its deadline and
    ``abandoned`` when the owner gave the task up (``FusedCommBuffer.reset(abandon=True)``).
    """

    __slots__ = ("name", "_requests", "_keep", "_finish", "_done", "_steps", "_engine",
                 "_event", "_error", "_rank", "timed_out", "abandoned", "timeout", "seq",
                 "on_fail", "window", "_blocked", "_stopped", "_stealable", "_since",
                 "polled", "context", "__weakref__")

    def __init__(self, steps: Optional[Steps], engine: "Engine",
                 keep: Sequence[Any] = (), name: str = "", rank: int = -1,
                 timeout: Optional[float] = None) -> None:
        self.name = name
        self._requests: Any = collections.deque()  # nonblocking: (request, land, args), oldest first
        self._keep = list(keep)
        self._finish: Optional[Callable[[], None]] = None
        self._done = False          # completed and cleaned up (callbacks ran)
        self._steps: Optional[Steps] = steps
        self._engine = engine
        self._event: Optional[Latch] = None  # set by the engine when finished
        self._error: Optional[BaseException] = None
        self._rank = rank
        self.timed_out = False
        self.abandoned = False
        self.timeout = timeout
        self.seq = -1               # position in the engine's stream (set on submit)
        self.on_fail: Optional[Callable[[BaseException], None]] = None
        #: more of a timeout's message, computed when it happens (the owner's late ranks)
        self.context: Optional[Callable[[], str]] = None
        self.window = 1             # pipelined calls in flight at most (nonblocking engine)
        self._blocked = False       # the last call was a fence: pull nothing until it landed
        self._stopped = False       # no more calls (steps exhausted, or failed)
        self._stealable = False     # thread engine: left a moment for its caller to run
        self._since = 0.0           # thread engine: when it was started (monotonic)
        #: thread engine: its calls are non-blocking (small, under a deadline), so a caller
        #: waiting with a deadline may run and poll them
        self.polled = False

    # -- engine side
    def _fail(self, exc: BaseException) -> None:
        """Record why the task failed (the engine sets the event afterwards)."""
        if self._error is None:
            self._error = exc
        hook, self.on_fail = self.on_fail, None
        if hook is not None:
            hook(exc)

    def _finished(self) -> bool:
        event = self._event
        return event is not None and event.is_set()

    # -- caller side
    def is_completed(self) -> bool:
        """Poll once (this also drives MPI's progress); True once finished, with or without
        an error (``wait()`` raises it)."""
        if self._done:
            return True
        self._engine.progress()
        if self._finished():
            self._complete()
        return self._done

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the task completes successfully (at once if it already has)."""
        if self._done:
            if self._error is None:
                fn()
            return
        first = self._finish

        def chained() -> None:
            if first is not None:
                first()
            fn()

        self._finish = chained

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until done, or raise ``CommTimeoutError`` after ``timeout`` seconds (default:
        the communicator's deadline, ``None`` there meaning forever). Raises the task's error
        (``OrderError``, ``AbandonedError``, ``CommError``) every time it is called."""
        if not self._done:
            seconds = self.timeout if timeout is None else _deadline_seconds(timeout)
            event = self._event
            if event is None or not event._set:  # not _finished(), without the call
                self._engine.wait_for(self, seconds)
            self._complete()
        if self._error is not None:
            error = self._error
            if isinstance(error, FusionError):
                raise error
            raise CommError(f"rank {self._rank}: {self.name or 'collective'} failed: "
                            f"{error}") from error

    def _timeout_error(self, timeout: float) -> CommTimeoutError:
        self.timed_out = True
        self._engine.late.add(self)  # at exit, do not wait for it (engine.stuck)
        more = self.context() if self.context is not None else ""
        return CommTimeoutError(f"rank {self._rank}: {self.name or 'collective'} did not "
                                f"complete within {timeout:g} s (another rank may not have "
                                f"started it, or started collectives in a different order)"
                                f"{more}")

    def _complete(self) -> None:
        if self._done:
            return
        self._done = True
        finish, self._finish = self._finish, None
        self._requests = []
        self._steps = None
        self._keep = []
        self.context = None
        if self._error is None and finish is not None:
            finish()

    def __repr__(self) -> str:
        return f"CommTask({self.name!r}, completed={self._done})"
