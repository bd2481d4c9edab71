"""``CommTask``: the one handle for in-flight collectives (Paddle's ``task``).

It reads its record (``record.Collective``), which keeps every array MPI touches alive until
the collective finished, because mpi4py does not keep non-blocking buffers alive; it never
writes it (the engine does, and ``record.finish``). It carries its own deadline: ``wait()``
without an argument waits at most the communicator's ``timeout`` (so a task handed out by
``sync_params(sync=False)`` is bounded like every other wait).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, TYPE_CHECKING

from ..config import MAX_TIMEOUT
from ..errors import CommError, CommTimeoutError, FusionError, OptionError
from .record import Collective

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


class CommTask:
    """The caller's handle of a started collective: ``wait()`` finishes it, ``is_completed()``
    polls it.

    ``name`` names it in errors; ``timeout`` is the default deadline of ``wait()``;
    ``timed_out`` says a wait missed its deadline; ``abandoned`` is set when the owner gave it
    up (``FusedCommBuffer.reset(abandon=True)``); ``context``, if set, adds to a timeout's
    message (the owner's late ranks). What the engine knows of the collective -- its calls,
    the arrays MPI uses, its place in the stream -- is in its record (``record.Collective``),
    which the engine owns.

    A communicator makes it when it starts a collective (``buf.task``,
    ``sync_params(sync=False)``); users do not build one.

    Args:
        op: the collective's record (its name, arrays and state).
        engine: the engine that runs it, driven by :meth:`is_completed` and :meth:`wait`.
        timeout: the default deadline of :meth:`wait`, in seconds (None: forever).
    """

    __slots__ = ("name", "timeout", "abandoned", "context", "_op", "_engine", "_finish",
                 "_done", "__weakref__")

    def __init__(self, op: Collective, engine: "Engine",
                 timeout: Optional[float] = None) -> None:
        self.name = op.plan.name
        self.timeout = timeout
        self.abandoned = False
        #: more of a timeout's message, computed when it happens (the owner's late ranks)
        self.context: Optional[Callable[[], str]] = None
        self._op = op
        self._engine = engine
        self._finish: Optional[Callable[[], None]] = None
        self._done = False          # completed and cleaned up (callbacks ran)

    @property
    def timed_out(self) -> bool:
        """A wait missed its deadline (the collective may have finished since)."""
        return self._op.late

    @property
    def error(self) -> Optional[BaseException]:
        """Why the collective failed on this rank (``wait()`` raises it); None while it runs
        or once it succeeded."""
        return self._op.error

    def is_completed(self) -> bool:
        """Poll once (this also drives MPI's progress); True once finished, with or without
        an error (``wait()`` raises it)."""
        if self._done:
            return True
        self._engine.progress()
        if self._op.done.flag:
            self._complete()
        return self._done

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the task completes successfully (at once if it already has)."""
        if self._done:
            if self._op.error is None:
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
        op = self._op
        if not self._done:
            seconds = self.timeout if timeout is None else _deadline_seconds(timeout)
            if not op.done.flag and not self._engine.wait_for(op, seconds):
                raise self._timeout_error(seconds)
            self._complete()
        if op.error is not None:
            error = op.error
            if isinstance(error, FusionError):
                raise error
            raise CommError(f"rank {op.plan.rank}: {self.name or 'collective'} failed: "
                            f"{error}") from error

    def _timeout_error(self, timeout: float) -> CommTimeoutError:
        more = self.context() if self.context is not None else ""
        rank = self._op.plan.rank
        return CommTimeoutError(f"rank {rank}: {self.name or 'collective'} did not "
                                f"complete within {timeout:g} s (another rank may not have "
                                f"started it, or started collectives in a different order)"
                                f"{more}")

    def _complete(self) -> None:
        if self._done:
            return
        self._done = True
        finish, self._finish = self._finish, None
        self.context = None
        if self._op.error is None and finish is not None:
            finish()

    def __repr__(self) -> str:
        return f"CommTask({self.name!r}, completed={self._done})"
