"""mpifusion's own REDUCE buffer under mpiexec, every rank's grad buffer dumped (the root's
reduced result and the non-root ranks' local values), for each way 1/n is applied:
``pre`` (scale_after_comm=False), ``post`` (scale_after_comm=True), ``avg``
(use_reduce_avg: non-root ranks keep their unscaled sums). The oracle's non-root rule is
Paddle's; this checks mpifusion's runtime against it. Writes ``OUT/{case}/rank{r}.npz`` and
``spec.json``."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
from mpi4py import MPI

from mpifusion import FusedCommBuffer, Param
from mpifusion.capture import Recorder

SHAPES = {"w0": (10, 3), "w1": (257,), "w2": (3, 31, 2)}


def main() -> int:
    out = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    dst = n - 1
    for case, sac, avg in (("pre", False, False), ("post", True, False), ("avg", True, True)):
        params = [Param(name, np.zeros(shape, np.float32)) for name, shape in SHAPES.items()]
        buf = FusedCommBuffer(0, params, comm, acc_steps=2, act="reduce", dst=dst,
                              scale_after_comm=sac, use_reduce_avg=avg)
        rec = Recorder(rank, n)
        rng = np.random.default_rng(10 * rank + len(case))
        for _ in range(2):
            for p in params:
                g = rng.standard_normal(p.data.shape).astype(np.float32)
                rec.declare(p.name, g.shape, g.dtype)
                rec.add_input(p.name, g)
                buf.add_grad(p, grad=g)
        buf.scale_grads()
        for p in params:
            rec.set_output(p.name, p.grad)
        d = os.path.join(out, case)
        rec.save(d)
        if rank == 0:
            with open(os.path.join(d, "spec.json"), "w", encoding="utf-8") as f:
                json.dump(rec.spec("reduce", average=True, dst=dst), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
