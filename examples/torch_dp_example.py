#!/usr/bin/env python
"""Data-parallel PyTorch training with mpifusion in place of DDP, checked against one process.

Run:  mpiexec -n 2 python -m mpi4py examples/torch_dp_example.py

Every rank holds the same small MLP. Its parameters are moved into mpifusion's fused param
buffers and its ``.grad`` tensors are DLPack views of the fused grad buffers, so autograd
accumulates straight into the buckets (DDP's ``gradient_as_bucket_view``). A post-accumulate
hook per parameter calls ``add_grad`` -- the emulated backward hook -- and the buffer starts
its all-reduce as soon as the last parameter of the bucket has its grad. ``scale_grads``
waits and averages; the optimizer then steps on the fused params in place.

Each rank trains on its own slice of every global batch. Rank-averaged grads of equal-sized
slices are the grads of the mean loss over the concatenated batch, so every step must match
one process training on that batch, up to fp32 rounding (summing in another order). The
script prints the loss curve of both and exits 1 when the curves or final weights differ by
more than ``--rtol``/``--atol``.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Tuple

import numpy as np
import torch
from mpi4py import MPI

import mpifusion
from mpifusion import FusedCommBuffer, Param, assign_group_by_size, to_torch


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 1),
    )


def make_data(steps: int, global_batch: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same regression data set on every rank: ``steps`` global batches."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(steps, global_batch, 16, generator=gen)
    w = 0.3 * torch.randn(16, 1, generator=gen)
    y = torch.sin(x @ w) + 0.1 * torch.randn(steps, global_batch, 1, generator=gen)
    return x, y


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def fuse(model: torch.nn.Module, comm: MPI.Comm, group_bytes: int) -> List[FusedCommBuffer]:
    """Move the model's params and grads into fused buffers; wire the backward hooks."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [Param(n, p.detach()) for n, p in named]  # shares memory, no copy yet
    by_name = dict(named)
    buffers = []
    for group_id, group in assign_group_by_size(params, group_bytes).items():
        buf = FusedCommBuffer(group_id, group, comm, act="all_reduce", fuse_param=True)
        for mp in group:
            tp = by_name[mp.name]
            # the torch parameter now lives in the fused param buffer ...
            tp.data = to_torch(mp.data)
            # ... and its grad is a view of the fused grad buffer that autograd accumulates into
            tp.grad = to_torch(mp.grad)
            tp.register_post_accumulate_grad_hook(lambda _t, b=buf, m=mp: b.add_grad(m))
        buffers.append(buf)
    return buffers


def train_data_parallel(args, comm: MPI.Comm, x, y) -> Tuple[List[float], torch.nn.Module, int]:
    rank, size = comm.Get_rank(), comm.Get_size()
    local = args.batch_per_rank
    model = make_model(args.seed)
    buffers = fuse(model, comm, args.group_bytes)
    opt = make_optimizer(model, args.lr)
    losses = []
    for step in range(args.steps):
        xs = x[step, rank * local:(rank + 1) * local]
        ys = y[step, rank * local:(rank + 1) * local]
        for buf in buffers:  # zero the buckets in place (set_to_none would drop the views)
            buf.grad_storage[...] = 0
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()      # hooks check every param in; each bucket all-reduces when full
        for buf in buffers:
            buf.scale_grads()  # wait, average over ranks
        opt.step()
        losses.append(comm.allreduce(loss.item(), op=MPI.SUM) / size)
    return losses, model, len(buffers)


def train_single(args, x, y) -> Tuple[List[float], torch.nn.Module]:
    model = make_model(args.seed)
    opt = make_optimizer(model, args.lr)
    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[step]), y[step])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-per-rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-bytes", type=int, default=8192,
                        help="bucket size limit in bytes (small, so the model spans buckets)")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--atol", type=float, default=1e-6)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # ranks share the cores

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = make_data(args.steps, args.batch_per_rank * size, args.seed)
    dp_losses, dp_model, nbuf = train_data_parallel(args, comm, x, y)
    ref_losses, ref_model = train_single(args, x, y)

    loss_err = max(abs(a - b) - args.rtol * abs(b) for a, b in zip(dp_losses, ref_losses))
    weight_errs = {}
    for (name, p), (_, q) in zip(dp_model.named_parameters(), ref_model.named_parameters()):
        a, b = p.detach().numpy().astype(np.float64), q.detach().numpy().astype(np.float64)
        weight_errs[name] = float(np.max(np.abs(a - b) - args.rtol * np.abs(b)))
    ok = loss_err <= args.atol and max(weight_errs.values()) <= args.atol
    # every rank must agree with the reference (and so with each other)
    ok_all = comm.allreduce(int(ok), op=MPI.MIN) == 1

    if rank == 0:
        print(f"mpifusion {mpifusion.__version__}, torch {torch.__version__}: {size} rank(s), "
              f"{nbuf} fused buffer(s), global batch {args.batch_per_rank * size}")
        print(f"{'step':>4}  {'data-parallel loss':>20}  {'single-process loss':>20}  {'|diff|':>9}")
        for i, (a, b) in enumerate(zip(dp_losses, ref_losses)):
            print(f"{i:>4}  {a:>20.9f}  {b:>20.9f}  {abs(a - b):>9.2e}")
        print("final weights, max |dp - single| - rtol*|single| per tensor:")
        for name, err in weight_errs.items():
            print(f"  {name:<12} {err:+.2e}")
        verdict = "EQUAL" if ok_all else "DIFFERENT"
        print(f"{verdict} to single-process training (rtol={args.rtol:g}, atol={args.atol:g})")
        sys.stdout.flush()
    # under python -m mpi4py a rank that exits non-zero aborts the job at once: every rank
    # waits here until rank 0 has printed, so that the abort cannot cut its report short
    comm.Barrier()
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
