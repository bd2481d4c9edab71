"""``mpifusion run``: fuse a model's params, sync synthetic gradients, prove the result right.

Every rank builds the same params, fuses them with ``fused_parameters`` (or, for
``release_grads``, which ``fused_parameters`` does not take, with ``FusedCommBuffer`` over the
same groups), and emulates ``acc_steps`` backward passes per step by calling each param's
backward hook in reverse param order. The gradient a rank feeds is a pure function of
(seed, rank, step, micro-step, param), so each rank recomputes, in float64, the exact sum over
all ranks of what it should hold and compares with :func:`mpifusion.oracle.error_bound`, or,
with exact inputs (``--inputs exact``), demands it bit for bit. The gradient sources:
``gradsource``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..runtime.buffer import FusedCommBuffer, HookAction
from ..dtypes import as_dtype, dtype_name, finfo
from ..runtime.fusion import fused_parameters
from ..oracle import ErrorStats, bound_model, error_bound, format_ratio
from ..oracle.inputs import exact_formula, exact_tolerance
from ..runtime.param import Param
from ..config import CommOptions
from ..errors import LayoutError, OptionError
from ..plan.grouping import PlanError, grad_dtype_for, split_groups
from .bandwidth import algbw, bus_factor, fmt_gbps
from ..limits import format_bytes, memory_problem
from .render import buffer_summary
from ..spec import Spec
from .gradsource import GRAD, INIT, TABLE_SIZE, UPDATE, ExactGradSource, GradSource

__all__ = ["GRAD", "INIT", "TABLE_SIZE", "UPDATE", "ExactGradSource", "GradSource",
           "RunOptions", "run_job"]

#: printed before the verdict of a one-rank job (e.g. ``mpifusion run`` without ``mpiexec``)
ONE_RANK_NOTE = ("note: this job has 1 rank, so no gradient crossed ranks; start more with "
                 "mpiexec -n N mpifusion run ... (or srun -n N mpifusion run ...)")

#: show a progress bar when the first step predicts a run longer than this (seconds)
PROGRESS_AFTER_S = 5.0


def agree(comm: MPI.Comm, error: Optional[str]) -> Optional[str]:
    """Every rank's verdict on its input; the first error (prefixed with its rank when it is
    not rank 0's), or None when all ranks are fine. Collective, so no rank is left behind."""
    errors = comm.allgather(error)
    for rank, err in enumerate(errors):
        if err is not None:
            return err if rank == 0 or err.startswith("rank ") else f"rank {rank}: {err}"
    return None


@dataclass
class RunOptions:
    """The switches of a run that are not part of the spec."""

    steps: int = 3
    seed: int = 0
    release_grads: bool = False
    reduce_avg: bool = False
    scale_after_comm: bool = False
    progress: bool = True
    inputs: str = "random"  # or "exact": oracle.exact_inputs, checked bit for bit
    comm_options: Optional[CommOptions] = None  # None: CommOptions.from_env()


@dataclass
class StepTimes:
    backward: float = 0.0   # inside backward hooks: accumulation, check-in, comm launch
    wait: float = 0.0       # scale_grads: rest of the collectives and the 1/n scaling
    comm: float = 0.0       # first comm launch .. last scale_grads returned
    sync: float = 0.0       # sync_params (reduce_scatter)

    @property
    def step(self) -> float:
        return self.backward + self.wait + self.sync


@dataclass
class Job:
    spec: Spec
    options: RunOptions
    comm: MPI.Comm
    params: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    plan: list = field(default_factory=list)
    owner: dict = field(default_factory=dict)  # param name -> buffer


def spec_digest(spec: Spec) -> str:
    return hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode()).hexdigest()


def ranks_on_this_node(comm: MPI.Comm) -> int:
    """How many ranks of ``comm`` share this machine's memory (collective)."""
    try:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    except MPI.Exception:
        return 1
    try:
        return node.Get_size()
    finally:
        node.Free()


