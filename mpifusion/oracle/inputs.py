"""Bit-exact inputs for a gradient sync: nccl-tests' ``-c`` for fused gradient buffers.

With random gradients a result can only be held to a rounding-error bound, which grows with
``sum|x|`` and lets a small lost contribution pass. :func:`exact_inputs` makes gradients
whose every partial sum, in every order, is exactly representable in the grad dtype, so every
correct implementation (any reduction order, segmentation, algorithm or pre-scaling by a
power of two) ends with the same bits, and ``check(..., exact=True)`` demands them.

Construction (docs/oracle.md, "Bit-exact inputs"): contribution ``j = rank * acc_steps + k``
of ``N = nranks * acc_steps``. Element ``i`` of a param holds ``c = min(N, W)`` of them
(``W = p - 2`` slots, ``p`` the grad dtype's precision: 22 fp32, 9 fp16, 6 bf16, 51 fp64),
contributions ``start_i .. start_i + c - 1`` (mod N) with ``start_i = i * c mod N``, so the
first ``ceil(N / c)`` elements already hold every contribution. The ``t``-th of them is
``+-2**(E_i + slot_i(t))``, its slot distinct within the element (an affine map mod ``W``),
its sign and ``E_i`` hashed from ``(seed, param name, i)``; the others are 0 there. Every
partial sum is then a signed sum of distinct powers of two ``2**E_i .. 2**(E_i + W - 1)``: a
multiple of ``2**E_i`` below ``2**(E_i + W)``, which ``p`` bits hold, with two bits to spare so
that the sum plus one doubled contribution, or twice the sum, is exact too (never rounded
back onto the right answer). ``E_i`` keeps every value, its ``1/n`` (``n`` up to
``max(64, nranks)``) and twice the sum inside the normal range of the param and grad dtypes.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..dtypes import as_dtype, dtype_name
from ..errors import OptionError
from ..plan.grouping import grad_dtype_for
from ..spec import as_spec
from .bound import unit_roundoff
from .dumps import DumpError

#: precision p (significand bits, the implicit one included) and normal exponent range
_PRECISION = {"float64": 53, "float32": 24, "float16": 11, "bfloat16": 8}
_EXPONENTS = {"float64": (-1022, 1023), "float32": (-126, 127), "float16": (-14, 15),
              "bfloat16": (-126, 127)}
#: bits left free above the largest sum: the sum with one contribution doubled, or twice
#: the sum, is still exact (a wrong result cannot round onto the right one)
HEADROOM_BITS = 2
#: 2**-MIN_SHIFT (1/64) of the smallest value is still normal: pre-scaled means over up to
#: 64 ranks (more: ceil(log2 nranks)) stay exact and clear of flush-to-zero
MIN_SHIFT = 6
#: the range E_i is drawn from where the dtypes allow it (values about 2**-24 .. 2**29 for
#: fp32): gradient-like magnitudes, far from subnormals and overflow
_E_RANGE = (-24, 8)
_MASK64 = (1 << 64) - 1
#: elements generated at a time (a few tens of MiB of temporaries)
CHUNK = 1 << 20


def _int(value: Any, what: str, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise OptionError(f"{what}: expected an int, got {value!r}")
    if value < lo or (hi is not None and value >= hi):
        upper = f" and < {hi}" if hi is not None else ""
        raise OptionError(f"{what}: expected an int >= {lo}{upper}, got {value}")
    return int(value)


def is_power_of_two(n: int) -> bool:
    """``n`` is 1, 2, 4, ...: a mean over that many ranks is exact for exact inputs."""
    return n >= 1 and n & (n - 1) == 0


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array: a hash of the element index, the same in
    every process and for any slice of the param (no global RNG state)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class ExactPattern:
    """Where each contribution of one param sits: :func:`exact_pattern` builds it; every
    method takes elements ``[lo, hi)`` of the flattened param, so shards cost their size."""

    #: the param's name
    name: str
    #: elements of the param
    numel: int
    #: the param's dtype (the inputs are fed in it)
    param_dtype: str
    #: the dtype the grads are summed in (fp32 with main grads)
    grad_dtype: str
    #: ranks of the sync
    nranks: int
    #: micro-steps per step
    acc_steps: int
    #: ``W``, slots per element (the window of powers of two)
    width: int
    #: ``c = min(N, W)``, contributions per element
    held: int
    #: ``(lo, hi)`` of the element exponent ``E_i``, both included
    e_range: tuple
    #: the 64-bit hash of ``(seed, name)`` the signs and exponents come from
    key: int

    @property
    def contributions(self) -> int:
        """``N = nranks * acc_steps``; contribution ``j`` is rank ``j // acc_steps``,
        micro-step ``j % acc_steps``."""
        return self.nranks * self.acc_steps

    def _span(self, lo: int, hi: Optional[int]) -> tuple:
        hi = self.numel if hi is None else hi
        if not 0 <= lo <= hi <= self.numel:
            raise OptionError(f"{self.name}: elements [{lo}, {hi}) are not within [0, "
                              f"{self.numel})")
        return lo, hi

    def _structure(self, lo: int, hi: int) -> tuple:
        """``(E, a, b, signs, start)`` per element: slot of the t-th held contribution
        ``(b + a*t) mod W``, its sign bit ``t`` of ``signs``, contributions from ``start``."""
        idx = np.arange(lo, hi, dtype=np.uint64)
        with np.errstate(over="ignore"):
            base = idx * np.uint64(2) + np.uint64(self.key)
            signs = _mix(base)
            shape = _mix(base + np.uint64(1))
        e_lo, e_hi = self.e_range
        exps = (e_lo + (shape % np.uint64(e_hi - e_lo + 1)).astype(np.int64))
        units = np.array([a for a in range(1, self.width + 1)
                          if math.gcd(a, self.width) == 1], dtype=np.int64)
        a = units[((shape >> np.uint64(16)) % np.uint64(len(units))).astype(np.int64)]
        b = ((shape >> np.uint64(40)) % np.uint64(self.width)).astype(np.int64)
        n = self.contributions
        start = (np.arange(lo, hi, dtype=np.int64) % n) * self.held % n
        return exps, a, b, signs, start

    def _chunks(self, lo: int, hi: int):
        """``(lo, hi)`` pieces of at most CHUNK elements: bounded temporaries."""
        for start in range(lo, hi, CHUNK):
            yield start, min(start + CHUNK, hi)

    def contribution(self, j: int, lo: int = 0, hi: Optional[int] = None) -> np.ndarray:
        """Contribution ``j``'s float64 values over elements ``[lo, hi)`` (flat)."""
        j = _int(j, "contribution", 0, self.contributions)
        lo, hi = self._span(lo, hi)
        out = np.zeros(hi - lo)
        for clo, chi in self._chunks(lo, hi):
            exps, a, b, signs, start = self._structure(clo, chi)
            t = (j - start) % self.contributions  # its position among the element's held
            held = t < self.held
            t = np.where(held, t, 0)
            neg = ((signs >> t.astype(np.uint64)) & np.uint64(1)).astype(bool)
            value = np.ldexp(np.where(neg, -1.0, 1.0), exps + (b + a * t) % self.width)
            out[clo - lo:chi - lo] = np.where(held, value, 0.0)
        return out

    def total(self, lo: int = 0, hi: Optional[int] = None) -> tuple:
        """``(sum, sum|x|)`` over every contribution, float64 and exact, elements ``[lo, hi)``."""
        lo, hi = self._span(lo, hi)
        total, absolute = np.empty(hi - lo), np.empty(hi - lo)
        for clo, chi in self._chunks(lo, hi):
            exps, a, b, signs, _start = self._structure(clo, chi)
            units = np.zeros(chi - clo, dtype=np.int64)  # in quanta 2**E_i: below 2**W
            every = np.zeros(chi - clo, dtype=np.int64)
            for t in range(self.held):
                bit = np.int64(1) << ((b + a * t) % self.width)
                neg = ((signs >> np.uint64(t)) & np.uint64(1)).astype(bool)
                units += np.where(neg, -bit, bit)
                every += bit
            total[clo - lo:chi - lo] = np.ldexp(units.astype(np.float64), exps)
            absolute[clo - lo:chi - lo] = np.ldexp(every.astype(np.float64), exps)
        return total, absolute

    def decode(self, output: Any, *, divisor: int = 1, offset: int = 0) -> "Contributions":
        """Which contributions ``output`` (elements ``offset ..`` of the result, in any float
        dtype) holds: see :func:`decode_contributions` (``divisor`` likewise)."""
        out = np.asarray(output).reshape(-1)
        lo, hi = self._span(offset, offset + out.size)
        terms = np.stack([self.contribution(j, lo, hi) for j in range(self.contributions)])
        return decode_inputs(terms, out, divisor=divisor, acc_steps=self.acc_steps, offset=lo)


