"""``Communicator``: the collectives a fused buffer needs, on a private communicator.

How a buffer is handed to MPI changes the time of a sync by up to 8x (see BENCHMARKS.md), so
the way collectives run is a *strategy* (``CommOptions.strategy``):

``auto`` (default) is ``shm`` or ``hierarchical`` where ranks share a node, else ``thread``
(:func:`resolve_strategy`).

``thread``
    A daemon thread per communicator runs blocking collectives in segments of
    ``segment_bytes`` (blocking calls take MPI's fastest algorithms; segments stay in cache,
    so the ``1/n`` scaling and half-precision rounding of each segment are cheap). It
    progresses on its own while the caller keeps calling ``add_grad`` or computing. Needs
    ``MPI_THREAD_MULTIPLE`` (mpi4py's default level).
``nonblocking``
    ``Iallreduce``/``Ireduce``/... in segments, up to ``window`` of them in flight (a
    pipeline: each lands -- scaled, rounded back -- as it completes, while later ones are in
    flight). Progressed by a progress thread at ``MPI_THREAD_MULTIPLE``, else by ``poll()``
    (every ``add_grad``), ``is_completed()`` and ``wait()`` (engines.py). The path for MPIs
    without ``MPI_THREAD_MULTIPLE``.

``shm``
    For the ranks of one node: each buffer's grad and param storage lives in shared memory
    every rank of the node maps (the arena of ``shm.py``, :meth:`Communicator.reserve`),
    and each rank sums its slice of every rank's buffer directly between two barriers (``shm_collectives.py``), on a communication thread
    as ``thread``. Where the ranks span nodes or the shared memory cannot be made, every rank
    falls back to ``thread`` (agreed at construction, logged with the reason; ``strategy``
    then says ``thread`` and ``shm_fallback`` why). Device (cupy) and non-contiguous arrays
    take ``thread``'s collectives on the same stream.
``hierarchical``
    Across nodes: ``shm`` within each node, and between the nodes an MPI collective on each
    rank's slice over the ranks that hold the same slice on every node (reduce-scatter +
    all-gather, reduce or reduce-scatter; all-gather for ``sync_params``), on the same
    communication thread. ``node_size`` treats consecutive groups of ranks as nodes (nodes
    emulated on one machine); else the nodes MPI reports, which must hold equally many ranks
    numbered node by node (else ``thread``, with the reason).

Every collective is written once, as a generator of MPI calls (``collectives.py``,
``shm_collectives.py``); a strategy only decides whether each call is blocking (on the
thread) or non-blocking.

Order (``CommOptions.order``, see ``order.py``): ``strict`` runs collectives in start order,
each preceded by a tiny check that every rank starts the same one (``verify_order``);
``negotiated`` lets the ranks agree at run time on the order of the buffers ready everywhere.
Each (strategy, order, verify_order) is its own stream: its own private duplicate and engine. A
separate *control* duplicate carries the construction-time agreement check and the start
announcements, so building a buffer never meets another buffer's collectives in flight.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ..arrays import cuda
from ..config import THREADED_STRATEGIES, CommOptions, DEFAULT_SEGMENT_BYTES
from ..dtypes import HALF
from ..errors import AbandonedError, CommLimitError, OptionError, StateError
from ..machine import segment_for
from . import health, order as order_mod, shm_collectives as shm_steps, tuning
from .collectives import (allgather_steps, allreduce_steps, barrier_steps,
                          reduce_scatter_steps)
from .shm import NodeMemory, ShmStream, agree_max, memory_for, node_layout
from .engines import ThreadEngine
from .registry import engine_for, engines_of, private_comm, private_split
from .order import ALLGATHER, ALLREDUCE, BARRIER, REDUCE, REDUCE_SCATTER, Negotiator
from .call import Steps, as_nonblocking
from .record import Build, Collective, Plan
from .task import CommTask

logger = logging.getLogger("mpifusion")

#: negotiated order: which of a slot's item bits each kind of collective uses
_ITEM_KIND = {ALLREDUCE: 0, REDUCE: 0, REDUCE_SCATTER: 0, ALLGATHER: 1, BARRIER: 2}

#: ``_start``'s ``way`` of the shm collectives (0: MPI calls), in the order check's fingerprint
SHM_WAY = 1

@functools.lru_cache(maxsize=None)
def has_isendrecv() -> bool:
    """Whether this MPI has ``MPI_Isendrecv`` (MPI-4.0; Open MPI 5 has it though it reports
    MPI 3.1), tried once on COMM_SELF."""
    a, b = np.zeros(1, np.float32), np.empty(1, np.float32)
    try:
        MPI.COMM_SELF.Isendrecv([a, MPI.FLOAT], 0, 0, [b, MPI.FLOAT], 0, 0).Wait()
    except (NotImplementedError, MPI.Exception):
        return False
    return True


def allreduce_way(choice: str, strategy: str) -> str:
    """``CommOptions.allreduce`` resolved: ``auto`` is ``ring`` for ``nonblocking`` on Open
    MPI (its libnbc Iallreduce is the slow path measured in BENCHMARKS.md) where the library
    has Isendrecv, else ``mpi``. The same on every rank (the agreement check compares it)."""
    if choice != "auto":
        return choice
    if strategy == "nonblocking" and MPI.get_vendor()[0] == "Open MPI" and has_isendrecv():
        return "ring"
    return "mpi"


def resolve_strategy(choice: str, size: int = 1, per_node: int = 1, uneven: str = "",
                     thread_multiple: Optional[bool] = None,
                     nbytes: Optional[int] = None) -> Tuple[str, str]:
    """``CommOptions.strategy`` resolved for a communicator of ``size`` ranks, ``per_node``
    of them on each node (``uneven``: why the nodes do not hold equally many, numbered node
    by node), and why (what ``mpifusion info`` prints). ``auto`` takes shared memory where
    ranks share a node, since a direct reduction in a shared window stays near a memcpy where
    MPI's own all-reduce ran 1.1-7x slower (BENCHMARKS.md): ``shm`` when every rank is on one
    node, ``hierarchical`` across nodes of several ranks each (``thread`` for a buffer of
    ``nbytes`` below ``Tuning.auto_hierarchical_min_bytes``, where it measured faster), else
    ``thread`` (its blocking segments on a communication thread); ``nonblocking`` below
    MPI_THREAD_MULTIPLE (no second thread may call MPI). ``thread_multiple``: the thread level
    (None: MPI's); ``nbytes``: the bytes per rank the communicator carries (None: unknown,
    taken as large)."""
    if choice != "auto":
        return choice, "chosen (strategy= or MPIFUSION_COMM_STRATEGY)"
    if thread_multiple is None:
        thread_multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
    if not thread_multiple:
        return "nonblocking", "auto: MPI is not at MPI_THREAD_MULTIPLE"
    if size <= 1:
        return "thread", "auto: one rank"
    if uneven:
        return "thread", f"auto: {uneven}"
    if per_node >= size:
        return "shm", f"auto: all {size} ranks share one node"
    if per_node <= 1:
        return "thread", "auto: one rank per node"
    low = tuning.ACTIVE.auto_hierarchical_min_bytes
    if nbytes is not None and nbytes < low:
        return "thread", (f"auto: {size // per_node} nodes of {per_node} ranks, a buffer of "
                          f"{nbytes} bytes (below {low >> 10} KiB "
                          f"thread's one all-reduce is faster across nodes)")
    return "hierarchical", f"auto: {size // per_node} nodes of {per_node} ranks"


def _device_ready(arr: Any) -> None:
    """Wait for the kernels queued on a device array's stream before MPI reads it (a host
    array has none: no call into the device layer on the small collectives' path)."""
    if type(arr) is not np.ndarray:
        cuda.synchronize(arr)


def _prepared(prepare: Callable[[], None], steps: Steps) -> Steps:
    """``steps`` once ``prepare()`` ran: when the engine reaches them, after the order check."""
    prepare()
    yield from steps


class Communicator:
    """The collectives a fused buffer needs, on a private communicator.

    Half-precision buffers are widened to fp32 one segment at a time, summed in fp32, scaled
    (``scale``) in fp32 and rounded back once: MPI has no bfloat16 type, and summing in fp32
    makes the result depend only on the order of additions MPI chose, with one final
    rounding (see docs/exactness.md). Temporary memory stays within a few segments.
    """

    def __init__(self, comm: MPI.Comm, options: Optional[CommOptions] = None,
                 open: bool = True, *,
                 node_probe: Optional[Callable[[MPI.Comm], int]] = None,
                 nbytes: Optional[int] = None, **overrides: Any) -> None:
        """``comm``: the user's communicator, never used itself (its private duplicates
        are). ``options`` (default: :meth:`~mpifusion.CommOptions.from_env`); keyword ``overrides``
        (``strategy``, ``segment_bytes``, ``timeout``, ``order``, ...) replace single fields.
        ``open=False`` defers the agreement check and the stream to :meth:`open` (a buffer
        adds its own description to the check). ``node_probe``: how many ranks of a
        communicator share this rank's node (default: the node layout probed once per
        communicator, ``_nodes``), for tests of the ``shm`` fallback. ``nbytes``: the bytes
        per rank this communicator carries (a buffer's grads), which ``auto`` weighs across
        nodes (None: unknown, taken as large); the same on every rank."""
        if not isinstance(comm, MPI.Comm):
            raise OptionError(f"comm_group: expected an mpi4py communicator, "
                              f"got {type(comm).__name__}")
        if options is None:
            options = CommOptions.from_env(**overrides)
        elif overrides:
            options = options.with_(**overrides)
        self.control = private_comm(comm, "control", options.timeout)
        self.tracker = health.tracker_for(self.control)
        #: options this rank cannot run with, raised after the agreement check (``open``)
        self._bad_options: List[str] = []
        per_node, uneven = self._nodes(options)
        #: ``auto`` chose the strategy (its fallback is then no surprise, logged at info)
        self.auto = options.strategy == "auto"
        if self.auto:
            strategy, why = resolve_strategy("auto", comm.Get_size(), per_node, uneven,
                                             nbytes=nbytes)
            options = options.with_(strategy=strategy)
            logger.info("rank %d: strategy %r (%s)", comm.Get_rank(), strategy, why)
        if (options.strategy in THREADED_STRATEGIES
                and MPI.Query_thread() < MPI.THREAD_MULTIPLE):
            raise OptionError(f"rank {comm.Get_rank()}: strategy {options.strategy!r}: "
                              f"expected MPI "
                              f"initialised at MPI_THREAD_MULTIPLE, got level "
                              f"{MPI.Query_thread()} (set mpi4py.rc.thread_level = 'multiple' "
                              f"before importing MPI, or use strategy='nonblocking')")
        self.options = options
        self.strategy = options.strategy
        self.order = options.order
        self.verify = options.verify_order
        self.segment_bytes = segment_for(options)
        # segments in flight per collective: the thread runs one blocking call at a time
        self.window = options.window if self.strategy == "nonblocking" else 1
        self.allreduce_way = allreduce_way(options.allreduce, self.strategy)
        if (self.allreduce_way == "ring" and self.strategy == "nonblocking"
                and not has_isendrecv()):
            raise OptionError(f"rank {comm.Get_rank()}: allreduce 'ring' with the "
                              f"'nonblocking' strategy: expected an MPI with MPI_Isendrecv "
                              f"(MPI-4.0), this one has none (use allreduce='mpi')")
        self.timeout = options.timeout
        self.user_comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.key = -1           # this communicator's index among those built on comm
        self.slot: Optional[int] = None   # negotiated: its bits in the rounds
        self.comm: Optional[MPI.Comm] = None
        self._engine = None
        self._negotiator: Optional[Negotiator] = None
        self._segments: dict = {}   # (dtype, segment_bytes) -> _form(dtype)
        self.closed = False
        #: why ``shm`` was asked for and ``thread`` runs (None where it runs, or was not asked for)
        self.shm_fallback: Optional[str] = None
        self._node_probe = node_probe
        self._checked_mpi = self._checked_shm = False  # behind the order check (``open``)
        self._memory: Optional[NodeMemory] = None   # shm: the node's windows
        self._shm: Optional[ShmStream] = None       # shm: this stream's rows and scratch
        if open:
            self.open()

    def _nodes(self, options: CommOptions) -> Tuple[int, str]:
        """``(ranks per node, why the nodes are uneven)``: emulated by ``node_size``, else
        MPI's nodes, probed once per communicator -- by every rank, whatever its options,
        so that the calls line up even where the agreement check will find options that
        differ (collective on the first Communicator built on ``comm``)."""
        if self.tracker.nodes is None:
            _, _, per, uneven = node_layout(self.control, None, options.timeout)
            self.tracker.nodes = (per, uneven)
        size = self.control.Get_size()
        if options.node_size is not None:
            if size % options.node_size == 0:
                return options.node_size, ""
            # refused only once every rank compared its options (``open``): a value set on
            # one rank alone is then an AgreementError on every rank, not an error here and
            # a wait for this rank on the others
            self._bad_options.append(
                f"rank {self.control.Get_rank()}: node_size: expected a divisor of the "
                f"communicator's {size} ranks, got {options.node_size}")
        return self.tracker.nodes

    def _agreement_entries(self) -> list:
        """What every rank must agree on for the stream to line up (strategy, segments, ...)."""
        explicit = self.options.segment_bytes
        return [("strategy", self.strategy),
                ("segment_bytes", "machine default (smallest over ranks)" if explicit is None
                 else str(explicit)),
                ("window", str(self.window)), ("allreduce", self.allreduce_way),
                ("node_size", str(self.options.node_size)),
                ("pipeline", str(self.options.pipeline)),
                ("tuning", tuning.ACTIVE.changed() or "the defaults"),
                ("timeout set", str(self.timeout is not None)),
                ("order", self.order), ("verify_order", str(self.verify)),
                ("check_agreement", str(self.options.check_agreement)),
                ("negotiation slot", str(self.slot))]

    def open(self, entries: Sequence[Any] = (), where: Optional[str] = None) -> None:
        """Check that every rank builds the same thing (``entries``, plus this communicator's
        options), then open the stream. Collective over ``comm``, in construction order.
        ``where`` prefixes its errors (default ``"rank R: communicator"``).

        Raises:
            AgreementError: the ranks described different things (names what differs).
            OptionError: options this rank cannot run with.
        """
        if self.comm is not None:
            return
        where = where or f"rank {self.rank}: communicator"
        self.key = self.tracker.register()
        if self.order == "negotiated":
            self.slot = self.tracker.claim_slot(Negotiator.SLOTS)
            if self.slot is None:
                raise OptionError(f"{where}: order='negotiated': more than "
                                  f"{Negotiator.SLOTS} buffers alive on one communicator; "
                                  f"close() the ones no longer used")
        try:
            if self.size > 1:
                mine = list(entries) if self.options.check_agreement else []
                low = health.check_agreement(
                    self.control, self._agreement_entries() + mine, where, self.timeout,
                    self.tracker, self.key,
                    minimum=self.segment_bytes if self.options.segment_bytes is None else None)
                if low is not None:
                    self.segment_bytes = low
            if self._bad_options:  # every rank holds the same options: each raises this
                raise OptionError(self._bad_options[0])
            if self.strategy in ("shm", "hierarchical"):
                self._open_shm(where)
            tag = self._stream_tag()
            self.comm = private_comm(self.user_comm, tag, self.timeout)
        except BaseException:
            if self.slot is not None:
                self.tracker.free_slot(self.slot)
            raise
        engine = engine_for(self.comm, self.strategy, tag, window=self.window)
        if self.order == "negotiated" and engine.negotiator is None:
            engine.negotiator = Negotiator(engine)
        self._engine = engine
        self._negotiator = engine.negotiator
        # which collectives run behind the order check, decided once. MPI's own collectives
        # get it whatever ``verify_order`` says: it is what compares the step serial, so a
        # rank that dropped a step can never pair with its peers' pending collective (run
        # alongside the data instead, it measured slower than before it: BENCHMARKS.md,
        # "Order safety"). One node's shared-window rows compare the step themselves;
        # across nodes the check runs too (a node whose rows disagreed skips the cross-node
        # calls)
        many = self.size > 1
        self._checked_mpi = many
        self._checked_shm = many and (self.verify or (self._shm is not None
                                                      and self._shm.cross is not None))

    def _stream_tag(self) -> str:
        """The stream this communicator's collectives run on. Verified and unverified
        collectives never share one: where ranks started them in different orders, one
        rank's order check would meet another's data; a ``nonblocking`` stream has one
        window, its engine's."""
        return (self.strategy + ("" if self.order == "strict" else "/negotiated")
                + ("" if self.verify else "/unverified")
                + (f"/window{self.window}" if self.window > 1 else ""))

    def _open_shm(self, where: str) -> None:
        """Take ``shm`` where every rank is on one node (``hierarchical``: where the nodes
        hold equally many ranks, numbered node by node) and the stream's shared windows could
        be made, else fall back to ``thread`` -- decided by all ranks together (all-reduces),
        so every rank runs the same calls. ``node_size`` emulates nodes of that many ranks."""
        try:
            world = private_comm(self.user_comm, "shm/memory", self.timeout)
        except MPI.Exception as exc:  # e.g. MPICH's 2,048 communicators all taken
            error = CommLimitError(f"{where}: shm: a communicator for shared memory: the MPI "
                                   f"library's limit was reached: {exc}")
            if not self.auto:
                raise error from exc
            self._fall_back(str(error))
            return
        node_size = self.options.node_size
        reason = ""
        if self.strategy == "shm":
            if node_size is not None:
                here = node_size
            elif self._node_probe is not None:
                here = self._node_probe(world)
            else:  # probed once per communicator (``_nodes``): no Split_type per buffer
                here = self.tracker.nodes[0]
            spans, fewest = agree_max(world, [int(here < self.size), -here],
                                      f"{where}: shm", self.timeout)
            if spans:
                reason = (f"comm_group spans nodes (a node holds as few as {-int(fewest)} of "
                          f"its {self.size} ranks); shared windows need every rank on one "
                          f"node (strategy 'hierarchical' spans nodes)")
            node = world
        else:
            color, local, per, reason = node_layout(world, node_size, self.timeout)
            if not reason:
                node = private_split(self.user_comm, f"shm/memory/{per}", color, self.rank,
                                     self.timeout)
        stream = None
        if not reason:
            memory = memory_for(node, self.timeout)
            memory.timeout = self.timeout  # its all-reduces now are bounded by this deadline
            stream, reason = memory.stream(self._stream_tag(), where)
            if self.strategy == "hierarchical":  # a node without its window: none use theirs
                if agree_max(world, [int(stream is None)], f"{where}: hierarchical",
                             self.timeout)[0]:
                    stream, reason = None, reason or "a shared window failed on another node"
                elif stream.cross is None:
                    tag = self._stream_tag()
                    stream.span(private_split(self.user_comm, tag + "/node", color, self.rank,
                                              self.timeout),
                                private_split(self.user_comm, tag + "/cross", local, color,
                                              self.timeout))
        if stream is not None:
            self._memory, self._shm = memory, stream
            return
        self._fall_back(reason)

    def _fall_back(self, reason: str) -> None:
        """Run ``thread`` instead of ``shm`` (every rank agreed), saying why."""
        self.shm_fallback = reason
        logger.log(logging.INFO if self.auto else logging.WARNING,
                   "rank %d: strategy %r unavailable, using 'thread': %s",
                   self.rank, self.strategy, reason)
        self.strategy = "thread"

    def reserve(self, sizes: Sequence[Tuple[int, Any]], like: Any,
                where: str = "") -> List[Any]:
        """Shared-window regions (zeroed, on pages of their own) for arrays of ``(numel,
        dtype)``, e.g. a buffer's grad and param storage; ``[]`` for other strategies, device
        arrays, or where the ranks agreed not to make one (too little shared memory: logged).
        Collective with ``shm``: every rank reserves the same sizes in the same order (a
        buffer does it at construction, after its agreement check). ``like``: an array of
        the buffer's kind (a device array gets no region); ``where`` prefixes the warning."""
        if self._memory is None:
            return []
        where = where or f"rank {self.rank}: communicator"
        regions, reason = self._memory.reserve(sizes, where, wanted=type(like) is np.ndarray)
        if reason:
            logger.warning("%s: storage not in shared memory (%s): its collectives stage "
                           "it through the stream's scratch", where, reason)
        return regions

    def in_shared_window(self, arr: Any) -> bool:
        """Whether ``arr`` lies in this node's shared memory (``shm``'s arena): its
        collectives then read and write it in place, with no copy."""
        return self._memory is not None and self._memory.locate(arr)[0] >= 0

    def close(self) -> None:
        """This communicator's buffer is done: its slot is freed and it starts nothing more.
        The stream (duplicate, engine) stays for other buffers: see ``comm.release``."""
        if not self.closed:
            self.closed = True
            if self.slot is not None:
                self.tracker.free_slot(self.slot)

    def abandon(self, task: CommTask, key: int, seq: int, where: str) -> None:
        """Give ``task`` up: every stream of comm_group refuses later collectives on this
        rank, and the peers are told so that theirs refuse too. ``key`` and ``seq`` say
        which collective it was (the buffer's index on the communicator, and its count of
        collectives started), as the peers are told; ``where`` begins the refusals'
        message."""
        task.abandoned = True
        reason = (f"{where}: refused: a collective of this communicator ({task.name or 'task'}) "
                  f"was abandoned after a timeout (reset(abandon=True)); MPI cannot cancel it, "
                  f"so any later collective would pair with the stale one. Save what you need "
                  f"and abort, or build new buffers on a fresh communicator (comm.Split/Dup)")
        for engine in engines_of(self.user_comm):
            engine.abandon(reason)
        self.tracker.announce_abandoned(key, seq)

    def check_usable(self, name: str) -> None:
        """Refuse before anything changes: closed buffer, or an abandoned collective here or
        on a peer (announced on the control communicator). ``name`` is the call refused, for
        the message.

        Raises:
            StateError: closed, or never opened.
            AbandonedError: a collective was abandoned on this communicator.
        """
        if self.closed or self.comm is None:
            raise StateError(f"rank {self.rank}: {name}: the buffer was closed (or its "
                             f"communicator never opened); expected an open buffer")
        engine = self._engine
        if engine.abandoned is None and self.size > 1:
            self.tracker.drain()
            if self.tracker.abandoned:
                ranks = sorted(self.tracker.abandoned)
                for e in engines_of(self.user_comm):
                    e.abandon(f"rank {self.rank}: {name}: refused: rank(s) "
                              f"{', '.join(map(str, ranks))} abandoned a collective of this "
                              f"communicator after a timeout (reset(abandon=True)); a "
                              f"collective started now would pair with the stale one. Save "
                              f"what you need and abort, or build new buffers on a fresh "
                              f"communicator (comm.Split/Dup)")
        if engine.abandoned is not None:
            raise AbandonedError(engine.abandoned)
        engine.check_open()

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, strategy={self.strategy!r}, "
                f"segment_bytes={self.segment_bytes}, window={self.window})")

    def _segment(self, dtype: Any) -> int:
        """Elements per segment for ``dtype`` buffers (everything at once when 0)."""
        return self._form(dtype)[0]

    def _form(self, dtype: Any) -> Tuple[int, int]:
        """(elements per segment, the order check's dtype code) for ``dtype`` buffers, cached:
        a small collective asks on every start."""
        key = (dtype, self.segment_bytes)
        form = self._segments.get(key)
        if form is None:
            if self.segment_bytes == 0:
                # half precision still goes in bounded pieces: no full-size fp32 copy
                seg = (DEFAULT_SEGMENT_BYTES // 4) if dtype in HALF else (1 << 62)
            else:
                seg = max(1, self.segment_bytes
                          // (4 if dtype in HALF else np.dtype(dtype).itemsize))
            form = self._segments[key] = (seg, order_mod.dtype_code(dtype))
        return form

    def _start(self, build: Build, keep: Sequence[Any], name: str,
               desc: Sequence[int], nbytes: Optional[int] = None,
               prepare: Optional[Callable[[], None]] = None, way: int = 0) -> CommTask:
        """Submit a collective whose calls ``build(seq)`` makes, given its place in the
        stream: ``desc`` is (kind, count, dtype, root, buffer id, step), what the order check
        compares (and OrderError names) with this communicator's key (buffer ids may repeat);
        ``nbytes`` its size on this rank (small ones may run inline; default: of ``keep``),
        the same on every rank when ``desc`` is. ``prepare`` runs right before the first call
        that exchanges data -- after the order check -- so a collective refused by the check
        changed nothing (a buffer's pre-scaling by 1/n). ``way``: how the steps move data (0:
        MPI calls, ``SHM_WAY``: shared windows), so that ranks that chose differently fail
        the order check instead of mixing calls. Everything decided here is fixed in the
        record's :class:`Plan` before the engine sees it."""
        self.check_usable(name)
        desc = (*desc, self.key, way)  # one length on every rank: gathered on a mismatch
        engine = self._engine
        negotiator = self._negotiator
        inline = polled = False
        if negotiator is None and isinstance(engine, ThreadEngine):
            if nbytes is None:
                nbytes = sum([a.nbytes for a in keep])
            limits = tuning.ACTIVE
            inline = nbytes <= (limits.shm_inline_max_bytes if way == SHM_WAY
                                else limits.inline_max_bytes)
            # the same on every rank: size and "timeout set" are agreed
            polled = inline and self.timeout is not None
        # negotiated: the rounds agree on a slot, not on what each rank started in it: two
        # collectives of one Communicator started in different orders would pair silently;
        # checked as in the strict order, inside the round
        checked = self._checked_shm if way == SHM_WAY else self._checked_mpi
        comm, words = self.comm, engine.check_words

        def steps_at(seq: int) -> Steps:
            steps = build(seq)
            if prepare is not None:
                steps = _prepared(prepare, steps)
            if polled:
                steps = as_nonblocking(steps)
            if checked:
                steps = order_mod.verified_steps(seq, desc, polled, steps, comm, words, name)
            return steps

        op = Collective(Plan(name, self.rank, polled, inline), steps_at, keep)
        task = CommTask(op, engine, timeout=self.timeout)
        if negotiator is not None:
            negotiator.ready(self.slot * Negotiator.KINDS_PER_SLOT
                             + _ITEM_KIND.get(desc[0], 3), op)
        else:
            engine.submit(op)
        return task

    # -- reductions: SUM, then ``scale`` (1/n for an average) applied to the result only
    def allreduce(self, buf: Any, scale: Optional[float] = None,
                  name: str = "allreduce", tag: Tuple[int, int] = (-1, -1),
                  prepare: Optional[Callable[[], None]] = None) -> CommTask:
        """Sum ``buf`` over the ranks, in place, and start at once (non-blocking).

        Args:
            buf: the flat buffer (host or device; half precision is summed in fp32).
            scale: multiplies the result (``1/n`` for a mean), in fp32 before the one
                rounding back, so a mean costs no extra rounding.
            name: names the collective in errors and timeouts.
            tag: ``(buffer id, step)``, compared with the other ranks' before any data
                moves (``OrderError`` when they differ).
            prepare: run once that check passed, before ``buf`` is read (a pre-scaling),
                so a refused collective leaves ``buf`` unchanged.

        Returns:
            The :class:`~mpifusion.CommTask` (``wait()`` finishes it).
        """
        _device_ready(buf)
        nbytes = buf.nbytes
        seg, code = self._form(buf.dtype)
        desc = (ALLREDUCE, buf.size, code, -1, *tag)
        if self._on_shm(buf):
            return self._start(
                lambda seq: shm_steps.shm_allreduce_steps(
                    self._shm, buf, scale, None, (seq + 1, *desc, self.key), seg, name,
                    gather=self.verify, pipeline=self.options.pipeline),
                (buf,), name, desc, nbytes, prepare, SHM_WAY)
        ring = (self.size if self.allreduce_way == "ring"
                and nbytes > tuning.ACTIVE.inline_max_bytes else 0)
        return self._start(
            lambda seq: allreduce_steps(buf, scale, seg, root=None, rank=self.rank,
                                        window=self.window, ring=ring),
            (buf,), name, desc, nbytes, prepare)

    def reduce(self, buf: Any, root: int, scale: Optional[float] = None,
               name: str = "reduce", tag: Tuple[int, int] = (-1, -1),
               sent_scale: Optional[float] = None,
               prepare: Optional[Callable[[], None]] = None) -> CommTask:
        """Sum to ``root``, ``scale`` applied there; the other ranks keep their own values,
        scaled by ``sent_scale`` if given (each segment after it was sent, in cache).
        ``buf``, ``name``, ``tag`` and ``prepare`` as in :meth:`allreduce`; ``root`` is a rank
        of this communicator.

        Raises:
            OptionError: ``root`` is not a rank of this communicator.
        """
        if (isinstance(root, bool) or not isinstance(root, (int, np.integer))
                or not 0 <= root < self.size):
            raise OptionError(f"rank {self.rank}: {name}: root expected a rank in [0, {self.size}), "
                            f"got {root!r}")
        _device_ready(buf)
        seg, code = self._form(buf.dtype)
        desc = (REDUCE, buf.size, code, int(root), *tag)
        if self._on_shm(buf):
            return self._start(
                lambda seq: shm_steps.shm_allreduce_steps(
                    self._shm, buf, scale, int(root), (seq + 1, *desc, self.key), seg, name,
                    sent_scale=sent_scale, pipeline=self.options.pipeline),
                (buf,), name, desc, buf.nbytes, prepare, SHM_WAY)
        return self._start(
            lambda seq: allreduce_steps(buf, scale, seg, root=int(root), rank=self.rank,
                                        window=self.window, sent_scale=sent_scale),
            (buf,), name, desc, buf.nbytes, prepare)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, scale: Optional[float] = None,
                       name: str = "reduce_scatter",
                       tag: Tuple[int, int] = (-1, -1),
                       others_scale: Optional[float] = None,
                       prepare: Optional[Callable[[], None]] = None) -> CommTask:
        """Sum ``sendbuf`` over ranks; this rank's equal share lands in ``recvbuf`` (which may
        be that share of ``sendbuf`` itself), ``scale`` applied to it. The other shares of
        ``sendbuf`` keep this rank's own values, scaled by ``others_scale`` if given (each
        piece once packed, in cache). ``name``, ``tag`` and ``prepare`` as in
        :meth:`allreduce`.

        Raises:
            OptionError: buffers whose sizes or dtypes do not fit.
        """
        if sendbuf.size != recvbuf.size * self.size:
            raise OptionError(f"rank {self.rank}: {name}: expected a send buffer of "
                            f"{recvbuf.size * self.size} elements, got {sendbuf.size}")
        if sendbuf.dtype != recvbuf.dtype:
            raise OptionError(f"rank {self.rank}: {name}: expected the receive buffer in the send "
                            f"buffer's dtype {sendbuf.dtype}, got {recvbuf.dtype}")
        _device_ready(sendbuf)
        seg, code = self._form(sendbuf.dtype)
        desc = (REDUCE_SCATTER, sendbuf.size, code, -1, *tag)
        nbytes = sendbuf.nbytes + recvbuf.nbytes
        if self._on_shm(sendbuf) and self._on_shm(recvbuf):
            return self._start(
                lambda seq: shm_steps.shm_reduce_scatter_steps(
                    self._shm, sendbuf, recvbuf, scale, (seq + 1, *desc, self.key),
                    shm_steps.chunk_elements(seg, sendbuf.dtype), name,
                    others_scale=others_scale, pipeline=self.options.pipeline),
                (sendbuf, recvbuf), name, desc, nbytes, prepare, SHM_WAY)
        return self._start(
            lambda seq: reduce_scatter_steps(sendbuf, recvbuf, scale, seg, self.size,
                                             self.rank, window=self.window,
                                             others_scale=others_scale),
            (sendbuf, recvbuf), name, desc, nbytes, prepare)

    def allgather_inplace(self, buf: Any, name: str = "allgather",
                          tag: Tuple[int, int] = (-1, -1)) -> CommTask:
        """Every rank's equal share of ``buf`` (its own shard, in place) to every rank.
        ``name`` and ``tag`` as in :meth:`allreduce`.

        Raises:
            OptionError: ``buf`` does not split evenly over the ranks.
        """
        if buf.size % self.size:
            raise OptionError(f"rank {self.rank}: {name}: expected a buffer that splits evenly "
                            f"over {self.size} ranks, got {buf.size} elements")
        _device_ready(buf)
        desc = (ALLGATHER, buf.size, order_mod.dtype_code(buf.dtype), -1, *tag)
        if self._on_shm(buf):
            return self._start(
                lambda seq: shm_steps.shm_allgather_steps(
                    self._shm, buf, (seq + 1, *desc, self.key), name),
                (buf,), name, desc, buf.nbytes, way=SHM_WAY)
        seg = self._segment(buf.dtype)
        return self._start(
            lambda seq: allgather_steps(buf, seg, self.size, self.rank, window=self.window),
            (buf,), name, desc, buf.nbytes)

    def _on_shm(self, arr: Any) -> bool:
        """Whether ``arr`` goes through the shm collectives: a C-contiguous host array on a
        communicator running ``shm`` (in a window: in place; elsewhere: staged). Device
        arrays take the ``thread`` collectives on the same stream (see ``way``)."""
        return (self._shm is not None and type(arr) is np.ndarray
                and arr.flags.c_contiguous)

    def poll(self) -> None:
        """Called on every add_grad: drives MPI progress (``nonblocking``) or retires tasks
        the communication thread finished (``thread``)."""
        engine = self._engine
        if engine is not None and engine.tasks:
            engine.progress()

    def barrier(self) -> None:
        """A barrier ordered after every collective this communicator started."""
        self._start(lambda seq: barrier_steps(), (), "barrier",
                    (BARRIER, 0, 0, -1, -1, -1), 0).wait()

