"""The oracle: the exact reference of a gradient sync (``exact``: each element's sum or mean
rounded once), how far a correct result may be from it (``bound``), bit-exact inputs
(``inputs``), reading other implementations' dumps (``dumps``), checking them (``check``,
``steps``) and saying what went wrong (``diagnose``). Needs no MPI: it runs wherever the
dumps are.

In another project's tests::

    from mpifusion.oracle import assert_matches_reference
    assert_matches_reference(spec, [rank0_dict, rank1_dict])   # raises OracleMismatch

or ``report = check(spec, dumps)`` for the statistics (``report.ok``, ``str(report)``,
``report.to_json()``, ``report.raise_for_failure()``, ``plot_report(report, "err.png")``).
"""
from typing import Any

from ..errors import OracleMismatch, OracleWarning, WeakCheckError
from .bound import (BoundModel, ErrorStats, as_float64, bound_model, error_bound, format_ratio,
                    reduce_dtype, summed, unit_roundoff)
from .check import as_spec, check_dump
from .diagnose import Diagnosis, ParamCase, diagnose
from .dumps import DumpError
from .inputs import (Contributions, ExactPattern, decode_contributions, decode_inputs,
                     exact_inputs, exact_pattern, exact_sum, exact_tolerance)
from .report import CheckReport, CoverageIssue, SyncStats
from .steps import StepsReport, check, check_steps


def assert_matches_reference(spec: Any, dumps: Any, *, allow_weak: bool = False,
                             **options: Any) -> CheckReport:
    """``check(spec, dumps, **options).raise_for_failure()``: the one-line assertion for test
    suites; raises :class:`~mpifusion.errors.OracleMismatch` (an AssertionError) naming the
    params and ranks that stray. A PASS on inputs that cannot reveal a missing reduction
    (every rank fed the same inputs, or zeros) proves nothing, so it raises
    :class:`~mpifusion.errors.WeakCheckError` (one line: why, how to fix the inputs) unless
    ``allow_weak``; a bound coarser than one input warns (``OracleWarning``). ``dumps`` may
    be a directory of ``step{k}/`` folders (:func:`check_steps`). Returns the report."""
    return check(spec, dumps, **options).raise_for_failure().raise_for_weakness(allow_weak)


def plot_report(report: CheckReport, path: str) -> str:
    """Draw error/bound per param and rank into ``path`` (needs matplotlib); returns the file
    written: ``path``, plus ``.png`` when it has no extension (a directory is refused).

    Args:
        report: a :class:`CheckReport` (of :func:`check`).
        path: the image file; its extension picks the format.

    Raises:
        PlotError: matplotlib missing, a directory, or a file that cannot be written.
    """
    from .plot import plot_report as _plot

    return _plot(report, path)


__all__ = ["BoundModel", "ErrorStats", "as_float64", "bound_model", "error_bound",
           "format_ratio", "reduce_dtype", "summed", "unit_roundoff", "CheckReport",
           "CoverageIssue", "SyncStats", "OracleMismatch", "as_spec", "check", "check_dump",
           "assert_matches_reference", "plot_report", "DumpError", "OracleWarning",
           "WeakCheckError", "check_steps", "StepsReport", "exact_inputs", "exact_sum",
           "exact_pattern", "exact_tolerance", "decode_contributions", "Contributions",
           "ExactPattern", "decode_inputs", "Diagnosis", "ParamCase", "diagnose"]
