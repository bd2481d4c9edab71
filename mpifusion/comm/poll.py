"""The one poll loop with exponential back-off (every wait on a request or a condition).

A poll first retries quickly (a request often completes within microseconds), then sleeps
twice as long after each miss, up to ``cap``: a wait that takes seconds costs at most one
wake-up per ``cap`` and gives the core back to the ranks that do the work meanwhile.
"""
from __future__ import annotations

import time
from typing import Callable, Optional


class Backoff:
    """Pauses ``first``, ``2 * first``, ... up to ``cap`` seconds (``reset()`` restarts)."""

    __slots__ = ("first", "cap", "pause")

    def __init__(self, first: float = 1e-6, cap: float = 1e-3) -> None:
        self.first = first
        self.cap = cap
        self.pause = 0.0

    def next(self) -> float:
        """The next pause, without sleeping (a generator yields it as a ``_pause`` step)."""
        self.pause = min(max(2 * self.pause, self.first), self.cap)
        return self.pause

    def sleep(self) -> None:
        time.sleep(self.next())

    def reset(self) -> None:
        self.pause = 0.0


def poll(done: Callable[[], bool], timeout: Optional[float] = None, first: float = 1e-6,
         cap: float = 1e-3) -> bool:
    """Call ``done()`` until it returns True (then True), sleeping with back-off between
    calls; False once ``timeout`` seconds passed (``None``: no deadline; 0: one try)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    backoff = Backoff(first, cap)
    while not done():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        backoff.sleep()
    return True
