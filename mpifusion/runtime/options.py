"""``BufferOptions``: what a ``FusedCommBuffer`` does, validated in one place.

``FusedCommBuffer`` keeps Paddle's keyword arguments (code ported from Paddle passes them);
they are gathered into this frozen object, checked before anything is allocated, and the
same object names the options every rank must agree on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mpi4py import MPI

from ..errors import LayoutError
from ..plan.actions import HookAction


def dst_group_rank(dst: int, comm_group: Optional[MPI.Comm], where: str) -> int:
    """The rank in ``comm_group`` of REDUCE's root ``dst``, a *global* rank (of COMM_WORLD),
    as Paddle's ``dst`` is; a global rank outside comm_group is a ``LayoutError``.

    Without a comm_group the buffer never communicates: ``dst`` is kept as given.
    """
    if comm_group is None:
        return dst
    world = MPI.COMM_WORLD
    group, world_group = comm_group.Get_group(), world.Get_group()
    try:
        members = group.Translate_ranks(None, world_group)  # global ranks of comm_group
        mine = (world_group.Translate_ranks([dst], group)[0]
                if dst < world.Get_size() else MPI.UNDEFINED)
    finally:
        group.Free()
        world_group.Free()
    if mine == MPI.UNDEFINED:
        shown = ", ".join(str(r) for r in members)
        raise LayoutError(f"{where}: dst: REDUCE expected the root's global rank (of "
                          f"COMM_WORLD, as in Paddle) among comm_group's global ranks "
                          f"[{shown}], got {dst}")
    return mine


@dataclass(frozen=True)
class BufferOptions:
    """Paddle's FusedCommBuffer options (see README, "Options of FusedCommBuffer")."""

    act: Any = None
    acc_steps: int = 1
    dst: int = -1
    use_main_grad: Optional[bool] = None   # None: whether the first param has a main_grad
    fuse_param: bool = False
    scale_after_comm: bool = True
    release_grads: bool = False
    use_reduce_avg: bool = False
    free_grads_in_comm: bool = False
    init_slice_param: bool = False

    def checked(self, where: str, nranks: int, has_comm: bool) -> "BufferOptions":
        """These options with ``act`` parsed, or a ``LayoutError`` naming the first bad one
        (``where`` is "rank R: buffer I"; ``nranks`` the size of comm_group)."""
        acc = self.acc_steps
        try:
            ok = not isinstance(acc, bool) and int(acc) == acc and acc >= 1
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise LayoutError(f"{where}: acc_steps: expected an int >= 1, got {acc!r}")
        acc = int(acc)
        try:
            act = HookAction.parse(self.act)
        except LayoutError as exc:
            raise LayoutError(f"{where}: {exc}") from None
        if self.free_grads_in_comm:
            if acc != 1:
                raise LayoutError(f"{where}: free_grads_in_comm: expected acc_steps == 1, "
                                  f"got acc_steps={acc}")
            if act != HookAction.REDUCE_SCATTER:
                raise LayoutError(f"{where}: free_grads_in_comm: expected act=REDUCE_SCATTER, "
                                  f"got {act.name}")
            if not self.release_grads:
                raise LayoutError(f"{where}: free_grads_in_comm: expected release_grads=True")
        if self.fuse_param and self.release_grads:
            raise LayoutError(f"{where}: fuse_param and release_grads: expected at most one "
                              f"of them to be True")
        if self.fuse_param and act == HookAction.REDUCE_SCATTER:
            raise LayoutError(f"{where}: fuse_param: not supported with REDUCE_SCATTER "
                              f"(its params are always fused)")
        dst = self.dst
        if act == HookAction.REDUCE:
            # a global rank, as in Paddle; dst_group_rank checks it is in comm_group
            if isinstance(dst, bool) or not isinstance(dst, int) or dst < 0:
                raise LayoutError(f"{where}: dst: REDUCE expected the root's global rank "
                                  f"(an int >= 0), got {dst!r}")
        elif dst != -1:
            raise LayoutError(f"{where}: dst: expected -1 for {act.name}, got {dst!r}")
        if act == HookAction.REDUCE_SCATTER and not has_comm:
            raise LayoutError(f"{where}: comm_group: REDUCE_SCATTER needs a communicator "
                              f"to plan its shards, got None")
        return BufferOptions(
            act=act, acc_steps=acc, dst=dst, use_main_grad=self.use_main_grad,
            fuse_param=bool(self.fuse_param), scale_after_comm=bool(self.scale_after_comm),
            release_grads=bool(self.release_grads), use_reduce_avg=bool(self.use_reduce_avg),
            free_grads_in_comm=bool(self.free_grads_in_comm),
            init_slice_param=bool(self.init_slice_param))
