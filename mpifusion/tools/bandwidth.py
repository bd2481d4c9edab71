"""Bandwidth figures of ``mpifusion run`` and ``mpifusion bench``: one definition for both.

nccl-tests' definitions: algbw = bytes / time (GB/s, 1e9 bytes); busbw = algbw x a factor of
the collective and the rank count, what each rank's link carries relative to the data size
(all-reduce 2(n-1)/n, reduce 1, reduce-scatter and all-gather (n-1)/n). With one rank nothing
crosses a link, so busbw is 0. A time of zero (or less: a clock too coarse for the step) has no
bandwidth: the figures are ``None`` (JSON null) and print as ``-``.
"""
from __future__ import annotations

from typing import Optional

#: collective -> busbw factor for n ranks (n >= 2)
_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce": lambda n: 1.0,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter+allgather": lambda n: 2 * (n - 1) / n,
}
_ALIASES = {"allreduce": "all_reduce", "reducescatter": "reduce_scatter",
            "all_gather": "allgather"}
KINDS = tuple(_FACTORS)


def bus_factor(kind: str, nranks: int) -> float:
    """busbw / algbw for ``kind`` (``all_reduce``, ``reduce``, ``reduce_scatter``,
    ``allgather``, ``reduce_scatter+allgather``) on ``nranks`` ranks; 0 for one rank."""
    key = _ALIASES.get(kind.lower(), kind.lower())
    if key not in _FACTORS:
        raise ValueError(f"unknown collective {kind!r}: expected one of {', '.join(KINDS)}")
    return 0.0 if nranks <= 1 else float(_FACTORS[key](nranks))


def algbw(nbytes: int, seconds: float) -> Optional[float]:
    """GB/s (1e9 bytes per second), or None when ``seconds`` is not positive."""
    return nbytes / seconds / 1e9 if seconds > 0 else None


def busbw(kind: str, nbytes: int, seconds: float, nranks: int) -> Optional[float]:
    """algbw x :func:`bus_factor`, or None when ``seconds`` is not positive."""
    alg = algbw(nbytes, seconds)
    return None if alg is None else alg * bus_factor(kind, nranks)


def fmt_gbps(value: Optional[float], digits: int = 3) -> str:
    """``12.345`` with ``digits`` decimals, ``-`` for no figure."""
    return "-" if value is None else f"{value:.{digits}f}"
