"""Step serials: no rank ever returns a result mixed from two steps.

Every collective carries its buffer's step serial (``FusedCommBuffer.step``) and the ranks
always compare it: before the data with ``verify_order=True`` and in the shared-window rows
(``shm``), before MPI's own collectives whatever ``verify_order`` says. ``reset()`` ends the step on the
rank that calls it, so a rank that drops a step (a ``NanInfError``, then ``reset``) makes the
next collective an ``OrderError`` naming both serials on every rank, and a ``reset()`` on
every rank after it puts them back in step.

Under mpiexec (2, 3, 4 ranks): every strategy x verify_order, one rank dropping a step, every
result a rank returns checked exactly against that serial's inputs. Serially: reset's serial
rules and the OrderError's message and ``steps``.

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests/comm/test_step_serials.py``.
"""
import pickle
import threading

import numpy as np
import pytest
from mpi4py import MPI

from mpifusion import FusedCommBuffer, HookAction, Param
from mpifusion.comm.order import order_error
from mpifusion.config import CommOptions
from mpifusion.errors import NanInfError, OrderError

STRATEGIES = ("thread", "nonblocking", "shm", "hierarchical")
SHAPES = [(5,), (3, 4), (7,)]
#: the serial the last rank drops, and how many steps every rank runs
DROP, STEPS = 3, 8


def grad(n, rank, serial, i, shape):
    """Rank ``rank``'s grad of param ``i`` at ``serial``: ``n`` times an integer that tells
    rank, serial, param and element apart, so the mean over ranks is an exact integer
    (after 1/n too) and a result mixed from two serials shows."""
    j = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    return n * (1e6 * serial + 1e4 * rank + 1e2 * i + j)


def mean(n, serial, i, shape):
    return sum(grad(n, r, serial, i, shape) for r in range(n)) / n


def options(strategy, verify, size, deadline=30.0):
    kw = dict(strategy=strategy, verify_order=verify, timeout=deadline)
    if strategy == "hierarchical":  # 2x2 nodes at 4 ranks (cross-node and in-node steps)
        kw["node_size"] = 2 if size % 2 == 0 and size > 2 else 1
    return CommOptions(**kw)


#: (strategy, verify_order, deadline): every strategy with and without verify_order under a
#: deadline, and the MPI ways without one (no polled calls: every call blocking)
CASES = ([(s, v, 30.0) for s in STRATEGIES for v in (True, False)]
         + [(s, False, None) for s in ("thread", "nonblocking")])


@pytest.fixture
def watchdog(comm):
    """A job that a bug here would hang (no deadline) is aborted instead."""
    timer = threading.Timer(120.0, lambda: MPI.COMM_WORLD.Abort(70))
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, verify, deadline", CASES,
                         ids=[f"{s}-{'verify' if v else 'noverify'}-{'deadline' if d else 'nodeadline'}"
                              for s, v, d in CASES])
def test_a_dropped_step_is_an_order_error_everywhere_never_a_mix(comm, strategy, verify,
                                                                  deadline, watchdog):
    n, rank = comm.Get_size(), comm.Get_rank()
    params = [Param(f"w{i}", np.zeros(s)) for i, s in enumerate(SHAPES)]
    buf = FusedCommBuffer(0, params, comm, act=HookAction.ALL_REDUCE, check_naninf=True,
                          comm_options=options(strategy, verify, n, deadline))
    assert buf.comm.strategy == strategy and buf.step == 0
    returned, errors, dropped = [], [], False
    while buf.step < STEPS:
        serial = buf.step
        buf.grad_storage[...] = 0
        try:
            for i, p in enumerate(params):
                g = grad(n, rank, serial, i, p.shape)
                if rank == n - 1 and serial == DROP and i == len(params) - 1:
                    g = g.copy()
                    g.flat[0] = np.nan
                buf.add_grad(p, grad=g)
            buf.scale_grads()
        except NanInfError:
            dropped = True
            buf.reset(zero_grads=True)  # this rank drops the step
            assert buf.step == serial + 1
            continue
        except OrderError as err:
            errors.append((serial, err))
            buf.reset(zero_grads=True)
            continue
        returned.append(serial)
        for i, p in enumerate(params):
            want = mean(n, serial, i, p.shape)
            assert np.array_equal(p.grad, want), (
                f"rank {rank}: serial {serial} param {i}: a result that is not that serial's "
                f"mean: {p.grad.ravel()[:4]} != {want.ravel()[:4]}")
    buf.close()
    assert dropped == (rank == n - 1)
    # every rank: the collective after the drop failed, naming both serials
    assert [e.steps for _, e in errors] == [(DROP, DROP + 1)], [str(e) for _, e in errors]
    serial, err = errors[0]
    assert serial == (DROP + 1 if rank == n - 1 else DROP)
    text = str(err)
    assert f"step {DROP}" in text and f"step {DROP + 1}" in text and "dropped a step" in text
    assert "Nothing was exchanged" in text, text
    # in step again: the same serials returned, the same end on every rank
    assert returned == [s for s in range(STEPS) if s not in (DROP, DROP + 1)]
    assert len(set(comm.allgather(buf.step))) == 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["thread", "nonblocking"])
