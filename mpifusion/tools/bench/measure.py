"""The measurements of ``mpifusion bench``, in the order they run.

Each measurement is a function of one :class:`Bench` that fills its own keys of
``Bench.res``; :data:`MEASUREMENTS` lists them. A new sweep is one function here and one
table in ``report.TABLES``.
"""
from __future__ import annotations

import functools
import os
import platform
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import mpi4py
import numpy as np
from mpi4py import MPI

from ...comm import Communicator
from ...comm.communicator import allreduce_way
from ...config import DEFAULT_WINDOW, CommOptions
from ...machine import cpu_model
from ...plan.actions import HookAction
from ...runtime.buffer import FusedCommBuffer
from ...runtime.param import Param
from ..bandwidth import algbw, bus_factor, busbw
from ..timing import mpi_name, round_ratio, timeit, timeit_many
from .baselines import gloo_allreduce, raw_candidates, raw_other, segmented_allreduce
from .cluster import measure_cluster
from .probes import add_grad_cost, overlap, peak_memory
from .settings import Settings, auto_group_sweep, auto_size_sweep
from .workload import (HALF_DTYPE, auto_strategy, MiB, build_buffers, default_segment,
                       fallback_reason, full_step, grad_bytes, make_params, median_step,
                       usable_strategies)

#: buffer sizes of the small-buffer latency check (shm must be no slower than thread)
SMALL_BUFFER_BYTES = (4 << 10, 16 << 10, 64 << 10)
#: steps per timed run of one small buffer: each step is timed, and the run's time is their
#: median. A step is 25-60 us, where one descheduling of a rank (or a wake-up of another
#: candidate's idle comm thread, which polls for 1 s after its last use) added milliseconds
#: to a run's mean: with the mean of 20 steps in 5 rounds, three runs of one build gave shm
#: / thread at 4 KiB as 0.75, 0.89 and 1.13 (Open MPI, 2 ranks on 2 cores)
SMALL_BUFFER_REPS = 50
#: rounds per ``--iters``
SMALL_BUFFER_ROUNDS_PER_ITER = 4


@dataclass
class Bench:
    """One benchmark run: settings, communicators and the results dict ``res`` that the
    measurements fill in and the report reads (each section its own key)."""

    s: Settings
    world: MPI.Comm
    comm: MPI.Comm  # a duplicate: barriers and raw candidates never touch mpifusion's comms
    res: Dict[str, Any] = field(default_factory=dict)
    #: the strategy a default buffer takes here (``measure_meta`` learns it)
    auto: str = "thread"

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def n(self) -> int:
        return self.comm.Get_size()

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def params(self, fill: bool = False) -> List[Param]:
        return make_params(self.s.preset, self.s.dtype, seed=self.rank, fill=fill)

    def buffers(self, act: HookAction, strategy: str, group_bytes: Optional[int] = None,
                **kwargs: Any) -> List[FusedCommBuffer]:
        return build_buffers(self.params(), act, self.s.group_bytes if group_bytes is None
                             else group_bytes, self.comm, strategy, **kwargs)


def measure_meta(b: Bench) -> None:
    """What the run is: model, ranks, MPI, versions, defaults; and the strategies this job
    cannot run, dropped with their reason (the report states it)."""
    b.auto = auto_strategy(b.comm)
    b.s.strategies, skipped = usable_strategies(b.s.strategies, MPI.Query_thread())
    b.res["skipped_strategies"] = skipped
    for name, why in skipped.items():
        b.say(f"# strategy {name} skipped: {why}")
    if not b.s.strategies:  # the step rows need one strategy: the one a default run takes
        b.s.strategies = [b.auto]
    params = b.params()
    b.res["meta"] = {
        "preset": b.s.preset, "dtype": str(params[0].data.dtype), "params": len(params),
        "param_bytes": int(sum(p.data.nbytes for p in params)), "nranks": b.n,
        "mpi": mpi_name(), "mpi4py": mpi4py.__version__,
        "numpy": np.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "thread_level": MPI.Query_thread(), "default_strategy": b.auto,
        "default_segment_bytes": default_segment(b.comm), "group_bytes": b.s.group_bytes,
        "iters": b.s.iters, "warmup": b.s.warmup,
        "busbw_factor": bus_factor("all_reduce", b.n),
    }
    m = b.res["meta"]
    b.say(f"# mpifusion bench: {m['preset']} ({m['params']} params, "
          f"{m['param_bytes'] / 1e6:.3g} MB {m['dtype']}), {b.n} ranks, {m['mpi']}, "
          f"mpi4py {m['mpi4py']}")


