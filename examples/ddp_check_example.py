#!/usr/bin/env python
"""Check PyTorch DDP's gradient sync with ``mpifusion check``.

Two CPU processes train a small model under DistributedDataParallel (gloo) for one step of
``--acc-steps`` micro-steps (``no_sync`` on all but the last), and dump what the oracle needs:
each rank's local gradient of every micro-step (a tensor hook sees it before DDP reduces) and
the gradient DDP leaves in ``param.grad`` (the mean over ranks of the accumulated grads). The
script then runs ``mpifusion check`` on the dump and exits with its code.

    pip install torch==2.13.0      # CPU build
    python examples/ddp_check_example.py                      # PASS, exit 0
    python examples/ddp_check_example.py --corrupt fc2.weight # FAIL naming fc2.weight, exit 1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

WORLD = 2


def _model():
    import torch.nn as nn

    class Tiny(nn.Module):
        """Odd sizes on purpose, like mpifusion's tiny preset."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(17, 257)
            self.norm = nn.LayerNorm(257)
            self.fc2 = nn.Linear(257, 31)
            self.head = nn.Linear(31, 3)

        def forward(self, x):
            return self.head(self.fc2(self.norm(self.fc1(x).relu())).tanh())

    return Tiny()


def _worker(rank: int, out_dir: str, acc_steps: int, corrupt: str | None) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous",
                            rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = _model()
    ddp = DDP(model)
    local: dict = {name: [] for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: local[name].append(g.detach().clone()))
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for k in range(acc_steps):
        x = torch.randn(8, 17, generator=gen)
        y = torch.randn(8, 3, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if k < acc_steps - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    arrays = {}
    for name, p in model.named_parameters():
        for k, g in enumerate(local[name]):
            arrays[f"in/{name}/{k}"] = g.numpy()
        out = p.grad.detach().numpy().copy()
        if corrupt == name and rank == WORLD - 1:
            flat = out.reshape(-1)
            flat[flat.size // 2] += 1e-3 * max(float(np.abs(flat).max()), 1.0)
        arrays[f"out/{name}"] = out
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
    if rank == 0:
        spec = {"params": [{"name": n, "shape": list(p.shape), "dtype": "float32"}
                           for n, p in model.named_parameters()],
                "act": "all_reduce", "nranks": WORLD, "acc_steps": acc_steps,
                "average": True}  # DDP averages over ranks
        with open(os.path.join(out_dir, "spec.json"), "w", encoding="utf-8") as f:
            json.dump(spec, f, indent=1)
    dist.destroy_process_group()


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="dump folder (default: a temporary one)")
    parser.add_argument("--acc-steps", type=int, default=2, help="micro-steps (default 2)")
    parser.add_argument("--corrupt", metavar="PARAM",
                        help="perturb one element of PARAM's output on the last rank")
    parser.add_argument("--json", action="store_true", help="mpifusion check --json")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ddp-dump-") as tmp:
        out_dir = os.path.abspath(args.out or tmp)
        os.makedirs(out_dir, exist_ok=True)
        rendezvous = os.path.join(out_dir, "rendezvous")
        if os.path.exists(rendezvous):
            os.remove(rendezvous)
        mp.spawn(_worker, args=(out_dir, args.acc_steps, args.corrupt), nprocs=WORLD)
        cmd = [sys.executable, "-m", "mpifusion", "check", "--spec",
               os.path.join(out_dir, "spec.json"), out_dir] + (["--json"] if args.json else [])
        print("$ " + " ".join(cmd), flush=True)
        return subprocess.run(cmd, timeout=300).returncode


if __name__ == "__main__":
    sys.exit(main())
