"""What a check-in does with one param's grad: check it, see whether it is already in place,
move it into the grad buffer (``release_grads``), and put all of it back when the
communication the check-in starts is refused.

A mixin of ``FusedCommBuffer``, as ``ShardedParams`` is: these methods read and write the
buffer's grad views and grad storage, kept apart from its state machine and collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

from ..arrays import backend
from ..dtypes import as_dtype
from ..errors import GradError, error_context
from ..plan.actions import HookAction
from .param import Param
from .storage import grad_of, set_grad, slot_view


@dataclass
class GradSnapshot:
    """What a check-in may change for some params (their grad slots' values, grad
    references and views, the grad buffer it may allocate, the counters): taken before a
    check-in that may start communication, so that a refusal before the collective started
    (``NanInfError``) leaves everything exactly as it was. Taken only when that can happen
    (``check_naninf``): it copies the params' slots."""

    storage: Any
    is_shard: bool
    steps: Dict[str, int]
    count: int
    items: List[tuple]


class GradIntake:
    """Checks and moves of the grads handed to ``add_grad``/``mark_unused``."""

    def _unalias(self, param: Param, grad: Any) -> Any:
        """A grad that *is* the param's own grad view (``add_grad(p, grad=p.grad)`` after
        backward wrote into it) is already in place: None, so it is checked in without being
        added again. One that overlaps the grad buffer any other way is refused."""
        for own in (self._grad_view.get(param.name),
                    backend.shared_array(grad_of(param, self.use_main_grad))):
            if own is None:
                continue
            if backend.same_view(own, grad):
                return None
            if backend.overlaps(grad, own):
                raise GradError(f"{self._where()}: param '{param.name}': grad overlaps part of "
                                f"its own grad view; expected the view itself (already in "
                                f"place) or a separate array")
        storage = self.grad_storage
        if storage is not None and backend.overlaps(grad, storage):
            raise GradError(f"{self._where()}: param '{param.name}': grad lies in this "
                            f"buffer's grad storage outside the param's own slot (another "
                            f"param's grad?); expected a separate array")
        return grad

    def _check_grad(self, param: Param, grad: Any) -> Any:
        # a TypeError is asarray's one way to say it cannot import grad
        with error_context(f"{self._where()}: param '{param.name}': grad", TypeError,
                           kind=GradError):
            g = backend.asarray(grad)
        if tuple(g.shape) != param.shape:
            raise GradError(f"{self._where()}: param '{param.name}': grad shape expected "
                            f"{param.shape}, got {tuple(g.shape)}")
        if g.dtype != self._grad_dtype and g.dtype != as_dtype(param.dtype):
            raise GradError(f"{self._where()}: param '{param.name}': grad dtype expected "
                            f"{self._grad_dtype.name}, got {g.dtype}")
        if backend.device_of(g) != param.device:
            raise GradError(f"{self._where()}: param '{param.name}': grad device expected "
                            f"{param.device}, got {backend.device_of(g)}")
        return g

    def _check_grad_moved(self, param: Param, given: Any) -> None:
        """Raise unless ``given`` (the param's grad now, another object than the view it was
        fused with) is that same view: same address, shape, dtype and strides (a torch
        tensor over it is; a transposed or reshaped view at the same address is not)."""
        fused = self._grad_view[param.name]
        kind = "main_grad" if self.use_main_grad else "grad"
        arr = backend.shared_array(given)
        if arr is None or fused is None or backend.data_ptr(arr) != backend.data_ptr(fused):
            raise GradError(
                f"{self._where()}: param '{param.name}': the address of its {kind} changed "
                f"since it was fused (expected the view into the grad buffer). Accumulate in "
                f"place (g += x, g[...] = x) instead of rebinding it (g = g + x, clear_grad)")
        if not backend.same_view(arr, fused):
            raise GradError(
                f"{self._where()}: param '{param.name}': its {kind} is at the address of its "
                f"view but is not the view (shape {tuple(arr.shape)}, dtype {arr.dtype}, "
                f"strides {arr.strides}; expected shape {tuple(fused.shape)}, dtype "
                f"{fused.dtype}, strides {fused.strides}). Accumulate into the view itself "
                f"(g[...] = x) instead of rebinding it to another view")

    def _own_grad(self, param: Param) -> Any:
        """release_grads: the param's own grad as an array, checked to fit its slot (before
        anything is moved); a torch tensor with a lazy bit is resolved (read once)."""
        own = grad_of(param, self.use_main_grad)
        return None if own is None else self._check_grad(param, own)

    def _copy_grad_to_buffer(self, param: Param, grad: Any) -> None:
        """release_grads, first micro-step: move the param's own grad into a (new) buffer."""
        own = self._own_grad(param)  # before anything is allocated or moved
        if self.grad_storage is None or self._grads_are_shard:
            # none yet, or last step's reduce-scattered shard (free_grads_in_comm): a full one
            self.grad_storage = self._memory.zeros("grad", self.buffer_size, self._grad_dtype,
                                                   self._like)
            self._grads_are_shard = False
        link = not self.options.free_grads_in_comm
        if self.options.act == HookAction.REDUCE_SCATTER:
            view = self._sharding_param_grad_view[param.name].attach_grad_buffer(
                self.grad_storage, link_param=False)
        else:
            view = slot_view(self.grad_storage, self.layout[param.name])
        # a grad still viewing this very slot (grad buffer kept from the last step) is
        # already in it: adding it again would count it twice
        if own is not None and backend.data_ptr(own) != backend.data_ptr(view):
            view += own.reshape(view.shape)
        if grad is not None:
            view += grad
        set_grad(param, self.use_main_grad, view if link else None)
        self._grad_view[param.name] = view if link else None

    def _snapshot(self, params: Sequence[Param]) -> GradSnapshot:
        storage = self.grad_storage
        full = storage is not None and not self._grads_are_shard
        items = []
        for p in params:
            slot = self.layout[p.name]
            view = self._sharding_param_grad_view.get(p.name)
            items.append((
                p, slot, grad_of(p, self.use_main_grad), self._grad_view[p.name],
                None if view is None else (view, view.grad_buffer, view.slice_grad),
                storage[slot.offset:slot.end].copy() if full else None))
        return GradSnapshot(storage, self._grads_are_shard, dict(self._checkin.steps),
                            self._checkin.count, items)

    def _restore(self, snap: GradSnapshot) -> None:
        for p, slot, grad, grad_view, sharding, values in snap.items:
            if values is not None:
                snap.storage[slot.offset:slot.end] = values
            set_grad(p, self.use_main_grad, grad)
            self._grad_view[p.name] = grad_view
            if sharding is not None:
                view, view.grad_buffer, view.slice_grad = sharding
        self.grad_storage = snap.storage
        self._grads_are_shard = snap.is_shard
        self._checkin.undo(snap.steps, snap.count)
