"""The exact reference: each element's sum (or mean) of the inputs, rounded once.

The float64 reference rounded at every addition, and once more on the way to the grad dtype
(a float64 sum cast to fp32 can differ from the exactly rounded fp32 sum: double
rounding), so the bound had to carry the reference's own roundings. Here the sum is exact
and the only rounding is the last one, ``RN_even(sum / divisor)`` into the grad dtype.

How, per chunk of elements (vectorized numpy, memory bounded by the chunk):

* **fast path** (fp32/bf16/fp16 terms): the float64 sum is exact when every term is a
  multiple of the smallest term's quantum ``q`` and ``sum|x| < 2^53 q``. With ``m`` the
  smallest nonzero ``|x|`` of an element, ``q > m 2^-p`` (``p`` the terms' precision), so
  ``sum|x|`` (float64, rounded by less than a factor 2) ``<= 2^(52-p) m`` proves it. Then
  ``s / divisor`` is rounded once: exactly for a power-of-two divisor; otherwise
  ``fl64(s / n)`` can only mislead the rounding when it lands on a midpoint of the target,
  which is settled by the exact sign of ``s - mid * n``.
* **integer path** (everything else: fp64 terms, exponents far apart, Inf/NaN, overflow):
  each term is ``M 2^E`` with ``M`` a 53-bit integer; its 32-bit pieces are added into
  int64 limbs at fixed positions from the element's lowest term (96 guard bits below),
  carries are normalized, a mean is long-divided by ``n`` from the top (the remainder is
  sticky), and the top 64 bits plus a sticky bit are rounded to nearest even at the
  target's precision (subnormals included; past the largest finite value: overflow).

:func:`exact_sum` holds every term; :class:`ExactStream` (what ``check`` uses) holds one:
it keeps the fast path's running sums and proof, and reads the terms again only for the
elements that take the integer path, so a check's memory follows one param, not every
rank's inputs of it.

Special values follow IEEE: a NaN, or both infinities, give NaN; one sign of infinity gives
that infinity. An exact 0 is ``+0`` unless every term is ``-0`` (as IEEE addition gives); a
nonzero sum that rounds to 0 keeps its sign.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Optional

import numpy as np

from ..dtypes import as_dtype

#: target precisions (significand bits), smallest subnormal exponents, largest finite values
_PREC = {"float64": 53, "float32": 24, "float16": 11, "bfloat16": 8}
_EMIN_SUB = {"float64": -1074, "float32": -149, "float16": -24, "bfloat16": -133}
_MAX = {"float64": float(np.finfo(np.float64).max), "float32": float(np.finfo(np.float32).max),
        "float16": 65504.0, "bfloat16": float.fromhex("0x1.fep127")}
_UNIT = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11,
         "bfloat16": 2.0 ** -8}
_UNDER = {"float64": 2.0 ** -1075, "float32": 2.0 ** -150, "float16": 2.0 ** -25,
          "bfloat16": 2.0 ** -134}

#: elements per chunk: 8 terms of float64 work arrays stay within a core's L2
CHUNK = 1 << 15
_GUARD = 96          # guard bits below an element's lowest term (a mean's quotient bits)
_MASK32 = np.int64(0xFFFFFFFF)


@dataclass
class ExactResult:
    """What :func:`exact_sum` gives per element (flat float64/bool arrays)."""

    value: np.ndarray     # RN_even(sum / divisor) in the target dtype, held as float64
    #                       (or in that dtype itself: ExactStream.result(native=True))
    absolute: np.ndarray  # float64 sum|x| (for the bound): inf where an input is Inf/NaN,
    #                       NaN where it overflows (or the value does) with finite inputs
    inexact: np.ndarray   # the value is not the exact sum / divisor (it was rounded)
    overflow: np.ndarray  # finite inputs whose exact result or sum|x| is beyond the range
    dtype: str = "float64"

    def error_of(self, lo: int = 0, hi: Optional[int] = None) -> np.ndarray:
        """A bound on ``|exact - value|`` over ``[lo, hi)``: 0 where the value is exact,
        else ``u(dtype)|value| + underflow(dtype)`` (at least half an ulp). Kept as the
        ``inexact`` marks (a byte per element) and formed on demand, a chunk at a time."""
        value = np.asarray(self.value[lo:hi], dtype=np.float64)  # held natively, maybe
        err = np.abs(value)
        err *= _UNIT[self.dtype]
        err += _UNDER[self.dtype]
        err[~self.inexact[lo:hi] | ~np.isfinite(value)] = 0.0
        return err

    @property
    def error(self) -> np.ndarray:
        """:meth:`error_of` every element."""
        return self.error_of()


def _name(dtype: object) -> str:
    name = as_dtype(dtype).name
    if name not in _PREC:
        raise ValueError(f"exact reference: {name} is not a floating grad dtype "
                         f"(float16, bfloat16, float32, float64)")
    return name


def _is_pow2(n: int) -> bool:
    return n & (n - 1) == 0


def _round_float64(q: np.ndarray, name: str) -> np.ndarray:
    """``q`` (float64) rounded to nearest even in ``name``, as float64 (inf past max).
    fp32 by numpy's cast (correctly rounded in hardware); fp16 and bf16 by scaling to an
    integer and ``rint``, which depends on no library's cast."""
    with np.errstate(over="ignore", invalid="ignore"):
        if name == "float64":
            return q.copy()
        if name == "float32":
            return q.astype(np.float32).astype(np.float64)
        _, e = np.frexp(q)
        ue = np.maximum(e - _PREC[name], _EMIN_SUB[name])
        r = np.ldexp(np.rint(np.ldexp(q, -ue)), ue)
        r[np.abs(r) > _MAX[name]] = np.inf * np.sign(r[np.abs(r) > _MAX[name]])
        return r