def run_memory(spec: Spec, plan: Sequence[Any]) -> tuple:
    """``(bytes, detail)``: what one rank of a run allocates at its peak, estimated from the
    plan: the fused params (and the params' own arrays before fusing), the grad buffers, and
    the verifier's float64 work arrays for the largest param (about 15 per element)."""
    params = sum(b.layout.nbytes for b in plan)
    grads = sum(b.grad_nbytes for b in plan)
    largest = max((b.layout[p.name].padded_numel for b in plan for p in b.params), default=0)
    verify = 15 * 8 * largest
    need = 2 * params + grads + verify
    detail = (f"params {format_bytes(params)} (twice while fusing), grads "
              f"{format_bytes(grads)}, checking {format_bytes(verify)}")
    return need, detail


def check_job_spec(spec: Spec, comm: MPI.Comm) -> Optional[str]:
    """Input errors of a run on this rank (one line), or None: the spec against the job, the
    error bound (too many micro-steps leave no accuracy to check), and the memory the run
    needs against what this machine has for its ranks. Collective (every rank calls it)."""
    size = comm.Get_size()
    ranks_here = ranks_on_this_node(comm)
    if spec.nranks is not None and spec.nranks != size:
        return f"nranks: the spec says {spec.nranks} ranks, but the job has {size}"
    if spec.act == "reduce" and not 0 <= spec.dst < size:
        return f"dst: reduce needs a root rank in [0, {size}), got {spec.dst}"
    try:
        plan = spec.plan(size)
        for grad_dtype in sorted({str(b.grad_dtype) for b in plan}):
            bound_model(grad_dtype=grad_dtype, nranks=size, acc_steps=spec.acc_steps,
                        average=True)
    except ValueError as exc:  # PlanError, OptionError (the bound): one line each
        return str(exc)
    need, detail = run_memory(spec, plan)
    return memory_problem(need, "this run", ranks_here, detail)


def _hook(buffer: FusedCommBuffer, param: Param, grad: Any) -> None:
    buffer.add_grad(param, grad=grad)


def build(job: Job) -> None:
    """Params (deterministic, identical on every rank) and their fused buffers."""
    spec, comm = job.spec, job.comm
    size = comm.Get_size()
    specs = spec.fused_params()
    src = GradSource(job.options.seed + 1, specs[0].dtype)
    job.params = []
    for i, ps in enumerate(specs):
        data = src.values((INIT, i), ps.numel).astype(as_dtype(ps.dtype)).reshape(ps.shape)
        job.params.append(Param(ps.name, data, is_distributed=ps.is_distributed,
                                need_clip=ps.need_clip))
    decay = {ps.name: ps.decay for ps in specs}
    act = HookAction.parse(spec.act)
    dst = spec.dst if spec.act == "reduce" else -1
    if not job.options.release_grads:
        _, _, job.buffers = fused_parameters(
            job.params, use_main_grad=spec.use_main_grad, fuse_param=act != HookAction.REDUCE_SCATTER,
            comm_overlap=True, comm_group=comm, act=act, dst=dst, acc_step=spec.acc_steps,
            scale_after_comm=job.options.scale_after_comm,
            apply_decay_param_fun=lambda name: decay[name], use_reduce_avg=job.options.reduce_avg,
            group_size=spec.group_size, comm_options=job.options.comm_options)
    else:  # fused_parameters has no release_grads: same groups, buffers built directly
        job.buffers = []
        for members in split_groups(job.params, spec.group_size, lambda p: decay[p.name]):
            buf = FusedCommBuffer(len(job.buffers), members, comm, acc_steps=spec.acc_steps,
                                  act=act, dst=dst, use_main_grad=spec.use_main_grad,
                                  scale_after_comm=job.options.scale_after_comm,
                                  release_grads=True, use_reduce_avg=job.options.reduce_avg,
                                  comm_options=job.options.comm_options)
            for p in members:
                p.register_backward_hook(functools.partial(_hook, buf, p))
            job.buffers.append(buf)
    job.owner = {p.name: b for b in job.buffers for p in b.params}
    job.plan = spec.plan(size)


