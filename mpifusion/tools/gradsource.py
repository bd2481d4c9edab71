"""Where the gradients of ``mpifusion run`` come from, and their exact sums.

:class:`GradSource` (``--inputs random``, the default): windows of one random table of
``TABLE_SIZE`` (a prime) values, each starting at an offset hashed from (seed, rank, step,
micro-step, param): generating them costs a copy, and the float64 reference of a param longer
than the table costs ``R*K*TABLE_SIZE`` adds instead of ``R*K*numel``.

:class:`ExactGradSource` (``--inputs exact``): :func:`mpifusion.oracle.exact_inputs`, whose
sums are exact in every order, so the result must be bit-exact (a mean over a
non-power-of-two rank count: within the rounding of the mean).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from ..dtypes import as_dtype
from ..oracle.inputs import ExactPattern, exact_pattern
from ..spec import Spec

#: length of the random table gradients are cut from (prime, so windows rarely line up)
TABLE_SIZE = 1_000_003

#: key namespaces of GradSource.start: gradients, initial params, params after an update
GRAD, INIT, UPDATE = 0, 1, 2

#: exact inputs of training step ``t`` use ``seed = run seed * STEP_SEEDS + t``
STEP_SEEDS = 1 << 20


def _window(table: np.ndarray, start: int, n: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """``table[(start + j) % len(table)]`` for ``j < n``, by slice copies."""
    size = len(table)
    if out is None:
        out = np.empty(n, dtype=table.dtype)
    pos, s = 0, start % size
    while pos < n:
        take = min(size - s, n - pos)
        out[pos:pos + take] = table[s:s + take]
        pos += take
        s = 0
    return out


class GradSource:
    """The synthetic gradients of a run, and their exact float64 sums."""

    exact = False

    def __init__(self, seed: int, dtype: Any) -> None:
        self.seed = int(seed)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x6D70_6675]))
        self.table = rng.standard_normal(TABLE_SIZE).astype(as_dtype(dtype))
        self.table64 = self.table.astype(np.float64)  # the fed values, exactly

    def start(self, *key: int) -> int:
        """Offset into the table for a key of non-negative ints (first: GRAD, INIT, UPDATE)."""
        state = np.random.SeedSequence([self.seed, *key]).generate_state(2)
        return int((int(state[0]) << 32 | int(state[1])) % TABLE_SIZE)

    def grad(self, rank: int, step: int, micro: int, pidx: int, shape: Sequence[int]) -> np.ndarray:
        """What backward gives ``rank`` for param ``pidx`` at (step, micro-step)."""
        n = int(np.prod(shape, dtype=np.int64))
        return _window(self.table, self.start(GRAD, rank, step, micro, pidx), n).reshape(shape)

    def values(self, key: Sequence[int], n: int) -> np.ndarray:
        """Deterministic values (e.g. new params) of the table dtype, for ``key``."""
        return _window(self.table, self.start(*key), n)

    def reference(self, step: int, pidx: int, lo: int, hi: int, nranks: int,
                  acc_steps: int) -> tuple:
        """``(sum, sum|x|)`` over ranks and micro-steps of elements ``[lo, hi)`` of a param."""
        n = hi - lo
        starts = [self.start(GRAD, r, step, k, pidx) for r in range(nranks) for k in range(acc_steps)]
        period = n > TABLE_SIZE
        width = TABLE_SIZE if period else n
        total = np.zeros(width)
        absolute = np.zeros(width)
        piece = np.empty(width)
        for s in starts:
            _window(self.table64, s if period else s + lo, width, piece)
            total += piece
            absolute += np.abs(piece)
        if period:
            return _window(total, lo, n), _window(absolute, lo, n)
        return total, absolute


class ExactGradSource:
    """:func:`~mpifusion.oracle.exact_inputs` as a run's gradients (GradSource's interface);
    param values (``values``) still come from the random table."""

    exact = True

    def __init__(self, spec: Spec, seed: int, dtype: Any, nranks: int) -> None:
        self.seed = int(seed)
        self.spec = dataclasses.replace(spec, nranks=nranks)
        self.names = [p.name for p in spec.fused_params()]
        self.random = GradSource(seed, dtype)
        self._cache: dict = {}
        for name in self.names:  # refuse (OptionError) what exact inputs cannot hold, now
            exact_pattern(self.spec, name, seed=self.seed * STEP_SEEDS)

    def pattern(self, step: int, pidx: int) -> ExactPattern:
        """Param ``pidx``'s pattern at training step ``step`` (the last step's kept)."""
        key = (step, pidx)
        if key not in self._cache:
            if any(k[0] != step for k in self._cache):
                self._cache.clear()
            self._cache[key] = exact_pattern(self.spec, self.names[pidx],
                                             seed=self.seed * STEP_SEEDS + step)
        return self._cache[key]

    def grad(self, rank: int, step: int, micro: int, pidx: int, shape: Sequence[int]) -> np.ndarray:
        """What backward gives ``rank`` for param ``pidx`` at (step, micro-step): float64
        powers of two (or 0), exact in every grad dtype."""
        j = rank * self.spec.acc_steps + micro
        return self.pattern(step, pidx).contribution(j).reshape(shape)

    def values(self, key: Sequence[int], n: int) -> np.ndarray:
        return self.random.values(key, n)

    def reference(self, step: int, pidx: int, lo: int, hi: int, nranks: int,
                  acc_steps: int) -> tuple:
        """``(sum, sum|x|)`` of elements ``[lo, hi)``, exact."""
        return self.pattern(step, pidx).total(lo, hi)

