"""Real PyTorch peers on CPU ranks over gloo, captured with mpifusion.capture.TorchCapture.
Run under ``mpiexec -n N`` (each rank reads its rank from the launcher). Writes
``OUT/{case}/rank{r}.npz`` + ``OUT/{case}/spec.json`` per case:

* ``fsdp2_acc{K}`` (+ ``_corrupt``): FSDP2 (``fully_shard`` per layer and at the root, dim-0
  shards of uneven size), K micro-steps (``set_requires_gradient_sync(False)`` on all but
  the last); outputs are each rank's grad shard with its ``range/``; the capture also records
  FSDP2's param all-gather (``shard/`` before, ``param/`` after, every forward);
* ``ddp_acc2`` (+ ``_corrupt``): DDP, two micro-steps (``no_sync`` on the first).

The corrupt cases perturb one element of ``fc2.weight``'s grad on the last rank after the
sync (for FSDP2, in the rank's shard; pick a rank that holds rows of it).
"""
from __future__ import annotations

import argparse
import gc
import os

from peer_common import (init_gloo, launcher_rank, run_and_exit, save_case,
                         tiny_model_class)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--nranks", type=int, default=2)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    from torch import nn

    from mpifusion.capture import TorchCapture

    rank, n = launcher_rank(), args.nranks
    init_gloo(args.out, rank, n)

    Tiny = tiny_model_class()

    def save(case, cap, spec):
        save_case(args.out, case, cap, spec, rank)

    def corrupt(grad):
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        flat = local.view(-1)
        if flat.numel():
            flat[flat.numel() // 2] += 1e-3

    def steps(model, acc, between):
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
        for k in range(acc):
            x, y = torch.randn(8, 17, generator=gen), torch.randn(8, 3, generator=gen)
            with between(k < acc - 1):
                torch.nn.functional.mse_loss(model(x), y).backward()

    from contextlib import contextmanager, nullcontext

    for acc in (1, 2):
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = Tiny()
        for layer in (model.fc1, model.norm, model.fc2, model.head):
            fully_shard(layer)
        fully_shard(model)
        cap = TorchCapture(model, gather=True)

        @contextmanager
        def sync_last(skip):
            model.set_requires_gradient_sync(not skip)
            yield

        steps(model, acc, sync_last)
        cap.record_outputs()
        spec = cap.spec("reduce_scatter", average=True)  # FSDP2 averages over ranks
        save(f"fsdp2_acc{acc}", cap, spec)
        records = cap.gather(dst=0)  # every rank's record, in memory, on rank 0
        if rank == 0 and acc == 2:
            from mpifusion.oracle import check

            verdict = "PASS" if check(spec, records).ok else "FAIL"
            with open(os.path.join(args.out, f"fsdp2_acc{acc}", "in_memory.txt"), "w") as f:
                f.write(verdict + "\n")
        if rank == n - 1:
            corrupt(model.fc2.weight.grad)
        cap.record_outputs()
        save(f"fsdp2_acc{acc}_corrupt", cap, spec)

    torch.manual_seed(0)
    inner = Tiny()
    ddp = nn.parallel.DistributedDataParallel(inner)
    cap = TorchCapture(ddp)
    steps(ddp, 2, lambda skip: ddp.no_sync() if skip else nullcontext())
    cap.record_outputs()
    spec = cap.spec("all_reduce", average=True)  # DDP averages over ranks
    save("ddp_acc2", cap, spec)
    if rank == n - 1:
        corrupt(inner.fc2.weight.grad)
    cap.record_outputs()
    save("ddp_acc2_corrupt", cap, spec)
    # FSDP2's reference cycles would keep gloo's threads alive into interpreter exit, which
    # aborts now and then (as in the README's FSDP2 example)
    del model, cap, ddp, inner
    gc.collect()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    run_and_exit(main)
