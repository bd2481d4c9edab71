"""Shared test set-up.

The ``mpi`` marker alone decides the launcher. Tests marked ``mpi`` run under ``mpiexec -n N
python -m mpi4py -m pytest --only-mpi``, where only the modules whose source applies the
marker are collected (the others would be collected on every rank only to be skipped); a
plain ``pytest`` deselects them and says how to run them. A test failing on one rank aborts
the whole job at once (instead of leaving the other ranks blocked in a collective until the
timeout).

``--strict-skips`` (``MPIFUSION_STRICT_SKIPS=1``, set by scripts/test.sh) fails a run whose
skips tests/skips.py does not allow; every session removes the MPI segments and launcher
files that jobs killed during it left behind (tests/leftovers.py).
"""
import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests import leftovers, skips
# session-wide and autouse: no test or job sees a developer's own tune file (tests/helpers.py)
from tests.helpers import isolated_tune_file  # noqa: F401

os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

#: how a test module applies the marker (``pytest.mark.mpi``, ``mark.mpi(min_size=2)``);
#: the serial run checks that every collected ``mpi`` test sits in a module this finds
MPI_MARK = re.compile(r"\bmark\.mpi\b")


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _under_mpi(config) -> bool:
    return bool(config.getoption("with_mpi", False) or config.getoption("only_mpi", False))


def _rank(config) -> int:
    return _world().Get_rank() if _under_mpi(config) else 0


def pytest_addoption(parser):
    parser.addoption("--strict-skips", action="store_true",
                     default=os.environ.get(skips.STRICT_ENV, "") not in ("", "0"),
                     help="fail when a test skips for a reason tests/skips.py does not allow "
                          f"(also {skips.STRICT_ENV}=1)")
    parser.addoption("--stress", action="store_true",
                     default=os.environ.get("MPIFUSION_STRESS", "") not in ("", "0"),
                     help="also run the long randomized tests marked stress "
                          "(also MPIFUSION_STRESS=1)")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # Under mpiexec only rank 0 reports; other ranks print nothing unless a test fails.
    if _under_mpi(config) and _world().Get_rank() != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
    config._mpifusion_removed = []
    if config.getoption("strict_skips"):
        try:
            skips.asked()  # an unknown category name stops the run before it starts
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None


def _applies_mpi_mark(path: Path) -> bool:
    try:
        return MPI_MARK.search(path.read_text(encoding="utf-8", errors="replace")) is not None
    except OSError:
        return True


def pytest_ignore_collect(collection_path, config):
    """Under --only-mpi, a test module that never applies the ``mpi`` marker is not even
    imported (a text check: importing all ~50 modules on every rank took 8 s of CPU each)."""
    if (config.getoption("only_mpi", False) and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and not _applies_mpi_mark(collection_path)):
        return True
    return None


#: The serial run's longest files, longest first (seconds of their tests in a quiet
#: pytest-xdist run of 2026-12-05: 129, 34, 33, 25, 17, 13, 12.5, 12, 11.5, 9, 9, 8; the
#: next were below 8). They run first, the rest after them in collection order:
#: scripts/test.sh hands whole files to its workers (``--dist loadfile``), and
#: pytest-xdist's own order (most tests first) left the few long whole-job files of
#: tests/tools to the end, where one worker ran them while the other had nothing left.
#: (tests/slurm runs in a lane of its own beside them.)
LONGEST_FILES = (
    "faults/test_faults.py", "faults/test_leaving.py", "comm/test_engine_order.py",
    "tools/test_cli_run.py",
    "oracle/test_user_patterns.py", "docs/test_oracle_page.py", "docs/test_launcher_exit.py",
    "oracle/test_peers.py", "docs/test_transcripts.py", "tools/test_cli_ddp.py",
    "tools/test_cli_bench.py", "oracle/test_capture.py", "tools/test_run_exact_inputs.py",
)


