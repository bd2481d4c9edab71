"""Collectives in one verified order (``order="strict"``) or in an agreed one (``"negotiated"``).

``strict`` (Paddle's model): a communicator's collectives run in the order they are started,
which must be the same on every rank. ``verified_steps`` puts one tiny all-reduce in front of
each collective: the ranks compare a 64-bit fingerprint of (position in the stream, kind,
element count, dtype, root, buffer id, step) as ``MAX(h)`` and ``MAX(~h)`` (equal everywhere
iff ``max(h) == ~max(~h)``). On a mismatch -- which every rank sees in the same call -- the
ranks all-gather their descriptions and every rank raises the same :class:`OrderError`;
nothing was exchanged, so no grad changed and the stream stays aligned.

``negotiated`` (Horovod's model): a buffer that is ready does not start its collective; it is
marked ready, and a *round* -- one all-reduce (BAND) of ``[ready bits, ~ready bits, h, ~h]``
-- tells every rank which buffers are ready everywhere (AND) and whether any rank has one
that others lack (OR). The buffers ready everywhere are reduced in ascending slot order, the
same on every rank, whatever order the hooks fired in. Rounds go on while some rank has a
ready buffer that others lack, and stop at the same round on every rank.
"""
from __future__ import annotations

import collections
import threading
from functools import partial
from typing import Any, Deque, Dict, Generator, List, Optional, Sequence, TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ..errors import OrderError
from . import tuning
from .poll import Backoff
from .call import CHECK, FENCE, Call, Steps, pause
from .record import Collective, Plan, finish

if TYPE_CHECKING:
    from .engines import Engine

#: kinds of collectives, as fingerprinted (and named in OrderError)
KINDS = {1: "ALL_REDUCE", 2: "REDUCE", 3: "REDUCE_SCATTER", 4: "ALL_GATHER (sync_params)",
         5: "BARRIER", 6: "order negotiation round"}
ALLREDUCE, REDUCE, REDUCE_SCATTER, ALLGATHER, BARRIER, ROUND = 1, 2, 3, 4, 5, 6
_DTYPES = ("float32", "float64", "float16", "bfloat16", "uint8", "int64", "int32")
_MASK = (1 << 64) - 1


_CODES: Dict[Any, int] = {}


def dtype_code(dtype: Any) -> int:
    """A small int per dtype (cached: numpy's ``dtype.name`` is slow Python code)."""
    code = _CODES.get(dtype)
    if code is None:
        name = getattr(dtype, "name", str(dtype))
        code = _CODES[dtype] = _DTYPES.index(name) if name in _DTYPES else 99
    return code


def fingerprint(values: Sequence[int]) -> int:
    """64 bits from ints (int hashing is not salted: equal in every process)."""
    return hash(tuple(values)) & _MASK


def describe_call(row: Sequence[int]) -> str:
    """One rank's description ``[seq, kind, count, dtype, root, buffer, step(, key)]`` in
    words; ``key``: which of the communicators built on the user's one started it (buffer ids
    are the user's and may repeat: fused_parameters numbers each split from 0)."""
    seq, kind, count, dtype, root, buf, step = (int(v) for v in row[:7])
    key = int(row[7]) if len(row) > 7 else -1
    what = KINDS.get(kind, f"kind {kind}")
    text = (f"{'buffer %d ' % buf if buf >= 0 else ''}"
            f"{'(#%d built on this communicator) ' % key if key >= 0 else ''}"
            f"{'step %d ' % step if step >= 0 else ''}{what}")
    if kind not in (BARRIER, ROUND):
        text += f" of {count} {_DTYPES[dtype] if dtype < len(_DTYPES) else 'elements'}"
    if kind == REDUCE:
        text += f" to rank {root}"
    return f"{text} as collective #{seq}"


