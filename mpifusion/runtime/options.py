"""``BufferOptions``: what a ``FusedCommBuffer`` does, validated in one place.

``FusedCommBuffer`` keeps Paddle's keyword arguments (code ported from Paddle passes them);
they are gathered into this frozen object, checked before anything is allocated, and the
same object names the options every rank must agree on.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from mpi4py import MPI

from ..errors import LayoutError, OptionError
from ..limits import MAX_INT
from ..plan.actions import HookAction

#: FusedCommBuffer's on/off options; ``use_main_grad`` may also be None (its default)
SWITCHES = ("use_main_grad", "fuse_param", "scale_after_comm", "release_grads",
            "use_reduce_avg", "free_grads_in_comm", "init_slice_param")


def check_switch(value: Any, what: str, allow_none: bool = False) -> Optional[bool]:
    """An on/off option as a bool: True/False (or a numpy bool), else an ``OptionError``
    naming it. Truthiness would turn ``"False"``, ``"0"`` or ``[]`` into a setting the caller
    did not mean, so nothing else is taken (None only where the default is None)."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise OptionError(f"{what}: expected True or False{' or None' if allow_none else ''}, "
                      f"got {value!r}")


def as_int(value: Any) -> Optional[int]:
    """``value`` as an int when it is an integer (Python or numpy, not a bool), else None."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def check_buffer_id(id: Any, where: str) -> int:
    """A buffer id is an int (Paddle's): it goes into messages and the order check's
    fingerprint, where a string would hash differently on every rank (salted)."""
    if (not isinstance(id, (int, np.integer)) or isinstance(id, (bool, np.bool_))
            or not -MAX_INT <= id <= MAX_INT):
        raise OptionError(f"{where}: id: expected an int, got {id!r}")
    return int(id)


def check_comm_group(comm_group: Any, where: str) -> None:
    """An ``OptionError`` unless ``comm_group`` is None or a usable mpi4py communicator:
    ``MPI.COMM_NULL`` (what a freed communicator, or a split this rank is not in, becomes)
    would fail inside MPI with no word of the rank or buffer."""
    if comm_group is None:
        return
    if not isinstance(comm_group, MPI.Comm):
        raise OptionError(f"{where}: comm_group: expected an mpi4py communicator or None, "
                          f"got {type(comm_group).__name__}")
    if comm_group == MPI.COMM_NULL:
        raise OptionError(f"{where}: comm_group: expected a valid communicator, got "
                          f"MPI.COMM_NULL (a freed communicator, or a split this rank is "
                          f"not a member of)")


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
        (``where`` is "rank R: buffer I"; ``nranks`` the size of comm_group); an on/off
        option that is not a bool is an ``OptionError``."""
        flags = {}
        for name in SWITCHES:
            flags[name] = check_switch(getattr(self, name), f"{where}: {name}",
                                       allow_none=name == "use_main_grad")
        acc = self.acc_steps
        # an int, as Paddle's: 2.0 or 1e300 would be counted against by float comparison
        ok = (isinstance(acc, (int, np.integer)) and not isinstance(acc, (bool, np.bool_))
              and 1 <= acc <= MAX_INT)
        if not ok:
            raise LayoutError(f"{where}: acc_steps: expected an int >= 1, got {acc!r}")
        acc = int(acc)
        try:
            act = HookAction.parse(self.act)
        except LayoutError as exc:
            raise LayoutError(f"{where}: {exc}") from None
        if flags["free_grads_in_comm"]:
            if acc != 1:
                raise LayoutError(f"{where}: free_grads_in_comm: expected acc_steps == 1, "
                                  f"got acc_steps={acc}")
            if act != HookAction.REDUCE_SCATTER:
                raise LayoutError(f"{where}: free_grads_in_comm: expected act=REDUCE_SCATTER, "
                                  f"got {act.name}")
            if not flags["release_grads"]:
                raise LayoutError(f"{where}: free_grads_in_comm: expected release_grads=True")
        if flags["fuse_param"] and flags["release_grads"]:
            raise LayoutError(f"{where}: fuse_param and release_grads: expected at most one "
                              f"of them to be True")
        if flags["fuse_param"] and act == HookAction.REDUCE_SCATTER:
            raise LayoutError(f"{where}: fuse_param: not supported with REDUCE_SCATTER "
                              f"(its params are always fused)")
        dst = as_int(self.dst)  # numpy integers too (a rank read from an array)
        if act == HookAction.REDUCE:
            # a global rank, as in Paddle; dst_group_rank checks it is in comm_group
            if dst is None or dst < 0:
                raise LayoutError(f"{where}: dst: REDUCE expected the root's global rank "
                                  f"(an int >= 0), got {self.dst!r}")
        elif dst != -1:
            raise LayoutError(f"{where}: dst: expected -1 for {act.name}, got {self.dst!r}")
        if act == HookAction.REDUCE_SCATTER and not has_comm:
            raise LayoutError(f"{where}: comm_group: REDUCE_SCATTER needs a communicator "
                              f"to plan its shards, got None")
        return BufferOptions(act=act, acc_steps=acc, dst=dst, **flags)
