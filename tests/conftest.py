"""Shared test set-up.

Tests marked ``mpi`` run under ``mpiexec -n N python -m mpi4py -m pytest --with-mpi``; a
test failing on one rank aborts the whole job at once (instead of leaving the other ranks
blocked in a collective until the timeout).
"""
import os
import sys
import time

import pytest

os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _under_mpi(config) -> bool:
    return bool(config.getoption("with_mpi", False) or config.getoption("only_mpi", False))


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # Under mpiexec only rank 0 reports; other ranks print nothing unless a test fails.
    if _under_mpi(config) and _world().Get_rank() != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


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


@pytest.fixture
def comm():
    """COMM_WORLD under mpiexec (the test then runs at every rank count it is given)."""
    return _world()
