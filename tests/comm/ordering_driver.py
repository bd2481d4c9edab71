"""Driver of tests/comm/test_engine_order.py: one job, argv = scenario [strategy].

Scenarios that must end well print ``rank R: <check> ok`` per check; the others print what
they caught. Values are dyadic, so sums over <= 8 ranks are exact in fp32 and every result
is compared with a float64 reference computed here.
"""
import os
import random
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from mpifusion import FusedCommBuffer, Param
from mpifusion.comm import live_private_comms, release
from mpifusion.config import CommOptions
from mpifusion.errors import (AbandonedError, AgreementError, CommTimeoutError, GradError,
                              OrderError)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
scenario = sys.argv[1]
strategy = sys.argv[2] if len(sys.argv) > 2 else None


def say(text):
    print(f"rank {rank}: {text}", flush=True)


def value(r, step, i, k):
    """Rank r's grad for param i at step/micro-step k: small dyadic numbers."""
    return ((r * 7 + step * 3 + i * 5 + k) % 13 + 1) * 0.25


def ref_mean(step, i, acc=1):
    return sum(value(r, step, i, k) for r in range(size) for k in range(acc)) / size


def opts(**kw):
    return CommOptions.from_env(strategy=strategy, **kw)


def make(bid, shapes, comm=world, tag="p", **kw):
    params = [Param(f"{tag}{bid}_{j}", np.zeros(s, np.float32)) for j, s in enumerate(shapes)]
    kw.setdefault("comm_options", opts())
    return FusedCommBuffer(bid, params, comm, act="all_reduce", **kw), params


def feed(buf, params, step, i, acc=1):
    for k in range(acc):
        for p in params:
            buf.add_grad(p, grad=np.full(p.shape, value(rank, step, i, k), np.float32))


def check(params, step, i, what, acc=1):
    want = ref_mean(step, i, acc)
    for p in params:
        wrong = ~np.isclose(p.grad.astype(np.float64), want, rtol=1e-6, atol=0)
        if wrong.any():
            sys.exit(f"rank {rank}: {what}: wrong result {p.grad[wrong].ravel()[0]} in "
                     f"{int(wrong.sum())} of {wrong.size} elements (expected {want})")


def order_mismatch(sizes, label):
    """Rank 0 finishes buffer 1 first, the others buffer 0: OrderError everywhere, nothing
    changed, and after reset() the same buffers work in the right order."""
    a, pa = make(0, [(sizes[0],)], tag=label + "a")
    b, pb = make(1, [(sizes[1],)], tag=label + "b")
    first, second = ((b, pb, 1), (a, pa, 0)) if rank == 0 else ((a, pa, 0), (b, pb, 1))
    for buf, ps, i in (first, second):
        feed(buf, ps, 0, i)
    caught = []
    for buf in (a, b):
        try:
            buf.scale_grads()
        except OrderError as exc:
            caught.append(str(exc))
    if len(caught) != 2:
        sys.exit(f"rank {rank}: {label}: expected an OrderError from both buffers, got {caught}")
    for text in ("ranks started different collectives", "buffer 0", "buffer 1",
                 "order='negotiated'", "no grad changed"):
        if text not in caught[0]:
            sys.exit(f"rank {rank}: {label}: {text!r} not in {caught[0]!r}")
    for ps, i in ((pa, 0), (pb, 1)):  # untouched: still this rank's own grads
        if not np.all(ps[0].grad == value(rank, 0, i, 0)):
            sys.exit(f"rank {rank}: {label}: grads changed by a refused collective")
    for buf in (a, b):
        buf.reset(zero_grads=True)
    for buf, ps, i in ((a, pa, 0), (b, pb, 1)):
        feed(buf, ps, 0, i)
    a.scale_grads()
    b.scale_grads()
    check(pa, 0, 0, label)
    check(pb, 0, 1, label)
    say(f"{label} ok: {caught[0]}")