def measure_allreduce_steps(b: Bench) -> None:
    """mpifusion's ALL_REDUCE step per strategy against raw MPI and gloo, in rounds."""
    b.say("# measuring ALL_REDUCE steps against raw MPI, gloo and memcpy (in rounds) ...")
    fns: Dict[str, Callable[[], Any]] = {}
    meta_of: Dict[str, dict] = {}
    keep = []
    for strategy, avg in [(s, False) for s in b.s.strategies] + [(b.auto, True)]:
        buffers = b.buffers(HookAction.ALL_REDUCE, strategy, use_reduce_avg=avg)
        keep.append(buffers)
        label = (f"ALL_REDUCE{' (use_reduce_avg: 1/n per segment)' if avg else ''} "
                 f"[{strategy}]")
        fns[label] = (lambda bufs=buffers: full_step(bufs, False))
        meta_of[label] = {"action": "ALL_REDUCE", "strategy": strategy, "reduce_avg": avg,
                          "buffers": len(buffers), "bytes": grad_bytes(buffers),
                          "fallback": fallback_reason(buffers, strategy)}
    nbytes = meta_of[f"ALL_REDUCE [{b.s.strategies[0]}]"]["bytes"]
    # the half-precision step of the fastest strategy beside an fp32 run: half the bytes move
    half_key = None
    if np.dtype(b.params()[0].data.dtype) == np.float32:
        hs = "shm" if "shm" in b.s.strategies else b.auto
        half = build_buffers(make_params(b.s.preset, HALF_DTYPE, seed=b.rank, fill=False),
                             HookAction.ALL_REDUCE, b.s.group_bytes, b.comm, hs)
        keep.append(half)
        half_key = f"ALL_REDUCE {HALF_DTYPE} [{hs}]"
        fns[half_key] = (lambda bufs=half: full_step(bufs, False))
        meta_of[half_key] = {"action": "ALL_REDUCE", "strategy": hs, "dtype": HALF_DTYPE,
                             "buffers": len(half), "bytes": grad_bytes(half),
                             "fallback": fallback_reason(half, hs)}
    # the memcpy floor: every rank copies the same grad bytes at once (numpy)
    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    memcpy_key = "memcpy floor (numpy copy of the grad bytes)"
    fns[memcpy_key] = lambda: np.copyto(dst, src)
    b.res["meta"]["grad_bytes"] = nbytes
    b.say(f"# grads: {nbytes / 1e6:.3g} MB in fused buffers of {b.s.group_bytes / MiB:g} MiB "
          f"groups")
    raw_fns = raw_candidates(b.comm, nbytes, b.params(), 1.0 / b.n, b.s.segments)
    gloo = gloo_allreduce(b.comm, nbytes) if b.s.torch else None
    gloo_key = None
    if gloo is not None and "error" not in gloo:
        gloo_key = f"torch {gloo['torch']} gloo all_reduce (one call)"
        raw_fns[gloo_key] = gloo["fn"]
    elif gloo is not None:
        b.res["gloo_error"] = gloo["error"]
    timed = timeit_many({**fns, **raw_fns}, b.comm, b.s.iters, b.s.warmup)
    if gloo_key:
        gloo["close"]()
    b.res["memcpy"] = dict(timed.pop(memcpy_key), name=memcpy_key, bytes=nbytes)
    fns.pop(memcpy_key)
    if half_key:
        b.res["half_step"] = dict(timed.pop(half_key), name=half_key, **meta_of[half_key])
        fns.pop(half_key)
    b.res["steps"] = {k: dict(timed[k], **meta_of[k]) for k in fns}
    b.res["raw"] = {k: timed[k] for k in raw_fns}
    del keep, src, dst


