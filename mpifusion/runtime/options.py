"""``BufferOptions``: what a ``FusedCommBuffer`` does, validated in one place.

``FusedCommBuffer`` keeps Paddle's keyword arguments (code ported from Paddle passes them);
they are gathered into this frozen object, checked before anything is allocated, and its
fields' metadata name the options every rank must agree on (:meth:`BufferOptions.agreed`).
"""
from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, Optional

import numpy as np
from mpi4py import MPI

from ..config import naninf_check_from_env, parse_bool
from ..errors import LayoutError, OptionError, error_context
from ..limits import MAX_INT
from ..plan.actions import HookAction

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


def _check_act(value: Any, where: str, name: str) -> HookAction:
    with error_context(where, LayoutError):
        return HookAction.parse(value)  # its message names act


def _check_acc_steps(value: Any, where: str, name: str) -> int:
    # an int, as Paddle's: 2.0 or 1e300 would be counted against by float comparison
    if (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
            and 1 <= value <= MAX_INT):
        return int(value)
    raise LayoutError(f"{where}: {name}: expected an int >= 1, got {value!r}")


def _keep_int(value: Any, where: str, name: str) -> Any:
    """``dst`` as an int where it is one (numpy integers too: a rank read from an array); what
    it must be depends on ``act`` (:meth:`BufferOptions.checked`)."""
    number = as_int(value)
    return value if number is None else number


def _switch(value: Any, where: str, name: str) -> bool:
    return check_switch(value, f"{where}: {name}")


def _switch_or_none(value: Any, where: str, name: str) -> Optional[bool]:
    return check_switch(value, f"{where}: {name}", allow_none=True)


def _check_naninf(value: Any, where: str, name: str) -> bool:
    """None: the environment ($MPIFUSION_CHECK_NANINF or Paddle's FLAGS_pp_check_naninf)."""
    return naninf_check_from_env() if value is None else parse_bool(value, f"{where}: {name}")


def option(default: Any, check: Callable[[Any, str, str], Any], per_rank: str = "") -> Any:
    """A field of :class:`BufferOptions`: ``check(value, where, name)`` returns the value to
    use or raises naming ``where`` and the option. Every rank of comm_group must hold the same value (the
    agreement check at construction compares it) unless ``per_rank`` says why it may differ."""
    if not isinstance(per_rank, str):
        raise TypeError(f"per_rank: expected the reason as a str, got {per_rank!r}")
    return field(default=default, metadata={"check": check, "per_rank": per_rank})


@dataclass(frozen=True)
class BufferOptions:
    """FusedCommBuffer's options (docs/api.md, "Options of FusedCommBuffer"): the one definition.

    Each field says how it is checked and whether ranks must agree on it; the buffer reads
    these fields, :data:`SWITCHES` and :meth:`agreed` are derived from them, and a test
    holds FusedCommBuffer's keyword arguments (Paddle's names and defaults) to them.
    ``timeout``, ``order`` and ``comm_options`` are :class:`~mpifusion.CommOptions` fields:
    the buffer's communicator checks and agrees on those.
    """

    act: Any = option(None, _check_act)
    acc_steps: int = option(1, _check_acc_steps)
    dst: int = option(-1, _keep_int)
    #: None: whether the first param has a main_grad (the buffer resolves it)
    use_main_grad: Optional[bool] = option(None, _switch_or_none)
    fuse_param: bool = option(False, _switch)
    scale_after_comm: bool = option(True, _switch)
    release_grads: bool = option(False, _switch)
    use_reduce_avg: bool = option(False, _switch)
    free_grads_in_comm: bool = option(False, _switch)
    init_slice_param: bool = option(
        False, _switch,
        per_rank="it only gives this rank's slice_params views of its own shard; no "
                 "collective and no other rank's memory depends on it")
    check_naninf: Optional[bool] = option(None, _check_naninf)

    def checked(self, where: str, has_comm: bool) -> "BufferOptions":
        """These options checked and parsed (``act`` a HookAction, ``check_naninf`` resolved),
        or an error naming the first bad one (``where`` is "rank R: buffer I"): a
        ``LayoutError`` for values or combinations that cannot be built, an ``OptionError``
        for an on/off option that is not a bool."""
        opts = replace(self, **{f.name: f.metadata["check"](getattr(self, f.name), where, f.name)
                                for f in fields(self)})
        opts._check_combinations(where, has_comm, self.dst)
        return opts

    def _check_combinations(self, where: str, has_comm: bool, dst_given: Any) -> None:
        act = self.act
        if self.free_grads_in_comm:
            if self.acc_steps != 1:
                raise LayoutError(f"{where}: free_grads_in_comm: expected acc_steps == 1, "
                                  f"got acc_steps={self.acc_steps}")
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
        dst = as_int(self.dst)
        if act == HookAction.REDUCE:
            # a global rank, as in Paddle; dst_group_rank checks it is in comm_group
            if dst is None or dst < 0:
                raise LayoutError(f"{where}: dst: REDUCE expected the root's global rank "
                                  f"(an int >= 0), got {dst_given!r}")
        elif dst != -1:
            raise LayoutError(f"{where}: dst: expected -1 for {act.name}, got {dst_given!r}")
        if act == HookAction.REDUCE_SCATTER and not has_comm:
            raise LayoutError(f"{where}: comm_group: REDUCE_SCATTER needs a communicator "
                              f"to plan its shards, got None")

    def agreed(self) -> Dict[str, Any]:
        """Every option that all ranks of comm_group must hold equal, by name (an enum by its
        name): each field unless its ``per_rank`` metadata says why it may differ. Derived,
        so an option added to this class is agreed without another list to update."""
        return {f.name: _shown(getattr(self, f.name)) for f in fields(self)
                if not f.metadata["per_rank"]}


def _shown(value: Any) -> Any:
    return value.name if isinstance(value, enum.Enum) else value


#: FusedCommBuffer's on/off options; ``use_main_grad`` may also be None (its default)
SWITCHES = tuple(f.name for f in fields(BufferOptions)
                 if f.metadata["check"] in (_switch, _switch_or_none))