@dataclass(frozen=True)
class Contributions:
    """What :func:`decode_contributions` found, per element (rows) and contribution
    ``j = rank * acc_steps + k`` (columns): ``held`` the contributions the element was built
    from, ``present`` those the output holds, ``valid`` False where the output is no subset
    of them (a doubled contribution, a value from elsewhere, a rounding: then ``present`` is
    all False)."""

    #: elements x contributions, True where the element was built from it
    held: np.ndarray
    #: elements x contributions, True where the output holds it
    present: np.ndarray
    #: per element, False where the output is no subset of its contributions
    valid: np.ndarray
    #: micro-steps per step (``j = rank * acc_steps + k``)
    acc_steps: int
    #: the param index of row 0 (a shard's first element)
    offset: int = 0

    def source(self, j: int) -> tuple:
        """``(rank, micro-step)`` of contribution ``j``."""
        return divmod(int(j), self.acc_steps)

    def missing(self) -> np.ndarray:
        """``(element, j)`` pairs: held by the element, absent from a decodable output."""
        rows, cols = np.nonzero(self.held & ~self.present & self.valid[:, None])
        return np.stack([rows + self.offset, cols], axis=1)

    def describe(self, element: int) -> str:
        """One line for element ``element`` (an index of the param, as ``offset`` counts)."""
        i = element - self.offset
        if not self.valid[i]:
            return (f"element {element}: not a sum of its contributions (doubled, from "
                    f"another element, or rounded)")
        def names(mask: np.ndarray) -> str:
            return ", ".join(f"rank {r} k {k}" for r, k in map(self.source, np.flatnonzero(mask)))
        gone = self.held[i] & ~self.present[i]
        return (f"element {element}: holds {names(self.present[i]) or 'nothing'}"
                + (f"; missing {names(gone)}" if gone.any() else ""))


