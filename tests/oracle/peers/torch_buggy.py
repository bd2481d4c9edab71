"""Real PyTorch peers on CPU ranks over gloo, each run as written and with a bug put in the
way users put it in (in the peer's own code path; no output is edited afterwards), captured
with mpifusion.capture.TorchCapture. Run under ``mpiexec -n 2`` (each rank reads its rank
from the launcher). Writes ``OUT/{case}/rank{r}.npz`` + ``OUT/{case}/spec.json`` per case;
every case reduces two micro-steps and declares the mean over ranks:

* ``ddp``: DDP, ``no_sync`` on the first micro-step;
  ``ddp_hook_sum``: a ``register_comm_hook`` that all-reduces the bucket without dividing;
  ``ddp_no_sync_all``: every micro-step under ``no_sync``, the last one included;
* ``loop``: a hand-written loop (``all_reduce`` then ``/= world`` per grad);
  ``loop_divide_twice``: the caller divides again after the loop's helper did;
  ``loop_reduce``: ``dist.reduce`` to rank 0 where an all-reduce was meant, every rank
  keeping what gloo left in its buffer (non-root ranks: partial sums);
  ``loop_bf16``: the sum done in bfloat16 (``g.to(bfloat16)``, all-reduce, back);
* ``hooks``: a reducer whose tensor hooks add each micro-step's grad into its own buffers,
  all-reduced after the last; ``hooks_twice``: rank 1 registers ``fc2``'s hooks again before
  the second micro-step (a layer re-attached on that rank only);
* ``flat``: a flat-buffer reducer laid out as Paddle lays buffers out (each param at a
  256-byte aligned offset: the spec's plan), one all-reduce per buffer, the params' grads
  then read back as views; ``flat_packed``: the views forget the alignment padding;
  ``flat_reversed``: the views walk the two equal middle blocks in backward order;
* ``fsdp2``: FSDP2 (dim-0 shards with ``range/``, ``set_requires_gradient_sync(False)`` on
  the first micro-step); ``fsdp2_divide_factor``: ``set_gradient_divide_factor(world *
  micro-steps)`` on every FSDP module (the mean over micro-steps too; with
  ``set_force_sum_reduction_for_comms``, since gloo has no PREMUL_SUM).
"""
from __future__ import annotations

import gc
from contextlib import nullcontext

from peer_common import (init_gloo, launcher_rank, peer_parser, run_and_exit, save_case,
                         tiny_model_class)

ACC = 2  # micro-steps of every case