def _grad_dtype(spec: Spec, ps: Any) -> str:
    return dtype_name(grad_dtype_for(ps.dtype, spec.use_main_grad))


def _table_dtype(spec: Spec) -> Any:
    """The least precise grad dtype of the run: its values convert exactly to every other
    grad dtype (a model mixes fp32 with at most one half dtype), so one table feeds all."""
    return min((as_dtype(_grad_dtype(spec, ps)) for ps in spec.fused_params()),
               key=lambda d: finfo(d).nmant)


def _prescaled(options: RunOptions) -> bool:
    """Each rank scales by 1/n before the collective (so a non-power-of-two mean of exact
    inputs rounds in every addition), unless reduce-avg or scale-after-comm."""
    return not (options.reduce_avg or options.scale_after_comm)


class Verifier:
    """Compares what this rank holds after a sync with the float64 reference."""

    def __init__(self, job: Job, src: Any) -> None:
        self.job, self.src = job, src
        self.rank, self.size = job.comm.Get_rank(), job.comm.Get_size()
        self.stats = {p.name: ErrorStats(p.name) for p in job.params}

    def _compare(self, step: int, pidx: int, param: Param, out: np.ndarray, lo: int,
                 hi: int) -> None:
        """``out`` holds elements ``[lo, hi)`` of ``param``'s (padded) gradient."""
        spec = self.job.spec
        numel = param.numel
        stats = self.stats[param.name]
        real = max(0, min(hi, numel) - lo)
        if real:
            ref, absolute = self.src.reference(step, pidx, lo, lo + real, self.size,
                                               spec.acc_steps)
            ref /= self.size  # FusedCommBuffer always averages
            if self.src.exact:  # 0, or the rounding of a non-power-of-two mean
                bound = exact_tolerance(ref, absolute, grad_dtype=_grad_dtype(spec, param),
                                        nranks=self.size, average=True,
                                        prescaled=_prescaled(self.job.options))
            else:
                bound = error_bound(absolute, grad_dtype=_grad_dtype(spec, param),
                                    nranks=self.size, acc_steps=spec.acc_steps, average=True)
            stats.update(out[:real].astype(np.float64), ref, bound, self.rank, offset=lo)
        if real < out.size:  # padding must stay exactly zero
            pad = out[real:].astype(np.float64)
            stats.update(pad, np.zeros(pad.size), np.zeros(pad.size), self.rank,
                         offset=lo + real)

    def grads(self, step: int) -> None:
        spec = self.job.spec
        index = {p.name: i for i, p in enumerate(self.job.params)}
        for buf in self.job.buffers:
            lay = buf.layout
            if buf.act == HookAction.REDUCE and self.rank != buf.dst_rank:
                continue  # the result lives on the root only
            storage = buf.grad_storage
            for p in buf.params:
                slot = lay[p.name]
                if buf.act == HookAction.REDUCE_SCATTER:
                    piece = lay.slice_of(p.name, self.rank)
                    if piece is None:
                        continue
                    begin, end = piece
                    self._compare(step, index[p.name], p, storage[begin:end],
                                  begin - slot.offset, end - slot.offset)
                else:
                    view = p.main_grad if spec.use_main_grad else p.grad
                    flat = np.concatenate([view.reshape(-1), storage[slot.end:slot.padded_end]])
                    self._compare(step, index[p.name], p, flat, 0, slot.padded_numel)


def _expected_params(buf: FusedCommBuffer, src: GradSource, step: int) -> np.ndarray:
    """The params an optimizer step 'computes' (deterministic), padding zero."""
    lay = buf.layout
    out = np.zeros(lay.numel, dtype=as_dtype(lay.dtype))
    for p in buf.params:
        slot = lay[p.name]
        out[slot.offset:slot.end] = src.values((UPDATE, step, buf.id, slot.offset), slot.numel)
    return out


