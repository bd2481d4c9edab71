"""Cross-rank health checks: turn hangs into errors that say who is at fault.

Two tools, both on the buffer's private communicator:

* :func:`check_agreement` -- at buffer construction every rank hashes what it is about to
  build (param names, shapes, dtypes and order; act, acc_steps, dst, alignment and the other
  options) and the ranks compare the 64-bit hashes in **one** tiny all-reduce (MAX of ``h``
  and of ``~h``: they agree iff ``max(h) == ~max(~h)``). Only on a mismatch are the
  descriptions gathered, and every rank raises the same :class:`AgreementError` naming the
  first differing entry and which ranks hold which value. Without it, ranks that disagree
  either hang in the collective or silently reduce unrelated bytes together.

* :class:`StartTracker` -- before a rank starts a collective of a buffer it announces
  "buffer k, collective s started" with non-blocking sends; on a timeout the waiting rank
  reads the announcements that arrived and names the ranks that have not started (a rank
  that withheld a param, a rank that died, a rank stuck elsewhere). Announcements are only
  sent when the buffer has a deadline, so runs without a timeout pay nothing. Each rank
  tells every other rank up to :data:`ANNOUNCE_ALL_MAX` ranks; above that only rank 0 is
  told (O(1) messages per rank), and rank 0's error names the late ranks.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..errors import AgreementError, CommTimeoutError

#: Point-to-point tag of start announcements on mpifusion's private communicator (collectives
#: live in a separate MPI context, so they never match these messages).
ANNOUNCE_TAG = 7411
#: Up to this many ranks, every rank announces to every other; above it, only to rank 0.
ANNOUNCE_ALL_MAX = 64


def describe(params: Sequence[Any], options: dict) -> list:
    """What ranks must agree on, as ``(label, value)`` pairs: params first, in order."""
    entries = [(f"param #{i}", f"'{p.name}' shape {tuple(p.shape)} {p.dtype}")
               for i, p in enumerate(params)]
    entries.append(("number of params", str(len(params))))
    entries.extend((key, repr(value)) for key, value in options.items())
    return entries


def fingerprint(entries: list) -> int:
    """A 64-bit hash of the description (blake2b, so equal on every platform and run)."""
    text = "\x1e".join(f"{label}\x1f{value}" for label, value in entries)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _rank_list(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    shown = ", ".join(map(str, ranks[:16])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 16 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def first_difference(all_entries: Sequence[list]) -> str:
    """Describe the first entry on which the ranks' descriptions differ."""
    width = max(len(e) for e in all_entries)
    for i in range(width):
        values = [dict(enumerate(e)).get(i, ("", "(nothing)")) for e in all_entries]
        if len(set(values)) > 1:
            groups: dict = {}
            for rank, (label, value) in enumerate(values):
                groups.setdefault((label, value), []).append(rank)
            parts = [f"{label + ' ' if label else ''}{value} on {_rank_list(ranks)}"
                     for (label, value), ranks in groups.items()]
            return "; ".join(parts)
    return "(descriptions are equal but their hashes differ)"


def check_agreement(comm: MPI.Comm, entries: list, where: str, timeout: Optional[float] = None,
                    tracker: Optional["StartTracker"] = None, key: int = -1) -> None:
    """Raise :class:`AgreementError` on every rank unless all ranks described the same buffer.

    One all-reduce of two uint64 in the common case; a gather of the descriptions only when
    they differ. Within ``timeout`` seconds, or :class:`CommTimeoutError` naming late ranks.
    """
    if comm.Get_size() == 1:
        return
    h = np.uint64(fingerprint(entries))
    send = np.array([h, ~h], dtype=np.uint64)
    recv = np.empty(2, dtype=np.uint64)
    if tracker is not None:
        tracker.announce(key, 0)
    req = comm.Iallreduce(send, recv, op=MPI.MAX)
    wait_request(req, timeout, lambda: (f"{where}: the agreement check at construction did not "
                                        f"complete within {timeout:g} s"
                                        + (tracker.late_ranks_text(key, 0) if tracker else "")))
    if recv[0] == ~recv[1]:
        return
    everyone = comm.allgather(entries)
    raise AgreementError(f"{where}: ranks disagree on the buffer they build (collectives would "
                         f"hang or mix unrelated grads): {first_difference(everyone)}. "
                         f"Build the same params, in the same order, with the same options "
                         f"on every rank of comm_group")


