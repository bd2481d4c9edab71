"""``mpifusion bench``: mpifusion's gradient sync side by side with raw MPI, OSU/nccl-tests style.

Run as ``mpiexec -n 2 mpifusion bench``. One run measures, on the same bytes (a preset's
gradients, GPT-2-small fp32 by default):

* mpifusion's full step (``add_grad`` of every param, comm, ``scale_grads``) for ALL_REDUCE,
  REDUCE and REDUCE_SCATTER (+ ``sync_params``), per communication strategy;
* the raw MPI candidates on one contiguous buffer (the floor for this MPI), a naive
  ``Iallreduce`` of the flat buffer, per-param ``Iallreduce`` and torch gloo (when installed);
* a sweep of message sizes (algbw/busbw, nccl-tests definitions, ``tools.bandwidth``) and of
  fusion group sizes, both up to the model's grad bytes unless given;
* overlap with emulated compute (OSU's method), ``add_grad`` cost per param and peak memory.

Times are the slowest rank's, median over ``--iters`` (after ``--warmup``). Only rank 0 prints
and writes the JSON and PNG (into ``--out``, default ``bench_out/``). The targets shown are
those that apply to the model (the speed ratios are set for bandwidth-bound syncs); they
inform, they do not set the exit code: 0 after a run, 2 for bad arguments (checked on every
rank before anything is measured).

Structure: :data:`MEASUREMENTS` lists the measurements (each fills its keys of ``Bench.res``),
:data:`TABLES` the report's tables; a new sweep is one entry in each.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import socket
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .. import config as commlib
from ..comm import Communicator
from ..comm.communicator import allreduce_way
from ..config import CommOptions, OptionError
from ..runtime.buffer import FusedCommBuffer, HookAction
from ..dtypes import as_dtype
from ..runtime.fusion import assign_group_by_size
from ..runtime.param import Param
from ..presets import get_preset
from ..spec import normalize_dtype
from .bandwidth import algbw, bus_factor, busbw, fmt_gbps

MiB = 1 << 20


# --------------------------------------------------------------------------- timing
def timeit(fn: Callable[[], Any], comm: MPI.Comm, iters: int, warmup: int,
           setup: Optional[Callable[[], Any]] = None) -> Dict[str, float]:
    """Median/min seconds of ``fn`` over ``iters`` runs, each the slowest rank's time."""
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= warmup:
            times.append(dt)
    return {"median_s": statistics.median(times), "min_s": min(times), "iters": iters}


