"""The README's API tour: run with `mpiexec -n 4 python examples/api_tour.py`."""
import numpy as np
from mpi4py import MPI
from mpifusion import FusedCommBuffer, HookAction, Param

comm = MPI.COMM_WORLD
rank, nranks = comm.Get_rank(), comm.Get_size()
for act, dst in [(HookAction.ALL_REDUCE, -1), (HookAction.REDUCE, 0), (HookAction.REDUCE_SCATTER, -1)]:
    params = [Param("fc.weight", np.zeros((17, 257), np.float32)), Param("fc.bias", np.zeros(17, np.float32))]
    buf = FusedCommBuffer(0, params, comm, act=act, dst=dst, acc_steps=2)
    for micro_step in range(2):
        for p in reversed(params):  # backward visits params in reverse order
            buf.add_grad(p, grad=np.full(p.shape, rank + 1.0, np.float32))  # comm starts after the last
    buf.scale_grads()  # wait, then scale by 1/nranks: the mean over ranks of the 2 micro-steps' sum
    if act == HookAction.REDUCE_SCATTER:
        lo, hi = buf.layout.shard_range(rank)  # this rank's reduced shard of the flat grad buffer
        print(f"rank {rank} {act.name}: shard [{lo}, {hi}) max {buf.grad_storage[lo:hi].max()}, expected {nranks + 1.0}")
        buf.sync_params()  # all-gather the (optimizer-updated) param shards back
    elif act == HookAction.ALL_REDUCE or rank == dst:
        print(f"rank {rank} {act.name}: fc.bias.grad[0] = {params[1].grad[0]}, expected {nranks + 1.0}")
