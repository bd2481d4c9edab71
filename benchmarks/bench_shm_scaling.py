"""Issue 29's growth curve: the ALL_REDUCE step of one fused buffer against buffer size
(1 KiB .. 1 GiB) and rank count, per strategy, beside a memcpy of the same bytes.

Why: the shm strategy promises to stay near a memcpy on any machine state, where MPI's own
pipelined copies drift 1.5-7x away from it. A single absolute time says nothing on a loaded
2-core machine, so every candidate of one size runs in the same rounds (one run of each per
round) and the ratios are taken within a round, median over ``--rounds``.

Each candidate is one FusedCommBuffer of ``size`` bytes of fp32 grads (one param) and one
step: ``add_grad`` (comm starts), ``scale_grads`` (waits, 1/n), so shm's grads live in its
shared window as in training. ``hierarchical`` emulates two nodes (``node_size = n // 2``);
``memcpy`` is ``np.copyto`` of the same bytes on every rank at once; ``MPI Allreduce`` is
the library's one in-place call (no 1/n), the raw point for the model's MPI fit.
Small sizes repeat the step inside one timed run (``reps``) so the barrier's cost drops out.

    mpiexec -n 2 python benchmarks/bench_shm_scaling.py [--max-mib 1024] [--rounds 3]
    python benchmarks/bench_shm_scaling.py --plot 'benchmarks/results/bench_shm_scaling_*.json'

Rank 0 prints a markdown table and records it as .txt and .json, with the machine, the MPI
and the load average, in ``benchmarks/results/`` under a new name
(``bench_shm_scaling_<mpi>_n<N>_<UTC time>``, an entry in its index.json:
benchmarks/record.py); ``--out PREFIX`` writes PREFIX.json/.txt instead, unrecorded. More
ranks than cores is oversubscribed: the table says so.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from mpifusion import machine
from mpifusion.comm import release
from mpifusion.config import STRATEGIES, CommOptions
from mpifusion.runtime.buffer import FusedCommBuffer, HookAction
from mpifusion.runtime.param import Param
from mpifusion.tools.bench.workload import full_step
from mpifusion.tools.timing import mpi_name, round_ratio, timeit_many

import record  # benchmarks/record.py: results go to benchmarks/results/

KiB, MiB = 1 << 10, 1 << 20
#: the strategies measured (those of this mpifusion; hierarchical once it exists)
WANTED = ("thread", "nonblocking", "shm", "hierarchical")


def mem_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None where unreadable): sizes that would not
    fit are skipped, not swapped (the machine is shared)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load() -> str:
    """The 1/5/15-minute load average, recorded with each run (timing is noisy)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def sizes_of(max_mib: int) -> List[int]:
    """1 KiB, 4 KiB, ... up to ``max_mib`` MiB (powers of 4, and ``max_mib`` itself)."""
    out, s = [], KiB
    while s <= max_mib * MiB:
        out.append(s)
        s *= 4
    if out[-1] != max_mib * MiB:
        out.append(max_mib * MiB)
    return out


