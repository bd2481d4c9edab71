"""What a buffer does with its grads: the one definition of the action names."""
from __future__ import annotations

import enum
from typing import Any

from ..errors import LayoutError


class HookAction(enum.IntEnum):
    """What a buffer does with its grads once all params checked in."""

    #: every rank gets the reduced grads
    ALL_REDUCE = 0
    #: only the root (``dst``) gets them
    REDUCE = 1
    #: each rank gets its shard of them (and ``sync_params`` gathers the params back)
    REDUCE_SCATTER = 2

    @classmethod
    def parse(cls, value: Any) -> "HookAction":
        """A HookAction from itself, its int, or a name (any case, ``-``/``_`` or none).

        Args:
            value: ``HookAction.REDUCE``, ``1``, ``"reduce"``, ``"all-reduce"`` ...

        Raises:
            LayoutError: anything else (``True`` included).
        """
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            key = {"ALLREDUCE": "ALL_REDUCE", "REDUCESCATTER": "REDUCE_SCATTER"}.get(key, key)
            if key in cls.__members__:
                return cls[key]
        elif value is not None and not isinstance(value, bool):
            try:
                return cls(int(value))
            except (ValueError, TypeError):
                pass
        raise LayoutError(f"act: expected HookAction.ALL_REDUCE, REDUCE or REDUCE_SCATTER "
                          f"(or 'all_reduce', 'reduce', 'reduce_scatter'), got {value!r}")

    @property
    def key(self) -> str:
        """The lower-case name used in specs, layouts and on the command line."""
        return self.name.lower()


#: Paddle's name for the same enum.
HOOK_ACTION = HookAction
#: the names specs and the CLI use
ACT_NAMES = tuple(a.key for a in HookAction)
