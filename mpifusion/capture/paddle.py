"""Paddle capture: every rank's local grads per micro-step (``Tensor.register_hook`` sees a
grad before DataParallel's reducer or a ``FusedCommBuffer``'s ``add_grad`` takes it) and
what the rank holds after the sync.

* DataParallel, or ``FusedCommBuffer`` with ALL_REDUCE / REDUCE: outputs are each param's
  ``grad`` (or ``main_grad``) after ``scale_grads``;
* ``FusedCommBuffer`` with REDUCE_SCATTER: ``record_buffer_outputs(buffer)`` takes each
  param's slice of the rank's shard of the grad buffer, cut as Paddle cuts it (the oracle's
  default, so no range is written); ``record_buffer_shards(buffer)`` before ``sync_params``
  and ``record_params()`` after it capture the param all-gather.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .core import CaptureError, Recorder

__all__ = ["PaddleCapture"]

#: the grad-hook ids PaddleCapture registered on a param: ``(grad node pointer, {ids})``
_OWN_HOOKS = "_mpifusion_capture_hook_ids"

_DTYPES = {"paddle.float32": "float32", "paddle.float16": "float16",
           "paddle.bfloat16": "bfloat16", "paddle.float64": "float64"}


def to_numpy(t: Any, dtype: Optional[str] = None) -> np.ndarray:
    """A numpy copy of a Paddle tensor (bfloat16 as ml_dtypes.bfloat16)."""
    arr = np.array(t.numpy(), copy=True)
    if (dtype or dtype_name(t)) == "bfloat16" and arr.dtype == np.uint16:
        import ml_dtypes

        arr = arr.view(ml_dtypes.bfloat16)
    return arr


def dtype_name(t: Any) -> str:
    name = _DTYPES.get(str(t.dtype))
    if name is None:
        raise CaptureError(f"dtype {t.dtype}: not a float dtype the oracle checks")
    return name


class PaddleCapture(Recorder):
    """Record a Paddle data-parallel gradient step for the oracle.

    ``PaddleCapture(layer_or_params)`` before the first backward (a ``paddle.nn.Layer``:
    names from ``named_parameters``; a list of params, e.g. a buffer's: their ``.name``, as
    ``FusedCommBuffer`` keys them); run ``acc_steps`` backwards; ``record_outputs()`` after
    ``scale_grads`` (or DataParallel's backward); then ``to_dict()``, ``gather()``,
    ``save(dir)``, ``spec()``. ``attr="main_grad"`` reads fp32 main grads as the output.

    Args:
        params: a ``paddle.nn.Layer`` or a list of params; those with ``stop_gradient``
            are left out.
        rank: this rank (default: paddle.distributed's, else 0).
        nranks: the number of ranks (default: paddle.distributed's world size, else 1).
        attr: the param attribute read as the synced output.
    """

    def __init__(self, params: Any, *, rank: Optional[int] = None,
                 nranks: Optional[int] = None, attr: str = "grad") -> None:
        import paddle.distributed as dist

        ready = dist.is_initialized()
        super().__init__(rank if rank is not None else (dist.get_rank() if ready else 0),
                         nranks if nranks is not None else (dist.get_world_size() if ready
                                                            else 1))
        if hasattr(params, "named_parameters"):
            named = list(params.named_parameters())
        else:
            named = [(p.name, p) for p in params]
        self._attr = attr
        self._params: dict = {}
        self._handles: list = []
        try:
            for name, p in named:
                if p.stop_gradient:
                    continue
                self._params[name] = p
                self.declare(name, tuple(p.shape), dtype_name(p))
                self._hook(name, p)
        except BaseException:
            self.remove()  # a refused capture leaves no hook behind
            raise

    def _hook(self, name: str, p: Any) -> None:
        """Register the capture's grad hook on ``p``, refusing a param whose grad node had
        gradient hooks registered before ours (other than earlier captures').

        Paddle runs a grad node's gradient hooks in the order of their ids, which count up
        per node from 0 and are never reused (``_register_grad_hook`` returns it), but shows
        no list of them: an id above 0 means hooks were registered before ours and run
        first. One that all-reduces (a hand-written data-parallel hook) would make every
        rank record the reduced grad, which any reduction then matches;
        one that scales or moves the grad (group-sharded scaling, ``MixPrecisionLayer``'s
        main-grad hook) changes what is recorded as the local grad. DataParallel's reducer
        and ``_register_backward_hook`` (FusedCommBuffer) run after the grad hooks and take
        no id."""
        handle = p.register_hook(self._make_hook(name, dtype_name(p)))
        self._handles.append(handle)
        hook_id = getattr(handle, "_hook_id", None)
        node = getattr(p, "grad_fn", None)
        node_ptr = node.node_ptr() if node is not None and hasattr(node, "node_ptr") else None
        if isinstance(hook_id, bool) or not isinstance(hook_id, int) or node_ptr is None:
            raise CaptureError(f"rank {self.rank}: {name}: cannot tell whether the param has "
                               f"gradient hooks that run before the capture's (this Paddle's "
                               f"register_hook gave no hook id or grad node); expected Paddle "
                               f"3.x")
        own = getattr(p, _OWN_HOOKS, None)
        own_ids = own[1] if isinstance(own, tuple) and own[0] == node_ptr else set()
        earlier = [i for i in range(hook_id) if i not in own_ids]
        own_ids = set(own_ids) | {hook_id}
        try:
            setattr(p, _OWN_HOOKS, (node_ptr, own_ids))
        except (AttributeError, TypeError):  # then a later capture on p is refused: stricter
            pass
        if earlier:
            raise CaptureError(
                f"rank {self.rank}: {name}: the param already has gradient hooks "
                f"({len(earlier)} registered before the capture's, hook id(s) "
                f"{', '.join(map(str, earlier[:6]))}{' ...' if len(earlier) > 6 else ''}), "
                f"which would run before the capture's and change what it records as the "
                f"local grad; expected none: create the capture before registering them "
                f"(Paddle cannot show whether they were removed since; DataParallel and "
                f"FusedCommBuffer are fine either way)")

    def _make_hook(self, name: str, dtype: str) -> Any:
        def hook(grad: Any) -> None:
            self.add_input(name, to_numpy(grad, dtype))
        return hook

    def remove(self) -> None:
        """Remove every hook this capture installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _name_of(self, p: Any) -> str:
        for name, q in self._params.items():
            if q is p or q.name == p.name:
                return name
        raise CaptureError(f"rank {self.rank}: {p.name}: not a param of this capture")

    def record_outputs(self) -> None:
        """Read what the sync left in each param's ``grad`` (or ``attr``), full shape. A
        missing grad raises in ``gather()``, on every rank, not here on one."""
        self._read_outputs(self._params, self._attr, "clear_grad", lambda name, p, g:
                           self.set_output(name, to_numpy(g).reshape(tuple(p.shape))))

    def record_buffer_outputs(self, buffer: Any) -> None:
        """A REDUCE_SCATTER ``FusedCommBuffer``: each param's slice of this rank's shard of
        the grad buffer (padding included), as the oracle cuts by default."""
        storage = buffer.grad_storage
        for p in buffer.params:
            view = buffer._sharding_param_grad_view[p.name]
            begin, end = view._param_begin, view._param_end
            if begin < end:
                self.set_output(self._name_of(p), to_numpy(storage._slice(begin, end)))

    def record_buffer_shards(self, buffer: Any) -> None:
        """Before ``sync_params``: each param's slice of this rank's shard of the param buffer."""
        storage = buffer.param_storage
        for p in buffer.params:
            view = buffer._sharding_param_grad_view[p.name]
            begin, end = view._param_begin, view._param_end
            if begin < end:
                self.set_shard(self._name_of(p), to_numpy(storage._slice(begin, end)))

    def record_params(self) -> None:
        """After the all-gather: every param's full value."""
        for name, p in self._params.items():
            self.declare(name, tuple(p.shape), dtype_name(p))
            self.set_param(name, to_numpy(p).reshape(tuple(p.shape)))

    def gather(self, dst: int = 0) -> Optional[list]:
        """Every rank's ``to_dict()``, in rank order, on every rank (Paddle's
        ``all_gather_object``; ``dst`` kept for symmetry with TorchCapture: None elsewhere).
        When a rank's record is inconsistent, or a param has grads on some ranks and not
        others, every rank raises the same :class:`CaptureError`."""
        import paddle.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [self.to_dict()]

        def all_gather(obj: Any) -> list:
            every: list = []
            dist.all_gather_object(every, obj)
            return every

        # every rank first learns whether every record is sound: one rank raising alone
        # would leave the others in all_gather_object for ever
        mine = self._to_dict_agreed(all_gather)
        out: list = []
        dist.all_gather_object(out, mine)
        return out if dist.get_rank() == dst else None