def decode_inputs(inputs: Any, output: Any, *, divisor: int = 1, acc_steps: int = 1,
                  offset: int = 0) -> Contributions:
    """Which of ``inputs`` each element of ``output`` holds, read from the inputs themselves
    (no seed needed: the dumped ``in/`` arrays will do). ``inputs`` is ``N x n`` (row
    ``j = rank * acc_steps + k``, flat elements), ``output`` the ``n`` results, ``divisor``
    ``nranks`` for a mean. Where an element's nonzero inputs are distinct powers of two,
    either sign (as :func:`exact_inputs` makes them), the output counted in the smallest
    of them is a signed sum of distinct bits, one per input present; elements whose inputs
    are not so, or whose output is no such sum, are not ``valid``. ``acc_steps`` maps a row
    to its rank and micro-step; ``offset`` is the param index of element 0 (a shard).

    Raises:
        OptionError: inputs and output of different sizes, or a divisor below 1.
    """
    divisor = _int(divisor, "divisor", 1)
    x = np.asarray(inputs, dtype=np.float64)
    out = np.asarray(output).astype(np.float64).reshape(-1)
    x = x.reshape(x.shape[0], -1)
    if x.shape[1] != out.size:
        raise OptionError(f"decode: {x.shape[1]} element(s) of inputs for {out.size} of output")
    held = (x != 0) & np.isfinite(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.where(held, np.abs(x), np.inf).min(axis=0)
        ratio = np.where(held, np.log2(np.abs(x) / q), 0.0)
        slot = np.rint(ratio)
        valid = (held.any(axis=0) & np.all(~held | ((ratio == slot) & (slot < 62)), axis=0)
                 & np.all(np.isfinite(x), axis=0))
        slot = np.where(held & valid, slot, 0).astype(np.int64)
        bits = np.where(held & valid, np.int64(1) << slot, 0)
        used = np.bitwise_or.reduce(bits, axis=0)
        valid &= bits.sum(axis=0) == used  # distinct powers: no two inputs share a bit
        units = out * divisor / np.where(valid, q, 1.0)
        whole = np.rint(units)
        valid &= np.isfinite(units) & (np.abs(units - whole) <= 0.25) & (np.abs(whole) < 2.0 ** 62)
    whole = np.where(valid, whole, 0).astype(np.int64)
    neg = held & (x < 0)
    shifted = whole + np.where(neg, bits, 0).sum(axis=0)  # a negative one's bit: left out
    present = held & ((((shifted >> slot) & 1) == 1) != neg)
    valid &= (shifted >= 0) & ((shifted & ~used) == 0)
    present &= valid
    return Contributions(held.T, present.T, valid, acc_steps, offset)


def _window(param_dtype: str, grad_dtype: str, nranks: int, name: str) -> tuple:
    """``(W, (E_lo, E_hi))``: slots per element and the range of E_i for these dtypes."""
    width = _PRECISION[grad_dtype] - HEADROOM_BITS
    shift = max(MIN_SHIFT, math.ceil(math.log2(nranks)))
    emin = max(_EXPONENTS[param_dtype][0], _EXPONENTS[grad_dtype][0]) + shift
    emax = min(_EXPONENTS[param_dtype][1], _EXPONENTS[grad_dtype][1])
    lo, hi = max(emin, _E_RANGE[0]), min(emax - width, _E_RANGE[1])
    if hi < lo:  # a narrow exponent range (fp16 values, fp32 sums): fewer slots
        width = min(width, emax - emin)
        lo = hi = emin
    if width < 1:
        raise OptionError(f"{name}: {param_dtype} values cannot hold exact sums over "
                          f"{nranks} ranks (the mean's 1/{nranks} leaves no normal range)")
    return width, (lo, hi)


def exact_pattern(spec: Any, name: str, *, seed: int = 0) -> ExactPattern:
    """The :class:`ExactPattern` of param ``name`` (a fused param of ``spec``, which must
    give ``nranks``): what :func:`exact_inputs` feeds and how to decode a result.

    Args:
        spec: a :class:`~mpifusion.spec.Spec`, a dict or a JSON spec path.
        name: a fused param of the spec.
        seed: varies the signs and exponents (the same seed, the same inputs).

    Raises:
        OptionError: no ``nranks`` in the spec, an unknown param, or dtypes whose range
            cannot hold exact sums over so many ranks.
    """
    spec = as_spec(spec)
    seed = _int(seed, "seed", 0)
    if spec.nranks is None:
        raise OptionError("nranks: exact inputs need the spec's nranks (contribution "
                          "j = rank * acc_steps + micro-step of nranks * acc_steps)")
    by_name = {p.name: p for p in spec.fused_params()}
    if name not in by_name:
        raise OptionError(f"{name}: not a fused param of the spec (fused: "
                          f"{', '.join(list(by_name)[:8])}{' ...' if len(by_name) > 8 else ''})")
    p = by_name[name]
    param_dtype = dtype_name(p.dtype)
    grad_dtype = dtype_name(grad_dtype_for(p.dtype, spec.use_main_grad))
    width, e_range = _window(param_dtype, grad_dtype, spec.nranks, name)
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return ExactPattern(name, p.numel, param_dtype, grad_dtype, spec.nranks, spec.acc_steps,
                        width, min(spec.nranks * spec.acc_steps, width), e_range,
                        int.from_bytes(digest, "little") & _MASK64)


def exact_inputs(spec: Any, rank: int, step: int, *, seed: int = 0) -> dict:
    """``{name: gradient}`` that ``rank`` feeds at micro-step ``step`` (0 .. acc_steps-1) for
    every fused param of ``spec`` (a Spec, dict or JSON path with ``nranks``): param shape,
    param dtype (as backward gives them; fp32 main grads take them exactly). Every partial
    sum over ranks and micro-steps, in any order, is exact in the grad dtype, so a correct
    sync matches ``check(..., exact=True)`` bit for bit. Deterministic in (spec, rank, step,
    seed); vary ``seed`` between training steps.

    Raises:
        OptionError: no ``nranks`` in the spec, or ``rank``/``step`` out of range.
    """
    spec = as_spec(spec)
    pats = [exact_pattern(spec, p.name, seed=seed) for p in spec.fused_params()]
    rank = _int(rank, "rank", 0, spec.nranks)
    step = _int(step, "step (the micro-step)", 0, spec.acc_steps)
    out = {}
    for p, pat in zip(spec.fused_params(), pats):
        values = pat.contribution(rank * spec.acc_steps + step)
        out[p.name] = values.astype(as_dtype(p.dtype)).reshape(p.shape)
    return out


def exact_sum(spec: Any, name: str, *, seed: int = 0) -> tuple:
    """``(sum, sum|x|)`` of param ``name`` over every rank and micro-step of
    :func:`exact_inputs` (float64, exact, param shape): the sum a correct sync holds.
    ``spec`` and ``seed`` as given to :func:`exact_inputs`."""
    spec = as_spec(spec)
    pat = exact_pattern(spec, name, seed=seed)
    shape = next(p.shape for p in spec.fused_params() if p.name == name)
    total, absolute = pat.total()
    return total.reshape(shape), absolute.reshape(shape)


def decode_contributions(spec: Any, name: str, output: Any, *, seed: int = 0,
                         divisor: int = 1, offset: int = 0) -> Contributions:
    """Which contributions (rank, micro-step) each element of ``output`` holds, for inputs
    of :func:`exact_inputs` with this ``seed``: ``output`` is param ``name``'s result (flat
    elements from ``offset``: a shard), ``divisor`` ``nranks`` for a mean. Exact for sums and
    power-of-two means; for other divisors the output is rounded to the nearest quantum
    first (right while the mean's rounding stays below a quarter of one). ``spec`` as given
    to :func:`exact_inputs`.

    Returns:
        A :class:`Contributions` (``missing()``, ``describe(element)``).
    """
    divisor = _int(divisor, "divisor", 1)
    return exact_pattern(spec, name, seed=seed).decode(output, divisor=divisor, offset=offset)


# --------------------------------------------------------------------------- checking


def _gamma(k: int, u: float, grad_dtype: str, nranks: int) -> float:
    if k * u >= 0.5:
        raise OptionError(f"exact inputs: a mean over {nranks} ranks rounds {k} times in "
                          f"{grad_dtype}, too often for a bound below the result itself")
    return k * u / (1 - k * u)


def _tiny(dtype: str) -> float:
    """Half the smallest subnormal: the absolute error of one rounding there."""
    return 2.0 ** (_EXPONENTS[dtype][0] - _PRECISION[dtype])


def exact_tolerance(mean: Any, abs_sum: Any, *, grad_dtype: Any, nranks: int, average: bool,
                    prescaled: bool = True) -> np.ndarray:
    """Per element, how far a correct result of exact inputs may be from the exact ``mean``
    (the sum, or the float64 sum / nranks): 0 for a sum and for a mean over a power-of-two
    ``nranks`` (every step exact); otherwise the roundings of the ``1/n``: with ``prescaled``
    (each rank scales its accumulated gradient by ``fl(1/n)`` before the sum, so each of the
    ``R - 1`` additions may round too) ``gamma(R + 2) * abs_sum / n``, else ``gamma(3) *
    |mean|`` (``fl(1/n)``, the product, the rounding to the grad dtype: less than the smallest
    contribution / n, thanks to the two spare bits), ``gamma(k) = k*u/(1 - k*u)`` with ``u``
    the grad dtype's unit roundoff; plus the float64 reference's own rounding (2**-52 of it)
    and half a subnormal per rounding.
    ``inf``/NaN in ``abs_sum`` (Inf/NaN inputs, overflow) pass through, as in error_bound.
    ``grad_dtype`` is the dtype the sum is taken in; ``average`` whether the result is the
    mean (else the sum, always exact).

    Raises:
        OptionError: a mean that rounds too often for a bound below the result.
    """
    mean = np.asarray(mean, dtype=np.float64)
    abs_sum = np.asarray(abs_sum, dtype=np.float64)
    if not average or is_power_of_two(nranks):
        return np.where(np.isfinite(abs_sum), 0.0, abs_sum) + np.zeros_like(mean)
    g = dtype_name(grad_dtype)
    u = unit_roundoff(g)
    with np.errstate(invalid="ignore", over="ignore"):
        if prescaled:
            k = nranks + 2
            tol = abs_sum / nranks * _gamma(k, u, g, nranks) + 2 * k * _tiny(g)
        else:
            tol = np.abs(mean) * _gamma(3, u, g, nranks) + 3 * _tiny(g)
        tol = tol + np.abs(mean) * 2.0 ** -52
    return np.where(np.isfinite(abs_sum), tol, abs_sum)


def exact_formula(grad_dtype: Any, *, nranks: int, average: bool,
                  prescaled: bool = True) -> str:
    """The rule of :func:`exact_tolerance` in words, for reports."""
    g = dtype_name(grad_dtype)
    if not average:
        return "exact inputs: bit-exact (sum)"
    if is_power_of_two(nranks):
        return f"exact inputs: bit-exact (mean over {nranks} rank(s), a power of two)"
    if prescaled:
        k = nranks + 2
        return (f"exact inputs, mean over {nranks} ranks (not a power of two), pre-scaled "
                f"allowed: |out - S/n| <= gamma({k}) * sum|x|/n + eta, u = u({g})")
    return (f"exact inputs, mean over {nranks} ranks (not a power of two): |out - S/n| <= "
            f"gamma(3) * |S/n| + eta, u = u({g}) (fl(1/n), product, rounding)")


def quantum(x: Any) -> np.ndarray:
    """Per element the value of the lowest set bit of ``x`` (float64): ``x`` is an odd
    multiple of it; ``inf`` for 0, Inf and NaN (they constrain nothing)."""
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x) & (x != 0)
    mant, exp = np.frexp(np.where(finite, x, 1.0))
    ints = (np.abs(mant) * 2.0 ** 53).astype(np.int64)
    low = ints & -ints
    return np.where(finite, np.ldexp(low.astype(np.float64), exp - 53), np.inf)