def timeit_many(fns: Dict[str, Callable[[], Any]], comm: MPI.Comm, iters: int,
                warmup: int) -> Dict[str, Dict[str, float]]:
    """``timeit`` of several candidates in rounds (one run of each per round), so load that
    drifts during the run hits every candidate alike and their ratios stay fair."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= warmup:
                times[name].append(dt)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "iters": iters,
                "times_s": v} for k, v in times.items()}


def round_ratio(a: dict, b: dict) -> float:
    """Median over rounds of a/b (both from one ``timeit_many``): robust to drifting load."""
    if "times_s" in a and "times_s" in b and len(a["times_s"]) == len(b["times_s"]):
        return statistics.median(x / y for x, y in zip(a["times_s"], b["times_s"]))
    return a["median_s"] / b["median_s"]


#: the strategy a default run resolves to on this MPI (auto: thread at THREAD_MULTIPLE)
_DEFAULT = "thread" if MPI.Query_thread() >= MPI.THREAD_MULTIPLE else "nonblocking"


_SEGMENTS: Dict[int, int] = {}


def _default_segment(comm: MPI.Comm) -> int:
    """The segment size the thread strategy uses in this job (tuned, L2 rule or env): the
    smallest over ``comm``'s ranks, as the agreement check takes it. Collective on first use
    per communicator: ranks whose tune files or caches differ (mixed nodes) would otherwise
    time different candidates and hang."""
    key = comm.py2f()
    if key not in _SEGMENTS:
        _SEGMENTS[key] = comm.allreduce(commlib.CommOptions.from_env(strategy="thread").segment,
                                        op=MPI.MIN)
    return _SEGMENTS[key]


# --------------------------------------------------------------------------- workload
def make_params(preset: str, dtype: Optional[str], seed: int, fill: bool = True) -> List[Param]:
    """The preset's params; ``fill=False`` leaves them as untouched zero pages (timing runs
    of ALL_REDUCE/REDUCE never read them, so they cost no memory)."""
    rng = np.random.default_rng(seed)
    params = []
    for spec in get_preset(preset):
        dt = as_dtype(dtype or spec["dtype"])
        numel = int(np.prod(spec["shape"]))
        data = (rng.random(numel, dtype=np.float32).astype(dt, copy=False) if fill
                else np.zeros(numel, dt))
        params.append(Param(spec["name"], data.reshape(spec["shape"])))
    return params


def build_buffers(params: Sequence[Param], act: HookAction, group_bytes: int, comm: MPI.Comm,
                  strategy: str, **kwargs: Any) -> List[FusedCommBuffer]:
    groups = assign_group_by_size(list(params), group_size=group_bytes)
    dst = 0 if act == HookAction.REDUCE else -1
    options = CommOptions(strategy=strategy, verify_order=kwargs.pop("verify_order", True),
                          window=kwargs.pop("window", None) or commlib.DEFAULT_WINDOW,
                          allreduce=kwargs.pop("allreduce", "auto"))
    buffers = [FusedCommBuffer(i, plist, comm, act=act, dst=dst, comm_options=options, **kwargs)
               for i, plist in groups.items()]
    for b in buffers:  # real pages with real values, as after a backward pass
        if b.grad_storage is not None:
            b.grad_storage[...] = 1
    return buffers


def full_step(buffers: Sequence[FusedCommBuffer], sync: bool) -> None:
    """One training step's communication: every param checks in (comm starts per buffer as
    soon as it is full), then every buffer finishes, then sharded params are gathered."""
    for b in buffers:
        for p in b.params:
            b.add_grad(p)
    for b in buffers:
        b.scale_grads()
    if sync:
        for b in buffers:
            b.sync_params(sync=True)


def grad_bytes(buffers: Sequence[FusedCommBuffer]) -> int:
    return int(sum(b.grad_storage.nbytes for b in buffers))


# --------------------------------------------------------------------------- raw MPI
def segmented_allreduce(comm: MPI.Comm, buf: np.ndarray, seg_bytes: int,
                        scale: Optional[float] = None) -> Callable[[], None]:
    """Blocking in-place ``Allreduce`` of ``buf`` in segments, each scaled while in cache
    when ``scale`` is given (one segment >= the buffer: one call + one pass)."""
    step = max(1, seg_bytes // buf.itemsize)
    f = None if scale is None else buf.dtype.type(scale)

    def run() -> None:
        for s in range(0, buf.size, step):
            v = buf[s:s + step]
            comm.Allreduce(MPI.IN_PLACE, [v, MPI.FLOAT])
            if f is not None:
                v *= f
    return run


def segmented_reduce(comm: MPI.Comm, buf: np.ndarray, seg_bytes: int,
                     scale: Optional[float] = None, everywhere: bool = False
                     ) -> Callable[[], None]:
    """Blocking in-place ``Reduce`` to rank 0 in segments; the root scales what it received
    when ``scale`` is given, and with ``everywhere`` the other ranks scale each segment they
    sent too (Paddle's REDUCE scales every rank's buffer), so the floor does the same work."""
    step = max(1, seg_bytes // buf.itemsize)
    root = comm.Get_rank() == 0
    f = None if scale is None else buf.dtype.type(scale)
    own = f if everywhere else None

    def run() -> None:
        for s in range(0, buf.size, step):
            v = buf[s:s + step]
            if root:
                comm.Reduce(MPI.IN_PLACE, [v, MPI.FLOAT], root=0)
                if f is not None:
                    v *= f
            else:
                comm.Reduce([v, MPI.FLOAT], None, root=0)
                if own is not None:
                    v *= own
    return run


def reduce_scatter_allgather(comm: MPI.Comm, buf: np.ndarray,
                             scale: Optional[float] = None) -> Callable[[], None]:
    """``Reduce_scatter_block`` + in-place ``Allgather`` of ``buf`` (a multiple of the rank
    count), one call each; with ``scale`` the own shard is scaled in between."""
    n, rank = comm.Get_size(), comm.Get_rank()
    shard = np.empty(buf.size // n, buf.dtype)
    mine = buf[rank * shard.size:(rank + 1) * shard.size]
    f = None if scale is None else buf.dtype.type(scale)

    def run() -> None:
        comm.Reduce_scatter_block([buf, MPI.FLOAT], [shard, MPI.FLOAT])
        if f is not None:
            np.multiply(shard, f, out=mine)
        comm.Allgather(MPI.IN_PLACE, [buf, MPI.FLOAT])
    return run


def best_per_round(entries: Sequence[dict]) -> dict:
    """The fastest of several ``timeit_many`` results in each round, as one result."""
    rounds = len(entries[0]["times_s"])
    times = [min(e["times_s"][i] for e in entries) for i in range(rounds)]
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def raw_candidates(comm: MPI.Comm, nbytes: int, params: Sequence[Param], scale: float,
                   segments: Sequence[int]) -> Dict[str, Callable[[], Any]]:
    """The ways to hand the same bytes to MPI directly (no mpifusion), by name."""
    buf = np.ones(nbytes // 4, np.float32)
    f = np.float32(scale)

    def segmented(seg_bytes: int, with_scale: bool) -> Callable[[], None]:
        return segmented_allreduce(comm, buf, seg_bytes, scale if with_scale else None)

    cands: Dict[str, Callable[[], Any]] = {
        "Allreduce (blocking, one call)": lambda: comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT]),
    }
    for seg in segments:
        cands[f"Allreduce (blocking, {seg // MiB} MiB segments)"] = segmented(seg, False)
    if hasattr(comm, "Allreduce_init"):
        persistent = comm.Allreduce_init(MPI.IN_PLACE, [buf, MPI.FLOAT])

        def run_persistent() -> None:
            persistent.Start()
            persistent.Wait()
        cands["Allreduce_init (persistent, one call)"] = run_persistent

    def iseg() -> None:
        step = 8 * MiB // 4
        MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, [buf[s:s + step], MPI.FLOAT])
                             for s in range(0, buf.size, step)])
    cands["Iallreduce (8 MiB segments, Waitall)"] = iseg
    cands["Iallreduce (naive, one call)"] = (
        lambda: comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.FLOAT]).Wait())
    grads = [np.ones(p.numel, np.float32) for p in params]
    cands["Iallreduce per param (Waitall)"] = lambda: MPI.Request.Waitall(
        [comm.Iallreduce(MPI.IN_PLACE, [g, MPI.FLOAT]) for g in grads])
    # the fair floor of a sync step: the same 1/n scaling on the same bytes, done the two
    # cheap ways, at the segment sizes mpifusion's thread strategy may use
    seg = _default_segment(comm)
    for size in sorted({4 * MiB, seg}):
        cands[f"floor+scale: Allreduce {size // MiB} MiB segments, scaled per segment"] = \
            segmented(size, True)

    def scale_pass() -> None:
        segmented(seg, False)()
        buf.__imul__(f)
    cands[f"floor+scale: Allreduce {seg // MiB} MiB segments, then one scale pass"] = scale_pass
    return cands


def raw_other(comm: MPI.Comm, nbytes: int) -> Dict[str, Callable[[], Any]]:
    """Raw floors for REDUCE and REDUCE_SCATTER + allgather on the same bytes, each doing
    its step's 1/n: REDUCE's root scales the result and the other ranks what they sent (as
    Paddle scales every rank's buffer), REDUCE_SCATTER each rank its own shard."""
    n = comm.Get_size()
    f = 1.0 / n
    buf = np.ones((nbytes // 4) // n * n, np.float32)
    ways = {f"REDUCE raw: Reduce (blocking, {seg // MiB} MiB segments) + 1/n":
            segmented_reduce(comm, buf, seg, f, everywhere=True)
            for seg in sorted({8 * MiB, _default_segment(comm)})}
    ways["REDUCE raw: Reduce (blocking, one call) + 1/n pass"] = segmented_reduce(
        comm, buf, buf.nbytes, f, everywhere=True)
    ways["REDUCE_SCATTER raw: Reduce_scatter_block + 1/n + Allgather (one call each)"] = \
        reduce_scatter_allgather(comm, buf, f)
    return ways


def gloo_allreduce(comm: MPI.Comm, nbytes: int) -> Optional[dict]:
    """torch.distributed gloo all_reduce of the same bytes: {"fn", "torch", "close"}, or
    {"error"}; None when torch is not installed."""
    try:
        import datetime

        import torch
        import torch.distributed as dist
    except Exception:
        return None
    rank, n = comm.Get_rank(), comm.Get_size()
    host = comm.bcast(socket.gethostname() if rank == 0 else None, root=0)
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=n, timeout=datetime.timedelta(seconds=120))
    except Exception as exc:
        return {"error": f"gloo init failed: {exc}"}
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    return {"fn": lambda: dist.all_reduce(t), "torch": torch.__version__,
            "close": dist.destroy_process_group}


# --------------------------------------------------------------------------- other probes
def emulate_compute(seconds: float, mode: str, poll: Callable[[], None]) -> None:
    """OSU's dummy compute. ``device``: the host is free (a GPU computes), polling MPI every
    millisecond; ``cpu``: the host itself computes (numpy), polling between chunks."""
    end = time.perf_counter() + seconds
    if mode == "device":
        while True:
            left = end - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(1e-3, left))
            poll()
    x = np.linspace(0, 1, 32768, dtype=np.float32)
    while time.perf_counter() < end:
        np.sin(x, out=x)
        poll()


def overlap(buffers: Sequence[FusedCommBuffer], comm: MPI.Comm, iters: int, warmup: int,
            mode: str) -> dict:
    """OSU iallreduce overlap: pure = start+wait alone; compute for as long; overlap =
    1 - (total - compute) / pure."""
    def start() -> None:
        for b in buffers:
            for p in b.params:
                b.add_grad(p)

    def finish() -> None:
        for b in buffers:
            b.scale_grads()

    pure = timeit(lambda: (start(), finish()), comm, iters, warmup)["median_s"]
    poll = buffers[0].comm.poll
    totals = []
    for i in range(warmup + iters):
        comm.Barrier()
        t0 = time.perf_counter()
        start()
        emulate_compute(pure, mode, poll)
        finish()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= warmup:
            totals.append(dt)
    total = statistics.median(totals)
    pct = max(0.0, 100.0 * (1.0 - (total - pure) / pure)) if pure > 0 else 0.0
    return {"pure_s": pure, "compute_s": pure, "total_s": total, "overlap_pct": min(pct, 100.0)}


def add_grad_cost(buffers: Sequence[FusedCommBuffer], comm: MPI.Comm, iters: int) -> dict:
    """Seconds per ``add_grad(param)`` on the zero-copy path (grads already in the buffer),
    communication excluded (``use_comm=False``, comm started afterwards)."""
    per = []
    nparams = sum(len(b.params) for b in buffers)
    for _ in range(iters + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        for b in buffers:
            for p in b.params:
                b.add_grad(p, use_comm=False)
        per.append((time.perf_counter() - t0) / nparams)
        for b in buffers:
            b.comm_grads()
        for b in buffers:
            b.scale_grads()
    return {"per_param_s": statistics.median(per[1:]), "params": nparams}


def peak_memory(preset: str, dtype: Optional[str], act: HookAction, group_bytes: int,
                comm: MPI.Comm, strategy: str) -> dict:
    """Peak traced (numpy) memory during steps against params + grads + padding."""
    tracemalloc.start()
    try:
        params = make_params(preset, dtype, seed=comm.Get_rank())
        buffers = build_buffers(params, act, group_bytes, comm, strategy)
        full_step(buffers, sync=act == HookAction.REDUCE_SCATTER)
        if act == HookAction.REDUCE_SCATTER:
            ideal = sum(b.param_storage.nbytes for b in buffers)
        else:
            ideal = sum(p.data.nbytes for p in params)
        ideal += grad_bytes(buffers)
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(2):
            full_step(buffers, sync=act == HookAction.REDUCE_SCATTER)
        peak = tracemalloc.get_traced_memory()[1]
        del buffers, params
    finally:
        tracemalloc.stop()
    peak = comm.allreduce(peak, op=MPI.MAX)
    return {"action": act.name, "ideal_bytes": int(ideal), "held_bytes": int(before),
            "peak_bytes": int(peak), "ratio": peak / ideal}


# --------------------------------------------------------------------------- report
def _fmt_ms(s: float) -> str:
    """Milliseconds: one decimal from 10 ms, three below (small models' steps)."""
    ms = s * 1e3
    return f"{ms:9.1f}" if ms >= 10 else f"{ms:9.3f}"


def _nan(value: Optional[float]) -> float:
    return float("nan") if value is None else value


def write_plot(path: str, res: dict) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover - matplotlib is in the bench extra
        return f"no plot: {exc} (pip install 'mpifusion[bench]')"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    sweep = res["size_sweep"]
    sizes = [row["bytes"] for row in sweep]
    for key, style in (("raw_floor", "k-o"), ("mpifusion_thread", "b-s"),
                       ("mpifusion_nonblocking", "g-^"), ("naive_iallreduce", "r--x")):
        if key in sweep[0]:
            ax1.plot(sizes, [_nan(row[key]["busbw_GBps"]) for row in sweep], style, label=key)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("message size (bytes)")
    ax1.set_ylabel("busbw (GB/s)")
    ax1.set_title(f"allreduce busbw, {res['meta']['nranks']} ranks ({res['meta']['mpi']})")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    groups = res["group_sweep"]
    labels = [row["label"] for row in groups]
    nbytes = res["meta"]["grad_bytes"]
    ax2.bar(labels, [_nan(row["busbw_GBps"]) for row in groups], color="tab:blue",
            label="mpifusion ALL_REDUCE step (thread)")
    floor = res["floor"]
    n = res["meta"]["nranks"]
    ax2.axhline(_nan(busbw("all_reduce", nbytes, floor["median_s"], n)), color="k",
                label=f"raw floor: {floor['name']}")
    naive = res["raw"].get("Iallreduce (naive, one call)")
    if naive:
        ax2.axhline(_nan(busbw("all_reduce", nbytes, naive["median_s"], n)), color="r",
                    linestyle="--", label="naive Iallreduce of the flat buffer")
    ax2.set_xlabel("fusion group size (0 = unfused, one buffer per param)")
    ax2.set_ylabel("busbw (GB/s)")
    ax2.set_title(f"{res['meta']['preset']} full step vs group size")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    print(f"\n## {title}")
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")


# --------------------------------------------------------------------------- arguments
#: grads at least this large make a sync bandwidth-bound: the speed targets are set for them
BANDWIDTH_BOUND_BYTES = 64 * MiB


def build_parser() -> argparse.ArgumentParser:
    """``mpifusion bench``'s options; usage errors are printed by rank 0 only, exit 2."""
    from .cli import _Parser, _non_negative, _positive

    ap = _Parser(prog="mpifusion bench", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", default="gpt2-small", help="model whose grads are synced")
    ap.add_argument("--dtype", default=None,
                    help="dtype of every param, as in spec files (float32, bf16, ...)")
    ap.add_argument("--group-mb", type=_positive_float, default=256.0,
                    help="fusion group size of the main measurements (Paddle's default 256)")
    ap.add_argument("--group-sweep", default="auto",
                    help="fusion group sizes in MiB to sweep, e.g. 0,16,64,256,1024 (0: one "
                    "buffer per param); auto: four sizes up to the model's grads, and 0")
    ap.add_argument("--size-sweep", default="auto",
                    help="message sizes 2^a..2^b bytes, step c in the exponent (a:b:c); "
                    "auto: 2^12 up to the model's grad bytes (at most 2^28), step 2")
    ap.add_argument("--segments-mb", default="4,8,16,32",
                    help="segment sizes (MiB) of the raw blocking candidates")
    ap.add_argument("--iters", type=_positive, default=5)
    ap.add_argument("--warmup", type=_non_negative, default=1)
    ap.add_argument("--strategies", default=",".join(commlib.STRATEGIES))
    ap.add_argument("--windows", default="1,2,4,8",
                    help="nonblocking windows (segments in flight) swept against thread")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed gloo")
    ap.add_argument("--out", default="bench_out", metavar="DIR",
                    help="folder for the JSON results and the plot (created; git-ignored)")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="results file (default: DIR/bench_PRESET_nRANKS.json)")
    ap.add_argument("--png", default=None, metavar="FILE",
                    help="plot file (default: DIR/bench_PRESET_nRANKS.png; '' for none)")
    return ap


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _bad(option: str, expected: str, text: str) -> OptionError:
    return OptionError(f"{option}: expected {expected}, got {text!r}")


def _mib_list(text: str, option: str, allow_zero: bool) -> List[float]:
    """``"0,16,64"`` -> MiB values (>= 0, or > 0), in the given order."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 or (v == 0 and not allow_zero) or v != v or v == float("inf")
                         for v in values):
        raise _bad(option, f"comma-separated MiB {'>= 0' if allow_zero else '> 0'}", text)
    return values


def _windows(text: str) -> List[int]:
    """``"1,2,4,8"`` -> nonblocking windows, each checked like ``CommOptions.window``."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise _bad("--windows", "comma-separated ints in [1, 64]", text)
    return list(dict.fromkeys(commlib.parse_window(x, "--windows") for x in items))


def _exponents(text: str) -> range:
    """``"12:28:2"`` -> range(12, 29, 2): message sizes 2^e bytes (4 B to 1 GiB)."""
    try:
        lo, hi, step = (int(x) for x in text.split(":"))
    except ValueError:
        raise _bad("--size-sweep", "a:b:c with ints a <= b and c >= 1, or auto", text) from None
    if not (2 <= lo <= hi <= 30 and step >= 1):
        raise _bad("--size-sweep", "a:b:c with 2 <= a <= b <= 30 and c >= 1", text)
    return range(lo, hi + 1, step)


def auto_size_sweep(nbytes: int) -> List[int]:
    """Message sizes 4 KiB, 16 KiB, ... up to the first power of two >= ``nbytes`` (at most
    256 MiB): the sweep of a tiny model stops where its grads do."""
    top = min(28, max(12, math.ceil(math.log2(max(nbytes, 1)))))
    sizes = [1 << e for e in range(12, top + 1, 2)]
    return sizes if sizes[-1] == 1 << top else sizes + [1 << top]


def auto_group_sweep(nbytes: int) -> List[float]:
    """0 (one buffer per param) and the four sizes of the ladder 1/64, 1/16, ... 1024 MiB
    that end at the first one holding all ``nbytes`` (GPT-2-small: 0, 16, 64, 256, 1024)."""
    ladder = [4.0 ** k for k in range(-3, 6)]  # 1/64 MiB .. 1024 MiB
    upto = next((i for i, g in enumerate(ladder) if g * MiB >= nbytes), len(ladder) - 1)
    return [0.0] + ladder[max(0, upto - 3):upto + 1]


@dataclass
class Settings:
    """The validated arguments: the same on every rank, so every rank refuses alike."""

    preset: str
    dtype: Optional[str]
    group_bytes: int
    group_sweep: Optional[List[float]]  # None: auto, from the model's grad bytes
    size_sweep: Optional[List[int]]     # None: auto
    segments: List[int]
    strategies: List[str]
    windows: List[int]
    iters: int
    warmup: int
    torch: bool
    json_path: Optional[str]
    png_path: Optional[str]


def settings(args: argparse.Namespace, nranks: int) -> Settings:
    """Check every argument before anything is measured (OptionError/PresetError/SpecError,
    one line naming the option)."""
    dtype = normalize_dtype(args.dtype, "--dtype") if args.dtype is not None else None
    get_preset(args.preset)  # PresetError names the valid presets
    strategies = [commlib.parse_strategy(s.strip(), "--strategies")
                  for s in args.strategies.split(",") if s.strip()]
    if not strategies:
        raise _bad("--strategies", f"a comma-separated list of {', '.join(commlib.STRATEGIES)}",
                   args.strategies)
    base = os.path.join(args.out, f"bench_{args.preset}_n{nranks}")
    return Settings(
        preset=args.preset, dtype=dtype, group_bytes=int(args.group_mb * MiB),
        group_sweep=(None if args.group_sweep == "auto"
                     else _mib_list(args.group_sweep, "--group-sweep", allow_zero=True)),
        size_sweep=(None if args.size_sweep == "auto"
                    else [1 << e for e in _exponents(args.size_sweep)]),
        segments=[int(x * MiB) for x in _mib_list(args.segments_mb, "--segments-mb", False)],
        strategies=list(dict.fromkeys(strategies)), windows=_windows(args.windows),
        iters=args.iters, warmup=args.warmup,
        torch=not args.no_torch,
        json_path=base + ".json" if args.json is None else (args.json or None),
        png_path=base + ".png" if args.png is None else (args.png or None))


def _prepare_outputs(s: Settings) -> Optional[str]:
    """Create the output folders (rank 0); a one-line error, or None."""
    for path in (s.json_path, s.png_path):
        folder = os.path.dirname(path) if path else ""
        if folder:
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                return f"--out: cannot create {folder}: {exc.strerror or exc}"
            if not os.access(folder, os.W_OK):
                return f"--out: cannot write into {folder}"
    return None


# --------------------------------------------------------------------------- measurements
@dataclass
class Bench:
    """One benchmark run: settings, communicators and the results dict ``res`` that the
    measurements fill in and the report reads (each section its own key)."""

    s: Settings
    world: MPI.Comm
    comm: MPI.Comm  # a duplicate: barriers and raw candidates never touch mpifusion's comms
    res: Dict[str, Any] = field(default_factory=dict)

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
    params = b.params()
    b.res["meta"] = {
        "preset": b.s.preset, "dtype": str(params[0].data.dtype), "params": len(params),
        "param_bytes": int(sum(p.data.nbytes for p in params)), "nranks": b.n,
        "mpi": mpi_name(), "mpi4py": __import__("mpi4py").__version__,
        "numpy": np.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "thread_level": MPI.Query_thread(), "default_strategy": _DEFAULT,
        "default_segment_bytes": _default_segment(b.comm), "group_bytes": b.s.group_bytes,
        "iters": b.s.iters, "warmup": b.s.warmup,
        "busbw_factor": bus_factor("all_reduce", b.n),
    }
    m = b.res["meta"]
    b.say(f"# mpifusion bench: {m['preset']} ({m['params']} params, "
          f"{m['param_bytes'] / 1e6:.3g} MB {m['dtype']}), {b.n} ranks, {m['mpi']}, "
          f"mpi4py {m['mpi4py']}")


def measure_allreduce_steps(b: Bench) -> None:
    """mpifusion's ALL_REDUCE step per strategy against raw MPI and gloo, in rounds."""
    b.say("# measuring ALL_REDUCE steps against raw MPI and gloo (in rounds) ...")
    fns: Dict[str, Callable[[], Any]] = {}
    meta_of: Dict[str, dict] = {}
    keep = []
    for strategy, avg in [(s, False) for s in b.s.strategies] + [(_DEFAULT, True)]:
        buffers = b.buffers(HookAction.ALL_REDUCE, strategy, use_reduce_avg=avg)
        keep.append(buffers)
        label = (f"ALL_REDUCE{' (use_reduce_avg: 1/n per segment)' if avg else ''} "
                 f"[{strategy}]")
        fns[label] = (lambda bufs=buffers: full_step(bufs, False))
        meta_of[label] = {"action": "ALL_REDUCE", "strategy": strategy, "reduce_avg": avg,
                          "buffers": len(buffers), "bytes": grad_bytes(buffers)}
    nbytes = meta_of[f"ALL_REDUCE [{b.s.strategies[0]}]"]["bytes"]
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
    b.res["steps"] = {k: dict(timed[k], **meta_of[k]) for k in fns}
    b.res["raw"] = {k: timed[k] for k in raw_fns}
    del keep


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
        w = commlib.DEFAULT_WINDOW
        keep.append(b.buffers(HookAction.ALL_REDUCE, "nonblocking", window=w, allreduce="mpi"))
        fns[f"ALL_REDUCE [nonblocking, library Iallreduce, window {w}]"] = (
            lambda bufs=keep[-1]: full_step(bufs, False))
    # the library's own floors: the same bytes in the same segments, blocking and all
    # non-blocking at once (what any nonblocking window can at best reach)
    flat = np.ones(grad_bytes(keep[-1]) // 4, np.float32)
    seg = max(1, _default_segment(b.comm) // 4)
    fns["raw Allreduce, blocking segments"] = lambda: _raw_best(b.comm, flat, seg * 4)
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


def measure_size_sweep(b: Bench) -> None:
    """One buffer of each size: the raw floor, a naive Iallreduce and each Communicator."""
    b.say("# sweeping message sizes and fusion group sizes ...")
    sizes = b.s.size_sweep or auto_size_sweep(b.res["meta"]["grad_bytes"])
    comms = {s: Communicator(b.world, CommOptions(strategy=s)) for s in b.s.strategies}
    rows = []
    segment = _default_segment(b.comm)
    for size in sizes:
        buf = np.ones(max(1, size // 4), np.float32)
        iters = int(min(200, max(b.s.iters, 2e8 / size)))
        fns = {"raw_floor": lambda: _raw_best(b.comm, buf, segment),
               "naive_iallreduce": lambda: b.comm.Iallreduce(MPI.IN_PLACE,
                                                             [buf, MPI.FLOAT]).Wait()}
        for s, c in comms.items():
            fns[f"mpifusion_{s}"] = (lambda c=c: c.allreduce(buf).wait())
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
        buffers = b.buffers(HookAction.ALL_REDUCE, _DEFAULT, group_bytes=int(g * MiB))
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
        if strategy == _DEFAULT or "add_grad" not in b.res:
            b.res["add_grad"] = add_grad_cost(buffers, b.comm, max(b.s.iters, 5))
        del buffers


def measure_memory(b: Bench) -> None:
    """Peak memory during steps, fresh params, one action at a time."""
    b.res["memory"] = {a.name: peak_memory(b.s.preset, b.s.dtype, a, b.s.group_bytes, b.comm,
                                           _DEFAULT) for a in HookAction}
    b.res["memory"]["ru_maxrss_kB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure_order(b: Bench) -> None:
    """What order safety costs (default strategy, ALL_REDUCE): the strict order's check
    before each collective against no check, on the full step and per small collective, and
    the negotiated order's rounds against the verified strict order."""
    b.say("# cost of the order check and of the negotiated order ...")
    verified = b.buffers(HookAction.ALL_REDUCE, _DEFAULT)
    plain = b.buffers(HookAction.ALL_REDUCE, _DEFAULT, verify_order=False)
    # A B A in each round: the first run of a round is often slower (cache, other load)
    steps = timeit_many({"verified": lambda: full_step(verified, False),
                         "unverified": lambda: full_step(plain, False),
                         "verified, again": lambda: full_step(verified, False)},
                        b.comm, b.s.iters, b.s.warmup)
    both = [(x + y) / 2 for x, y in zip(steps["verified"]["times_s"],
                                         steps["verified, again"]["times_s"])]
    steps["verified"] = {"median_s": statistics.median(both), "times_s": both}
    del plain
    negotiated = b.buffers(HookAction.ALL_REDUCE, _DEFAULT, order="negotiated")
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
        x = np.ones(nbytes // 4, np.float32)
        comms = {v: Communicator(b.world, CommOptions(strategy=_DEFAULT, verify_order=v))
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
#: function here and one table in TABLES.
MEASUREMENTS: List[Callable[[Bench], None]] = [
    measure_meta, measure_allreduce_steps, measure_other_steps, measure_window_sweep,
    measure_size_sweep,
    measure_group_sweep, measure_overlap_and_add_grad, measure_memory, measure_order,
]


# --------------------------------------------------------------------------- targets
@dataclass
class Target:
    what: str
    value: float
    target: str
    applies: bool = True  # False: set for another regime (e.g. bandwidth-bound syncs)

    @property
    def met(self) -> bool:
        return _met(self.value, self.target)


def targets(res: dict) -> List[Target]:
    """The speed and memory targets, each marked whether it applies to this model: the
    ratios against raw MPI, gloo and the overlap are set for bandwidth-bound syncs."""
    steps, raw = res["steps"], res["raw"]
    step = steps[f"ALL_REDUCE [{_DEFAULT}]"] if f"ALL_REDUCE [{_DEFAULT}]" in steps \
        else next(v for k, v in steps.items() if k.startswith("ALL_REDUCE ["))
    big = res["meta"]["grad_bytes"] >= BANDWIDTH_BOUND_BYTES
    out = [
        Target("ALL_REDUCE step / best raw collective", round_ratio(step, res["floor"]),
               "<= 1.15", big),
        Target("ALL_REDUCE step / (best raw collective + 1/n scaling)",
               round_ratio(step, res["floor_with_scale"]), "<= 1.10", big),
        Target("naive flat Iallreduce / ALL_REDUCE step",
               round_ratio(raw["Iallreduce (naive, one call)"], step), ">= 3", big),
    ]
    for label, prefix in (("REDUCE", "REDUCE raw"),
                          ("REDUCE_SCATTER + sync_params", "REDUCE_SCATTER raw")):
        mine = steps.get(f"{label} [{_DEFAULT}]")
        floors = [raw[k] for k in raw if k.startswith(prefix)]
        if mine and floors:  # per round: the best raw way of that round, with the same 1/n
            out.append(Target(f"{label} step / best raw {label.split()[0]} + the same 1/n",
                              round_ratio(mine, best_per_round(floors)), "<= 1.15", big))
    gloo_key = next((k for k in raw if "gloo" in k), None)
    if gloo_key:
        out.append(Target("torch gloo all_reduce / ALL_REDUCE step",
                          round_ratio(raw[gloo_key], step), ">= 4", big))
    ov = res["overlap"].get(f"{_DEFAULT}/device")
    if ov:
        out.append(Target("overlap with emulated (device) compute, %", ov["overlap_pct"],
                          ">= 80", big))
    out.append(Target("add_grad per param, us", res["add_grad"]["per_param_s"] * 1e6, "<= 3"))
    if res.get("order_check"):
        out.append(Target("order check cost, % of the ALL_REDUCE step (buffers x check)",
                          res["order_check"]["pct_of_step"], "<= 2", big))
    out.append(Target("peak memory / (params + grads + padding), ALL_REDUCE",
                      res["memory"]["ALL_REDUCE"]["ratio"], "<= 1.05", big))
    return out


# --------------------------------------------------------------------------- report
def _kind(label: str) -> str:
    """The collective of a step or raw row, for its busbw factor."""
    if label.startswith("REDUCE_SCATTER"):
        return "reduce_scatter+allgather"
    if label.startswith("REDUCE"):
        return "reduce"
    return "all_reduce"


def _x_floor(v: dict, res: dict) -> str:
    floor = res["floor"]["median_s"]
    return f"{v['median_s'] / floor:.2f}" if floor > 0 else "-"


def table_steps(res: dict) -> tuple:
    n = res["meta"]["nranks"]
    return ("mpifusion full steps (add_grad of every param, comm, scale)",
            ["step", "buffers", "median ms", "min ms", "busbw GB/s", "x floor"],
            [[k, v["buffers"], _fmt_ms(v["median_s"]), _fmt_ms(v["min_s"]),
              fmt_gbps(busbw(_kind(k), v["bytes"], v["median_s"], n), 2), _x_floor(v, res)]
             for k, v in res["steps"].items()])


def table_raw(res: dict) -> tuple:
    n, nbytes = res["meta"]["nranks"], res["meta"]["grad_bytes"]
    return (f"raw MPI on one contiguous buffer of {nbytes / 1e6:.3g} MB",
            ["way", "median ms", "min ms", "busbw GB/s", "x floor"],
            [[k, _fmt_ms(v["median_s"]), _fmt_ms(v["min_s"]),
              fmt_gbps(busbw(_kind(k.replace(" raw:", "")), nbytes, v["median_s"], n), 2),
              _x_floor(v, res)] for k, v in res["raw"].items()])


def table_window_sweep(res: dict) -> tuple:
    return ("nonblocking window sweep (ALL_REDUCE full step; x thread: median over rounds of "
            "the per-round ratio)",
            ["step", "median ms", "min ms", "x thread"],
            [[r["what"], _fmt_ms(r["median_s"]), _fmt_ms(r["min_s"]),
              "-" if r["x_thread"] is None else f"{r['x_thread']:.2f}"]
             for r in res.get("window_sweep", [])])


def table_size_sweep(res: dict) -> tuple:
    sweep = res["size_sweep"]
    keys = [k for k in sweep[0] if k != "bytes"]
    return ("allreduce size sweep: busbw GB/s (algbw = bytes/time, busbw = algbw*2(n-1)/n)",
            ["bytes"] + keys,
            [[r["bytes"]] + [fmt_gbps(r[k]["busbw_GBps"], 2) for k in keys] for r in sweep])


def table_group_sweep(res: dict) -> tuple:
    return ("fusion group size sweep (ALL_REDUCE full step, default strategy)",
            ["group MiB", "buffers", "median ms", "busbw GB/s"],
            [[g["label"], g["buffers"], _fmt_ms(g["median_s"]), fmt_gbps(g["busbw_GBps"], 2)]
             for g in res["group_sweep"]])


def table_overlap(res: dict) -> tuple:
    return ("overlap with emulated compute (OSU: 1 - (total - compute) / pure)",
            ["strategy/compute", "pure ms", "total ms", "overlap %"],
            [[k, _fmt_ms(v["pure_s"]), _fmt_ms(v["total_s"]), f"{v['overlap_pct']:.0f}"]
             for k, v in res["overlap"].items()])


def table_memory(res: dict) -> tuple:
    return ("peak memory during steps (tracemalloc, slowest rank)",
            ["action", "params+grads+padding MB", "peak MB", "ratio"],
            [[k, f"{v['ideal_bytes'] / 1e6:.3g}", f"{v['peak_bytes'] / 1e6:.3g}",
              f"{v['ratio']:.3f}"] for k, v in res["memory"].items() if isinstance(v, dict)])


def table_order(res: dict) -> tuple:
    return ("order safety: strict order's check (verify_order) and negotiated order",
            ["what", "a ms", "b ms", "a / b"],
            [[r["what"], f"{r['a_s'] * 1e3:.4g}", f"{r['b_s'] * 1e3:.4g}", f"{r['ratio']:.3f}"]
             for r in res.get("order", [])]
            + ([["check per collective (4 KiB difference), us x buffers / step, %",
                 f"{res['order_check']['per_collective_s'] * 1e6:.1f} us",
                 f"x {res['order_check']['buffers']}",
                 f"{res['order_check']['pct_of_step']:.3f} %"]] if "order_check" in res else []))


def table_targets(res: dict) -> tuple:
    shown = [t for t in res["targets"] if t["applies"]]
    return ("targets (ratios within this run: median over rounds of the per-round ratio)",
            ["what", "value", "target", "met"],
            [[t["what"], f"{t['value']:.2f}", t["target"], "yes" if t["met"] else "NO"]
             for t in shown])


#: the report's tables, in order: each takes ``res`` and gives (title, header, rows)
TABLES: List[Callable[[dict], tuple]] = [
    table_steps, table_raw, table_window_sweep, table_size_sweep, table_group_sweep, table_overlap, table_memory,
    table_order, table_targets,
]


def report(res: dict, s: Settings) -> None:
    """Rank 0: the tables, then the files."""
    for table in TABLES:
        _print_table(*table(res))
    hidden = [t for t in res["targets"] if not t["applies"]]
    if hidden:
        print(f"\n({len(hidden)} target(s) not shown: they are set for bandwidth-bound syncs of "
              f">= {BANDWIDTH_BOUND_BYTES // MiB} MiB of grads; this model has "
              f"{res['meta']['grad_bytes'] / 1e6:.3g} MB. Try --preset gpt2-small.)")
    if "gloo_error" in res:
        print(f"\n(torch gloo skipped: {res['gloo_error']})")
    if s.json_path:
        with open(s.json_path, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    note = write_plot(s.png_path, res) if s.png_path else None
    wrote = [p for p in (s.json_path, None if note else s.png_path) if p]
    print(f"\nwall time {res['meta']['wall_s']:.0f} s; wrote {', '.join(wrote) or 'nothing'}"
          f"{'; ' + note if note else ''}")
    sys.stdout.flush()


# --------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark on COMM_WORLD; rank 0 prints the tables and writes JSON and PNG.
    Bad arguments raise (OptionError, PresetError, SpecError) on every rank before anything
    is measured; the command line turns them into one line and exit 2."""
    args = build_parser().parse_args(argv)
    world = MPI.COMM_WORLD
    s = settings(args, world.Get_size())
    error = _prepare_outputs(s) if world.Get_rank() == 0 else None
    error = world.bcast(error, root=0)
    if error is not None:
        raise OptionError(error)
    b = Bench(s, world, world.Dup())
    t_start = time.perf_counter()
    for measure in MEASUREMENTS:
        measure(b)
    b.res["meta"]["wall_s"] = time.perf_counter() - t_start
    b.res["targets"] = [dict(vars(t), met=t.met) for t in targets(b.res)]
    if b.rank == 0:
        report(b.res, s)
    b.comm.Barrier()
    b.comm.Free()
    return 0


def _raw_best(comm: MPI.Comm, buf: np.ndarray, seg_bytes: int) -> None:
    """The raw floor for one message: blocking Allreduce in ``seg_bytes`` pieces."""
    step = max(1, seg_bytes // 4)
    for s in range(0, buf.size, step):
        comm.Allreduce(MPI.IN_PLACE, [buf[s:s + step], MPI.FLOAT])


def mpi_name() -> str:
    """'MPICH 5.0.2' / 'Open MPI v5.0.11': the library's first words, without build details."""
    text = MPI.Get_library_version().replace("\x00", "").splitlines()[0]
    return " ".join(text.replace("Version:", "").split(",")[0].split())


def _met(value: float, target: str) -> bool:
    op, num = target.split()
    return value <= float(num) if op == "<=" else value >= float(num)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
