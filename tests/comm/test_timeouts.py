"""Timeouts (``timeout=``, ``$MPIFUSION_TIMEOUT``): a huge value means no deadline and
fits every wait; a bad one is refused by name before anything is built.
"""
from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from mpifusion.config import CommOptions, parse_timeout
from mpifusion.errors import OptionError

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize("value", [INF, 1e300, "inf", "1e300", 10 ** 400, "1e9999"])
def test_timeout_huge_means_no_deadline(value):
    assert parse_timeout(value, "timeout") is None
    assert CommOptions(timeout=value).timeout is None


@pytest.mark.parametrize("value", [NAN, -1, 0, "abc", "nan", "-1", "0", True, [1]])
def test_timeout_bad_values_are_refused_by_name(value):
    with pytest.raises(OptionError) as info:
        parse_timeout(value, "MPIFUSION_TIMEOUT")
    assert str(info.value).startswith("MPIFUSION_TIMEOUT: expected")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, ok", [("inf", True), ("1e300", True), ("nan", False),
                                      ("-1", False), ("0", False), ("abc", False)])
def test_timeout_from_the_environment(text, ok):
    if ok:
        assert CommOptions.from_env({"MPIFUSION_TIMEOUT": text}).timeout is None
    else:
        with pytest.raises(OptionError, match="MPIFUSION_TIMEOUT"):
            CommOptions.from_env({"MPIFUSION_TIMEOUT": text})


@pytest.mark.parametrize("value, ok", [(INF, True), (1e300, True), (1e9, True), (NAN, False),
                                       (-1, False), (0, False), ("abc", False)])
def test_buffer_timeout_keyword(value, ok):
    """FusedCommBuffer(timeout=...) on one rank: a huge value runs a full step (no
    OverflowError in any wait); a bad one is refused before anything is built."""
    from mpi4py import MPI

    from mpifusion import FusedCommBuffer, Param

    p = Param("w", np.zeros(3, np.float32))
    if not ok:
        with pytest.raises(OptionError, match="timeout"):
            FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce", timeout=value)
        return
    buf = FusedCommBuffer(0, [p], MPI.COMM_SELF, act="all_reduce", timeout=value)
    buf.add_grad(p, grad=np.full(3, 1.5, np.float32))
    buf.scale_grads()
    assert np.array_equal(p.grad, np.full(3, 1.5, np.float32))
    assert buf.timeout == (None if value > 1e9 else value)


def test_longest_deadline_fits_every_wait():
    """The largest finite deadline parse_timeout keeps is accepted by threading and time."""
    from mpifusion.config import MAX_TIMEOUT

    assert MAX_TIMEOUT <= threading.TIMEOUT_MAX
    ev = threading.Event()
    ev.set()
    assert ev.wait(MAX_TIMEOUT)
    assert math.isfinite(time.monotonic() + MAX_TIMEOUT)
