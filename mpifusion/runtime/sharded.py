"""The param side of a REDUCE_SCATTER buffer: each rank owns a shard of the params, and
``sync_params`` all-gathers the (optimizer-updated) shards back into the full params.

A mixin of ``FusedCommBuffer``: the same object Paddle's code calls, with the sharded-param
lifecycle (READY -> SHARDED -> SYNCING -> READY) kept in one place.
"""
from __future__ import annotations

import enum
from typing import Optional

from ..comm import CommTask
from ..errors import CommError, LayoutError, StateError
from ..plan.actions import HookAction
from .options import check_switch
from .param import Param


class ShardedParams:
    """Status and all-gather of the param shards (uses the buffer's comm, layout, views)."""

    class Status(enum.Enum):
        """What the param buffer of a reduce-scatter buffer holds (``buffer.status``)."""

        #: only this rank's shard of the params is valid
        SHARDED = enum.auto()
        #: ``sync_params`` is in flight
        SYNCING = enum.auto()
        #: full params valid
        READY = enum.auto()

    # ------------------------------------------------------------------ reduce-scatter params
    def _require_sharded(self, what: str) -> None:
        if self.options.act != HookAction.REDUCE_SCATTER:
            raise LayoutError(f"{self._where()}: {what}: expected a REDUCE_SCATTER buffer, "
                              f"got {self.options.act.name}")

    def assign_slice_grad(self, param: Param, slice_param: Param) -> None:
        """Point ``slice_param`` at this rank's slice of ``param`` (data and reduced grad).

        So an optimizer that updates only this rank's shard sees it as a param of its own.

        Args:
            param: one of this buffer's params.
            slice_param: the :class:`Param` that becomes the 1-D slice.

        Raises:
            LayoutError: not a ``REDUCE_SCATTER`` buffer.
            GradError: ``param`` is not one of this buffer's params.
            StateError: the param buffer was cleared (``reset_param_storage()`` first).
        """
        self._require_sharded("assign_slice_grad")
        self._checkin.steps_of(param)  # GradError unless one of this buffer's Param objects
        if self.param_storage is None:
            raise StateError(f"{self._where()}: assign_slice_grad: the param buffer was "
                             f"cleared; expected reset_param_storage() first")
        self._sharding_param_grad_view[param.name].assign_slice_grad(slice_param)

    def sync_params(self, sync: bool = True, param2task: Optional[dict] = None) -> Optional[CommTask]:
        """All-gather every rank's shard of the param buffer back into the full buffer.

        ``sync=False`` returns the task and records it in ``param2task`` for every param;
        with ``sync=True`` ``param2task`` is ignored, as in Paddle.

        Args:
            sync: wait for the all-gather before returning.
            param2task: a dict to record the task in, ``{name: task}`` (``sync=False``).

        Returns:
            The :class:`~mpifusion.CommTask` with ``sync=False``; else None (also when there
            is nothing to gather: one rank, or every param has stop_gradient).

        Raises:
            LayoutError: not a ``REDUCE_SCATTER`` buffer.
            StateError: the param buffer was cleared, or ``param2task`` already holds a
                task for a param.
            CommTimeoutError: ``sync=True`` and the all-gather did not finish in time.
        """
        sync = check_switch(sync, f"{self._where()}: sync_params: sync")
        if not self.need_reduce_scale_sync():
            return None
        self._require_sharded("sync_params")
        if self.param_storage is None:
            raise StateError(f"{self._where()}: sync_params: the param buffer was cleared; "
                            f"expected reset_param_storage() first")
        if not sync and param2task is not None:
            taken = [p.name for p in self._params if p.name in param2task]
            if taken:
                raise StateError(f"{self._where()}: param2task: params already have a sync "
                                f"task: {', '.join(taken)}")
        if self.nranks == 1:
            return None
        seq = self._start_collective()
        task = self._comm.allgather_inplace(self.param_storage,
                                            name=f"buffer {self._id} sync_params",
                                            tag=(self._id, self._step))
        self.status = self.Status.SYNCING
        task.add_done_callback(self._mark_ready)
        task.context = lambda: self._late_ranks(seq)  # the task's own wait() names them too
        if sync:
            try:
                self._wait_task(task, "sync_params", seq)
            except CommError:
                self.sync_param_task = task  # still pending: stays SYNCING, waitable again
                raise
            return None
        self.sync_param_task = task
        if param2task is not None:
            for p in self._params:
                param2task[p.name] = self.sync_param_task
        return self.sync_param_task

    def _mark_ready(self) -> None:
        self.status = self.Status.READY

    # ------------------------------------------------------------------ storage lifetime
    def _refuse_syncing(self, what: str) -> None:
        """The all-gather of sync_params writes into the param buffer until it completes: a
        buffer cleared or replaced under it would be READY afterwards with zeros."""
        task = self.sync_param_task
        if self.status == self.Status.SYNCING and task is not None and not task.is_completed():
            raise StateError(f"{self._where()}: {what}: sync_params is still in flight (status "
                            f"SYNCING: the all-gather writes into the param buffer); expected "
                            f"its task's wait() (or sync_params(sync=True)) first. Nothing "
                            f"was changed")

    def clear_param_storage(self) -> None:
        """Release the param buffer (reduce-scatter): params have no data until reset.
        Refused while ``sync_params`` is in flight (SYNCING).

        Raises:
            LayoutError: not a ``REDUCE_SCATTER`` buffer.
            StateError: ``sync_params`` is in flight.
        """
        self._require_sharded("clear_param_storage")
        self._refuse_syncing("clear_param_storage")
        self.param_storage = None
        for p in self._params:
            p.data = None
            self._sharding_param_grad_view[p.name].clear_param_buffer()
        self._memory.release("param")
        self.status = self.Status.SHARDED

    def reset_param_storage(self) -> None:
        """A fresh param buffer, re-viewed by every param; valid again after sync_params.
        Refused while ``sync_params`` is in flight (SYNCING).

        Raises:
            LayoutError: not a ``REDUCE_SCATTER`` buffer.
            StateError: ``sync_params`` is in flight.
        """
        self._require_sharded("reset_param_storage")
        self._refuse_syncing("reset_param_storage")
        # like the device template recorded at construction: grad_storage is None with
        # release_grads or after clear_grad_storage, and would give a host buffer
        self.param_storage = self._memory.zeros("param", self.buffer_size, self.layout.dtype,
                                                self._like)
        for p in self._params:
            self._sharding_param_grad_view[p.name].share_param_buffer(self.param_storage,
                                                                      copy=False)
        self.status = self.Status.SHARDED

    # Paddle's private names, for code ported from tensor_fusion_helper
    _clear_param_storage = clear_param_storage
    _reset_param_storage = reset_param_storage