def update_and_sync(job: Job, src: GradSource, step: int, times: StepTimes) -> list:
    """Reduce-scatter: each rank writes new values into its own shard only (the rest zeroed),
    ``sync_params`` all-gathers them; every param view must then be bit-exact. Returns the
    names of params whose data differ."""
    rank = job.comm.Get_rank()
    expected = []
    for buf in job.buffers:
        want = _expected_params(buf, src, step)
        begin, end = buf.layout.shard_range(rank)
        buf.param_storage[...] = 0
        buf.param_storage[begin:end] = want[begin:end]
        expected.append(want)
    t0 = time.perf_counter()
    for buf in job.buffers:
        buf.sync_params(sync=True)
    times.sync = time.perf_counter() - t0
    bad = []
    for buf, want in zip(job.buffers, expected):
        lay = buf.layout
        raw_want = want.view(np.uint8 if want.itemsize == 1 else f"u{want.itemsize}")
        raw_have = buf.param_storage.view(raw_want.dtype)
        for p in buf.params:
            slot = lay[p.name]
            data = p.data.reshape(-1).view(raw_want.dtype)
            ok = (np.array_equal(data, raw_want[slot.offset:slot.end])
                  and np.array_equal(raw_have[slot.end:slot.padded_end],
                                     raw_want[slot.end:slot.padded_end]))
            if not ok:
                bad.append(p.name)
    return bad


def one_step(job: Job, src: GradSource, step: int) -> StepTimes:
    """Backward emulation for every micro-step, then scale_grads (communication finishes)."""
    rank = job.comm.Get_rank()
    times = StepTimes()
    first_launch = None
    order = list(enumerate(job.params))[::-1]
    for micro in range(job.spec.acc_steps):
        for pidx, p in order:
            buf = job.owner[p.name]
            # table values convert exactly to the buffer's grad dtype
            g = src.grad(rank, step, micro, pidx, p.shape).astype(buf.grad_dtype, copy=False)
            t0 = time.perf_counter()
            p.backward(g)
            t1 = time.perf_counter()
            times.backward += t1 - t0
            if first_launch is None and buf.task is not None:
                first_launch = t1
    t0 = time.perf_counter()
    for buf in job.buffers:
        buf.scale_grads()
    t1 = time.perf_counter()
    times.wait = t1 - t0
    times.comm = t1 - (first_launch if first_launch is not None else t0)
    return times


def clear_grads(job: Job) -> None:
    """What the optimizer's clear_grad does between steps."""
    for buf in job.buffers:
        if job.options.release_grads:
            buf.clear_grad_storage()
        else:
            buf.grad_storage[...] = 0


def _progress(total: int, initial: int):
    from tqdm import tqdm  # a dependency; imported here, only when a bar is shown

    return tqdm(total=total, initial=initial, unit="step", file=sys.stderr, leave=False,
                dynamic_ncols=True)


def _bw(nbytes: int, seconds: float, factor: float) -> str:
    """``algbw X GB/s, busbw Y GB/s`` (tools.bandwidth's definitions)."""
    alg = algbw(nbytes, seconds)
    return (f"algbw {fmt_gbps(alg)} GB/s, "
            f"busbw {fmt_gbps(None if alg is None else alg * factor)} GB/s")


