"""pytest plugin: the ``mpifusion_oracle`` fixture for other projects' test suites.

Enable it with ``pytest_plugins = ["mpifusion.oracle.pytest_plugin"]`` in a ``conftest.py``
(or ``pytest -p mpifusion.oracle.pytest_plugin``). The fixture is a function
``mpifusion_oracle(spec, dumps, **options)`` that checks the dumps, fails the test with the
report (naming the params and ranks) when they stray, and returns the report; every report
is also written as JSON under the test's ``tmp_path`` (``oracle-report.json``) for CI
artifacts.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from . import check


@pytest.fixture
def mpifusion_oracle(tmp_path: Any) -> Callable[..., Any]:
    """Check ``(spec, dumps)`` against the float64 reference; fail the test on a mismatch."""
    counter = [0]

    def run(spec: Any, dumps: Any, **options: Any) -> Any:
        report = check(spec, dumps, **options)
        counter[0] += 1
        name = "oracle-report.json" if counter[0] == 1 else f"oracle-report-{counter[0]}.json"
        (tmp_path / name).write_text(json.dumps(report.to_json(), indent=1), encoding="utf-8")
        if not report.ok:
            pytest.fail(f"mpifusion oracle: FAIL\n{report}", pytrace=False)
        return report

    return run
