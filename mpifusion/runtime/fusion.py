"""Model-level entry points: split a model's params, group them by size, build the buffers.

Mirrors tensor_fusion_helper's ``fused_parameters`` / ``obtain_storage`` so that the same
model gives the same buffers, in the same order, with the same members.
"""
from __future__ import annotations

import functools
import itertools
import logging
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

from mpi4py import MPI

from .buffer import FusedCommBuffer, HookAction
from .storage import world_rank
from ..config import CommOptions
from ..dtypes import itemsize
from ..errors import LayoutError, error_context
from ..plan.grouping import PlanError, filter_split, split_params
from ..plan.layout import (ASSIGN_GROUP_SIZE, FUSED_GROUP_SIZE, check_fusable,
                           group_indices_by_size)
from .options import check_comm_group, check_switch
from .param import Param

logger = logging.getLogger("mpifusion")


def assign_group_by_size(parameters: Sequence[Param],
                         group_size: int = ASSIGN_GROUP_SIZE) -> "OrderedDict[int, list]":
    """Group params into buckets of about ``group_size`` bytes (Paddle's rule).

    One open group per dtype; a group closes right after the param that brings it to
    ``group_size`` bytes or more; groups are ordered by their first param.

    Args:
        parameters: the params (anything with ``name``, ``shape`` and ``dtype``).
        group_size: bytes per group before it closes.

    Returns:
        ``{group index: [params]}``, in order.

    Raises:
        LayoutError: a param of a dtype no buffer may hold.
    """
    groups = OrderedDict()
    with error_context(f"rank {world_rank()}", ValueError, kind=LayoutError):
        indices = group_indices_by_size(parameters, group_size)
    for group_idx, members in enumerate(indices):
        groups[group_idx] = [parameters[i] for i in members]
    if logger.isEnabledFor(logging.INFO):
        lines = []
        for group_idx, params in groups.items():
            nbytes = sum(p.numel for p in params) * itemsize(params[0].dtype)
            lines.append(f"group_{group_idx}: {nbytes / 1024 ** 2:.4f} MB, dtype: {params[0].dtype}, "
                         f"params: {len(params)}")
        logger.info("tensor fusion groups:\n%s", "\n".join(lines))
    return groups


def filter_params(params: Sequence[Param], is_fp32: bool, is_distributed: bool,
                  need_clip: bool):
    """The params of one (fp32?, distributed?, need_clip?) split, and their common dtype.

    Args:
        params: the model's params.
        is_fp32: take the fp32 params (else the others).
        is_distributed: take the model-parallel params (``is_distributed``) or the others.
        need_clip: take the params with ``need_clip`` set, or the others.

    Returns:
        ``(params, dtype name)``; ``([], None)`` when no param matches.

    Raises:
        LayoutError: the non-fp32 params of the split have different dtypes.
    """
    with error_context(f"rank {world_rank()}", PlanError, kind=LayoutError):
        return filter_split(params, is_fp32, is_distributed, need_clip)


def _check_switches(where: str, **switches: Any) -> None:
    """On/off arguments are bools (``check_switch``), checked before anything is built."""
    for name, value in switches.items():
        check_switch(value, f"{where}: {name}", allow_none=name == "use_main_grad")


def _hook(buffer: FusedCommBuffer, param: Param) -> Callable[[Any], None]:
    """What a backward hook of ``param`` does: check it in with its grad."""
    return functools.partial(_check_in, buffer, param)


def _check_in(buffer: FusedCommBuffer, param: Param, grad: Any = None) -> None:
    buffer.add_grad(param, grad=grad)


_fused_names = itertools.count()


def _fused_param(buffer: FusedCommBuffer, clip: bool, dist: bool) -> Param:
    """The buffer's params as one flat Param, its grad the flat grad buffer (Paddle's
    ParamStorage), ready for an optimizer that steps over fused tensors."""
    fused = Param(f"fused_param_{next(_fused_names)}", buffer.param_storage,
                  need_clip=clip, is_distributed=dist)
    if buffer.use_main_grad:
        fused.main_grad = buffer.grad_storage
    else:
        fused.grad = buffer.grad_storage
    fused.comm_buffer = buffer
    return fused