def run_job(spec: Spec, options: RunOptions, comm: MPI.Comm,
            say: Callable[[str], None] = print, source: str = "spec") -> int:
    """Run the job on every rank of ``comm``; rank 0 reports. Returns 0 PASS, 1 FAIL, 2 bad
    input (``source`` names the spec file or preset in input errors)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    out = say if rank == 0 else (lambda _line: None)
    error = check_job_spec(spec, comm)
    if error is not None:
        error = f"{source}: {error}"
    digests = comm.allgather(spec_digest(spec))  # on every rank: the collectives must pair
    if error is None:
        for r, d in enumerate(digests):
            if d != digests[0]:
                error = f"rank {r}: its spec differs from rank 0's (same files on every node?)"
                break
    error = agree(comm, error)
    if error is not None:
        return _fail_input(rank, error)
    job = Job(spec, options, comm)
    try:
        build(job)
        error = None
    except (LayoutError, PlanError) as exc:  # the core refused the params: bad input
        error = str(exc)
    except MemoryError:  # the estimate of check_job_spec was short: still one line, exit 2
        need, detail = run_memory(spec, spec.plan(size))
        error = (f"out of memory while building the buffers: this run needs about "
                 f"{format_bytes(need)} per rank ({detail})")
    error = agree(comm, error)
    if error is not None:
        return _fail_input(rank, error)

    try:  # exact inputs refuse what they cannot hold exactly (OptionError): bad input
        src = (ExactGradSource(spec, options.seed, _table_dtype(spec), size)
               if options.inputs == "exact" else GradSource(options.seed, _table_dtype(spec)))
        rules = {str(b.grad_dtype): exact_formula(b.grad_dtype, nranks=size, average=True,
                                                  prescaled=_prescaled(options))
                 for b in job.plan if src.exact}
        for grad_dtype in rules:  # a mean that rounds too often to check is refused now
            exact_tolerance(np.ones(1), np.ones(1), grad_dtype=grad_dtype, nranks=size,
                            average=True, prescaled=_prescaled(options))
        error = None
    except OptionError as exc:
        error = str(exc)
    error = agree(comm, error)
    if error is not None:
        return _fail_input(rank, error)
    verifier = Verifier(job, src)
    grad_bytes = sum(b.grad_nbytes for b in job.plan)
    param_bytes = sum(b.layout.nbytes for b in job.plan)
    models = {str(b.grad_dtype): bound_model(grad_dtype=b.grad_dtype, nranks=size,
                                             acc_steps=spec.acc_steps, average=True)
              for b in job.plan}
    strategy = getattr(job.buffers[0].comm, "strategy", None) if job.buffers else None
    out(f"mpifusion run: {size} rank(s), act {spec.act}, acc_steps {spec.acc_steps}, "
        f"{options.steps} step(s), {len(job.params)} params, use_main_grad {spec.use_main_grad}, "
        f"release_grads {options.release_grads}, reduce_avg {options.reduce_avg}, "
        f"scale_after_comm {options.scale_after_comm}, seed {options.seed}"
        f"{', inputs exact' if src.exact else ''}{', strategy ' + strategy if strategy else ''}")
    for planned in job.plan[:8]:
        out("  " + buffer_summary(planned))
    if len(job.plan) > 8:
        out(f"  ... {len(job.plan) - 8} more buffer(s); see mpifusion layout")
    for grad_dtype, model in models.items():
        if src.exact:
            out(f"tolerance (oracle.exact_tolerance, {grad_dtype} grads): {rules[grad_dtype]}")
        else:
            out(f"error bound (oracle.error_bound, {grad_dtype} grads): {model.formula}")

    bar = None
    history = []
    sync_bad: list = []
    factor = bus_factor(spec.act, size)
    started = time.perf_counter()
    for step in range(options.steps):
        comm.Barrier()
        times = one_step(job, src, step)
        verifier.grads(step)
        if spec.act == "reduce_scatter":
            sync_bad += [(step, n) for n in update_and_sync(job, src, step, times)]
        clear_grads(job)
        mine = np.array([times.step, times.backward, times.wait, times.comm, times.sync])
        worst = np.empty_like(mine)
        comm.Allreduce(mine, worst, op=MPI.MAX)  # the slowest rank sets the step time
        history.append(worst)
        line = (f"step {step + 1}/{options.steps}: {worst[0] * 1e3:.2f} ms (backward "
                f"{worst[1] * 1e3:.2f}, wait {worst[2] * 1e3:.2f}), comm {worst[3] * 1e3:.2f} ms, "
                f"{_bw(grad_bytes, worst[3], factor)}")
        if spec.act == "reduce_scatter":
            line += f", sync_params {worst[4] * 1e3:.2f} ms"
        if bar is not None:
            bar.write(line)
            bar.update(1)
        else:
            out(line)
        # a bar only when the whole run looks like taking more than a few seconds
        elapsed = time.perf_counter() - started
        if (step == 0 and rank == 0 and options.progress and options.steps > 1
                and elapsed * options.steps > PROGRESS_AFTER_S):
            bar = _progress(options.steps, initial=1)
    if bar is not None:
        bar.close()

    # ---- verdict: worst error per param over every rank
    gathered = comm.gather(verifier.stats, root=0)
    all_sync_bad = comm.gather(sync_bad, root=0)
    verdict = None
    if rank == 0:
        merged: dict = {}
        for per_rank in gathered:  # ErrorStats.merge: a NaN ratio counts as a failure
            for name, st in per_rank.items():
                merged.setdefault(name, ErrorStats(name)).merge(st)
        bad_sync = sorted({n for rows in all_sync_bad for _, n in rows})
        failing = [n for n, st in merged.items() if not st.ok]
        worst_name = max(merged, key=lambda n: merged[n].max_ratio)
        w = merged[worst_name]
        med = np.median(np.array(history), axis=0)
        out(f"median step {med[0] * 1e3:.2f} ms, comm {med[3] * 1e3:.2f} ms over "
            f"{grad_bytes} grad bytes: {_bw(grad_bytes, med[3], factor)} "
            f"({spec.act}, busbw = algbw * {factor:.3g})")
        if spec.act == "reduce_scatter":
            out(f"sync_params {med[4] * 1e3:.2f} ms over {param_bytes} param bytes: "
                f"{_bw(param_bytes, med[4], bus_factor('allgather', size))}")
        checked = sum(st.compared for st in merged.values())
        out(f"max error: {w.max_abs:.3g} abs, {w.max_rel:.3g} rel, {format_ratio(w.max_ratio)} "
            f"of the bound (param {worst_name}, rank {w.worst_rank}); {checked} elements "
            f"checked over "
            f"{options.steps} step(s)")
        if spec.act == "reduce_scatter":
            out(f"sync_params: {'exact' if not bad_sync else 'WRONG for ' + ', '.join(bad_sync[:10])}")
        if size == 1:
            out(ONE_RANK_NOTE)
        bound = ("the error bound" if not src.exact else "bit-exact (exact inputs)"
                 if all("bit-exact" in r for r in rules.values())
                 else "the rounding of the mean (exact inputs)")
        if failing or bad_sync:
            names = ", ".join(failing[:10]) + (" ..." if len(failing) > 10 else "")
            why = []
            if failing:
                beyond = "not " + bound if bound.startswith("bit") else "beyond " + bound
                why.append(f"{len(failing)} param(s) {beyond}: {names}")
                for name in failing[:10]:
                    out(f"  {name}: {merged[name].reason}")
            if bad_sync:
                why.append(f"{len(bad_sync)} param(s) wrong after sync_params")
            verdict = "FAIL: " + "; ".join(why)
        else:
            within = bound if bound.startswith("bit") else "within " + bound
            verdict = (f"PASS: {len(merged)} params {within} on {size} rank(s) "
                       f"for {options.steps} step(s)")
        out(verdict)
    code = 0 if rank != 0 or verdict.startswith("PASS") else 1
    return int(comm.bcast(code, root=0))


def _fail_input(rank: int, error: str) -> int:
    if rank == 0:
        print(f"mpifusion run: error: {error}", file=sys.stderr, flush=True)
    return 2
