"""How this process is leaving, for the exit handler that must never block the job.

``python -m mpi4py`` ends a rank that leaves with ``sys.exit(n)`` (n != 0), an uncaught
exception or ``KeyboardInterrupt`` by ``MPI_Abort`` -- but only at the very end of the
interpreter's exit, after every ``atexit`` handler, including mpifusion's
(``registry._stop_engines``). A handler that waits for its peers there (a collective, or
finishing a started collective) waits for ranks that are still in their step, and the
abort that would end them never comes: the job hangs. ``sys.exit`` leaves no trace that
such a handler could read (``sys.last_value`` is set for exceptions only), so the status
that ``mpi4py.run`` hands to ``MPI._set_abort_status`` is recorded here on its way.
"""
from __future__ import annotations

import sys
from typing import Any

from mpi4py import MPI

#: the status ``python -m mpi4py`` will abort the job with at exit (0: none)
_ABORT = [0]


def _recording(original: Any) -> Any:
    def set_abort_status(status: int) -> None:
        _ABORT[0] = int(status)
        original(status)

    set_abort_status.__wrapped__ = original  # type: ignore[attr-defined]
    return set_abort_status


def install() -> None:
    """Record the abort status from now on (idempotent). ``mpi4py.run`` looks the setter
    up on the module when it calls it, so wrapping the attribute is enough."""
    setter = getattr(MPI, "_set_abort_status", None)
    if setter is not None and not hasattr(setter, "__wrapped__"):
        MPI._set_abort_status = _recording(setter)


def abort_status() -> int:
    """The status this process aborts the job with at exit (0: it finalizes normally)."""
    return _ABORT[0]


def on_error() -> bool:
    """Whether this process leaves on an error: an uncaught exception (any launcher) or a
    pending abort (``python -m mpi4py`` after ``sys.exit(n)``, n != 0, or an interrupt).
    Such a process must not wait for its peers on the way out."""
    return _ABORT[0] != 0 or getattr(sys, "last_value", None) is not None


def abort_now() -> None:
    """End the job at once with the pending abort status (what mpi4py would do after the
    remaining exit handlers, which may block): output flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    MPI.COMM_WORLD.Abort(_ABORT[0])


__all__ = ["abort_now", "abort_status", "install", "on_error"]
