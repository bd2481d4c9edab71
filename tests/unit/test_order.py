"""The order check's pieces without MPI jobs: fingerprints equal in every process, messages
that name what each rank started, strict parsing of the order options and of wait timeouts."""
import subprocess
import sys

import numpy as np
import pytest

from mpifusion.comm.order import (ALLREDUCE, REDUCE, fingerprint, order_message)
from mpifusion.comm.task import _deadline_seconds
from mpifusion.config import CommOptions
from mpifusion.errors import OptionError

ROW = (5, ALLREDUCE, 64, 0, -1, 3, 7)


def test_fingerprint_is_the_same_in_every_process():
    """Ranks are separate processes with their own hash seeds: the fingerprint must not
    depend on them (str hashing does; int tuples do not)."""
    code = ("from mpifusion.comm.order import fingerprint; "
            f"print(fingerprint({list(ROW)!r}))")
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed}, check=True).stdout.strip()
            for seed in ("0", "1", "12345")}
    assert seen == {str(fingerprint(ROW))}
    assert fingerprint(ROW) != fingerprint((5, ALLREDUCE, 64, 0, -1, 4, 7))  # another buffer
    assert 0 <= fingerprint(ROW) < 1 << 64


def test_order_message_names_each_rank_and_the_way_out():
    rows = np.array([[5, ALLREDUCE, 64, 0, -1, 3, 7],
                     [5, ALLREDUCE, 64, 0, -1, 3, 7],
                     [5, REDUCE, 128, 3, 2, 4, 7]], dtype=np.int64)
    text = order_message(2, rows, "buffer 4 reduce")
    assert text.startswith("rank 2: buffer 4 reduce: ranks started different collectives")
    assert "ranks 0, 1 started buffer 3 step 7 ALL_REDUCE of 64 float32 as collective #5" in text
    assert "rank 2 started buffer 4 step 7 REDUCE of 128 bfloat16 to rank 2" in text
    assert "order='negotiated'" in text and "no grad changed" in text


@pytest.mark.parametrize("value, expected", [("strict", "strict"), (" Negotiated ", "negotiated")])
def test_order_option(value, expected):
    assert CommOptions(order=value).order == expected
    assert CommOptions.from_env({"MPIFUSION_ORDER": value}).order == expected


@pytest.mark.parametrize("env, message", [
    ({"MPIFUSION_ORDER": "fifo"}, "MPIFUSION_ORDER: expected one of strict, negotiated"),
    ({"MPIFUSION_VERIFY_ORDER": "maybe"}, "MPIFUSION_VERIFY_ORDER: expected a boolean"),
])
def test_order_settings_refused_by_name(env, message):
    with pytest.raises(OptionError, match=message):
        CommOptions.from_env(env)


def test_verify_order_switch():
    assert CommOptions().verify_order is True
    assert CommOptions.from_env({"MPIFUSION_VERIFY_ORDER": "0"}).verify_order is False
    assert CommOptions.from_env({}, verify_order=False).verify_order is False


@pytest.mark.parametrize("value, expected", [
    (None, None), (float("inf"), None), (1e300, None), (10 ** 400, None), (0, 0.0), (2.5, 2.5)])
def test_wait_timeout(value, expected):
    assert _deadline_seconds(value) == expected


@pytest.mark.parametrize("value", [float("nan"), -1, "5", True])
def test_wait_timeout_refused(value):
    with pytest.raises(OptionError, match="timeout: expected a number of seconds"):
        _deadline_seconds(value)


def test_fused_parameters_order_option():
    """order= reaches every buffer fused_parameters builds, and a step still works."""
    from mpi4py import MPI

    from mpifusion import Param, fused_parameters

    params = [Param(f"w{i}", np.full((5 + i,), 1.0 + i, np.float32)) for i in range(3)]
    _, _, buffers = fused_parameters(params, comm_overlap=True, comm_group=MPI.COMM_WORLD,
                                     act="all_reduce", group_size=32, order="negotiated")
    assert len(buffers) > 1 and {b.comm.order for b in buffers} == {"negotiated"}
    for b in buffers:
        for p in b.params:
            b.add_grad(p, grad=np.full(p.shape, 2.0, np.float32))
    for b in buffers:
        b.scale_grads()
        b.close()
    assert all(np.all(p.grad == 2.0) for p in params)  # one rank: the mean is the grad
    with pytest.raises(OptionError, match="order: expected one of strict, negotiated"):
        fused_parameters(params, comm_overlap=True, comm_group=MPI.COMM_WORLD,
                         act="all_reduce", order="random")