class ExactSum:
    """Terms added one by one (kept by reference, not copied), summed exactly on demand.

    ``add(x)``: a term, values of a float dtype (fp16, bf16, fp32, fp64, native or as
    float64), all of one shape. ``result(dtype, divisor)``: per element
    ``RN_even(sum / divisor)`` in ``dtype``, rounded once (see the module docstring).
    """

    def __init__(self, chunk: int = CHUNK) -> None:
        self._terms: List[np.ndarray] = []
        self._shape: Optional[tuple] = None
        self._chunk = int(chunk)

    def add(self, x: np.ndarray) -> None:
        """Add one term (its values are read when :meth:`result` runs)."""
        x = np.asarray(x)
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            raise ValueError(f"exact reference: term of dtype {x.dtype}, expected a float")
        if self._shape is None:
            self._shape = x.shape
        elif x.shape != self._shape:
            raise ValueError(f"exact reference: term of shape {list(x.shape)}, expected "
                             f"{list(self._shape)}")
        self._terms.append(x.reshape(-1))

    def result(self, dtype: object, divisor: int = 1) -> ExactResult:
        """The exactly rounded ``sum / divisor`` in ``dtype`` (flat arrays)."""
        if not self._terms:
            raise ValueError("exact reference: expected at least one term")
        return exact_sum(self._terms, dtype, divisor, chunk=self._chunk)

    def rounded(self, dtype: object, divisor: int = 1) -> np.ndarray:
        """``result(dtype, divisor).value`` in the terms' shape."""
        return self.result(dtype, divisor).value.reshape(self._shape)


def exact_sum(terms: Iterable[np.ndarray], dtype: object, divisor: int = 1, *,
              chunk: int = CHUNK) -> ExactResult:
    """Per element of the flat ``terms`` (float arrays of one size): the sum divided by the
    positive int ``divisor``, rounded once to nearest even in ``dtype``."""
    name = _name(dtype)
    terms = [np.asarray(t).reshape(-1) for t in terms]
    if not terms:
        raise ValueError("exact reference: expected at least one term")
    divisor = _divisor(divisor)
    size = terms[0].size
    for t in terms:
        if t.size != size:
            raise ValueError(f"exact reference: terms of {t.size} and {size} elements")
        if t.dtype.kind != "f" and t.dtype.name != "bfloat16":
            raise ValueError(f"exact reference: term of dtype {t.dtype}, expected a float")
    # the fast path's criterion needs every term to be a value of a p <= 26 bit dtype
    prec = max(_PREC.get(t.dtype.name, 53) for t in terms)
    res = ExactResult(np.empty(size), np.empty(size), np.zeros(size, dtype=bool),
                      np.zeros(size, dtype=bool), name)
    chunk = max(1, int(chunk))
    for lo in range(0, size, chunk):
        hi = min(size, lo + chunk)
        _chunk(terms, lo, hi, name, divisor, prec, res)
    return res