def order_mismatch_free_grads():
    """The same with a free_grads_in_comm REDUCE_SCATTER buffer: after the OrderError,
    reset() gives the full local grads back (not the shard that got no result)."""
    a, pa = make(0, [(40,)], tag="fa")
    rp = [Param("fr0", np.zeros((30,), np.float32)), Param("fr1", np.zeros((9,), np.float32))]
    rs = FusedCommBuffer(1, rp, world, act="reduce_scatter", release_grads=True,
                         free_grads_in_comm=True, comm_options=opts())

    def feed_rs(step):
        for j, p in enumerate(rp):
            rs.add_grad(p, grad=np.full(p.shape, value(rank, step, 10 + j, 0), np.float32))
    steps = [lambda: feed(a, pa, 0, 0), lambda: feed_rs(0)]
    for run in (steps[::-1] if rank == 0 else steps):
        run()
    caught = 0
    for buf in (a, rs):
        try:
            buf.scale_grads()
        except OrderError:
            caught += 1
        buf.reset()
    if caught != 2:
        sys.exit(f"rank {rank}: free grads: expected 2 OrderErrors, got {caught}")
    if rs.grad_storage.size != rs.buffer_size:
        sys.exit(f"rank {rank}: free grads: grad buffer of {rs.grad_storage.size} elements "
                 f"after reset, expected the full {rs.buffer_size}")
    for j, p in enumerate(rp):
        slot = rs.layout[p.name]
        if not np.all(rs.grad_storage[slot.offset:slot.end] == value(rank, 0, 10 + j, 0)):
            sys.exit(f"rank {rank}: free grads: local grads of {p.name} lost after reset")
    say("free-grads mismatch ok")


def negotiated():
    """Adversarial orders: every rank finishes the buffers in its own random order, with
    jitter, over several steps (acc_steps 1 and 2, a REDUCE_SCATTER with sync_params)."""
    shapes = [[(97,)], [(1,), (33,)], [(257,)], [(5, 3)], [(1000,)]]
    bufs = [make(i, s, order="negotiated", tag="n", acc_steps=1 + i % 2)
            for i, s in enumerate(shapes)]
    rs_params = [Param("rs0", np.full((31,), 2.0, np.float32)), Param("rs1", np.ones((7,), np.float32))]
    rs = FusedCommBuffer(9, rs_params, world, act="reduce_scatter", order="negotiated",
                         comm_options=opts())
    rng = random.Random(1000 + rank)
    for step in range(4):
        order = list(range(len(bufs)))
        rng.shuffle(order)
        for i in order:
            buf, params = bufs[i]
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.01)
            feed(buf, params, step, i, acc=buf.acc_steps)
        for j, p in enumerate(rs_params):  # the reduce-scatter buffer in the middle of them
            rs.add_grad(p, grad=np.full(p.shape, value(rank, step, 20 + j, 0), np.float32))
        for i in reversed(order):
            buf, params = bufs[i]
            buf.scale_grads()
            check(params, step, i, f"negotiated step {step} buffer {i}", buf.acc_steps)
            buf.reset(zero_grads=True)
        rs.scale_grads()
        lo, hi = rs.layout.shard_range(rank)
        for j, p in enumerate(rs_params):  # this rank's shard of the reduced grads
            slot = rs.layout[p.name]
            a, b = max(lo, slot.offset), min(hi, slot.end)
            if a < b and not np.allclose(rs.grad_storage[a:b], ref_mean(step, 20 + j)):
                sys.exit(f"rank {rank}: negotiated reduce-scatter step {step}: wrong shard")
        rs.param_storage[lo:hi] = rank + step  # "optimizer": each rank updates its shard
        task = rs.sync_params(sync=False)
        if task is not None:  # None on one rank: nothing to gather
            task.wait()
        for r in range(size):  # every rank's shard arrived
            a, b = rs.layout.shard_range(r)
            if not np.all(rs.param_storage[a:b] == r + step):
                sys.exit(f"rank {rank}: negotiated sync_params step {step}: wrong shard of {r}")
        rs.reset(zero_grads=True)
    say(f"negotiated ok ({len(bufs)} buffers x 4 steps)")


