"""The check-in counters of one step: which params gave their ``acc_steps`` micro-steps.

Kept apart from the buffer so the state machine (docs/state-machine.md) is small enough
to read in one go: ``add``/``complete`` move it forward, ``reset`` starts the step afresh.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from ..errors import GradError


class CheckIn:
    """Micro-steps per param this step, and how many params finished all of them."""

    def __init__(self, params: Sequence[Any], acc_steps: int, where: str) -> None:
        self.acc_steps = acc_steps
        self.by_name: Dict[str, Any] = {p.name: p for p in params}
        self.steps: Dict[str, int] = dict.fromkeys(self.by_name, 0)
        self.count = 0          # params checked in (all micro-steps done)
        self._where = where

    def steps_of(self, param: Any) -> int:
        """Micro-steps ``param`` has this step; raises unless it is one of these params."""
        name = getattr(param, "name", None)
        steps = self.steps.get(name)
        if steps is None or self.by_name[name] is not param:
            held = ", ".join(list(self.by_name)[:5]) + (", ..." if len(self.by_name) > 5 else "")
            raise GradError(f"{self._where}: param '{name}': not a param of this buffer "
                            f"(it holds {len(self.by_name)} params: {held})")
        return steps

    def add(self, name: str) -> bool:
        """One micro-step of ``name``; True when that checked the param in."""
        steps = self.steps[name] + 1
        self.steps[name] = steps
        if steps == self.acc_steps:
            self.count += 1
            return True
        return False

    def undo(self, steps: Dict[str, int], count: int) -> None:
        """Put the counters back as ``steps``/``count`` (a copy taken before a call that
        failed after counting, e.g. a NanInfError when the last check-in started comm)."""
        self.steps.update(steps)
        self.count = count

    def complete(self, name: str) -> None:
        """Check ``name`` in at once (its remaining micro-steps count as zero gradient)."""
        self.steps[name] = self.acc_steps
        self.count += 1

    @property
    def all_in(self) -> bool:
        return self.count == len(self.steps)

    def missing(self) -> List[str]:
        return [name for name, n in self.steps.items() if n < self.acc_steps]

    def text(self) -> str:
        """"x/y params checked in: missing a, b (1 of 2 micro-steps)" for errors (Megatron's
        progress counts); a missing param that has some micro-steps says how many."""
        missing = self.missing()
        text = f"{self.count}/{len(self.steps)} params checked in"
        if missing:
            shown = [name if not self.steps[name] else
                     f"{name} ({self.steps[name]} of {self.acc_steps} micro-steps)"
                     for name in missing[:10]]
            text += f": missing {', '.join(shown)}{' ...' if len(missing) > 10 else ''}"
        return text

    def reset(self) -> None:
        for name in self.steps:
            self.steps[name] = 0
        self.count = 0
