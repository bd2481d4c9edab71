"""mpifusion across the nodes of an emulated cluster (``scripts/cluster.sh``), at several
layouts (nodes x ranks per node): results checked against the oracle and an independent
float64 reference, and the ``mpifusion run`` and ``info`` commands.

1. At 2x2, 3x2, 2x3 and 4x2 under MPICH, and 2x3 and 4x2 under Open MPI (between them every
   node count but 3, and both ranks per node): one job per layout builds, for each strategy
   ``auto``, ``hierarchical`` and ``thread``, one FusedCommBuffer per action (all_reduce,
   reduce to a rank off node 0, reduce_scatter and then ``sync_params``) of params of awkward
   sizes (1, 7, 13x17, a prime above a segment, one above the shared-window inline limit),
   two micro-steps each, the oracle's exact inputs, segments of 16 KiB. Rank 0 checks every
   rank's result twice: bit for bit by the oracle (``check(..., exact=True)`` over every
   rank's dump) and against its own float64 mean of the inputs every rank fed (within the
   fp32 rounding of the scaling), the kept parts and the all-gather included. ``auto`` must
   resolve to ``hierarchical``.
2. ``mpifusion run`` passes across nodes; ``mpifusion info`` names every node and its ranks.

The module is also its own driver: ``python test_across_nodes.py matrix`` on each rank.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[2]
#: params of every buffer: one element, primes, one bigger than a 16 KiB segment, and one
#: (1 MiB + 12 bytes of fp32) above the shared-window collectives' inline limit, so that both
#: the caller's inline run and the communication thread's run cross the nodes
SHAPES = [(1,), (7,), (13, 17), (20011,), (262147,)]
SEGMENT = 16 << 10
STRATEGIES = ("auto", "hierarchical", "thread")
ACTS = ("all_reduce", "reduce", "reduce_scatter")
#: the driver's deadline for every collective (seconds): generous, the ranks share 2 cores
DEADLINE = 120


# ------------------------------------------------------------------ the driver (each rank)


def _spec(act: str, nranks: int, dst: int, ident: int) -> dict:
    return {"params": [{"name": f"b{ident}p{i}", "shape": list(s), "dtype": "float32"}
                       for i, s in enumerate(SHAPES)],
            "act": act, "nranks": nranks, "acc_steps": 2, "dst": dst, "average": True}


def _one_buffer(comm, per: int, strategy: str, act: str, ident: int) -> dict:
    """One buffer's step on this rank: its dump for the oracle (inputs, results, the
    all-gather), its whole grad buffer per param and its shard range, for rank 0's checks."""
    import numpy as np

    from mpifusion import FusedCommBuffer, HookAction, Param
    from mpifusion.config import CommOptions
    from mpifusion.oracle import exact_inputs

    n, rank = comm.Get_size(), comm.Get_rank()
    # the root of reduce: a rank of the last node, not its first when the node holds several
    dst = n - 1 - (per // 2) if act == "reduce" else -1
    spec = _spec(act, n, dst, ident)
    names = [p["name"] for p in spec["params"]]
    params = [Param(name, np.zeros(shape, np.float32)) for name, shape in zip(names, SHAPES)]
    buf = FusedCommBuffer(ident, params, comm, act=HookAction[act.upper()], dst=dst,
                          acc_steps=2, comm_options=CommOptions(
                              strategy=strategy, timeout=DEADLINE, segment_bytes=SEGMENT))
    inputs = [exact_inputs(spec, rank, k, seed=ident) for k in range(2)]
    for k in range(2):
        for p in reversed(params):  # backward order
            buf.add_grad(p, grad=inputs[k][p.name])
    buf.scale_grads()

    dump, grads = {}, {}
    lo, hi = buf.layout.shard_range(rank) if act == "reduce_scatter" else (0, 0)
    pieces = {}  # param -> [begin, end) of it in this rank's shard (reduce_scatter)
    for p in params:
        slot = buf.layout[p.name]
        grads[p.name] = buf.grad_storage[slot.offset:slot.end].copy()
        for k in range(2):
            dump[f"in/{p.name}/{k}"] = inputs[k][p.name]
        if act == "reduce_scatter":
            begin, end = max(lo - slot.offset, 0), min(hi - slot.offset, p.numel)
            if begin < end:
                pieces[p.name] = (begin, end)
                dump[f"range/{p.name}"] = np.array([begin, end], np.int64)
                dump[f"out/{p.name}"] = grads[p.name][begin:end]
        else:
            dump[f"out/{p.name}"] = grads[p.name].reshape(p.shape)
    gathered = None
    if act == "reduce_scatter":  # sync_params: this rank's shard of the params to every rank
        buf.param_storage[lo:hi] = _shard_values(ident, rank, hi - lo)
        for name, (begin, end) in pieces.items():
            offset = buf.layout[name].offset
            dump[f"shard/{name}"] = buf.param_storage[offset + begin:offset + end].copy()
        buf.sync_params()
        for p in params:
            slot = buf.layout[p.name]
            dump[f"param/{p.name}"] = buf.param_storage[slot.offset:slot.end].reshape(
                p.shape).copy()
        gathered = buf.param_storage.copy()
    out = {"strategy": strategy, "resolved": buf.comm.strategy, "act": act, "dst": dst,
           "dump": dump, "spec": spec, "grads": grads, "pieces": pieces,
           "shard_numel": buf.layout.shard_numel, "gathered": gathered}
    buf.close()
    return out


def _shard_values(ident: int, rank: int, numel: int):
    """What rank ``rank`` writes into its param shard before ``sync_params``."""
    import numpy as np

    return (np.random.default_rng([ident, 77, rank]).integers(-512, 512, numel)
            .astype(np.float32) / 8)


def _independent(everyone: list) -> List[str]:
    """Rank 0's own check of one buffer over every rank's results, from the inputs each rank
    fed (not the oracle's code): the float64 sum of every rank's two micro-steps, /n, must
    be within the fp32 rounding of the scaling (the sums are exact: the oracle's exact
    inputs); outside its reduce-scatter shard, and off the root of reduce, a rank holds its
    own sum /n. After ``sync_params`` every rank holds every rank's shard, in rank order."""
    import numpy as np

    n = len(everyone)
    first = everyone[0]
    act, dst = first["act"], first["dst"]
    problems = []
    for name in first["grads"]:
        own = [sum(e["dump"][f"in/{name}/{k}"].astype(np.float64).ravel() for k in range(2))
               for e in everyone]
        total = sum(own)
        for r, e in enumerate(everyone):
            want = own[r] / n
            if act == "all_reduce" or (act == "reduce" and r == dst):
                want = total / n
            elif act == "reduce_scatter" and name in e["pieces"]:
                begin, end = e["pieces"][name]
                want[begin:end] = total[begin:end] / n
            got = e["grads"][name].astype(np.float64)
            # 1/n rounded to fp32, and the product rounded: 2 units of fp32 roundoff
            over = np.abs(got - want) / (2 * 2.0 ** -24 * np.abs(want) + 1e-30)
            if over.max() > 1:
                i = int(over.argmax())
                problems.append(f"rank {r} {name}[{i}]: {float(got[i])!r}, expected "
                                f"{float(want[i])!r} ({over.max():.3g} x the bound)")
    if act == "reduce_scatter":
        shard = first["shard_numel"]
        expected = np.concatenate([_shard_values(first["spec_ident"], r, shard)
                                   for r in range(n)])
        for r, e in enumerate(everyone):
            if not np.array_equal(e["gathered"], expected):
                problems.append(f"rank {r}: sync_params: the param buffer is not every "
                                f"rank's shard in rank order")
    return problems


def _driver(argv: List[str]) -> int:
    """``matrix PER``: every strategy and action; rank 0 checks every rank's results (the
    oracle, and its own reference) and prints one JSON line."""
    from mpi4py import MPI

    from mpifusion.comm import release
    from mpifusion.oracle import check

    comm = MPI.COMM_WORLD
    rank, per = comm.Get_rank(), int(argv[1])
    began = time.monotonic()
    cells = []
    try:
        ident = 0
        for strategy in STRATEGIES:
            for act in ACTS:
                mine = _one_buffer(comm, per, strategy, act, ident)
                mine["spec_ident"] = ident
                everyone = comm.gather(mine, root=0)
                if rank == 0:
                    report = check(mine["spec"], [e["dump"] for e in everyone], exact=True)
                    cells.append({"strategy": strategy, "act": act,
                                  "resolved": [e["resolved"] for e in everyone],
                                  "verdict": report.verdict(), "ok": report.ok,
                                  "oracle": "" if report.ok else str(report)[-3000:],
                                  "independent": _independent(everyone),
                                  "checked": sum(g.size for e in everyone
                                                 for g in e["grads"].values())})
                ident += 1
    finally:
        release(comm)
    nodes = comm.gather(MPI.Get_processor_name(), root=0)
    if rank == 0:
        sys.stdout.write(json.dumps({"nodes": nodes, "cells": cells,
                                     "seconds": time.monotonic() - began}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(_driver(sys.argv[1:]))


# ------------------------------------------------------------------ the tests

import pytest  # noqa: E402

from tests.cluster.conftest import run_on  # noqa: E402

#: (nodes, ranks per node, MPI): MPICH at every layout, Open MPI at a covering two
LAYOUTS = [(2, 2, "mpich"), (3, 2, "mpich"), (2, 3, "mpich"), (4, 2, "mpich"),
           (2, 3, "openmpi"), (4, 2, "openmpi")]
#: seconds one job may take: 8 ranks of 9 buffers on 2 cores (Open MPI's ranks busy-poll)
JOB_TIMEOUT = 400


def _json_line(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(lines) == 1, \
        f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[0])


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("nodes, per, mpi", LAYOUTS,
                         ids=[f"{n}x{p}-{m}" for n, p, m in LAYOUTS])
def test_every_strategy_and_action_across_nodes(clusters, nodes, per, mpi):
    name = clusters(nodes)
    proc = run_on(name, per, mpi, [__file__, "matrix", str(per)], JOB_TIMEOUT)
    answer = _json_line(proc)
    print(f"{nodes}x{per} {mpi}: {answer['seconds']:.1f} s in the job")
    size = nodes * per
    # rank r runs on node r // per (scripts/cluster.sh numbers the ranks node by node)
    assert answer["nodes"] == [f"{name}-n{r // per}" for r in range(size)], answer["nodes"]
    cells = answer["cells"]
    assert [(c["strategy"], c["act"]) for c in cells] == [(s, a) for s in STRATEGIES
                                                          for a in ACTS]
    numel = size * sum(math.prod(s) for s in SHAPES)
    for c in cells:
        where = f"{nodes}x{per} {mpi} {c['strategy']} {c['act']}"
        # auto over nodes of several ranks each is hierarchical; thread stays thread
        assert c["resolved"] == ["thread" if c["strategy"] == "thread" else "hierarchical"] \
            * size, where
        assert c["ok"] and c["verdict"] == "PASS", f"{where}: oracle {c['verdict']}\n{c['oracle']}"
        assert c["independent"] == [], f"{where}: " + "\n".join(c["independent"])
        assert c["checked"] == numel, where


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_run_and_info_across_nodes(clusters, mpi):
    """``mpifusion run`` verifies every rank across 3 nodes of 2 ranks (its small buffers
    take ``thread``, as ``auto`` picks it below 256 KiB) and its reduce-scatter; ``mpifusion info`` (text and --json) names the
    3 nodes and the ranks of each, and resolves ``auto`` over them."""
    name = clusters(3)
    proc = run_on(name, 2, mpi, ["-m", "mpifusion", "info"], JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert (f"nodes:          3 ({name}-n0: ranks 0-1, {name}-n1: ranks 2-3, "
            f"{name}-n2: ranks 4-5)\n") in out, out
    assert f"processor:      {name}-n0\n" in out, out
    assert ("strategy:       hierarchical (auto: 3 nodes of 2 ranks; thread for buffers "
            "below 256 KiB)") in out, out
    proc = run_on(name, 2, mpi, ["-m", "mpifusion", "info", "--json"], JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert info["nodes"] == [{"name": f"{name}-n{i}", "ranks": [2 * i, 2 * i + 1]}
                             for i in range(3)], info
    assert info["world_size"] == 6 and info["ranks_on_node"] == 2, info
    for act in ("all_reduce", "reduce_scatter"):
        proc = run_on(name, 2, mpi, ["-m", "mpifusion", "run", "--act", act, "--steps", "2"],
                      JOB_TIMEOUT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        last = proc.stdout.strip().splitlines()[-1]
        assert last.startswith("PASS:") and "on 6 rank(s)" in last, proc.stdout[-3000:]
