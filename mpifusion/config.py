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

#: ``strict`` (collectives start in program order, verified) or ``negotiated`` (ranks agree)
ORDERS = ("strict", "negotiated")
#: how a segment is all-reduced: the library's collective, or mpifusion's ring of Isendrecv
ALLREDUCE_WAYS = ("auto", "mpi", "ring")
#: half <-> fp32 casts: auto (compiled kernel when built), kernel (required), numpy (plain casts)
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


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: :data:`ENVIRONMENT` is the single list of them, which this
    module's readers follow and from which the docs' table (docs/environment.md) is made
    when the site is built. The texts are Markdown."""

    name: str
    #: what it sets: ``CommOptions.<field>`` (then :meth:`CommOptions.from_env` reads it into
    #: that field), a keyword of ``FusedCommBuffer``, or another setting
    option: str
    #: what it takes
    values: str
    #: what applies when it is unset (or blank)
    default: str
    #: what it does, in one line
    meaning: str
    #: who reads it: ``mpifusion`` (the library, through this module) or a script's path
    reader: str = "mpifusion"

    @property
    def field(self) -> str:
        """The ``CommOptions`` field this variable is the default of ("" if none)."""
        prefix = "CommOptions."
        return self.option[len(prefix):] if self.option.startswith(prefix) else ""


_BOOL = "a boolean: `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`"
_SBATCH = "scripts/mpifusion.sbatch"


def _one_of(names: tuple) -> str:
    return "one of " + ", ".join(f"`{n}`" for n in names)


#: Every environment variable mpifusion reads (``reader="mpifusion"``: only this module reads
#: them, as the documented defaults of the options they name) and those of the batch script
#: ``scripts/mpifusion.sbatch``. ``tests/docs/test_environment_page.py`` checks that every
#: ``MPIFUSION_`` name of the library and of that script is here.
ENVIRONMENT = (
    EnvVar("MPIFUSION_COMM_STRATEGY", "CommOptions.strategy",
           _one_of(STRATEGIES + ("auto",)), f"`{DEFAULT_STRATEGY}`",
           "how collectives run: `auto` takes `shm` on one node, `hierarchical` across nodes "
           "of several ranks, else `thread`; `nonblocking` below MPI_THREAD_MULTIPLE"),
    EnvVar("MPIFUSION_SEGMENT_BYTES", "CommOptions.segment_bytes",
           "bytes, an int >= 0 (`1e6` too); `0`: one piece per buffer",
           "the size `mpifusion tune` recorded for this machine type, else twice the "
           "per-core L2 within 2-16 MiB",
           "the size of the pieces a buffer is reduced in"),
    EnvVar("MPIFUSION_TIMEOUT", "CommOptions.timeout",
           "seconds > 0; `inf` (or more than 1e9): no deadline",
           f"no deadline (`{_SBATCH}` sets 300 s, or half the job's time left)",
           "the longest any wait may take: then `CommTimeoutError` naming the late ranks"),
    EnvVar("MPIFUSION_CHECK_AGREEMENT", "CommOptions.check_agreement", _BOOL, "`1`",
           "`0` leaves the params out of the construction-time comparison of what every rank "
           "builds (the settings are always compared)"),
    EnvVar("MPIFUSION_WINDOW", "CommOptions.window", f"an int in 1-{MAX_WINDOW}",
           f"`{DEFAULT_WINDOW}`",
           "`nonblocking`: how many segments of one collective are in flight at once"),
    EnvVar("MPIFUSION_ORDER", "CommOptions.order", _one_of(ORDERS), f"`{ORDERS[0]}`",
           "`strict`: collectives run in the order they are started, the same on every rank "
           "(checked); `negotiated`: the ranks agree on the order at run time"),
    EnvVar("MPIFUSION_VERIFY_ORDER", "CommOptions.verify_order", _BOOL, "`1`",
           "`strict` order: check before each collective that every rank starts the same one; "
           "`0` skips the check's all-reduce only where `shm`'s own rows compare the same"),
    EnvVar("MPIFUSION_ALLREDUCE", "CommOptions.allreduce", _one_of(ALLREDUCE_WAYS),
           f"`{ALLREDUCE_WAYS[0]}`",
           "how a host buffer's segments are all-reduced: the library's call (`mpi`), a ring "
           "of Isendrecv (`ring`), or `ring` for `nonblocking` on Open MPI (`auto`)"),
    EnvVar("MPIFUSION_NODE_SIZE", "CommOptions.node_size", "an int >= 1",
           "the nodes MPI reports",
           "`shm`/`hierarchical`: ranks per node, consecutive ranks forming a node (emulated "
           "nodes on one machine)"),
    EnvVar("MPIFUSION_PIPELINE", "CommOptions.pipeline", _BOOL, "`0`",
           "`hierarchical`: the step between nodes as a pipeline, for buffers from 256 KiB"),
    EnvVar("MPIFUSION_CHECK_NANINF", "FusedCommBuffer(check_naninf=)", _BOOL, "`0`",
           "check the grad buffer for NaN/Inf before communicating (`NanInfError` naming the "
           "rank and params; nothing is sent)"),
    EnvVar("FLAGS_pp_check_naninf", "FusedCommBuffer(check_naninf=)", _BOOL, "`0`",
           "Paddle's name of the same switch: either variable turns the check on"),
    EnvVar("MPIFUSION_CUDA_AWARE", "MPI given device memory", _BOOL,
           "ask the MPI library",
           "hand GPU buffers to MPI directly (`1`) or stage them through host memory (`0`)"),
    EnvVar("MPIFUSION_TUNE_FILE", "the tune file", "a path",
           "`$XDG_CACHE_HOME/mpifusion/tune.json`, else `~/.cache/mpifusion/tune.json`",
           "where `mpifusion tune` records the best segment size per machine type, and jobs "
           "read it"),
    EnvVar("MPIFUSION_HALFCAST", "half-precision casts", _one_of(HALFCAST_MODES),
           f"`{HALFCAST_MODES[0]}`",
           "how fp16/bf16 segments are widened to fp32 and rounded back: the compiled kernel "
           "when built (`auto`), the kernel or an error (`kernel`), numpy's casts (`numpy`); "
           "the same bits"),
    EnvVar("MPIFUSION_ARGS", "the batch job's arguments", "words split on spaces", "`run`",
           "`python -m mpifusion`'s arguments, when the script is given none", _SBATCH),
    EnvVar("MPIFUSION_VENV", "the batch job's venv", "a path", "none",
           "a virtual environment (with mpifusion and mpi4py) to activate first", _SBATCH),
    EnvVar("MPIFUSION_PYTHON", "the batch job's Python", "a command",
           "`python`, else `python3`", "the Python that runs mpifusion", _SBATCH),
    EnvVar("MPIFUSION_SRUN_MPI", "srun's `--mpi=`", "a PMI plugin name",
           "from the MPI library mpi4py loads", "how srun starts the MPI ranks", _SBATCH),
    EnvVar("MPIFUSION_CPU_BIND", "srun's `--cpu-bind=`", "a binding",
           "cores where the cluster binds, else none", "how srun binds the ranks to cores",
           _SBATCH),
)


def env_var(name: str) -> EnvVar:
    """The definition of the variable ``name`` (``KeyError`` naming it if there is none)."""
    for var in ENVIRONMENT:
        if var.name == name:
            return var
    raise KeyError(f"{name}: not an environment variable of mpifusion.config.ENVIRONMENT")


def _env_of(field: str) -> str:
    """The variable that gives ``CommOptions.<field>`` its default."""
    (name,) = [v.name for v in ENVIRONMENT if v.field == field]
    return name


STRATEGY_ENV = _env_of("strategy")
SEGMENT_ENV = _env_of("segment_bytes")
TIMEOUT_ENV = _env_of("timeout")
AGREEMENT_ENV = _env_of("check_agreement")
WINDOW_ENV = _env_of("window")
ORDER_ENV = _env_of("order")
VERIFY_ORDER_ENV = _env_of("verify_order")
ALLREDUCE_ENV = _env_of("allreduce")
NODE_SIZE_ENV = _env_of("node_size")
PIPELINE_ENV = _env_of("pipeline")
#: NaN/Inf check before communication; Paddle's flag name works too (either one turns it on)
NANINF_ENV = tuple(v.name for v in ENVIRONMENT if v.option == "FusedCommBuffer(check_naninf=)")
CUDA_AWARE_ENV = env_var("MPIFUSION_CUDA_AWARE").name
TUNE_FILE_ENV = env_var("MPIFUSION_TUNE_FILE").name
HALFCAST_ENV = env_var("MPIFUSION_HALFCAST").name

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


#: the parser of each ``CommOptions`` field that a variable of :data:`ENVIRONMENT` sets
_FIELD_PARSERS = {
    "strategy": parse_strategy, "segment_bytes": parse_segment_bytes, "timeout": parse_timeout,
    "check_agreement": parse_bool, "window": parse_window, "order": parse_order,
    "verify_order": parse_bool, "allreduce": parse_allreduce, "node_size": parse_node_size,
    "pipeline": parse_bool,
}
# CommOptions field, its environment variable, its parser (in ENVIRONMENT's order; a field
# without a parser is a KeyError at import, never a variable silently left unread)
_ENV_FIELDS = tuple((v.field, v.name, _FIELD_PARSERS[v.field])
                    for v in ENVIRONMENT if v.field)


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
    other, as no core is left to overlap with. ``window``: with ``nonblocking``, how many
    segments of one collective are in flight at once.

    Every field is checked (and strings parsed) when the object is made; the environment
    variables (``MPIFUSION_COMM_STRATEGY``, ``MPIFUSION_TIMEOUT`` ...) are only the defaults
    :meth:`from_env` reads.

    Raises:
        OptionError: a field with a value it cannot take (names the field).
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
        """A copy with some fields changed (``None`` values are ignored).

        Args:
            changes: ``field=value`` pairs, checked like the constructor's.
        """
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None,
                 **overrides: Any) -> "CommOptions":
        """The documented defaults from the environment, then explicit ``overrides``
        (arguments beat the environment; ``None`` overrides are ignored).

        Args:
            environ: the variables to read (default ``os.environ``).
            overrides: fields that win over the environment.

        Raises:
            OptionError: a variable or override with a value it cannot take (names it).
        """
        environ = os.environ if environ is None else environ
        fields: dict = {}
        for field, name, parse in _ENV_FIELDS:
            value = environ.get(name, "").strip()
            if value:
                fields[field] = parse(value, name)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)
