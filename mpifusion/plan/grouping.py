"""Which params share a buffer, and in which order buffers are built: the one definition.

``fused_parameters`` (at run time), ``mpifusion layout`` and the oracle (without MPI) all take
the order from :func:`split_params` and the buffers from :func:`plan_model`, so a layout
printed on a laptop is the one a job allocates. Params here are anything with ``name``,
``shape``, ``dtype`` (name or numpy dtype), ``is_distributed`` and ``need_clip``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..dtypes import as_dtype, dtype_name, itemsize
from ..errors import FusionError
from .layout import FlatLayout, check_fusable, group_indices_by_size, plan_flat, plan_sharded


def grad_dtype_name(param_dtype: Any, use_main_grad: bool) -> str:
    """Grads in the params' dtype; main grads (``use_main_grad``) are fp32 for narrower
    (half-precision) params and never narrower than the param: float64 params keep float64
    grads (an oracle's reference must not be rounded to fp32)."""
    name = dtype_name(param_dtype)
    if use_main_grad and itemsize(name) < itemsize("float32"):
        return "float32"
    return name


def grad_dtype_for(param_dtype: Any, use_main_grad: bool) -> Any:
    """The numpy dtype of :func:`grad_dtype_name` (the one rule)."""
    return as_dtype(grad_dtype_name(param_dtype, use_main_grad))


class PlanError(FusionError, ValueError):
    """Params that cannot be planned as asked (one line, names the field or param)."""


def _is_fp32(p: Any) -> bool:
    return dtype_name(p.dtype) == "float32"


def filter_split(params: Sequence[Any], is_fp32: bool, is_distributed: bool,
                 need_clip: bool) -> Tuple[list, Optional[str]]:
    """The params of one (fp32?, distributed?, need_clip?) split and their common dtype."""
    chosen = [p for p in params
              if bool(getattr(p, "is_distributed", False)) == is_distributed
              and bool(getattr(p, "need_clip", True)) == need_clip
              and _is_fp32(p) == is_fp32]
    dtype = dtype_name(chosen[0].dtype) if chosen else None
    for p in chosen:
        if dtype_name(p.dtype) != dtype:
            raise PlanError(f"param '{p.name}': expected dtype {dtype} like '{chosen[0].name}' "
                            f"(all non-fp32 params must share one dtype), got "
                            f"{dtype_name(p.dtype)}")
    return chosen, dtype


@dataclass(frozen=True)
class Split:
    """Params fused together before size grouping: one (fp32, distributed, need_clip) split,
    decay or not. ``fused_parameters`` builds buffers split by split, in list order."""

    params: tuple
    distributed: bool
    need_clip: bool
    decay: bool


def split_params(params: Sequence[Any], is_decay: Callable[[Any], bool]) -> List[Split]:
    """Paddle's order: (fp32, distributed, need_clip) from (True, True, True) to
    (False, False, False); within each, the decay params first, then the others. Empty
    splits are left out; one non-fp32 dtype per model, and only dtypes a buffer may hold
    (checked for every param first, so nothing is built for a model that fails)."""
    try:
        check_fusable(params)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    out: List[Split] = []
    half: Optional[str] = None
    for fp32, dist, clip in itertools.product([True, False], repeat=3):
        chosen, dtype = filter_split(params, fp32, dist, clip)
        if not fp32 and dtype is not None:
            if half is None:
                half = dtype
            elif dtype != half:
                raise PlanError(f"param '{chosen[0].name}': expected dtype {half} (one "
                                f"non-fp32 dtype per model), got {dtype}")
        decay = [p for p in chosen if is_decay(p)]
        other = [p for p in chosen if not is_decay(p)]
        for members, is_d in ((decay, True), (other, False)):
            if members:
                out.append(Split(tuple(members), dist, clip, is_d))
    return out


def split_groups(params: Sequence[Any], group_size: int,
                 is_decay: Callable[[Any], bool]) -> List[list]:
    """Every buffer's params, in build order: each split grouped by size."""
    groups = []
    for split in split_params(params, is_decay):
        members = list(split.params)
        for idx in group_indices_by_size(members, group_size):
            groups.append([members[i] for i in idx])
    return groups


@dataclass(frozen=True)
class PlannedBuffer:
    """One fused buffer: its params (in buffer order) and their layout."""

    index: int
    act: str
    dtype: str
    grad_dtype: str
    params: tuple
    layout: FlatLayout

    @property
    def grad_nbytes(self) -> int:
        return self.layout.numel * itemsize(self.grad_dtype)


def plan_model(params: Sequence[Any], *, act: str, group_size: int, use_main_grad: bool,
               nranks: Optional[int], is_decay: Callable[[Any], bool]) -> List[PlannedBuffer]:
    """Every buffer ``fused_parameters`` builds for ``params`` (trainable ones only), with
    offsets and, for ``reduce_scatter``, the shards of ``nranks`` ranks."""
    if not params:
        raise PlanError("params: no trainable param to fuse (every param has trainable: false "
                        "or stop_gradient: true)")
    if act == "reduce_scatter" and nranks is None:
        raise PlanError("nranks: reduce_scatter needs the number of ranks "
                        "(set \"nranks\" in the spec or pass --nranks)")
    buffers: List[PlannedBuffer] = []
    for members in split_groups(params, group_size, is_decay):
        dtype = dtype_name(members[0].dtype)
        layout = plan_sharded(members, nranks) if act == "reduce_scatter" else plan_flat(members)
        buffers.append(PlannedBuffer(len(buffers), act, dtype,
                                     grad_dtype_name(dtype, use_main_grad),
                                     tuple(members), layout))
    return buffers
