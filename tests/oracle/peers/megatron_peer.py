"""Megatron-core's ``DistributedDataParallel`` (its ``ParamAndGradBuffer``) on CPU ranks over
gloo, run as written and with a bug put in the way a Megatron user puts it in (in the peer's
own code path: a config flag, a call, a bucket group's communication overridden; no output is
edited afterwards), captured with ``mpifusion.capture.TorchCapture(model, attr="main_grad")``.
Run under ``mpiexec -n 2`` (each rank reads its rank from the launcher)::

    mpiexec -n 2 python megatron_peer.py OUT [--cases a,b]

Every case trains peer_common's ``Tiny`` (fp32) for 2 steps of 2 micro-steps (``no_sync`` on
the first), ``zero_grad_buffer()`` at the start of each step and ``finish_grad_sync()`` after
the last micro-step, in 3 buckets (``bucket_size=500``: ``fc2`` + ``head``, ``norm``,
``fc1``; Megatron lays the params out in reverse, so ``head.bias`` is the buffer's first) with
``overlap_grad_reduce=True``. Megatron's first step launches the collectives from
``finish_grad_sync``, the second from the backward hooks as each bucket fills: both steps are
checked (``cap.step(k)``: ``OUT/{case}/step{k}/rank{r}.npz``, plus ``OUT/{case}/spec.json``).
Megatron pre-scales each bucket by ``1/world`` and sums: the spec declares the mean.

* ``megatron``: as written;
  ``megatron_per_token_loss``: ``TransformerConfig(calculate_per_token_loss=True)`` with the
  loss still the per-rank mean and nothing dividing by the token count afterwards (Megatron
  then scales by 1: the sum over ranks);
  ``megatron_scale_after``: ``model.scale_gradients(0.5)`` after the sync;
  ``megatron_bucket_copy``: bucket 0's communication overridden to all-reduce a staging copy
  of the bucket (``grad_data.clone()``), never copied back (each rank keeps its own grads,
  pre-scaled by 1/world);
  ``megatron_bf16_bucket``: bucket 0 all-reduced through a bfloat16 copy, copied back;
  ``megatron_rank1_zeroes``: rank 1 zeroes its buckets right before they are reduced (a
  batch "skipped" on that rank alone; the mean still divides by 2);
  ``megatron_zero_between``: ``zero_grad_buffer()`` between the micro-steps too;
  ``megatron_views_early``: after the sync, each param's ``main_grad`` re-pointed one element
  early in the buffer (``grad_data[start - 1:end - 1]``; ``head.bias``, at the buffer's start,
  has nothing before it and keeps its view), put back before the next step;
  ``megatron_param_twice``: ``head.weight`` (in bucket 0) all-reduced once more with bucket
  0's all-reduce;
* the distributed optimizer (``use_distributed_optimizer=True``: Megatron reduce-scatters
  each bucket, and each rank keeps the reduced shard of every bucket: its pieces of the
  params' ``main_grad``, recorded with their ``range/`` in the flattened param, as
  Megatron's ``DistributedOptimizer`` cuts them; ``act: reduce_scatter``):
  ``megatron_distopt`` as written, ``megatron_distopt_per_token_loss``,
  ``megatron_distopt_bucket_copy`` (the reduce-scatter into the staging copy's shard) and
  ``megatron_distopt_rank1_zeroes``, the bugs as above.

CPU: megatron-core allocates ``grad_data`` on ``torch.cuda.current_device()``, so this
process (only) sets ``torch.cuda.current_device = lambda: "cpu"`` (all 0.16.1 needs); newer
releases' ``start_grad_sync`` (0.19.2 at least) also calls ``torch.cuda.current_stream()``
unconditionally, which gets a dummy stream here when there is no CUDA.
``parallel_state.initialize_model_parallel()`` runs on the default (gloo) group.
"""
from __future__ import annotations

import gc
from contextlib import nullcontext

from peer_common import (init_gloo, launcher_rank, peer_parser, run_and_exit, save_case,
                         tiny_model_class)

