"""pytest plugin: the ``mpifusion_oracle`` fixture for other projects' test suites.

Enable it with ``pytest_plugins = ["mpifusion.oracle.pytest_plugin"]`` in a ``conftest.py``
(or ``pytest -p mpifusion.oracle.pytest_plugin``). The fixture is a function
``mpifusion_oracle(spec, dumps, *, allow_weak=False, **options)`` that checks the dumps (a
directory of ``step{k}/`` folders: every step), raises :class:`~mpifusion.errors.OracleMismatch`
with the report (naming the step, params and ranks) when they stray, raises
:class:`~mpifusion.errors.WeakCheckError` with one line when the inputs cannot reveal a
missing reduction (the same inputs on every rank, or zeros) unless ``allow_weak``, warns
(``OracleWarning``) when the bound is coarser than one input, and returns the report. Both
errors are ``AssertionError`` subclasses: the test fails, and ``pytest.raises(OracleMismatch)``
expects a failure.
Every report is also written as JSON under the test's ``tmp_path``: ``oracle-report.json``
for the first call of a test, ``oracle-report-2.json``, ``-3`` ... for later ones.

A test failing with :class:`~mpifusion.errors.OracleMismatch` or
:class:`~mpifusion.errors.WeakCheckError` (``assert_matches_reference``, or a rank's check
re-raised by :func:`mpifusion.capture.torch.spawn`) shows the message, report first, instead
of a traceback.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from ..errors import OracleMismatch, WeakCheckError
from . import check
from .report import weak_message


@pytest.fixture
def mpifusion_oracle(tmp_path: Any) -> Callable[..., Any]:
    """Check ``(spec, dumps)`` against the float64 reference; raise ``OracleMismatch`` on a
    mismatch, ``WeakCheckError`` on inputs too weak to reveal one (unless
    ``allow_weak=True``): AssertionErrors, so the test fails.

    The fixture's value is that function; a test calls it as
    ``mpifusion_oracle(spec, dumps)``, as often as it likes (each report is written under
    the test's ``tmp_path``), and gets the report
    (:class:`~mpifusion.oracle.CheckReport` or :class:`~mpifusion.oracle.StepsReport`).

    Args:
        spec: a :class:`~mpifusion.spec.Spec`, a dict or a JSON spec path.
        dumps: a directory of ``rank{r}.npz`` (or of ``step{k}/`` folders), or a list of
            records, as :func:`~mpifusion.oracle.check` takes them.
        allow_weak: accept inputs too weak to reveal a missing reduction.
        options: :func:`~mpifusion.oracle.check`'s keyword arguments (``exact``,
            ``reduce_avg``).

    Raises:
        ~mpifusion.oracle.OracleMismatch: the dumps do not match the reference.
        ~mpifusion.oracle.WeakCheckError: the inputs cannot reveal a missing reduction.
    """
    counter = [0]

    def run(spec: Any, dumps: Any, *, allow_weak: bool = False, **options: Any) -> Any:
        __tracebackhide__ = True
        report = check(spec, dumps, **options)
        counter[0] += 1
        name = "oracle-report.json" if counter[0] == 1 else f"oracle-report-{counter[0]}.json"
        (tmp_path / name).write_text(json.dumps(report.to_json(allow_weak=allow_weak),
                                                indent=1), encoding="utf-8")
        if not report.ok:
            raise _plain(OracleMismatch(f"mpifusion oracle: FAIL\n{report}", report))
        if report.weak and not allow_weak:
            raise _plain(WeakCheckError(weak_message(report), report))
        return report.raise_for_weakness(allow_weak=True)  # the coarse-bound warning

    return run


def _plain(exc: Exception) -> Exception:
    """Mark an error the fixture raised: pytest shows its message alone (the report, or the
    weak check's one line), as the fixture's ``pytest.fail`` did before it raised."""
    exc._mpifusion_fixture = True  # type: ignore[attr-defined]
    return exc


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    """The oracle's own failures read as their message (the report), not a traceback."""
    outcome = yield
    rep = outcome.get_result()
    if call.excinfo is not None and rep.failed and \
            call.excinfo.errisinstance((OracleMismatch, WeakCheckError)):
        exc = call.excinfo.value
        rep.longrepr = (str(exc) if getattr(exc, "_mpifusion_fixture", False)
                        else f"{type(exc).__name__}: {exc}")
