"""``mpifusion bench``'s report: markdown tables on rank 0, then the JSON and the plot.

:data:`TABLES` lists the tables in order; each takes the results dict and gives
``(title, header, rows)``. The table layout and the JSON are what users and scripts read.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable, List, Optional, Sequence

from ..bandwidth import busbw, fmt_gbps
from ..timing import round_ratio
from .cluster import table_cluster, write_cluster_plot
from .settings import Settings
from .targets import BANDWIDTH_BOUND_BYTES
from .workload import MiB


def fmt_ms(s: float) -> str:
    """Milliseconds: one decimal from 10 ms, three below (small models' steps)."""
    ms = s * 1e3
    return f"{ms:9.1f}" if ms >= 10 else f"{ms:9.3f}"


def step_kind(label: str) -> str:
    """The collective of a step or raw row, for its busbw factor."""
    if label.startswith("REDUCE_SCATTER"):
        return "reduce_scatter+allgather"
    if label.startswith("REDUCE"):
        return "reduce"
    return "all_reduce"


def _nan(value: Optional[float]) -> float:
    return float("nan") if value is None else value


def _x_floor(v: dict, res: dict) -> str:
    floor = res["floor"]["median_s"]
    return f"{v['median_s'] / floor:.2f}" if floor > 0 else "-"


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A markdown table under a ``## title`` heading, columns padded to their widest cell."""
    print(f"\n## {title}")
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")


def table_steps(res: dict) -> tuple:
    n = res["meta"]["nranks"]
    return ("mpifusion full steps (add_grad of every param, comm, scale)",
            ["step", "buffers", "median ms", "min ms", "busbw GB/s", "x floor"],
            [[k, v["buffers"], fmt_ms(v["median_s"]), fmt_ms(v["min_s"]),
              fmt_gbps(busbw(step_kind(k), v["bytes"], v["median_s"], n), 2), _x_floor(v, res)]
             for k, v in res["steps"].items()])


def table_raw(res: dict) -> tuple:
    n, nbytes = res["meta"]["nranks"], res["meta"]["grad_bytes"]
    return (f"raw MPI on one contiguous buffer of {nbytes / 1e6:.3g} MB",
            ["way", "median ms", "min ms", "busbw GB/s", "x floor"],
            [[k, fmt_ms(v["median_s"]), fmt_ms(v["min_s"]),
              fmt_gbps(busbw(step_kind(k.replace(" raw:", "")), nbytes, v["median_s"], n), 2),
              _x_floor(v, res)] for k, v in res["raw"].items()])


def _ratio(v: dict, ref: Optional[dict]) -> str:
    return "-" if not ref or ref["median_s"] <= 0 else f"{round_ratio(v, ref):.2f}"


def table_side_by_side(res: dict) -> tuple:
    """Every strategy's ALL_REDUCE step beside the memcpy floor and the best raw segmented
    Allreduce + 1/n, all timed in the same rounds: the ratios are per round."""
    memcpy, scaled = res.get("memcpy"), res.get("floor_with_scale")
    rows = []
    steps = [(k, v) for k, v in res["steps"].items()
             if k.startswith("ALL_REDUCE [")]
    if "half_step" in res:
        steps.append((res["half_step"]["name"], res["half_step"]))
    for k, v in steps:
        rows.append([k, fmt_ms(v["median_s"]), _ratio(v, memcpy), _ratio(v, scaled),
                     v.get("fallback") or ""])
    if memcpy:
        rows.append([memcpy["name"], fmt_ms(memcpy["median_s"]), "1.00",
                     _ratio(memcpy, scaled), ""])
    if scaled:
        rows.append([f"floor + scale: {scaled['name'].split(': ', 1)[-1]}",
                     fmt_ms(scaled["median_s"]), _ratio(scaled, memcpy), "1.00", ""])
    for name, why in res.get("skipped_strategies", {}).items():
        rows.append([f"ALL_REDUCE [{name}]", "-", "-", "-", f"skipped: {why}"])
    return ("strategies side by side with the memcpy floor (ALL_REDUCE full step; ratios: "
            "median over rounds of the per-round ratio)",
            ["step", "median ms", "x memcpy", "x floor+scale", "note"], rows)


def table_small_buffers(res: dict) -> tuple:
    """One small fused buffer per strategy: the latency a shared-memory strategy must match against thread."""
    rows = []
    for r in res.get("small_buffers", []):
        keys = [k for k in r if isinstance(r[k], dict)]
        rows.append([f"{r['bytes'] >> 10} KiB"]
                    + [f"{r[k]['median_s'] * 1e6:.1f} us"
                       + ("" if r[k]["x_thread"] is None else f" ({r[k]['x_thread']:.2f})")
                       for k in keys])
    first = res["small_buffers"][0]
    header = ["buffer"] + [k for k in first if isinstance(first[k], dict)]
    return ("small buffers: one ALL_REDUCE step per strategy (each run's median step, "
            "median over rounds; in brackets x thread, per round)", header, rows)


def table_window_sweep(res: dict) -> tuple:
    return ("nonblocking window sweep (ALL_REDUCE full step; x thread: median over rounds of "
            "the per-round ratio)",
            ["step", "median ms", "min ms", "x thread"],
            [[r["what"], fmt_ms(r["median_s"]), fmt_ms(r["min_s"]),
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
            [[g["label"], g["buffers"], fmt_ms(g["median_s"]), fmt_gbps(g["busbw_GBps"], 2)]
             for g in res["group_sweep"]])


def table_overlap(res: dict) -> tuple:
    return ("overlap with emulated compute (OSU: 1 - (total - compute) / pure)",
            ["strategy/compute", "pure ms", "total ms", "overlap %"],
            [[k, fmt_ms(v["pure_s"]), fmt_ms(v["total_s"]), f"{v['overlap_pct']:.0f}"]
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
    table_steps, table_raw, table_side_by_side, table_window_sweep, table_small_buffers,
    table_size_sweep, table_group_sweep,
    table_overlap, table_memory, table_order, table_cluster, table_targets,
]


def write_plot(path: str, res: dict) -> Optional[str]:
    """The size sweep and the group sweep as a PNG; a note instead when matplotlib is
    missing."""
    try:  # optional (the bench extra) and slow to import: only when a plot is written
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover - matplotlib is in the bench extra
        return f"no plot: {exc} (pip install 'mpifusion[bench]')"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    sweep = res["size_sweep"]
    sizes = [row["bytes"] for row in sweep]
    for key, style in (("raw_floor", "k-o"), ("mpifusion_thread", "b-s"),
                       ("mpifusion_nonblocking", "g-^"), ("mpifusion_shm", "m-d"),
                       ("mpifusion_hierarchical", "c-v"), ("naive_iallreduce", "r--x")):
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


def report(res: dict, s: Settings) -> None:
    """Rank 0: the tables (those of the sections measured: ``--only`` runs one; a table
    gives None where its section has nothing, as the cluster's on one node), then the
    files."""
    for table in TABLES:
        try:
            got = table(res)
        except KeyError:
            if s.only is None:
                raise
            continue
        if got is not None and got[2]:
            print_table(*got)
    hidden = [t for t in res["targets"] if not t["applies"]]
    if hidden:
        print(f"\n({len(hidden)} target(s) not shown: they are set for bandwidth-bound syncs of "
              f">= {BANDWIDTH_BOUND_BYTES // MiB} MiB of grads; this model has "
              f"{res['meta']['grad_bytes'] / 1e6:.3g} MB. Try --preset gpt2-small.)")
    for name, why in res.get("skipped_strategies", {}).items():
        print(f"\n(strategy {name} skipped: {why})")
    if "gloo_error" in res:
        print(f"\n(torch gloo skipped: {res['gloo_error']})")
    if s.json_path:
        with open(s.json_path, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    note = write_plot(s.png_path, res) if s.png_path and "size_sweep" in res else None
    wrote = [p for p in (s.json_path, None if note or "size_sweep" not in res
                         else s.png_path) if p]
    if s.png_path and res.get("cluster"):
        cluster_png = s.png_path[:-4] + "_cluster.png" if s.png_path.endswith(".png") \
            else s.png_path + "_cluster.png"
        cnote = write_cluster_plot(cluster_png, res)
        note = "; ".join(x for x in (note, cnote) if x) or None
        wrote += [] if cnote else [cluster_png]
    print(f"\nwall time {res['meta']['wall_s']:.0f} s; wrote {', '.join(wrote) or 'nothing'}"
          f"{'; ' + note if note else ''}")
    sys.stdout.flush()
