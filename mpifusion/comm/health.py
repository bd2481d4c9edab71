"""Cross-rank health checks: turn hangs into errors that say who is at fault.

Two tools:

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

Both run on a *control* communicator: a private duplicate of comm_group that carries nothing
else (a lock serialises its calls), so they never meet a buffer's collectives, which run on
their stream's own duplicate through its engine.
"""
from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ..errors import AgreementError, CommTimeoutError
from .poll import poll

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


def entries_digest(entries: list) -> int:
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
                    tracker: Optional["StartTracker"] = None, key: int = -1,
                    minimum: Optional[int] = None) -> Optional[int]:
    """Raise :class:`AgreementError` on every rank unless all ranks described the same buffer.

    One all-reduce of three uint64 in the common case (and the minimum over ranks of
    ``minimum``, e.g. each machine's default segment size, which is returned); a gather of
    the descriptions only when they differ. Always the non-blocking form, polled, so ranks
    whose options differ (strategy, deadline) still make the same calls. Within ``timeout``
    seconds, or :class:`CommTimeoutError` naming late ranks. ``comm`` is a control
    communicator: its calls are serialised by the tracker's lock.
    """
    if comm.Get_size() == 1:
        return minimum
    lock = tracker.lock if tracker is not None else threading.Lock()
    h = np.uint64(entries_digest(entries))
    low = np.uint64(minimum if minimum is not None else 0)
    send = np.array([h, ~h, ~low], dtype=np.uint64)
    recv = np.empty(3, dtype=np.uint64)
    if tracker is not None and timeout is not None:
        tracker.announce(key, 0)

    def late() -> str:
        return (f"{where}: the agreement check at construction did not complete within "
                f"{timeout:g} s" + (tracker.late_ranks_text(key, 0) if tracker else ""))

    with lock:
        req = comm.Iallreduce([send, MPI.UINT64_T], [recv, MPI.UINT64_T], op=MPI.MAX)
    wait_request(req, timeout, late, lock, keep=(send, recv))
    if recv[0] == ~recv[1]:
        return None if minimum is None else int(~recv[2])
    everyone = _allgather_entries(comm, entries, timeout, late, lock)
    raise AgreementError(f"{where}: ranks disagree on the buffer they build (collectives would "
                         f"hang or mix unrelated grads): {first_difference(everyone)}. "
                         f"Build the same params, in the same order, with the same options "
                         f"on every rank of comm_group")


def _allgather_entries(comm: MPI.Comm, entries: list, timeout: Optional[float], late,
                       lock) -> list:
    """Every rank's description (JSON), with polled non-blocking calls."""
    data = np.frombuffer(json.dumps(entries).encode(), dtype=np.uint8)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    mine = np.array([data.size], np.int64)  # referenced until the call completes
    with lock:
        req = comm.Iallgather([mine, MPI.INT64_T], [sizes, MPI.INT64_T])
    wait_request(req, timeout, late, lock, keep=(mine, sizes))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    with lock:
        req = comm.Iallgatherv([data, MPI.BYTE], [out, (sizes, offsets), MPI.BYTE])
    wait_request(req, timeout, late, lock, keep=(data, out, sizes, offsets))
    return [[tuple(e) for e in json.loads(out[o:o + n].tobytes().decode())]
            for o, n in zip(offsets.tolist(), sizes.tolist())]


#: Requests given up after a timeout, with their arrays: MPI may still read or write them
#: (a collective cannot be cancelled), so they must never be freed.
_STRANDED: list = []


def wait_request(req: MPI.Request, timeout: Optional[float], message, lock=None,
                 keep: tuple = ()) -> None:
    """Poll ``req`` until done (each test under ``lock``), bounded by ``timeout``;
    ``message()`` builds the CommTimeoutError text. ``keep``: the arrays the call uses,
    kept alive for good if it times out (mpi4py keeps no reference to them)."""
    if lock is None:
        done = req.Test
    else:
        def done() -> bool:
            with lock:
                return req.Test()
    if not poll(done, timeout, first=1e-5, cap=1e-3):
        _STRANDED.append((req, keep))
        raise CommTimeoutError(message())