def wait_request(req: MPI.Request, timeout: Optional[float], message) -> None:
    """``req.Wait()`` bounded by ``timeout``; ``message()`` builds the CommTimeoutError text."""
    if timeout is None:
        req.Wait()
        return
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not req.Test():
        if time.monotonic() >= deadline:
            raise CommTimeoutError(message())
        time.sleep(pause)
        pause = min(pause * 2, 1e-2)


class StartTracker:
    """Who started which collective, learned from small non-blocking announcements.

    One per private communicator. Buffers register in construction order (the same on every
    rank, which the agreement check enforces) and get a key; ``seq`` counts the buffer's
    collectives (0 = the construction check). Messages are ``int64[key, seq]``.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._next_key = 0
        self._started: dict = {}   # key -> int64[size]: highest seq each rank announced
        self._sends: list = []     # (request, message) until the send completes
        self._probe = MPI.Status()
        self.broken = False        # a send or receive failed (a peer died): stop talking

    def register(self) -> int:
        key = self._next_key
        self._next_key += 1
        return key

    def _peers(self) -> list:
        if self.size <= ANNOUNCE_ALL_MAX:
            return [r for r in range(self.size) if r != self.rank]
        return [] if self.rank == 0 else [0]

    def _seen(self, key: int) -> np.ndarray:
        seen = self._started.get(key)
        if seen is None:
            seen = self._started[key] = np.full(self.size, -1, dtype=np.int64)
        return seen

    def announce(self, key: int, seq: int) -> None:
        """Tell the peers that this rank starts collective ``seq`` of buffer ``key`` now."""
        if self.size == 1 or self.broken:
            return
        self._seen(key)[self.rank] = max(self._seen(key)[self.rank], seq)
        msg = np.array([key, seq], dtype=np.int64)
        try:
            for peer in self._peers():
                self._sends.append((self.comm.Isend([msg, MPI.INT64_T], peer, ANNOUNCE_TAG), msg))
            self.drain()
        except MPI.Exception:
            self.broken = True

    def drain(self) -> None:
        """Receive the announcements that arrived; forget sends that completed."""
        if self.broken:
            return
        try:
            buf = np.empty(2, dtype=np.int64)
            while self.comm.Iprobe(MPI.ANY_SOURCE, ANNOUNCE_TAG, self._probe):
                src = self._probe.Get_source()
                self.comm.Recv([buf, MPI.INT64_T], src, ANNOUNCE_TAG)
                seen = self._seen(int(buf[0]))
                seen[src] = max(seen[src], int(buf[1]))
            if self._sends:
                self._sends = [(r, m) for r, m in self._sends if not r.Test()]
        except MPI.Exception:
            self.broken = True

    def not_started(self, key: int, seq: int) -> Optional[list]:
        """Ranks not known to have started collective ``seq`` of ``key``; None if unknowable."""
        if self.size == 1:
            return []
        if self.broken or (self.size > ANNOUNCE_ALL_MAX and self.rank != 0):
            return None
        self.drain()
        seen = self._seen(key)
        return [r for r in range(self.size) if seen[r] < seq]

    def late_ranks_text(self, key: int, seq: int) -> str:
        """``'; ranks 1, 3 have not started it'`` (or why that is unknown), for error messages."""
        late = self.not_started(key, seq)
        if late is None:
            return ("; which ranks have not started it is unknown here"
                    + (f" (at more than {ANNOUNCE_ALL_MAX} ranks only rank 0 tracks that)"
                       if self.size > ANNOUNCE_ALL_MAX else ""))
        if not late:
            return ("; every rank has started it (a rank may have died or stalled inside "
                    "the collective)")
        verb = "have" if len(late) > 1 else "has"
        return (f"; {_rank_list(late)} of the buffer's communicator {verb} not started it "
                f"(withheld a param, stopped early, or died)")


_TRACKERS: dict = {}


def tracker_for(comm: MPI.Comm) -> StartTracker:
    """The one tracker of a (private) communicator."""
    key = comm.py2f()
    tracker = _TRACKERS.get(key)
    if tracker is None:
        tracker = _TRACKERS[key] = StartTracker(comm)
    return tracker
