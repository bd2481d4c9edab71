"""Differential test: Paddle 3.3.1's own ``FusedCommBuffer`` against mpifusion's.

Paddle's class (``paddle.distributed.fleet.utils.tensor_fusion_helper``, CPU build) runs on
rank 0 with every rank of the job simulated in one process: its collectives are replaced by
the in-place stand-ins below (``_World``), which sum over the simulated ranks' buffers.
mpifusion runs for real under mpiexec with the same inputs; every rank's whole grad buffer
and param buffer must match Paddle's for that rank, over acts x acc_steps x main_grad x
release_grads x reduce_avg x scale_after_comm x free_grads_in_comm (where Paddle allows the
combination). Then the seven behaviours aligned with Paddle, and the ones mpifusion
keeps on purpose (README, "Differences from Paddle"), each shown on both sides.

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests/buffer/test_paddle_differential.py``
(meant for 2 and 3 ranks; other rank counts run too). Skipped when paddle is not installed.

Inputs are positive multiples of 1/4, so sums are exact in any order: the only rounding is
the 1/nranks scaling (and the pre-scaled sum), which both sides may do in different steps;
grads compare within a few units of fp32 roundoff, params bit for bit.
"""
import functools
import importlib.util
import itertools
import threading
import time

import numpy as np
import pytest

from mpifusion import FusedCommBuffer, Param
from mpifusion.dtypes import as_dtype
from mpifusion.errors import LayoutError, NanInfError

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(importlib.util.find_spec("paddle") is None,
                       reason="paddle is not installed (pip install -e '.[paddle]'; "
                              "scripts/test.sh installs it)"),
]

SHAPES = [(3, 5), (1,), (70,), (2, 33)]  # awkward: padding everywhere, params span shards
RTOL = 8 * 2.0 ** -24                    # grads: a few fp32 roundings of the 1/n scaling
ACTS = ["ALL_REDUCE", "REDUCE", "REDUCE_SCATTER"]
STEPS = 2


def _combos():
    out = []
    for act, acc, mg, rel, avg, sac, free in itertools.product(
            ACTS, [1, 2], [False, True], [False, True], [False, True], [False, True],
            [False, True]):
        # Paddle allows free_grads_in_comm only with REDUCE_SCATTER, release_grads, acc_steps 1
        if free and not (act == "REDUCE_SCATTER" and rel and acc == 1):
            continue
        out.append((act, acc, mg, rel, avg, sac, free))
    return out


COMBOS = _combos()


@pytest.fixture(autouse=True)
def _two_or_more(comm):
    if comm.Get_size() < 2:
        pytest.skip("simulated ranks against real ones: needs 2 or more ranks")


def grad_value(rank, step, micro, index, shape):
    """What rank ``rank`` contributes: positive multiples of 1/4 (exact sums in any order)."""
    n = int(np.prod(shape))
    j = np.arange(n)
    return (((rank * 7 + step * 5 + micro * 3 + index * 11 + j) % 13 + 1) * 0.25).astype(
        np.float32).reshape(shape)


def param_value(index, shape):
    return ((np.arange(int(np.prod(shape))) % 9 + index + 1) * 0.5).astype(np.float32).reshape(shape)


def updated_shard(step, begin, end):
    """What the optimizer 'writes' into a rank's shard of the param buffer."""
    return ((np.arange(begin, end) % 17 + step + 1) * 0.125).astype(np.float32)


# ---------------------------------------------------------------------------- Paddle's side
class _Task:
    def __init__(self, world, seq):
        self._world, self._seq = world, seq

    def wait(self):
        self._world.finish(self._seq)
        return True

    def is_completed(self):
        return self._seq in self._world.done


