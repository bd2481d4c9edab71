"""PyTorch capture: every rank's local grads per micro-step (tensor hooks, which see a grad
before DDP or FSDP2 reduce it) and what the rank holds after the sync.

* plain modules and DDP: hooks on the params; outputs are ``param.grad`` (full);
* FSDP2 (``fully_shard``): params are DTensors sharded on dim 0; the hooks go on the unsharded
  params FSDP2 swaps in for forward/backward (found by a forward pre-hook on every module
  that owns params), outputs are the local shards of ``param.grad`` with their
  ``range/{name}`` in the flattened param, and with ``gather=True`` each forward records the
  rank's shard before FSDP2's all-gather and the full param it produced.

Use one backward per micro-step; ``spec()`` counts them.
"""
from __future__ import annotations

import math
import os
import re
import sys
import weakref
from typing import Any, Optional

import numpy as np

from .core import CaptureError, Recorder

__all__ = ["TorchCapture", "spawn"]


def to_numpy(t: Any) -> np.ndarray:
    """A numpy copy of a tensor (DTensor: its local part; bfloat16 as ml_dtypes.bfloat16)."""
    import torch

    if hasattr(t, "to_local"):
        t = t.to_local()
    # a clone: .numpy() of the tensor itself would pin its storage (FSDP2 resizes it to 0)
    t = t.detach().to("cpu", copy=True).contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "device_mesh") and hasattr(t, "to_local")


