"""The layout planner: which params share a buffer and where each one sits.

Pure arithmetic on names, shapes and dtypes -- no MPI and no arrays -- so that a layout can be
planned, printed and compared (``mpifusion layout``) on a laptop, and so that the buffers are
built from a plan that was checked first (plan, then allocate, then view).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from ..dtypes import ITEMSIZES, dtype_name, itemsize as _itemsize

#: Paddle's alignment for gpu/npu/xpu, in bytes of the parameter dtype.
ALIGNMENT_BYTES = 256
#: The dtypes a fused buffer may hold (Paddle fuses fp32/fp16/bf16; fp64 for an oracle's
#: precise reference): the one rule, applied by every buffer plan and by ``fused_parameters``
#: before anything is built. Grouping (``eager_assign_group_by_size``) takes any dtype.
#: (the names of ``dtypes.ITEMSIZES``, widest first)
FUSABLE_DTYPES = tuple(sorted(ITEMSIZES, key=lambda name: (-ITEMSIZES[name], name)))

#: ``assign_group_by_size`` default limit (Paddle: 128 MiB).
ASSIGN_GROUP_SIZE = 128 * 1024 * 1024
#: ``fused_parameters`` / ``obtain_storage`` default limit (Paddle: 256 MiB).
FUSED_GROUP_SIZE = 256 * 1024 * 1024

# Paddle's phi::DataType enum order; leftover open groups are emitted in this order
# (it only shows when a tensor_indices permutation skips the final sort).
_PADDLE_DTYPE_ORDER = {
    "bool": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "uint32": 6, "int32": 7,
    "uint64": 8, "int64": 9, "float32": 10, "float64": 11, "complex64": 12, "complex128": 13,
    "float16": 15, "bfloat16": 16,
}


@dataclass(frozen=True)
class TensorMeta:
    """What the planner needs to know of a tensor."""

    name: str
    shape: tuple
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def meta_of(obj: Any) -> TensorMeta:
    """Read name, shape and dtype off anything that has them (Param, ParamSpec, TensorMeta)."""
    if isinstance(obj, TensorMeta):
        return obj
    return TensorMeta(str(obj.name), tuple(obj.shape), obj.dtype)


def _metas(tensors: Iterable[Any]) -> list:
    return [meta_of(t) for t in tensors]


# --------------------------------------------------------------------------- grouping


def eager_assign_group_by_size(
    tensors: Sequence[Any],
    is_sparse_gradient: Sequence[bool],
    group_size_limits: Sequence[int],
    tensor_indices: Optional[Sequence[int]] = None,
) -> list:
    """Paddle's ``core.eager_assign_group_by_size``, rule for rule (see SEMANTICS.md section 1).

    Each dtype keeps one open group; a group closes right after the tensor that brings it to
    ``>= limit``; sparse tensors are singletons; limits advance per dtype and clamp at the last.
    """
    metas = _metas(tensors)
    limits = [int(x) for x in group_size_limits]
    if not limits:
        raise ValueError("group_size_limits: expected at least one limit, got []")
    if len(is_sparse_gradient) != len(metas):
        raise ValueError(f"is_sparse_gradient: expected {len(metas)} flags, "
                         f"got {len(is_sparse_gradient)}")
    if tensor_indices is not None and len(tensor_indices) > 0:
        real = [int(i) for i in tensor_indices]
        if sorted(real) != list(range(len(metas))):
            raise ValueError(f"tensor_indices: expected a permutation of 0..{len(metas) - 1}, "
                             f"got {list(tensor_indices)}")
    else:
        real = None

    groups: list = []
    open_groups: dict = {}  # dtype -> [indices, bytes]
    limit_index: dict = {}
    for i, meta in enumerate(metas):
        index = real[i] if real is not None else i
        if is_sparse_gradient[index]:
            groups.append([index])
            continue
        entry = open_groups.setdefault(meta.dtype, [[], 0])
        entry[0].append(index)
        entry[1] += meta.nbytes
        k = limit_index.setdefault(meta.dtype, 0)
        if entry[1] >= limits[k]:
            groups.append(entry[0])
            open_groups[meta.dtype] = [[], 0]
            limit_index[meta.dtype] = min(k + 1, len(limits) - 1)
    for dtype in sorted(open_groups, key=lambda d: _PADDLE_DTYPE_ORDER.get(d, 99)):
        if open_groups[dtype][0]:
            groups.append(open_groups[dtype][0])
    if real is None:
        groups.sort(key=lambda g: g[0])
    return groups


def group_indices_by_size(tensors: Sequence[Any], group_size: int) -> list:
    """The grouping tensor_fusion_helper uses: dense tensors, limits ``[group_size, group_size]``."""
    if int(group_size) < 0:
        raise ValueError(f"group_size: expected a non-negative number of bytes, got {group_size}")
    return eager_assign_group_by_size(tensors, [False] * len(tensors), [group_size, group_size])


def get_group_size(parameters: Sequence[Any], group_size: int = ASSIGN_GROUP_SIZE) -> list:
    """Per group, the optimizer-state estimate in GiB that Paddle reports.

    Paddle assumes 12 bytes of state per parameter element (fp32 master weight + two Adam
    moments) and expresses it relative to the parameter's own bytes.

    Args:
        parameters: the params (anything with ``name``, ``shape`` and ``dtype``).
        group_size: bytes per group, as in ``assign_group_by_size``.

    Returns:
        One float per group, in group order.
    """
    metas = _metas(parameters)
    sizes = []
    for indices in group_indices_by_size(metas, group_size):
        nbytes = sum(metas[i].nbytes for i in indices)
        sizes.append(nbytes / 1024 ** 3 * 12 / metas[indices[0]].itemsize)
    return sizes


# --------------------------------------------------------------------------- buffer layouts


@dataclass(frozen=True)
class Slot:
    """Where one param lives in a flat buffer, in elements."""

    #: the param's name
    name: str
    #: the param's shape
    shape: tuple
    #: its first element in the buffer
    offset: int
    #: its elements
    numel: int
    #: its elements with the padding after it (alignment, shard rounding)
    padded_numel: int

    @property
    def end(self) -> int:
        """One past the param's last element in the buffer."""
        return self.offset + self.numel

    @property
    def padded_end(self) -> int:
        """One past the param's padding, where the next slot starts."""
        return self.offset + self.padded_numel