class _World:
    """Stand-ins for Paddle's collectives over simulated ranks (one process).

    The k-th collective a simulated rank starts joins the k-th of every other rank; its input
    is copied when started (as a real collective reads it then) and the result is written
    into the outputs, in place, when the first rank waits, after every rank has started it
    (the test drives all ranks' backward before any waits; blocking calls such as
    ``sync_params(sync=True)`` run in one thread per rank). Sums are exact float64 sums
    rounded once to the buffer dtype; AVG divides that sum by nranks first. ``ranks`` are the
    group's global ranks in group order (what ``paddle.distributed.reduce`` converts ``dst``
    with).
    """

    def __init__(self, paddle, ranks):
        self.paddle, self.ranks = paddle, list(ranks)
        self.calls = [[] for _ in self.ranks]
        self.done = set()
        self.cond = threading.Condition()

    def group(self, rank):
        return _Group(self, rank)

    def start(self, rank, kind, src, out, avg=False, root=None):
        src = self.paddle.cast(src, "float32").numpy().astype(np.float64).ravel()
        with self.cond:
            self.calls[rank].append((kind, src, out, avg, root))
            self.cond.notify_all()
            return _Task(self, len(self.calls[rank]) - 1)

    def finish(self, seq):
        with self.cond:
            if not self.cond.wait_for(lambda: all(len(c) > seq for c in self.calls), 60):
                raise TimeoutError(f"simulated collective {seq}: a rank never started it")
            if seq not in self.done:
                self._finish(seq)

    def _finish(self, seq):
        calls = [c[seq] for c in self.calls]
        kind, _, _, avg, root = calls[0]
        assert all(c[0] == kind for c in calls), [c[0] for c in calls]
        n = len(calls)
        total = sum(c[1] for c in calls)
        if avg:
            total = total / n
        for rank, (_, src, out, _, _) in enumerate(calls):
            if kind == "all_reduce":
                value = total
            elif kind == "reduce":
                if rank != root:
                    continue
                value = total
            elif kind == "reduce_scatter":
                shard = total.size // n
                value = total[rank * shard:(rank + 1) * shard]
            else:  # all_gather
                value = np.concatenate([c[1] for c in calls])
            arr = self.paddle.to_tensor(value.astype(np.float32).reshape(out.shape))
            self.paddle.assign(arr.astype(out.dtype), out)
        self.done.add(seq)


class _Group:
    """What FusedCommBuffer reads of a Paddle group: nranks, rank, process_group.all_gather."""

    def __init__(self, world, rank):
        self.world, self.rank, self.nranks = world, rank, len(world.ranks)
        self.ranks = world.ranks
        self.process_group = self

    def get_group_rank(self, global_rank):
        return self.ranks.index(global_rank)  # ValueError for a rank outside the group

    def all_gather(self, slice_buffer, full_buffer):
        return self.world.start(self.rank, "all_gather", slice_buffer, full_buffer)


@functools.lru_cache(maxsize=None)
def _paddle():
    """Paddle and its helper module, with the two patches the simulation needs.

    - device type: the helper aligns to 256 bytes for accelerators only and refuses the CPU;
      an accelerator type would make its storages switch devices, so the CPU gets the
      accelerators' alignment entry and is made the helper's (cached) device type.
    - collectives: ``paddle.distributed.{all_reduce,reduce,reduce_scatter}`` become the
      ``_World`` stand-ins of the group they are given (this process is a test process).
    """
    import warnings

    with warnings.catch_warnings():  # its C++-extension helper warns that ccache is missing
        warnings.simplefilter("ignore", UserWarning)
        import paddle
        from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh

    tfh.alignment.setdefault("cpu", tfh.alignment["gpu"])
    tfh.__current_device_type__ = "cpu"
    AVG = paddle.distributed.ReduceOp.AVG

    def all_reduce(tensor, op=None, group=None, sync_op=True):
        return group.world.start(group.rank, "all_reduce", tensor, tensor, op == AVG)

    def reduce(tensor, dst, op=None, group=None, sync_op=True):
        root = group.get_group_rank(dst)  # as paddle.distributed.reduce: dst is global
        return group.world.start(group.rank, "reduce", tensor, tensor, op == AVG, root)

    def reduce_scatter(output, input, op=None, group=None, sync_op=True):
        return group.world.start(group.rank, "reduce_scatter", input, output, op == AVG)

    paddle.distributed.all_reduce = all_reduce
    paddle.distributed.reduce = reduce
    paddle.distributed.reduce_scatter = reduce_scatter
    paddle.set_device("cpu")
    return paddle, tfh


def run_ranks(calls):
    """Run one blocking call per simulated rank, each in its own thread; re-raise errors."""
    errors = []

    def run(call):
        try:
            call()
        except BaseException as exc:  # noqa: B902 (handed to the test thread)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


_names = itertools.count()


