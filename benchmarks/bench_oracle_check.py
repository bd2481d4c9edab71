"""``mpifusion check`` at scale: the float64 reference against the exact one, on the same
dumps, next to the time it takes just to read them, with each run's peak memory.

    python benchmarks/bench_oracle_check.py [--ranks 8] [--preset gpt2-small]
        [--rounds 3] [--baseline REV] [--candidate REV] [--dir DIR] [--keep]

Writes ``rank{r}.npz`` dumps of an all-reduce mean (random fp32 inputs, one micro-step, the
outputs an fp32 sum times ``fp32(1/n)``) into a temporary folder, then times, in rounds (one
run of each per round, so drifting load hits them alike): ``read`` (every ``in/`` and
``out/`` member read through ``mpifusion.oracle.dumps.DumpFile``), ``float64`` (``check``
of ``--baseline``, the last revision with the float64 reference) and ``exact`` (``check`` of
``--candidate``). Each runs in a child process (``git archive`` of its revision on
``PYTHONPATH``); its time is measured inside the child around the call, and its peak
memory is the child's ``VmHWM`` (peak resident set) less what it held after the imports.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Dict, List

import numpy as np

from mpifusion.machine import cpu_model
from mpifusion.spec import Spec

import record  # benchmarks/record.py: results go to benchmarks/results/

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, sys, time
def hwm():  # this process's peak RSS (ru_maxrss would start at the parent's: kept over exec)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
kind, spec_path, folder, nranks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
from mpifusion.oracle import check
from mpifusion.oracle.dumps import DumpFile
from mpifusion.spec import load_spec
base = hwm()
t0, c0 = time.perf_counter(), time.process_time()
if kind == "read":
    spec = load_spec(spec_path)
    files = [DumpFile(f"{folder}/rank{r}.npz") for r in range(nranks)]
    nbytes = 0
    for p in spec.params:
        for f in files:
            for key in (f"in/{p.name}/0", f"out/{p.name}"):
                nbytes += f[key].nbytes
    ok = nbytes > 0
else:
    ok = check(spec_path, folder).ok
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
peak = hwm()
print(json.dumps({"seconds": seconds, "cpu": cpu, "ok": bool(ok), "peak_kib": peak,
                  "base_kib": base}))
"""



def _write_member(zf: zipfile.ZipFile, key: str, arr: np.ndarray) -> None:
    with zf.open(f"{key}.npy", "w", force_zip64=True) as out:
        np.lib.format.write_array(out, np.ascontiguousarray(arr), allow_pickle=False)


def make_dumps(folder: str, spec: Spec, nranks: int, seed: int = 0) -> int:
    """One ``rank{r}.npz`` per rank, written param by param (never all in memory)."""
    zips = [zipfile.ZipFile(os.path.join(folder, f"rank{r}.npz"), "w",
                            compression=zipfile.ZIP_STORED) for r in range(nranks)]
    rng = np.random.default_rng(seed)
    scale = np.float32(1.0 / nranks)
    try:
        for p in spec.params:
            xs = [rng.standard_normal(p.shape, dtype=np.float32) for _ in range(nranks)]
            total = xs[0].copy()
            for x in xs[1:]:
                total += x
            total *= scale
            for zf, x in zip(zips, xs):
                _write_member(zf, f"in/{p.name}/0", x)
                _write_member(zf, f"out/{p.name}", total)
    finally:
        for zf in zips:
            zf.close()
    return sum(os.path.getsize(os.path.join(folder, f"rank{r}.npz")) for r in range(nranks))


def _tree(rev: str, into: str) -> str:
    """``git archive`` of ``rev``'s package into ``into``; returns the commit."""
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "mpifusion"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return commit


