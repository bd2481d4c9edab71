"""The pipelined paths without MPI: the nonblocking engine's window (fake requests), the GPU
staging pipeline (a fake device that runs copies late or early and logs their order), the
window option, and the one poll-with-backoff helper."""
import collections
import gc
import time
import weakref

import numpy as np
import pytest

from mpifusion.arrays import staging
from mpifusion.comm import poll as pollmod
from mpifusion.comm.engines import NonBlockingEngine
from mpifusion.comm.call import FENCE, Call, pipelined
from mpifusion.comm.record import Collective, Plan
from mpifusion.comm.task import CommTask
from mpifusion.config import MAX_WINDOW, WINDOW_ENV, CommOptions
from mpifusion.dtypes import bfloat16, float16, float32
from mpifusion.errors import OptionError

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize("bad", [0, -1, MAX_WINDOW + 1, 1.5, "x", True, None, "2.0"])
def test_invalid_window_refused(bad):
    with pytest.raises(OptionError) as info:
        CommOptions(window=bad)
    assert "window" in str(info.value) and f"[1, {MAX_WINDOW}]" in str(info.value)


def test_pipeline_option_is_off_by_default_and_read_from_the_environment():
    assert CommOptions().pipeline is False
    assert CommOptions(pipeline=True).pipeline is True
    assert CommOptions.from_env({"MPIFUSION_PIPELINE": "1"}).pipeline is True
    assert CommOptions.from_env({"MPIFUSION_PIPELINE": "1"}, pipeline=False).pipeline is False
    with pytest.raises(OptionError, match="MPIFUSION_PIPELINE"):
        CommOptions.from_env({"MPIFUSION_PIPELINE": "sometimes"})


def test_window_from_env_names_the_variable():
    assert CommOptions.from_env({WINDOW_ENV: "8"}).window == 8
    assert CommOptions.from_env({WINDOW_ENV: "3"}, window=2).window == 2  # argument wins
    with pytest.raises(OptionError, match=WINDOW_ENV):
        CommOptions.from_env({WINDOW_ENV: "0"})


# --------------------------------------------------------------------------- poll
def test_poll_done_timeout_and_backoff():
    calls = []
    assert pollmod.poll(lambda: calls.append(1) or len(calls) >= 3)
    assert len(calls) == 3
    t0 = time.monotonic()
    assert not pollmod.poll(lambda: False, timeout=0.05, cap=1e-3)
    assert 0.04 < time.monotonic() - t0 < 2
    assert not pollmod.poll(lambda: False, timeout=0)
    b = pollmod.Backoff(1e-6, 8e-6)
    assert [b.next() for _ in range(6)] == [1e-6, 2e-6, 4e-6, 8e-6, 8e-6, 8e-6]
    b.reset()
    assert b.next() == 1e-6