def _divisor(divisor: object) -> int:
    """``divisor`` as a positive int below 2^26 (ValueError otherwise)."""
    if isinstance(divisor, bool) or not isinstance(divisor, (int, np.integer)) \
            or not 0 < int(divisor) < 2 ** 26:
        raise ValueError(f"exact reference: divisor {divisor!r}: expected an int in "
                         f"1 .. 2^26 - 1")
    return int(divisor)


def _chunk(terms: list, lo: int, hi: int, name: str, n: int, prec: int,
           res: ExactResult) -> None:
    """One chunk ``[lo, hi)`` into ``res``: float64 sum where it is provably exact, the
    integer path for the rest."""
    c = hi - lo
    s = res.value[lo:hi]
    a = res.absolute[lo:hi]
    tmp = np.empty(c)
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(s, terms[0][lo:hi], casting="unsafe")
        np.abs(s, out=a)
        fast_ok = prec <= 26 and name != "float64"
        if fast_ok:
            m = np.where(a > 0, a, np.inf)
        for t in terms[1:]:
            np.copyto(tmp, t[lo:hi], casting="unsafe")
            s += tmp
            np.abs(tmp, out=tmp)
            a += tmp
            if fast_ok:
                np.minimum(m, tmp, out=m, where=tmp > 0)
        if fast_ok:
            m *= 2.0 ** (52 - prec)
            fast = a <= m           # False for inf/NaN: those take the integer path
            value, inexact = _round_fast(s, n, name)
            fast &= np.isfinite(value)
        else:
            fast = np.zeros(c, dtype=bool)
            value, inexact = s, np.zeros(c, dtype=bool)
    slow = np.flatnonzero(~fast)
    over = res.overflow[lo:hi]
    if slow.size:
        sub = np.stack([np.asarray(t[lo:hi][slow], dtype=np.float64) for t in terms])
        v, inx, special, ovf = _integer_path(sub, name, n)
        value[slow] = v
        inexact[slow] = inx
        a[slow[special]] = np.inf                    # |NaN| counts as inf, as before
        over[slow] = ovf
    with np.errstate(over="ignore", invalid="ignore"):
        over |= np.isnan(a)                            # cannot happen for special elements
        over |= np.isinf(a) & np.isfinite(value)       # sum|x| overflowed float64
    a[over] = np.nan
    if value is not s:
        s[...] = value
    res.inexact[lo:hi] = inexact


def _round_fast(s: np.ndarray, n: int, name: str) -> tuple:
    """``(RN(s / n) in name, inexact)`` for an exact float64 ``s`` of terms with at most
    26 significand bits (so ``value * n`` is exact in float64)."""
    if _is_pow2(n):
        q = s / n if n > 1 else s              # exact: no float64 underflow this high
        value = _round_float64(q, name)
        return value, value != q
    q = s / n                                  # one float64 rounding, settled below
    value = _round_float64(q, name)
    d = q - value                              # exact (both within a factor 2, or value 0)
    bits = d.view(np.int64) & np.int64(0x000FFFFFFFFFFFFF)
    cand = np.flatnonzero((bits == 0) & (d != 0) & np.isfinite(value))
    if cand.size:
        qc, vc = q[cand], value[cand]
        other = qc + d[cand]                   # the neighbour on q's other side, if q is a
        mid = (_round_float64(other, name) == other) & (other != vc)  # midpoint of the two
        if mid.any():
            idx = cand[mid]
            qm, vm, om = q[idx], value[idx], other[mid]
            sign = np.sign(s[idx] - qm * n)    # qm * n exact: p + 1 bits times n < 2^26
            up, down = np.maximum(vm, om), np.minimum(vm, om)
            value[idx] = np.where(sign > 0, up, np.where(sign < 0, down, vm))
    with np.errstate(over="ignore", invalid="ignore"):
        inexact = value * n != s
    return value, inexact


