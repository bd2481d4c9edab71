"""Flat buffers and the views into them: Paddle's ``flatten_dense_tensors`` and
``build_reduce_scatter_buffer``.

A layout is planned first (``layout.py``), then the buffers are allocated once and every
param's data and grad become views of its slot, so frameworks write straight into them.
"""
from __future__ import annotations

import gc
import logging
import sys
import threading
from typing import Any, List, Optional, Sequence

from mpi4py import MPI

from ..arrays import backend
from ..comm.shm import punch, refill
from ..errors import LayoutError, error_context
from ..plan.grouping import grad_dtype_for
from ..plan.layout import FlatLayout, Slot, plan_flat, plan_sharded
from .param import Param

logger = logging.getLogger("mpifusion")


def world_rank() -> int:
    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0


def grad_of(param: Param, use_main_grad: bool) -> Any:
    return param.main_grad if use_main_grad else param.grad


def set_grad(param: Param, use_main_grad: bool, value: Any) -> None:
    if use_main_grad:
        param.main_grad = value
    else:
        param.grad = value


def check_trainable(params: Sequence[Param], rank: int) -> None:
    """Only trainable params are fused; as in Paddle, ``trainable`` is ``not stop_gradient``."""
    for p in params:
        if not p.trainable:
            raise LayoutError(f"rank {rank}: param '{p.name}': expected a trainable param "
                              f"(only trainable params are fused), got trainable=False "
                              f"(stop_gradient=True)")


def check_has_data(params: Sequence[Param], rank: int, where: str = "") -> None:
    """Every param to fuse must hold its data: one released by a reduce-scatter buffer's
    ``clear_param_storage`` has none (copying it into a fused buffer would give NaN)."""
    for p in params:
        if p.data is None:
            raise LayoutError(f"{where or f'rank {rank}'}: param '{p.name}': has no data (released "
                              f"by clear_param_storage() of the buffer that holds it); expected "
                              f"its data: reset_param_storage() and sync_params() on that "
                              f"buffer first")


def device_template(params: Sequence[Param]) -> Any:
    """An empty array on the params' device (numpy or cupy, same GPU): what every later
    allocation of a buffer is made ``like``, so it never depends on arrays that come and go
    (``param.data`` after ``clear_param_storage``, the grad buffer after ``clear_grad_storage``
    or with ``release_grads``)."""
    return backend.empty(0, params[0].data.dtype, params[0].data)


def plan_or_raise(plan_fn, params, *args, rank: int) -> FlatLayout:
    with error_context(f"rank {rank}", ValueError, kind=LayoutError):
        return plan_fn(params, *args)


def slot_view(buffer: Any, slot: Slot) -> Any:
    """A param-shaped view of ``slot`` in a flat buffer."""
    return buffer[slot.offset:slot.end].reshape(slot.shape)


def adopt_data(param: Param, view: Any, copy: bool) -> None:
    """Make ``param.data`` the view (copying its values in first when ``copy``)."""
    if copy:
        view[...] = param.data
    param.data = view


def adopt_grad(param: Param, use_main_grad: bool, view: Any) -> None:
    """Make the param's grad (or main_grad) the (zero) view: a grad it held before is
    dropped, as in Paddle, whose grad buffers start at zero."""
    set_grad(param, use_main_grad, view)


def _unused_probe() -> int:
    probe = {"region": object()}
    return sys.getrefcount(probe["region"])


#: the reference count of an array held only by ``BufferMemory.regions`` (measured the way
#: ``release`` measures, so it holds on any Python version)
_UNUSED_REFS = _unused_probe()