def measure_other_steps(b: Bench) -> None:
    """REDUCE and REDUCE_SCATTER + sync_params per strategy against their raw floors."""
    b.say("# measuring REDUCE and REDUCE_SCATTER steps (in rounds) ...")
    fns: Dict[str, Callable[[], Any]] = {}
    meta_of: Dict[str, dict] = {}
    keep = []
    for strategy in b.s.strategies:
        for act in (HookAction.REDUCE, HookAction.REDUCE_SCATTER):
            buffers = b.buffers(act, strategy)
            keep.append(buffers)
            sync = act == HookAction.REDUCE_SCATTER
            label = f"{act.name}{' + sync_params' if sync else ''} [{strategy}]"
            fns[label] = (lambda bufs=buffers, y=sync: full_step(bufs, y))
            meta_of[label] = {"action": act.name, "strategy": strategy, "reduce_avg": False,
                              "buffers": len(buffers), "bytes": grad_bytes(buffers)}
    other = raw_other(b.comm, b.res["meta"]["grad_bytes"])
    timed = timeit_many({**fns, **other}, b.comm, b.s.iters, b.s.warmup)
    b.res["steps"].update({k: dict(timed[k], **meta_of[k]) for k in fns})
    b.res["raw"].update({k: timed[k] for k in other})
    raw = b.res["raw"]
    floor = min((k for k in raw if k.startswith("Allreduce")), key=lambda k: raw[k]["median_s"])
    b.res["floor"] = dict(raw[floor], name=floor)
    scaled = min((k for k in raw if k.startswith("floor+scale")),
                 key=lambda k: raw[k]["median_s"])
    b.res["floor_with_scale"] = dict(raw[scaled], name=scaled)
    del keep


