"""The registry of private communicators: one duplicate of a user's communicator per stream,
and one engine per duplicate.

A stream is a (strategy, order, verify_order) setting, plus the ``control`` duplicate of the
health checks: each gets its own duplicate, made once per user communicator (collective on
first use), so the calls of two streams never interleave. The duplicates are cached on the
user's communicator (an MPI attribute), and :func:`release` -- or freeing the user's
communicator -- stops their engines and frees them; at exit :func:`_stop_engines` lets
started collectives finish (bounded) before MPI finalizes.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Dict, Optional

from mpi4py import MPI

from ..errors import CommTimeoutError
from .engines import Engine, NonBlockingEngine, ThreadEngine
from . import leaving
from .health import forget
from .shm import release_memory
from .poll import poll

#: Engines by the handle of their private communicator (removed when it is freed).
_ENGINES: Dict[int, Engine] = {}
#: Private duplicates alive, by handle (what :func:`live_private_comms` counts).
_LIVE: Dict[int, MPI.Comm] = {}
#: MPI attribute key under which a communicator caches its private duplicates ({tag: dup}).
#: An attribute, not a dict keyed by handle: MPI reuses the handle of a freed communicator,
#: and a new communicator must not inherit the old one's duplicate (another group). Its
#: delete callback releases them when the user frees the communicator.
_DUPS_KEYVAL: Optional[int] = None
_EXITING = False
_REGISTRY_LOCK = threading.RLock()
leaving.install()


def _keyval() -> int:
    global _DUPS_KEYVAL
    if _DUPS_KEYVAL is None:
        # not copied by comm.Dup(); deleted (-> _on_delete) by Free() or Delete_attr()
        _DUPS_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_on_delete)
    return _DUPS_KEYVAL


def _on_delete(comm: MPI.Comm, keyval: int, dups: dict) -> None:
    try:
        _release_dups(dups)
    except Exception:  # an MPI callback must not raise
        pass


def _release_dups(dups: dict, timeout: float = 30.0) -> None:
    with _REGISTRY_LOCK:
        items = list(dups.items())
        dups.clear()
    for _tag, dup in items:  # every engine first: an shm stream's tasks use the windows
        engine = _ENGINES.pop(dup.py2f(), None)
        if engine is not None:
            engine.close(0.0 if _EXITING else timeout)
    for _tag, dup in items:
        handle = dup.py2f()
        # the shm control windows made on it (collective, creation order: every rank frees
        # the user's communicator) and its arena (local: unmapped as its regions go)
        if not _EXITING:
            release_memory(dup)
        forget(dup, None if _EXITING or MPI.Is_finalized() else timeout)
        _LIVE.pop(handle, None)
        if not _EXITING and not MPI.Is_finalized():
            try:
                dup.Free()
            except MPI.Exception:
                pass


def private_comm(comm: MPI.Comm, tag: str = "", timeout: Optional[float] = None) -> MPI.Comm:
    """A duplicate of ``comm`` made once per communicator and ``tag`` (collective on first
    use). Each stream (strategy and order) gets its own duplicate, so their calls never
    interleave. Always a polled ``Idup`` -- the same call on every rank whatever its
    deadline -- bounded by ``timeout``: a rank that never builds a buffer on ``comm`` gives
    a ``CommTimeoutError`` instead of a hang.

    Raises:
        CommTimeoutError: the duplicate was not made within ``timeout`` seconds (a rank
            of ``comm`` did not take part).
    """
    with _REGISTRY_LOCK:
        keyval = _keyval()
        dups = comm.Get_attr(keyval)
        if dups is None:
            dups = {}
            comm.Set_attr(keyval, dups)
        dup = dups.get(tag)
        if dup is not None:
            return dup
        dup, request = comm.Idup()
        if not poll(request.Test, timeout, first=1e-5):
            raise CommTimeoutError(
                    f"rank {comm.Get_rank()}: duplicating comm_group for mpifusion (first "
                    f"buffer on it) did not complete within {timeout:g} s: some rank of "
                    f"the {comm.Get_size()} has not built a buffer on this communicator")
        dups[tag] = dup
        _LIVE[dup.py2f()] = dup
        return dup


def private_split(comm: MPI.Comm, tag: str, color: int, key: int,
                  timeout: Optional[float] = None) -> MPI.Comm:
    """``comm.Split(color, key)`` made once per communicator and ``tag``, cached and released
    as the duplicates are (the ``hierarchical`` strategy's node and cross-node groups). Split
    has no non-blocking form: it runs on a duplicate made by :func:`private_comm`'s polled
    Idup, so a rank that never comes is a CommTimeoutError there, not a hang here."""
    with _REGISTRY_LOCK:
        cached = comm.Get_attr(_keyval())
        if cached is not None and tag in cached:
            return cached[tag]
    base = private_comm(comm, tag + "/base", timeout)
    part = base.Split(color, key)
    with _REGISTRY_LOCK:
        dups = comm.Get_attr(_keyval())
        dups[tag] = part
        _LIVE[part.py2f()] = part
    return part


def private_comms_of(comm: MPI.Comm) -> dict:
    """``{tag: duplicate}`` made for ``comm`` so far (empty after :func:`release`)."""
    dups = comm.Get_attr(_keyval())
    return dict(dups) if dups else {}


def engine_for(dup: MPI.Comm, strategy: str, label: str,
               progress_thread: Optional[bool] = None, window: int = 1) -> Engine:
    """The one engine of a private communicator (made on first use). ``progress_thread``:
    for a ``nonblocking`` engine made now, whether it gets one (None: where the thread level
    allows it; False drives it from the callers only, as below MPI_THREAD_MULTIPLE);
    ``window``: its segments in flight per collective (the stream's tag names it)."""
    with _REGISTRY_LOCK:
        key = dup.py2f()
        engine = _ENGINES.get(key)
        if engine is None:
            # shm runs on a communication thread too: it drives the reduction itself
            engine = (NonBlockingEngine(dup, label, progress_thread, window)
                      if strategy == "nonblocking" else ThreadEngine(dup, label))
            _ENGINES[key] = engine
        return engine


def engines_of(comm: MPI.Comm) -> list:
    """The engines of every private duplicate of ``comm``."""
    return [e for e in (_ENGINES.get(d.py2f()) for d in private_comms_of(comm).values())
            if e is not None]


def release(comm: MPI.Comm, timeout: float = 30.0) -> None:
    """Stop the engines (threads) of ``comm``'s private duplicates and free them.

    Collective like ``comm.Free()``: call it on every rank of ``comm``, after the last
    collective of its buffers (started collectives are finished first, within ``timeout``
    seconds). Idempotent, and safe at exit; freeing ``comm`` itself does the same. Buffers
    built on ``comm`` before cannot communicate afterwards; new ones make new duplicates.
    """
    if MPI.Is_finalized() or comm == MPI.COMM_NULL:
        return
    dups = comm.Get_attr(_keyval())
    if dups is None:
        return
    _release_dups(dups, timeout)
    comm.Delete_attr(_keyval())


def live_private_comms() -> int:
    """How many private duplicates mpifusion holds (for leak checks)."""
    return len(_LIVE)


@atexit.register
def _stop_engines() -> None:
    """Let started collectives finish (bounded) and stop the threads before MPI finalizes,
    unless this process leaves on an error: then nothing here waits for a peer.

    A process that leaves on an error (``leaving.on_error``: an uncaught exception, or
    ``python -m mpi4py``'s pending abort after ``sys.exit(n)`` or an interrupt) stops its
    engines without draining them; with an abort pending it aborts the job right here,
    with the rank's status, before any later exit handler could block. A communication
    thread still blocked in a collective that timed out, was abandoned or was never joined
    cannot be stopped, and MPI_Finalize under it crashes (SIGSEGV with MPICH): then the
    process says so and exits with status 1 without finalizing. Nothing collective runs
    here: a peer may never come (it is still in its step, stopped, or gone)."""
    global _EXITING
    quick = leaving.on_error()
    blocked = []
    for engine in list(_ENGINES.values()):
        if quick or engine.stuck or engine.abandoned is not None:
            engine.closed = True  # waiting only delays the abort
            if isinstance(engine, NonBlockingEngine):
                engine.stop_thread()
            if (isinstance(engine, ThreadEngine) and engine.thread.is_alive()
                    and any(not t.finished() for t in list(engine.tasks))):
                blocked.append(engine)
            continue
        engine.close(timeout=30.0)
        if (isinstance(engine, ThreadEngine) and engine.thread.is_alive()
                and any(not t.finished() for t in list(engine.tasks))):
            blocked.append(engine)  # a collective the other ranks never joined
    _EXITING = True
    _ENGINES.clear()
    if leaving.abort_status() and MPI.Is_initialized() and not MPI.Is_finalized():
        leaving.abort_now()  # what mpi4py does after the last handler: do it before one blocks
    if blocked and MPI.Is_initialized() and not MPI.Is_finalized():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        sys.stderr.write(f"mpifusion: rank {blocked[0].rank}: exiting without MPI_Finalize: a "
                         f"collective that timed out, was abandoned or was never joined by the "
                         f"other ranks is still pending on a communication thread, and MPI "
                         f"cannot finalize under it\n")
        sys.stderr.flush()
        os._exit(1)
