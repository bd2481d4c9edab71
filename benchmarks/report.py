"""The current benchmark tables of the docs, built from the latest results in
``benchmarks/results/`` (the entries of its manifest, index.json: benchmarks/record.py).

    python benchmarks/report.py            # print every generated block
    python benchmarks/report.py --write    # rewrite them in the pages
    python benchmarks/report.py --check    # exit 1, naming the block, where a page differs

A generated block lies between ``<!-- report.py: NAME -->`` and ``<!-- report.py: end NAME
-->`` in a page; the text around it is the page's own. The blocks: docs/benchmarks.md's
``current`` (one table per target, each from the latest result of that target, or of each
MPI library for the ``mpifusion bench`` runs) and ``index`` (every recorded result), and
docs/performance.md's ``headline`` (the default path's table). Each table states the date,
the commit and the machine of what it shows. Where the latest result of a target was measured
while a default buffer took another strategy than it takes now (``auto``, as
``mpifusion.comm.communicator.resolve_strategy`` decides on one node and across nodes), the
table says "old results only" instead of presenting them as current.
tests/docs/test_benchmarks_page.py fails when a page is not what this script builds.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
#: the pages with generated blocks, and the blocks each holds
PAGES = {"docs/benchmarks.md": ("current", "index"), "docs/performance.md": ("headline",)}
MARK = "<!-- report.py: {} -->"
END = "<!-- report.py: end {} -->"

Entry = Dict[str, Any]


# ------------------------------------------------------------------------------ the manifest

def load(folder: str = RESULTS) -> List[Entry]:
    """The manifest's entries, oldest first, each with ``_folder`` set."""
    with open(os.path.join(folder, "index.json")) as fh:
        index = json.load(fh)
    entries = [dict(e, _folder=folder) for e in index["results"]]
    return sorted(entries, key=lambda e: e["date"])


def path(e: Entry, suffix: str) -> Optional[str]:
    """The entry's file ending in ``suffix`` (``.json``, ``.txt``), or None."""
    for f in e["files"]:
        if f.endswith(suffix):
            return os.path.join(e["_folder"], f)
    return None


def read_json(e: Entry) -> Optional[dict]:
    p = path(e, ".json")
    return None if p is None else _json(p)


@functools.lru_cache(maxsize=None)
def _json(p: str) -> dict:
    with open(p) as fh:
        return json.load(fh)


def read_text(e: Entry) -> str:
    with open(path(e, ".txt"), encoding="utf-8", errors="replace") as fh:
        return fh.read().replace("\x00", "")


def of(entries: Sequence[Entry], target: str, need: str = "") -> List[Entry]:
    return [e for e in entries if e["target"] == target
            and (not need or path(e, need) is not None)]


def latest_per_mpi(entries: Sequence[Entry]) -> List[Entry]:
    """The newest entry of each MPI library (entries are oldest first), in MPICH, Open MPI
    order."""
    newest: Dict[str, Entry] = {}
    for e in entries:
        newest[" / ".join(e["machine"]["mpi"])] = e
    return sorted(newest.values(), key=lambda e: " / ".join(e["machine"]["mpi"]))


def current_default(setting: Optional[str]) -> Optional[str]:
    """What ``auto`` takes today for a large buffer: on one node (2 ranks at
    MPI_THREAD_MULTIPLE), across nodes of 2 ranks each."""
    if setting is None:
        return None
    from mpifusion.comm.communicator import resolve_strategy

    if setting == "one node":
        return resolve_strategy("auto", size=2, per_node=2, thread_multiple=True)[0]
    return resolve_strategy("auto", size=4, per_node=2, thread_multiple=True)[0]


# ------------------------------------------------------------------------------ formatting

def short(commit: Optional[str]) -> str:
    return commit[:7] if commit else "unknown"


def when(e: Entry) -> str:
    return e["date"].replace("T", " ")[:16] + " UTC"


def mpis(e: Entry) -> str:
    return " / ".join(e["machine"]["mpi"]) or "no MPI"


def machine(e: Entry) -> str:
    m = e["machine"]
    mem = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ""
    return f"{m['cpu']}, {m['cores']} cores{mem}"