def main() -> int:
    parser = peer_parser()
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    from torch import nn

    from mpifusion.capture import TorchCapture

    rank, world = launcher_rank(), args.nranks
    init_gloo(args.out, rank, world)

    Tiny = tiny_model_class()

    class Blocks(nn.Module):
        """Two middle blocks of one shape, between a stem and a head of other shapes."""

        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(17, 33)
            self.blocks = nn.ModuleList([nn.Linear(33, 33), nn.Linear(33, 33)])
            self.head = nn.Linear(33, 3)

        def forward(self, x):
            h = self.stem(x).tanh()
            for b in self.blocks:
                h = b(h).tanh()
            return self.head(h)

    def fresh(cls):
        torch.manual_seed(0)  # same initial weights on every rank
        return cls()

    def save(case, cap, spec):
        save_case(args.out, case, cap, spec, rank)

    def backward(model, k):
        """Micro-step ``k``'s forward and backward on this rank's own data (17 in, 3 out)."""
        gen = torch.Generator().manual_seed(1000 + 10 * rank + k)
        x, y = torch.randn(8, 17, generator=gen), torch.randn(8, 3, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()

    wanted = set(filter(None, args.cases.split(",")))

    def run(name):
        return not wanted or name in wanted

    # ------------------------------------------------------------------ DDP
    def ddp_case(case, bug=None):
        inner = fresh(Tiny)
        ddp = nn.parallel.DistributedDataParallel(inner)
        cap = TorchCapture(ddp)
        if bug == "hook_sum":
            def allreduce_sum(state, bucket):  # torch's allreduce_hook without its divide
                fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])
            ddp.register_comm_hook(None, allreduce_sum)
        for k in range(ACC):
            last = k == ACC - 1
            with ddp.no_sync() if (not last or bug == "no_sync_all") else nullcontext():
                backward(ddp, k)
        cap.record_outputs()
        save(case, cap, cap.spec("all_reduce", average=True))

    if run("ddp"):
        ddp_case("ddp")
    if run("ddp_hook_sum"):
        ddp_case("ddp_hook_sum", "hook_sum")
    if run("ddp_no_sync_all"):
        ddp_case("ddp_no_sync_all", "no_sync_all")

    # ------------------------------------------------------------------ hand-written loops
    def average_gradients(model):
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world

    def loop_case(case, bug=None):
        model = fresh(Tiny)
        cap = TorchCapture(model)
        for k in range(ACC):
            backward(model, k)  # grads accumulate in .grad
        if bug is None:
            average_gradients(model)
        elif bug == "divide_twice":
            average_gradients(model)
            for p in model.parameters():  # "the mean over ranks" once more
                p.grad /= world
        elif bug == "reduce":
            for p in model.parameters():  # reduce where an all-reduce was meant
                dist.reduce(p.grad, dst=0, op=dist.ReduceOp.SUM)
                p.grad /= world
        elif bug == "bf16":
            for p in model.parameters():  # "halves the bytes on the wire"
                half = p.grad.to(torch.bfloat16)
                dist.all_reduce(half)
                p.grad.copy_(half.to(torch.float32) / world)
        cap.record_outputs()
        save(case, cap, cap.spec("all_reduce", average=True))

    for case, bug in (("loop", None), ("loop_divide_twice", "divide_twice"),
                      ("loop_reduce", "reduce"), ("loop_bf16", "bf16")):
        if run(case):
            loop_case(case, bug)

    # ------------------------------------------------------------------ hook reducer
    def hooks_case(case, bug=None):
        model = fresh(Tiny)
        cap = TorchCapture(model)  # before the reducer's hooks: it records the local grads
        acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}

        def attach(module, prefix):
            for local, p in module.named_parameters():
                name = f"{prefix}.{local}" if prefix else local

                def add(g, name=name):  # returns None: autograd's grad stays as it was
                    acc[name].add_(g)
                p.register_hook(add)

        attach(model, "")
        for k in range(ACC):
            if bug == "twice" and rank == 1 and k == 1:
                attach(model.fc2, "fc2")  # re-attached on this rank only
            backward(model, k)
        for n, p in model.named_parameters():
            dist.all_reduce(acc[n])
            p.grad = acc[n] / world
        cap.record_outputs()
        save(case, cap, cap.spec("all_reduce", average=True))

    if run("hooks"):
        hooks_case("hooks")
    if run("hooks_twice"):
        hooks_case("hooks_twice", "twice")

    # ------------------------------------------------------------------ flat buffers
    def flat_case(case, bug=None):
        from mpifusion.spec import Spec

        model = fresh(Blocks)
        cap = TorchCapture(model)
        for k in range(ACC):
            backward(model, k)
        spec = cap.spec("all_reduce", average=True)
        params = dict(model.named_parameters())
        for planned in Spec.from_dict(spec).plan(world):  # Paddle's buffers and offsets
            layout = planned.layout
            flat = torch.zeros(layout.numel, dtype=torch.float32)
            for slot in layout.slots:  # flatten at the aligned offsets
                flat[slot.offset:slot.offset + slot.numel] = params[slot.name].grad.reshape(-1)
            dist.all_reduce(flat)
            flat /= world
            # where each param's grad is read back from
            views, packed = {}, 0
            for slot in layout.slots:
                views[slot.name] = packed if bug == "packed" else slot.offset
                packed += slot.numel  # (the alignment padding forgotten)
            names = [s.name for s in layout.slots]
            if bug == "reversed":  # the blocks walked as backward walks them
                blocks = [n for n in names if n.startswith("blocks.")]
                order = sorted(blocks, key=lambda n: -int(n.split(".")[1]))
                it = iter(order)
                names = [next(it) if n.startswith("blocks.") else n for n in names]
            for slot, name in zip(layout.slots, names):
                p = params[name]
                at = views[slot.name]
                p.grad = flat[at:at + p.numel()].view(p.shape).clone()
        cap.record_outputs()
        save(case, cap, spec)

    for case, bug in (("flat", None), ("flat_packed", "packed"), ("flat_reversed", "reversed")):
        if run(case):
            flat_case(case, bug)

    # ------------------------------------------------------------------ FSDP2
    def fsdp2_case(case, bug=None):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        model = fresh(Tiny)
        for layer in (model.fc1, model.norm, model.fc2, model.head):
            fully_shard(layer)
        fully_shard(model)
        if bug == "divide_factor":
            for m in model.modules():  # "the mean over the micro-steps as well"
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(float(world * ACC))
                    # gloo has no PREMUL_SUM: a SUM, then FSDP2 divides by the factor
                    m.set_force_sum_reduction_for_comms(True)
        cap = TorchCapture(model)
        for k in range(ACC):
            model.set_requires_gradient_sync(k == ACC - 1)
            backward(model, k)
        cap.record_outputs()
        save(case, cap, cap.spec("reduce_scatter", average=True))  # FSDP2: the mean
        del cap, model
        gc.collect()

    if run("fsdp2"):
        fsdp2_case("fsdp2")
    if run("fsdp2_divide_factor"):
        fsdp2_case("fsdp2_divide_factor", "divide_factor")

    gc.collect()  # FSDP2's reference cycles would keep gloo's threads alive into exit
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    run_and_exit(main)