def obtain_storage(
    parameters: Sequence[Param],
    use_main_grad: bool = False,
    clip: bool = True,
    dist: bool = False,
    fuse_param: bool = True,
    comm_overlap: bool = False,
    act: Any = None,
    comm_group: Optional[MPI.Comm] = None,
    dst: int = -1,
    acc_steps: int = 1,
    scale_after_comm: bool = False,
    use_reduce_avg: bool = False,
    group_size: int = FUSED_GROUP_SIZE,
    comm_options: Optional[CommOptions] = None,
):
    """Build one buffer per size group. Returns ``(fused_params, buffers)``: the fused params
    when ``fuse_param``, the buffers (with backward hooks registered) when ``comm_overlap``.

    Args:
        parameters: the params of one split (one dtype).
        use_main_grad: fp32 main grads for half-precision params.
        clip: the fused params' ``need_clip``.
        dist: the fused params' ``is_distributed``.
        fuse_param: fuse the params' data too, and return one flat :class:`Param` per
            buffer (its grad the grad buffer).
        comm_overlap: register each param's backward hook (``add_grad``), and return
            the buffers.
        act: the buffers' :class:`HookAction`.
        comm_group: the communicator (None: buffers that cannot communicate).
        dst: ``REDUCE``'s root, a global rank.
        acc_steps: micro-steps per step.
        scale_after_comm: scale by ``1/nranks`` after the collective (else before).
        use_reduce_avg: average in the collective.
        group_size: bytes per buffer before it closes (:func:`assign_group_by_size`).
        comm_options: how the collectives run (None: from the environment).

    Raises:
        LayoutError: params that cannot be fused.
        OptionError: an option with a value it cannot take.
    """
    where = f"rank {world_rank()}"
    _check_switches(where, clip=clip, dist=dist, fuse_param=fuse_param,
                    comm_overlap=comm_overlap)
    check_comm_group(comm_group, where)
    if len(parameters) < 1:
        return [], []
    with error_context(where, ValueError, kind=LayoutError):  # every group's dtype first
        check_fusable(parameters)
    storage, buffers = [], []
    for group_idx, params in assign_group_by_size(parameters, group_size=group_size).items():
        buffer = FusedCommBuffer(group_idx, params, comm_group=comm_group, acc_steps=acc_steps,
                                 act=act, dst=dst, use_main_grad=use_main_grad,
                                 fuse_param=fuse_param, scale_after_comm=scale_after_comm,
                                 use_reduce_avg=use_reduce_avg, comm_options=comm_options)
        if fuse_param:
            storage.append(_fused_param(buffer, clip, dist))
        if comm_overlap:
            for p in params:
                p.register_backward_hook(_hook(buffer, p))
            buffers.append(buffer)
    return storage, buffers


def _fused_parameters_impl(parameters, *, use_main_grad, fuse_param, comm_overlap, comm_group,
                           act, dst, acc_step, scale_after_comm, apply_decay_param_fun,
                           use_reduce_avg, group_size, comm_options):
    def is_decay(p: Param) -> bool:
        return apply_decay_param_fun is not None and bool(apply_decay_param_fun(p.name))

    with error_context(f"rank {world_rank()}", PlanError, kind=LayoutError):
        splits = split_params(parameters, is_decay)
    decay_fused, all_fused, all_buffers = [], [], []
    common = dict(use_main_grad=use_main_grad, fuse_param=fuse_param, comm_overlap=comm_overlap,
                  act=act, comm_group=comm_group, dst=dst, acc_steps=acc_step,
                  scale_after_comm=scale_after_comm, use_reduce_avg=use_reduce_avg,
                  group_size=group_size, comm_options=comm_options)
    for split in splits:
        storage, buffers = obtain_storage(list(split.params), clip=split.need_clip,
                                          dist=split.distributed, **common)
        if split.decay:
            decay_fused += storage
        all_fused += storage
        all_buffers += buffers
    return decay_fused, all_fused, all_buffers


