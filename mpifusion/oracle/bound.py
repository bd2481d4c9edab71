"""The float64 reference of a gradient sync, and how far a correct result may be from it.

Both ``mpifusion run`` (checking mpifusion itself) and ``mpifusion check`` (checking another
implementation) compare against the exact sum of the gradients that were fed in, computed in
float64, and accept an element when its error is within :func:`error_bound` of that element.
The bound is a worst-case rounding-error bound (Higham, *Accuracy and Stability of Numerical
Algorithms*, ch. 3-4), not a tolerance picked to make tests pass: an implementation that
rounds more often, or in a narrower dtype, than the model below can exceed it.

Model of a sync (the half-precision rule mpifusion implements):

1. each rank accumulates its ``K = acc_steps`` micro-step gradients in the *grad dtype*
   (fp32 main grads, or the fp16/bf16/fp32 param dtype): ``K - 1`` roundings there;
2. the ``R = nranks`` accumulated gradients are summed in fp32 (fp64 for fp64 buffers), in
   whatever order the collective chooses: at most ``R - 1`` roundings along any path;
3. an average multiplies by ``fl(1/R)``: two more roundings in the reduce dtype, and one in
   the grad dtype when a half-precision buffer is pre-scaled before communicating;
4. a half-precision grad buffer receives the fp32 result rounded once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from ..dtypes import as_dtype

#: unit roundoff u (half the spacing of 1.0) and half the smallest subnormal spacing, per dtype
_UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11,
                  "bfloat16": 2.0 ** -8}
_UNDERFLOW = {"float64": 2.0 ** -1075, "float32": 2.0 ** -150, "float16": 2.0 ** -25,
              "bfloat16": 2.0 ** -134}


def unit_roundoff(dtype: object) -> float:
    """``u`` of a floating dtype: the largest relative error of one rounding to nearest."""
    return _UNIT_ROUNDOFF[as_dtype(dtype).name]


def reduce_dtype(grad_dtype: object) -> str:
    """The dtype a collective sums in: fp64 stays fp64, everything else is summed in fp32."""
    return "float64" if as_dtype(grad_dtype).name == "float64" else "float32"


@dataclass(frozen=True)
class BoundModel:
    """The constants of :func:`error_bound` for one sync, kept for reports."""

    rel: float      # multiplies c * sum|x|
    absolute: float  # added once: underflow (subnormal) roundings
    formula: str


def bound_model(*, grad_dtype: object, nranks: int, acc_steps: int, average: bool) -> BoundModel:
    """The two constants of the bound (see :func:`error_bound`)."""
    acc = as_dtype(grad_dtype).name
    red = reduce_dtype(acc)
    u_acc, u_red = _UNIT_ROUNDOFF[acc], _UNIT_ROUNDOFF[red]
    half = acc in ("float16", "bfloat16")
    n_acc = (acc_steps - 1) + (1 if half else 0) + (1 if (average and half) else 0)
    n_red = (nranks - 1) + (2 if average else 0)
    theta = n_acc * u_acc + n_red * u_red
    if theta >= 1:
        raise ValueError(f"error bound: {n_acc} roundings in {acc} and {n_red} in {red} leave "
                         f"no accuracy (theta={theta:g} >= 1)")
    rel = theta / (1 - theta)
    absolute = n_acc * _UNDERFLOW[acc] + n_red * _UNDERFLOW[red]
    formula = (f"|out - ref| <= c*sum|x| * theta/(1-theta) + eta, theta = {n_acc}*u({acc}) + "
               f"{n_red}*u({red}) = {theta:.3g}, c = {'1/' + str(nranks) if average else '1'}")
    return BoundModel(rel, absolute, formula)


def error_bound(abs_sum: np.ndarray, *, grad_dtype: object, nranks: int, acc_steps: int,
                average: bool) -> np.ndarray:
    """Per element, the largest error a correct sync may have.

    ``abs_sum`` is ``sum over ranks r and micro-steps k of |x[r,k]|`` (float64), where the
    ``x`` are the gradients as fed in (already in their dtype, so exactly known). With
    ``c = 1/R`` for an average (1 for a sum) the bound is::

        c * abs_sum * theta / (1 - theta) + eta
        theta = n_acc * u(grad dtype) + n_red * u(reduce dtype)
        n_acc = (K - 1) + [grad dtype is half] + [average and half]
        n_red = (R - 1) + 2 * [average]
        eta   = n_acc * underflow(grad dtype) + n_red * underflow(reduce dtype)

    Each rounding contributes a factor ``(1 + d)`` with ``|d| <= u``, and every partial sum is
    bounded by ``c * abs_sum``; ``theta/(1-theta)`` bounds their product (Higham, Lemma 3.1).
    ``eta`` covers results that land in the subnormal range, where rounding errors are
    absolute. For one rank, one micro-step and no average the bound is 0: the result must be
    bit-exact.
    """
    model = bound_model(grad_dtype=grad_dtype, nranks=nranks, acc_steps=acc_steps,
                        average=average)
    c = 1.0 / nranks if average else 1.0
    return np.asarray(abs_sum, dtype=np.float64) * (c * model.rel) + model.absolute


def as_float64(arr: np.ndarray, dtype_hint: Optional[str] = None) -> np.ndarray:
    """A float64 copy of ``arr``; raw 2-byte void/uint16 data is read as bfloat16 bits when
    ``dtype_hint`` says bfloat16 (numpy's .npz cannot name the bfloat16 dtype)."""
    arr = np.asarray(arr)
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2 or (
            arr.dtype == np.uint16 and dtype_hint == "bfloat16"):
        arr = arr.view(as_dtype("bfloat16"))
    return arr.astype(np.float64)


@dataclass
class ErrorStats:
    """Worst errors of one param against its reference (over every element compared)."""

    name: str
    compared: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0    # over elements whose reference is not 0
    max_ratio: float = 0.0  # max |err| / bound; > 1 fails; inf where the bound is 0
    worst_rank: Optional[int] = None
    nonfinite: int = 0

    @property
    def ok(self) -> bool:
        return self.max_ratio <= 1.0 and self.nonfinite == 0

    def update(self, out: np.ndarray, ref: np.ndarray, bound: np.ndarray,
               rank: Optional[int] = None) -> None:
        """Fold one comparison (``out`` and ``ref`` float64, same shape) into the stats."""
        if out.size == 0:
            return
        finite = np.isfinite(out)
        bad = int(out.size - np.count_nonzero(finite))
        err = np.abs(out - ref)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(ref != 0, err / np.abs(ref), 0.0)  # undefined where ref == 0
            ratio = np.where(bound > 0, err / bound, np.where(err == 0, 0.0, np.inf))
        ratio = np.where(finite, ratio, np.inf)
        worst = float(ratio.max())
        if worst > self.max_ratio or self.worst_rank is None:
            self.worst_rank = rank
        self.compared += out.size
        self.nonfinite += bad
        self.max_abs = max(self.max_abs, float(np.where(finite, err, np.inf).max()))
        self.max_rel = max(self.max_rel, float(np.where(finite, rel, np.inf).max()))
        self.max_ratio = max(self.max_ratio, worst)


def summed(terms: Iterable[np.ndarray]) -> tuple:
    """``(sum, sum of |x|)`` of float64 arrays, for the reference and its bound."""
    total = absolute = None
    for x in terms:
        x = np.asarray(x, dtype=np.float64)
        if total is None:
            total, absolute = x.copy(), np.abs(x)
        else:
            total += x
            absolute += np.abs(x)
    if total is None:
        raise ValueError("summed: expected at least one term")
    return total, absolute


def format_ratio(ratio: float) -> str:
    """A short human form of ``err/bound``."""
    if math.isinf(ratio):
        return "inf"
    return f"{ratio:.3g}"