class StartTracker:
    """Who started which collective, learned from small non-blocking announcements.

    One per control communicator (a private duplicate that carries only the construction
    checks and these messages; its calls are serialised by ``lock``). Buffers register in
    construction order (the same on every rank, which the agreement check enforces) and get
    a key; ``seq`` counts the buffer's collectives (0 = the construction check). Messages are
    ``int64[key, seq, kind]``: kind 0 "started", kind 1 "gave it up" (``reset(abandon=True)``,
    sent to every peer whatever the deadline, so their later collectives refuse to pair with
    the stale one). It also hands out the negotiation slots of the communicator's buffers.
    """

    STARTED, ABANDONED = 0, 1

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.lock = threading.Lock()
        self._next_key = 0
        self._started: dict = {}   # key -> int64[size]: highest seq each rank announced
        self._sends: list = []     # (request, message) until the send completes
        self._sent = np.zeros(self.size, dtype=np.int64)  # messages sent to each rank
        self._got = np.zeros(self.size, dtype=np.int64)   # messages received from each rank
        self._probe = MPI.Status()
        self.broken = False        # a send or receive failed (a peer died): stop talking
        self.abandoned: dict = {}  # rank -> (key, seq) of a collective it gave up
        self._next_slot = 0
        self._slots: set = set()   # negotiation slots in use on this rank
        #: ``(ranks per node, why the nodes are uneven)`` of the communicator, learned by the
        #: first Communicator built on it (``Communicator._nodes``)
        self.nodes: Optional[Tuple[int, str]] = None

    def register(self) -> int:
        key = self._next_key
        self._next_key += 1
        return key

    def claim_slot(self, nslots: int) -> Optional[int]:
        """The next negotiation slot (construction order), or None when it is still taken."""
        slot = self._next_slot % nslots
        self._next_slot += 1
        if slot in self._slots:
            return None
        self._slots.add(slot)
        return slot

    def free_slot(self, slot: int) -> None:
        self._slots.discard(slot)

    def _peers(self) -> list:
        if self.size <= ANNOUNCE_ALL_MAX:
            return [r for r in range(self.size) if r != self.rank]
        return [] if self.rank == 0 else [0]

    def _seen(self, key: int) -> np.ndarray:
        seen = self._started.get(key)
        if seen is None:
            seen = self._started[key] = np.full(self.size, -1, dtype=np.int64)
        return seen

    def _send(self, peers: Sequence[int], key: int, seq: int, kind: int) -> None:
        msg = np.array([key, seq, kind], dtype=np.int64)
        with self.lock:
            try:
                for peer in peers:
                    self._sends.append((self.comm.Isend([msg, MPI.INT64_T], peer, ANNOUNCE_TAG),
                                        msg))
                    self._sent[peer] += 1
            except MPI.Exception:
                self.broken = True
        self.drain()

    def announce(self, key: int, seq: int) -> None:
        """Tell the peers that this rank starts collective ``seq`` of buffer ``key`` now."""
        if self.size == 1 or self.broken:
            return
        self._seen(key)[self.rank] = max(self._seen(key)[self.rank], seq)
        self._send(self._peers(), key, seq, self.STARTED)

    def announce_abandoned(self, key: int, seq: int) -> None:
        """Tell every peer that this rank gave up collective ``seq`` of buffer ``key``."""
        if self.size == 1 or self.broken:
            return
        self._send([r for r in range(self.size) if r != self.rank], key, seq, self.ABANDONED)

    def drain(self) -> None:
        """Receive the announcements that arrived; forget sends that completed."""
        if self.broken:
            return
        comm = self.comm
        try:  # the common case, before every start: nothing came, nothing to forget
            # two probes: one may only progress a message that arrived meanwhile
            if (not self._sends and not comm.Iprobe(MPI.ANY_SOURCE, ANNOUNCE_TAG)
                    and not comm.Iprobe(MPI.ANY_SOURCE, ANNOUNCE_TAG)):
                return
        except MPI.Exception:
            self.broken = True
            return
        with self.lock:
            try:
                # two passes: one probe may only progress a message that arrived meanwhile
                for _ in range(2):
                    while self.comm.Iprobe(MPI.ANY_SOURCE, ANNOUNCE_TAG, self._probe):
                        src = self._probe.Get_source()
                        buf = np.empty(3, dtype=np.int64)
                        self.comm.Recv([buf, MPI.INT64_T], src, ANNOUNCE_TAG)
                        self._got[src] += 1
                        key, seq, kind = (int(v) for v in buf)
                        if kind == self.ABANDONED:
                            self.abandoned.setdefault(src, (key, seq))
                        else:
                            seen = self._seen(key)
                            seen[src] = max(seen[src], seq)
                if self._sends:
                    self._sends = [(r, m) for r, m in self._sends if not r.Test()]
            except MPI.Exception:
                self.broken = True

    def settle(self, timeout: float) -> bool:
        """Receive every message still on its way here, and finish this rank's sends, before
        the communicator is freed (collective). A message left unreceived on a freed
        communicator is not harmless: Open MPI reuses the communicator's context, and a later
        communicator's collective was seen to consume it (that rank then ran one collective
        ahead of its peer: a hang). False if ``timeout`` passed first or a peer is gone."""
        if self.size == 1 or self.broken:
            return not self.broken
        sent, due = self._sent.copy(), np.empty_like(self._sent)
        try:
            wait_request(self.comm.Ialltoall([sent, MPI.INT64_T], [due, MPI.INT64_T]),
                         timeout, lambda: "", keep=(sent, due))
            return poll(lambda: self.drain() or self.broken or
                        (not self._sends and bool((self._got >= due).all())),
                        timeout, first=1e-5) and not self.broken
        except (MPI.Exception, CommTimeoutError):
            self.broken = True
            return False

    def not_started(self, key: int, seq: int) -> Optional[list]:
        """Ranks not known to have started collective ``seq`` of ``key``; None if unknowable."""
        if self.size == 1:
            return []
        if self.broken or (self.size > ANNOUNCE_ALL_MAX and self.rank != 0):
            return None
        self.drain()
        seen = self._seen(key)
        return [r for r in range(self.size) if seen[r] < seq]

    def abandoned_text(self) -> str:
        """``'; rank 1 gave up ...'`` when peers abandoned a collective, for error messages."""
        self.drain()
        if not self.abandoned:
            return ""
        ranks = sorted(self.abandoned)
        return (f"; {_rank_list(ranks)} gave up a collective of this communicator "
                f"(reset(abandon=True) after a timeout), so it can no longer pair collectives")

    def late_ranks_text(self, key: int, seq: int) -> str:
        """``'; ranks 1, 3 have not started it'`` (or why that is unknown), for error messages."""
        late = self.not_started(key, seq)
        gave_up = self.abandoned_text()
        if late is None:
            return ("; which ranks have not started it is unknown here"
                    + (f" (at more than {ANNOUNCE_ALL_MAX} ranks only rank 0 tracks that)"
                       if self.size > ANNOUNCE_ALL_MAX else "") + gave_up)
        if not late:
            return ("; every rank has started it (a rank may have died or stalled inside "
                    "the collective)" + gave_up)
        verb = "have" if len(late) > 1 else "has"
        return (f"; {_rank_list(late)} of the buffer's communicator {verb} not started it "
                f"(withheld a param, stopped early, or died)" + gave_up)


_TRACKERS: dict = {}


def tracker_for(comm: MPI.Comm) -> StartTracker:
    """The one tracker of a (control) communicator."""
    key = comm.py2f()
    tracker = _TRACKERS.get(key)
    if tracker is None:
        tracker = _TRACKERS[key] = StartTracker(comm)
    return tracker


def forget(comm: MPI.Comm, settle: Optional[float] = None) -> None:
    """Drop the tracker of a communicator about to be freed (MPI reuses its handle); with
    ``settle`` seconds, first receive what is still on its way (collective:
    :meth:`StartTracker.settle`)."""
    tracker = _TRACKERS.pop(comm.py2f(), None)
    if tracker is not None and settle is not None:
        tracker.settle(settle)