def build_in_flight():
    """A new buffer (its agreement check) while another buffer's collective is in flight."""
    big, pbig = make(0, [(300_000,)], tag="big")
    if rank == 1:
        time.sleep(0.2)  # rank 0 builds the next buffer while the first is still in flight
    feed(big, pbig, 0, 0)
    small, psmall = make(1, [(17,), (3,)], tag="small")
    feed(small, psmall, 0, 1)
    small.scale_grads()
    big.scale_grads()
    check(pbig, 0, 0, "build in flight")
    check(psmall, 0, 1, "build in flight")
    say("build-in-flight ok")


def interleaved():
    """The user communicates between a small buffer's last add_grad and its wait, in an
    order that needs the collective to progress without the caller: rank 0 starts it, then
    enters a barrier (and a send to the next rank) that the others reach only before they
    start it. A collective run on the caller at start would block rank 0 in it, the others
    in the barrier: a deadlock. Buffers a waiting caller may run itself (64 KiB and under;
    shm: 1 MiB) and, for thread and nonblocking, one above."""
    for step, n in enumerate((100, 16_384, 3, 20_000)):
        buf, params = make(step, [(n,), (5,)], tag=f"il{step}_")
        if rank == 0:
            feed(buf, params, step, 0)
            world.Barrier()
            if size > 1:
                world.send(step, dest=1, tag=7)
        else:
            world.Barrier()
            if rank == 1:
                assert world.recv(source=0, tag=7) == step
            feed(buf, params, step, 0)
        buf.scale_grads()
        check(params, step, 0, f"interleaved step {step}")
        buf.close()
    say("interleaved ok")