def paddle_params(main_grad, shapes=SHAPES):
    paddle, _ = _paddle()
    dtype = "bfloat16" if main_grad else "float32"
    out = []
    for i, shape in enumerate(shapes):
        p = paddle.create_parameter(list(shape), dtype, name=f"pdiff_{next(_names)}",
                                    default_initializer=paddle.nn.initializer.Constant(0.0))
        paddle.assign(paddle.to_tensor(param_value(i, shape)).astype(dtype), p)
        if main_grad:
            p.main_grad = None  # Paddle's hook gives main_grad; the helper looks for the attribute
        out.append(p)
    return out


def paddle_backward(p, x, main_grad):
    """What Paddle's backward (and main-grad hook) does with a param's grad ``x``: accumulate
    in place into the grad it has, or give it a new one."""
    paddle, _ = _paddle()
    t = paddle.to_tensor(x)
    g = p.main_grad if main_grad else p.grad
    if g is not None and g._is_initialized():
        g.add_(t)
    elif main_grad:
        p.main_grad = t
    else:
        p._copy_gradient_from(t)


def _np(t):
    paddle, _ = _paddle()
    return None if t is None else paddle.cast(t, "float32").numpy().ravel().copy()


def run_paddle(combo, nranks, shapes=SHAPES, ranks=None, dst=None, held_grads=False,
               keep_grads=False, steps=STEPS, after_step=None):
    """Every simulated rank's (grad buffer, param buffer) after each step, as numpy.

    ``ranks``: the group's global ranks in group order (default: all, in order); ``dst``: a
    global rank (default: the last); ``held_grads``: each param holds a grad when fused;
    ``keep_grads``: no clearing between steps (else the optimizer's: zero the buffer, or with
    release_grads drop the params' grads and the buffer); ``after_step(step, bufs, params)``
    runs after each step's snapshot.
    """
    paddle, tfh = _paddle()
    act, acc, mg, rel, avg, sac, free = combo
    ranks = list(range(nranks)) if ranks is None else list(ranks)
    world = _World(paddle, ranks)
    action = getattr(tfh.HOOK_ACTION, act)
    if act != "REDUCE":
        dst = -1
    elif dst is None:
        dst = ranks[-1]
    params = [paddle_params(mg, shapes) for _ in ranks]
    if held_grads:
        for r, ps in enumerate(params):
            for i, p in enumerate(ps):
                paddle_backward(p, grad_value(r, -1, 0, i, shapes[i]), mg)
    bufs = [tfh.FusedCommBuffer(3, params[r], world.group(r), acc_steps=acc, act=action, dst=dst,
                                use_main_grad=mg, release_grads=rel, use_reduce_avg=avg,
                                scale_after_comm=sac, free_grads_in_comm=free)
            for r in range(len(ranks))]
    out = [[] for _ in ranks]
    for step in range(steps):
        for k in range(acc):
            for r in range(len(ranks)):
                for i in reversed(range(len(shapes))):
                    paddle_backward(params[r][i], grad_value(r, step, k, i, shapes[i]), mg)
                    bufs[r].add_grad(params[r][i])
        for b in bufs:
            b.scale_grads()
        grads = [_np(b.grad_storage) for b in bufs]
        if act == "REDUCE_SCATTER":
            tasks = {}
            for r, b in enumerate(bufs):
                shard = b.buffer_size // len(ranks)
                view = b.param_storage._slice(r * shard, (r + 1) * shard)
                new = paddle.to_tensor(updated_shard(step, r * shard, (r + 1) * shard))
                paddle.assign(new.astype(view.dtype), view)
            if step == 0:  # blocking: one thread per simulated rank
                run_ranks([functools.partial(b.sync_params, sync=True) for b in bufs])
            else:
                for b in bufs:
                    b.sync_params(sync=False, param2task=tasks)
            for b in bufs:
                if b.sync_param_task is not None:
                    b.sync_param_task.wait()
        for r, b in enumerate(bufs):
            out[r].append((grads[r], _np(b.param_storage)))
        if after_step is not None:
            after_step(step, bufs, params)
        if keep_grads:
            continue
        for r, b in enumerate(bufs):  # what the optimizer does after reading the grads
            if rel:
                for p in params[r]:
                    if mg:
                        p.main_grad = None
                    else:
                        p.clear_gradient(False)
                b._clear_grad_storage()
            else:
                b.grad_storage.zero_()
    return out