def _integer_path(x: np.ndarray, name: str, n: int) -> tuple:
    """Exact sums of the columns of ``x`` (terms x elements, float64), divided by ``n`` and
    rounded once: ``(value, inexact, special, overflow)``."""
    finite = np.isfinite(x)
    special = ~finite.all(axis=0)
    value = np.empty(x.shape[1])
    inexact = np.zeros(x.shape[1], dtype=bool)
    overflow = np.zeros(x.shape[1], dtype=bool)
    if special.any():
        xs = x[:, special]
        nan = np.isnan(xs).any(axis=0)
        pos = (xs == np.inf).any(axis=0)
        neg = (xs == -np.inf).any(axis=0)
        value[special] = np.where(nan | (pos & neg), np.nan, np.where(pos, np.inf, -np.inf))
    regular = np.flatnonzero(~special)
    step = 4096
    for lo in range(0, regular.size, step):
        idx = regular[lo:lo + step]
        v, inx = _limbs_round(x[:, idx], name, n)
        value[idx] = v
        inexact[idx] = inx
    overflow[regular] = ~np.isfinite(value[regular])
    return value, inexact, special, overflow


def _limbs_round(x: np.ndarray, name: str, n: int) -> tuple:
    """Integer accumulation of finite float64 terms (terms x elements), see the module
    docstring."""
    nterms, m = x.shape
    frac, exp = np.frexp(x)
    mant = np.ldexp(frac, 53).astype(np.int64)           # x = mant * 2^(exp - 53), exact
    exp = exp.astype(np.int64) - 53
    nonzero = mant != 0
    all_zero = ~nonzero.any(axis=0)
    neg_zero = (np.signbit(x) | nonzero).all(axis=0) & all_zero  # every term -0
    big = np.int64(1 << 40)
    base = np.where(nonzero, exp, big).min(axis=0)
    base = np.where(all_zero, 0, base) - _GUARD
    shift_div = 0
    if n > 1 and _is_pow2(n):
        shift_div, n = n.bit_length() - 1, 1              # exact: move the binary point
    shift = np.where(nonzero, exp - base, _GUARD)         # >= GUARD for every term
    top_bit = int(shift.max()) + 53 + nterms.bit_length() + 1
    nlimbs = top_bit // 32 + 2
    limbs = np.zeros((nlimbs, m), dtype=np.int64)
    flat = limbs.reshape(-1)
    cols = np.arange(m, dtype=np.int64)
    for i in range(nterms):
        mi = mant[i]
        sign = np.where(mi < 0, -1, 1).astype(np.int64)
        mag = np.abs(mi)
        j, o = shift[i] >> 5, shift[i] & 31
        lo_part = (mag & _MASK32) << o                    # < 2^63
        hi_part = (mag >> 32) << o                        # < 2^52
        c0 = lo_part & _MASK32
        c1 = (lo_part >> 32) + (hi_part & _MASK32)
        c2 = hi_part >> 32
        base_ix = j * m + cols
        flat[base_ix] += sign * c0
        flat[base_ix + m] += sign * c1
        flat[base_ix + 2 * m] += sign * c2
    _normalize(limbs)
    negative = limbs[-1] < 0
    limbs[:, negative] *= -1
    _normalize(limbs)
    rem = np.zeros(m, dtype=np.int64)
    if n > 1:
        for k in range(nlimbs - 1, -1, -1):
            cur = (rem << 32) + limbs[k]
            q = cur // n
            rem = cur - q * n
            limbs[k] = q
    nz = limbs != 0
    any_nz = nz.any(axis=0)
    top = nlimbs - 1 - np.argmax(nz[::-1], axis=0)
    top = np.where(any_nz, top, 2)
    lt = limbs[top, cols].astype(np.uint64)
    l1 = limbs[top - 1, cols].astype(np.uint64)
    l2 = limbs[top - 2, cols].astype(np.uint64)
    bl = np.frexp(lt.astype(np.float64))[1].astype(np.int64)   # bit length, 1 .. 32
    bl = np.where(any_nz, bl, 1)
    blu = bl.astype(np.uint64)
    window = (lt << (np.uint64(64) - blu)) | (l1 << (np.uint64(32) - blu)) | (l2 >> blu)
    below = np.logical_or.accumulate(nz, axis=0)
    sticky = (rem != 0) | ((l2 & ((np.uint64(1) << blu) - np.uint64(1))) != 0)
    sticky |= np.where(top >= 3, below[np.maximum(top - 3, 0), cols], False)
    e_top = base - shift_div + 32 * top + bl - 1
    ue = np.maximum(e_top - (_PREC[name] - 1), _EMIN_SUB[name])
    k = ue - (e_top - 63)                                 # bits dropped from the window
    tiny = k > 64                                         # below half the smallest subnormal
    kk = np.clip(k, 11, 64).astype(np.uint64)
    one = np.uint64(1)
    half_bit = (window >> (kk - one)) & one
    lower = window & ((one << (kk - one)) - one)
    kept = (window >> (kk - one)) >> one
    up = (half_bit == one) & ((lower != 0) | sticky | ((kept & one) == one))
    kept = kept + up.astype(np.uint64)
    inexact = (half_bit == one) | (lower != 0) | sticky
    kept = np.where(tiny, np.uint64(0), kept)
    inexact |= tiny
    with np.errstate(over="ignore"):
        value = np.ldexp(kept.astype(np.float64), ue)
    value[value > _MAX[name]] = np.inf
    value = np.where(negative, -value, value)
    value[~any_nz] = 0.0
    value[neg_zero] = -0.0
    inexact &= any_nz
    return value, inexact


