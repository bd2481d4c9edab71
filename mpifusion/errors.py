"""Exceptions users can catch; every message names the rank and the param or option at fault."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Tuple, Type


class FusionError(RuntimeError):
    """Base class of mpifusion's own errors."""


class LayoutError(FusionError, ValueError):
    """Params that cannot be fused as asked (mixed dtypes, duplicate names, bad options)."""


class OptionError(FusionError, ValueError):
    """An option or environment setting with a value it cannot take (names which, and why)."""


class AgreementError(LayoutError):
    """Ranks tried to build different buffers (params, order, shapes, dtypes or options)."""


class GradError(FusionError, ValueError):
    """A gradient handed to ``add_grad`` that cannot be accumulated (unknown param, wrong
    shape/dtype, replaced view, too many micro-steps)."""


class CheckInError(FusionError):
    """Communication asked for while some params have not checked in yet."""


class NanInfError(FusionError, FloatingPointError, ValueError):
    """NaN or Inf found in a grad buffer before communication (a ``ValueError`` too, as
    Paddle raises one: ported ``except ValueError`` code catches it)."""


class StateError(FusionError):
    """A call the buffer's current state does not allow (communication still in flight,
    storage cleared, no communicator); the message says what to call first."""


class CommError(FusionError):
    """A collective could not be started or finished."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective did not finish within the buffer's deadline."""


class CommLimitError(CommError):
    """The MPI library ran out of something mpifusion needs for a new stream (its
    communicators: MPICH has 2,048 context ids); the message names the limit."""


class OracleMismatch(FusionError, AssertionError):
    """A checked implementation's results do not match the oracle's reference (names the params
    and ranks; ``report`` holds every statistic). An AssertionError too, so test runners show
    it as a failed assertion.

    Args:
        message: the report as text, first line the verdict.
        report: the :class:`~mpifusion.oracle.CheckReport` (or ``StepsReport``); its
            failing params and ranks are kept as ``params`` and ``ranks``.
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report
        self.params = list(getattr(report, "failing", []))
        self.ranks = list(getattr(report, "failing_ranks", []))


class WeakCheckError(FusionError, AssertionError):
    """A check that passed on inputs that cannot reveal a missing reduction (the same inputs
    on every rank, or all zeros): a reducer that does nothing would pass it too. Raised by
    ``assert_matches_reference`` and the pytest fixture unless ``allow_weak=True``.

    Args:
        message: one line, why and how to fix the inputs.
        report: the report of the check, kept as ``report``.
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class OracleWarning(UserWarning):
    """The oracle passed, but its bound is coarser than one input's contribution: a result
    missing one rank's or micro-step's gradient may pass (half-precision grads, many ranks)."""


class OrderError(CommError):
    """Ranks started different collectives at the same point of a communicator's stream
    (another buffer, step, size or kind): every rank raises it. ``steps``: where the ranks
    started the same buffer's collective at different step serials, ``(lowest, highest)``
    (a rank dropped a step; ``reset()`` then moves the buffer past ``highest``), else None.

    Args:
        message: what each rank started, by rank.
        steps: as above.
    """

    def __init__(self, message: str = "", steps: Optional[Tuple[int, int]] = None) -> None:
        super().__init__(message)
        self.steps = None if steps is None else (int(steps[0]), int(steps[1]))


class AbandonedError(CommError):
    """A collective on this communicator was given up (``reset(abandon=True)``) on some rank:
    later collectives would pair with the stale one, so they refuse to run."""


class InputLimitError(FusionError, ValueError):
    """Input beyond what can be read, planned or allocated here (one line, says why)."""


@contextmanager
def error_context(where: str, *catch: Type[BaseException], kind: Optional[type] = None,
                  note: str = "") -> Iterator[None]:
    """Errors of the types ``catch`` raised inside, raised again as ``kind`` (default: the
    same type) reading ``"{where}: {error}{note}"``, the original chained as the cause.

    The one way context ("rank R: buffer I: param 'p'") is put on an error raised below
    the code that knows it: the message says where, the traceback still shows how.
    """
    try:
        yield
    except catch as err:
        raise (kind or type(err))(f"{where}: {err}{note}") from err