def quiet_wait(comm):
    """A barrier that sleeps while waiting: MPI's busy wait on the other ranks would take
    the CPU rank 0 needs for Paddle (the machines running the suite have 2 cores)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def on_rank0(comm, fn):
    """``fn()`` on rank 0 (the Paddle side), its result on every rank; its error everywhere."""
    result = None
    if comm.Get_rank() == 0:
        try:
            result = ("ok", fn())
        except BaseException as exc:  # noqa: B902 (re-raised on every rank below)
            result = ("error", f"rank 0: {type(exc).__name__}: {exc}")
    quiet_wait(comm)
    kind, value = comm.bcast(result, root=0)
    if kind == "error":
        raise RuntimeError(value)
    return value


_RESULTS: dict = {}


def paddle_results(comm):
    """Rank 0 simulates every combination once; each rank gets its own rank's results."""
    n, rank = comm.Get_size(), comm.Get_rank()
    if n not in _RESULTS:
        per_rank = None
        if rank == 0:
            runs = {combo: run_paddle(combo, n) for combo in COMBOS}
            per_rank = [{c: runs[c][r] for c in COMBOS} for r in range(n)]
        quiet_wait(comm)
        _RESULTS[n] = comm.scatter(per_rank, root=0)
    return _RESULTS[n]


# ---------------------------------------------------------------------------- mpifusion's side
def our_params(main_grad, shapes=SHAPES, tag="w"):
    dtype = as_dtype("bfloat16" if main_grad else "float32")
    return [Param(f"{tag}{i}", param_value(i, s).astype(dtype)) for i, s in enumerate(shapes)]


def run_ours(comm, combo, shapes=SHAPES, dst=None, held_grads=False, keep_grads=False,
             steps=STEPS):
    """This rank's (grad buffer, param buffer) after each step (run_paddle's options; ``comm``
    is the group, ``dst`` a global rank, default: comm's last rank), and the buffer."""
    act, acc, mg, rel, avg, sac, free = combo
    n, rank = comm.Get_size(), comm.Get_rank()
    params = our_params(mg, shapes)
    if held_grads:
        for i, p in enumerate(params):
            setattr(p, "main_grad" if mg else "grad", grad_value(rank, -1, 0, i, shapes[i]))
    if act != "REDUCE":
        dst = -1
    elif dst is None:
        dst = global_rank(comm, n - 1)
    buf = FusedCommBuffer(3, params, comm, acc_steps=acc, act=act, dst=dst, use_main_grad=mg,
                          release_grads=rel, use_reduce_avg=avg, scale_after_comm=sac,
                          free_grads_in_comm=free)
    out = []
    for step in range(steps):
        for k in range(acc):
            for i in reversed(range(len(shapes))):
                p, x = params[i], grad_value(rank, step, k, i, shapes[i])
                if i % 2 == 0:
                    buf.add_grad(p, grad=x)  # the framework hands the grad in
                    continue
                view = p.main_grad if mg else p.grad  # backward writes the grad itself
                if view is None:
                    setattr(p, "main_grad" if mg else "grad", x.copy())
                else:
                    view += x
                buf.add_grad(p)
        buf.scale_grads()
        grads = buf.grad_storage.astype(np.float64)
        if act == "REDUCE_SCATTER":
            lo, hi = buf.layout.shard_range(rank)
            buf.param_storage[lo:hi] = updated_shard(step, lo, hi).astype(buf.param_storage.dtype)
            tasks = {}
            task = buf.sync_params(sync=step == 0, param2task=tasks)
            if task is not None:
                assert all(tasks[p.name] is task for p in params)
                task.wait()
        params_now = None if buf.param_storage is None else buf.param_storage.astype(np.float32)
        out.append((grads, params_now))
        if keep_grads:
            continue
        if rel:
            buf.clear_grad_storage()
        else:
            buf.grad_storage[...] = 0
    return out, buf


def global_rank(comm, rank):
    """The global rank (of COMM_WORLD) of ``comm``'s rank ``rank``."""
    from mpi4py import MPI

    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return group.Translate_ranks([rank], world)[0]
    finally:
        group.Free()
        world.Free()


def assert_same(have, want, where):
    """Whole buffers, step by step: grads within RTOL, params bit for bit."""
    assert len(have) == len(want), where
    for step, ((g_have, p_have), (g_want, p_want)) in enumerate(zip(have, want)):
        at = f"{where} step {step}"
        assert g_have.shape == g_want.shape, at
        np.testing.assert_allclose(g_have, g_want, rtol=RTOL, atol=0, err_msg=f"grads {at}")
        if p_want is None:
            assert p_have is None, at
        else:
            np.testing.assert_array_equal(p_have, p_want, err_msg=f"params {at}")


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(
    [c[0].lower(), f"acc{c[1]}"] + [name for name, on in zip(
        ["main_grad", "release", "avg", "scale_after", "free"], c[2:]) if on]))