def dtensor_range(p: Any, local_numel: int) -> tuple:
    """``[begin, end)`` of a DTensor's local part in the flattened global tensor; only
    layouts that are one contiguous range (Shard(0) and Replicate) are accepted."""
    names = [type(pl).__name__ for pl in p.placements]
    dims = [getattr(pl, "dim", None) for pl in p.placements]
    if any(n not in ("Shard", "Replicate") for n in names) or any(
            n == "Shard" and d != 0 for n, d in zip(names, dims)):
        raise CaptureError(f"placements {p.placements}: only Shard(0)/Replicate shards are one "
                           f"range of the flattened param")
    shape = tuple(p.shape)
    row = math.prod(shape[1:]) if shape else 1
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        begin = int(offset[0]) * row if shape else 0
    except (ImportError, AttributeError, TypeError):  # torch.chunk's cut on a 1-D mesh
        mesh = p.device_mesh
        rank, size = mesh.get_local_rank(), mesh.size()
        chunk = -(-shape[0] // size)
        begin = min(rank * chunk, shape[0]) * row
    return begin, begin + local_numel


class TorchCapture(Recorder):
    """Record a PyTorch model's data-parallel gradient step for the oracle.

    ``TorchCapture(model)`` before the first forward (``model`` may be the DDP wrapper or an
    FSDP2 module); run ``acc_steps`` backwards; ``record_outputs()`` after the sync (after
    the last backward; before ``optimizer.step``/``zero_grad``); then ``to_dict()``,
    ``gather()`` (the list of every rank's dict, on ``dst``), ``save(dir)`` and ``spec()``.
    ``attr`` names the grad to read as the output (``"main_grad"`` for Megatron-style fp32
    main grads). The inputs are what the tensor hooks see, so where a framework writes the
    weight grads straight into ``main_grad`` (Megatron's ``gradient_accumulation_fusion``)
    no hook sees them: record such a model with the fusion off.

    Args:
        model: the module (or its DDP wrapper, or an FSDP2 module); every param that
            requires a grad is recorded, by its ``named_parameters`` name.
        rank: this rank (default: torch.distributed's, else 0).
        nranks: the number of ranks (default: torch.distributed's world size, else 1).
        attr: the param attribute read as the synced output.
        gather: FSDP2: also record each param's shard and the gathered param at every
            forward, so the check covers the all-gather too.

    Raises:
        CaptureError: FSDP2 mixed precision that changes a param's dtype (the reduction
            would not be in the param's dtype); no hook is left behind.
    """

    def __init__(self, model: Any, *, rank: Optional[int] = None,
                 nranks: Optional[int] = None, attr: str = "grad", gather: bool = False) -> None:
        import torch.distributed as dist

        ready = dist.is_available() and dist.is_initialized()
        super().__init__(rank if rank is not None else (dist.get_rank() if ready else 0),
                         nranks if nranks is not None else (dist.get_world_size() if ready
                                                            else 1))
        inner = getattr(model, "module", model) if type(model).__name__ in (
            "DistributedDataParallel", "DataParallel") else model
        self._attr, self._gather = attr, gather
        self._params: dict = {}     # name -> the module's registered param (DTensor for FSDP2)
        self._hooked: dict = {}     # id(tensor) -> weakref, tensors that carry our hook
        self._handles: list = []
        self._sharded = False
        try:
            for name, p in inner.named_parameters():
                if not p.requires_grad:
                    continue
                self._params[name] = p
                self.declare(name, tuple(p.shape), str(p.dtype).replace("torch.", ""))
                if _is_dtensor(p):
                    self._sharded = True
                else:
                    self._hook(name, p)
            self._refuse_fsdp_mixed_precision(inner)
            if self._sharded or gather:
                for mod_name, mod in inner.named_modules():
                    if any(True for _ in mod.named_parameters(recurse=False)):
                        self._handles.append(mod.register_forward_pre_hook(
                            self._make_pre_forward(mod_name)))
        except BaseException:
            self.remove()  # a refused capture leaves no hook behind
            raise

    def _refuse_fsdp_mixed_precision(self, inner: Any) -> None:
        """FSDP2 with a ``MixedPrecisionPolicy`` that changes a param's dtype is refused:
        its unsharded param (whose grad the hook records) and its all-gather are in
        ``param_dtype``, the reduction in ``reduce_dtype``, and the sharded grad is cast back
        to the param's dtype, while the capture declares the param's dtype for all of them:
        the oracle would check the reduction at the wrong precision and report a misleading
        all-gather mismatch."""
        seen: set = set()
        by_id = {id(p): n for n, p in self._params.items()}
        for mod_name, mod in inner.named_modules():
            get_state = getattr(mod, "_get_fsdp_state", None)
            if get_state is None:
                continue
            state = get_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            for group in groups:
                if id(group) in seen:
                    continue
                seen.add(id(group))
                policy = getattr(group, "mp_policy", None)
                fsdp_params = getattr(group, "fsdp_params", None)
                if policy is None or fsdp_params is None:
                    raise CaptureError(f"rank {self.rank}: FSDP2 module '{mod_name}': cannot "
                                       f"read its MixedPrecisionPolicy (this torch's FSDP2 "
                                       f"internals differ from torch 2.13's), so cannot tell "
                                       f"in which dtype its grads are reduced; expected a "
                                       f"param group with mp_policy and fsdp_params")
                for fp in fsdp_params:
                    sharded = getattr(fp, "sharded_param", None)
                    if id(sharded) not in by_id:
                        continue  # frozen: not captured, not reduced
                    orig = sharded.dtype
                    param_dtype, reduce_dtype = policy.param_dtype, policy.reduce_dtype
                    # as FSDPParam.init_dtype_attrs: a dtype equal to the param's is no cast
                    if param_dtype == orig or not orig.is_floating_point:
                        param_dtype = None
                    compute = param_dtype or orig
                    if reduce_dtype == compute:
                        reduce_dtype = None
                    if param_dtype is None and reduce_dtype is None:
                        continue
                    name = by_id[id(sharded)]
                    dt = lambda d: str(d).replace("torch.", "")  # noqa: E731
                    raise CaptureError(
                        f"rank {self.rank}: {name}: FSDP2 mixed precision on module "
                        f"'{mod_name or '(root)'}' (MixedPrecisionPolicy(param_dtype="
                        f"{dt(policy.param_dtype)}, reduce_dtype={dt(policy.reduce_dtype)})) "
                        f"for a {dt(orig)} param: its grads are computed in {dt(compute)} "
                        f"and reduced in {dt(reduce_dtype or compute)}, its all-gather runs "
                        f"in {dt(compute)}, but the capture records and checks them as "
                        f"{dt(orig)}; not supported: expected no MixedPrecisionPolicy (or "
                        f"one whose dtypes equal the params') for the captured step")

    # ---------------------------------------------------------------- hooks
    def _hook(self, name: str, t: Any) -> None:
        ref = self._hooked.get(id(t))
        if ref is not None and ref() is t:
            return
        if getattr(t, "_backward_hooks", None):
            # they run before the capture's: one that reduces (a hand-written or Horovod-style
            # data-parallel hook) makes every rank record the reduced grad, and any reduction
            # then passes the check
            raise CaptureError(f"rank {self.rank}: {name}: the param already has gradient "
                               f"hooks, which would run before the capture's and change what "
                               f"it records as the local grad; create the capture before "
                               f"registering them (DDP and FSDP are fine either way)")
        self._hooked[id(t)] = weakref.ref(t)
        # a weak reference: a hook holding the capture (which holds the params) made a
        # reference cycle through every param, freed only by the cyclic GC, at worst at
        # interpreter exit, after torch's own teardown (a spawned rank then aborted now and
        # then: SIGABRT once in some 15 runs)
        capture = weakref.ref(self)

        def on_grad(g: Any, n: str = name) -> None:
            owner = capture()
            if owner is not None:
                owner._on_grad(n, g)

        self._handles.append(t.register_hook(on_grad))

    def _on_grad(self, name: str, grad: Any) -> None:
        self.add_input(name, to_numpy(grad))

    def _make_pre_forward(self, mod_name: str) -> Any:
        def pre_forward(module: Any, args: Any) -> None:
            for local, t in module.named_parameters(recurse=False):
                name = f"{mod_name}.{local}" if mod_name else local
                if name not in self._params or _is_dtensor(t):
                    continue  # not ours, or still sharded (FSDP2 has not gathered it)
                sharded = self._params[name]
                if t.dtype != sharded.dtype:  # a mixed-precision cast the refusal missed
                    raise CaptureError(f"rank {self.rank}: {name}: the unsharded param is "
                                       f"{t.dtype}, the sharded one {sharded.dtype} (FSDP2 "
                                       f"mixed precision?); expected one dtype: the capture "
                                       f"checks the reduction in the param's dtype")
                self._hook(name, t)  # FSDP2's unsharded param: its grad is the local one
                if self._gather and _is_dtensor(sharded):
                    shard = to_numpy(sharded)
                    self.set_shard(name, shard, dtensor_range(sharded, shard.size))
                    self.set_param(name, to_numpy(t))
        return pre_forward

    def remove(self) -> None:
        """Remove every hook this capture installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked.clear()

    # ---------------------------------------------------------------- results
    def record_outputs(self) -> None:
        """Read what the sync left in each param's grad: full for DDP, this rank's shard
        (with its range) for FSDP2. A param whose grad is missing does not raise here but
        in ``gather()``, on every rank (one rank raising alone would strand the others)."""
        self._read_outputs(self._params, self._attr, "zero_grad", self._store_output)

    def _store_output(self, name: str, p: Any, g: Any) -> None:
        arr = to_numpy(g)
        if _is_dtensor(g):
            self.set_output(name, arr.reshape(-1), dtensor_range(g, arr.size))
        else:
            self.set_output(name, arr)

    def gather(self, dst: int = 0) -> Optional[list]:
        """Every rank's ``to_dict()``, in rank order, on rank ``dst`` (None elsewhere), over
        torch.distributed (a collective: every rank calls it). When a rank's record is
        inconsistent, or a param has grads on some ranks and not others (unused on a rank),
        every rank raises the same :class:`CaptureError`, naming the ranks and params."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return [self.to_dict()]

        def all_gather(obj: Any) -> list:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, obj)
            return every

        # every rank first learns whether every record is sound: one rank raising alone
        # would leave the others in gather_object for ever
        mine = self._to_dict_agreed(all_gather)
        out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(mine, out, dst=dst)
        return out


