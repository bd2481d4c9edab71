"""``Call``: one step of a collective, as its generator yields it to an engine.

Every collective is a generator of calls (``collectives.py``, ``order.py``); the engine
decides whether each MPI call runs blocking (``thread``) or as its non-blocking form
(``nonblocking``: the same name with an ``I`` in front, Allreduce -> Iallreduce).

- A *fence* (``fence=True``, the default): the generator resumes only after this call and
  every earlier one completed and landed (the order check, negotiation rounds, barriers, the
  last step of a collective).
- A *pipelined* call (``fence=False``): the engine may resume the generator to prepare the
  next call while this one is in flight, and runs ``land()`` once it completed, in issue
  order. An engine pulls the next call only while fewer than the collective's ``window`` are
  in flight, so a scratch ring of ``window`` slots is reused only after its call landed.
- :func:`pause` is no MPI call: the thread engine sleeps, the other skips it; both first
  finish what is in flight (:data:`FENCE` is a pause of 0).
- *Ahead* (``ahead=k``, pipelined calls only): a dependency the generator states. The call
  is issued in its non-blocking form on every engine, once at most ``k`` earlier calls are
  still in flight (the older ones completed and landed), so the generator can start the next
  chunk's work while this one moves; without it (``None``, the default) the thread engine
  runs a pipelined call blocking, in turn. The ``hierarchical`` inter-node steps use it: the
  all-gather of chunk k waits for chunk k's reduce-scatter, not for chunk k+1's.
- :data:`CHECK` starts the engine's order-check all-reduce (a persistent request made with
  the engine, ``Engine.start_check``): a fence, non-blocking on every engine.
- ``comm``: the communicator the call runs on, where it is not the engine's own (the
  ``hierarchical`` strategy's node and cross-node communicators, private to its stream, so
  that their calls stay in the stream's order too).

A call marked ``nonblocking`` names a method that returns a request (``Iallreduce``, or
mpifusion's own request-like waits): every engine issues it as it is and waits for it (the
thread engine at once). The order check always is non-blocking, so that the checks of any two
collectives match whatever each rank runs, and so are all calls of a small collective under a
deadline (:func:`as_nonblocking`), which a waiting caller may poll itself. MPI never matches a
blocking collective with a non-blocking one. Calls are built by keyword past their first
three fields, so a new field can never shift the others.
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional

#: the keyword arguments of a call that has none (shared, so read-only)
NO_KWARGS: Mapping[str, Any] = MappingProxyType({})


class Call(NamedTuple):
    """One step of a collective: an MPI call (``method`` of the communicator, blocking name)
    or, with ``method`` None, the engine's order check (``check``) or a ``pause``."""

    method: Optional[str]
    args: tuple = ()
    kwargs: Mapping[str, Any] = NO_KWARGS
    #: runs once the call completed, in issue order (where a segment is scaled and rounded)
    land: Optional[Callable[[], None]] = None
    fence: bool = True
    #: seconds the thread engine sleeps (``method`` None, not ``check``)
    pause: float = 0.0
    check: bool = False
    comm: Any = None
    #: pipelined: issued non-blocking once at most this many earlier calls are in flight
    ahead: Optional[int] = None
    #: ``method`` returns a request (its non-blocking form): issued as it is, then waited for
    nonblocking: bool = False


Steps = Iterator[Call]
FENCE = Call(None)
CHECK = Call(None, check=True)


def pipelined(method: str, args: tuple, kwargs: Mapping[str, Any] = NO_KWARGS,
              land: Optional[Callable[[], None]] = None, comm: Any = None,
              ahead: Optional[int] = None) -> Call:
    """A call the engine may keep in flight while the generator prepares the next one."""
    return Call(method, args, kwargs, land=land, fence=False, comm=comm, ahead=ahead)


def pause(seconds: float) -> Call:
    """No MPI call: a fence, then (thread engine) a sleep of ``seconds``."""
    return Call(None, pause=seconds)


@functools.lru_cache(maxsize=None)
def nonblocking_name(name: str) -> str:
    """mpi4py's non-blocking method for a blocking one (Allreduce -> Iallreduce)."""
    return "I" + name[0].lower() + name[1:]


def as_nonblocking(steps: Steps) -> Steps:
    """``steps`` with every MPI call in its non-blocking form."""
    for call in steps:
        yield call if call.method is None or call.nonblocking else call._replace(
            method=nonblocking_name(call.method), nonblocking=True)
