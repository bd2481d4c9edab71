"""Which strategy ``auto`` takes: the decision for any machine (faked: rank counts, node
shapes, thread levels), and what a default Communicator takes under mpiexec, where every
rank shares this one machine's node (or ``node_size`` emulates nodes).

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests/comm/test_strategy_choice.py``.
"""
import pytest

from mpifusion.comm import Communicator, release
from mpifusion.comm.communicator import resolve_strategy
from mpifusion.config import STRATEGIES, CommOptions
from mpifusion.errors import AgreementError

UNEVEN = "the nodes hold 2 to 4 ranks; hierarchical needs the same number on every node"


@pytest.mark.parametrize("size,per_node,uneven,threads,want", [
    (2, 2, "", True, "shm"),
    (8, 8, "", True, "shm"),
    (16, 8, "", True, "hierarchical"),
    (512, 8, "", True, "hierarchical"),
    (6, 3, "", True, "hierarchical"),
    (4, 1, "", True, "thread"),           # one rank per node: nothing to share
    (1, 1, "", True, "thread"),
    (6, 0, UNEVEN, True, "thread"),
    (8, 8, "", False, "nonblocking"),     # no second thread may call MPI
    (16, 8, "", False, "nonblocking"),
])
def test_auto_takes_shared_memory_where_ranks_share_a_node(size, per_node, uneven, threads,
                                                           want):
    strategy, why = resolve_strategy("auto", size, per_node, uneven, thread_multiple=threads)
    assert strategy == want, why
    assert why.startswith("auto: ") and (not uneven or uneven in why), why


@pytest.mark.parametrize("nbytes,want", [(None, "hierarchical"), (0, "thread"),
                                          (4 << 10, "thread"), ((256 << 10) - 1, "thread"),
                                          (256 << 10, "hierarchical"),
                                          (64 << 20, "hierarchical")])
def test_auto_across_nodes_weighs_the_buffer_size(nbytes, want):
    """Across nodes a small buffer takes ``thread`` (faster there, measured); on one node and
    for a chosen strategy the size changes nothing."""
    strategy, why = resolve_strategy("auto", 16, 8, thread_multiple=True, nbytes=nbytes)
    assert strategy == want and why.startswith("auto: 2 nodes of 8 ranks"), why
    assert want == "hierarchical" or f"a buffer of {nbytes} bytes" in why, why
    assert resolve_strategy("auto", 8, 8, thread_multiple=True, nbytes=nbytes)[0] == "shm"
    assert resolve_strategy("hierarchical", 16, 8, thread_multiple=True,
                            nbytes=nbytes)[0] == "hierarchical"


@pytest.mark.parametrize("chosen", STRATEGIES)
def test_a_chosen_strategy_is_kept_whatever_the_nodes(chosen):
    for threads in (True, False):
        assert resolve_strategy(chosen, 16, 8, thread_multiple=threads) == (
            chosen, "chosen (strategy= or MPIFUSION_COMM_STRATEGY)")


@pytest.mark.mpi
def test_a_default_communicator_on_one_node_runs_shm(comm):
    c = Communicator(comm, CommOptions())
    try:
        want = "thread" if comm.Get_size() == 1 else "shm"
        assert c.auto and c.strategy == want and c.shm_fallback is None, \
            (c.strategy, c.shm_fallback)
    finally:
        c.close()


@pytest.mark.mpi(min_size=4)
def test_a_default_communicator_over_emulated_nodes_runs_hierarchical(comm):
    if comm.Get_size() % 2:
        pytest.skip("another rank count: 2-rank nodes need an even count")
    c = Communicator(comm, CommOptions(node_size=2))
    try:
        assert c.strategy == "hierarchical" and c.shm_fallback is None, c.shm_fallback
    finally:
        c.close()


@pytest.mark.mpi(min_size=4)
def test_default_buffers_over_emulated_nodes_take_their_size_into_account(comm):
    """A FusedCommBuffer under ``auto`` across (emulated) nodes: ``thread`` for 4 KiB of
    grads, ``hierarchical`` for 1 MiB, and each reduces to the mean."""
    import numpy as np

    from mpifusion import FusedCommBuffer, HookAction, Param

    if comm.Get_size() % 2:
        pytest.skip("another rank count: 2-rank nodes need an even count")
    n, rank = comm.Get_size(), comm.Get_rank()
    for ident, (numel, want) in enumerate([(1024, "thread"), (1 << 18, "hierarchical")]):
        p = Param(f"w{ident}", np.zeros(numel, np.float32))
        buf = FusedCommBuffer(ident, [p], comm, act=HookAction.ALL_REDUCE,
                              comm_options=CommOptions(node_size=2))
        try:
            assert buf.comm.strategy == want, (numel, buf.comm.strategy)
            buf.add_grad(p, grad=np.full(numel, rank + 1, np.float32))
            buf.scale_grads()
            np.testing.assert_array_equal(p.grad, np.float32((n + 1) / 2))
        finally:
            buf.close()


@pytest.mark.mpi(min_size=2)
def test_auto_on_one_rank_and_a_chosen_strategy_on_the_others_is_refused(comm):
    """Every rank probes the nodes, whatever it asked for, so a rank that resolves ``auto``
    and ranks that chose ``thread`` still meet in the agreement check: AgreementError on
    every rank, never a hang or a mismatched call."""
    options = CommOptions() if comm.Get_rank() == 0 else CommOptions(strategy="thread")
    sub = comm.Dup()  # a fresh communicator: its first Communicator probes the nodes
    try:
        with pytest.raises(AgreementError, match="strategy"):
            Communicator(sub, options, timeout=30.0)
    finally:
        release(sub)
        sub.Free()