class ExactInputCheck:
    """Whether the inputs fed to ``check(..., exact=True)`` are exact in every order: per
    element every input is a multiple of the finest bit ``q`` among them, so every partial
    sum is one of at most ``sum|x| / q`` quanta; they are exact when that stays below
    ``2**p`` (``p`` the grad dtype's precision) and, for a power-of-two mean, ``q / n`` is
    still a value of the grad dtype. Feed each input with :meth:`add`, then :meth:`verify`."""

    def __init__(self, name: str, numel: int, grad_dtype: Any, nranks: int,
                 average: bool) -> None:
        self.name, self.grad_dtype = name, dtype_name(grad_dtype)
        self.nranks, self.average = nranks, average
        self.finest = np.full(numel, np.inf)
        self.source = np.zeros(numel, dtype=np.int32)
        self.labels: list = []

    def add(self, x: Any, label: str) -> None:
        """One input (``label``: where it was read, e.g. ``rank 2 in/w/0``)."""
        q = quantum(x).reshape(-1)
        finer = q < self.finest
        self.finest[finer] = q[finer]
        self.source[finer] = len(self.labels)
        self.labels.append(label)

    def verify(self, abs_sum: Any) -> None:
        """Raise DumpError (one line) naming the first element whose sums may round."""
        g, p = self.grad_dtype, _PRECISION[self.grad_dtype]
        absolute = np.asarray(abs_sum, dtype=np.float64).reshape(-1)
        q = self.finest
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            counted = np.isfinite(q) & ~np.isinf(absolute)  # Inf/NaN inputs: compared as such
            quanta = absolute / q
            wide = counted & ~(quanta < 2.0 ** p)
            fine = np.zeros_like(wide)
            if self.average and is_power_of_two(self.nranks):
                fine = counted & (q / self.nranks < 2.0 ** (_EXPONENTS[g][0] - p + 1))
        bad = wide | fine
        if not bad.any():
            return
        i = int(np.flatnonzero(bad)[0])
        label = self.labels[self.source[i]]
        head = (f"exact=True needs inputs whose partial sums are exact in {g} "
                f"(mpifusion.oracle.exact_inputs): param {self.name}, element {i}, {label}")
        if wide[i]:
            why = (f"its finest bit is {q[i]:.6g}, and sum|x| = {absolute[i]:.9g} over every "
                   f"rank and micro-step is {quanta[i]:.6g} of those, more than the "
                   f"{p} bits of {g} hold")
        else:
            why = (f"its finest bit {q[i]:.6g} divided by {self.nranks} ranks is below "
                   f"{g}'s smallest value, so the mean rounds")
        more = int(bad.sum()) - 1
        raise DumpError(f"{head}: {why}" + (f" ({more} more element(s) like it)" if more else ""))
