"""The reference of a gradient sync, and how far a correct result may be from it.

``mpifusion check`` (checking another implementation) compares against the *exact*
reference (:mod:`.exact`): per element the exact sum of the gradients that were fed in, or
their exact mean, rounded once into the grad dtype. ``mpifusion run`` (checking mpifusion
itself) still compares against a float64 sum (:class:`ReferenceSum`), whose own roundings
the bound then counts (``n_ref``). Either way an element passes when its error is within
:func:`error_bound`, a worst-case rounding-error bound (Higham, *Accuracy and Stability of
Numerical Algorithms*, ch. 3-4), not a tolerance picked to make tests pass: an
implementation that rounds more often, or in a narrower dtype, than the model below can
exceed it.

Model of a sync (the half-precision rule mpifusion implements):

1. each rank accumulates its ``K = acc_steps`` micro-step gradients in the *grad dtype*
   (fp32 main grads, or the fp16/bf16/fp32 param dtype): ``K - 1`` roundings there;
2. the ``R = nranks`` accumulated gradients are summed in fp32 (fp64 for fp64 buffers), in
   whatever order the collective chooses: at most ``R - 1`` roundings along any path;
3. an average multiplies by ``fl(1/R)``: two more roundings in the reduce dtype, and one in
   the grad dtype when a half-precision buffer is pre-scaled before communicating;
4. a half-precision grad buffer receives the fp32 result rounded once.

With the exact reference ``ref = RN(V)`` (``V`` the exact sum or mean) the comparison is
``|out - RN(V)| <= |out - V| + |V - RN(V)|``: the implementation's own roundings (the
model above) plus the one rounding of the reference, which is 0 where ``V`` is a value of
the grad dtype and at most ``u |RN(V)| + underflow`` elsewhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from ..dtypes import as_dtype
from ..errors import OptionError

#: unit roundoff u (half the spacing of 1.0) and half the smallest subnormal spacing, per dtype
_UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11,
                  "bfloat16": 2.0 ** -8}
_UNDERFLOW = {"float64": 2.0 ** -1075, "float32": 2.0 ** -150, "float16": 2.0 ** -25,
              "bfloat16": 2.0 ** -134}


def unit_roundoff(dtype: object) -> float:
    """``u`` of a floating dtype: the largest relative error of one rounding to nearest.

    Args:
        dtype: float64, float32, float16 or bfloat16 (a name or a numpy dtype).

    Returns:
        ``2**-53``, ``2**-24``, ``2**-11`` or ``2**-8``.
    """
    return _UNIT_ROUNDOFF[as_dtype(dtype).name]


def reduce_dtype(grad_dtype: object) -> str:
    """The dtype a collective sums in: fp64 stays fp64, everything else is summed in fp32.

    Args:
        grad_dtype: the dtype of the grads sent (a name or a numpy dtype).
    """
    return "float64" if as_dtype(grad_dtype).name == "float64" else "float32"


@dataclass(frozen=True)
class BoundModel:
    """The constants of :func:`error_bound` for one sync, kept for reports."""

    #: ``theta/(1-theta)``, which multiplies ``c * sum|x|``
    rel: float
    #: ``eta``, added once for the roundings that land in the subnormal range
    absolute: float
    #: the bound written out with its counts of roundings, for reports
    formula: str


#: theta at which the bound stops meaning anything: theta/(1-theta) >= 1 makes it at least
#: c*sum|x| >= |reference|, so a result of 0 (or the negated result, soon after) would pass
#: every element (theta < 1 alone is not enough: theta/(1-theta) reaches 1 at 0.5)
THETA_MAX = 0.5


def _max_acc_steps(acc: str, red: str, n_red: int, nranks: int) -> int:
    """The most micro-steps whose bound still has theta < THETA_MAX (for the message)."""
    per_step = _UNIT_ROUNDOFF[acc] + nranks * _UNIT_ROUNDOFF["float64"]
    return max(0, int((THETA_MAX - n_red * _UNIT_ROUNDOFF[red]) / per_step))


def bound_model(*, grad_dtype: object, nranks: int, acc_steps: int, average: bool,
                exact_reference: bool = False) -> BoundModel:
    """The two constants of the bound (see :func:`error_bound`); ``exact_reference``: the
    reference is the exactly rounded one (no float64 roundings of its own to allow for).

    Args:
        grad_dtype: the dtype the grads are accumulated in.
        nranks: the ranks whose grads are reduced.
        acc_steps: micro-steps per step.
        average: the result is the mean over ranks (else the sum).
        exact_reference: as above.

    Raises:
        OptionError: so many roundings that the bound would be as large as the result
            (even 0 would pass); the message says how many micro-steps would do.
    """
    acc = as_dtype(grad_dtype).name
    red = reduce_dtype(acc)
    u_acc, u_red = _UNIT_ROUNDOFF[acc], _UNIT_ROUNDOFF[red]
    half = acc in ("float16", "bfloat16")
    n_acc = (acc_steps - 1) + (1 if half else 0) + (1 if (average and half) else 0)
    n_red = (nranks - 1) + (2 if average else 0)
    # the float64 reference is a float64 sum too (R*K - 1 additions, and a division or a
    # multiplication by fl(1/R) for a mean): its roundings are as large as a float64
    # implementation's own, so they are part of |out - ref| (without them a correct float64
    # sum in another rank order fails, at 1.33x the bound at 4 ranks)
    n_ref = 0 if exact_reference else (nranks * acc_steps - 1) + (2 if average else 0)
    theta = n_acc * u_acc + n_red * u_red + n_ref * _UNIT_ROUNDOFF["float64"]
    if theta >= THETA_MAX:  # an OptionError: a ValueError too, and one line for the CLI
        raise OptionError(f"acc_steps {acc_steps}, nranks {nranks}: too many roundings to "
                          f"check ({n_acc} in {acc} and {n_red} in {red}: theta={theta:g} >= "
                          f"{THETA_MAX}, a bound at least the size of the result, so even 0 "
                          f"would pass; at most about {_max_acc_steps(acc, red, n_red, nranks)} "
                          f"micro-steps at {nranks} rank(s))")
    rel = theta / (1 - theta)
    # a half-precision average may be pre-scaled on every rank (scale_after_comm=False): one
    # rounding per rank's term (one factor of theta), but where the scaled grads are
    # subnormal each is an absolute error of its own, R of them that add up (counting one
    # eta, a correct result fails at 5+ ranks)
    n_under = n_acc + (nranks - 1 if (average and half) else 0)
    absolute = (n_under * _UNDERFLOW[acc] + n_red * _UNDERFLOW[red]
                + n_ref * _UNDERFLOW["float64"])
    c_text = f"c = {'1/' + str(nranks) if average else '1'}"
    if exact_reference:
        formula = (f"|out - ref| <= c*sum|x| * theta/(1-theta) + eta + d, theta = "
                   f"{n_acc}*u({acc}) + {n_red}*u({red}) = {theta:.3g}, {c_text}, ref the exact "
                   f"value V rounded once to {acc}, d = 0 where ref = V, else "
                   f"u({acc})*|ref| + underflow({acc})")
    else:
        formula = (f"|out - ref| <= c*sum|x| * theta/(1-theta) + eta, theta = {n_acc}*u({acc}) + "
                   f"{n_red}*u({red}) + {n_ref}*u(float64) = {theta:.3g}, {c_text}")
    return BoundModel(rel, absolute, formula)


def error_bound(abs_sum: np.ndarray, *, grad_dtype: object, nranks: int, acc_steps: int,
                average: bool, ref_error: Optional[np.ndarray] = None) -> np.ndarray:
    """Per element, the largest error a correct sync may have.

    ``abs_sum`` is ``sum over ranks r and micro-steps k of |x[r,k]|`` (float64), where the
    ``x`` are the gradients as fed in (already in their dtype, so exactly known). With
    ``c = 1/R`` for an average (1 for a sum) the bound is::

        c * abs_sum * theta / (1 - theta) + eta
        theta = n_acc * u(grad dtype) + n_red * u(reduce dtype) + n_ref * u(float64)
        n_acc = (K - 1) + [grad dtype is half] + [average and half]
        n_red = (R - 1) + 2 * [average]
        n_ref = (R * K - 1) + 2 * [average]    (the float64 reference's own roundings)
        eta   = (n_acc + [average and half] * (R - 1)) * underflow(grad dtype)
                + n_red * underflow(reduce dtype) + n_ref * underflow(float64)

    With ``ref_error`` (``ExactResult.error`` of the exact reference: per element a bound on
    ``|V - ref|``, 0 where the exactly rounded reference equals the exact ``V``) the
    reference is exact but for its one rounding to the grad dtype: ``n_ref = 0`` and
    ``ref_error`` is added, since ``|out - ref| <= |out - V| + |V - ref|``.

    Each rounding contributes a factor ``(1 + d)`` with ``|d| <= u``, and every partial sum is
    bounded by ``c * abs_sum``; ``theta/(1-theta)`` bounds their product (Higham, Lemma 3.1).
    ``eta`` covers results that land in the subnormal range, where rounding errors are
    absolute. For one rank, one micro-step and no average the bound is 0: the result must be
    bit-exact.

    Non-finite ``abs_sum`` (see :class:`~mpifusion.oracle.bound.ReferenceSum`) passes
    through: ``inf`` (the inputs hold Inf/NaN: the output must match the reference's
    Inf/NaN) stays ``inf``, and ``NaN``
    (the float64 sums overflowed with finite inputs) stays ``NaN``, which every comparison
    treats as a failure. Neither is ever an infinite tolerance for a finite reference.

    Args:
        abs_sum: ``sum|x|`` per element, as above.
        grad_dtype: the dtype the grads are accumulated in.
        nranks: ``R``, the ranks whose grads are reduced.
        acc_steps: ``K``, micro-steps per step.
        average: the result is the mean over ranks (``c = 1/R``).
        ref_error: as above (None: a float64 reference).

    Returns:
        The bound per element, float64, of ``abs_sum``'s shape.

    Raises:
        OptionError: too many roundings to check (:func:`bound_model`).
    """
    model = bound_model(grad_dtype=grad_dtype, nranks=nranks, acc_steps=acc_steps,
                        average=average, exact_reference=ref_error is not None)
    c = 1.0 / nranks if average else 1.0
    abs_sum = np.asarray(abs_sum, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        bound = np.asarray(abs_sum * (c * model.rel))
        bound += model.absolute
        if ref_error is not None:
            bound += np.asarray(ref_error, dtype=np.float64).reshape(bound.shape)
    # inf * 0 would be NaN; in place, since a param's bound is one of its largest arrays
    np.copyto(bound, abs_sum, where=np.isinf(abs_sum))
    return bound


def as_native(arr: np.ndarray, dtype_hint: Optional[str] = None) -> np.ndarray:
    """``arr`` in its own float dtype, not copied (the exact reference reads any float
    dtype, and a float64 copy of every rank's inputs would double their memory); raw 2-byte
    data is viewed as bfloat16 under the rule of :func:`as_float64`."""
    arr = np.asarray(arr)
    dt = arr.dtype
    if dt.name != "bfloat16" and dt.itemsize == 2 and (dt.kind == "V" or dt == np.uint16):
        if dtype_hint != "bfloat16":
            raise ValueError(f"raw 2-byte values ({dt}) are read as bfloat16 bits only for a "
                             f"bfloat16 param, not {dtype_hint}")
        return arr.view(as_dtype("bfloat16"))
    return arr


def as_float64(arr: np.ndarray, dtype_hint: Optional[str] = None) -> np.ndarray:
    """A float64 copy of ``arr``; raw 2-byte void/uint16 data is read as bfloat16 bits when
    ``dtype_hint`` says bfloat16 (numpy's .npz cannot name the bfloat16 dtype), and refused
    otherwise (the same bytes are other numbers in fp16).

    Args:
        arr: a float array (or raw 2-byte data, as above).
        dtype_hint: the param's dtype in the spec.

    Raises:
        ValueError: raw 2-byte data for a param that is not bfloat16.
    """
    return as_native(arr, dtype_hint).astype(np.float64)


def _worst(a: float, b: float) -> float:
    """The larger of two ratios, a NaN counting as infinitely bad (``max`` would drop it)."""
    a = math.inf if math.isnan(a) else a
    b = math.inf if math.isnan(b) else b
    return a if a >= b else b


def _num(x: float) -> str:
    return f"{x:.9g}" if math.isfinite(x) else ("nan" if math.isnan(x) else
                                                 ("+inf" if x > 0 else "-inf"))


@dataclass
class ErrorStats:
    """Worst errors of one param against its reference (over every element compared).

    The rule for every element: where the reference is finite, the output must be
    finite and within the bound (a NaN ``err/bound`` fails); where the reference is +inf,
    -inf or NaN (the inputs held Inf/NaN), the output must be the same (same sign for inf);
    where the reference or ``sum|x|`` overflows although every input is finite (its
    bound is NaN, :class:`~mpifusion.oracle.bound.ReferenceSum`), the element cannot be
    checked and fails as ``overflow``: it is never given an infinite bound.
    """

    #: the param's name
    name: str
    #: elements compared, over every rank
    compared: int = 0
    #: the largest ``|out - ref|``
    max_abs: float = 0.0
    #: the largest ``|out - ref| / |ref|``, over elements whose reference is not 0
    max_rel: float = 0.0
    #: the largest ``|err| / bound``; above 1 fails; inf for any failing element
    max_ratio: float = 0.0
    #: the rank of the largest ratio (None before any comparison, or without ranks)
    worst_rank: Optional[int] = None
    #: Inf/NaN outputs where the reference is finite
    nonfinite: int = 0
    #: elements whose reference is Inf/NaN (Inf/NaN in the inputs)
    nonfinite_ref: int = 0
    #: of those, the elements whose output is not the same Inf/NaN
    mismatched: int = 0
    #: elements whose reference or ``sum|x|`` overflows with finite inputs
    overflow: int = 0
    #: finite outputs farther from the reference than the bound
    beyond: int = 0
    #: the largest ``|err| / bound`` over those finite comparisons only
    beyond_ratio: float = 0.0
    #: the first failing element, for the report
    first_failure: Optional[str] = None

    @property
    def ok(self) -> bool:
        """Whether every element compared passes (the rule above)."""
        return (self.max_ratio <= 1.0 and not self.nonfinite and not self.mismatched
                and not self.overflow and not self.beyond)

    @property
    def reason(self) -> Optional[str]:
        """Why the param fails, in one line (None when it passes)."""
        if self.ok:
            return None
        parts = []
        if self.overflow:
            parts.append(f"{self.overflow} element(s) whose reference or sum|x| "
                         f"overflows (finite inputs too large to check)")
        if self.mismatched:
            parts.append(f"{self.mismatched} element(s) where the reference is Inf/NaN "
                         f"(Inf/NaN in the inputs) but the output is not the same Inf/NaN")
        if self.nonfinite:
            parts.append(f"{self.nonfinite} Inf/NaN output(s) where the reference is finite")
        if self.beyond or not parts:
            parts.append(f"{self.beyond} element(s) beyond the bound (worst "
                         f"{format_ratio(self.beyond_ratio)} of it)")
        text = "; ".join(parts)
        return f"{text}; first: {self.first_failure}" if self.first_failure else text

    def update(self, out: np.ndarray, ref: np.ndarray, bound: np.ndarray,
               rank: Optional[int] = None, *, overflow: Optional[np.ndarray] = None,
               offset: int = 0) -> None:
        """Fold one comparison into the stats: ``out``, ``ref`` and ``bound`` of one size
        (``bound`` from :func:`error_bound`: NaN where the reference overflowed, inf where the
        inputs held Inf/NaN; ``overflow`` may mark overflowed elements explicitly, as
        :attr:`~mpifusion.oracle.bound.ReferenceSum.overflow`); ``offset`` is the index of
        element 0 in the param; ``rank``, whose output ``out`` is (for
        :attr:`worst_rank` and the first failure's text)."""
        out = np.asarray(out, dtype=np.float64).reshape(-1)
        ref = np.asarray(ref, dtype=np.float64).reshape(-1)
        bound = np.asarray(bound, dtype=np.float64).reshape(-1)
        if out.size == 0:
            return
        if ((overflow is None or not np.any(overflow)) and np.isfinite(out).all()
                and np.isfinite(ref).all() and np.isfinite(bound).all()):
            self._update_finite(out, ref, bound, rank, offset)
            return
        ref_finite = np.isfinite(ref)
        # NaN bound: the float64 sums overflowed; a finite reference with an infinite bound
        # can only come from an overflowed sum|x| too (an Inf/NaN input makes ref non-finite)
        over = np.isnan(bound) | (ref_finite & np.isinf(bound))
        if overflow is not None:
            over |= np.asarray(overflow, dtype=bool).reshape(-1)
        special = ~ref_finite & ~over            # a genuine Inf/NaN reference
        regular = ref_finite & ~over
        out_finite = np.isfinite(out)
        same = np.where(np.isnan(ref), np.isnan(out), out == ref)
        mismatch = special & ~same
        nonfinite = regular & ~out_finite
        checked = regular & out_finite
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            err = np.where(checked, np.abs(out - ref), 0.0)
            rel = np.where(checked & (ref != 0), err / np.abs(ref), 0.0)
            ratio = np.where(bound > 0, err / bound, np.where(err == 0, 0.0, np.inf))
        ratio = np.where(np.isnan(ratio), np.inf, ratio)  # a NaN ratio is a failure
        beyond = checked & ~(ratio <= 1.0)
        failing = over | mismatch | nonfinite
        ratio = np.where(checked, ratio, 0.0)
        self.beyond_ratio = _worst(self.beyond_ratio, float(ratio.max()))
        ratio = np.where(failing, np.inf, ratio)
        worst = float(ratio.max())
        if worst > self.max_ratio or self.worst_rank is None:
            self.worst_rank = rank
        self.compared += out.size
        self.nonfinite += int(np.count_nonzero(nonfinite))
        self.nonfinite_ref += int(np.count_nonzero(special))
        self.mismatched += int(np.count_nonzero(mismatch))
        self.overflow += int(np.count_nonzero(over))
        self.beyond += int(np.count_nonzero(beyond))
        bad_abs = np.inf if (mismatch | nonfinite).any() else 0.0
        self.max_abs = _worst(self.max_abs, max(float(err.max()), bad_abs))
        self.max_rel = _worst(self.max_rel, max(float(rel.max()), bad_abs))
        self.max_ratio = _worst(self.max_ratio, worst)
        if self.first_failure is None and (failing.any() or beyond.any()):
            i = int(np.flatnonzero(failing | beyond)[0])
            where = f" on rank {rank}" if rank is not None else ""
            self.first_failure = (f"element {offset + i}{where}: reference {_num(ref[i])}, "
                                  f"output {_num(out[i])}, bound {_num(bound[i])}")

    def _update_finite(self, out: np.ndarray, ref: np.ndarray, bound: np.ndarray,
                       rank: Optional[int], offset: int) -> None:
        """:meth:`update` when every value is finite (the common case): the same rule with
        fewer passes and temporaries."""
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            err = np.subtract(out, ref)
            np.abs(err, out=err)          # inf only if out - ref overflows: then beyond
            ratio = np.divide(err, bound)  # x/0 = inf (beyond), 0/0 = NaN: exact, so 0
            np.nan_to_num(ratio, copy=False, nan=0.0, posinf=np.inf)
            rel = np.abs(ref)
            np.divide(err, rel, out=rel, where=rel != 0)  # stays 0 where ref == 0
        beyond = ratio > 1.0
        count = int(np.count_nonzero(beyond))
        worst = float(ratio.max())
        if worst > self.max_ratio or self.worst_rank is None:
            self.worst_rank = rank
        self.compared += out.size
        self.beyond += count
        self.max_abs = _worst(self.max_abs, float(err.max()))
        self.max_rel = _worst(self.max_rel, float(rel.max()))
        self.max_ratio = _worst(self.max_ratio, worst)
        self.beyond_ratio = _worst(self.beyond_ratio, worst)
        if count and self.first_failure is None:
            i = int(np.argmax(beyond))
            where = f" on rank {rank}" if rank is not None else ""
            self.first_failure = (f"element {offset + i}{where}: reference {_num(ref[i])}, "
                                  f"output {_num(out[i])}, bound {_num(bound[i])}")

    def merge(self, other: "ErrorStats") -> None:
        """Fold another rank's stats of the same param into these.

        Args:
            other: the stats to add (unchanged).
        """
        if other.max_ratio > self.max_ratio or self.worst_rank is None:
            self.worst_rank = other.worst_rank
        for name in ("compared", "nonfinite", "nonfinite_ref", "mismatched", "overflow",
                     "beyond"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.max_abs = _worst(self.max_abs, other.max_abs)
        self.max_rel = _worst(self.max_rel, other.max_rel)
        self.max_ratio = _worst(self.max_ratio, other.max_ratio)
        self.beyond_ratio = _worst(self.beyond_ratio, other.beyond_ratio)
        if self.first_failure is None:
            self.first_failure = other.first_failure


class ReferenceSum:
    """The float64 sum and ``sum|x|`` of the terms fed in, one term at a time (three arrays
    of the param's size), with the marks :func:`~mpifusion.oracle.error_bound` and
    :class:`~mpifusion.oracle.ErrorStats` read: ``absolute`` is ``inf`` where an input is
    Inf/NaN and ``NaN`` where the sums overflow although every input is finite (the
    reference cannot be trusted there)."""

    def __init__(self) -> None:
        self._total: Optional[np.ndarray] = None
        self._absolute: Optional[np.ndarray] = None
        self._special: Optional[np.ndarray] = None  # an input (or part) was Inf/NaN

    def add(self, x: np.ndarray, absolute: Optional[np.ndarray] = None) -> None:
        """Add a term ``x`` (or, with ``absolute``, a partial result ``(total, sum|x|)`` of
        another ReferenceSum, marks included)."""
        x = np.asarray(x, dtype=np.float64)
        if absolute is None:
            special = ~np.isfinite(x)
            mag = np.where(special, np.inf, np.abs(x))  # |NaN| counts as inf: not overflow
        else:
            mag = np.asarray(absolute, dtype=np.float64)
            special = np.isinf(mag)
        with np.errstate(over="ignore", invalid="ignore"):
            if self._total is None:
                self._total, self._absolute = x.copy(), mag.copy()
                self._special = special
            else:
                self._total += x
                self._absolute += mag
                self._special |= special

    def _started(self) -> None:
        if self._total is None:
            raise ValueError("summed: expected at least one term")

    @property
    def total(self) -> np.ndarray:
        """The float64 sum of the terms (Inf/NaN where they overflowed or held Inf/NaN)."""
        self._started()
        return self._total

    @property
    def overflow(self) -> np.ndarray:
        """Elements whose every input is finite but whose sum or ``sum|x|`` is not."""
        self._started()
        bad = ~np.isfinite(self._absolute) | ~np.isfinite(self._total)
        return bad & ~self._special

    @property
    def absolute(self) -> np.ndarray:
        """``sum|x|``, ``inf`` where an input is Inf/NaN, ``NaN`` where it overflowed."""
        self._started()
        absolute = self._absolute.copy()
        bad = ~np.isfinite(absolute) | ~np.isfinite(self._total)
        absolute[bad & self._special & ~np.isnan(absolute)] = np.inf
        absolute[bad & ~self._special] = np.nan  # overflow with finite inputs
        return absolute

    def result(self) -> tuple:
        """``(sum, sum|x|)`` with the marks described above."""
        return self.total.copy(), self.absolute


def summed(terms: Iterable[np.ndarray]) -> tuple:
    """``(sum, sum of |x|)`` of float64 arrays, for the reference and its bound (marks as in
    :class:`~mpifusion.oracle.bound.ReferenceSum`: ``inf`` for Inf/NaN inputs, ``NaN`` for
    overflow).

    Args:
        terms: the arrays to sum (one shape), at least one.

    Raises:
        ValueError: no terms.
    """
    acc = ReferenceSum()
    for x in terms:
        acc.add(x)
    return acc.result()


def format_ratio(ratio: float) -> str:
    """A short human form of ``err/bound``.

    Args:
        ratio: the ratio (inf and NaN read ``"inf"``: both fail).
    """
    if math.isinf(ratio) or math.isnan(ratio):
        return "inf"
    return f"{ratio:.3g}"