def measured(e: Entry) -> str:
    """``2026-12-05 16:01 UTC, commit 776e58a (measured on the tree of d2419cc)``; a date
    taken from git (results older than the manifest) is the commit's: "by" that date."""
    tree = f" (measured on the tree of {e['measured_at']})" if e.get("measured_at") else ""
    dirty = " with uncommitted changes" if e.get("dirty") else ""
    date = (f"by {when(e)} (the date of the commit that added it)"
            if e.get("date_source") == "git" else when(e))
    return f"{date}, commit {short(e['commit'])}{dirty}{tree}"


def provenance(used: Sequence[Entry]) -> List[str]:
    """The lines that say when, where and on what the table's results were measured, and
    whether they are current."""
    lines = []
    machines = list(dict.fromkeys(machine(e) for e in used))
    if len({measured(e) for e in used}) == 1 and len(machines) == 1:
        ids = " and ".join(f"{mpis(e)} (`{e['id']}`)" for e in used)
        lines.append(f"Measured {measured(used[0])} on {machines[0]}, {ids}.")
    else:
        runs = "; ".join(f"{mpis(e)}: {measured(e)} (`{e['id']}`)" for e in used)
        lines.append(f"Measured on {' and '.join(machines)}. {runs}.")
    settings = {e.get("setting") for e in used}
    then = sorted({e.get("default_strategy") or "" for e in used} - {""})
    if settings == {None}:
        lines.append("Does not depend on the communication strategy.")
    else:
        setting = next(s for s in settings if s)
        now = current_default(setting)
        if then and then != [now]:
            lines.append(f"**Old results only**: measured while a default buffer "
                         f"({setting}) took `{'`, `'.join(then)}`; it now takes `{now}`, and "
                         "this target has no result since. Read them as history, not as "
                         "what the default does today.")
        else:
            lines.append(f"Current: a default buffer ({setting}) took `{now}` then and "
                         "takes it now.")
    notes = list(dict.fromkeys(e["note"] for e in used if e.get("note")))
    if notes:
        lines.append("Note: " + "; ".join(notes) + ".")
    return lines


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    return (["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def ms(v: Optional[dict]) -> str:
    return "-" if not v else f"{v['median_s'] * 1e3:.1f}"


def x(a: Optional[dict], b: Optional[dict]) -> str:
    from mpifusion.tools.timing import round_ratio

    return "-" if not a or not b else f"{round_ratio(a, b):.2f}"


def met(t: Optional[dict]) -> str:
    return "-" if not t else f"{t['value']:.2f} ({'met' if t['met'] else '**missed**'})"


def md_tables(text: str) -> List[Tuple[List[str], List[str], List[List[str]]]]:
    """The markdown tables of a result's text: (the ``#`` lines since the previous table,
    header, rows)."""
    out, notes, lines = [], [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set(
                "|- :"):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            out.append((notes, header, rows))
            notes = []
            continue
        if line.startswith("#"):
            notes.append(line)
        i += 1
    return out


# ------------------------------------------------------------------------------ the targets

Section = Tuple[str, List[Entry], List[str]]  # title, entries used, table lines


#: the workload of the default path's tables: ``mpifusion bench`` runs of other presets or
#: rank counts are listed in the index, not shown as the default path
REFERENCE = {"preset": "gpt2-small", "nranks": 2}


def _bench_runs(entries: Sequence[Entry]) -> List[Tuple[Entry, dict]]:
    """The latest ``mpifusion bench`` JSON of the reference workload of each MPI, with its
    results."""
    runs = [e for e in of(entries, "default-step", ".json")
            if all(read_json(e).get("meta", {}).get(k) == v for k, v in REFERENCE.items())]
    return [(e, read_json(e)) for e in latest_per_mpi(runs)]


def _target(res: dict, start: str) -> Optional[dict]:
    return next((t for t in res.get("targets", []) if t["what"].startswith(start)), None)


def sec_default_path(entries: Sequence[Entry]) -> Optional[Section]:
    runs = _bench_runs(entries)
    if not runs:
        return None
    params = runs[0][1]["meta"]["params"]
    header, cells = [f"ALL_REDUCE full step (add_grad x {params}, reduce, 1/n)"], []
    for e, res in runs:
        header += [f"{mpis(e)}, ms", "x memcpy", "x raw + 1/n"]
    default = runs[0][1]["meta"]["default_strategy"]
    names = [(f"default step: `{default}`", lambda r: r["steps"].get(
                 f"ALL_REDUCE [{r['meta']['default_strategy']}]")),
             ("bf16 grads, default strategy", lambda r: r.get("half_step")),
             ("`thread` (MPI's blocking Allreduce in segments, on a thread)",
              lambda r: r["steps"].get("ALL_REDUCE [thread]")),
             ("`nonblocking` (Iallreduce in segments)",
              lambda r: r["steps"].get("ALL_REDUCE [nonblocking]")),
             ("best raw way of the buffer, no 1/n (raw)", lambda r: r.get("floor")),
             ("best raw way + the same 1/n (raw + 1/n)", lambda r: r.get("floor_with_scale")),
             ("naive flat `Iallreduce`", lambda r: r["raw"].get("Iallreduce (naive, one call)")),
             ("memcpy of the same grad bytes", lambda r: r.get("memcpy"))]
    for label, pick in names:
        row = [label]
        for _, res in runs:
            v = pick(res)
            row += [ms(v), x(v, res.get("memcpy")), x(v, res.get("floor_with_scale"))]
        cells.append(row)
    meta = runs[0][1]["meta"]
    caption = (f"{meta['preset']} {meta['dtype']} ({meta['grad_bytes'] / 1e6:.0f} MB of grads "
               f"in {meta['group_bytes'] >> 20} MiB groups), {meta['nranks']} ranks; the "
               "slowest rank's median of "
               f"{meta['iters']} rounds; ratios are medians of per-round ratios within each run.")
    ways = ["The run's best raw ways: " + "; ".join(
        f"{mpis(e)}: raw = {res['floor']['name']}, raw + 1/n = "
        f"{res['floor_with_scale']['name']}" for e, res in runs if "floor_with_scale" in res)
        + "."]
    return ("The default path on one node: `shm` against MPI's own `Allreduce`",
            [e for e, _ in runs], [caption, ""] + table(header, cells) + [""] + ways)


STEP_TARGETS = ("ALL_REDUCE step / best raw collective", "ALL_REDUCE step / (best raw",
                "REDUCE step /", "REDUCE_SCATTER + sync_params step /",
                "naive flat Iallreduce", "torch gloo", "shm ALL_REDUCE step / (best raw",
                "shm ALL_REDUCE step / memcpy")
HALF_TARGETS = ("shm ALL_REDUCE step, bfloat16",)
SMALL_TARGETS = ("shm / thread, one 4-64 KiB",)


def _txt_targets(e: Entry) -> Dict[str, float]:
    """A ``mpifusion bench`` text's ``## targets`` table: {what: value}."""
    out: Dict[str, float] = {}
    for _, header, rows in md_tables(read_text(e)):
        if header[:3] == ["what", "value", "target"]:
            for r in rows:
                try:
                    out[r[0]] = float(r[1])
                except ValueError:
                    pass
    return out


def _same_default_runs(entries: Sequence[Entry], e: Entry) -> List[Entry]:
    """The ``mpifusion bench`` runs of ``e``'s MPI and machine under ``e``'s default."""
    return [o for o in of(entries, "default-step", ".txt")
            if o["machine"]["mpi"] == e["machine"]["mpi"] and machine(o) == machine(e)
            and o.get("default_strategy") == e.get("default_strategy")]


def _targets_table(entries: Sequence[Entry], keep: Callable[[str], bool]
                   ) -> Optional[Tuple[List[Entry], List[str]]]:
    runs = _bench_runs(entries)
    if not runs:
        return None
    whats = [t["what"] for t in runs[0][1].get("targets", []) if t["applies"] and keep(t["what"])]
    header = ["target", "wanted"]
    history = []
    for e, _ in runs:
        same = _same_default_runs(entries, e)
        history.append([_txt_targets(o) for o in same])
        header += [f"{mpis(e)}, this run",
                   f"all {len(same)} runs with `{e['default_strategy']}` (min-max)"]
    rows = []
    for w in whats:
        row = [w, next(t["target"] for t in runs[0][1]["targets"] if t["what"] == w)]
        for (_, res), hist in zip(runs, history):
            t = next((t for t in res["targets"] if t["what"] == w), None)
            vals = [h[w] for h in hist if w in h]
            row += [met(t), f"{min(vals):.2f}-{max(vals):.2f} ({len(vals)} runs)"
                    if vals else "-"]
        rows.append(row)
    return [e for e, _ in runs], table(header, rows)


def sec_step_targets(entries: Sequence[Entry]) -> Optional[Section]:
    got = _targets_table(entries, lambda w: w.startswith(STEP_TARGETS))
    return got and ("The sync step against the raw collective (targets of `mpifusion bench`)",
                    got[0], ["Ratios within each run (median of per-round ratios); beside the "
                             "latest run, the range over every recorded run of the same MPI, "
                             "machine and default strategy, older code included: on this "
                             "shared machine one run's ratio is not the whole story.", ""]
                    + got[1])


def sec_small_buffers(entries: Sequence[Entry]) -> Optional[Section]:
    runs = _bench_runs(entries)
    runs = [(e, r) for e, r in runs if r.get("small_buffers")]
    if not runs:
        return None
    default = runs[0][1]["meta"]["default_strategy"]
    header = ["one fused buffer"]
    for e, _ in runs:
        header += [f"{mpis(e)}: `thread`, us", f"`{default}`, us (x thread)"]
    rows = []
    for i, row0 in enumerate(runs[0][1]["small_buffers"]):
        row = [f"{row0['bytes'] >> 10} KiB"]
        for _, res in runs:
            r = res["small_buffers"][i]
            d = r.get(default, {})
            row += [f"{r['thread']['median_s'] * 1e6:.1f}",
                    f"{d['median_s'] * 1e6:.1f} ({d['x_thread']:.2f})" if d else "-"]
        rows.append(row)
    small = _targets_table(entries, lambda w: w.startswith(SMALL_TARGETS))
    lines = ["Each step timed, each run's median step, median over rounds; target: no slower "
             "than `thread`.", ""] + table(header, rows)
    if small:
        lines += [""] + small[1]
    return "Small buffers (4-64 KiB) on the default path", [e for e, _ in runs], lines


def sec_other_targets(entries: Sequence[Entry]) -> Optional[Section]:
    got = _targets_table(entries, lambda w: not w.startswith(
        STEP_TARGETS + HALF_TARGETS + SMALL_TARGETS))
    return got and ("Overlap, `add_grad`, the order check and memory (targets of `mpifusion "
                    "bench`)", got[0], got[1])


def sec_half(entries: Sequence[Entry]) -> Optional[Section]:
    found = of(entries, "half-step")
    if not found:
        return None
    e = found[-1]
    columns: List[Tuple[str, Dict[str, List[str]]]] = []
    workload = ""
    for notes, header, rows in md_tables(read_text(e)):
        said = next((n for n in reversed(notes) if "ranks" in n), "")
        workload = workload or said.lstrip("# ").split(";")[0]
        lib = said.split(";")[-1].strip()
        lib = re.sub(r"(Version:\s*|, package.*)", "", lib).strip() or mpis(e)
        columns.append((lib, {r[0]: r[1:] for r in rows}))
    steps = list(columns[0][1])
    header = ["ALL_REDUCE step"]
    for lib, _ in columns:
        header += [f"{lib}, ms", "/ fp32 (median over rounds, min-max)"]
    rows = [[s] + [c for _, col in columns for c in col.get(s, ["-", "-"])] for s in steps]
    return ("Half precision: the bf16 and fp16 step against fp32", [e],
            [f"The run: {workload}. Target: a half-precision step within 0.75x the fp32 "
             "step on the default path (the bf16 row of the default path's table above is "
             "the same target, from `mpifusion bench`).", ""]
            + table(header, rows))


def sec_cluster(entries: Sequence[Entry]) -> Optional[Section]:
    found = latest_per_mpi(of(entries, "cluster", ".json"))
    if not found:
        return None
    from mpifusion.tools.bench.cluster import cluster_checks
    from mpifusion.tools.bench.targets import met

    keys = ["hierarchical / link floor, >= 16 MiB", "hierarchical / thread, >= 1 MiB",
            "hierarchical / raw Allreduce + 1/n, >= 1 MiB", "hierarchical / thread, 4-64 KiB",
            "every step / link floor, the floor's own check"]
    header = ["MPI", "nodes x ranks", "link", "hier / floor, >= 16 MiB (<= 1.15)",
              "hier / thread, >= 1 MiB (<= 1)", "hier / raw + 1/n, >= 1 MiB (<= 1)",
              "hier / thread, 4-64 KiB (<= 1)", "fastest step / floor (>= 0.95)"]
    rows = []
    for e in found:
        for run in read_json(e)["runs"]:
            cl = run.get("cluster")
            if not cl:
                continue
            checks = {what.replace("cluster: ", ""): (value, target)
                      for what, value, target in cluster_checks(cl)}
            mpi = cl["meta"].get("mpi", "-").replace("Intel(R) MPI Library", "Intel MPI")
            row = [mpi.split(" for ")[0], f"{run['nodes']} x {run['ranks_per_node']}",
                   f"{run['rate']}, {cl['link']['rate_Bps'] / 1e9:.2f} GB/s"]
            for start in keys:
                hit = next(((w, v, t) for w, (v, t) in checks.items() if w.startswith(start)),
                           None)
                if hit is None:
                    row.append("-")
                    continue
                w, v, t = hit
                at = w.split(": ")[-1].rstrip(")")
                row.append(f"{v:.2f} ({'met' if met(v, t) else '**missed**'}; {at})")
            rows.append(row)
    return ("Across nodes: `hierarchical` against the link floor", list(found),
            ["Emulated nodes (network namespaces joined by shaped links) sharing one "
             "machine's cores; each cell is the worst size that the target covers. The last "
             "column checks the floor itself: a step faster than it means the link was "
             "measured slow, and the ratios to that floor flatter.", ""]
            + table(header, rows))


def sec_oracle(entries: Sequence[Entry]) -> Optional[Section]:
    found = of(entries, "oracle-check", ".txt")
    if not found:
        return None
    e = found[-1]
    text = read_text(e).splitlines()
    start = next(i for i, line in enumerate(text) if "median s" in line and "x float64" in line)
    rows = []
    for line in text[start + 1:]:
        parts = line.split()
        if len(parts) != 6:
            break
        rows.append(parts)
    work = next((line.split(":", 1)[1].strip() for line in text
                 if line.startswith("workload:")), "")
    exact = next(r for r in rows if r[0] == "exact")
    ok = float(exact[4]) <= 2
    return ("The oracle check's cost", [e],
            [f"`mpifusion check`, {work}. Target: the exact check within 2x the float64 "
             f"check's time: {exact[4]} ({'met' if ok else '**missed**'}).", ""]
            + table(["median of the rounds", "wall s", "CPU s", "x read", "x float64",
                     "peak GiB"], rows))


def sec_deadline(entries: Sequence[Entry]) -> Optional[Section]:
    found = of(entries, "deadline", ".txt")
    if not found:
        return None
    e = found[-1]
    cells: Dict[Tuple[str, str], Dict[str, List[str]]] = {}
    libs: List[str] = []
    for notes, header, rows in md_tables(read_text(e)):
        title = next((n for n in notes if n.startswith("## ")), "")
        if "before" in title:
            continue
        lib = title[3:].split(",")[0].strip() or mpis(e)
        libs = list(dict.fromkeys(libs + [lib]))
        for r in rows:
            cells.setdefault((r[0], r[1]), {}).setdefault(lib, []).append(r[4])
    rows = [[case, strategy] + [", ".join(v.get(lib, [])) or "-" for lib in libs]
            for (case, strategy), v in cells.items()]
    return ("With a deadline: deadline 60 s / none", [e],
            ["Each run's ratio, best of its rounds' medians (1.00: the deadline is free).", ""]
            + table(["case", "strategy"] + [f"{lib} (runs)" for lib in libs], rows))


def sec_window(entries: Sequence[Entry]) -> Optional[Section]:
    found = of(entries, "nonblocking-window", ".json")
    if not found:
        return None
    e = found[-1]
    per: Dict[str, Dict[str, List[float]]] = {}
    for f in e["files"]:
        if not f.endswith(".json"):
            continue
        with open(os.path.join(e["_folder"], f)) as fh:
            res = json.load(fh)
        lib = res["meta"]["mpi"]
        for row in res["window_sweep"]:
            per.setdefault(row["what"], {}).setdefault(lib, []).append(row["x_thread"])
    libs = sorted({lib for v in per.values() for lib in v})
    m = res["meta"]
    rows = [[what] + [", ".join(f"{r:.2f}" for r in v.get(lib, [])) + (
        f"; median {statistics.median(v[lib]):.2f}" if len(v.get(lib, [])) > 1 else "")
        for lib in libs] for what, v in per.items()]
    return ("The `nonblocking` window against `thread`", [e],
            [f"x the `thread` step per run (median of per-round ratios), {m['preset']} "
             f"{m['dtype']}, {m['nranks']} ranks. Target: `nonblocking` within 1.25x "
             "`thread`.", ""]
            + table(["ALL_REDUCE step"] + [f"{lib} (runs)" for lib in libs], rows))


def _simple_table(target: str, title: str, caption: str, pick: int = -1
                  ) -> Callable[[Sequence[Entry]], Optional[Section]]:
    """A section that shows one markdown table of the latest result's text as it is."""
    def section(entries: Sequence[Entry]) -> Optional[Section]:
        found = of(entries, target, ".txt")
        if not found:
            return None
        e = found[-1]
        tables = md_tables(read_text(e))
        notes, header, rows = tables[max(-len(tables), min(pick, len(tables) - 1))]
        said = [n.lstrip("# ") for n in notes if not n.startswith("# recorded ")][-1:]
        return title, [e], [" ".join([caption] + [f"The run: {n}." for n in said]), ""] \
            + table(header, rows)
    return section


def sec_scaling(entries: Sequence[Entry]) -> Optional[Section]:
    found = latest_per_mpi(of(entries, "shm-scaling", ".json"))
    if not found:
        return None
    runs = [(e, read_json(e)) for e in found]
    keys = [k for k in ("thread", "shm", "MPI Allreduce") if k in runs[0][1]["rows"][0]]
    header = ["one buffer's ALL_REDUCE step, x memcpy"] + [
        f"{mpis(e)} ({res['meta']['nranks']} ranks): {k}" for e, res in runs for k in keys]
    sizes = [r["bytes"] for r in runs[0][1]["rows"]]
    rows = []
    for size in sizes:
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        row = [label]
        for _, res in runs:
            r = next((r for r in res["rows"] if r["bytes"] == size), {})
            row += [f"{r[k]['x_memcpy']:.2f}" if k in r else "-" for k in keys]
        rows.append(row)
    return ("Growth with buffer size: one buffer per strategy against a memcpy", found,
            ["Median of per-round ratios to `np.copyto` of the same bytes, "
             f"{runs[0][1]['meta']['rounds']} rounds.", ""]
            + table(header, rows))


#: docs/benchmarks.md's ``current`` block, in order: each builds its table or None (no
#: result of that target yet)
SECTIONS: List[Callable[[Sequence[Entry]], Optional[Section]]] = [
    sec_default_path, sec_step_targets, sec_small_buffers, sec_half, sec_cluster,
    sec_other_targets, sec_oracle, sec_deadline, sec_window,
    _simple_table("segment-size", "Segment size: the step per segment size",
                  "The ALL_REDUCE step at each segment size, x the best raw way of the same "
                  "round (median, min-max); the last run in the file.", pick=-1),
    _simple_table("halfcast", "Half-precision casts: the `halfcast` kernel against a memcpy",
                  "Casts of one segment, x a memcpy of the fp32 segment in the same round "
                  "(median, min-max over rounds); the first run in the file.", pick=0),
    _simple_table("halfcast-sums", "Half-precision sums: does bf16 depend on the data?",
                  "`sum_half` of 2 sources per bf16 kernel path and kind of data, x the fp16 "
                  "sum of normal values in the same round (median, min-max over rounds).",
                  pick=-1),
    sec_scaling,
]
#: targets with no table of their own (their figures stay in BENCHMARKS.md until they are
#: recorded): named in the ``current`` block
UNTABLED = ("small-messages", "floors", "fused-scaling", "persistent", "hierarchical-model")


def block_current(entries: Sequence[Entry]) -> List[str]:
    out: List[str] = []
    for build in SECTIONS:
        got = build(entries)
        if got is None:
            continue
        title, used, lines = got
        out += [f"### {title}", ""] + provenance(used) + [""] + lines + [""]
    absent = [t for t in UNTABLED if not of(entries, t)]
    models = of(entries, "hierarchical-model")
    if models:
        out += ["### Not tabled here", "",
                "The hierarchical MODEL (2-64 nodes; not a measurement): "
                + "; ".join(f"`{e['id']}` ({when(e)}, {mpis(e)})" for e in models) + "."]
    if absent:
        out += ["", "No recorded result yet (their figures are in BENCHMARKS.md's prose): "
                + ", ".join(f"`{t}`" for t in absent) + "."]
    return out + [""] if out and out[-1] else out


def block_index(entries: Sequence[Entry]) -> List[str]:
    rows = [[f"`{e['id']}`", e["target"], when(e), short(e["commit"])
             + (f" (tree {e['measured_at']})" if e.get("measured_at") else ""),
             machine(e), mpis(e), f"`{e['default_strategy']}`" if e.get("default_strategy")
             else "-", ", ".join(f"`{f}`" for f in e["files"])]
            for e in reversed(entries)]
    return table(["result", "target", "date", "commit", "machine", "MPI", "default then",
                  "files in benchmarks/results/"], rows) + [""]


def block_headline(entries: Sequence[Entry]) -> List[str]:
    got = sec_default_path(entries)
    if got is None:
        return ["(no `mpifusion bench` result recorded)", ""]
    _, used, lines = got
    return (provenance(used) + ["", "Machine-dependent: the milliseconds are this machine's "
                                "(a shared 2-core VM); the ratios, each taken within one run, "
                                "are what carries over, and even they move with the "
                                "machine's state.", ""] + lines + [""])


BLOCKS: Dict[str, Callable[[Sequence[Entry]], List[str]]] = {
    "current": block_current, "index": block_index, "headline": block_headline}


# ------------------------------------------------------------------------------ the pages

def build(entries: Optional[Sequence[Entry]] = None) -> Dict[str, str]:
    entries = load() if entries is None else entries
    return {name: "\n".join(fn(entries)) for name, fn in BLOCKS.items()}


def splice(text: str, name: str, body: str) -> str:
    """``text`` with block ``name``'s body replaced (ValueError when the markers are
    missing)."""
    start, end = MARK.format(name), END.format(name)
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no '{start}' ... '{end}' in the page")
    return text[:i + len(start)] + "\n\n" + body.rstrip("\n") + "\n\n" + text[j:]


def pages(blocks: Dict[str, str], root: str = REPO) -> Dict[str, Tuple[str, str]]:
    """{page: (its text now, its text with the blocks rebuilt)}."""
    out = {}
    for page, names in PAGES.items():
        with open(os.path.join(root, page), encoding="utf-8") as fh:
            old = fh.read()
        new = old
        for name in names:
            new = splice(new, name, blocks[name])
        out[page] = (old, new)
    return out


def stale(root: str = REPO, folder: str = RESULTS) -> List[str]:
    """The pages whose generated blocks differ from what the results build."""
    return [page for page, (old, new) in pages(build(load(folder)), root).items()
            if old != new]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the pages' blocks")
    ap.add_argument("--check", action="store_true", help="exit 1 where a page is stale")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for page in bad:
            print(f"{page}: stale; run: python benchmarks/report.py --write", file=sys.stderr)
        return 1 if bad else 0
    blocks = build()
    if args.write:
        for page, (old, new) in pages(blocks).items():
            if old != new:
                with open(os.path.join(REPO, page), "w", encoding="utf-8") as fh:
                    fh.write(new)
                print(f"wrote {page}")
        return 0
    for name, body in blocks.items():
        print(f"{MARK.format(name)}\n\n{body}\n{END.format(name)}\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