def _normalize(limbs: np.ndarray) -> None:
    """Carries up: every limb but the top in [0, 2^32), the top one signed."""
    for k in range(limbs.shape[0] - 1):
        carry = limbs[k] >> 32
        limbs[k] &= _MASK32
        limbs[k + 1] += carry


class ExactStream:
    """The exact reference with one term in memory at a time: a check reads one rank's input,
    adds it here and drops it, so memory follows one param, not every rank's inputs of it.

    ``add(x)`` folds a term into running float64 accumulators, a chunk at a time: the sum,
    ``sum|x|`` and, for the fast path's proof, the smallest nonzero ``|x|`` (held in float32:
    a value of a p <= 24 bit term is one exactly). :meth:`result` rounds the proven elements
    and hands the rest (exponents far apart, fp64 terms, Inf/NaN) to the integer path, which
    needs every term of those elements: ``terms()`` yields the terms again, in the order they
    were added (re-read from the files), and only those elements' values are kept, in batches
    of at most half the terms' bytes. Same results as :func:`exact_sum`, bit for bit.
    """

    def __init__(self, size: int, chunk: int = CHUNK) -> None:
        self.size, self._chunk = int(size), max(1, int(chunk))
        self._sum: Optional[np.ndarray] = None
        self._abs: Optional[np.ndarray] = None
        self._min: Optional[np.ndarray] = None   # smallest nonzero |x| (fast path only)
        self._prec = 0
        self._count = 0
        self._bytes = 0                            # the terms' bytes, for the batch size

    def add(self, x: np.ndarray) -> None:
        """Fold one term (a float array of ``size`` elements) into the accumulators."""
        x = np.asarray(x).reshape(-1)
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            raise ValueError(f"exact reference: term of dtype {x.dtype}, expected a float")
        if x.size != self.size:
            raise ValueError(f"exact reference: terms of {x.size} and {self.size} elements")
        self._prec = max(self._prec, _PREC.get(x.dtype.name, 53))
        self._bytes += x.nbytes
        first = self._sum is None
        if first:
            self._sum, self._abs = np.empty(self.size), np.empty(self.size)
            if self._prec <= 24:
                self._min = np.empty(self.size, dtype=np.float32)
        if self._prec > 24:
            self._min = None                       # no fast path: its proof is not needed
        s, a, m = self._sum, self._abs, self._min
        tmp = np.empty(min(self._chunk, self.size))
        with np.errstate(over="ignore", invalid="ignore"):
            for lo in range(0, self.size, self._chunk):
                hi = min(self.size, lo + self._chunk)
                t = tmp[:hi - lo]
                np.copyto(t, x[lo:hi], casting="unsafe")
                if first:
                    s[lo:hi] = t
                else:
                    s[lo:hi] += t
                np.abs(t, out=t)
                if first:
                    a[lo:hi] = t
                    if m is not None:
                        m[lo:hi] = np.where(t > 0, t, np.inf)
                else:
                    a[lo:hi] += t
                    if m is not None:
                        np.minimum(m[lo:hi], t, out=m[lo:hi], where=t > 0)
        self._count += 1

    def result(self, dtype: object, divisor: int = 1, terms: Optional[Any] = None, *,
               native: bool = False) -> ExactResult:
        """The exactly rounded ``sum / divisor`` in ``dtype``. ``terms``: a callable giving
        the added terms again, in order (needed only when some element fails the fast
        path's proof). ``native``: the value held in ``dtype`` itself (float16, bfloat16,
        float32: it is a value of that dtype, exactly) rather than float64. The
        accumulators are released."""
        name = _name(dtype)
        if not self._count:
            raise ValueError("exact reference: expected at least one term")
        n = _divisor(divisor)
        s, a, m = self._sum, self._abs, self._min
        self._sum = self._min = self._abs = None
        held = as_dtype(name) if native and name != "float64" else np.dtype(np.float64)
        res = ExactResult(np.empty(self.size, dtype=held), a, np.zeros(self.size, dtype=bool),
                          np.zeros(self.size, dtype=bool), name)
        fast_ok = self._prec <= 26 and name != "float64" and m is not None
        slow_parts = []
        with np.errstate(over="ignore", invalid="ignore"):
            for lo in range(0, self.size, self._chunk):
                hi = min(self.size, lo + self._chunk)
                if fast_ok:
                    bound = m[lo:hi].astype(np.float64)
                    bound *= 2.0 ** (52 - self._prec)
                    fast = a[lo:hi] <= bound       # False for inf/NaN: the integer path
                    value, inexact = _round_fast(s[lo:hi], n, name)
                    fast &= np.isfinite(value)
                    res.value[lo:hi] = value
                    res.inexact[lo:hi] = inexact
                    slow = np.flatnonzero(~fast)
                else:
                    slow = np.arange(hi - lo)
                if slow.size:
                    slow_parts.append(slow + lo)
        s = m = None
        slow = np.concatenate(slow_parts) if slow_parts else np.zeros(0, dtype=np.int64)
        slow_parts = []
        if slow.size:
            if terms is None:
                raise ValueError("exact reference: some elements need the integer path, "
                                 "which needs the terms again (terms=None)")
            # float64 rows of every term, half the terms' bytes a batch at most
            batch = max(self._chunk, (self._bytes // 2) // (8 * self._count))
            for lo in range(0, slow.size, batch):
                idx = slow[lo:lo + batch]
                sub = np.empty((self._count, idx.size))
                i = 0
                for t in terms():
                    if i >= self._count:
                        raise ValueError("exact reference: terms() gave more terms than "
                                         "were added")
                    np.copyto(sub[i], np.asarray(t).reshape(-1)[idx], casting="unsafe")
                    i += 1
                if i != self._count:
                    raise ValueError(f"exact reference: terms() gave {i} of the "
                                     f"{self._count} terms added")
                v, inx, special, ovf = _integer_path(sub, name, n)
                sub = None
                res.value[idx] = v
                res.inexact[idx] = inx
                a[idx[special]] = np.inf            # |NaN| counts as inf, as before
                res.overflow[idx] = ovf
        with np.errstate(over="ignore", invalid="ignore"):
            for lo in range(0, self.size, self._chunk):
                hi = min(self.size, lo + self._chunk)
                over = res.overflow[lo:hi]
                ac = a[lo:hi]
                over |= np.isnan(ac)
                over |= np.isinf(ac) & np.isfinite(res.value[lo:hi])
                ac[over] = np.nan
        return res
