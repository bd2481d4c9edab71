"""``CommTask``: the one handle for in-flight collectives (Paddle's ``task``).

It owns every array MPI touches until the collective is done, because mpi4py does not keep
non-blocking buffers alive, and it carries its own deadline state.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Generator, Iterator, Optional, Sequence, Tuple, TYPE_CHECKING

from ..errors import CommError, CommTimeoutError

if TYPE_CHECKING:
    from .engines import _Engine

#: One MPI call of a collective: (name of the blocking mpi4py method, args, kwargs). The
#: non-blocking form is the same name with an ``I`` in front (Allreduce -> Iallreduce).
Call = Tuple[str, tuple, dict]
Steps = Generator[Call, None, None]


class CommTask:
    """An in-flight collective: ``wait()`` finishes it, ``is_completed()`` polls it.

    ``steps`` is the collective's generator of MPI calls, run by ``engine`` in start order;
    ``keep`` holds the arrays MPI reads or writes until the task is done; ``timed_out`` is set
    when a wait on this task missed its deadline.
    """

    __slots__ = ("name", "_requests", "_keep", "_finish", "_done", "_steps", "_engine",
                 "_issued_all", "_event", "_error", "_rank", "timed_out")

    def __init__(self, steps: Iterator[Call], engine: "_Engine", keep: Sequence[Any] = (),
                 name: str = "", rank: int = -1) -> None:
        self.name = name
        self._requests: list = []   # the nonblocking engine's call in flight
        self._keep = list(keep)
        self._finish: Optional[Callable[[], None]] = None
        self._done = False
        self._steps: Optional[Iterator[Call]] = steps
        self._engine = engine
        self._issued_all = True
        self._event: Optional[threading.Event] = None
        self._error: Optional[BaseException] = None
        self._rank = rank
        self.timed_out = False

    def is_completed(self) -> bool:
        """Poll once; this also drives MPI's progress engine."""
        if self._done:
            return True
        self._engine.progress()
        if self._engine.finished(self):
            self._complete()
        return self._done

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the task completes (at once if it already has)."""
        if self._done:
            fn()
            return
        first = self._finish

        def chained() -> None:
            if first is not None:
                first()
            fn()

        self._finish = chained

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until done, or raise ``CommTimeoutError`` after ``timeout`` seconds."""
        if self._done:
            return
        self._engine.wait_for(self, timeout)
        self._complete()

    def _timeout_error(self, timeout: float) -> CommTimeoutError:
        self.timed_out = True
        self._engine.timed_out = True  # at exit, do not wait for this communicator
        return CommTimeoutError(f"rank {self._rank}: {self.name or 'collective'} did not "
                                f"complete within {timeout:g} s (another rank may not have "
                                f"started it, or started collectives in a different order)")

    def _complete(self) -> None:
        error, self._error = self._error, None
        self._done = True
        finish, self._finish = self._finish, None
        self._requests = []
        self._steps = None
        self._keep = []
        if error is not None:
            raise CommError(f"rank {self._rank}: {self.name or 'collective'} failed: "
                            f"{error}") from error
        if finish is not None:
            finish()

    def __repr__(self) -> str:
        return f"CommTask({self.name!r}, completed={self._done})"
