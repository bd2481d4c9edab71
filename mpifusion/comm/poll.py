"""The one poll loop with exponential back-off (every wait on a request or a condition).

A poll first retries quickly (a request often completes within microseconds), then sleeps
twice as long after each miss, up to ``cap``: a wait that takes seconds costs at most one
wake-up per ``cap`` and gives the core back to the ranks that do the work meanwhile.

A wait on a pipeline (many calls, each landing in micro- to milliseconds) must not back off
while the calls keep landing: a sleep that grew to ``cap`` would make every later call land up
to ``cap`` late (a 16-segment all-reduce took 7x as long with a deadline as without). Given
``moves`` (a counter of calls issued or landed), :func:`poll` only yields the core
(``sched_yield``, as a blocking MPI wait spins) while the counter moved in the last
:data:`SPIN_S`, and backs off from scratch once it stops moving.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

#: how long a wait given ``moves`` keeps spinning (yielding the core) after the last move
SPIN_S = 0.005


class Backoff:
    """Pauses ``first``, ``2 * first``, ... up to ``cap`` seconds (``reset()`` restarts)."""

    __slots__ = ("first", "cap", "pause")

    def __init__(self, first: float = 1e-6, cap: float = 1e-3) -> None:
        self.first = first
        self.cap = cap
        self.pause = 0.0

    def next(self) -> float:
        """The next pause, without sleeping (a generator yields it as a ``call.pause``)."""
        self.pause = min(max(2 * self.pause, self.first), self.cap)
        return self.pause

    def sleep(self) -> None:
        time.sleep(self.next())

    def reset(self) -> None:
        self.pause = 0.0


def never_moves() -> int:
    """The ``moves`` of a wait on one request: a counter that never moves, so :func:`poll`
    spins (yielding the core) for :data:`SPIN_S` first, as a blocking MPI call would."""
    return 0


def poll(done: Callable[[], bool], timeout: Optional[float] = None, first: float = 1e-6,
         cap: float = 1e-3, moves: Optional[Callable[[], int]] = None) -> bool:
    """Call ``done()`` until it returns True (then True), sleeping with back-off between
    calls; False once ``timeout`` seconds passed (``None``: no deadline; 0: one try).
    ``moves``: a progress counter; while it moved in the last :data:`SPIN_S`, only yield."""
    now = time.monotonic()
    deadline = None if timeout is None else now + timeout
    backoff = Backoff(first, cap)
    seen, moved_at = (moves() if moves is not None else 0), now
    while not done():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        if moves is not None:
            count = moves()
            if count != seen:
                seen, moved_at = count, now
                backoff.reset()
            if now - moved_at < SPIN_S:
                os.sched_yield()
                continue
        backoff.sleep()
    return True
