"""A real peer: Paddle 3.3.1's own FusedCommBuffer on CPU ranks over gloo, captured with
mpifusion.capture.PaddleCapture. Run under ``mpiexec -n 2`` (each rank reads its rank from
the launcher). Writes ``OUT/{case}/rank{r}.npz`` + ``OUT/{case}/spec.json`` per case:

* ``ar_acc{K}_{pre|post}`` (+ ``_corrupt``): ALL_REDUCE with release_grads, K micro-steps,
  1/n applied before (scale_after_comm=False) or after the collective;
* ``ar_acc2_pre_dropped`` (+ ``_corrupt``): ``ar_acc2_pre`` where a rank-local guard in
  ``2.weight``'s backward hook drops its grad of micro-step 0 on rank 1 (zeroed before
  ``add_grad``);
* ``reduce_acc2`` (+ ``_corrupt``): REDUCE to rank 0 (gloo leaves partial sums in non-root
  buffers, so only the root's result is dumped);
* ``rs_solo_rank{r}``: a REDUCE_SCATTER buffer over a one-rank group per rank (gloo has no
  reduce_scatter), its grad slices taken as Paddle cuts them (``record_buffer_outputs``);
* ``gather`` (+ ``_corrupt``): a REDUCE_SCATTER buffer's ``sync_params`` (an all-gather).

gloo has no reduce_scatter and no AVG, so those are not run. The corrupt cases perturb one
element of ``2.weight`` (its grad; its gathered param) on the last rank (REDUCE: the root)
after the sync.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from peer_common import launcher_rank


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--nranks", type=int, default=2)
    parser.add_argument("--cases", default="", help="comma-separated all-reduce/reduce cases "
                        "to run, and nothing else (default: every case)")
    args = parser.parse_args()
    wanted = set(filter(None, args.cases.split(",")))
    rank, n = launcher_rank(), args.nranks
    eps = [f"127.0.0.1:{args.port + r}" for r in range(n)]
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(n),
                      PADDLE_TRAINER_ENDPOINTS=",".join(eps), PADDLE_CURRENT_ENDPOINT=eps[rank],
                      PADDLE_DISTRI_BACKEND="gloo", PADDLE_RANK_IN_NODE=str(rank))
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh

    from mpifusion.capture import PaddleCapture

    paddle.set_device("cpu")
    dist.init_parallel_env()
    # the helper only plans for accelerators; "gpu" gives its 256-byte alignment on the CPU
    tfh.__current_device_type__ = "gpu"
    group = dist.new_group(list(range(n)))

    def model():
        paddle.seed(0)  # same initial weights on every rank
        return paddle.nn.Sequential(paddle.nn.Linear(17, 33), paddle.nn.Tanh(),
                                    paddle.nn.Linear(33, 5))

    def corrupt(t):
        flat = t.reshape([-1])
        flat[flat.shape[0] // 2] = flat[flat.shape[0] // 2] + 1e-3

    def save(case, cap, spec):
        d = os.path.join(args.out, case)
        path = cap.save(d)
        if spec["nranks"] == 1:  # a one-rank case: the rank's own file is rank0.npz
            os.replace(path, os.path.join(d, "rank0.npz"))
        if rank == 0 or spec["nranks"] == 1:
            with open(os.path.join(d, "spec.json"), "w", encoding="utf-8") as f:
                json.dump(spec, f)

    def run(case, act, acc, scale_after_comm, bug=None):
        if wanted and case not in wanted:
            return
        layer = model()
        params = layer.parameters()
        cap = PaddleCapture(layer)  # names from named_parameters: 0.weight ... 2.bias
        kw = {"dst": 0} if act == tfh.HOOK_ACTION.REDUCE else {}
        buf = tfh.FusedCommBuffer(0, params, group, acc_steps=acc, act=act, release_grads=True,
                                  scale_after_comm=scale_after_comm, **kw)
        step = [0]
        for p in params:  # what Paddle's sharding/pp code registers: add_grad after backward
            hook = tfh.bw_hook_func(buf, p)
            if bug == "dropped" and p is params[2]:
                hook = guarded(hook, p, step)
            p._register_backward_hook(hook)
        gen = np.random.default_rng(100 + rank)
        for k in range(acc):
            step[0] = k
            x = paddle.to_tensor(gen.standard_normal((8, 17)).astype("float32"))
            (layer(x) ** 2).mean().backward()
        buf.scale_grads()
        # gloo's reduce overwrites part of a non-root rank's buffer with partial sums (NCCL's
        # leaves it as Paddle's rule says), so only the root's result is dumped here
        on_root = not kw or rank == kw["dst"]
        if on_root:
            cap.record_outputs()
        spec = cap.spec("reduce" if kw else "all_reduce", average=True, **kw)
        save(case, cap, spec)
        if rank == kw.get("dst", n - 1):  # the last rank; the root of REDUCE
            corrupt(params[2].grad)  # 2.weight
        if on_root:
            cap.record_outputs()
        save(case + "_corrupt", cap, spec)

    def guarded(hook, p, step):
        """The hook behind a rank-local guard that drops 2.weight's grad of micro-step 0 on
        rank 1 (zeroed in place before add_grad copies it into the buffer: skipping add_grad
        itself would leave the buffer one check-in short, and the other ranks waiting)."""
        def fused_comm(*a):
            if rank == 1 and step[0] == 0:
                with paddle.no_grad():
                    p.grad.zero_()
            return hook(*a)
        return fused_comm

    for acc in (1, 2, 3):
        for sac in (False, True):
            run(f"ar_acc{acc}_{'post' if sac else 'pre'}", tfh.HOOK_ACTION.ALL_REDUCE, acc, sac)
    run("ar_acc2_pre_dropped", tfh.HOOK_ACTION.ALL_REDUCE, 2, False, bug="dropped")
    run("reduce_acc2", tfh.HOOK_ACTION.REDUCE, 2, False)
    if wanted:  # only the named all-reduce / reduce cases
        print(f"rank {rank}: done", flush=True)
        return 0

    # REDUCE_SCATTER outputs cut as Paddle cuts them: gloo has no reduce_scatter, so each rank
    # runs a buffer over a group of its own (one rank: nothing to send) and dumps its slices
    solo = [dist.new_group([r]) for r in range(n)][rank]
    layer = model()
    params = layer.parameters()
    buf = tfh.FusedCommBuffer(0, params, solo, acc_steps=2, act=tfh.HOOK_ACTION.REDUCE_SCATTER)
    for p in params:
        p._register_backward_hook(lambda *_, p=p: buf.add_grad(p, use_comm=False))
    cap = PaddleCapture(layer)
    gen = np.random.default_rng(200 + rank)
    for _ in range(2):
        x = paddle.to_tensor(gen.standard_normal((8, 17)).astype("float32"))
        (layer(x) ** 2).mean().backward()
    buf.scale_grads()
    cap.record_buffer_outputs(buf)
    save(f"rs_solo_rank{rank}", cap, cap.spec("reduce_scatter", average=False, nranks=1))

    # sync_params of a REDUCE_SCATTER buffer: each rank writes new values into its shard
    layer = model()
    params = layer.parameters()
    buf = tfh.FusedCommBuffer(0, params, group, act=tfh.HOOK_ACTION.REDUCE_SCATTER)
    size = buf.param_storage._numel() // n
    buf.param_storage._slice(rank * size, (rank + 1) * size).scale_(1.0 + rank)  # "a step"
    cap = PaddleCapture(layer)
    cap.record_buffer_shards(buf)
    buf.sync_params()
    cap.record_params()
    spec = cap.spec("reduce_scatter", average=True)
    save("gather", cap, spec)
    if rank == n - 1:
        corrupt(params[2])
    cap.record_params()
    save("gather_corrupt", cap, spec)
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