@dataclass(frozen=True)
class FlatLayout:
    """Layout of one fused buffer.

    ``nranks`` is None for all-reduce / reduce buffers (``flatten_dense_tensors``), and the
    number of shards for reduce-scatter buffers (``build_reduce_scatter_buffer``).
    ``layout[name]`` is a param's :class:`Slot`; ``name in layout`` says whether it is here.
    """

    #: the params' dtype name
    dtype: str
    #: one :class:`Slot` per param, in buffer order
    slots: tuple
    #: the buffer's elements, padding included
    numel: int
    #: every slot's bytes (in the param dtype) are a multiple of it
    alignment_bytes: int = ALIGNMENT_BYTES
    #: the number of shards (reduce-scatter), else None
    nranks: Optional[int] = None
    _index: dict = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {s.name: s for s in self.slots})

    def __getitem__(self, name: str) -> Slot:
        return self._index[name]

    def __contains__(self, name: str) -> bool:
        return name in self._index

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer in the params' dtype."""
        return self.numel * _itemsize(self.dtype)

    @property
    def padding(self) -> int:
        """Elements that hold no parameter (alignment and shard padding)."""
        return self.numel - sum(s.numel for s in self.slots)

    @property
    def param2offset(self) -> dict:
        """``{name: offset}`` of every param, in elements (Paddle's ``param2offset``)."""
        return {s.name: s.offset for s in self.slots}

    # -- sharding (reduce-scatter buffers only)
    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard (the whole buffer unless sharded)."""
        return self.numel // (self.nranks or 1)

    def shard_range(self, rank: int) -> tuple:
        """``[begin, end)`` of the buffer that ``rank`` owns after reduce-scatter."""
        begin = max(rank, 0) * self.shard_numel
        return begin, begin + self.shard_numel

    def slice_of(self, name: str, rank: int) -> Optional[tuple]:
        """The part of a param's padded slot inside ``rank``'s shard, or None when empty.

        It may include padding, and one param may span several ranks (Paddle's
        ShardingGradView rule).
        """
        slot = self._index[name]
        lo, hi = self.shard_range(rank)
        begin, end = max(slot.offset, lo), min(slot.padded_end, hi)
        return (begin, end) if begin < end else None

    def slices(self, name: str) -> list:
        """:meth:`slice_of` ``name`` for every rank, in rank order."""
        return [self.slice_of(name, r) for r in range(self.nranks or 1)]


def aligned_numel(numel: int, itemsize: int, alignment_bytes: int = ALIGNMENT_BYTES) -> int:
    """``numel`` plus the padding that makes its bytes a multiple of ``alignment_bytes``."""
    remaining = (numel * itemsize) % alignment_bytes
    pad = 0 if remaining == 0 else (alignment_bytes - remaining) // itemsize
    return numel + pad


def sharded_numel(numel: int, itemsize: int, nranks: int,
                  alignment_bytes: int = ALIGNMENT_BYTES) -> int:
    """``numel`` rounded up to a multiple of ``(alignment // itemsize) * nranks`` elements."""
    unit = (alignment_bytes // itemsize) * nranks
    return -(-numel // unit) * unit


def check_fusable(params: Iterable[Any]) -> None:
    """A ``ValueError`` naming the first param whose dtype no fused buffer may hold (an int,
    bool or complex param would reach the collective and fail there, or be summed wrongly)."""
    for obj in params:
        meta = meta_of(obj)
        if meta.dtype not in FUSABLE_DTYPES:
            raise ValueError(f"param '{meta.name}': dtype {meta.dtype} cannot be fused; "
                             f"expected one of {', '.join(FUSABLE_DTYPES)}")


def _check_one_dtype(metas: list) -> str:
    if not metas:
        raise ValueError("params: expected at least one parameter, got none")
    check_fusable(metas)
    dtype = metas[0].dtype
    for m in metas[1:]:
        if m.dtype != dtype:
            raise ValueError(f"param '{m.name}': expected dtype {dtype} like '{metas[0].name}' "
                             f"(one buffer holds one dtype), got {m.dtype}")
    names = set()
    for m in metas:
        if m.name in names:
            raise ValueError(f"param '{m.name}': names must be unique within a buffer")
        names.add(m.name)
    return dtype


def plan_flat(params: Sequence[Any], alignment_bytes: int = ALIGNMENT_BYTES) -> FlatLayout:
    """Layout of ``flatten_dense_tensors``: each param padded to ``alignment_bytes``, in order.

    A fp32 main-grad buffer uses the same element offsets, so param and grad line up.
    """
    metas = _metas(params)
    dtype = _check_one_dtype(metas)
    size = _itemsize(dtype)
    slots, offset = [], 0
    for m in metas:
        padded = aligned_numel(m.numel, size, alignment_bytes)
        slots.append(Slot(m.name, m.shape, offset, m.numel, padded))
        offset += padded
    return FlatLayout(dtype, tuple(slots), offset, alignment_bytes)


def plan_sharded(params: Sequence[Any], nranks: int,
                 alignment_bytes: int = ALIGNMENT_BYTES) -> FlatLayout:
    """Layout of ``build_reduce_scatter_buffer``: every param padded to a multiple of
    ``alignment * nranks`` so that the buffer splits evenly into ``nranks`` shards."""
    if int(nranks) < 1:
        raise ValueError(f"nranks: expected a positive number of ranks, got {nranks}")
    metas = _metas(params)
    dtype = _check_one_dtype(metas)
    size = _itemsize(dtype)
    slots, offset = [], 0
    for m in metas:
        padded = sharded_numel(m.numel, size, nranks, alignment_bytes)
        slots.append(Slot(m.name, m.shape, offset, m.numel, padded))
        offset += padded
    return FlatLayout(dtype, tuple(slots), offset, alignment_bytes, int(nranks))
