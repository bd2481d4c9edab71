"""``Param``: what a user hands to mpifusion in place of a framework parameter."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

from ..arrays import backend
from ..dtypes import dtype_name
from ..errors import error_context


class Param:
    """A named parameter: its data, its gradient and Paddle's flags.

    ``data``, ``grad`` and ``main_grad`` are arrays (numpy or cupy); once a param is fused they
    are views into the fused buffers, so a framework that writes into them (in place) writes
    into the buffer. ``array`` may be any DLPack producer; it is not copied (so a torch tensor
    with its negation or conjugation bit set, whose memory is not its value, is a TypeError;
    ``.resolve_neg()`` / ``.resolve_conj()`` make a copy that can be shared).

    Args:
        name: the param's name, unique in a buffer (errors and dumps name it).
        array: the param's data.
        grad: its gradient array (shape and device of ``array``), if it has one.
        main_grad: its fp32 main gradient (Paddle's, for ``use_main_grad``), if it has one.
        trainable: Paddle's ``trainable``; False is ``stop_gradient=True``.
        stop_gradient: leave the param out of ``fused_parameters`` (a buffer still
            communicates its grad).
        is_distributed: a model-parallel param (``fused_parameters`` groups it apart).
        need_clip: whether gradient clipping applies (``fused_parameters`` groups by it).
        optimize_attr: Paddle's per-param optimizer settings (default learning rate 1.0).

    Raises:
        ValueError: an empty name, or a grad whose shape or device differs from ``array``.
        TypeError: an array that cannot be shared without a copy.
    """

    def __init__(
        self,
        name: str,
        array: Any,
        *,
        grad: Any = None,
        main_grad: Any = None,
        trainable: bool = True,
        stop_gradient: bool = False,
        is_distributed: bool = False,
        need_clip: bool = True,
        optimize_attr: Optional[dict] = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Param name: expected a non-empty str, got {name!r}")
        self.name = name
        self.data = _import(name, "array", array)
        self.grad = _import(name, "grad", grad, like=self.data)
        self.main_grad = _import(name, "main_grad", main_grad, like=self.data)
        # one flag, as in Paddle (trainable is not stop_gradient): either one turns it off
        self.stop_gradient = bool(stop_gradient) or not bool(trainable)
        self.is_distributed = bool(is_distributed)
        self.need_clip = bool(need_clip)
        self.optimize_attr = {"learning_rate": 1.0} if optimize_attr is None else optimize_attr
        self._backward_hooks: list = []

    @property
    def data(self) -> Any:
        """The param's array; a view into the param buffer once fused (``fuse_param``,
        ``REDUCE_SCATTER``), None while a sharded buffer's param storage is cleared."""
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        # shape and dtype outlive the data: a sharded buffer may release it for a while
        self._data = value
        if value is not None:
            self._shape = tuple(value.shape)
            self._dtype = dtype_name(value.dtype)
            self._device = backend.device_of(value)

    @property
    def trainable(self) -> bool:
        """``not stop_gradient``, as in Paddle (setting either flag sets the other)."""
        return not self.stop_gradient

    @trainable.setter
    def trainable(self, value: bool) -> None:
        self.stop_gradient = not bool(value)

    @property
    def shape(self) -> tuple:
        """The param's shape (kept while :attr:`data` is released)."""
        return self._shape

    @property
    def dtype(self) -> str:
        """The param's dtype name, such as ``"float32"`` (kept while :attr:`data` is
        released)."""
        return self._dtype

    @property
    def device(self) -> str:
        """Where the data (and so the buffer it joins) lives, ``"cpu"`` or ``"cuda:N"``."""
        return self._device

    @property
    def numel(self) -> int:
        """Elements of the param (the product of its shape)."""
        return math.prod(self._shape)

    def register_backward_hook(self, hook: Callable[..., Any]) -> None:
        """Hooks run by :meth:`backward`, as a framework's autograd would after this grad.

        Args:
            hook: called as ``hook(grad)``; ``fused_parameters(comm_overlap=True)``
                registers the buffer's ``add_grad`` here.
        """
        self._backward_hooks.append(hook)

    def backward(self, grad: Any = None) -> None:
        """Emulate the end of this param's backward: run its hooks (e.g. a buffer's add_grad).

        Args:
            grad: handed to every hook (None: the grad is already in the param's view).
        """
        for hook in self._backward_hooks:
            hook(grad)

    def __repr__(self) -> str:
        return f"Param({self.name!r}, shape={self.shape}, dtype={self.dtype})"


def _import(name: str, field: str, value: Any, like: Any = None) -> Any:
    """``value`` as a numpy/cupy array sharing its memory, checked against the param's data."""
    if value is None:
        return None
    # shared, never copied: a torch tensor whose memory is not its value is refused; a
    # TypeError is asarray's one way to say it cannot import value
    with error_context(f"Param '{name}': {field}", TypeError):
        arr = backend.asarray(value, resolve_lazy=False)
    if like is not None:
        if tuple(arr.shape) != tuple(like.shape):
            raise ValueError(f"Param '{name}': {field}: expected shape {tuple(like.shape)} "
                             f"like its data, got {tuple(arr.shape)}")
        if backend.device_of(arr) != backend.device_of(like):
            raise ValueError(f"Param '{name}': {field}: expected device "
                             f"{backend.device_of(like)} like its data, got "
                             f"{backend.device_of(arr)}")
    return arr