def test_buffers_match_paddle(comm, combo):
    if comm.Get_size() not in (2, 3):
        pytest.skip("the matrix runs at 2 and 3 ranks (the seven cases at every size >= 2)")
    want = paddle_results(comm)[combo]
    have, _ = run_ours(comm, combo)
    assert_same(have, want, f"rank {comm.Get_rank()} {combo}")


# ---------------------------------------------------------------------------- the seven cases
ONE = ("ALL_REDUCE", 1, False, False, False, True, False)  # a plain combination


def _with(combo, **kw):
    names = ["act", "acc", "mg", "rel", "avg", "sac", "free"]
    values = dict(zip(names, combo), **kw)
    return tuple(values[k] for k in names)


def test_1_reduce_dst_is_a_global_rank(comm):
    """Paddle's dst is a global rank, converted to the group's: on a communicator holding every
    rank in reverse order, dst=0 is the group's last rank; a global rank outside the group
    is refused (by Paddle when it reduces, by mpifusion when the buffer is built)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    combo = _with(ONE, act="REDUCE")
    rev = comm.Split(0, key=n - 1 - rank)  # group rank g is global rank n-1-g
    try:
        want = on_rank0(comm, lambda: run_paddle(combo, n, ranks=range(n - 1, -1, -1), dst=0,
                                                 steps=1))
        have, buf = run_ours(rev, combo, dst=0, steps=1)
        assert (buf.dst, buf.dst_rank) == (0, n - 1)
        assert_same(have, want[rev.Get_rank()], f"rank {rank} reversed group, dst=0")
    finally:
        rev.Free()
    if n < 3:
        return
    pair = comm.Split(0 if rank in (1, 2) else 1, key=rank)  # global ranks {1, 2}
    try:
        if rank in (1, 2):
            have, buf = run_ours(pair, combo, dst=2, steps=1)  # the pair's rank 1
            assert buf.dst_rank == 1
        else:
            have = None
        want = on_rank0(comm, lambda: (run_paddle(combo, 2, ranks=[1, 2], dst=2, steps=1),
                                       _paddle_refuses_dst_outside_group(combo)))
        if rank in (1, 2):
            assert_same(have, want[0][pair.Get_rank()], f"rank {rank} group [1, 2], dst=2")
            params = our_params(False)
            with pytest.raises(LayoutError, match=rf"rank {rank - 1}: buffer 0: dst: .*global "
                                                  r"ranks \[1, 2\], got 0"):
                FusedCommBuffer(0, params, pair, act="REDUCE", dst=0)
            assert all(p.grad is None for p in params)
        assert want[1] == "ValueError"
    finally:
        pair.Free()


def _paddle_refuses_dst_outside_group(combo):
    try:
        run_paddle(combo, 2, ranks=[1, 2], dst=0, steps=1)
    except ValueError as exc:  # paddle.distributed.reduce: group.get_group_rank(0)
        return type(exc).__name__
    return "accepted"


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("main_grad", [False, True])
def test_2_grad_held_when_fused_is_dropped(comm, act, main_grad):
    """Paddle's grad buffers start at zero: a grad (or main_grad) a param holds when it is
    fused is not reduced."""
    n = comm.Get_size()
    combo = _with(ONE, act=act, mg=main_grad)
    want = on_rank0(comm, lambda: run_paddle(combo, n, held_grads=True, steps=1))
    have, _ = run_ours(comm, combo, held_grads=True, steps=1)
    assert_same(have, want[comm.Get_rank()], f"rank {comm.Get_rank()} held grads")
    plain, _ = run_ours(comm, combo, steps=1)  # as if no grad had been held
    assert_same(have, plain, "held grads vs none")


def test_3_clear_grad_storage_drops_the_params_grads(comm):
    """Kept on purpose: mpifusion's clear_grad_storage() also drops p.grad (the view that
    would keep the whole buffer alive); Paddle's leaves p.grad holding the reduced values, and
    its next step reduces them again unless the optimizer cleared p.grad first (as Paddle's
    optimizers do: the matrix above runs that flow, with equal results)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    combo = _with(ONE, rel=True)

    def paddle_side():
        held = {}

        def clear_storage_only(step, bufs, params):
            if step == 0:
                for b in bufs:
                    b._clear_grad_storage()
                held["grads"] = [[_np(p.grad) for p in ps] for ps in params]

        runs = run_paddle(combo, n, keep_grads=True, after_step=clear_storage_only)
        return runs, held["grads"]

    runs, held = on_rank0(comm, paddle_side)
    step0, step1 = runs[rank]
    params = our_params(False)
    buf = FusedCommBuffer(3, params, comm, act="ALL_REDUCE", release_grads=True)
    for i in reversed(range(len(SHAPES))):
        buf.add_grad(params[i], grad=grad_value(rank, 0, 0, i, SHAPES[i]))
    buf.scale_grads()
    reduced = [p.grad.ravel().copy() for p in params]
    buf.clear_grad_storage()
    assert buf.grad_storage is None and all(p.grad is None for p in params)
    for i, p in enumerate(params):  # Paddle's p.grad kept exactly these values
        np.testing.assert_allclose(held[rank][i], reduced[i], rtol=RTOL, atol=0)
    for i in reversed(range(len(SHAPES))):
        buf.add_grad(params[i], grad=grad_value(rank, 1, 0, i, SHAPES[i]))
    buf.scale_grads()
    # Paddle's second step = the new grads + last step's result left in p.grad
    fresh = buf.grad_storage.astype(np.float64)
    layout = buf.layout
    carried = np.zeros(layout.numel)
    for p, r in zip(params, reduced):
        carried[layout[p.name].offset:layout[p.name].end] = r
    np.testing.assert_allclose(step1[0], fresh + carried, rtol=RTOL, atol=0)
    assert not np.allclose(fresh, step1[0])