def test_reset_on_every_rank_keeps_the_ranks_in_step(comm, strategy):
    """A step dropped on every rank (as after an agreed found-inf flag) is no error."""
    n, rank = comm.Get_size(), comm.Get_rank()
    params = [Param("w", np.zeros(4))]
    buf = FusedCommBuffer(0, params, comm, act=HookAction.ALL_REDUCE,
                          comm_options=CommOptions(strategy=strategy, verify_order=False,
                                                   timeout=30.0))
    for serial in range(4):
        assert buf.step == serial
        buf.grad_storage[...] = 0
        found_inf = comm.allreduce(int(serial == 1 and rank == 0), op=MPI.MAX)
        if found_inf:
            buf.reset(zero_grads=True)
            continue
        buf.add_grad(params[0], grad=grad(n, rank, serial, 0, (4,)))
        buf.scale_grads()
        assert np.array_equal(params[0].grad, mean(n, serial, 0, (4,)))
    buf.close()


# -- serial: reset's rules and the error

class _Failed:
    """A finished task that failed with ``error`` (what reset reads of a task)."""

    def __init__(self, error):
        self.error = error
        self.abandoned = False

    def is_completed(self):
        return True


def _buffer():
    params = [Param("w", np.zeros(3))]
    return FusedCommBuffer(0, params, MPI.COMM_SELF, act="all_reduce"), params


def test_reset_always_ends_the_step():
    buf, params = _buffer()
    assert buf.step == 0
    buf.reset()
    assert buf.step == 1
    buf.reset(zero_grads=True)
    assert buf.step == 2
    buf.add_grad(params[0], grad=np.ones(3))
    buf.scale_grads()
    assert buf.step == 3
    with pytest.raises(AttributeError):
        buf.step = 0  # read-only


@pytest.mark.parametrize("own,steps,after", [(3, (3, 4), 5), (4, (3, 4), 5),
                                             (9, (3, 4), 10), (3, (3, 3), 4), (3, None, 4)])
def test_reset_after_an_order_error_moves_past_the_highest_serial(own, steps, after):
    buf, _ = _buffer()
    buf._step = own
    buf._task = _Failed(OrderError("mismatch", steps=steps))
    buf.reset()
    assert buf.step == after and buf.task is None


def test_reset_after_another_error_ends_the_step_only():
    buf, _ = _buffer()
    buf._step = 5
    buf._task = _Failed(RuntimeError("no serials"))
    buf.reset()
    assert buf.step == 6


def _rows(steps, buf=0, key=0):
    return np.array([(7, 1, 64, 0, -1, buf, s, key, 0) for s in steps], dtype=np.int64)


def test_order_error_names_each_ranks_serial():
    err = order_error(0, _rows([3, 4, 3]), "buffer 0 all_reduce")
    assert err.steps == (3, 4)
    text = str(err)
    assert "rank 1 at step 4; ranks 0, 2 at step 3" in text
    assert "dropped a step" in text and "reset() ends the step" in text
    assert "moves the buffer past step 4" in text and "Nothing was exchanged" in text
    again = pickle.loads(pickle.dumps(err))
    assert again.steps == (3, 4) and str(again) == text


def test_order_error_of_other_differences_has_no_serials():
    err = order_error(1, _rows([3, 3], buf=0).copy(), "x")  # all alike: no step split
    assert err.steps is None
    rows = np.concatenate([_rows([3], buf=0), _rows([4], buf=1)])
    err = order_error(1, rows, "x")
    assert err.steps is None and "ranks started different collectives" in str(err)
    assert OrderError("plain").steps is None
