"""Order-check findings of a red-team review (2026-12-04), each a silently wrong result before:
an OrderError that had already pre-scaled the grads, and buffers sharing an id (as every split
of fused_parameters numbers its groups from 0) started in different orders."""
import numpy as np
import pytest

from mpifusion import CommOptions, FusedCommBuffer, Param, fused_parameters
from mpifusion.errors import OrderError

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("strategy", ["thread", "nonblocking"])
def test_order_error_leaves_prescaled_grads_unchanged(comm, strategy):
    """``scale_after_comm=False`` scales by 1/n before the collective (Paddle); an OrderError
    says no grad changed, so the scaling must wait for the check. Retry after reset() gives
    the mean, not mean/n."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("an order mismatch needs two ranks")
    pa, pb = Param("a", np.zeros(40, np.float32)), Param("b", np.zeros(40, np.float32))
    bufs = [FusedCommBuffer(i, [p], comm, act="all_reduce", scale_after_comm=False,
                            comm_options=CommOptions(strategy=strategy)) for i, p in enumerate((pa, pb))]
    A, B = bufs
    order = [(B, pb), (A, pa)] if rank == 0 else [(A, pa), (B, pb)]
    for buf, p in order:
        buf.add_grad(p, grad=np.full(40, rank + 1.0, np.float32))
    errors = 0
    for buf in bufs:
        try:
            buf.scale_grads()
        except OrderError as exc:
            errors += 1
            assert "no grad changed" in str(exc)
    assert errors == 2
    # nothing was scaled: each rank still holds its own gradient
    assert (pa.grad == rank + 1.0).all() and (pb.grad == rank + 1.0).all()
    for buf, p in ((A, pa), (B, pb)):
        buf.reset()
        buf.add_grad(p)   # the grad it holds, checked in again, now in the same order
    A.scale_grads()
    B.scale_grads()
    mean = np.float32(sum(np.float32(r + 1) * np.float32(1.0 / n) for r in range(n)))
    expected = np.float32(0)
    for r in range(n):  # Paddle's numbers: each rank's grad times fl(1/n), then summed
        expected = np.float32(expected + np.float32(np.float32(r + 1) * np.float32(1.0 / n)))
    assert np.allclose(pa.grad, mean, rtol=1e-6) and np.allclose(pb.grad, mean, rtol=1e-6)
    assert np.allclose(pa.grad, expected, rtol=1e-6)


@pytest.mark.parametrize("strategy", ["thread", "nonblocking"])
def test_buffers_with_one_id_in_different_orders_are_an_order_error(comm, strategy):
    """fused_parameters numbers the groups of each split (decay / no decay, ...) from 0, so
    two buffers with id 0 are ordinary; the check tells them apart by which communicator
    (in construction order) started the collective, not by the user's id."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("an order mismatch needs two ranks")
    params = [Param("fc.weight", np.zeros(64, np.float32)),
              Param("fc.bias", np.zeros(64, np.float32))]
    _, _, bufs = fused_parameters(params, comm_overlap=True, comm_group=comm,
                                  act="all_reduce", fuse_param=False,
                                  comm_options=CommOptions(strategy=strategy),
                                  apply_decay_param_fun=lambda name: name.endswith("weight"))
    assert [b.id for b in bufs] == [0, 0]
    values = {"fc.weight": 1.0, "fc.bias": 100.0}
    for p in (params if rank % 2 == 0 else params[::-1]):
        p.backward(np.full(64, values[p.name], np.float32))
    raised = []
    for b in bufs:
        try:
            b.scale_grads()
        except OrderError as exc:
            raised.append(str(exc))
    assert len(raised) == 2, "mixed the grads of two params without an error"
    assert "built on this communicator" in raised[0]
    assert params[0].grad[0] == 1.0 and params[1].grad[0] == 100.0  # nothing exchanged


@pytest.mark.parametrize("strategy", ["thread", "nonblocking"])
@pytest.mark.parametrize("persistent", [True, False])
def test_order_check_by_persistent_request_and_without(comm, strategy, persistent):
    """The order check is one persistent all-reduce per stream (MPI-4 ``Allreduce_init``,
    started again for every collective); an MPI without persistent collectives gets an
    ``Iallreduce`` per check instead. Either way: matched collectives give exact sums, small
    and large, many times over (the persistent request is restarted); collectives started
    in different orders are an OrderError on every rank, and the stream goes on after it."""
    from mpifusion.comm import release
    from mpifusion.comm.communicator import Communicator

    n, rank = comm.Get_size(), comm.Get_rank()
    sub = comm.Dup()  # its own streams: the fallback below must not leak into other tests
    try:
        c1 = Communicator(sub, CommOptions(strategy=strategy))
        c2 = Communicator(sub, CommOptions(strategy=strategy))
        engine = c1._engine
        assert engine is c2._engine
        if persistent:
            assert engine.check_request is not None, "an MPI-4 library: a persistent check"
        else:
            engine.free_check()  # as on an MPI without Allreduce_init
            assert engine.check_request is None
        for size in (1, 1000, 300_000):
            for k in range(5):
                a = np.full(size, rank + 1.0 + k, np.float64)
                c1.allreduce(a).wait()
                assert (a == n * (n + 1) / 2 + n * k).all()
        if n > 1:
            a, b = np.ones(8, np.float64), np.ones(16, np.float64)
            first, second = ((c1, a), (c2, b)) if rank == 0 else ((c2, b), (c1, a))
            tasks = [first[0].allreduce(first[1]), second[0].allreduce(second[1])]
            errors = []
            for task in tasks:
                try:
                    task.wait()
                except OrderError as exc:
                    errors.append(str(exc))
            assert len(errors) == 2 and all("no grad changed" in e for e in errors)
            assert (a == 1).all() and (b == 1).all()
        a = np.full(5, rank + 1.0, np.float64)
        c2.allreduce(a).wait()
        assert (a == n * (n + 1) / 2).all()
    finally:
        release(sub)
        sub.Free()


@pytest.mark.parametrize("strategy", ["thread", "nonblocking"])
def test_deadline_passing_with_the_check_in_flight(comm, strategy):
    """One rank starts late: the others' waits pass their deadline while the order check
    (a persistent request) is in flight -- the thread strategy's caller hands it to the comm
    thread -- and every rank starts a second collective meanwhile. The check must not be
    restarted before it completed: both results exact, and fifty more checks after it."""
    import time

    from mpifusion.comm.communicator import Communicator
    from mpifusion.errors import CommTimeoutError

    n, rank = comm.Get_size(), comm.Get_rank()
    c = Communicator(comm, CommOptions(strategy=strategy, timeout=0.3))
    for trial in range(4):
        a = np.full(1000, rank + 1.0 + trial, np.float64)
        b = np.full(50, rank + 2.0, np.float64)
        if rank == n - 1 and trial % 2 == 0:
            time.sleep(0.6)
        first = c.allreduce(a)
        try:
            first.wait()
        except CommTimeoutError:
            pass  # the late rank's peers, mostly
        second = c.allreduce(b)
        first.wait(timeout=60)
        second.wait(timeout=60)
        assert (a == n * (n + 1) / 2 + n * trial).all()
        assert (b == n * (n + 3) / 2).all()
    for _ in range(50):
        x = np.full(7, rank + 1.0, np.float64)
        c.allreduce(x).wait(timeout=60)
        assert (x == n * (n + 1) / 2).all()
