"""``mpifusion bench``'s cluster section: the steps of a job that spans nodes against the
link's floor. Nothing runs (one ``allgather`` of the processor names) on one node.

* the link: a ``Sendrecv`` between local rank 0 of node 0 and local rank 0 of node 1, both
  directions at once (a two-level all-reduce uses the link both ways), of 64 MiB, the
  fastest of :data:`LINK_RUNS` (their median is kept too); and of 8 bytes (the latency,
  median). The fastest, not the median: one TCP stream each way over a tbf-shaped link runs
  at the line rate in some runs and at half of it in others (its ACKs queue behind the other
  direction's data), 0.58 s or 1.12 s for 64 MiB at 1 Gbit/s, where one way alone is always
  0.56 s; the median measured whichever mode won. Always 64 MiB: one of 16 MiB measured
  half the rate (TCP's ramp). Beside it (``link["concurrent"]``) the same 64 MiB split over
  every local rank of node 0 with its peer on node 1, at once: the link as
  ``hierarchical``'s p concurrent inter-node collectives share it; the rate is the faster of
  the two (:func:`best_rate`: one TCP connection can stay in the half-rate mode for all of
  its runs). And ``link["one_way"]``: the pair's 64 MiB one way only (``Send``/``Recv``),
  which does not fall into that mode: Open MPI's pairs ran both ways at half the rate in 10
  of 10 runs at 3 nodes, 1 Gbit/s, and its floor was twice the line's (hierarchical measured
  "0.51x the floor"). The floor takes the fastest of the three, so it is never above what
  the line allows; a step still faster than 0.95x the floor fails a check of its own
  (:func:`cluster_checks`): a floor above a measured step means the link measured slow;
* the floor of an all-reduce of ``m`` bytes per rank on ``N`` nodes: every byte of the
  node's sum crosses its link ``2(N-1)/N`` times, ``2(N-1)/N x m / rate`` (each way);
* per size (one fp32 buffer of each of ``--cluster-sizes``, and the ``--preset``'s grads in
  fused groups of ``--group-mb``): the ALL_REDUCE step of ``hierarchical``, ``thread`` and
  ``auto``, raw ``Allreduce`` + 1/n on the same bytes (``thread``'s storage, between its
  steps), and the node-local part alone (``shm`` on each node's communicator, every node at
  once: what the model of ``benchmarks/model_hierarchical.py`` takes as the on-node cost),
  in the same rounds; each run's time is the slowest rank's median step.

The pure arithmetic (:func:`allreduce_floor_s`, :func:`ratios`, :func:`cluster_checks`) is
what the tables and the targets read; ``tests/tools/test_bench_cluster.py`` checks it.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ... import machine
from ...comm import release
from ...plan.actions import HookAction
from ...runtime.param import Param
from ..timing import mpi_name, round_ratio, timeit_many
from .workload import (MiB, build_buffers, fallback_reason, grad_bytes,
                       make_params, median_step, usable_strategies)

if TYPE_CHECKING:  # pragma: no cover
    from .measure import Bench

KiB = 1 << 10
#: the default ``--cluster-sizes``: bytes of fp32 grads per rank, and the preset's grads
DEFAULT_SIZES = "4K,16K,64K,1M,4M,16M,64M,preset"
#: the strategies measured (``auto`` as it resolves here), beside raw MPI and the node part
STRATEGIES = ("hierarchical", "thread", "auto")
#: bytes of the link's Sendrecv
LINK_BYTES = 64 * MiB
#: timed Sendrecvs of the link (after one more), and 8-byte ones per latency run
LINK_RUNS = 5
LATENCY_REPS = 50
#: steps repeated inside one timed run, below 4 MiB (a run's time is their median)
REPS_BYTES = 4 * MiB
MAX_REPS = 50
#: the targets: hierarchical <= 1.15x the floor from 16 MiB; faster than raw and thread
#: from 1 MiB; no slower than thread at 4-64 KiB
FLOOR_FROM, FLOOR_TARGET = 16 * MiB, 1.15
#: a step below this x the floor means the floor is wrong (the link measured slow)
FLOOR_SANE = 0.95
FASTER_FROM = 1 * MiB
SMALL_RANGE = (4 * KiB, 64 * KiB)


def parse_sizes(text: str, option: str = "--cluster-sizes") -> List[Any]:
    """``"4K,1M,preset"`` -> ``[4096, 1048576, "preset"]`` (K, M, G: binary; a multiple of
    4 bytes, fp32), in the given order without repeats; ValueError names the option."""
    out: List[Any] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item == "preset":
            out.append(item)
            continue
        mult = {"K": KiB, "M": MiB, "G": 1 << 30}.get(item[-1].upper(), 1)
        digits = item[:-1] if mult > 1 else item
        try:
            size = int(float(digits) * mult)
        except ValueError:
            size = 0
        if size < 4 or size % 4 or size > 4 << 30:
            raise ValueError(f"{option}: expected sizes like 4K,1M,64M (4 bytes .. 4G, "
                             f"multiples of 4) and 'preset', got {item!r}")
        out.append(size)
    if not out:
        raise ValueError(f"{option}: expected sizes like 4K,1M,64M and 'preset', got {text!r}")
    return list(dict.fromkeys(out))


def fmt_bytes(n: float) -> str:
    """``4 KiB``, ``16 MiB``; anything else in MB (a preset's grads)."""
    n = int(n)
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0 and n < MiB:
        return f"{n // KiB} KiB"
    return f"{n / 1e6:.3g} MB"


def allreduce_floor_s(nbytes: float, nodes: int, rate_Bps: float) -> float:
    """The link's floor for an all-reduce of ``nbytes`` per rank on ``nodes`` nodes: each
    node's sum crosses its link ``2(N-1)/N`` times each way, at ``rate_Bps`` each way."""
    if nodes < 2:
        return 0.0
    return 2 * (nodes - 1) / nodes * nbytes / rate_Bps


def link_fit(nbytes: int, big_s: float, small_s: float) -> Dict[str, float]:
    """The link from two Sendrecvs (both ways at once): ``rate`` = bytes / time of the big
    one (each way), ``alpha`` = the 8-byte one's time, ``beta`` = the rest per byte."""
    return {"bytes": nbytes, "seconds": big_s, "rate_Bps": nbytes / big_s,
            "alpha_s": small_s, "beta_s_per_byte": max(big_s - small_s, 1e-12) / nbytes}


def best_rate(link: Dict[str, Any]) -> Dict[str, Any]:
    """``link`` with ``rate_Bps`` the fastest of the single pair's, the concurrent
    streams' (the same 64 MiB over the same link, both ways) and the pair's one way only
    (``link["one_way"]``), ``single_rate_Bps`` the pair's and ``rate_from`` which one it is:
    every pair of TCP streams can fall into the half-rate mode for all of its runs (5 of 5
    at 3 nodes, 1 Gbit/s, once under MPICH; 10 of 10 under Open MPI), one way never does."""
    out = dict(link, single_rate_Bps=link["rate_Bps"], rate_from="single pair")
    for key, name in (("concurrent", "{streams} pairs at once"), ("one_way", "one way")):
        other = link.get(key)
        if other and other["rate_Bps"] > out["rate_Bps"]:
            out.update(rate_Bps=other["rate_Bps"], rate_from=name.format(**other),
                       beta_s_per_byte=other["beta_s_per_byte"])
    return out


def ratios(row: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """A size's ratios: each candidate's median / the floor, and hierarchical / thread and
    hierarchical / raw (median over rounds of the per-round ratio); None where missing."""
    floor = row["floor_s"]
    c = row["candidates"]
    out: Dict[str, Optional[float]] = {
        f"{k}_x_floor": (v["median_s"] / floor if floor > 0 else None) for k, v in c.items()}
    hier = c.get("hierarchical")
    for other in ("thread", "raw"):
        out[f"hierarchical_x_{other}"] = (round_ratio(hier, c[other])
                                          if hier and other in c else None)
    return out


def cluster_checks(cluster: Dict[str, Any]) -> List[Tuple[str, float, str]]:
    """The targets as ``(what, value, target)``, each the worst size that it covers:
    hierarchical / floor from 16 MiB, hierarchical / thread and / raw from 1 MiB (faster:
    below 1), hierarchical / thread at 4-64 KiB (no slower)."""
    rows = cluster.get("rows", [])
    out: List[Tuple[str, float, str]] = []

    def worst(key: str, pick: Callable[[dict], bool]) -> Optional[Tuple[float, str]]:
        got = [(r[key], r["label"]) for r in rows if pick(r) and r.get(key) is not None]
        return max(got) if got else None

    big = worst("hierarchical_x_floor", lambda r: r["bytes"] >= FLOOR_FROM)
    if big:
        out.append((f"cluster: hierarchical / link floor, >= 16 MiB per rank (worst: "
                    f"{big[1]})", big[0], f"<= {FLOOR_TARGET}"))
    for other in ("thread", "raw"):
        w = worst(f"hierarchical_x_{other}", lambda r: r["bytes"] >= FASTER_FROM)
        if w:
            name = "thread" if other == "thread" else "raw Allreduce + 1/n"
            out.append((f"cluster: hierarchical / {name}, >= 1 MiB (worst: {w[1]})", w[0],
                        "<= 1.0"))
    w = worst("hierarchical_x_thread",
              lambda r: SMALL_RANGE[0] <= r["bytes"] <= SMALL_RANGE[1] and not r.get("preset"))
    if w:
        out.append((f"cluster: hierarchical / thread, 4-64 KiB (worst: {w[1]})", w[0],
                    "<= 1.0"))
    low = fastest_x_floor(rows)
    if low:
        out.append((f"cluster: every step / link floor, the floor's own check (fastest: "
                    f"{low[1]})", low[0], f">= {FLOOR_SANE}"))
    return out


def fastest_x_floor(rows: List[Dict[str, Any]]) -> Optional[Tuple[float, str]]:
    """The fastest step from 16 MiB as ``(x floor, "CANDIDATE at SIZE")``, or None. No such
    step can beat the floor (smaller ones may, through tbf's burst): one below
    :data:`FLOOR_SANE` says the link was measured slow, and every ratio to the floor
    flatters."""
    steps = [(r[f"{k}_x_floor"], f"{k} at {r['label']}") for r in rows
             if r["bytes"] >= FLOOR_FROM
             for k in r["candidates"]  # node: the node's part alone, not an all-reduce
             if k != "node" and r.get(f"{k}_x_floor") is not None]
    return min(steps) if steps else None


def layout(comm: MPI.Comm) -> Optional[Dict[str, Any]]:
    """None on one node (one allgather of the processor names); else the nodes as
    ``COMM_TYPE_SHARED`` gives them: ``nodes``, ``ranks_per_node`` (None when uneven),
    ``leaders`` (world rank of each node's local rank 0, in order), ``names`` and the node
    communicator of this rank (``node_comm``)."""
    names = comm.allgather(MPI.Get_processor_name())
    if len(set(names)) < 2:
        return None
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local = comm.allgather(node_comm.Get_rank())
    sizes = comm.allgather(node_comm.Get_size())
    leader_of = comm.allgather(node_comm.bcast(comm.Get_rank(), root=0))
    leaders = [r for r, lr in enumerate(local) if lr == 0]
    if len(leaders) < 2:
        node_comm.Free()
        return None
    per = sizes[0] if len(set(sizes)) == 1 else None
    # the ranks of node 0 and node 1 by local rank: the pairs of the aggregate link test
    first = {local[r]: r for r in range(len(local)) if leader_of[r] == leaders[0]}
    second = {local[r]: r for r in range(len(local)) if leader_of[r] == leaders[1]}
    pairs = [(first[i], second[i]) for i in sorted(first) if i in second]
    return {"nodes": len(leaders), "ranks_per_node": per, "leaders": leaders,
            "names": [names[r] for r in leaders], "node_comm": node_comm, "pairs": pairs}


def quiet_barrier(comm: MPI.Comm, poll_s: float = 2e-4) -> None:
    """A barrier that sleeps while it waits: a rank spinning in ``MPI_Barrier`` would take a
    core that the link test's pair needs where nodes share cores (an emulated cluster)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def measure_link(comm: MPI.Comm, pairs: Sequence[Tuple[int, int]], nbytes: int,
                 latency: bool = True, one_way: bool = False) -> Dict[str, float]:
    """The world ranks of each pair exchange ``nbytes`` both ways at once (``Sendrecv``), all
    pairs together, :data:`LINK_RUNS` times after one more (each run the slowest pair's
    time; the other ranks wait in :func:`quiet_barrier`); with ``latency``, 8 bytes
    :data:`LATENCY_REPS` times per run; ``one_way``: the pair's first rank sends, the second
    receives. :func:`link_fit` of the bytes each way over the link,
    from the fastest big run (the rate: see the module docstring) and the median latency,
    with the big runs' median and times (every rank gets them)."""
    me = comm.Get_rank()
    peer = next((b if me == a else a for a, b in pairs if me in (a, b)), None)
    size = nbytes if peer is not None else 1
    send, recv = np.ones(size, np.uint8), np.empty(size, np.uint8)
    tiny_s, tiny_r = np.ones(8, np.uint8), np.empty(8, np.uint8)
    big, small = [], []
    for i in range(LINK_RUNS + 1):
        quiet_barrier(comm)
        t0 = time.perf_counter()
        took, lat = 0.0, 0.0
        if peer is not None:
            if not one_way:
                comm.Sendrecv([send, MPI.BYTE], peer, 7, [recv, MPI.BYTE], peer, 7)
            elif any(me == a for a, _ in pairs):
                comm.Send([send, MPI.BYTE], peer, 7)
            else:
                comm.Recv([recv, MPI.BYTE], peer, 7)
            took = time.perf_counter() - t0
        quiet_barrier(comm)
        if peer is not None and latency:
            t1 = time.perf_counter()
            for _ in range(LATENCY_REPS):
                comm.Sendrecv([tiny_s, MPI.BYTE], peer, 8, [tiny_r, MPI.BYTE], peer, 8)
            lat = (time.perf_counter() - t1) / LATENCY_REPS
        quiet_barrier(comm)
        took, lat = (comm.allreduce(x, op=MPI.MAX) for x in (took, lat))
        if i:
            big.append(took)
            small.append(lat)
    return dict(link_fit(nbytes * len(pairs), min(big), statistics.median(small)),
                median_s=statistics.median(big), times_s=big)


def _raw_fn(comm: MPI.Comm, arrays: Sequence[np.ndarray], reps: int) -> Callable[[], float]:
    """Raw ``Allreduce`` in place + 1/n of each array (the buffers' storage)."""
    inv = np.float32(1.0 / comm.Get_size())
    flats = [a.reshape(-1) for a in arrays]

    def run() -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for x in flats:
                comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT])
                np.multiply(x, inv, out=x)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return run


