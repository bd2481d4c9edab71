"""``mpifusion bench``: mpifusion's gradient sync side by side with raw MPI, OSU/nccl-tests style.

Run as ``mpiexec -n 2 mpifusion bench``. One run measures, on the same bytes (a preset's
gradients, GPT-2-small fp32 by default):

* mpifusion's full step (``add_grad`` of every param, comm, ``scale_grads``) for ALL_REDUCE,
  REDUCE and REDUCE_SCATTER (+ ``sync_params``), per communication strategy;
* every strategy side by side with a memcpy floor (a numpy copy of the same grad bytes) and
  the best raw segmented ``Allreduce`` + 1/n, in the same rounds, with a bf16 step of the
  ``shm`` strategy beside an fp32 run and one small (4-64 KiB) buffer per strategy; a
  strategy this job cannot run (threaded ones below MPI_THREAD_MULTIPLE) is skipped with its
  reason;
* the raw MPI candidates on one contiguous buffer (the floor for this MPI), a naive
  ``Iallreduce`` of the flat buffer, per-param ``Iallreduce`` and torch gloo (when installed);
* a sweep of message sizes (algbw/busbw, nccl-tests definitions, ``tools.bandwidth``) and of
  fusion group sizes, both up to the model's grad bytes unless given;
* overlap with emulated compute (OSU's method), ``add_grad`` cost per param and peak memory;
* where the job spans nodes, the cluster section (``cluster``): the link's rate measured
  point to point, the all-reduce floor it sets, and ``hierarchical``, ``thread``, ``auto``
  and raw ``Allreduce`` + 1/n against it per size (``--cluster-sizes``); ``--only cluster``
  runs it alone.

Times are the slowest rank's, median over ``--iters`` (after ``--warmup``). Only rank 0 prints
and writes the JSON and PNG (into ``--out``, default ``bench_out/``). The targets shown are
those that apply to the model (the speed ratios are set for bandwidth-bound syncs); they
inform, they do not set the exit code: 0 after a run, 2 for bad arguments (checked on every
rank before anything is measured).

Modules: ``settings`` (arguments), ``workload`` (the params, buffers and one step),
``baselines`` (raw MPI and gloo on the same bytes), ``probes`` (overlap, add_grad, memory),
``measure`` (:data:`~.measure.MEASUREMENTS`, each filling its keys of ``Bench.res``),
``cluster`` (the multi-node section: its measurement, table, plot and targets),
``targets`` and ``report`` (:data:`~.report.TABLES`); a new sweep is one entry in each list.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from mpi4py import MPI

from ...errors import OptionError
from .measure import MEASUREMENTS, Bench
from .report import report
from .settings import auto_group_sweep, auto_size_sweep, build_parser, prepare_outputs, settings
from .targets import targets

__all__ = ["main", "build_parser", "settings", "Bench", "MEASUREMENTS", "targets", "report",
           "auto_group_sweep", "auto_size_sweep"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark on COMM_WORLD; rank 0 prints the tables and writes JSON and PNG.
    Bad arguments raise (OptionError, PresetError, SpecError) on every rank before anything
    is measured; the command line turns them into one line and exit 2."""
    args = build_parser().parse_args(argv)
    world = MPI.COMM_WORLD
    s = settings(args, world.Get_size())
    error = prepare_outputs(s) if world.Get_rank() == 0 else None
    error = world.bcast(error, root=0)
    if error is not None:
        raise OptionError(error)
    b = Bench(s, world, world.Dup())
    t_start = time.perf_counter()
    for measure in MEASUREMENTS:
        if s.only is None or measure.__name__ in ("measure_meta", f"measure_{s.only}"):
            measure(b)
    b.res["meta"]["wall_s"] = time.perf_counter() - t_start
    b.res["targets"] = [dict(vars(t), met=t.met) for t in targets(b.res)]
    if b.rank == 0:
        report(b.res, s)
    b.comm.Barrier()
    b.comm.Free()
    return 0