class BufferMemory:
    """Where a buffer's flat storage comes from: fresh arrays (``backend.zeros``), or, with
    the ``shm`` strategy, the regions of the node's shared arena the communicator reserved at
    construction (``Communicator.reserve``: zero, their pages reserved), handed out zeroed on
    every (re)allocation. A region stays the buffer's for its lifetime, but
    ``release_grads``, ``clear_grad_storage``, ``clear_param_storage`` and dropping the
    buffer (``FusedCommBuffer.__del__``) give its pages back (:meth:`release`), so the
    memory behaves as with fresh arrays; a region whose pages went back has them reserved
    again (``shm.refill``) before it is handed out, or -- /dev/shm full by then -- the
    buffer gets a fresh private array instead (a warning; its collectives stage it), never a
    region whose first write would be SIGBUS."""

    def __init__(self, param: Any = None, grad: Any = None) -> None:
        self.regions = {"param": param, "grad": grad}
        #: regions that read as zeros already (fresh, or their pages given back)
        self.zeroed = {"param": param is not None, "grad": grad is not None}
        #: regions whose pages were given back (:func:`punch`): reserved again before reuse
        self.punched = {"param": False, "grad": False}

    def zeros(self, which: str, numel: int, dtype: Any, like: Any) -> Any:
        """``numel`` zeros of ``dtype`` for the ``which`` ("param"/"grad") storage."""
        region = self.regions[which]
        if region is None or region.size != numel or region.dtype != dtype:
            return backend.zeros(numel, dtype, like)
        if self.punched[which]:
            why = refill(region)
            if why:
                logger.warning("rank %d: %s storage: its shared-memory region cannot be "
                               "reused (%s): using private memory, its collectives stage it "
                               "through the stream's scratch", world_rank(), which, why)
                return backend.zeros(numel, dtype, like)
            self.punched[which] = False
        if not self.zeroed[which]:
            region[...] = 0
        self.zeroed[which] = False
        return region

    def release(self, which: str) -> bool:
        """The buffer dropped its ``which`` storage: give the region's pages back, unless
        an array of it is still alive (a grad or param the user kept: it keeps its values,
        as a dropped fresh array would, until the next allocation zeroes the region). True
        where the region is unused now (its pages went back where the system allows: a
        window in private memory keeps them), False while an array of it is alive."""
        if self.regions[which] is None or self.zeroed[which]:
            return True
        if sys.getrefcount(self.regions[which]) > _UNUSED_REFS:
            return False
        self.zeroed[which] = self.punched[which] = punch(self.regions[which])
        return True

    def release_all(self) -> bool:
        """:meth:`release` both regions; True where neither is in use any more."""
        grad, param = self.release("grad"), self.release("param")
        return grad and param


#: memories of dropped buffers whose regions were still referenced when the buffer went
#: (objects of the same garbage cycle live until the collector frees them, or a user keeps
#: an array): tried again after each garbage collection
_DROPPED: List[BufferMemory] = []
#: re-entrant: a collection (and so the retry) may start inside ``buffer_dropped``
_DROPPED_LOCK = threading.RLock()


def _retry_dropped(phase: str, info: dict) -> None:
    if phase != "stop" or not _DROPPED or sys.is_finalizing():
        return
    try:
        with _DROPPED_LOCK:
            _DROPPED[:] = [m for m in _DROPPED if not m.release_all()]
    except Exception:  # interpreter shutdown under way: nothing to give back to
        pass


def buffer_dropped(memory: BufferMemory) -> None:
    """A buffer is being finalised: give its regions' pages back now, or after the garbage
    collection that frees its last arrays (never while a user keeps one)."""
    if memory.release_all():
        return
    with _DROPPED_LOCK:
        if _retry_dropped not in gc.callbacks:
            gc.callbacks.append(_retry_dropped)
        _DROPPED.append(memory)


#: fresh arrays for every allocation (no reserved regions)
FRESH = BufferMemory()


