"""The bytes ``mpifusion bench`` syncs: a preset's params in fused buffers, and one step.

Every measurement builds its buffers here, so mpifusion's steps and the raw baselines move
the same bytes; the default strategy and segment size are those a default run takes here.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ...comm.communicator import resolve_strategy
from ...comm.shm import node_layout
from ...config import DEFAULT_WINDOW, THREADED_STRATEGIES, CommOptions
from ...dtypes import as_dtype
from ...machine import segment_for
from ...plan.actions import HookAction
from ...presets import get_preset
from ...runtime.buffer import FusedCommBuffer
from ...runtime.fusion import assign_group_by_size
from ...runtime.param import Param

MiB = 1 << 20

def auto_strategy(comm: MPI.Comm) -> str:
    """The strategy a default buffer on ``comm`` resolves to (``auto``: shm where the ranks
    share a node; collective)."""
    _, _, per, uneven = node_layout(comm, None, None)
    return resolve_strategy("auto", comm.Get_size(), per, uneven)[0]

#: the dtype of the half-precision step measured beside an fp32 run (half precision must keep pace)
HALF_DTYPE = "bfloat16"

_SEGMENTS: Dict[int, int] = {}


def usable_strategies(strategies: Sequence[str], thread_level: int
                      ) -> Tuple[List[str], Dict[str, str]]:
    """The strategies this job can run, and why each other one is skipped: a strategy that
    needs a communication thread cannot start below MPI_THREAD_MULTIPLE, and a benchmark
    should say so rather than end on the Communicator's error."""
    usable, skipped = [], {}
    for s in strategies:
        if s in THREADED_STRATEGIES and thread_level < MPI.THREAD_MULTIPLE:
            skipped[s] = (f"needs MPI_THREAD_MULTIPLE, this job runs at thread level "
                          f"{thread_level}")
        else:
            usable.append(s)
    return usable, skipped


def fallback_reason(buffers: Sequence[FusedCommBuffer], strategy: str) -> Optional[str]:
    """Why ``buffers`` run another strategy than ``strategy`` (shm/hierarchical fall back
    to thread where shared windows are not available), or None."""
    comm = buffers[0].comm if buffers else None
    if comm is None or comm.strategy == strategy or strategy == "auto":
        return None
    return f"ran {comm.strategy}: {comm.shm_fallback or 'fallback'}"


def default_segment(comm: MPI.Comm) -> int:
    """The segment size the thread strategy uses in this job (tuned, L2 rule or env): the
    smallest over ``comm``'s ranks, as the agreement check takes it. Collective on first use
    per communicator: ranks whose tune files or caches differ (mixed nodes) would otherwise
    time different candidates and hang."""
    key = comm.py2f()
    if key not in _SEGMENTS:
        _SEGMENTS[key] = comm.allreduce(segment_for(CommOptions.from_env(strategy="thread")),
                                        op=MPI.MIN)
    return _SEGMENTS[key]


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
    """``params`` fused in groups of ``group_bytes`` with real grads (all ones); the
    keywords ``verify_order``, ``window``, ``allreduce`` and ``pipeline`` set the
    CommOptions, the rest go to FusedCommBuffer."""
    groups = assign_group_by_size(list(params), group_size=group_bytes)
    dst = 0 if act == HookAction.REDUCE else -1
    options = CommOptions(strategy=strategy, verify_order=kwargs.pop("verify_order", True),
                          window=kwargs.pop("window", None) or DEFAULT_WINDOW,
                          allreduce=kwargs.pop("allreduce", "auto"),
                          pipeline=kwargs.pop("pipeline", False))
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


def median_step(buffers: Sequence[FusedCommBuffer], reps: int) -> float:
    """Seconds of the median of ``reps`` ALL_REDUCE steps of ``buffers``, each timed alone."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        full_step(buffers, False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def grad_bytes(buffers: Sequence[FusedCommBuffer]) -> int:
    """Bytes of the buffers' grads."""
    return int(sum(b.grad_storage.nbytes for b in buffers))