ACC = 2      # micro-steps per training step
STEPS = 2    # training steps (Megatron's first takes another code path)
BUCKET = 500  # elements: 3 buckets of Tiny (fc2 + head, norm, fc1)

CASES = {  # case -> (bug, distributed optimizer)
    "megatron": (None, False),
    "megatron_per_token_loss": ("per_token_loss", False),
    "megatron_scale_after": ("scale_after", False),
    "megatron_bucket_copy": ("bucket_copy", False),
    "megatron_bf16_bucket": ("bf16_bucket", False),
    "megatron_rank1_zeroes": ("rank1_zeroes", False),
    "megatron_zero_between": ("zero_between", False),
    "megatron_views_early": ("views_early", False),
    "megatron_param_twice": ("param_twice", False),
    "megatron_distopt": (None, True),
    "megatron_distopt_per_token_loss": ("per_token_loss", True),
    "megatron_distopt_bucket_copy": ("bucket_copy", True),
    "megatron_distopt_rank1_zeroes": ("rank1_zeroes", True),
}


def cpu_patches() -> None:
    """What megatron-core needs to run its DDP on CPU tensors (this process only)."""
    import torch

    torch.cuda.current_device = lambda: "cpu"  # grad_data (and param_data) allocated there
    if not torch.cuda.is_available():
        class _Stream:  # newer start_grad_sync asks for it whatever the device
            def wait_stream(self, other):
                pass

            def synchronize(self):
                pass

        torch.cuda.current_stream = lambda device=None: _Stream()


class _Handles:
    """The handle Megatron waits on in ``finish_grad_sync``: the user's collectives, then
    what the user does once they are done (``after``)."""

    def __init__(self, works, after=None):
        self.works, self.after = works, after

    def wait(self):
        for w in self.works:
            if w is not None:
                w.wait()
        if self.after is not None:
            self.after()


def override_grad_sync(group, communicate):
    """A user's own communication for one bucket group: its ``start_grad_sync`` replaced by a
    copy of Megatron's (the same guards, the pre-scaling by ``gradient_scaling_factor``, the
    all-reduce, or with the distributed optimizer the reduce-scatter into this rank's shard)
    in which ``communicate(bucket, shard_or_None)`` launches the collective and returns
    ``(works, after)``."""
    def start_grad_sync(force_all_reduce=False):
        if group.is_first_batch and group.grad_reduce_handle is not None:
            return
        assert group.grad_reduce_handle is None, "one communication outstanding at a time"
        for bucket in group.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        works, afters = [], []
        for bucket in group.buckets:
            shard = None
            if group.ddp_config.use_distributed_optimizer and not force_all_reduce:
                size = group.intra_distributed_optimizer_instance_size
                n = bucket.grad_data.numel() // size
                r = group.intra_distributed_optimizer_instance_rank
                shard = (r * n, (r + 1) * n)
            w, after = communicate(bucket, shard)
            works += w
            if after is not None:
                afters.append(after)
        group.grad_reduce_handle = _Handles(
            works, (lambda: [a() for a in afters]) if afters else None)

    group.start_grad_sync = start_grad_sync  # Megatron calls self.start_grad_sync(...)