SHAPES0 = [(3, 5), (0,), (70,)]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("release", [False, True])
def test_4_size_zero_params(comm, act, release):
    """Kept on purpose: size-0 params are accepted everywhere. Paddle accepts them with
    release_grads and in reduce-scatter buffers (results compared here) and refuses them only
    in ALL_REDUCE/REDUCE buffers without release_grads, by an assertion meant for released
    storages; there mpifusion gives what Paddle gives with release_grads."""
    n, rank = comm.Get_size(), comm.Get_rank()
    combo = _with(ONE, act=act, rel=release)
    refused = act != "REDUCE_SCATTER" and not release

    def paddle_side():
        if refused:
            with pytest.raises(AssertionError, match="released InternalStorage"):
                run_paddle(combo, n, shapes=SHAPES0)
            return run_paddle(_with(combo, rel=True), n, shapes=SHAPES0)
        return run_paddle(combo, n, shapes=SHAPES0)

    want = on_rank0(comm, paddle_side)
    have, buf = run_ours(comm, combo, shapes=SHAPES0)
    assert buf.layout["w1"].numel == 0
    assert_same(have, want[rank], f"rank {rank} size-0 {act} release={release}")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("flag", ["stop_gradient", "trainable"])
def test_5_stop_gradient_params_are_refused(comm, act, flag):
    """trainable is not stop_gradient, as in Paddle, where fusing such a param fails."""

    def paddle_side():
        paddle, tfh = _paddle()
        ps = paddle_params(False)
        setattr(ps[2], flag, flag == "stop_gradient")  # trainable=False or stop_gradient=True
        assert ps[2].stop_gradient and not ps[2].trainable
        world = _World(paddle, [0])
        with pytest.raises(AssertionError, match="param must be trainable"):
            tfh.FusedCommBuffer(0, ps, world.group(0), act=getattr(tfh.HOOK_ACTION, act),
                                dst=0 if act == "REDUCE" else -1)
        return True

    assert on_rank0(comm, paddle_side)
    ps = our_params(False)
    setattr(ps[2], flag, flag == "stop_gradient")  # trainable=False or stop_gradient=True
    assert ps[2].stop_gradient and not ps[2].trainable
    with pytest.raises(LayoutError, match=r"param 'w2'.*trainable=False \(stop_gradient=True\)"):
        FusedCommBuffer(0, ps, comm, act=act, dst=0 if act == "REDUCE" else -1)
    assert all(p.grad is None for p in ps)