def test_poll_spins_while_moving_and_backs_off_once_stalled(monkeypatch):
    """A wait on a pipeline whose calls keep landing must not sleep (each sleep would grow
    and delay every later call: 7x slower with a deadline); once stalled it backs off."""
    clock = [0.0]
    sleeps, yields = [], []
    monkeypatch.setattr(pollmod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(pollmod.time, "sleep", lambda s: (sleeps.append(s), clock.__setitem__(0, clock[0] + s)))
    monkeypatch.setattr(pollmod.os, "sched_yield", lambda: (yields.append(1), clock.__setitem__(0, clock[0] + 1e-4)))
    counter = [0]
    polls = [0]

    def done():  # a call lands on every other poll for 400 polls (40 ms), then nothing moves
        polls[0] += 1
        if polls[0] < 400 and polls[0] % 2 == 0:
            counter[0] += 1
        return polls[0] >= 600

    assert pollmod.poll(done, timeout=10.0, moves=lambda: counter[0])
    first_sleep = len(yields)
    assert sleeps and first_sleep >= 398  # no sleep while it moved, long after SPIN_S
    assert max(sleeps) <= 1e-3 and sleeps[0] == 1e-6  # then backed off from scratch
    # without ``moves``: back-off from the first miss, as before
    sleeps.clear(), yields.clear()
    polls[0] = 0
    assert pollmod.poll(done, timeout=10.0)
    assert not yields and len(sleeps) == 599


# --------------------------------------------------------------------------- engine
class FakeRequest:
    def __init__(self, log, index):
        self.log, self.index, self.done = log, index, False

    def Test(self):
        return self.done

    def Wait(self):
        self.done = True


class FakeComm:
    """Issues fake requests; the test decides when each completes."""

    def __init__(self):
        self.requests = []

    def Get_rank(self):
        return 0

    def __getattr__(self, name):
        if not name.startswith("I"):
            raise AttributeError(name)

        def issue(*args, **kwargs):
            r = FakeRequest(self, len(self.requests))
            self.requests.append((name, args, r))
            return r
        return issue


def _steps(count, landed, fence_at=None):
    for k in range(count):
        if k == fence_at:
            yield Call("Barrier", (k,))
        else:
            yield pipelined("Allreduce", (k,), land=lambda k=k: landed.append(k))


def _task(engine, steps, window):
    """A collective's record, as the engine runs it (submit it to start it), on a stream
    whose window is ``window``."""
    engine.window = window
    return Collective(Plan(name="t"), lambda seq: steps)


def _handle(engine, task):
    """The caller's handle of a submitted record."""
    return CommTask(task, engine)


@pytest.mark.parametrize("window", [1, 2, 3, 8])
def test_engine_keeps_window_in_flight_and_lands_in_order(window):
    comm = FakeComm()
    engine = NonBlockingEngine(comm, progress_thread=False)
    landed = []
    task = _task(engine, _steps(6, landed), window)
    engine.submit(task)
    assert len(comm.requests) == min(window, 6) and landed == []
    # the second call completes first: nothing lands before the first did (issue order)
    if window > 1:
        comm.requests[1][2].done = True
        engine.progress()
        assert landed == [] and len(comm.requests) == min(window, 6)
    issued = len(comm.requests)
    while not task.finished():
        pending = [r for _, _, r in comm.requests if not r.done]
        assert len(pending) <= window
        pending[0].done = True
        engine.progress()
        inflight = sum(not r.done for _, _, r in comm.requests)
        assert inflight <= window
        assert len(comm.requests) >= issued
        issued = len(comm.requests)
    assert landed == list(range(6)) and [a[0] for _, a, _ in comm.requests] == list(range(6))
    _handle(engine, task).wait()


class ForgetfulComm(FakeComm):
    """Like mpi4py: a non-blocking call keeps no reference to its arrays (only a weak one
    here, to see whether anything else does)."""

    def __getattr__(self, name):
        if not name.startswith("I"):
            raise AttributeError(name)

        def issue(*args, **kwargs):
            r = FakeRequest(self, len(self.requests))
            refs = [weakref.ref(a[0].base) for a in args if isinstance(a, list)]
            self.requests.append((name, refs, r))
            return r
        return issue


def _scratch_steps(count):
    """Calls on views of a scratch array only this generator holds (as the collectives'
    rings are), and nothing after the last call: the generator ends while they fly."""
    scratch = np.arange(16, dtype=np.float32)
    for k in range(count):
        yield pipelined("Allreduce", ([scratch[k:k + 4], None],))


@pytest.mark.parametrize("window", [1, 3, 8])
def test_engine_keeps_a_calls_arrays_alive_until_it_lands(window):
    """Regression: the last pipelined calls of a reduce-scatter read scratch that was freed
    when its generator ended (Open MPI, 4 ranks, window 8: wrong sums in the last piece)."""
    comm = ForgetfulComm()
    engine = NonBlockingEngine(comm, progress_thread=False)
    task = _task(engine, _scratch_steps(3), window)
    engine.submit(task)
    while not task.finished():
        gc.collect()
        for _, refs, r in comm.requests:
            if not r.done:
                assert all(ref() is not None for ref in refs), "freed while in flight"
        pending = [r for _, _, r in comm.requests if not r.done]
        pending[0].done = True
        engine.progress()
    _handle(engine, task).wait()
    gc.collect()
    assert all(ref() is None for _, refs, _ in comm.requests for ref in refs)


def test_a_timed_out_request_keeps_its_arrays_for_good():
    """The agreement check's calls: a request given up after its deadline may still be
    written by MPI, so its arrays must outlive the raised CommTimeoutError."""
    from mpifusion.comm import health
    from mpifusion.errors import CommTimeoutError

    recv = np.zeros(3, np.uint64)
    ref = weakref.ref(recv)
    never = FakeRequest(None, 0)
    with pytest.raises(CommTimeoutError, match="late"):
        health.wait_request(never, 0.02, lambda: "late", keep=(recv,))
    del recv
    gc.collect()
    assert ref() is not None and health._STRANDED[-1][0] is never


def test_fence_waits_for_everything_before_it():
    comm = FakeComm()
    engine = NonBlockingEngine(comm, progress_thread=False)
    landed = []
    task = _task(engine, _steps(5, landed, fence_at=2), window=4)
    engine.submit(task)
    # calls 0, 1 pipelined, 2 is a fence: issued, but 3 waits until 0..2 all landed
    assert [n for n, _, _ in comm.requests] == ["Iallreduce", "Iallreduce", "Ibarrier"]
    for i in (2, 1):
        comm.requests[i][2].done = True
        engine.progress()
        assert len(comm.requests) == 3
    comm.requests[0][2].done = True
    engine.progress()
    assert landed == [0, 1] and len(comm.requests) == 5
    for _, _, r in comm.requests:
        r.done = True
    _handle(engine, task).wait(timeout=5)
    assert landed == [0, 1, 3, 4]


def test_landing_error_stops_issuing_and_drains():
    comm = FakeComm()
    engine = NonBlockingEngine(comm, progress_thread=False)

    def steps():
        yield pipelined("Allreduce", (0,), land=lambda: 1 / 0)
        for k in range(1, 5):
            yield pipelined("Allreduce", (k,))
    task = _task(engine, steps(), window=2)
    engine.submit(task)
    comm.requests[0][2].done = True
    engine.progress()
    assert len(comm.requests) == 2 and not task.finished()  # call 1 still in flight
    comm.requests[1][2].done = True
    engine.progress()
    assert task.finished() and len(comm.requests) == 2
    with pytest.raises(Exception, match="division"):
        _handle(engine, task).wait()


def test_pause_is_a_fence_and_later_tasks_wait():
    comm = FakeComm()
    engine = NonBlockingEngine(comm, progress_thread=False)
    landed = []

    def steps():
        yield pipelined("Allreduce", (0,), land=lambda: landed.append(0))
        yield FENCE
        yield pipelined("Allreduce", (1,), land=lambda: landed.append(1))
    first, second = _task(engine, steps(), 4), _task(engine, _steps(2, landed), 4)
    engine.submit(first)
    engine.submit(second)
    assert len(comm.requests) == 1
    comm.requests[0][2].done = True
    engine.progress()
    assert landed == [0] and len(comm.requests) == 2
    comm.requests[1][2].done = True
    engine.progress()
    assert first.finished() and len(comm.requests) == 4  # the next task starts after
    for _, _, r in comm.requests:
        r.done = True
    _handle(engine, second).wait(timeout=5)
    assert landed == [0, 1, 0, 1]


def test_progress_thread_moves_without_the_caller():
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("progress thread needs MPI_THREAD_MULTIPLE")
    comm = FakeComm()
    engine = NonBlockingEngine(comm, progress_thread=True)
    try:
        landed = []
        task = _task(engine, _steps(4, landed), window=2)
        engine.submit(task)
        deadline = time.monotonic() + 10
        while not task.finished() and time.monotonic() < deadline:
            for _, _, r in list(comm.requests):
                r.done = True  # the "network" completes them; the caller never polls
            time.sleep(1e-3)
        assert task.finished() and landed == [0, 1, 2, 3]
    finally:
        engine.stop_thread()
    assert not engine.thread.is_alive()


# --------------------------------------------------------------------------- GPU staging
class FakeEvent:
    def __init__(self, name):
        self.name, self.done = name, False


class FakeDevice(staging.Device):
    """numpy arrays as "device" memory; each copy is queued on its stream and runs only
    when forced (``lazy``: a host wait, or a later op on the same stream / one waiting for
    it) or at once (eager). Logs issue and run order. Missing waits then read stale data
    (lazy), early slot reuse overwrites data still in MPI (eager). A copy engine copies
    contiguous memory only: packing a strided view and casting happen in ``work``."""

    def __init__(self, lazy):
        self.lazy = lazy
        self.log = []
        self.streams = {"d2h": collections.deque(), "h2d": collections.deque()}
        self.pinned_count = 0
        self.pinned_sizes = []
        self.scratch_sizes = []

    def pinned(self, n, dtype):
        self.pinned_count += 1
        self.pinned_sizes.append(n)
        return np.full(n, np.nan, dtype)  # garbage until a copy lands

    def scratch(self, n, dtype, like):
        self.scratch_sizes.append(n)
        return np.full(n, np.nan, dtype)

    def _queue(self, stream, name, fn, after=None):
        ev = FakeEvent(name)
        self.log.append(("issue", name))
        self.streams[stream].append((ev, fn, after))
        if not self.lazy:
            self._run_until(ev, stream)
        return ev

    def _run_until(self, ev, stream=None):
        if ev is None or ev.done:
            return
        streams = [stream] if stream else [s for s, q in self.streams.items()
                                           if any(e is ev for e, _, _ in q)]
        q = self.streams[streams[0]]
        while not ev.done:
            e, fn, after = q.popleft()
            self._run_until(after)  # the stream waits for that event first
            fn()
            e.done = True
            self.log.append(("run", e.name))

    @staticmethod
    def _check(part, host, work):
        assert host.shape == part.shape and host.flags.c_contiguous
        if work is None:  # a plain copy: contiguous, same dtype
            assert part.flags.c_contiguous and host.dtype == part.dtype
        else:
            assert work.shape == part.shape and work.flags.c_contiguous
            assert work.dtype == host.dtype

    def to_host(self, part, host, work=None, after=None):
        self._check(part, host, work)

        def run():
            if work is not None:
                work[...] = part.astype(work.dtype)  # widen / pack on the device
                host[...] = work
            else:
                host[...] = part
        return self._queue("d2h", f"d2h@{id(host)}", run, after)

    def to_device(self, host, part, work=None):
        self._check(part, host, work)

        def run():  # reads host when the copy runs, not now
            if work is None:
                part[...] = host
            else:
                work[...] = host
                part[...] = work.astype(part.dtype)  # round / scatter on the device
        return self._queue("h2d", f"h2d@{id(part)}", run)

    def wait(self, event):
        self._run_until(event)
        self.log.append(("wait", event.name))


def _buf(arg):
    """The array of an mpi4py buffer spec ``[array, type]``."""
    return arg[0] if isinstance(arg, list) else arg


def _run_call(calls):
    """Complete one collective call issued by every simulated rank (``calls[r]``)."""
    name, args = calls[0][0], [c[1] for c in calls]
    if name == "Sendrecv":  # (send, dest, tag, recv, source, tag): one ring step
        sends = [_buf(a[0]).copy() for a in args]
        for r, a in enumerate(args):
            src = a[4]
            assert args[src][1] == r and a[2] == args[src][5]  # the source sends here
            out = _buf(a[3])
            assert not np.shares_memory(out, _buf(a[0]))
            assert out.size == sends[src].size
            out[...] = sends[src]
    elif name == "Reduce_scatter_block":
        sends, recvs = [_buf(a[0]) for a in args], [_buf(a[1]) for a in args]
        total = np.sum([b.astype(np.float64) for b in sends], axis=0)
        n = recvs[0].size
        for r, out in enumerate(recvs):
            assert not np.shares_memory(out, sends[r])  # MPI forbids aliasing
            out[...] = total[r * n:(r + 1) * n]
    elif name == "Allgather":
        sends, recvs = [_buf(a[0]) for a in args], [_buf(a[1]) for a in args]
        for r, out in enumerate(recvs):
            assert not np.shares_memory(out, sends[r])
            out[...] = np.concatenate(sends)
    else:  # (IN_PLACE, [buf, type]) is reduced in place; ([buf, type], None) only sends
        bufs = [(a[0][0] if isinstance(a[0], list) else a[1][0]) for a in args]
        total = np.sum([b.astype(np.float64) for b in bufs], axis=0)
        for a, b in zip(args, bufs):
            if not isinstance(a[0], list):
                b[...] = total


def _sent(call):
    """What a call hands MPI to read, as bytes (MPI may read it until it completes)."""
    first = call[1][0]
    return (_buf(first) if isinstance(first, list) else _buf(call[1][1])).tobytes()


def _simulate(gens, window, on_issue):
    """Run one generator per simulated rank in lock step like the nonblocking engine:
    pipelined calls in flight up to ``window`` (completed oldest first), fences drained.
    MPI reads what it sends when the call completes; the test also checks that nothing
    changed it since the call was issued (a slot refilled too early)."""
    inflight = [collections.deque() for _ in gens]
    blocked = done = False

    def complete_oldest():
        entries = [q.popleft() for q in inflight]
        for call, sent in entries:
            assert _sent(call) == sent, f"{call[0]}: send buffer changed while in MPI"
        calls = [c for c, _ in entries]
        _run_call(calls)
        for c in calls:
            if c.land is not None:
                c.land()

    while True:
        if inflight[0] and (blocked or done or len(inflight[0]) >= window):
            complete_oldest()
            continue
        if done:
            return
        blocked = False
        steps = [next(g, None) for g in gens]
        if steps[0] is None:
            assert all(s is None for s in steps)
            done = True
            continue
        assert len({s[0] for s in steps}) == 1  # every rank issues the same call
        if steps[0].method is None:  # a pause: a fence
            blocked = True
            continue
        on_issue(steps[0])
        for q, s in zip(inflight, steps):
            q.append((s, _sent(s)))
        blocked = steps[0].fence


def _fill(rng, n, dtype):
    return (rng.integers(-64, 64, n) / 8).astype(dtype)


def _check_overlap(dev, issued, rounds, window, lands=True):
    """The copy of round k + 1 to the host was started before MPI got round k; round k's
    copy back before MPI got round k + window (nothing waited for it); a lazy device is
    waited on for a copy back only after the last call was issued."""
    log = dev.log
    d2h = [i for i, e in enumerate(log) if e[0] == "issue" and e[1].startswith("d2h")]
    assert len(d2h) == rounds == len(issued)
    for k in range(rounds - 1):
        assert d2h[k + 1] < issued[k]
    if not lands:
        return
    h2d = [i for i, e in enumerate(log) if e[0] == "issue" and e[1].startswith("h2d")]
    assert len(h2d) == rounds
    for k in range(rounds - window):
        assert h2d[k] < issued[k + window]
    if dev.lazy and rounds > 2:
        first_wait = min(i for i, e in enumerate(log)
                         if e[0] == "wait" and e[1].startswith("h2d"))
        assert first_wait > issued[-1]


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("dtype", [float32, np.float64, float16, bfloat16])
@pytest.mark.parametrize("numel,seg,window", [(1000, 96, 1), (1000, 96, 3), (50, 96, 2),
                                              (301, 100, 8), (17, 4, 2)])
@pytest.mark.parametrize("root", [None, 1])
def test_staging_pipeline_results_and_overlap(lazy, dtype, numel, seg, window, root):
    from mpifusion.comm.collectives import allreduce_steps

    nranks, rng = 3, np.random.default_rng(numel + seg)
    data = [_fill(rng, numel, dtype) for _ in range(nranks)]
    ref = np.sum([d.astype(np.float64) for d in data], axis=0) * np.float64(0.5)
    devs = [FakeDevice(lazy) for _ in range(nranks)]
    bufs = [d.copy() for d in data]
    gens = [allreduce_steps(b, 0.5, seg, root, r, window=window, device=dv)
            for r, (b, dv) in enumerate(zip(bufs, devs))]
    issued = []
    _simulate(gens, window, lambda step: issued.append(len(devs[0].log)))
    for r, (b, d) in enumerate(zip(bufs, data)):
        if root is None or r == root:
            np.testing.assert_array_equal(b.astype(np.float64),
                                          ref.astype(dtype).astype(np.float64))
        else:
            np.testing.assert_array_equal(b, d)  # a non-root rank's buffer is untouched
    nseg = -(-numel // seg)
    assert devs[0].pinned_count == min(window + 2, nseg)
    _check_overlap(devs[0], issued, nseg, window, lands=root is None)


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("dtype", [float32, np.float64, float16, bfloat16])
@pytest.mark.parametrize("numel,seg,window", [(1000, 96, 1), (1000, 96, 3), (50, 96, 2),
                                              (17, 4, 2)])
def test_reduce_non_root_scales_what_it_sent(staged, dtype, numel, seg, window):
    """``sent_scale``: a non-root rank ends with its own values times the factor, rounded
    once from fp32 for half precision (what scaling the whole buffer afterwards gives); the
    root's result is untouched by it; nothing changes a segment while MPI reads it."""
    from mpifusion.comm.collectives import allreduce_steps

    nranks, root, third = 3, 1, 1.0 / 3
    rng = np.random.default_rng(numel * 7 + seg)
    data = [_fill(rng, numel, dtype) for _ in range(nranks)]
    bufs = [d.copy() for d in data]
    devs = [FakeDevice(False) if staged else None for _ in range(nranks)]
    gens = [allreduce_steps(b, 0.5, seg, root, r, window=window, device=dv, sent_scale=third)
            for r, (b, dv) in enumerate(zip(bufs, devs))]
    _simulate(gens, window, lambda step: None)
    total = np.sum([d.astype(np.float64) for d in data], axis=0) * 0.5
    for r, (b, d) in enumerate(zip(bufs, data)):
        if r == root:
            want = total.astype(dtype)
        elif np.dtype(dtype).itemsize < 4:
            want = (d.astype(np.float32) * np.float32(third)).astype(dtype)
        else:
            want = d * np.dtype(dtype).type(third)
        np.testing.assert_array_equal(b.view(np.uint8), want.view(np.uint8), err_msg=f"rank {r}")


@pytest.mark.parametrize("dtype", [float32, np.float64, float16, bfloat16])
@pytest.mark.parametrize("nranks", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("numel,seg,window", [(1000, 96, 1), (1000, 96, 3), (50, 96, 2),
                                              (301, 100, 8), (17, 4, 2), (5, 3, 2), (0, 8, 2)])
def test_ring_allreduce_sums_every_chunk_once(dtype, nranks, numel, seg, window):
    """The ring (allreduce='ring'): every rank ends with the same bits, equal to the float64
    sum (exact on these values), scaled and rounded once; chunks smaller than one element
    per rank, segments the ranks do not divide, windows wider than the segments."""
    from mpifusion.comm.collectives import allreduce_steps

    rng = np.random.default_rng(numel * 31 + nranks + seg)
    data = [_fill(rng, numel, dtype) for _ in range(nranks)]
    ref = np.sum([d.astype(np.float64) for d in data], axis=0) * 0.5
    bufs = [d.copy() for d in data]
    gens = [allreduce_steps(b, 0.5, seg, None, r, window=window, ring=nranks)
            for r, b in enumerate(bufs)]
    calls = []
    _simulate(gens, window, calls.append)
    for r, b in enumerate(bufs):
        np.testing.assert_array_equal(b.view(np.uint8), bufs[0].view(np.uint8),
                                      err_msg=f"rank {r}")
    np.testing.assert_array_equal(bufs[0].astype(np.float64), ref.astype(dtype).astype(np.float64))
    segments = -(-numel // seg) if numel else 0
    assert len(calls) == segments * 2 * (nranks - 1)
    assert all(c[0] == "Sendrecv" for c in calls)


#: (shard, seg, window): shards a piece does not divide, a piece (seg // nranks) larger
#: than the shard, seg below nranks (pieces of one element), an empty shard
RS_CASES = [(37, 16, 1), (37, 16, 2), (37, 16, 8), (10, 96, 2), (1, 8, 3), (100, 24, 3),
            (23, 3, 2), (0, 8, 2)]
HALVES_AND_FULL = [float32, np.float64, float16, bfloat16]


def _check_rounds(dev, issued, shard, seg, nranks, window, widened):
    """A collective in rounds of piece k of every shard: overlap order, and memory bounded
    by the slots, not the buffer: window + 2 send and receive slots, one round wide, and a
    device scratch slot each where a round is widened or strided (packed or scattered)."""
    piece = max(1, min(seg // nranks, shard))
    rounds = -(-shard // piece)
    _check_overlap(dev, issued, rounds, window)
    slots = min(window + 2, rounds)
    assert dev.pinned_count == 2 * slots
    assert max(dev.pinned_sizes, default=0) <= nranks * piece
    assert max(dev.scratch_sizes, default=0) <= nranks * piece
    strided = nranks > 1 and rounds > 1
    assert len(dev.scratch_sizes) == (slots if widened or strided else 0)


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("dtype", HALVES_AND_FULL, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("nranks", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("shard,seg,window", RS_CASES)
@pytest.mark.parametrize("inplace", [False, True])
def test_staged_reduce_scatter_results_and_overlap(lazy, dtype, nranks, shard, seg, window,
                                                    inplace):
    """Round k: piece k of every shard packed (and widened) on the device, one copy to the
    host, Reduce_scatter_block, this rank's piece back (rounded on the device)."""
    from mpifusion.comm.collectives import reduce_scatter_steps

    rng = np.random.default_rng(1000 * nranks + shard + seg)
    numel = shard * nranks
    data = [_fill(rng, numel, dtype) for _ in range(nranks)]
    total = np.sum([d.astype(np.float64) for d in data], axis=0) * np.float64(0.5)
    devs = [FakeDevice(lazy) for _ in range(nranks)]
    sends = [d.copy() for d in data]
    recvs = [s[r * shard:(r + 1) * shard] if inplace else np.full(shard, -7, dtype)
             for r, s in enumerate(sends)]
    gens = [reduce_scatter_steps(s, o, 0.5, seg, nranks, r, window=window, device=dv)
            for r, (s, o, dv) in enumerate(zip(sends, recvs, devs))]
    issued = []
    _simulate(gens, window, lambda step: issued.append(len(devs[0].log)))
    for r, (o, send, d) in enumerate(zip(recvs, sends, data)):
        want = total[r * shard:(r + 1) * shard].astype(dtype).astype(np.float64)
        np.testing.assert_array_equal(o.astype(np.float64), want, err_msg=f"rank {r}")
        if not inplace:
            np.testing.assert_array_equal(send, d)  # the send buffer is only read
    half = np.dtype(dtype) in (np.dtype(float16), np.dtype(bfloat16))
    _check_rounds(devs[0], issued, shard, seg, nranks, window, widened=half)


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("dtype", HALVES_AND_FULL, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("nranks", [1, 2, 3, 5])
@pytest.mark.parametrize("shard,seg,window", RS_CASES)
@pytest.mark.parametrize("inplace", [False, True])
def test_reduce_scatter_scales_the_other_shards(staged, dtype, nranks, shard, seg, window,
                                                inplace):
    """``others_scale``: the other ranks' shards of the send buffer end with this rank's own
    values times the factor, rounded once from fp32 for half precision (what Paddle's
    scale_grads of the whole buffer gives); this rank's share is the scaled sum; nothing
    changes what MPI reads while it reads it (the one-call path scales only afterwards)."""
    from mpifusion.comm.collectives import reduce_scatter_steps

    third = 1.0 / 3
    rng = np.random.default_rng(77 * nranks + shard + seg)
    numel = shard * nranks
    data = [_fill(rng, numel, dtype) for _ in range(nranks)]
    total = np.sum([d.astype(np.float64) for d in data], axis=0) * 0.5
    sends = [d.copy() for d in data]
    recvs = [s[r * shard:(r + 1) * shard] if inplace else np.full(shard, -7, dtype)
             for r, s in enumerate(sends)]
    devs = [FakeDevice(False) if staged else None for _ in range(nranks)]
    gens = [reduce_scatter_steps(s, o, 0.5, seg, nranks, r, window=window, device=dv,
                                 others_scale=third)
            for r, (s, o, dv) in enumerate(zip(sends, recvs, devs))]
    _simulate(gens, window, lambda step: None)
    for r, (o, send, d) in enumerate(zip(recvs, sends, data)):
        mine = slice(r * shard, (r + 1) * shard)
        np.testing.assert_array_equal(o.astype(np.float64),
                                      total[mine].astype(dtype).astype(np.float64))
        if np.dtype(dtype).itemsize < 4:
            scaled = (d.astype(np.float32) * np.float32(third)).astype(dtype)
        else:
            scaled = d * np.dtype(dtype).type(third)
        others = np.ones(numel, bool)
        others[mine] = False
        np.testing.assert_array_equal(send[others].view(np.uint8), scaled[others].view(np.uint8),
                                      err_msg=f"rank {r}")
        if not inplace:
            np.testing.assert_array_equal(send[mine], d[mine])  # its own share: only read


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("dtype", HALVES_AND_FULL, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("nranks", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("shard,seg,window", RS_CASES)
def test_staged_allgather_results_and_overlap(lazy, dtype, nranks, shard, seg, window):
    """Round k: piece k of this rank's shard to the host, Allgather (send and receive slots),
    the block back and scattered into piece k of every shard on the device; raw bytes."""
    from mpifusion.comm.collectives import allgather_steps

    rng = np.random.default_rng(7 * nranks + shard + seg)
    numel = shard * nranks
    want = _fill(rng, numel, dtype)
    want[: min(3, numel)] = np.array([np.nan, -0.0, np.inf][: min(3, numel)], dtype)  # raw
    bufs = []
    for r in range(nranks):  # only its own shard is this rank's; the rest is stale
        b = np.full(numel, 99, dtype)
        b[r * shard:(r + 1) * shard] = want[r * shard:(r + 1) * shard]
        bufs.append(b)
    devs = [FakeDevice(lazy) for _ in range(nranks)]
    gens = [allgather_steps(b, seg, nranks, r, window=window, device=dv)
            for r, (b, dv) in enumerate(zip(bufs, devs))]
    issued = []
    _simulate(gens, window, lambda step: issued.append(len(devs[0].log)))
    for r, b in enumerate(bufs):
        assert b.tobytes() == want.tobytes(), f"rank {r}"
    _check_rounds(devs[0], issued, shard, seg, nranks, window, widened=False)  # raw bytes


# ------------------------------------------------------- a stated dependency (``ahead``)
class CountingComm(FakeComm):
    """Records, for every call issued, how many earlier calls were still in flight."""

    def __getattr__(self, name):
        issue = super().__getattr__(name)

        def counted(*args, **kwargs):
            pending = sum(not r.done for _, _, r in self.requests)
            r = issue(*args, **kwargs)
            self.requests[-1] = (name, (args, pending), r)
            return r
        return counted


def _ahead_steps(aheads, landed, seen, comm):
    """One pipelined call per entry of ``aheads``; before each, what is still in flight."""
    for k, ahead in enumerate(aheads):
        seen.append(sum(not r.done for _, _, r in comm.requests))
        yield pipelined("Allreduce", (k,), land=lambda k=k: landed.append(k), comm=comm,
                        ahead=ahead)
    yield FENCE


@pytest.mark.parametrize("engine_kind", ["thread", "nonblocking"])
def test_ahead_bounds_what_is_in_flight_and_lands_in_order(engine_kind):
    """A call with ``ahead=k`` is issued once at most k earlier calls are in flight (the
    older ones landed, in issue order), and the generator runs on while they fly."""
    from mpifusion.comm.engines import ThreadEngine

    comm = CountingComm()
    aheads = [3, 3, 1, 3, 2, 0, 3, 3, 3, 2]
    engine = (ThreadEngine(comm) if engine_kind == "thread"
              else NonBlockingEngine(comm, progress_thread=False))
    landed, seen = [], []
    task = _task(engine, _ahead_steps(aheads, landed, seen, comm), window=8)
    engine.submit(task)
    handle = _handle(engine, task)
    if engine_kind == "nonblocking":
        while not task.finished():  # complete the oldest, as MPI might
            pending = [r for _, _, r in comm.requests if not r.done]
            if pending:
                pending[0].done = True
            engine.progress()
    handle.wait(timeout=10)
    assert landed == list(range(len(aheads)))
    issued = [(a[0][0], a[1]) for _, a, _ in comm.requests]
    assert [k for k, _ in issued] == list(range(len(aheads)))
    for (k, pending), ahead in zip(issued, aheads):
        assert pending <= ahead, (k, pending, ahead)
    if engine_kind == "thread":  # nothing completes on its own: each waits only as needed
        bounded = _bounded(aheads)
        assert [p for _, p in issued] == bounded
        # the generator ran on with the calls in flight (up to 4 here)
        assert seen[1:] == [b + 1 for b in bounded[:-1]] and max(seen) == 4
    engine.close(1.0)


def _bounded(aheads):
    """What the thread engine leaves in flight before each call when none completes by
    itself: ``min(calls in flight, ahead)``."""
    out, inflight = [], 0
    for a in aheads:
        inflight = min(inflight, a)
        out.append(inflight)
        inflight += 1
    return out


# ------------------------------------------------------------- the call's protocol
def test_a_call_says_it_is_non_blocking_in_a_field_not_in_its_name():
    """``as_nonblocking`` marks every MPI call it turns into its non-blocking form, keeps
    calls already marked (no ``IIallgather``), and a call is built by keyword: every field
    of ``pipelined`` lands where it is named."""
    from mpifusion.comm.call import as_nonblocking

    land, comm = (lambda: None), object()
    calls = [Call("Allreduce", (1,)), Call("Iallgather", (2,), nonblocking=True), FENCE,
             pipelined("Reduce", (3,), land=land, comm=comm, ahead=2)]
    out = list(as_nonblocking(iter(calls)))
    assert [(c.method, c.nonblocking) for c in out] == [
        ("Iallreduce", True), ("Iallgather", True), (None, False), ("Ireduce", True)]
    p = calls[3]
    assert (p.land, p.fence, p.comm, p.ahead, p.nonblocking, p.pause, p.check) == (
        land, False, comm, 2, False, 0.0, False)
    # a name that merely starts with I is not taken for a request
    assert Call("Info").nonblocking is False