def _step_split(rows: np.ndarray) -> Optional[Dict[int, List[int]]]:
    """Each step serial and the ranks at it, where the rows differ in the step (column 6)
    only -- the same collective of the same buffer, a rank a step ahead -- else None."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] < 7 or len(rows) < 2:
        return None
    rest = np.delete(rows[:, 1:], 5, axis=1)  # all but the position and the step
    if (rest != rest[0]).any() or (rows[:, 6] == rows[0, 6]).all():
        return None
    at: Dict[int, List[int]] = {}
    for r, step in enumerate(rows[:, 6].tolist()):
        at.setdefault(int(step), []).append(r)
    return at


def _ranks(rs: Sequence[int]) -> str:
    return (f"{'ranks' if len(rs) > 1 else 'rank'} {', '.join(map(str, rs[:16]))}"
            f"{', ...' if len(rs) > 16 else ''}")


#: what a rank that dropped a step, and the ranks that met it, do
_DROPPED = ("a rank dropped a step (reset() ends the step on the rank that calls it, so its "
            "next collective carries the next step serial). To skip a step, skip it on every "
            "rank (agree first, e.g. an all-reduce of a found-inf flag, as AMP does) or check "
            "in a zero grad (mark_unused) so that the step goes on")
_UNMOVED = "Nothing was exchanged (no grad changed); every rank raises this"


def _buffer_text(row: Sequence[int]) -> str:
    buf, key = int(row[5]), int(row[7]) if len(row) > 7 else -1
    return (f"{'buffer %d' % buf if buf >= 0 else 'a collective'}"
            f"{' (#%d built on this communicator)' % key if key >= 0 else ''}")


def order_message(rank: int, rows: np.ndarray, where: str) -> str:
    at = _step_split(rows)
    after = _UNMOVED
    if at is not None:
        high = max(at)
        parts = "; ".join(f"{_ranks(rs)} at step {s}" for s, rs in sorted(at.items(),
                                                                       reverse=True))
        return (f"rank {rank}: {where}: ranks started {_buffer_text(rows[0])} at different "
                f"steps ({parts}): {_DROPPED}. {after}; reset() on every rank moves the "
                f"buffer past step {high}")
    groups: Dict[str, List[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(describe_call(row), []).append(r)
    parts = "; ".join(f"{_ranks(rs)} started {text}" for text, rs in groups.items())
    return (f"rank {rank}: {where}: ranks started different collectives on one communicator "
            f"({parts}). {after}. "
            f"Start collectives in the same order on every rank (e.g. the last add_grad of "
            f"each buffer in the same order), or pass order='negotiated' (MPIFUSION_ORDER="
            f"negotiated) to let the ranks agree on an order")


def order_error(rank: int, rows: np.ndarray, where: str) -> OrderError:
    """The :class:`OrderError` of gathered descriptor rows ``[seq, kind, count, dtype, root,
    buffer, step(, key, ...)]`` (one per rank): the same on every rank, with ``steps`` set
    where the rows differ in the step serial only."""
    at = _step_split(rows)
    return OrderError(order_message(rank, rows, where),
                      steps=None if at is None else (min(at), max(at)))


def verified_steps(seq: int, desc: Sequence[int], polled: bool, steps: Steps,
                   comm: MPI.Comm, words: Any, name: str) -> Steps:
    """``steps`` preceded by the order check (one all-reduce of two uint64, non-blocking on
    every engine: see ``call.py``). ``seq`` is the collective's place in the stream,
    ``desc`` (kind, count, dtype, root, buffer id, step, communicator key), ``polled``
    whether its calls are non-blocking; ``words`` the engine's ``check_words``. The
    fingerprint covers the form of the calls that follow, so ranks that would issue them
    differently stop here instead of deadlocking. Reads nothing but what it is passed."""
    h = fingerprint((seq, *desc, polled))
    # the engine's scratch: its tasks run one at a time, and this is a fence
    words[0] = h
    words[1] = h ^ _MASK
    yield CHECK
    if words[2] ^ _MASK != words[3]:
        mine = np.array((seq, *desc), dtype=np.int64)
        rows = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
        yield Call("Iallgather", ([mine, MPI.INT64_T], [rows, MPI.INT64_T]), nonblocking=True)
        raise order_error(comm.Get_rank(), rows, name or "collective")
    yield from steps


class Negotiator:
    """Agreed order for one (negotiated) private communicator; see the module docstring.

    Items are ``slot * KINDS_PER_SLOT + kind``: a slot per Communicator (buffer), claimed in
    construction order (checked by the agreement check), a kind per collective type.
    """

    WORDS = 16                          # 1024 item bits per round
    KINDS_PER_SLOT = 4
    SLOTS = WORDS * 64 // KINDS_PER_SLOT

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.queues: Dict[int, Deque[Collective]] = {}
        self.active = False             # a round task is queued or running on this rank
        self.current: Optional[Collective] = None
        self.rounds = 0                 # rounds run (for the benchmark)
        #: collectives run in rounds so far: the next one's place (the same on every rank)
        self.placed = 0

    def ready(self, item: int, task: Collective) -> None:
        """``task`` is ready on this rank; it runs once every rank has marked ``item`` ready."""
        with self.lock:
            self.queues.setdefault(item, collections.deque()).append(task)
            start = not self.active
            self.active = True
        if start:
            try:
                self.engine.submit(self._round_task())
            except BaseException:
                with self.lock:
                    self.active = False
                    self.queues[item].remove(task)
                raise

    def _round_task(self) -> Collective:
        return Collective(Plan(name="order negotiation", rank=self.engine.rank,
                               on_fail=self._fail_all), self._rounds)

    def _fail_all(self, exc: BaseException) -> None:
        with self.lock:
            items = [t for q in self.queues.values() for t in q]
            if self.current is not None:
                items.append(self.current)
            self.queues.clear()
            self.current = None
            self.active = False
        for t in items:
            finish(t, exc)

    def _rounds(self, seq: int) -> Steps:
        """The round task's calls (``seq``: its place in the engine's stream): rounds until
        nothing is ready anywhere that is not ready everywhere, each running the collectives
        ready everywhere, built with their place among the agreed ones."""
        words = self.WORDS
        send = np.zeros(2 * words + 2, dtype=np.uint64)
        recv = np.empty_like(send)
        rnd, backoff = 0, Backoff(2e-5, tuning.ACTIVE.negotiation_max_pause_s)
        while True:
            send[:words] = 0
            with self.lock:
                ids = [i for i, q in self.queues.items() if q]
            for i in ids:
                send[i >> 6] |= np.uint64(1 << (i & 63))
            send[words:2 * words] = ~send[:words]
            h = np.uint64(fingerprint((ROUND, seq, rnd)))
            send[2 * words], send[2 * words + 1] = h, ~h
            yield Call("Allreduce", ([send, MPI.UINT64_T], [recv, MPI.UINT64_T]),
                       {"op": MPI.BAND})
            self.rounds += 1
            if recv[2 * words] != ~recv[2 * words + 1]:
                raise OrderError(f"rank {self.engine.rank}: order negotiation round {rnd} of "
                                 f"negotiation #{seq}: not every rank is in the same round "
                                 f"(a collective started outside the negotiation?)")
            every = recv[:words].copy()
            anywhere = ~recv[words:2 * words]
            agreed = [w * 64 + b for w in np.flatnonzero(every).tolist()
                      for b in range(64) if (int(every[w]) >> b) & 1]
            for item in agreed:
                with self.lock:
                    task = self.queues[item].popleft()
                    self.current = task
                try:
                    failure = yield from _own_landings(task, self.placed)
                except Exception as exc:  # its steps raised: the task's error, not the round's
                    failure = exc
                self.placed += 1
                with self.lock:
                    self.current = None
                finish(task, failure)
            rnd += 1
            if not np.any(anywhere & ~every):
                # nothing ready anywhere that was not reduced now: every rank ends here
                with self.lock:
                    more = any(self.queues.values())
                    self.active = more
                if more:  # got ready meanwhile on this rank: the next round task starts now
                    self.engine.submit_from_stream(self._round_task())
                return
            if agreed:
                backoff.reset()
            else:
                yield pause(backoff.next())


def _own_landings(task: Collective,
                  seq: int) -> Generator[Call, None, Optional[BaseException]]:
    """``task``'s calls inside a negotiation round, built with ``seq``; returns its first
    landing error, which stays its own (not the round's). It ends with a fence, so the round
    finishes it only once everything landed."""
    errors: List[BaseException] = []
    build = task.build
    for call in (build(seq) if build is not None else ()):
        if call.land is not None:
            call = call._replace(land=partial(_land_for, errors, call.land))
        yield call
    yield FENCE
    return errors[0] if errors else None


def _land_for(errors: List[BaseException], land: Any) -> None:
    try:
        land()
    except Exception as exc:
        errors.append(exc)