def _run(kind: str, tree: str, spec_path: str, folder: str, nranks: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.run([sys.executable, "-c", _CHILD, kind, spec_path, folder, str(nranks)],
                          env=env, capture_output=True, text=True, cwd=tree)
    if proc.returncode:
        raise RuntimeError(f"{kind}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default="db0983b",
                    help="revision with the float64 reference (default: the one before the "
                         "exact reference reached check)")
    ap.add_argument("--candidate", default="HEAD", help="revision with the exact reference")
    ap.add_argument("--dir", default=None, help="where to write the dumps (default: a "
                                                "temporary folder under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the dumps")
    ap.add_argument("--dumps", default=None, help="reuse the rank{r}.npz of an earlier --keep "
                                                  "run (the same --ranks and --preset)")
    ap.add_argument("--json", default=None, help="also write every run as JSON here "
                    "(default: beside the recorded .txt in --results)")
    record.add_arguments(ap)
    args = ap.parse_args()
    with record.recorded(args, "bench_oracle_check", "oracle-check",
                         "mpifusion check of every rank's dumps: exact reference against "
                         "float64 and a plain read (no MPI)", extra=(".json",)) as prefix:
        if prefix and not args.json:
            args.json = prefix + ".json"
        run(args)


def run(args: argparse.Namespace) -> None:

    spec = Spec.from_preset(args.preset, dtype="float32", act="all_reduce",
                            nranks=args.ranks, acc_steps=1, average=True)
    work = tempfile.mkdtemp(prefix="bench_oracle_", dir=args.dir)
    try:
        folder = args.dumps or os.path.join(work, "dumps")
        if not args.dumps:
            os.mkdir(folder)
        spec_path = os.path.join(work, "spec.json")
        with open(spec_path, "w") as f:
            json.dump({"params": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype}
                                  for p in spec.params],
                       "act": "all_reduce", "nranks": args.ranks, "acc_steps": 1,
                       "average": True}, f)
        t0 = time.perf_counter()
        if args.dumps:
            size = sum(os.path.getsize(os.path.join(folder, f"rank{r}.npz"))
                       for r in range(args.ranks))
        else:
            size = make_dumps(folder, spec, args.ranks)
        print(f"dumps: {args.ranks} x {size / args.ranks / 1e6:.1f} MB "
              f"{'reused' if args.dumps else 'written'} in {time.perf_counter() - t0:.1f} s",
              flush=True)
        trees = {}
        for kind, rev in (("float64", args.baseline), ("exact", args.candidate)):
            trees[kind] = os.path.join(work, kind)
            os.mkdir(trees[kind])
            print(f"{kind}: {_tree(rev, trees[kind])} ({rev})", flush=True)
        trees["read"] = trees["exact"]
        runs: Dict[str, List[dict]] = {k: [] for k in ("read", "float64", "exact")}
        _run("read", trees["read"], spec_path, folder, args.ranks)  # warm the page cache
        for rnd in range(args.rounds):
            for kind in runs:
                r = _run(kind, trees[kind], spec_path, folder, args.ranks)
                runs[kind].append(r)
                print(f"round {rnd + 1} {kind:8s} {r['seconds']:7.1f} s (cpu {r['cpu']:6.1f} s)"
                      f"  ok={r['ok']}  "
                      f"peak {(r['peak_kib'] - r['base_kib']) / 2 ** 20:.2f} GiB over the "
                      f"imports' {r['base_kib'] / 2 ** 20:.2f} GiB", flush=True)
        largest = max(spec.params, key=lambda p: p.numel)
        limit = largest.numel * (args.ranks * 4 + 8)
        print()
        print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, "
              f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2 ** 30:.0f} GiB; "
              f"numpy {np.__version__}, Python {platform.python_version()}")
        print(f"workload: {args.preset} fp32, {len(spec.params)} params, {args.ranks} ranks, "
              f"{size / 1e9:.2f} GB of dumps; largest param {largest.name} "
              f"({largest.numel} elements)")
        print(f"stated limit: all ranks' inputs of the largest param plus its float64 "
              f"reference = {limit / 2 ** 30:.2f} GiB")
        print(f"{'':10s}{'median s':>10s}{'cpu s':>8s}{'x read':>8s}{'x float64':>11s}"
              f"{'peak GiB':>10s}")
        med = {k: float(np.median([r["seconds"] for r in v])) for k, v in runs.items()}
        cpu = {k: float(np.median([r["cpu"] for r in v])) for k, v in runs.items()}
        for kind, rs in runs.items():
            peak = max(r["peak_kib"] - r["base_kib"] for r in rs) / 2 ** 20
            print(f"{kind:10s}{med[kind]:10.1f}{cpu[kind]:8.1f}{med[kind] / med['read']:8.2f}"
                  f"{med[kind] / med['float64']:11.2f}{peak:10.2f}")
        ratios = [e["seconds"] / f["seconds"] for e, f in zip(runs["exact"], runs["float64"])]
        cpu_ratios = [e["cpu"] / f["cpu"] for e, f in zip(runs["exact"], runs["float64"])]
        print(f"exact / float64 per round: wall {', '.join(f'{r:.2f}' for r in ratios)}; "
              f"cpu {', '.join(f'{r:.2f}' for r in cpu_ratios)}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"runs": runs, "limit_bytes": limit, "bytes": size,
                           "ratios": ratios}, f, indent=1)
        if not all(r["ok"] for v in runs.values() for r in v):
            print("a check FAILED on correct dumps", file=sys.stderr)
            sys.exit(1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept: {work}")


if __name__ == "__main__":
    main()