def threads():
    """add_grad of the same params from two threads at once, acc_steps=2: no micro-step lost
    (big grads: numpy's += releases the GIL, so without the buffer's lock two accumulations
    into one view race; the last add_grad starts the collective from a hook thread)."""
    buf, params = make(0, [(4_000_000,), (3,)], tag="t", acc_steps=2)
    for step in range(10):
        gate = threading.Barrier(2)

        def hook(k):
            gate.wait()
            for p in params:
                buf.add_grad(p, grad=np.full(p.shape, value(rank, step, 0, k), np.float32))
        ts = [threading.Thread(target=hook, args=(k,)) for k in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        buf.scale_grads()
        check(params, step, 0, f"threads step {step}", acc=2)
        buf.reset(zero_grads=True)
    say("threads ok")


def alias():
    """add_grad(p, grad=p.grad) after backward wrote into the view: counted once."""
    buf, params = make(0, [(6,)], tag="al")
    p = params[0]
    p.grad[...] = value(rank, 0, 0, 0)
    buf.add_grad(p, grad=p.grad)
    buf.scale_grads()
    check(params, 0, 0, "alias")
    buf.reset(zero_grads=True)
    try:  # the right shape, shifted by one element: half in its own view
        buf.add_grad(p, grad=buf.grad_storage[1:7])
        sys.exit(f"rank {rank}: alias: a grad overlapping its own view was accepted")
    except GradError as exc:
        if "overlaps part of its own grad view" not in str(exc):
            raise
    other, po = make(1, [(6,), (6,)], tag="al2")
    try:
        other.add_grad(po[0], grad=po[1].grad)
        sys.exit(f"rank {rank}: alias: another param's view was accepted")
    except GradError as exc:
        if "outside the param's own slot" not in str(exc):
            raise
    say("alias ok")


def lifetime():
    """50 split communicators with a buffer each, freed: no thread or duplicate left."""
    def one(k):
        sub = world.Split(k % 2 if size > 1 else 0, rank)
        buf, params = make(k, [(7,)], comm=sub, tag=f"l{k}_")
        feed(buf, params, 0, 0)
        buf.scale_grads()
        buf.close()
        buf.close()  # idempotent
        if k % 2:
            release(sub)
            release(sub)  # idempotent
        sub.Free()  # frees the private duplicates too
    one(0)
    threads0, comms0 = threading.active_count(), live_private_comms()
    for k in range(1, 51):
        one(k)
    if threading.active_count() > threads0 or live_private_comms() > comms0:
        sys.exit(f"rank {rank}: lifetime: threads {threads0} -> {threading.active_count()}, "
                 f"private comms {comms0} -> {live_private_comms()}")
    with make(99, [(4,)], tag="ctx")[0] as ctx:
        feed(ctx, ctx.params, 0, 0)  # started here, finished by close() on the way out
    check(ctx.params, 0, 0, "context manager")
    say(f"lifetime ok (threads {threads0}, private comms {comms0})")


def suite():
    order_mismatch((15, 15), "equal sizes")
    order_mismatch((15, 200), "different sizes")
    order_mismatch_free_grads()
    suite_one_rank()


def abandon():
    """Rank 1 is late; rank 0 times out, gives the collective up; nobody pairs with it."""
    deadline = float(os.environ["MPIFUSION_TIMEOUT"])
    sub = world.Dup()
    buf, params = make(0, [(5,)], comm=sub, tag="ab")
    world.Barrier()
    if rank == 1:
        time.sleep(2.5 * deadline)
    try:
        feed(buf, params, 0, 0)
        buf.scale_grads()
        say(f"abandon: WRONG: completed with {params[0].grad[0]}")
    except CommTimeoutError as exc:
        say(f"abandon: timed out: {exc}")
        buf.reset(abandon=True, zero_grads=True)
        try:  # the next step must refuse, not pair with the stale one
            feed(buf, params, 1, 0)
            buf.scale_grads()
            say(f"abandon: WRONG: step 1 ran: {params[0].grad[0]}")
        except AbandonedError as exc:
            say(f"abandon: refused: {exc}")
    except AbandonedError as exc:
        say(f"abandon: refused: {exc}")
    say("abandon: done")  # before the barrier: the first rank out ends the job (hydra)
    world.Barrier()
    os._exit(0)  # a collective is still pending: do not finalize


def sync_deadline():
    """A rank stopped before sync_params(sync=False): the others' task.wait() times out."""
    params = [Param("s0", np.ones((13,), np.float32))]
    buf = FusedCommBuffer(0, params, world, act="reduce_scatter", comm_options=opts())
    others = world.Split(int(rank == 1), rank)  # the ranks that wait, to end together
    world.Barrier()
    if rank == 1:
        time.sleep(20 * float(os.environ["MPIFUSION_TIMEOUT"]))
        os._exit(0)
    start = time.monotonic()
    try:
        if os.environ.get("MPIFUSION_TEST_SYNC") == "1":  # the blocking form
            buf.sync_params(sync=True)
        else:
            buf.sync_params(sync=False).wait()
        say("sync: WRONG: completed")
    except CommTimeoutError as exc:
        say(f"sync: timed out after {time.monotonic() - start:.1f} s: {exc}")
        if buf.sync_param_task is None or buf.sync_param_task.is_completed():
            say("sync: WRONG: no pending sync_param_task after the timeout")
    others.Barrier()  # every waiting rank has printed before the first one exits
    os._exit(0)


def agree():
    """Settings differ across ranks (MPMD): AgreementError on every rank, at construction."""
    params = [Param("a0", np.ones((3,), np.float32))]
    try:
        FusedCommBuffer(0, params, world, act="all_reduce")
        say("agree: WRONG: built")
    except AgreementError as exc:
        say(f"agree: AgreementError: {exc}")


def suite_one_rank():
    """One rank: no mismatch is possible, everything else must still work."""
    negotiated()
    build_in_flight()
    interleaved()
    threads()
    alias()
    lifetime()


{"suite": suite, "suite1": suite_one_rank, "abandon": abandon, "sync": sync_deadline,
 "agree": agree}[scenario]()
