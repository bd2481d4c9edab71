"""``mpifusion bench``: mpifusion's gradient sync side by side with raw MPI, OSU/nccl-tests style.

Run as ``mpiexec -n 2 python scripts/bench_sync.py`` (or ``mpifusion bench``). One run measures,
on the same bytes (a preset's gradients, GPT-2-small fp32 by default):

* mpifusion's full step (``add_grad`` of every param, comm, ``scale_grads``) for ALL_REDUCE,
  REDUCE and REDUCE_SCATTER (+ ``sync_params``), per communication strategy;
* the raw MPI candidates on one contiguous buffer (the floor for this MPI), a naive
  ``Iallreduce`` of the flat buffer, per-param ``Iallreduce`` and torch gloo (when installed);
* a sweep of message sizes (algbw/busbw, nccl-tests definitions) and of fusion group sizes;
* overlap with emulated compute (OSU's method), ``add_grad`` cost per param and peak memory.

Times are the slowest rank's, median over ``--iters`` (after ``--warmup``). Only rank 0 prints
and writes the JSON and PNG; every rank returns 0.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
import tracemalloc
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .. import config as commlib
from ..comm import Communicator
from ..config import CommOptions
from ..runtime.buffer import FusedCommBuffer, HookAction
from ..dtypes import as_dtype
from ..runtime.fusion import assign_group_by_size
from ..runtime.param import Param
from ..presets import get_preset

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


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw factor: what each rank's links carry relative to the data size."""
    if n <= 1:
        return 0.0
    return {"allreduce": 2 * (n - 1) / n, "reduce": 1.0,
            "reduce_scatter+allgather": 2 * (n - 1) / n}.get(kind, (n - 1) / n)


#: the strategy a default run resolves to on this MPI (auto: thread at THREAD_MULTIPLE)
_DEFAULT = "thread" if MPI.Query_thread() >= MPI.THREAD_MULTIPLE else "nonblocking"


def _default_segment() -> int:
    """The segment size the thread strategy uses on this machine (tuned, L2 rule or env)."""
    return commlib.CommOptions.from_env(strategy="thread").segment


# --------------------------------------------------------------------------- workload
def make_params(preset: str, dtype: Optional[str], seed: int, fill: bool = True) -> List[Param]:
    """The preset's params; ``fill=False`` leaves them as untouched zero pages (timing runs
    of ALL_REDUCE/REDUCE never read them, so they cost no memory)."""
    rng = np.random.default_rng(seed)
    params = []
    for spec in get_preset(preset, dtype):
        dt = as_dtype(spec["dtype"])
        numel = int(np.prod(spec["shape"]))
        data = (rng.random(numel, dtype=np.float32).astype(dt, copy=False) if fill
                else np.zeros(numel, dt))
        params.append(Param(spec["name"], data.reshape(spec["shape"])))
    return params


