"""Argument types and the parser shared by every ``mpifusion`` command.

Each type turns one command-line word into a value or raises argparse's one-line error
(``--iters: expected an integer >= 1, got '0'``); :class:`Parser` prints that line on rank
0 only and exits 2 on every rank.
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Callable

from ..errors import LayoutError
from ..plan.actions import HookAction
from .console import EXIT_INPUT, rank


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are printed by rank 0 only (every rank still exits 2)."""

    def error(self, message: str):  # type: ignore[override]
        if rank() == 0:  # one line, like every other bad input (the usage is in --help)
            print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr,
                  flush=True)
        raise SystemExit(EXIT_INPUT)

    def _print_message(self, message: str, file: Any = None) -> None:
        if rank() == 0:
            super()._print_message(message, file)


_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


def byte_size(text: str) -> int:
    """``268435456``, ``256M``, ``256MiB``, ``1G``: bytes, suffixes are powers of 1024."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a number of bytes such as 268435456 or "
                                         f"256M, got {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def hook_action(text: str) -> str:
    """``all_reduce``, ``reduce`` or ``reduce_scatter`` (Paddle's spellings too), as the
    spec's key."""
    try:
        return HookAction.parse(text).key
    except LayoutError:
        raise argparse.ArgumentTypeError(f"expected all_reduce, reduce or reduce_scatter, "
                                         f"got {text!r}") from None


def from_check(check: Callable[[Any], Any], name: str) -> Callable[[str], Any]:
    """``check`` (which raises ValueError) as an argparse type: its message becomes
    argparse's one-line error; ``name`` is what argparse calls the type."""
    def convert(text: str) -> Any:
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert
