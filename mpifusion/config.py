"""Options as frozen objects; the environment is read here and nowhere else.

Library code takes options as arguments (``CommOptions`` for how collectives run,
``FusedCommBuffer``'s keywords for what a buffer does). Environment variables are only the
documented *defaults* of those arguments, resolved once by :meth:`CommOptions.from_env`, so
the CLI and the benchmark pass options explicitly instead of editing ``os.environ``.
This module is a leaf (it imports only errors): an option left at ``None`` is resolved by
the module that knows its default, e.g. the segment size by :func:`mpifusion.machine.segment_for`.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from .errors import OptionError

STRATEGY_ENV = "MPIFUSION_COMM_STRATEGY"
SEGMENT_ENV = "MPIFUSION_SEGMENT_BYTES"
TIMEOUT_ENV = "MPIFUSION_TIMEOUT"
AGREEMENT_ENV = "MPIFUSION_CHECK_AGREEMENT"
#: ``nonblocking``: how many segments of one collective are in flight at once
WINDOW_ENV = "MPIFUSION_WINDOW"
#: ``strict`` (collectives start in program order, verified) or ``negotiated`` (ranks agree)
ORDER_ENV = "MPIFUSION_ORDER"
#: strict order: check before each collective that every rank starts the same one
VERIFY_ORDER_ENV = "MPIFUSION_VERIFY_ORDER"
ORDERS = ("strict", "negotiated")
#: how a segment is all-reduced: the library's collective, or mpifusion's ring of Isendrecv
ALLREDUCE_ENV = "MPIFUSION_ALLREDUCE"
ALLREDUCE_WAYS = ("auto", "mpi", "ring")
#: ``shm``/``hierarchical``: ranks per node, to treat consecutive groups of ranks as nodes
#: (emulated nodes on one machine); unset: the nodes MPI reports (COMM_TYPE_SHARED)
NODE_SIZE_ENV = "MPIFUSION_NODE_SIZE"
#: ``hierarchical``: the inter-node step as a pipeline (chunk k between the nodes while the
#: node sums chunk k+1), for buffers from 256 KiB
PIPELINE_ENV = "MPIFUSION_PIPELINE"
#: NaN/Inf check before communication; Paddle's flag name works too.
NANINF_ENV = ("MPIFUSION_CHECK_NANINF", "FLAGS_pp_check_naninf")
CUDA_AWARE_ENV = "MPIFUSION_CUDA_AWARE"
#: where ``mpifusion tune`` records the segment size per machine type (machine.py)
TUNE_FILE_ENV = "MPIFUSION_TUNE_FILE"
#: half <-> fp32 casts: auto (compiled kernel when built), kernel (required), numpy (plain casts)
HALFCAST_ENV = "MPIFUSION_HALFCAST"
HALFCAST_MODES = ("auto", "kernel", "numpy")

STRATEGIES = ("thread", "nonblocking", "shm", "hierarchical")
#: strategies whose collectives run on a communication thread: MPI_THREAD_MULTIPLE only
THREADED_STRATEGIES = ("thread", "shm", "hierarchical")
#: ``auto``: ``shm`` / ``hierarchical`` where ranks share a node, else ``thread``;
#: ``nonblocking`` below MPI_THREAD_MULTIPLE (``communicator.resolve_strategy``).
DEFAULT_STRATEGY = "auto"
#: Half-precision pieces when segments are off (0), so no full-size fp32 copy is made. The
#: ``thread`` strategy's default segment size is the machine's (``machine.segment_for``).
DEFAULT_SEGMENT_BYTES = 8 << 20
#: ``nonblocking``: segments in flight per collective (measured: BENCHMARKS.md, "Nonblocking
#: window"); 1 starts the next segment only when the previous one landed.
DEFAULT_WINDOW = 2
MAX_WINDOW = 64
#: Deadlines longer than this (about 31 years) mean "no deadline": waits take float seconds
#: and threading/time functions overflow on huge values.
MAX_TIMEOUT = 1e9

_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("0", "false", "no", "off", "n", "f", "")


def parse_bool(value: Any, what: str) -> bool:
    """One rule for boolean switches, from the environment or an argument."""
    if isinstance(value, bool):
        return value
    key = str(value).strip().lower()
    if key in _TRUE:
        return True
    if key in _FALSE:
        return False
    raise OptionError(f"{what}: expected a boolean (1/0, true/false, yes/no, on/off), "
                      f"got {value!r}")


def parse_strategy(value: Any, what: str = "strategy") -> str:
    key = str(value).strip().lower().replace("_", "").replace("-", "")
    key = {"nb": "nonblocking", "plain": "nonblocking", "threaded": "thread",
           "shared": "shm", "sharedmemory": "shm", "hier": "hierarchical"}.get(key, key)
    if key not in STRATEGIES + ("auto",):
        raise OptionError(f"{what}: expected one of {', '.join(STRATEGIES)} or auto, "
                          f"got {value!r}")
    return key


def parse_segment_bytes(value: Any, what: str = "segment_bytes") -> int:
    """Bytes per segment, an int in [0, 2**62] (0: no segments). Any integer type (a numpy
    one computed from shapes: as ``acc_steps`` and ``root``), or a string of one (``"1e6"``
    too; digits are read exactly, not through a float)."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                raise OptionError(f"{what}: expected a number of bytes, got {value!r}") \
                    from None
            if not math.isfinite(number) or number != int(number):
                raise OptionError(f"{what}: expected an int >= 0 (0: no segments), "
                                  f"got {value!r}")
            value = int(number)
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or not 0 <= value <= (1 << 62)):
        raise OptionError(f"{what}: expected an int >= 0 (0: no segments), got {value!r}")
    return int(value)


def parse_window(value: Any, what: str = "window") -> int:
    """Segments in flight: an int in [1, MAX_WINDOW] (strings of such ints accepted)."""
    if isinstance(value, str):
        text = value.strip()
        value = int(text) if text.isdigit() else text
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WINDOW:
        raise OptionError(f"{what}: expected an int in [1, {MAX_WINDOW}] (segments of one "
                          f"collective in flight at once), got {value!r}")
    return int(value)


def unset(value: Any) -> bool:
    """None, or a string of blanks: an optional option left unset (its default applies)."""
    return value is None or (isinstance(value, str) and not value.strip())


def parse_timeout(value: Any, what: str = "timeout") -> Optional[float]:
    """Seconds, strictly: ``None``/``inf``/anything above :data:`MAX_TIMEOUT` mean no
    deadline; NaN, zero, negatives and non-numbers are refused (they are typos, not intent)."""
    if unset(value):
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            raise OptionError(f"{what}: expected a number of seconds > 0 (or inf for no "
                              f"deadline), got {text!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionError(f"{what}: expected a number of seconds > 0, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float: certainly "forever"
        return None
    if math.isnan(seconds) or seconds <= 0:
        raise OptionError(f"{what}: expected a number of seconds > 0 (or inf for no "
                          f"deadline), got {value!r}")
    return None if seconds > MAX_TIMEOUT else seconds


def parse_node_size(value: Any, what: str = "node_size") -> Optional[int]:
    """Ranks per (emulated) node: an int >= 1 (strings of one accepted), or None."""
    if unset(value):
        return None
    if isinstance(value, str):
        value = int(value.strip()) if value.strip().isdigit() else value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise OptionError(f"{what}: expected an int >= 1 (ranks per node), got {value!r}")
    return int(value)


def parse_order(value: Any, what: str = "order") -> str:
    key = str(value).strip().lower()
    if key not in ORDERS:
        raise OptionError(f"{what}: expected one of {', '.join(ORDERS)}, got {value!r}")
    return key


def parse_allreduce(value: Any, what: str = "allreduce") -> str:
    key = str(value).strip().lower()
    if key not in ALLREDUCE_WAYS:
        raise OptionError(f"{what}: expected one of {', '.join(ALLREDUCE_WAYS)}, got {value!r}")
    return key


def cuda_aware_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """``$MPIFUSION_CUDA_AWARE`` forced on/off, or None (ask the MPI library)."""
    environ = os.environ if environ is None else environ
    value = environ.get(CUDA_AWARE_ENV, "").strip()
    return parse_bool(value, CUDA_AWARE_ENV) if value else None


def tune_path(environ: Optional[Mapping[str, str]] = None) -> str:
    """``$MPIFUSION_TUNE_FILE``, else ``$XDG_CACHE_HOME/mpifusion/tune.json`` (XDG's default:
    ``~/.cache``; a relative ``$XDG_CACHE_HOME`` is ignored, as XDG says: it would name
    another file in each folder a job starts in)."""
    environ = os.environ if environ is None else environ
    path = environ.get(TUNE_FILE_ENV, "").strip()
    if not path:
        cache = environ.get("XDG_CACHE_HOME", "").strip()
        if not os.path.isabs(cache):
            cache = os.path.join("~", ".cache")
        path = os.path.join(cache, "mpifusion", "tune.json")
    return os.path.expanduser(path)


def halfcast_from_env(environ: Optional[Mapping[str, str]] = None) -> str:
    """``$MPIFUSION_HALFCAST``: how half-precision segments are widened and rounded."""
    environ = os.environ if environ is None else environ
    mode = environ.get(HALFCAST_ENV, "").strip().lower() or "auto"
    if mode not in HALFCAST_MODES:
        raise OptionError(f"{HALFCAST_ENV}: expected one of {', '.join(HALFCAST_MODES)}, "
                          f"got {mode!r}")
    return mode


def naninf_check_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    environ = os.environ if environ is None else environ
    return any(parse_bool(environ.get(k, ""), k) for k in NANINF_ENV)


# CommOptions field, its environment variable, its parser (in the order they are read)
_ENV_FIELDS = (
    ("strategy", STRATEGY_ENV, parse_strategy),
    ("segment_bytes", SEGMENT_ENV, parse_segment_bytes),
    ("timeout", TIMEOUT_ENV, parse_timeout),
    ("check_agreement", AGREEMENT_ENV, parse_bool),
    ("window", WINDOW_ENV, parse_window),
    ("order", ORDER_ENV, parse_order),
    ("verify_order", VERIFY_ORDER_ENV, parse_bool),
    ("allreduce", ALLREDUCE_ENV, parse_allreduce),
    ("node_size", NODE_SIZE_ENV, parse_node_size),
    ("pipeline", PIPELINE_ENV, parse_bool),
)


@dataclass(frozen=True)
class CommOptions:
    """How a buffer's collectives run (the same on every rank: checked at construction).

    ``strategy``: ``"thread"`` (blocking collectives in segments on a communication thread),
    ``"nonblocking"`` (Iallreduce/Ireduce/... from the caller), ``"shm"`` (the ranks of one
    node reduce directly in the shared memory that holds the buffers, driven by a
    communication thread; ``thread`` where the ranks span nodes), ``"hierarchical"`` (``shm``
    within each node, MPI between the ranks that hold the same slice on every node) or
    ``"auto"`` (``shm`` on one node, ``hierarchical`` over nodes of several ranks each,
    else ``thread``; ``nonblocking`` below MPI_THREAD_MULTIPLE). ``node_size``:
    ranks per node for ``shm``/``hierarchical``, consecutive ranks forming a node (emulated
    nodes; ``None``: the nodes MPI reports). ``segment_bytes``: size
    of the pieces a buffer is reduced in; ``None`` takes the strategy's default, 0 means one
    piece. ``timeout``: seconds any wait may take (``None``: forever). ``check_agreement``:
    compare what every rank builds at construction. ``order``: ``"strict"`` (collectives run
    in the order they are started, the same on every rank) or ``"negotiated"`` (ranks agree
    at run time on the order of the buffers ready everywhere). ``verify_order``: with
    ``strict``, confirm before each collective that every rank starts the same one.
    ``allreduce``: how a host buffer's segments are all-reduced: ``"mpi"`` (the library's
    Allreduce/Iallreduce), ``"ring"`` (a ring of Isendrecv, reduce-scatter then all-gather:
    point-to-point calls every MPI progresses well) or ``"auto"`` (``ring`` for the
    ``nonblocking`` strategy on Open MPI, whose non-blocking all-reduce is 2-6x its blocking
    one here, and where the MPI has Isendrecv; ``mpi`` otherwise). Buffers up to 64 KiB
    always take the library's call (latency-bound: one call beats ``2(n-1)`` rounds).
    ``pipeline``: ``hierarchical`` runs its inter-node step as a pipeline for buffers from
    256 KiB (chunk k between the nodes while the node sums chunk k+1; the same bits). Off by
    default: where the links' TCP work and the node's sums share the cores (the emulated
    cluster of one 2-core machine) it measured 1.1-1.35x slower than one chunk after the
    other, as no core is left to overlap with.
    """

    strategy: str = DEFAULT_STRATEGY
    segment_bytes: Optional[int] = None
    timeout: Optional[float] = None
    check_agreement: bool = True
    order: str = "strict"
    verify_order: bool = True
    window: int = DEFAULT_WINDOW
    allreduce: str = "auto"
    node_size: Optional[int] = None
    pipeline: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", parse_strategy(self.strategy))
        if self.segment_bytes is not None:
            object.__setattr__(self, "segment_bytes", parse_segment_bytes(self.segment_bytes))
        object.__setattr__(self, "timeout", parse_timeout(self.timeout))
        object.__setattr__(self, "check_agreement",
                           parse_bool(self.check_agreement, "check_agreement"))
        object.__setattr__(self, "order", parse_order(self.order))
        object.__setattr__(self, "verify_order", parse_bool(self.verify_order, "verify_order"))
        object.__setattr__(self, "window", parse_window(self.window))
        object.__setattr__(self, "allreduce", parse_allreduce(self.allreduce))
        object.__setattr__(self, "node_size", parse_node_size(self.node_size))
        object.__setattr__(self, "pipeline", parse_bool(self.pipeline, "pipeline"))

    def with_(self, **changes: Any) -> "CommOptions":
        """A copy with some fields changed (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None,
                 **overrides: Any) -> "CommOptions":
        """The documented defaults from the environment, then explicit ``overrides``
        (arguments beat the environment; ``None`` overrides are ignored)."""
        environ = os.environ if environ is None else environ
        fields: dict = {}
        for field, name, parse in _ENV_FIELDS:
            value = environ.get(name, "").strip()
            if value:
                fields[field] = parse(value, name)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)