def test_6_naninf_error_is_a_value_error(comm, monkeypatch):
    """Paddle raises ValueError (after pre-scaling, with scale_after_comm=False); mpifusion's
    NanInfError is one too, and leaves everything as before the call (kept: errors change
    nothing; the add_grad that found it is undone)."""
    n, rank = comm.Get_size(), comm.Get_rank()

    def paddle_side():
        paddle, tfh = _paddle()
        monkeypatch.setenv("FLAGS_pp_check_naninf", "1")
        ps = paddle_params(False)
        world = _World(paddle, range(n))
        buf = tfh.FusedCommBuffer(0, ps, world.group(0), act=tfh.HOOK_ACTION.ALL_REDUCE,
                                  scale_after_comm=False)
        for i in reversed(range(1, len(SHAPES))):
            paddle_backward(ps[i], grad_value(0, 0, 0, i, SHAPES[i]), False)
            buf.add_grad(ps[i])
        bad = grad_value(0, 0, 0, 0, SHAPES[0])
        bad[0, 0] = np.nan
        paddle_backward(ps[0], bad, False)
        before = _np(buf.grad_storage)
        with pytest.raises(ValueError, match="inf or nan"):
            buf.add_grad(ps[0])
        return before, _np(buf.grad_storage)

    before, after = on_rank0(comm, paddle_side)
    np.testing.assert_allclose(after[1:], before[1:] / n, rtol=RTOL)  # Paddle pre-scaled
    ps = our_params(False)
    buf = FusedCommBuffer(0, ps, comm, act="ALL_REDUCE", scale_after_comm=False,
                          check_naninf=True)
    for i in reversed(range(len(SHAPES))):
        g = grad_value(rank, 0, 0, i, SHAPES[i])
        if i == 0:
            g[0, 0] = np.nan  # on every rank: all raise, none waits in the collective
            kept = buf.grad_storage.copy()
            with pytest.raises(ValueError, match=f"rank {rank}: .*NaN/Inf.*w0") as err:
                buf.add_grad(ps[i], grad=g)
            assert isinstance(err.value, NanInfError)
            # not pre-scaled, and the call is undone: the NaN grad not added, w0 not in
            np.testing.assert_array_equal(buf.grad_storage, kept)
            assert buf.missing_params() == ["w0"] and buf.task is None
        else:
            buf.add_grad(ps[i], grad=g)


def test_7_sync_params_ignores_param2task_when_sync(comm):
    """sync_params(sync=True, param2task=...) ignores param2task, as in Paddle; with
    sync=False a param that already has a task is refused (Paddle: AssertionError after
    starting the all-gather; mpifusion: StateError before)."""
    from mpifusion.errors import StateError

    n, rank = comm.Get_size(), comm.Get_rank()
    combo = _with(ONE, act="REDUCE_SCATTER")
    taken = {f"w{i}": "taken" for i in range(len(SHAPES))}

    def paddle_side():
        def sync_again(step, bufs, params):
            tasks = [{p.name: "taken" for p in ps} for ps in params]
            run_ranks([functools.partial(b.sync_params, sync=True, param2task=t)
                       for b, t in zip(bufs, tasks)])
            assert all(set(t.values()) == {"taken"} for t in tasks)

        return run_paddle(combo, n, steps=1, after_step=sync_again)

    want = on_rank0(comm, paddle_side)
    have, buf = run_ours(comm, combo, steps=1)
    tasks = dict(taken)
    assert buf.sync_params(sync=True, param2task=tasks) is None and tasks == taken
    assert_same([(have[0][0], buf.param_storage.astype(np.float32))], want[rank], f"rank {rank}")
    with pytest.raises(StateError, match="param2task.*w0"):
        buf.sync_params(sync=False, param2task=dict(taken))
    assert buf.sync_param_task is None or buf.sync_param_task.is_completed()


@pytest.mark.parametrize("release", [False, True])
def test_8_grads_kept_between_steps(comm, release):
    """Kept on purpose: with release_grads and the grad buffer kept between steps (no
    clearing), Paddle adds each grad view onto itself at the next step's first micro-step
    (the grad doubles); mpifusion does not. Without release_grads both accumulate alike."""
    n, rank = comm.Get_size(), comm.Get_rank()
    combo = _with(ONE, rel=release)
    want = on_rank0(comm, lambda: run_paddle(combo, n, keep_grads=True))
    have, _ = run_ours(comm, combo, keep_grads=True)
    if not release:
        assert_same(have, want[rank], f"rank {rank} grads kept")
        return
    assert_same(have[:1], want[rank][:1], f"rank {rank} step 0")
    np.testing.assert_allclose(want[rank][1][0], 2 * have[1][0], rtol=RTOL, atol=0)