def shared_memory_ranks(comm: MPI.Comm) -> int:
    """How many ranks of ``comm`` share this rank's machine memory (the same kernel boot
    id): the nodes of an emulated cluster are one machine's."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = MPI.Get_processor_name()
    return comm.allgather(boot).count(boot)


def memory_short(comm: MPI.Comm, need_per_rank: int) -> Optional[str]:
    """Why ``need_per_rank`` bytes on every rank would not fit (half of MemAvailable, over
    the ranks sharing a machine's memory), on any rank; None when they fit (the same answer
    on every rank)."""
    avail = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    sharing = shared_memory_ranks(comm)
    why = None
    if avail is not None and need_per_rank * sharing > avail // 2:
        why = (f"needs {need_per_rank * sharing / 1e9:.3g} GB on a machine of {sharing} "
               f"ranks, {avail / 1e9:.3g} GB available")
    return next((w for w in comm.allgather(why) if w), None)


def measure_size(b: "Bench", lay: Dict[str, Any], size: Any, strategies: Sequence[str],
                 rate: float) -> Dict[str, Any]:
    """Every candidate of one size in the same rounds, on a duplicate freed afterwards (its
    windows and threads with it). The preset's grads skip the node candidate (memory: a
    buffer of the model's grads per candidate and rank)."""
    preset = size == "preset"
    comm = b.world.Dup()
    node = lay["node_comm"].Dup()
    if preset:
        params = make_params(b.s.preset, "float32", seed=b.rank, fill=False)
        group = b.s.group_bytes
    else:
        params = [Param("g", np.zeros(size // 4, np.float32))]
        group = size

    def fresh() -> List[Param]:
        return [Param(p.name, np.zeros(p.data.shape, np.float32)) for p in params]

    bufs: Dict[str, List[Any]] = {}
    for s in strategies:
        bufs[s] = build_buffers(params if not bufs else fresh(), HookAction.ALL_REDUCE,
                                group, comm, s)
    nbytes = grad_bytes(next(iter(bufs.values())))
    reps = int(min(MAX_REPS, max(1, REPS_BYTES // max(nbytes, 1))))
    fns: Dict[str, Callable[[], float]] = {s: functools.partial(median_step, v, reps)
                                           for s, v in bufs.items()}
    raw_on = bufs.get("thread") or [None]
    arrays = ([x.grad_storage for x in raw_on] if raw_on[0] is not None
              else [np.ones(nbytes // 4, np.float32)])
    fns["raw"] = _raw_fn(comm, arrays, reps)
    if not preset:
        bufs["node"] = build_buffers(fresh(), HookAction.ALL_REDUCE, group, node, "shm")
        fns["node"] = functools.partial(median_step, bufs["node"], reps)
        if "hierarchical" in strategies:  # CommOptions(pipeline=True), beside the default
            bufs["pipelined"] = build_buffers(fresh(), HookAction.ALL_REDUCE, group, comm,
                                              "hierarchical", pipeline=True)
            fns["pipelined"] = functools.partial(median_step, bufs["pipelined"], reps)
    timed = timeit_many(fns, b.comm, b.s.iters, max(1, b.s.warmup), self_timed=True)
    # what auto resolved to for buffers of this size (thread below 256 KiB across nodes)
    auto_ran = sorted({x.comm.strategy for x in bufs.get("auto", []) if x.comm is not None})
    notes = {s: why for s in strategies + ("node", "pipelined") if s in bufs
             for why in [fallback_reason(bufs[s], {"node": "shm", "pipelined": "hierarchical"}
                                         .get(s, s))] if why}
    for v in bufs.values():
        for x in v:
            x.close()
    release(comm)
    release(node)
    comm.Free()
    node.Free()
    row: Dict[str, Any] = {
        "label": (f"{b.s.preset} {nbytes / 1e6:.3g} MB" if preset else fmt_bytes(nbytes)),
        "bytes": nbytes, "preset": preset, "buffers": len(bufs[strategies[0]]),
        "reps": reps, "floor_s": allreduce_floor_s(nbytes, lay["nodes"], rate),
        "candidates": {k: {"median_s": v["median_s"], "min_s": v["min_s"],
                           "times_s": v["times_s"]} for k, v in timed.items()},
        "notes": notes, "auto_ran": auto_ran}
    row.update(ratios(row))
    return row


def measure_cluster(b: "Bench") -> None:
    """The cluster section (``res["cluster"]``), only where the job spans nodes."""
    lay = layout(b.comm)
    if lay is None:
        return
    sizes = list(b.s.cluster_sizes)
    strategies, skipped = usable_strategies(list(STRATEGIES), MPI.Query_thread())
    preset_bytes = int(sum(p.data.nbytes for p in make_params(b.s.preset, "float32", 0,
                                                              fill=False)))
    link_bytes = LINK_BYTES
    b.say(f"# cluster: {lay['nodes']} nodes x {lay['ranks_per_node']} ranks; link: "
          f"Sendrecv of {fmt_bytes(link_bytes)} between {lay['names'][0]} and "
          f"{lay['names'][1]} ...")
    link = measure_link(b.comm, lay["pairs"][:1], link_bytes)
    # every local rank of node 0 with its peer on node 1 at once, the same bytes in all: the
    # link as the p concurrent streams of hierarchical's inter-node step share it
    streams = len(lay["pairs"])
    if streams > 1:
        link["concurrent"] = dict(measure_link(b.comm, lay["pairs"],
                                               link_bytes // streams, latency=False),
                                  streams=streams)
    # ... and one way only, which no TCP ACK queue halves
    link["one_way"] = measure_link(b.comm, lay["pairs"][:1], link_bytes, latency=False,
                                   one_way=True)
    link = best_rate(link)
    b.say(f"# cluster: link {link['rate_Bps'] / 1e9:.3g} GB/s each way ({link['rate_from']}), "
          f"latency {link['alpha_s'] * 1e6:.1f} us; both ways: one pair "
          f"{link['single_rate_Bps'] / 1e9:.3g} GB/s"
          + (f", {streams} at once {link['concurrent']['rate_Bps'] / 1e9:.3g} GB/s"
             if streams > 1 else "")
          + f"; one way {link['one_way']['rate_Bps'] / 1e9:.3g} GB/s; steps per size "
          f"(in rounds) ...")
    rows, skipped_sizes = [], {}
    for size in sizes:
        if size == "preset":
            nbytes = preset_bytes
            why = memory_short(b.comm, len(strategies) * nbytes)
            if why:
                skipped_sizes[f"{b.s.preset} {nbytes / 1e6:.3g} MB"] = why
                b.say(f"#   {b.s.preset}: skipped, {why}")
                continue
        rows.append(measure_size(b, lay, size, tuple(strategies), link["rate_Bps"]))
        r = rows[-1]
        b.say(f"#   {r['label']}: floor {r['floor_s'] * 1e3:.3g} ms, hierarchical "
              f"{r['candidates']['hierarchical']['median_s'] * 1e3:.3g} ms"
              if "hierarchical" in r["candidates"] else f"#   {r['label']} done")
    lay["node_comm"].Free()
    b.res["cluster"] = {
        "meta": {"nodes": lay["nodes"], "ranks_per_node": lay["ranks_per_node"],
                 "node_names": lay["names"], "nranks": b.n, "mpi": mpi_name(),
                 "machine": machine.machine_key(), "cpu": machine.cpu_model(),
                 "auto_strategy": b.auto, "skipped_strategies": skipped,
                 "iters": b.s.iters, "warmup": max(1, b.s.warmup),
                 "skipped_sizes": skipped_sizes},
        "link": link, "rows": rows}


def _fmt_ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.3g}"


def _fmt_x(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def table_cluster(res: dict) -> Optional[tuple]:
    """The cluster section's table (None on one node): ms per step, x the link floor."""
    cl = res.get("cluster")
    if not cl:
        return None
    m, link = cl["meta"], cl["link"]
    auto = ", ".join(f"{r['label']}: {'/'.join(r['auto_ran'])}" for r in cl["rows"]
                     if r.get("auto_ran")) or m["auto_strategy"]
    keys = [k for k in ("hierarchical", "pipelined", "thread", "auto", "raw", "node")
            if any(k in r["candidates"] for r in cl["rows"])]
    header = (["size/rank", "floor ms"] + [f"{k} ms (x floor)" for k in keys]
              + ["hier/thread", "hier/raw"])
    rows = []
    for r in cl["rows"]:
        c = r["candidates"]
        rows.append([r["label"], _fmt_ms(r["floor_s"])]
                    + [f"{_fmt_ms(c[k]['median_s'])} ({_fmt_x(r.get(k + '_x_floor'))})"
                       if k in c else "-" for k in keys]
                    + [_fmt_x(r["hierarchical_x_thread"]), _fmt_x(r["hierarchical_x_raw"])])
    title = (f"cluster: {m['nodes']} nodes x {m['ranks_per_node']} ranks, link "
             f"{link['rate_Bps'] / 1e9:.3g} GB/s each way (Sendrecv of "
             f"{fmt_bytes(link['bytes'])}), latency {link['alpha_s'] * 1e6:.1f} us; floor = "
             f"2(N-1)/N x bytes / rate; auto ran {auto}; pipelined = "
             f"hierarchical with pipeline=True; node = shm on each node alone")
    return title, header, rows


def write_cluster_plot(path: str, res: dict) -> Optional[str]:
    """t / floor against size per strategy (PNG); a note when matplotlib is missing."""
    cl = res.get("cluster")
    if not cl:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover - matplotlib is in the bench extra
        return f"no cluster plot: {exc} (pip install 'mpifusion[bench]')"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = sorted(cl["rows"], key=lambda r: r["bytes"])
    for key, style in (("hierarchical", "c-v"), ("pipelined", "c:v"), ("thread", "b-s"),
                       ("auto", "g:^"),
                       ("raw", "k-o"), ("node", "m--d")):
        pts = [(r["bytes"], r.get(f"{key}_x_floor")) for r in rows]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=key)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(FLOOR_TARGET, color="r", linestyle=":", linewidth=0.8,
               label=f"target {FLOOR_TARGET}x (>= 16 MiB)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("fp32 grads per rank (bytes)")
    ax.set_ylabel("step time / link floor")
    m = cl["meta"]
    ax.set_title(f"{m['nodes']} nodes x {m['ranks_per_node']}, link "
                 f"{cl['link']['rate_Bps'] / 1e9:.3g} GB/s ({m['mpi']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