def fused_parameters(
    parameters: Sequence[Any],
    use_main_grad: bool = False,
    fuse_param: bool = True,
    comm_overlap: bool = False,
    comm_group: Optional[MPI.Comm] = None,
    act: Any = None,
    dst: int = -1,
    acc_step: int = 1,
    scale_after_comm: bool = False,
    group_params: bool = False,
    apply_decay_param_fun: Optional[Callable[[str], bool]] = None,
    use_reduce_avg: bool = False,
    group_size: int = FUSED_GROUP_SIZE,
    comm_options: Optional[CommOptions] = None,
    order: Optional[str] = None,
):
    """Fuse a model's params (and grads) into buffers, split as Paddle splits them.

    ``order`` (``"strict"``/``"negotiated"``, default ``$MPIFUSION_ORDER`` or strict) is the
    buffers' collective order (docs/troubleshooting.md).

    Returns ``(decay_fused, all_fused, all_buffers)``; with ``group_params`` the input is a
    list of ``{"params": [...], ...}`` groups and ``(updated_groups, buffers)`` is returned.

    The params are split by (fp32 or not, ``is_distributed``, ``need_clip``), then by decay,
    and each split is grouped by size; every rank must call it with the same params, as
    building the buffers is collective.

    Args:
        parameters: the model's params (:class:`Param`), or with ``group_params`` the
            optimizer's param groups.
        use_main_grad: fp32 main grads for half-precision params.
        fuse_param: fuse the params' data too (the fused params of the result).
        comm_overlap: register a backward hook per param, so ``param.backward(grad)``
            checks it in, and return the buffers.
        comm_group: the communicator; None with ``comm_overlap`` is ``COMM_WORLD``
            (``ALL_REDUCE`` only).
        act: the collective (:class:`HookAction` or its name); None: ``REDUCE``.
        dst: ``REDUCE``'s root, a global rank (required for ``REDUCE``).
        acc_step: micro-steps per step (Paddle's spelling).
        scale_after_comm: scale by ``1/nranks`` after the collective (else before).
        group_params: ``parameters`` is a list of param groups.
        apply_decay_param_fun: ``name -> bool``, whether weight decay applies to a param
            (the decay split).
        use_reduce_avg: average in the collective.
        group_size: bytes per buffer before it closes.
        comm_options: how the collectives run (None: from the environment).
        order: the buffers' collective order, as above.

    Raises:
        LayoutError: params that cannot be fused, ``REDUCE`` without ``dst``, a param group
            without ``params``.
        OptionError: an option with a value it cannot take.
    """
    where = f"rank {world_rank()}"
    _check_switches(where, use_main_grad=use_main_grad, fuse_param=fuse_param,
                    comm_overlap=comm_overlap, scale_after_comm=scale_after_comm,
                    group_params=group_params, use_reduce_avg=use_reduce_avg)
    check_comm_group(comm_group, where)
    act = HookAction.REDUCE if act is None else HookAction.parse(act)
    if comm_overlap and comm_group is None:
        if act != HookAction.ALL_REDUCE:
            raise LayoutError(f"rank {world_rank()}: comm_group: only ALL_REDUCE may use the "
                              f"default communicator (COMM_WORLD); got {act.name} without one")
        comm_group = MPI.COMM_WORLD
    if act == HookAction.REDUCE and dst == -1:
        raise LayoutError(f"rank {world_rank()}: dst: REDUCE expected the root's rank, got -1")
    if act == HookAction.ALL_REDUCE:
        dst = -1
    if order is not None:
        comm_options = (comm_options or CommOptions.from_env()).with_(order=order)
    options = dict(use_main_grad=use_main_grad, fuse_param=fuse_param,
                   comm_overlap=comm_overlap, comm_group=comm_group, act=act, dst=dst,
                   acc_step=acc_step, scale_after_comm=scale_after_comm,
                   apply_decay_param_fun=apply_decay_param_fun,
                   use_reduce_avg=use_reduce_avg, group_size=group_size,
                   comm_options=comm_options)
    if not group_params:
        return _fused_parameters_impl(parameters, **options)

    updated, buffers = [], []
    for idx, group in enumerate(parameters):
        if not isinstance(group, dict) or "params" not in group:
            raise LayoutError(f"rank {world_rank()}: parameters[{idx}]: with group_params=True "
                              f"expected a dict with a 'params' list, got {type(group).__name__}")
        real = group["params"]
        _, group_fused, group_buffers = _fused_parameters_impl(real, **options)
        if comm_overlap:
            buffers.extend(group_buffers)
        for fused in group_fused:
            fused.optimize_attr = real[0].optimize_attr
        group["params"] = group_fused
        updated.append(group)
    return updated, buffers