#: mpifusion's exceptions a rank's traceback text carries back to the process that spawned it
_RERAISED = ("mpifusion.errors.OracleMismatch", "mpifusion.errors.WeakCheckError",
             "mpifusion.capture.core.CaptureError")


def _run_rank(index: int, fn: Any, args: tuple) -> None:
    """One spawned rank: ``fn(index, *args)``; once it returned, the process ends at once
    (``os._exit(0)``, output flushed). torch's C++ teardown at interpreter exit, after
    ``destroy_process_group``, aborts a gloo rank now and then under load ("terminate called
    without an active exception", SIGABRT: 1 in about 50 runs of the docs' patterns on two
    busy cores), which would fail a test whose rank had finished and saved everything. A
    rank that raises still exits through torch's own path, which reports the error."""
    fn(index, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Any, args: tuple = (), nprocs: int = 1, **kwargs: Any) -> Any:
    """``torch.multiprocessing.spawn(fn, args, nprocs, ...)``, except that

    - a rank that failed the oracle's check (``OracleMismatch``, ``WeakCheckError``) or the
      capture (``CaptureError``) raises that error here, its message (the report) prefixed
      with the rank, instead of a ``ProcessRaisedException`` whose traceback hides the
      report a hundred lines down (any other failure propagates unchanged);
    - a rank whose ``fn`` returned exits without the interpreter's teardown (``os._exit``:
      torch's C++ teardown after ``destroy_process_group`` aborts a gloo rank now and then):
      its ``atexit`` handlers do not run, so ``fn`` writes and closes what it keeps (files,
      logs) before it returns.

    Args:
        fn: called as ``fn(rank, *args)`` in each process.
        args: the arguments after the rank.
        nprocs: the number of processes (ranks).
        kwargs: ``torch.multiprocessing.spawn``'s other arguments (``join``, ...).

    Returns:
        What ``torch.multiprocessing.spawn`` returns (None, or its context with
        ``join=False``).

    Raises:
        OracleMismatch: a rank's check failed (the report, prefixed with the rank).
        WeakCheckError: a rank's check ran on inputs too weak to tell.
        CaptureError: a rank's capture could not make a consistent dump.
    """
    import torch.multiprocessing as mp

    from ..errors import OracleMismatch, WeakCheckError

    __tracebackhide__ = True  # pytest: the failure starts at the caller's line
    try:
        return mp.spawn(_run_rank, args=(fn, tuple(args)), nprocs=nprocs, **kwargs)
    except mp.ProcessRaisedException as exc:
        text = str(getattr(exc, "msg", exc))
        found = None
        for match in re.finditer(rf"^({'|'.join(map(re.escape, _RERAISED))}): ", text, re.M):
            found = match  # the last one: the exception the rank ended with
        if found is None:
            raise
        cls = {"OracleMismatch": OracleMismatch, "WeakCheckError": WeakCheckError,
               "CaptureError": CaptureError}[found.group(1).rpartition(".")[2]]
        message = text[found.end():].rstrip()
        raise cls(f"rank {exc.error_index}: {message}") from None