def one_buffer(world: MPI.Comm, size: int, strategy: str, node_size: Optional[int]
               ) -> FusedCommBuffer:
    """One fused ALL_REDUCE buffer of ``size`` bytes of fp32 grads (real pages, all ones)."""
    param = Param("g", np.zeros(max(1, size // 4), np.float32))
    options = CommOptions(strategy=strategy, node_size=node_size)
    buf = FusedCommBuffer(0, [param], world, act=HookAction.ALL_REDUCE, comm_options=options)
    buf.grad_storage[...] = 1
    return buf


def measure_size(world: MPI.Comm, size: int, strategies: List[str], rounds: int,
                 with_raw: bool) -> Dict[str, Any]:
    """All candidates of one size in the same rounds; ratios within each round."""
    n = world.Get_size()
    comm = world.Dup()  # its own duplicates and windows, released after this size
    # oversubscribed ranks take turns on the cores: fewer repeats keep the run in minutes
    reps = int(min({2: 200, 4: 50}.get(n, 20), max(1, (4 * MiB) // size)))
    bufs: Dict[str, FusedCommBuffer] = {}
    fallback: Dict[str, str] = {}
    fns: Dict[str, Callable[[], Any]] = {}
    for s in strategies:
        node_size = max(1, n // 2) if s == "hierarchical" else None
        bufs[s] = one_buffer(comm, size, s, node_size)
        c = bufs[s].comm
        if c is not None and c.strategy != s:
            fallback[s] = f"ran {c.strategy}: {c.shm_fallback}"
        fns[s] = (lambda b=[bufs[s]]: [full_step(b, False) for _ in range(reps)])
    src = np.ones(max(1, size // 4), np.float32)
    dst = np.empty_like(src)
    fns["memcpy"] = lambda: [np.copyto(dst, src) for _ in range(reps)]
    if with_raw:
        raw = np.ones(max(1, size // 4), np.float32)
        fns["MPI Allreduce"] = lambda: [comm.Allreduce(MPI.IN_PLACE, [raw, MPI.FLOAT])
                                        for _ in range(reps)]
    timed = timeit_many(fns, comm, rounds, 1)
    for b in bufs.values():
        b.close()
    release(comm)
    comm.Free()
    row: Dict[str, Any] = {"bytes": size, "reps": reps, "fallback": fallback}
    for k, v in timed.items():
        per = [t / reps for t in v["times_s"]]
        row[k] = {"median_s": statistics.median(per), "min_s": min(per), "times_s": per,
                  "x_memcpy": round_ratio(v, timed["memcpy"]),
                  "x_thread": round_ratio(v, timed["thread"]) if "thread" in timed else None}
    return row


def fmt_size(b: int) -> str:
    return f"{b // MiB} MiB" if b >= MiB else f"{b // KiB} KiB"


def table(res: Dict[str, Any]) -> str:
    """The markdown table: median per step (us) and per-round ratios to memcpy/thread."""
    keys = [k for k in res["rows"][0] if isinstance(res["rows"][0][k], dict)
            and "median_s" in res["rows"][0][k]]
    m = res["meta"]
    over = " (OVERSUBSCRIBED: more ranks than cores)" if m["oversubscribed"] else ""
    lines = [f"# {m['nranks']} ranks{over}, {m['mpi']}, {m['cpu']}, {m['cpus']} cores, "
             f"{m['rounds']} rounds, load {m['load_start']} -> {m['load_end']}, "
             f"{m['date']}",
             "# cells: median us per step [x memcpy, x thread] (ratios: median over rounds "
             "of the per-round ratio)",
             "| size | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 1)]
    for r in res["rows"]:
        cells = []
        for k in keys:
            if k not in r:
                cells.append("-")
                continue
            v = r[k]
            xt = "" if v["x_thread"] is None else f", {v['x_thread']:.2f}"
            cells.append(f"{v['median_s'] * 1e6:.4g} [{v['x_memcpy']:.2f}{xt}]")
        note = "; ".join(f"{s} {why}" for s, why in r["fallback"].items())
        lines.append(f"| {fmt_size(r['bytes'])} | " + " | ".join(cells) + " |"
                     + (f" {note}" if note else ""))
    lines += [f"# skipped: {s}" for s in res["skipped"]]
    return "\n".join(lines)


def plot(paths: List[str], png: str) -> None:
    """Step time against size per strategy, one panel per MPI, a line style per rank count;
    and x memcpy against size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [json.load(open(p)) for p in sorted(paths)]
    mpis = sorted({r["meta"]["mpi"] for r in runs})
    fig, axes = plt.subplots(2, len(mpis), figsize=(7 * len(mpis), 10), squeeze=False)
    colors = {"thread": "tab:blue", "nonblocking": "tab:green", "shm": "tab:red",
              "hierarchical": "tab:purple", "memcpy": "k", "MPI Allreduce": "tab:orange"}
    styles = {2: "-o", 4: "--s", 8: ":^"}
    for j, mpi in enumerate(mpis):
        for r in (x for x in runs if x["meta"]["mpi"] == mpi):
            n = r["meta"]["nranks"]
            for key, color in colors.items():
                pts = [(row["bytes"], row[key]) for row in r["rows"] if key in row]
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                kw = dict(color=color, label=f"{key} n={n}", markersize=3)
                axes[0][j].plot(xs, [p[1]["median_s"] * 1e6 for p in pts],
                                styles.get(n, "-"), **kw)
                if key != "memcpy":
                    axes[1][j].plot(xs, [p[1]["x_memcpy"] for p in pts],
                                    styles.get(n, "-"), **kw)
        axes[0][j].set_yscale("log")
        axes[0][j].set_ylabel("step time, us (median)")
        axes[0][j].set_title(f"{mpi}: one buffer's ALL_REDUCE step\n(n > "
                             f"{runs[0]['meta']['cpus']}: oversubscribed cores)")
        axes[1][j].set_ylabel("x memcpy (median of per-round ratios)")
        axes[1][j].set_yscale("log")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("buffer size (bytes)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][j].legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-mib", type=int, default=None,
                    help="largest buffer (default: 1024 at 2 ranks, 256 at 4, 64 at 8)")
    ap.add_argument("--min-mib", type=float, default=0,
                    help="smallest buffer (e.g. 1024 with --max-mib 1024: only 1 GiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--strategies", default=",".join(s for s in WANTED if s in STRATEGIES))
    ap.add_argument("--out", default=None, help="results prefix (.json and .txt; not "
                    "recorded; default: a new name in --results)")
    ap.add_argument("--plot", nargs="*", default=None, metavar="JSON",
                    help="no measuring: plot these results files into --png")
    ap.add_argument("--png", default=None, help="the plot (default: a new name in --results, "
                    "recorded)")
    record.add_arguments(ap)
    args = ap.parse_args()
    if args.plot is not None:
        paths = [p for pat in args.plot for p in glob.glob(pat)]
        if args.png:
            plot(paths, args.png)
        else:
            record.save(args, "bench_shm_scaling_plot", "shm-scaling",
                        "plot of " + ", ".join(os.path.basename(p) for p in sorted(paths)),
                        writers={".png": lambda png: plot(paths, png)})
        return
    if args.rounds < 1:
        raise SystemExit("--rounds: expected an int >= 1")
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    max_mib = args.max_mib or {2: 1024, 4: 256}.get(n, 64)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    skipped = [f"{s}: not a strategy of this mpifusion" for s in strategies
               if s not in STRATEGIES]
    strategies = [s for s in strategies if s in STRATEGIES]
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        skipped += [f"{s}: needs MPI_THREAD_MULTIPLE" for s in strategies if s != "nonblocking"]
        strategies = [s for s in strategies if s == "nonblocking"]
    mpi = mpi_name()
    info = record.job(world)
    meta = {"nranks": n, "mpi": mpi, "cpu": machine.cpu_model(), "cpus": os.cpu_count(),
            "machine": machine.machine_key(), "python": platform.python_version(),
            "oversubscribed": n > (os.cpu_count() or n), "rounds": args.rounds,
            "strategies": strategies, "hierarchical_node_size": max(1, n // 2),
            "load_start": load(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = []
    for size in (x for x in sizes_of(max_mib) if x >= args.min_mib * MiB):
        # per rank: each strategy's grads, memcpy's two copies, the raw buffer (<= 256 MiB)
        with_raw = size <= 256 * MiB
        need = size * (len(strategies) + 2 + with_raw) * n
        avail = world.bcast(mem_available() if rank == 0 else None, root=0)
        if avail is not None and need > 0.6 * avail:
            skipped.append(f"{fmt_size(size)}: needs ~{need / 2**30:.1f} GiB over the ranks, "
                           f"{avail / 2**30:.1f} GiB available")
            continue
        t0 = time.perf_counter()
        rows.append(measure_size(world, size, strategies, args.rounds, with_raw))
        if rank == 0:
            r = rows[-1]
            print(f"# {fmt_size(size)}: {time.perf_counter() - t0:.1f} s; x memcpy "
                  + ", ".join(f"{k} {r[k]['x_memcpy']:.2f}" for k in r
                              if isinstance(r[k], dict) and "x_memcpy" in r[k]), flush=True)
    meta["load_end"] = load()
    res = {"meta": meta, "rows": rows, "skipped": skipped}
    if rank == 0:
        text = table(res)
        print(text)
        if args.out:
            with open(args.out + ".json", "w") as fh:
                json.dump(res, fh, indent=1)
            with open(args.out + ".txt", "w") as fh:
                fh.write(text + "\n")
            print(f"wrote {args.out}.json, {args.out}.txt", file=sys.stderr)
        else:
            record.save(args, "bench_shm_scaling", "shm-scaling",
                        f"one fused buffer's ALL_REDUCE step per strategy, {n} ranks, x memcpy",
                        job_info=info, text=text, data=res)


if __name__ == "__main__":
    main()