def flatten_dense_tensors(
    parameters: Sequence[Param],
    use_main_grad: bool = False,
    fuse_param: bool = True,
    warp_buffer: bool = False,
    release_grad: bool = False,
    *,
    layout: Optional[FlatLayout] = None,
    memory: BufferMemory = FRESH,
):
    """Fuse params (optional) and grads into 256-byte-aligned flat buffers.

    Returns ``(param_buffer, grad_buffer)`` with ``fuse_param``, else ``(grad_buffer,)``;
    with ``release_grad`` it only plans: ``(None, total_numel, param2offset)``.
    ``warp_buffer`` is accepted for Paddle compatibility; numpy buffers need no wrapping.
    ``layout``: the plan of ``parameters`` when the caller already made it (planned once);
    ``memory``: where the buffers are allocated.

    Args:
        parameters: the params, one dtype, in buffer order; their data (with
            ``fuse_param``) and grads become views of the buffers.
        use_main_grad: the grad buffer in fp32 for half-precision params (their
            ``main_grad``).
        fuse_param: also fuse the params' data (copied in).
        warp_buffer: ignored (Paddle's).
        release_grad: plan only, allocate nothing.
        layout: the plan, if already made.
        memory: where the buffers are allocated (fresh arrays by default).

    Raises:
        LayoutError: params that cannot share a buffer (dtypes, names, no data, not
            trainable).
    """
    if layout is None:
        rank = world_rank()
        check_trainable(parameters, rank)
        layout = plan_or_raise(plan_flat, parameters, rank=rank)
    if release_grad:
        return None, layout.numel, layout.param2offset
    check_has_data(parameters, world_rank())
    like = parameters[0].data
    outputs = ()
    if fuse_param:
        param_buffer = memory.zeros("param", layout.numel, layout.dtype, like)
        for p in parameters:
            adopt_data(p, slot_view(param_buffer, layout[p.name]), copy=True)
        outputs = (param_buffer,)
    grad_buffer = memory.zeros("grad", layout.numel,
                               grad_dtype_for(layout.dtype, use_main_grad), like)
    for p in parameters:
        adopt_grad(p, use_main_grad, slot_view(grad_buffer, layout[p.name]))
    return outputs + (grad_buffer,)


class ShardingGradView:
    """One param's place in a reduce-scatter buffer, and its slice on this rank.

    Made by :func:`build_reduce_scatter_buffer` (``buffer._sharding_param_grad_view``, as in
    Paddle); it points the param's data and grad at the buffers and keeps the slice of this
    rank's shard that the optimizer updates.

    Args:
        param: the param.
        layout: the buffer's plan (sharded).
        rank: this rank: which shard the slice is cut from.
        param_buffer: the flat param buffer (the param's data is copied into its slot).
        grad_buffer: the flat grad buffer (None with ``release_grad``).
        use_main_grad: point the param's ``main_grad`` (not ``grad``) at the grad buffer.
        release_grad: no grad buffer yet (:meth:`attach_grad_buffer` later).
    """

    def __init__(self, param: Param, layout: FlatLayout, rank: int, param_buffer: Any,
                 grad_buffer: Any, use_main_grad: bool = False, release_grad: bool = False) -> None:
        self.param = param
        self.slot = layout[param.name]
        self._use_main_grad = use_main_grad
        self.rank_begin, _ = layout.shard_range(rank)
        piece = layout.slice_of(param.name, rank)
        self.param_begin, self.param_end = piece if piece else (0, 0)
        self._param_buffer = param_buffer
        self.grad_buffer = None
        self.slice_grad = None
        if not release_grad:
            self.attach_grad_buffer(grad_buffer, link_param=True)
        self.share_param_buffer(param_buffer, copy=True)

    @property
    def has_effective_slice_param(self) -> bool:
        """Whether any of the param's padded slot lies in this rank's shard."""
        return self.param_begin < self.param_end

    def attach_grad_buffer(self, grad_buffer: Any, link_param: bool) -> Any:
        """Point this view at a (full) grad buffer; returns the param's full grad view.

        Args:
            grad_buffer: the full flat grad buffer.
            link_param: make the param's grad (or main grad) that view too.
        """
        self.grad_buffer = grad_buffer
        self.slice_grad = (grad_buffer[self.param_begin:self.param_end]
                           if self.has_effective_slice_param else None)
        view = slot_view(grad_buffer, self.slot)
        if link_param:
            adopt_grad(self.param, self._use_main_grad, view)
        return view

    def share_param_buffer(self, param_buffer: Any, copy: bool) -> None:
        """Make the param's data the view of its slot in ``param_buffer``.

        Args:
            param_buffer: the flat param buffer.
            copy: copy the param's current data into the slot first (False: a fresh
                buffer whose values come from ``sync_params``).
        """
        self._param_buffer = param_buffer
        adopt_data(self.param, slot_view(param_buffer, self.slot), copy)

    def clear_param_buffer(self) -> None:
        """``clear_param_storage``: a buffer kept here would keep all of its memory."""
        self._param_buffer = None

    def fill_slice_param(self, slice_param: Param) -> None:
        """Make ``slice_param.data`` the 1-D view of this rank's piece of the param buffer.

        Args:
            slice_param: the param to fill (empty, or of the slice's size).

        Raises:
            LayoutError: ``slice_param`` has data of another size.
        """
        size = self.param_end - self.param_begin
        if slice_param.data is not None and slice_param.numel not in (0, size):
            raise LayoutError(f"slice param '{slice_param.name}' of '{self.param.name}': "
                              f"expected {size} elements, got {slice_param.numel}")
        slice_param.data = self._param_buffer[self.param_begin:self.param_end]

    def assign_slice_grad(self, slice_param: Param) -> None:
        """Point ``slice_param``'s data and grad at this rank's slice (nothing when the param
        has no slice here).

        Args:
            slice_param: the param the optimizer updates in place of the shard.

        Raises:
            LayoutError: ``slice_param`` has data of another size.
        """
        if self.slice_grad is None:
            return
        self.fill_slice_param(slice_param)
        set_grad(slice_param, self._use_main_grad, self.slice_grad)

    def reset_grad_buffer(self, shard_buffer: Any) -> None:
        """After ``free_grads_in_comm``, the slice lives in the shard-sized buffer.

        Args:
            shard_buffer: this rank's shard of the grads (its first element is the shard's).
        """
        self.grad_buffer = shard_buffer
        self.slice_grad = (shard_buffer[self.param_begin - self.rank_begin:
                                        self.param_end - self.rank_begin]
                           if self.has_effective_slice_param else None)

    def clear_grad_buffer(self) -> None:
        """Forget the grad buffer (``clear_grad_storage``): a kept one would stay alive."""
        self.grad_buffer = None
        self.slice_grad = None


