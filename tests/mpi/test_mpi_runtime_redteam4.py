"""Red-team round 4 at every rank count: a grad passed positionally to ``add_grad(param,
use_comm=True, grad=None)`` became ``use_comm``. With a one-element grad of value ``rank`` it
was falsy on rank 0 (checked in, communication never started there) and truthy elsewhere
(grad dropped, collective started): the ranks parted ways. Now every rank refuses it, the
same way, before anything changes, and the step then goes on to the exact result."""
import numpy as np
import pytest

from mpifusion import FusedCommBuffer, OptionError, Param

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("act", ["all_reduce", "reduce_scatter"])
def test_a_positional_grad_is_refused_on_every_rank_and_the_step_goes_on(comm, act):
    rank, n = comm.Get_rank(), comm.Get_size()
    p = Param("w", np.zeros(1, np.float32))
    buf = FusedCommBuffer(0, [p], comm, act=act, timeout=60)
    with pytest.raises(OptionError, match=rf"^rank {rank}: buffer 0: param 'w': add_grad: "
                                          rf"use_comm: expected True or False"):
        buf.add_grad(p, np.full(1, float(rank), np.float32))
    assert buf.checked_in == 0 and buf.task is None and not buf.grad_storage.any()
    buf.add_grad(p, grad=np.full(1, float(rank + 1), np.float32))
    buf.scale_grads()
    if act == "all_reduce" or rank == 0:  # w[0] lies in rank 0's shard
        assert float(p.grad[0]) == (n + 1) / 2