def main() -> int:
    parser = peer_parser()
    args = parser.parse_args()
    wanted = [c for c in args.cases.split(",") if c] or list(CASES)
    unknown = [c for c in wanted if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown} (known: {', '.join(CASES)})")

    import torch
    import torch.distributed as dist

    cpu_patches()
    rank, world = launcher_rank(), args.nranks
    init_gloo(args.out, rank, world)

    import warnings

    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.transformer.transformer_config import TransformerConfig

    from mpifusion.capture import TorchCapture

    parallel_state.initialize_model_parallel()  # TP = PP = 1: data parallel over all ranks
    Tiny = tiny_model_class()

    def backward(model, step, k):
        """Micro-step ``k`` of step ``step``: forward and backward on this rank's own data."""
        gen = torch.Generator().manual_seed(1000 + 100 * step + 10 * rank + k)
        x, y = torch.randn(8, 17, generator=gen), torch.randn(8, 3, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()

    def pieces(model):
        """name -> (begin, end) of each param's piece in this rank's shard of its bucket, in
        the flattened param (as the DistributedOptimizer's param ranges cut them)."""
        out = {}
        names = {p: n for n, p in model.module.named_parameters()}
        for buf in model.buffers:
            for bucket in buf.buckets:
                n = bucket.grad_data.numel() // world
                lo_s, hi_s = bucket.offset + rank * n, bucket.offset + (rank + 1) * n
                for p in bucket.params_list:
                    start, end, _ = buf.param_index_map[p]
                    lo, hi = max(start, lo_s), min(end, hi_s)
                    if lo < hi:
                        out[names[p]] = (lo - start, hi - start)
        return out

    def run_case(case):
        bug, distopt = CASES[case]
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                   calculate_per_token_loss=bug == "per_token_loss")
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=True, bucket_size=BUCKET, use_distributed_optimizer=distopt)
        torch.manual_seed(0)  # the same initial weights on every rank
        model = DistributedDataParallel(config, ddp_config, Tiny())
        groups = model.bucket_groups
        assert len(groups) == 3 and all(len(g.buckets) == 1 for g in groups), \
            [[len(b.params_list) for b in g.buckets] for g in groups]
        cap = TorchCapture(model, attr="main_grad")
        params = dict(model.module.named_parameters())

        # ---------------------------------------------------------------- the bugs' code
        if bug in ("bucket_copy", "bf16_bucket", "param_twice"):
            def communicate(bucket, shard):
                if bug == "param_twice":  # the tied weight reduced with the bucket too
                    def again():
                        dist.all_reduce(params["head.weight"].main_grad)
                    return [dist.all_reduce(bucket.grad_data, async_op=True)], again
                staged = bucket.grad_data.to(torch.bfloat16) if bug == "bf16_bucket" \
                    else bucket.grad_data.clone()  # a staging copy to communicate from
                if shard is None:
                    work = dist.all_reduce(staged, async_op=True)
                else:
                    work = dist.reduce_scatter_tensor(staged[shard[0]:shard[1]], staged,
                                                      async_op=True)
                if bug == "bucket_copy":
                    return [work], None  # the result stays in the copy
                lo, hi = shard or (0, staged.numel())

                def copy_back():
                    bucket.grad_data[lo:hi].copy_(staged[lo:hi])
                return [work], copy_back
            override_grad_sync(groups[0], communicate)
        if bug == "rank1_zeroes" and rank == 1:
            for group in groups:
                def zero_then_sync(force_all_reduce=False, group=group,
                                   sync=group.start_grad_sync):
                    for bucket in group.buckets:  # this rank's batch "skipped"
                        bucket.grad_data.zero_()
                    sync(force_all_reduce)
                group.start_grad_sync = zero_then_sync

        # ---------------------------------------------------------------- training
        for step in range(STEPS):
            cap.step(step)
            model.zero_grad_buffer()
            for k in range(ACC):
                if bug == "zero_between" and k > 0:
                    model.zero_grad_buffer()
                with model.no_sync() if k < ACC - 1 else nullcontext():
                    backward(model, step, k)
            model.finish_grad_sync()
            if bug == "scale_after":
                model.scale_gradients(0.5)
            kept = {}
            if bug == "views_early":  # the grads read through views one element early
                for buf in model.buffers:
                    for p, (start, end, _) in buf.param_index_map.items():
                        if start > 0:
                            kept[p] = p.main_grad
                            p.main_grad = buf.grad_data[start - 1:end - 1].view(p.shape)
            if distopt:
                for name, (a, b) in pieces(model).items():
                    cap.set_output(name, params[name].main_grad.detach().reshape(-1)[a:b]
                                   .numpy(), (a, b))
            else:
                cap.record_outputs()
            for p, view in kept.items():
                p.main_grad = view
            save_case(args.out, case, cap,
                      cap.spec("reduce_scatter" if distopt else "all_reduce", average=True),
                      rank)
        cap.remove()
        del cap, model
        gc.collect()

    for case in wanted:
        run_case(case)

    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    run_and_exit(main)
