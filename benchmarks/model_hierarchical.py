"""An alpha-beta MODEL (not a measurement) of ``hierarchical`` against a flat ring
allreduce at 2..64 nodes x 8 ranks, fitted from ``bench_shm_scaling.py``'s runs.

Why: there is one 2-core machine here and no network, so issue 29's question -- does the
node-local shm reduction pay across nodes? -- can only be answered by a model whose on-node
costs are fitted from the measured runs and whose network costs are stated parameters.

Fits (weighted least squares, relative residuals, over every size of a run):
``t(m) = alpha + beta * m`` per candidate of each ``bench_shm_scaling_<mpi>_n<N>.json``:
shm (the node's shm reduce-scatter + all-gather: what ``shm`` does), ``MPI Allreduce`` (the
library's on-node collective; its point-to-point cost per byte is beta / (2(p-1)/p)),
memcpy (the reduction's per-byte compute, gamma = 1.5x memcpy: two reads, one write).

Model, P = 8N ranks, m bytes of grads per rank:

* flat ring (ranks numbered node by node): 2(P-1) steps, each moving m/P over the slowest
  link -- inter-node (alpha_net, beta_net) or the on-node MPI hop (alpha_p2p, beta_p2p) --
  and reducing m/P: ``2(P-1) * max(a_net + m/P b_net, a_p2p + m/P b_p2p) + (P-1)/P m g``;
* hierarchical: the node's shm reduction (fitted; the per-rank bytes of an 8-rank node equal
  those of the 2-rank runs: read m, write m), then 8 rings at once over the N nodes, one per
  slice of m/8, sharing the node's NIC: ``t_shm(m) + 2(N-1) (a_net + m/N b_net) +
  (N-1)/N m/8 g``.

The network defaults are a typical 100 Gb/s InfiniBand (HDR100/EDR): alpha 2 us, beta 1 /
12.5 GB/s; ``--alpha-net``/``--gbps-net`` change them. On-node fits come from a shared,
loaded 2-core VM: they are what this machine measured, not what an HPC node would.

    python benchmarks/model_hierarchical.py [--mpi mpich] [--alpha-net 2e-6] [--gbps-net 12.5]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Dict, List, Tuple

import numpy as np

from mpifusion import machine

MiB = 1 << 20
GPT2_SMALL_BYTES = 497.8e6   # GPT-2-small's fp32 grads in fused buffers (BENCHMARKS.md)
SMALL_BYTES = 1 * MiB
RANKS_PER_NODE = 8
NODES = (2, 4, 8, 16, 32, 64)


def fit(rows: List[dict], key: str) -> Tuple[float, float]:
    """alpha (s), beta (s/byte) of ``t = alpha + beta * m`` by least squares on relative
    residuals (each row divided by its time), so 1 KiB and 256 MiB weigh alike; both
    clipped at 0 (a negative latency is noise)."""
    pts = [(r["bytes"], r[key]["median_s"]) for r in rows if key in r]
    m = np.array([p[0] for p in pts], float)
    t = np.array([p[1] for p in pts], float)
    a = np.stack([1 / t, m / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return max(0.0, float(alpha)), max(0.0, float(beta))


def load_fits(folder: str, mpi: str) -> Dict[int, Dict[str, Tuple[float, float]]]:
    """{ranks: {candidate: (alpha, beta)}} from ``bench_shm_scaling_<mpi>_n*.json``."""
    out: Dict[int, Dict[str, Tuple[float, float]]] = {}
    for path in sorted(glob.glob(os.path.join(folder, f"bench_shm_scaling_{mpi}_n*.json"))):
        with open(path) as fh:
            res = json.load(fh)
        n = res["meta"]["nranks"]
        keys = [k for k in res["rows"][0] if isinstance(res["rows"][0][k], dict)
                and "median_s" in res["rows"][0][k]]
        out[n] = {k: fit(res["rows"], k) for k in keys}
        out[n]["_oversubscribed"] = (float(res["meta"]["oversubscribed"]), 0.0)
    return out


def flat_ring(m: float, nodes: int, net: Tuple[float, float], p2p: Tuple[float, float],
              gamma: float) -> float:
    """Seconds of a ring allreduce over all P = 8N ranks (see the module docstring)."""
    p = nodes * RANKS_PER_NODE
    step = max(net[0] + m / p * net[1], p2p[0] + m / p * p2p[1])
    return 2 * (p - 1) * step + (p - 1) / p * m * gamma


def hierarchical(m: float, nodes: int, net: Tuple[float, float], shm: Tuple[float, float],
                 gamma: float) -> float:
    """Seconds of node shm reduction + 8 concurrent inter-node rings of m/8 each."""
    ring = 2 * (nodes - 1) * (net[0] + m / nodes * net[1])
    return shm[0] + shm[1] * m + ring + (nodes - 1) / nodes * m / RANKS_PER_NODE * gamma


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", default="benchmarks")
    ap.add_argument("--mpi", default="mpich", help="which runs to fit: mpich or openmpi")
    ap.add_argument("--alpha-net", type=float, default=2e-6,
                    help="inter-node latency per message, s (100 Gb/s InfiniBand: ~2 us)")
    ap.add_argument("--gbps-net", type=float, default=12.5,
                    help="inter-node bandwidth per node, GB/s (100 Gb/s = 12.5 GB/s)")
    ap.add_argument("--out", default=None, help="prefix of .txt/.json/.png "
                    "(default: benchmarks/model_hierarchical_<mpi>)")
    args = ap.parse_args()
    if args.alpha_net < 0 or args.gbps_net <= 0:
        raise SystemExit("--alpha-net: expected >= 0; --gbps-net: expected > 0")
    fits = load_fits(args.folder, args.mpi)
    if 2 not in fits:
        raise SystemExit(f"--mpi {args.mpi}: no bench_shm_scaling_{args.mpi}_n2.json in "
                         f"{args.folder} (run benchmarks/bench_shm_scaling.py first)")
    net = (args.alpha_net, 1 / (args.gbps_net * 1e9))
    a2, b2 = fits[2]["MPI Allreduce"]
    p2p = (a2 / 2, b2)                      # 2-rank ring: 2 steps, bus factor 1
    gamma = 1.5 * fits[2]["memcpy"][1]
    shm = fits[2]["shm"]
    worst = max(fits)                       # the most ranks measured (oversubscribed)
    shm_worst = fits[worst]["shm"]
    lines = ["# MODEL, NOT A MEASUREMENT: hierarchical (node shm + inter-node rings of 1/8 "
             "slices) against a flat ring allreduce, 8 ranks per node",
             f"# on-node costs fitted from benchmarks/bench_shm_scaling_{args.mpi}_n*.json "
             f"({machine.cpu_model()}, a shared loaded 2-core VM); network: parameters "
             f"alpha {args.alpha_net * 1e6:g} us, {args.gbps_net:g} GB/s "
             f"(typical 100 Gb/s InfiniBand)", "",
             "| fit (t = alpha + beta m) | ranks | alpha us | GB/s (1/beta) |",
             "| --- | --- | --- | --- |"]
    for n, f in sorted(fits.items()):
        for k, (a, b) in f.items():
            if not k.startswith("_"):
                over = " (oversubscribed)" if f["_oversubscribed"][0] else ""
                lines.append(f"| {k} | {n}{over} | {a * 1e6:.1f} | "
                             f"{(1 / b / 1e9) if b > 0 else float('inf'):.2f} |")
    lines += ["", f"| grads | nodes x 8 | flat ring ms | hierarchical ms | hier / flat | "
              f"hier, shm fit of {worst} ranks ms | hier / flat | flat ring, network-bound "
              f"ms | hier / that |", "| --- " * 9 + "|"]
    table = []
    for m, name in ((GPT2_SMALL_BYTES, "GPT-2-small 498 MB"), (SMALL_BYTES, "1 MiB")):
        for nodes in NODES:
            f = flat_ring(m, nodes, net, p2p, gamma)
            h = hierarchical(m, nodes, net, shm, gamma)
            hw = hierarchical(m, nodes, net, shm_worst, gamma)
            fn = flat_ring(m, nodes, net, (0.0, 0.0), gamma)  # on-node hops as fast as net
            table.append({"grads": name, "bytes": m, "nodes": nodes, "flat_s": f,
                          "hier_s": h, "hier_worst_s": hw, "flat_net_s": fn})
            lines.append(f"| {name} | {nodes} x 8 | {f * 1e3:.3g} | {h * 1e3:.3g} | "
                         f"{h / f:.2f} | {hw * 1e3:.3g} | {hw / f:.2f} | {fn * 1e3:.3g} | "
                         f"{h / fn:.2f} |")
    lines.append("# flat ring, network-bound: the same ring if its on-node hops cost nothing "
                 "beyond the network's (a node whose MPI shm copies outrun the NIC)")
    lines.append("# flat ring per step: max(inter-node, on-node MPI hop); the on-node MPI fit "
                 f"alpha {p2p[0] * 1e6:.1f} us, {1 / p2p[1] / 1e9:.2f} GB/s; "
                 f"gamma = 1.5 x memcpy = {1 / gamma / 1e9:.2f} GB/s")
    text = "\n".join(lines)
    print(text)
    out = args.out or os.path.join(args.folder, f"model_hierarchical_{args.mpi}")
    with open(out + ".txt", "w") as fh:
        fh.write(text + "\n")
    with open(out + ".json", "w") as fh:
        json.dump({"model": True, "network": {"alpha_s": net[0], "beta_s_per_byte": net[1],
                                              "source": "typical 100 Gb/s InfiniBand"},
                   "fits": {str(n): f for n, f in fits.items()}, "p2p": p2p,
                   "gamma": gamma, "rows": table}, fh, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"no plot: {exc}")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, name in zip(axes, ("GPT-2-small 498 MB", "1 MiB")):
        rows = [r for r in table if r["grads"] == name]
        xs = [r["nodes"] for r in rows]
        ax.plot(xs, [r["flat_s"] * 1e3 for r in rows], "k-o", label="flat ring")
        ax.plot(xs, [r["flat_net_s"] * 1e3 for r in rows], "k--", label="flat ring, network-bound")
        ax.plot(xs, [r["hier_s"] * 1e3 for r in rows], "r-s", label="hierarchical (shm fit, 2 ranks)")
        ax.plot(xs, [r["hier_worst_s"] * 1e3 for r in rows], "r:^",
                label=f"hierarchical (shm fit, {worst} ranks, oversubscribed)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("nodes (x 8 ranks)")
        ax.set_ylabel("allreduce ms (MODEL)")
        ax.set_title(f"MODEL, not measured: {name}, {args.mpi} on-node fits")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=100)
    print(f"wrote {out}.txt, {out}.json, {out}.png")


if __name__ == "__main__":
    main()