def build_buffers(params: Sequence[Param], act: HookAction, group_bytes: int, comm: MPI.Comm,
                  strategy: str, **kwargs: Any) -> List[FusedCommBuffer]:
    groups = assign_group_by_size(list(params), group_size=group_bytes)
    dst = 0 if act == HookAction.REDUCE else -1
    options = CommOptions(strategy=strategy)
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
def raw_candidates(comm: MPI.Comm, nbytes: int, params: Sequence[Param], scale: float,
                   segments: Sequence[int]) -> Dict[str, Callable[[], Any]]:
    """The ways to hand the same bytes to MPI directly (no mpifusion), by name."""
    buf = np.ones(nbytes // 4, np.float32)
    f = np.float32(scale)

    def segmented(seg_bytes: int, with_scale: bool) -> Callable[[], None]:
        step = seg_bytes // 4

        def run() -> None:
            for s in range(0, buf.size, step):
                v = buf[s:s + step]
                comm.Allreduce(MPI.IN_PLACE, [v, MPI.FLOAT])
                if with_scale:
                    v *= f
        return run

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
    for seg in sorted({4 * MiB, _default_segment()}):
        cands[f"floor+scale: Allreduce {seg // MiB} MiB segments, scaled per segment"] = \
            segmented(seg, True)
    seg = _default_segment()

    def scale_pass() -> None:
        segmented(seg, False)()
        buf.__imul__(f)
    cands[f"floor+scale: Allreduce {seg // MiB} MiB segments, then one scale pass"] = scale_pass
    return cands


def raw_other(comm: MPI.Comm, nbytes: int) -> Dict[str, Callable[[], Any]]:
    """Raw floors for REDUCE and REDUCE_SCATTER + allgather on the same bytes."""
    n = comm.Get_size()
    count = (nbytes // 4) // n * n
    buf = np.ones(count, np.float32)
    shard = np.empty(count // n, np.float32)
    step = 8 * MiB // 4
    rank = comm.Get_rank()

    def reduce_seg() -> None:
        for s in range(0, buf.size, step):
            v = [buf[s:s + step], MPI.FLOAT]
            if rank == 0:
                comm.Reduce(MPI.IN_PLACE, v, root=0)
            else:
                comm.Reduce(v, None, root=0)

    def rs_ag() -> None:
        comm.Reduce_scatter_block([buf, MPI.FLOAT], [shard, MPI.FLOAT])
        comm.Allgather(MPI.IN_PLACE, [buf, MPI.FLOAT])

    return {"REDUCE raw: Reduce (blocking, 8 MiB segments)": reduce_seg,
            "REDUCE raw: Reduce (blocking, one call)": lambda: comm.Reduce(
                MPI.IN_PLACE if rank == 0 else [buf, MPI.FLOAT],
                [buf, MPI.FLOAT] if rank == 0 else None, root=0),
            "REDUCE_SCATTER raw: Reduce_scatter_block + Allgather (one call each)": rs_ag}


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
    return f"{s * 1e3:9.1f}"


def _gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9 if s > 0 else 0.0


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
        ax1.plot(sizes, [row[key]["busbw_GBps"] for row in sweep], style, label=key)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("message size (bytes)")
    ax1.set_ylabel("busbw (GB/s)")
    ax1.set_title(f"allreduce busbw, {res['meta']['nranks']} ranks ({res['meta']['mpi']})")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    groups = res["group_sweep"]
    labels = [row["label"] for row in groups]
    nbytes = res["meta"]["grad_bytes"]
    ax2.bar(labels, [row["busbw_GBps"] for row in groups], color="tab:blue",
            label="mpifusion ALL_REDUCE step (thread)")
    floor = res["floor"]
    ax2.axhline(_gbps(nbytes, floor["median_s"]) * res["meta"]["busbw_factor"], color="k",
                label=f"raw floor: {floor['name']}")
    naive = res["raw"].get("Iallreduce (naive, one call)")
    if naive:
        ax2.axhline(_gbps(nbytes, naive["median_s"]) * res["meta"]["busbw_factor"], color="r",
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


# --------------------------------------------------------------------------- main
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mpifusion bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", default="gpt2-small", help="model whose grads are synced")
    ap.add_argument("--dtype", default=None, help="override the preset's dtype (fp32, bf16, ...)")
    ap.add_argument("--group-mb", type=float, default=256.0,
                    help="fusion group size of the main measurements (Paddle's default 256)")
    ap.add_argument("--group-sweep", default="0,16,64,256,1024",
                    help="fusion group sizes in MiB to sweep (0: one buffer per param)")
    ap.add_argument("--size-sweep", default="12:28:2",
                    help="message sizes 2^a..2^b bytes, step c in the exponent (a:b:c)")
    ap.add_argument("--segments-mb", default="4,8,16,32",
                    help="segment sizes (MiB) of the raw blocking candidates")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--strategies", default=",".join(commlib.STRATEGIES))
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed gloo")
    ap.add_argument("--json", default="bench_sync.json", help="where rank 0 writes the results")
    ap.add_argument("--png", default="bench_sync.png", help="where rank 0 writes the plot")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark on COMM_WORLD; rank 0 prints the tables and writes JSON and PNG."""
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    comm = world.Dup()  # timing barriers and raw candidates never touch mpifusion's comms
    rank, n = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    strategies = [commlib.parse_strategy(s, '--strategies') for s in args.strategies.split(",") if s]
    group_bytes = int(args.group_mb * MiB)
    t_start = time.perf_counter()
    res: Dict[str, Any] = {}

    params = make_params(args.preset, args.dtype, seed=rank, fill=False)  # shapes, for raw runs
    nparams = len(params)
    res["meta"] = {
        "preset": args.preset, "dtype": str(params[0].data.dtype), "params": nparams,
        "param_bytes": int(sum(p.data.nbytes for p in params)), "nranks": n,
        "mpi": mpi_name(),
        "mpi4py": __import__("mpi4py").__version__, "numpy": np.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "thread_level": MPI.Query_thread(),
        "default_strategy": _DEFAULT,
        "default_segment_bytes": _default_segment(),
        "group_bytes": group_bytes, "iters": args.iters, "warmup": args.warmup,
        "busbw_factor": bus_factor("allreduce", n),
    }
    say(f"# mpifusion bench: {args.preset} ({nparams} params, "
        f"{res['meta']['param_bytes'] / 1e6:.0f} MB {res['meta']['dtype']}), {n} ranks, "
        f"{res['meta']['mpi']}, mpi4py {res['meta']['mpi4py']}")

    # -- 1. ALL_REDUCE: mpifusion's step per strategy vs raw MPI and gloo, in rounds
    say("# measuring ALL_REDUCE steps against raw MPI and gloo (in rounds) ...")
    steps: Dict[str, dict] = {}
    fns: Dict[str, Callable[[], Any]] = {}
    meta_of: Dict[str, dict] = {}
    keep: List[Any] = []
    variants = [(s, False) for s in strategies] + [(_DEFAULT, True)]
    for strategy, avg in variants:
        buffers = build_buffers(make_params(args.preset, args.dtype, rank, fill=False),
                                HookAction.ALL_REDUCE, group_bytes, comm, strategy,
                                use_reduce_avg=avg)
        keep.append(buffers)
        label = (f"ALL_REDUCE{' (use_reduce_avg: 1/n per segment)' if avg else ''} "
                 f"[{strategy}]")
        fns[label] = (lambda b=buffers: full_step(b, False))
        meta_of[label] = {"action": "ALL_REDUCE", "strategy": strategy, "reduce_avg": avg,
                          "buffers": len(buffers), "bytes": grad_bytes(buffers)}
    nbytes = meta_of[f"ALL_REDUCE [{strategies[0]}]"]["bytes"]
    res["meta"]["grad_bytes"] = nbytes
    say(f"# grads: {nbytes / 1e6:.1f} MB in fused buffers of {args.group_mb:g} MiB groups")
    segments = [int(float(x) * MiB) for x in args.segments_mb.split(",") if x]
    raw_fns = raw_candidates(comm, nbytes, params, 1.0 / n, segments)
    gloo = None if args.no_torch else gloo_allreduce(comm, nbytes)
    gloo_key = None
    if gloo is not None and "error" not in gloo:
        gloo_key = f"torch {gloo['torch']} gloo all_reduce (one call)"
        raw_fns[gloo_key] = gloo["fn"]
    elif gloo is not None:
        res["gloo_error"] = gloo["error"]
    timed = timeit_many({**fns, **raw_fns}, comm, args.iters, args.warmup)
    if gloo_key:
        gloo["close"]()
    for label in fns:
        steps[label] = dict(timed[label], **meta_of[label])
    raw = {k: timed[k] for k in raw_fns}
    del keep, fns, raw_fns, gloo

    # -- 2. REDUCE and REDUCE_SCATTER + sync_params, per strategy, vs their raw floors
    say("# measuring REDUCE and REDUCE_SCATTER steps (in rounds) ...")
    fns, keep = {}, []
    for strategy in strategies:
        for act in (HookAction.REDUCE, HookAction.REDUCE_SCATTER):
            buffers = build_buffers(make_params(args.preset, args.dtype, rank, fill=False),
                                    act, group_bytes, comm, strategy)
            keep.append(buffers)
            sync = act == HookAction.REDUCE_SCATTER
            label = f"{act.name}{' + sync_params' if sync else ''} [{strategy}]"
            fns[label] = (lambda b=buffers, y=sync: full_step(b, y))
            meta_of[label] = {"action": act.name, "strategy": strategy, "reduce_avg": False,
                              "buffers": len(buffers), "bytes": grad_bytes(buffers)}
    other = raw_other(comm, nbytes)
    timed = timeit_many({**fns, **other}, comm, args.iters, args.warmup)
    for label in fns:
        steps[label] = dict(timed[label], **meta_of[label])
    raw.update({k: timed[k] for k in other})
    del keep, fns, other
    res["steps"] = steps
    res["raw"] = raw
    floor_names = [k for k in raw if k.startswith("Allreduce")]
    floor_name = min(floor_names, key=lambda k: raw[k]["median_s"])
    res["floor"] = dict(raw[floor_name], name=floor_name)
    scaled_names = [k for k in raw if k.startswith("floor+scale")]
    sfloor_name = min(scaled_names, key=lambda k: raw[k]["median_s"])
    res["floor_with_scale"] = dict(raw[sfloor_name], name=sfloor_name)

    # -- 3. message size sweep (single buffer), busbw
    say("# sweeping message sizes and fusion group sizes ...")
    lo, hi, st = (int(x) for x in args.size_sweep.split(":"))
    sweep = []
    comms = {s: Communicator(world, CommOptions(strategy=s)) for s in strategies}
    for e in range(lo, hi + 1, st):
        size = 1 << e
        buf = np.ones(size // 4, np.float32)
        iters = int(min(200, max(args.iters, 2e8 / size)))
        row: Dict[str, Any] = {"bytes": size}
        fns = {"raw_floor": lambda: _raw_best(comm, buf, _default_segment()),
               "naive_iallreduce": lambda: comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.FLOAT]).Wait()}
        for s, c in comms.items():
            fns[f"mpifusion_{s}"] = (lambda c=c: c.allreduce(buf).wait())
        for key, r in timeit_many(fns, comm, iters, max(1, args.warmup)).items():
            algbw = _gbps(size, r["median_s"])
            row[key] = {"median_s": r["median_s"], "algbw_GBps": algbw,
                        "busbw_GBps": algbw * bus_factor("allreduce", n)}
        sweep.append(row)
    res["size_sweep"] = sweep

    # -- 4. fusion group size sweep (default strategy)
    gsweep = []
    for g in (float(x) for x in args.group_sweep.split(",") if x):
        buffers = build_buffers(make_params(args.preset, args.dtype, rank, fill=False),
                                HookAction.ALL_REDUCE, int(g * MiB), comm,
                                _DEFAULT)
        r = timeit(lambda b=buffers: full_step(b, False), comm, args.iters, args.warmup)
        gsweep.append({"label": f"{g:g}", "group_mib": g, "buffers": len(buffers),
                       "median_s": r["median_s"],
                       "busbw_GBps": _gbps(nbytes, r["median_s"]) * bus_factor("allreduce", n)})
        del buffers
    res["group_sweep"] = gsweep

    # -- 5. overlap with emulated compute (OSU), add_grad cost
    say("# overlap, add_grad cost, peak memory ...")
    res["overlap"] = {}
    for strategy in strategies:
        buffers = build_buffers(make_params(args.preset, args.dtype, rank, fill=False),
                                HookAction.ALL_REDUCE, group_bytes, comm, strategy)
        for mode in ("device", "cpu"):
            res["overlap"][f"{strategy}/{mode}"] = overlap(buffers, comm, args.iters,
                                                           args.warmup, mode)
        if strategy == _DEFAULT:
            res["add_grad"] = add_grad_cost(buffers, comm, max(args.iters, 5))
        del buffers
    del params

    # -- 6. peak memory during steps (fresh params, one action at a time)
    res["memory"] = {a.name: peak_memory(args.preset, args.dtype, a, group_bytes, comm,
                                         _DEFAULT) for a in HookAction}
    res["memory"]["ru_maxrss_kB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res["meta"]["wall_s"] = time.perf_counter() - t_start

    # -- report
    step = steps[f"ALL_REDUCE [{_DEFAULT}]"]
    naive = raw["Iallreduce (naive, one call)"]
    targets = [
        ("ALL_REDUCE step / best raw collective", round_ratio(step, res["floor"]), "<= 1.15"),
        ("ALL_REDUCE step / (best raw collective + 1/n scaling)",
         round_ratio(step, res["floor_with_scale"]), "<= 1.15"),
        ("naive flat Iallreduce / ALL_REDUCE step", round_ratio(naive, step), ">= 3"),
    ]
    gloo_key = next((k for k in raw if "gloo" in k), None)
    if gloo_key:
        targets.append(("torch gloo all_reduce / ALL_REDUCE step",
                        round_ratio(raw[gloo_key], step), ">= 4"))
    ov = res["overlap"].get(f"{_DEFAULT}/device")
    if ov:
        targets.append(("overlap with emulated (device) compute, %", ov["overlap_pct"], ">= 80"))
    targets.append(("add_grad per param, us", res["add_grad"]["per_param_s"] * 1e6, "<= 3"))
    targets.append(("peak memory / (params + grads + padding), ALL_REDUCE",
                    res["memory"]["ALL_REDUCE"]["ratio"], "<= 1.05"))
    res["targets"] = [{"what": w, "value": v, "target": t, "met": _met(v, t)}
                      for w, v, t in targets]

    if rank == 0:
        bf = bus_factor("allreduce", n)
        _print_table("mpifusion full steps (add_grad of every param, comm, scale)",
                     ["step", "buffers", "median ms", "min ms", "busbw GB/s", "x floor"],
                     [[k, v["buffers"], _fmt_ms(v["median_s"]), _fmt_ms(v["min_s"]),
                       f"{_gbps(v['bytes'], v['median_s']) * bf:.2f}",
                       f"{v['median_s'] / res['floor']['median_s']:.2f}"]
                      for k, v in steps.items()])
        _print_table(f"raw MPI on one contiguous buffer of {nbytes / 1e6:.0f} MB",
                     ["way", "median ms", "min ms", "busbw GB/s", "x floor"],
                     [[k, _fmt_ms(v["median_s"]), _fmt_ms(v["min_s"]),
                       f"{_gbps(nbytes, v['median_s']) * bf:.2f}",
                       f"{v['median_s'] / res['floor']['median_s']:.2f}"]
                      for k, v in raw.items()])
        keys = [k for k in sweep[0] if k != "bytes"]
        _print_table("allreduce size sweep: busbw GB/s "
                     "(algbw = bytes/time, busbw = algbw*2(n-1)/n)",
                     ["bytes"] + keys,
                     [[r["bytes"]] + [f"{r[k]['busbw_GBps']:.2f}" for k in keys] for r in sweep])
        _print_table("fusion group size sweep (ALL_REDUCE full step, default strategy)",
                     ["group MiB", "buffers", "median ms", "busbw GB/s"],
                     [[g["label"], g["buffers"], _fmt_ms(g["median_s"]),
                       f"{g['busbw_GBps']:.2f}"] for g in gsweep])
        _print_table("overlap with emulated compute (OSU: 1 - (total - compute) / pure)",
                     ["strategy/compute", "pure ms", "total ms", "overlap %"],
                     [[k, _fmt_ms(v["pure_s"]), _fmt_ms(v["total_s"]), f"{v['overlap_pct']:.0f}"]
                      for k, v in res["overlap"].items()])
        _print_table("peak memory during steps (tracemalloc, slowest rank)",
                     ["action", "params+grads+padding MB", "peak MB", "ratio"],
                     [[k, f"{v['ideal_bytes'] / 1e6:.1f}", f"{v['peak_bytes'] / 1e6:.1f}",
                       f"{v['ratio']:.3f}"] for k, v in res["memory"].items()
                      if isinstance(v, dict)])
        _print_table("targets (ratios within this run: median over rounds of the per-round ratio)",
                     ["what", "value", "target", "met"],
                     [[t["what"], f"{t['value']:.2f}", t["target"], "yes" if t["met"] else "NO"]
                      for t in res["targets"]])
        if "gloo_error" in res:
            print(f"\n(torch gloo skipped: {res['gloo_error']})")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1, default=str)
        note = write_plot(args.png, res) if args.png else None
        print(f"\nwall time {res['meta']['wall_s']:.0f} s; wrote {args.json or '-'}, "
              f"{(note or args.png) or '-'}")
        sys.stdout.flush()
    comm.Barrier()
    for c in comms.values():
        c.barrier()
    comm.Free()
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
