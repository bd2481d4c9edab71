"""JAX capture: JAX has no hooks, so grads go in as values: a grads pytree per micro-step
(what ``jax.grad`` returned on this rank) and the synced pytree (after ``lax.pmean``/``psum``
or a ``jax.distributed`` all-reduce). Leaves are named by their pytree path
(``params/dense/kernel``); two leaves that would get one name (a key holding "/" next to
nested keys) are refused, as is a name given to a different leaf in a later tree.

One process per rank: ``JaxCapture(rank=r, nranks=n)``. One process driving several devices
(``pmap``/``shard_map`` with a leading device axis): ``JaxCapture.stacked(...)`` records
every device as a rank and returns one record per device.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .core import CaptureError, Recorder

__all__ = ["JaxCapture"]


def _leaves(tree: Any, where: str = "grads") -> list:
    """``[(name, path, leaf)]`` in pytree order: names joined from the key paths with "/",
    ``path`` the key path as ``jax.tree_util.keystr`` writes it. A key holding "/" (Haiku's
    ``"mlp/~/linear_0"``) is kept as is, so two paths can give one name (``{"a/b": x}`` and
    ``{"a": {"b": y}}``): refused, naming both, instead of one leaf overwriting the other."""
    import jax

    out, seen = [], {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for k in path:
            for attr in ("key", "name", "idx"):
                if hasattr(k, attr):
                    parts.append(str(getattr(k, attr)))
                    break
            else:
                parts.append(str(k))
        name, where_path = "/".join(parts) or "leaf", jax.tree_util.keystr(path) or "(root)"
        if name in seen:
            raise CaptureError(f"{where}: leaves {seen[name]} and {where_path} both get the "
                               f"name {name!r} (keys holding '/' join like nested keys); "
                               f"expected one name per leaf: rename a key")
        seen[name] = where_path
        out.append((name, where_path, leaf))
    return out


def to_numpy(x: Any) -> np.ndarray:
    """A numpy copy of a JAX array (bfloat16 stays ml_dtypes.bfloat16)."""
    return np.array(x, copy=True)


class JaxCapture(Recorder):
    """Record one rank's JAX gradient step: ``add_micro_step(grads)`` per micro-step,
    ``set_outputs(synced_grads)`` after the sync; then ``to_dict()``, ``save(dir)``,
    ``spec()``.

    Args:
        rank: this rank (one process per rank), or the device (see :meth:`stacked`).
        nranks: the number of ranks, for :meth:`~mpifusion.capture.Recorder.spec`.
    """

    def __init__(self, rank: int = 0, nranks: Optional[int] = None) -> None:
        super().__init__(rank, nranks)
        self._paths: dict = {}  # name -> the key path it was first given for

    def _same_path(self, name: str, path: str, where: str) -> None:
        """One name, one key path, in every tree given to this capture (else two different
        leaves would be recorded as one param)."""
        old = self._paths.setdefault(name, path)
        if old != path:
            raise CaptureError(f"rank {self.rank}: {where}: leaf {path} gets the name "
                               f"{name!r}, which earlier trees gave leaf {old}; expected "
                               f"the same tree structure for every micro-step and the "
                               f"outputs")

    def _declare_tree(self, tree: Any, where: str) -> list:
        leaves = [(n, path, to_numpy(x))
                  for n, path, x in _leaves(tree, f"rank {self.rank}: {where}")]
        for name, path, _ in leaves:
            self._same_path(name, path, where)
        for name, _, arr in leaves:
            self.declare(name, arr.shape, arr.dtype)
        return leaves

    def add_micro_step(self, grads: Any) -> None:
        """This rank's local grads of one micro-step (a pytree of arrays)."""
        where = f"micro-step {max(map(len, self._inputs.values()), default=0)} grads"
        for name, _, arr in self._declare_tree(grads, where):
            self.add_input(name, arr)

    def set_outputs(self, grads: Any) -> None:
        """What this rank holds after the sync (a pytree shaped like the grads)."""
        leaves = _leaves(grads, f"rank {self.rank}: outputs")
        for name, path, _ in leaves:
            self._same_path(name, path, "outputs")
        for name, _, arr in leaves:
            self.set_output(name, to_numpy(arr))

    @classmethod
    def stacked(cls, micro_steps: list, synced: Any) -> list:
        """Records for a single-process run over several devices: every leaf of each
        micro-step's grads and of ``synced`` has a leading device axis (``pmap`` outputs);
        device ``d`` becomes rank ``d``. Returns one :class:`JaxCapture` per device.

        Args:
            micro_steps: one grads pytree per micro-step, as above.
            synced: the synced grads, as above.

        Raises:
            CaptureError: no micro-steps, or leaves without one common device axis.
        """
        if not micro_steps:
            raise CaptureError("micro_steps: expected at least one grads pytree")
        first = _leaves(micro_steps[0], "micro_steps[0]")
        ndev = {np.shape(x)[0] if np.ndim(x) else None for _, _, x in first}
        if len(ndev) != 1 or None in ndev:
            raise CaptureError(f"micro_steps[0]: every leaf needs the same leading device axis "
                               f"(got leading sizes {sorted(map(str, ndev))})")
        n = ndev.pop()
        caps = [cls(rank=d, nranks=n) for d in range(n)]
        for k, grads in enumerate(micro_steps):
            for name, path, x in _leaves(grads, f"micro_steps[{k}]"):
                for cap in caps:
                    cap._same_path(name, path, f"micro_steps[{k}]")
                arr = to_numpy(x)
                if arr.shape[:1] != (n,):
                    raise CaptureError(f"micro_steps[{k}]: {name}: leading axis "
                                       f"{arr.shape[:1]}, expected ({n},) devices")
                for d, cap in enumerate(caps):
                    cap.declare(name, arr.shape[1:], arr.dtype)
                    cap.add_input(name, arr[d])
        for name, path, x in _leaves(synced, "synced"):
            for cap in caps:
                cap._same_path(name, path, "synced")
            arr = to_numpy(x)
            for d, cap in enumerate(caps):
                cap.set_output(name, arr[d])
        return caps