def measure_window_sweep(b: Bench) -> None:
    """The ALL_REDUCE step, ``nonblocking`` at each window against ``thread``, in rounds
    (ratios within one round: the machine's load drifts between rounds), with the raw
    blocking and non-blocking segmented all-reduce of the same bytes (no 1/n)."""
    b.say("# nonblocking window sweep against thread (in rounds) ...")
    fns: Dict[str, Callable[[], Any]] = {}
    keep = []
    thread = "ALL_REDUCE [thread]"
    if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
        keep.append(b.buffers(HookAction.ALL_REDUCE, "thread"))
        fns[thread] = (lambda bufs=keep[-1]: full_step(bufs, False))
    for w in b.s.windows:
        keep.append(b.buffers(HookAction.ALL_REDUCE, "nonblocking", window=w))
        fns[f"ALL_REDUCE [nonblocking, window {w}]"] = (
            lambda bufs=keep[-1]: full_step(bufs, False))
    if allreduce_way("auto", "nonblocking") == "ring":  # the library's path it replaces
        w = DEFAULT_WINDOW
        keep.append(b.buffers(HookAction.ALL_REDUCE, "nonblocking", window=w, allreduce="mpi"))
        fns[f"ALL_REDUCE [nonblocking, library Iallreduce, window {w}]"] = (
            lambda bufs=keep[-1]: full_step(bufs, False))
    # the library's own floors: the same bytes in the same segments, blocking and all
    # non-blocking at once (what any nonblocking window can at best reach)
    flat = np.ones(grad_bytes(keep[-1]) // 4, np.float32)
    seg = max(1, default_segment(b.comm) // 4)
    fns["raw Allreduce, blocking segments"] = segmented_allreduce(b.comm, flat, seg * 4)
    fns["raw Iallreduce, all segments in flight, Waitall"] = lambda: MPI.Request.Waitall(
        [b.comm.Iallreduce(MPI.IN_PLACE, [flat[i:i + seg], MPI.FLOAT])
         for i in range(0, flat.size, seg)])
    timed = timeit_many(fns, b.comm, b.s.iters, b.s.warmup)
    rows = [{"what": k, "window": (int(k.rsplit(" ", 1)[1][:-1]) if "window " in k else None),
             "median_s": v["median_s"], "min_s": v["min_s"], "times_s": v["times_s"],
             "x_thread": round_ratio(v, timed[thread]) if thread in timed else None}
            for k, v in timed.items()]
    b.res["window_sweep"] = rows
    del keep


def measure_small_buffers(b: Bench) -> None:
    """Latency of one small fused buffer (4-64 KiB) per strategy, in rounds: the target asks
    shm to be no slower than thread here, where a sync is a few barriers, not bytes."""
    b.say("# small buffers: one fused buffer per strategy, 4-64 KiB (in rounds) ...")
    rows = []
    reps = SMALL_BUFFER_REPS
    for size in SMALL_BUFFER_BYTES:
        fns: Dict[str, Callable[[], Any]] = {}
        keep = []
        for strategy in b.s.strategies:
            param = Param("g", np.zeros(size // 4, np.float32))
            bufs = build_buffers([param], HookAction.ALL_REDUCE, size, b.comm, strategy)
            keep.append(bufs)
            fns[strategy] = functools.partial(median_step, bufs, reps)
        timed = timeit_many(fns, b.comm, SMALL_BUFFER_ROUNDS_PER_ITER * max(b.s.iters, 3),
                            max(1, b.s.warmup), self_timed=True)
        row: Dict[str, Any] = {"bytes": size, "reps": reps}
        for k, v in timed.items():
            row[k] = {"median_s": v["median_s"], "times_s": v["times_s"],
                      "x_thread": round_ratio(v, timed["thread"]) if "thread" in timed
                      else None}
        rows.append(row)
        for bufs in keep:
            for buf in bufs:
                buf.close()
    b.res["small_buffers"] = rows


def measure_size_sweep(b: Bench) -> None:
    """One array of each size: the raw floor, a naive Iallreduce and each Communicator on a
    plain numpy array; ``shm`` and ``hierarchical`` also on an array in their shared window
    (``_in_window``), as a buffer's storage is: a plain array is staged through the
    stream's scratch, a copy in and a copy out."""
    b.say("# sweeping message sizes and fusion group sizes ...")
    sizes = b.s.size_sweep or auto_size_sweep(b.res["meta"]["grad_bytes"])
    comms = {s: Communicator(b.world, CommOptions(strategy=s)) for s in b.s.strategies}
    windows = {}  # one region of the largest size per communicator that has windows
    for s, c in comms.items():
        region = c.reserve([(max(1, max(sizes) // 4), np.float32)], np.empty(0, np.float32),
                           where=f"rank {b.comm.rank}: bench size sweep [{s}]")
        if region:
            windows[s] = region[0]
    rows = []
    segment = default_segment(b.comm)
    for size in sizes:
        buf = np.zeros(max(1, size // 4), np.float32)  # summed again and again: ones overflow
        iters = int(min(200, max(b.s.iters, 2e8 / size)))
        fns = {"raw_floor": segmented_allreduce(b.comm, buf, segment),
               "naive_iallreduce": lambda: b.comm.Iallreduce(MPI.IN_PLACE,
                                                             [buf, MPI.FLOAT]).Wait()}
        for s, c in comms.items():
            fns[f"mpifusion_{s}"] = (lambda c=c: c.allreduce(buf).wait())
            if s in windows:
                shared = windows[s][:buf.size]
                shared[...] = 0
                fns[f"mpifusion_{s}_in_window"] = (lambda c=c, a=shared: c.allreduce(a).wait())
        row: Dict[str, Any] = {"bytes": size}
        for key, r in timeit_many(fns, b.comm, iters, max(1, b.s.warmup)).items():
            row[key] = {"median_s": r["median_s"], "algbw_GBps": algbw(size, r["median_s"]),
                        "busbw_GBps": busbw("all_reduce", size, r["median_s"], b.n)}
        rows.append(row)
    for c in comms.values():
        c.barrier()
    b.res["size_sweep"] = rows


def measure_group_sweep(b: Bench) -> None:
    """The full ALL_REDUCE step (default strategy) at each fusion group size."""
    nbytes = b.res["meta"]["grad_bytes"]
    rows = []
    for g in b.s.group_sweep or auto_group_sweep(nbytes):
        buffers = b.buffers(HookAction.ALL_REDUCE, b.auto, group_bytes=int(g * MiB))
        r = timeit(lambda bufs=buffers: full_step(bufs, False), b.comm, b.s.iters, b.s.warmup)
        rows.append({"label": f"{g:g}", "group_mib": g, "buffers": len(buffers),
                     "median_s": r["median_s"],
                     "busbw_GBps": busbw("all_reduce", nbytes, r["median_s"], b.n)})
        del buffers
    b.res["group_sweep"] = rows


def measure_overlap_and_add_grad(b: Bench) -> None:
    """Overlap with emulated compute (OSU) per strategy; add_grad cost (default strategy)."""
    b.say("# overlap, add_grad cost, peak memory ...")
    b.res["overlap"] = {}
    for strategy in b.s.strategies:
        buffers = b.buffers(HookAction.ALL_REDUCE, strategy)
        for mode in ("device", "cpu"):
            b.res["overlap"][f"{strategy}/{mode}"] = overlap(buffers, b.comm, b.s.iters,
                                                             b.s.warmup, mode)
        if strategy == b.auto or "add_grad" not in b.res:
            b.res["add_grad"] = add_grad_cost(buffers, b.comm, max(b.s.iters, 5))
        del buffers


def measure_memory(b: Bench) -> None:
    """Peak memory during steps, fresh params, one action at a time."""
    b.res["memory"] = {a.name: peak_memory(b.s.preset, b.s.dtype, a, b.s.group_bytes, b.comm,
                                           b.auto) for a in HookAction}
    b.res["memory"]["ru_maxrss_kB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure_order(b: Bench) -> None:
    """What order safety costs (default strategy, ALL_REDUCE): the strict order's check
    before each collective against no check, on the full step and per small collective, and
    the negotiated order's rounds against the verified strict order."""
    b.say("# cost of the order check and of the negotiated order ...")
    verified = b.buffers(HookAction.ALL_REDUCE, b.auto)
    plain = b.buffers(HookAction.ALL_REDUCE, b.auto, verify_order=False)
    # A B A in each round: the first run of a round is often slower (cache, other load)
    steps = timeit_many({"verified": lambda: full_step(verified, False),
                         "unverified": lambda: full_step(plain, False),
                         "verified, again": lambda: full_step(verified, False)},
                        b.comm, b.s.iters, b.s.warmup)
    both = [(x + y) / 2 for x, y in zip(steps["verified"]["times_s"],
                                         steps["verified, again"]["times_s"])]
    steps["verified"] = {"median_s": statistics.median(both), "times_s": both}
    del plain
    negotiated = b.buffers(HookAction.ALL_REDUCE, b.auto, order="negotiated")
    steps.update({("negotiated" if k == "n" else "verified (again)"): v for k, v in timeit_many(
        {"n": lambda: full_step(negotiated, False), "v": lambda: full_step(verified, False)},
        b.comm, b.s.iters, b.s.warmup).items()})
    rows = [{"what": f"ALL_REDUCE step, {len(verified)} buffers: verified / unverified",
             "a_s": steps["verified"]["median_s"], "b_s": steps["unverified"]["median_s"],
             "ratio": round_ratio(steps["verified"], steps["unverified"])},
            {"what": "ALL_REDUCE step: negotiated / verified strict",
             "a_s": steps["negotiated"]["median_s"], "b_s": steps["verified (again)"]["median_s"],
             "ratio": round_ratio(steps["negotiated"], steps["verified (again)"])}]
    nbuffers = len(verified)
    del verified, negotiated
    for nbytes in (4 << 10, 256 << 10):  # one small collective: the check's own latency
        x = np.zeros(nbytes // 4, np.float32)
        comms = {v: Communicator(b.world, CommOptions(strategy=b.auto, verify_order=v))
                 for v in (True, False)}
        reps = 50
        r = timeit_many({v: (lambda c=c: [c.allreduce(x).wait() for _ in range(reps)])
                         for v, c in comms.items()}, b.comm, max(b.s.iters, 10), 2)
        rows.append({"what": f"one {nbytes >> 10} KiB allreduce: verified / unverified",
                     "a_s": r[True]["median_s"] / reps, "b_s": r[False]["median_s"] / reps,
                     "ratio": round_ratio(r[True], r[False])})
        for c in comms.values():
            c.barrier()
    # The step ratio drowns in noise on a loaded machine; the check's absolute cost does not:
    # one check per collective (the 4 KiB difference), times the buffers, over the step.
    check_s = max(0.0, rows[2]["a_s"] - rows[2]["b_s"])
    b.res["order"] = rows
    b.res["order_check"] = {"per_collective_s": check_s, "buffers": nbuffers,
                            "pct_of_step": 100 * nbuffers * check_s / rows[0]["b_s"]}


#: the measurements, in order; each fills its own keys of ``Bench.res``. A new sweep is one
#: function here and one table in ``report.TABLES``. ``--only NAME`` runs ``measure_meta``
#: and ``measure_NAME`` alone.
MEASUREMENTS: List[Callable[[Bench], None]] = [
    measure_meta, measure_allreduce_steps, measure_other_steps, measure_window_sweep,
    measure_small_buffers, measure_size_sweep, measure_group_sweep, measure_overlap_and_add_grad, measure_memory,
    measure_order, measure_cluster,
]