def _longest_first(items):
    """``items`` with LONGEST_FILES' tests first (in that order, each file's own order kept)."""
    tests_dir = Path(__file__).resolve().parent
    rank = {tests_dir / name: i for i, name in enumerate(LONGEST_FILES)}
    return sorted(items, key=lambda item: rank.get(Path(str(item.fspath)), len(rank)))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Deselect (not skip) what this launcher does not run, so skips mean something; the
    serial run starts with its longest files (LONGEST_FILES)."""
    only_mpi = config.getoption("only_mpi", False)
    with_mpi = config.getoption("with_mpi", False)
    keep, drop = [], []
    files_ok = {}
    for item in items:
        is_mpi = item.get_closest_marker("mpi") is not None
        if item.get_closest_marker("stress") is not None and not config.getoption("stress"):
            drop.append(item)
        elif only_mpi and not is_mpi:
            drop.append(item)
        elif not (only_mpi or with_mpi) and is_mpi:
            path = Path(str(item.fspath))
            if path not in files_ok:
                files_ok[path] = _applies_mpi_mark(path)
            if not files_ok[path]:
                raise pytest.UsageError(
                    f"{item.nodeid} is marked mpi but its module never writes 'mark.mpi', so "
                    f"the MPI runs would not collect it; mark it in the module itself")
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    if not (only_mpi or with_mpi):
        keep = _longest_first(keep)
    elif _world().Get_size() > MATRIX_WHOLE_UP_TO:
        _thin_matrices(keep, _world().Get_size())
    items[:] = keep
    n_mpi = sum(1 for item in drop if item.get_closest_marker("mpi") is not None)
    config._mpifusion_mpi_deselected = 0 if (only_mpi or with_mpi) else n_mpi


#: Tests marked ``matrix`` (a dtype x action x option matrix whose cases do not depend on the
#: rank count) run whole at up to this many ranks; above it, a few cases that together give
#: every parameter every one of its values (each-choice): the 8-rank runs keep what 8 ranks
#: add (another size of every collective) without repeating each combination that 2, 3 and
#: 4 ranks have run. At 8 ranks: 481 tests run -> 273 (MPICH: 100-118 s -> 78 s).
MATRIX_WHOLE_UP_TO = 4


def each_choice(cases: "list[dict]") -> "set[int]":
    """Indices of a few ``cases`` (parameter name -> value) that together hold every
    value of every parameter: greedily the case with the most values not yet held, the
    first such case on a tie (the same choice on every rank)."""
    todo = {pair for case in cases for pair in case.items()}
    chosen: "set[int]" = set()
    while todo:
        best = max(range(len(cases)), key=lambda i: (len(todo & set(cases[i].items())), -i))
        chosen.add(best)
        todo -= set(cases[best].items())
    return chosen


def _case_values(item) -> dict:
    """Parameter name -> its value in this case, by repr (a tuple of names parametrized
    together is still one parameter per name), by position where the repr is an address."""
    params, indices = item.callspec.params, item.callspec.indices
    return {name: (f"#{indices[name]}" if " at 0x" in repr(value) else repr(value))
            for name, value in params.items() if name in indices}


def _thin_matrices(items, size: int) -> None:
    """Skip, at ``size`` ranks, the cases of each ``matrix`` test that :func:`each_choice`
    leaves out (a skip of the "ranks" kind: tests/skips.py checks they ran at another
    count)."""
    groups: dict = {}
    for item in items:
        if item.get_closest_marker("matrix") is not None and hasattr(item, "callspec"):
            groups.setdefault((str(item.fspath), item.originalname), []).append(item)
    for group in groups.values():
        keep = each_choice([_case_values(item) for item in group])
        for i, item in enumerate(group):
            if i not in keep:
                item.add_marker(pytest.mark.skip(reason=matrix_skip_reason(size)))


def matrix_skip_reason(size: int) -> str:
    return (f"a matrix case: every case runs at 1-{MATRIX_WHOLE_UP_TO} ranks, at {size} "
            f"ranks each parameter value once (tests/conftest.py)")


def pytest_sessionstart(session):
    session.config._mpifusion_snapshot = leftovers.snapshot()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _under_mpi(item.config):
        comm = _world()
        if comm.Get_size() > 1:
            sys.stderr.write(f"\n[rank {comm.Get_rank()}] FAILED {item.nodeid} "
                             f"({report.when}):\n{report.longreprtext}\n")
            sys.stderr.flush()
            # the launcher forwards output asynchronously and drops what is still on its way
            # when the abort kills the job: seen under load (an empty failure report)
            time.sleep(0.5)
            comm.Abort(1)


#: nodeid -> (outcome, skip reason) of this session's tests
_OUTCOMES: dict = {}


def pytest_runtest_logreport(report):
    """Keep each test's outcome (and a skip's reason) for the skip guard and the skip log."""
    if hasattr(report, "wasxfail"):
        _OUTCOMES[report.nodeid] = ("xfailed" if report.skipped else "xpassed", "")
    elif report.skipped:
        _OUTCOMES[report.nodeid] = ("skipped", skips.skip_reason(report))
    elif report.when == "call" or report.failed:
        _OUTCOMES.setdefault(report.nodeid, (report.outcome, ""))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    skipped = [(n, r) for n, (o, r) in _OUTCOMES.items() if o == "skipped"]
    config._mpifusion_refused = (skips.refused(skipped)
                                 if config.getoption("strict_skips") else [])
    if config._mpifusion_refused and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    # a pytest-xdist worker sees only its share; the controller gets every report and logs
    worker = hasattr(config, "workerinput")
    if _rank(config) == 0:
        folder = os.environ.get(skips.LOG_ENV)
        if folder and _OUTCOMES and not worker:
            label = os.environ.get(skips.LABEL_ENV) or (
                f"mpi-n{_world().Get_size()}" if _under_mpi(config) else "serial")
            skips.write_log(folder, label, dict(_OUTCOMES))
        config._mpifusion_removed = leftovers.sweep(config._mpifusion_snapshot)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n_mpi = getattr(config, "_mpifusion_mpi_deselected", 0)
    if n_mpi:
        terminalreporter.write_line(
            f"{n_mpi} tests marked mpi deselected: they run under "
            f"mpiexec -n N python -m mpi4py -m pytest --only-mpi (scripts/test.sh)")
    removed = getattr(config, "_mpifusion_removed", [])
    if removed:
        terminalreporter.write_line(
            f"removed {len(removed)} MPI segment(s)/launcher file(s) left by jobs killed "
            f"during this session: {' '.join(p.name for p in removed[:10])}"
            f"{' ...' if len(removed) > 10 else ''}")
    refused = getattr(config, "_mpifusion_refused", [])
    if refused:
        terminalreporter.section("skips not allowed in this run (--strict-skips)", red=True)
        for nodeid, reason in refused:
            terminalreporter.write_line(f"{nodeid}: {reason}")
        terminalreporter.write_line(
            "Install what they need, or allow their category for this run with "
            f"{skips.ALLOW_ENV}=<category,...> (categories and reasons: tests/skips.py).")


@pytest.fixture
def comm():
    """COMM_WORLD under mpiexec (the test then runs at every rank count it is given)."""
    return _world()
