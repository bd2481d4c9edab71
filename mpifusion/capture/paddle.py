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
    ``save(dir)``, ``spec()``. ``attr="main_grad"`` reads fp32 main grads as the output."""

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
        for name, p in named:
            if p.stop_gradient:
                continue
            self._params[name] = p
            self.declare(name, tuple(p.shape), dtype_name(p))
            self._handles.append(p.register_hook(self._make_hook(name, dtype_name(p))))

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
        """Read what the sync left in each param's ``grad`` (or ``attr``), full shape."""
        for name, p in self._params.items():
            if not self._inputs[name]:
                continue
            g = getattr(p, self._attr, None)
            if g is None:
                raise CaptureError(f"rank {self.rank}: {name}: .{self._attr} is None after the "
                                   f"sync (call record_outputs before clear_grad)")
            self.set_output(name, to_numpy(g).reshape(tuple(p.shape)))

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
        ``all_gather_object``; ``dst`` kept for symmetry with TorchCapture: None elsewhere)."""
        import paddle.distributed as dist

        mine = self.to_dict()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [mine]
        out: list = []
        dist.all_gather_object(out, mine)
        return out if dist.get_rank() == dst else None