def build_reduce_scatter_buffer(
    parameters: Sequence[Param],
    sharding_degree: int,
    rank: int,
    use_main_grad: bool = False,
    release_grad: bool = False,
    init_slice_param: bool = False,
    slice_params: Optional[dict] = None,
    *,
    layout: Optional[FlatLayout] = None,
    memory: BufferMemory = FRESH,
):
    """Fuse params and grads into a buffer padded to split evenly over ``sharding_degree``.

    Returns ``(views, total_numel, param_buffer, grad_buffer, param_buffer_ipc_meta)``, where
    ``views`` maps each param name to its ``ShardingGradView``.

    Args:
        parameters: the params, one dtype, in buffer order.
        sharding_degree: the number of ranks (shards).
        rank: this rank: which shard its slices come from.
        use_main_grad: the grad buffer in fp32 for half-precision params.
        release_grad: no grad buffer yet (``grad_buffer`` is None).
        init_slice_param: fill each param's entry of ``slice_params`` with its slice.
        slice_params: ``{name: Param}`` for ``init_slice_param`` (every param with a
            slice on this rank).
        layout: the plan, if already made.
        memory: where the buffers are allocated (fresh arrays by default).

    Raises:
        LayoutError: params that cannot share a buffer, or a missing ``slice_params`` entry.
    """
    if layout is None:
        check_trainable(parameters, rank)
        layout = plan_or_raise(plan_sharded, parameters, sharding_degree, rank=rank)
    check_has_data(parameters, rank)
    slice_params = {} if slice_params is None else slice_params
    if init_slice_param:
        for p in parameters:
            if layout.slice_of(p.name, rank) and p.name not in slice_params:
                raise LayoutError(f"rank {rank}: slice_params: expected an entry for param "
                                  f"'{p.name}' (it has a slice on this rank)")
    like = parameters[0].data
    param_buffer = memory.zeros("param", layout.numel, layout.dtype, like)
    grad_buffer = None if release_grad else memory.zeros(
        "grad", layout.numel, grad_dtype_for(layout.dtype, use_main_grad), like)
    views = {}
    for p in parameters:
        view = ShardingGradView(p, layout, rank, param_buffer, grad_buffer,
                                use_main_grad=use_main_grad, release_grad=release_grad)
        if init_slice_param and view.has_effective_slice_param:
            view.fill_slice_param(slice_params[p.name])
        views[p.name] = view
    return views, layout.numel, param_buffer, grad_buffer, backend.ipc_handle(param_buffer)
