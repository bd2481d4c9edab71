"""Why a param fails: the likely bug behind a failing param's outputs, in one line.

Six common bugs (a sum where a mean was wanted, one rank's contribution lost, the mean over
3 of 4 ranks, averaged twice, values shifted by 64 elements, a reduction done in bf16) all
fail as "N element(s) beyond the bound"; :func:`diagnose` tells them apart, so the report
says what went wrong. Pure numpy and no MPI, like the rest of the oracle.

Method, for the wrong output ranks together (the usual case: one bug on every rank), then
each rank alone (a rank whose output is wrong):

1. NaN/Inf where the reference is finite, or the reverse: ``nonfinite``;
2. the first weight model ``out ~ sum_j w_j x_j`` over the ``nranks * acc_steps``
   contributions (rank, micro-step) that explains every element beyond the bound, within
   the bound of that model: every rank its own gradient times one factor (``local_only``);
   one contribution lost (a rank, a micro-step on every rank, one rank's micro-step), the
   one that explains best; one factor times the expected output (``scale``); a
   least-squares fit on up to 4096 of the elements beyond the bound (the failing ranks
   pooled when a piece is too small to fit alone; ranks holding the same output fitted
   once) with one weight per contribution, else per rank, else per micro-step (a small
   param has fewer elements than contributions), the weights snapped to ``v * m_j`` with
   one common value ``v`` and small multiplicities ``m_j`` (0, 1, 2, 3), ``v`` to a
   simple fraction of the expected weight. A lost contribution comes first: within the
   bound it explains the output as well as a scale near 1 or a narrower dtype, and least
   squares cannot weigh a contribution lost in rounding noise. The weights, read as
   multiples of the expected weight, are classified: all one factor (``scale``), some 0
   (``missing``, whatever the divisor), some doubled (``duplicate``), the rank's own
   contributions alone (``local_only``);
3. else within the worst-case bound of the same reduction done in fp16 or bf16, with an
   error of the size that dtype's rounding makes (``precision``; of the two, the one whose
   simulated rounding error is the closer in size to the observed one);
4. else another param's reduced gradient of the same size (``swap``: the 16 nearest);
5. else the reduced flat buffer shifted by an offset, within the param or from its
   neighbours (``shift``: 4 slots each side; candidate offsets from matching distinctive
   output values against the buffer's sorted values, then checked on every element);
6. else ``unexplained``, with the error statistics.

A kind is claimed only when its model explains the output within a bound, and a
diagnosis explains every wrong rank's output: where ranks differ, its text names each
group's ranks, kind and text (:func:`_merge`). The verdict is never touched (``check``
calls this for failing params only, and only records the result). The contract
(:class:`Diagnosis`, :class:`ParamCase`) and the element-wise models (shift, swap,
precision) are in ``fault_models.py``.
"""
from __future__ import annotations

import hashlib
import math
from fractions import Fraction
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..dtypes import dtype_name
from ..plan.grouping import grad_dtype_for
from .bound import ReferenceSum, error_bound
from .fault_models import (FIELDS, KINDS, Diagnosis, ParamCase, RankOutput, ReducedBuffer,
                           column, expected_weights, find_precision, find_shift, find_swap,
                           fmt_factor, misfit, model, names_of, simple_fraction)
from .dumps import read_array

#: elements the weights are fitted on (the model is then checked on every element)
FIT_ELEMENTS = 4096
#: other params' references kept while one param is diagnosed (shift and swap share them)
REFERENCE_CACHE = 12

__all__ = ["FIELDS", "KINDS", "Diagnosis", "ParamCase", "RankOutput", "diagnose",
           "diagnose_failure", "references_from_dumps"]


def _simple(case: ParamCase, x: float) -> Optional[Fraction]:
    """``x`` as a fraction a bug makes of the expected weight (nranks, 1/nranks, nranks/k,
    2, ...): denominator and numerator within a few times the contributions."""
    return simple_fraction(x, max(8, 2 * case.n), max(16, 4 * case.n))


def _group(case: ParamCase, js: Sequence[int]) -> tuple:
    """``(from_ranks, steps, words)`` of contributions ``js``: whole ranks, whole micro-steps
    or the pairs themselves."""
    acc = case.acc_steps
    pairs = sorted((int(j) // acc, int(j) % acc) for j in js)
    ranks = sorted({r for r, _ in pairs})
    steps = sorted({k for _, k in pairs})
    product = len(pairs) == len(ranks) * len(steps)
    if product and len(steps) == acc:
        words = f"{names_of(ranks, 'rank')}" + (" (every micro-step)" if acc > 1 else "")
    elif product and len(ranks) == case.nranks:
        words = f"{names_of(steps, 'micro-step')} on every rank"
    elif product:
        words = f"{names_of(ranks, 'rank')}, {names_of(steps, 'micro-step')}"
    else:
        words = "(rank, micro-step) " + ", ".join(f"({r}, {k})" for r, k in pairs)
    return ranks, steps, words


def _whole_ranks(case: ParamCase, js: Sequence[int]) -> bool:
    """Whether contributions ``js`` (distinct, not none) are whole ranks, every micro-step
    of each: what a collective over a wrong group loses."""
    return len(js) > 0 and len(js) == len({int(j) // case.acc_steps for j in js}) * case.acc_steps


# --------------------------------------------------------------------------- the weight fit


def _fit_rows(case: ParamCase, ro: RankOutput, idx: np.ndarray) -> tuple:
    """``(A, b)``: the elements ``idx`` of the rank's output as rows over the
    contributions."""
    a = np.empty((idx.size, case.n))
    for j in range(case.n):
        a[:, j] = column(case, j, ro.begin, ro.end, idx)
    return a, ro.out[idx]


def _rows(case: ParamCase, ro: RankOutput, rng: np.random.Generator, share: int) -> tuple:
    """The fit's rows: the sampled wrong elements, and, where they are too few to fit the
    contributions (sparse inputs leave some elements right), a sample of every finite
    element as well (None otherwise)."""
    wrong = _fit_rows(case, ro, ro.sample)
    if ro.sample.size >= 2 * case.n:
        return wrong, None
    ok = np.flatnonzero(np.isfinite(ro.out) & np.isfinite(ro.expected))
    idx = np.sort(rng.choice(ok, share, replace=False)) if ok.size > share else ok
    return wrong, _fit_rows(case, ro, idx)


def _sample(ro: RankOutput, rng: np.random.Generator, limit: int) -> np.ndarray:
    """Up to ``limit`` of the rank's wrong, finite elements, in order."""
    ok = np.flatnonzero(np.isfinite(ro.out) & np.isfinite(ro.expected) & ro.wrong)
    return np.sort(rng.choice(ok, limit, replace=False)) if ok.size > limit else ok


def _snap(w: np.ndarray) -> Optional[np.ndarray]:
    """Multiplicities ``m`` (0..3) with ``w ~ v * m`` for one common ``v``, or None."""
    top = float(np.max(np.abs(w))) if w.size else 0.0
    if top == 0 or not math.isfinite(top):
        return None
    big = np.abs(w) > 0.3 * top
    v = float(w[big][np.argmin(np.abs(w[big]))])
    q = w / v
    m = np.rint(q)
    if np.max(np.abs(q - m)) > 0.05 or m.min() < 0 or m.max() > 3:
        return None
    return m


def _bases(case: ParamCase) -> List[np.ndarray]:
    """The weight models a least-squares fit tries, each a basis (contributions x
    unknowns), the most general first: one weight per contribution; then one per rank and
    one per micro-step. Their few unknowns fit a param with fewer wrong elements than
    contributions (a 4-element bias at 3 ranks x 2 micro-steps), and they hold the usual
    bugs (a rank or a micro-step lost or doubled)."""
    n, acc = case.nranks, case.acc_steps
    bases = [np.eye(case.n)]
    if acc > 1:
        bases.append(np.kron(np.eye(n), np.ones((acc, 1))))  # row r*acc+k -> column r
        if n > 1:
            bases.append(np.kron(np.ones((n, 1)), np.eye(acc)))  # row r*acc+k -> column k
    return bases


def _fit(case: ParamCase, rows: List[tuple], basis: np.ndarray) -> Optional[tuple]:
    """``(m, v)``: the snapped weight model of the pooled rows, the weights ``basis @ u``
    (``u`` fitted), or None."""
    a = np.vstack([r[0] for r in rows])
    b = np.concatenate([r[1] for r in rows])
    g = a @ basis
    if g.shape[0] <= g.shape[1] or not np.any(b):
        return None  # as many unknowns as elements: any output fits, the check proves nothing
    # normal equations: a small solve (a few dozen unknowns at most), far cheaper than
    # lstsq's SVD of the rows; lstsq where they are singular (equal inputs)
    gram = g.T @ g
    try:
        u = np.linalg.solve(gram, g.T @ b)
        if not np.all(np.isfinite(u)) or np.linalg.cond(gram) > 1e10:
            raise np.linalg.LinAlgError
    except np.linalg.LinAlgError:
        u, *_ = np.linalg.lstsq(g, b, rcond=None)
    m = _snap(basis @ u)
    if m is None:
        return None
    am = a @ m
    den = float(am @ am)
    if den == 0:
        return None
    return m, float(am @ b) / den


def _drops(case: ParamCase) -> Iterator[np.ndarray]:
    """Keep-masks (0: lost) of what a bug commonly loses: one rank, one micro-step on every
    rank, one rank's micro-step. Tried against the bound, not fitted: they explain a param
    too small to fit, and a contribution too small to tell from rounding by least squares
    (a rank whose loss is scaled by 0.01, in bf16)."""
    n, acc = case.nranks, case.acc_steps

    def lose(ranks: Sequence[int], steps: Sequence[int]) -> np.ndarray:
        keep = np.ones((n, acc))
        keep[np.ix_(list(ranks), list(steps))] = 0
        return keep.reshape(-1)

    for r in range(n):
        yield lose([r], range(acc))
    if acc > 1:
        for k in range(acc):
            yield lose(range(n), [k])
        for r in range(n):
            for k in range(acc):
                yield lose([r], [k])


def _dropped(case: ParamCase, ranks: list) -> Optional[tuple]:
    """``(m, v, misfit)``: of :func:`_drops`, the one that explains every one of ``ranks``
    best, the rest at the expected weight or, where whole ranks of a mean are lost, at the
    mean over the ranks left (the collective's own divisor); None where none explains."""
    ro = case.outputs[ranks[0]]
    e = expected_weights(case, ranks[0], ro)
    support = e != 0
    c = float(e[support][0])
    best = None
    for keep in _drops(case):
        m = support * keep
        lost = np.flatnonzero(support & (m == 0))
        if not lost.size or not m.any():
            continue
        kept = [c]
        if case.average and not ro.own and _whole_ranks(case, lost):
            kept.append(1.0 / (case.nranks - lost.size // case.acc_steps))
        for v in kept:
            worst = _worst(case, ranks, lambda r: v * m)
            if worst <= 1 and (best is None or worst < best[2]):
                best = (m, v, worst)
    return best


def _worst(case: ParamCase, ranks: list, weights: Callable[[int], np.ndarray]) -> float:
    """The largest :func:`misfit` of ``weights(rank)`` over ``ranks`` (at most 1: the
    model explains every one; the first rank it does not explain ends the search)."""
    worst = 0.0
    for r in ranks:
        worst = max(worst, misfit(case, case.outputs[r], weights(r)))
        if worst > 1:
            break
    return worst


# --------------------------------------------------------------------------- the kinds


def _classify(case: ParamCase, rank: int, ro: RankOutput, m: np.ndarray, v: float,
              alone: bool) -> Optional[Diagnosis]:
    """The kind of the (verified) weights ``v * m``, read as multiples ``q`` of the expected
    weight; ``alone``: fitted to this rank only (a model several ranks share is never one
    rank's own gradient)."""
    e = expected_weights(case, rank, ro)
    support = e != 0
    if np.any(m[~support]):
        return None  # contributions a rank's own output should not hold
    if v == 0:
        return _scale(case, [rank], 0.0, ro.own)
    q = np.where(support, v * m / float(e[support][0]), 0.0)
    present, absent = support & (m > 0), support & (m == 0)
    if not present.any():
        return None
    base = float(q[present].min())
    uniform = bool(np.allclose(q[present], base, rtol=1e-9, atol=0))
    if uniform and not absent.any():
        return None if abs(base - 1) < 1e-9 else _scale(case, [rank], base, ro.own)
    if v < 0:
        return None  # negated and lost or doubled: no one bug
    own_only = (alone and not ro.own and uniform
                and np.array_equal(present, _own_mask(case, rank) > 0))
    if own_only and _local(case, v):
        return _local_only(case, rank, v)
    doubled = _doubled(case, q, present, absent, uniform, base)
    if doubled.any():
        return _duplicate(case, rank, ro, q, absent, doubled, base, uniform)
    if not uniform:
        return None
    d = _missing(case, rank, ro, absent, base)
    if own_only:  # 2 ranks: the same values are the rank's own gradient, scaled
        d.text += (f"; the same values as this rank's own gradient times {fmt_factor(v)} "
                   f"(local_only: the collective skipped or run on a copy): at 2 ranks one "
                   f"output alone cannot tell the two apart")
    return d


def _doubled(case: ParamCase, q: np.ndarray, present: np.ndarray, absent: np.ndarray,
             uniform: bool, base: float) -> np.ndarray:
    """The contributions counted more than once: those at twice the weight of the others
    or more; where every one present weighs the same and some are lost, all present when
    they weigh 2 or 3 times the expected weight, unless whole ranks are lost (the weight is
    then the collective's divisor: a mean over the ranks present, or a sum)."""
    if not uniform:
        return present & (q >= 2 * base * (1 - 1e-9))
    lost = np.flatnonzero(absent)
    if lost.size and not _whole_ranks(case, lost) and round(base, 9) in (2.0, 3.0):
        return present.copy()
    return np.zeros_like(present)


def _local_only(case: ParamCase, rank: int, v: float) -> Diagnosis:
    """``local_only``: the rank's own contributions alone, each of weight ``factor``."""
    n = case.nranks
    scaled = ("" if abs(v - 1) < 1e-12 else
              f" times 1/{n} = 1/nranks (pre-scaled for the mean)" if abs(v * n - 1) < 1e-12
              else f" times {fmt_factor(v)}")
    return Diagnosis("local_only", f"the output is the rank's own accumulated gradient"
                     f"{scaled}, not the reduction over {n} ranks (the collective was "
                     f"skipped, ran on a copy, or its result was not written back)", [rank],
                     factor=float(v))


def _missing(case: ParamCase, rank: int, ro: RankOutput, absent: np.ndarray,
             base: float) -> Diagnosis:
    """``missing``: the ``absent`` contributions lost, every other one at ``base`` times
    the expected weight (for a mean, said as the divisor it amounts to)."""
    n, acc = case.nranks, case.acc_steps
    lost = np.flatnonzero(absent)
    ranks, steps, words = _group(case, lost)
    total = int(np.count_nonzero(expected_weights(case, rank, ro)))
    summed = f"{total - lost.size} of {total} contributions summed"
    if case.average and not ro.own:
        div = n / base
        why = (" = nranks" if abs(div - n) < 1e-9 else
               ", the ranks present: a mean over those that arrived"
               if _whole_ranks(case, lost) and abs(div - (n - len(ranks))) < 1e-9 else
               ": a sum where a mean was expected" if abs(div - 1) < 1e-9 else "")
        summed += f", divided by {fmt_factor(div)}{why}"
    elif abs(base - 1) > 1e-9:
        summed += f", times {fmt_factor(base)}"
    whole_steps = len(ranks) == n and len(ranks) * len(steps) == lost.size
    cause = ("a micro-step's gradient overwritten instead of accumulated (the buffer "
             "zeroed between micro-steps, or the hook registered late)" if whole_steps
             else "a rank left out of the collective (a wrong group, count or offset)"
             if len(steps) == acc else "contributions lost on the way")
    return Diagnosis("missing", f"the contributions of {words} are missing ({summed}): "
                     f"{cause}", [rank], from_ranks=ranks, steps=steps)


def _duplicate(case: ParamCase, rank: int, ro: RankOutput, q: np.ndarray, absent: np.ndarray,
               doubled: np.ndarray, base: float, uniform: bool) -> Diagnosis:
    """``duplicate``: the ``doubled`` contributions counted more than once, naming every
    other weight that differs from the expected one (a common factor, lost ones)."""
    ranks, steps, words = _group(case, np.flatnonzero(doubled))
    unit = 1.0 if uniform else base  # the weight a contribution counted once has
    counts = {int(round(x / unit)) for x in q[doubled]}
    times = {2: "twice", 3: "3 times"}.get(counts.pop(), "") if len(counts) == 1 else ""
    text = f"the contributions of {words} are counted {times or 'more than once'}"
    if uniform and case.average and not ro.own and abs(base - case.nranks) < 1e-9:
        text += (f" ({fmt_factor(base)} = nranks: or summed where a mean was expected, "
                 f"not divided by nranks)")
    if abs(unit - 1) > 1e-9:
        text += f"; every contribution times {fmt_factor(unit)}"
    lost = np.flatnonzero(absent)
    if lost.size:
        text += f"; those of {_group(case, lost)[2]} are missing"
    text += (": a gradient accumulated or reduced more than once (a hook run twice, a param "
             "in two buckets, a stale buffer not zeroed)")
    if lost.size:
        text += ", and the missing ones never added (overwritten, or zeroed)"
    return Diagnosis("duplicate", text, [rank], from_ranks=ranks, steps=steps)


def _counted(f: float) -> str:
    """What a factor of 2 or 3 also is: every contribution counted that many times."""
    times = {2.0: "twice", 3.0: "3 times"}.get(f)
    return (f"every contribution counted {times} (a gradient accumulated or reduced "
            f"{times})" if times else "")


def _scale(case: ParamCase, ranks: list, factor: float, own: bool) -> Diagnosis:
    """``scale``: the text names what the factor amounts to (nranks, 1/nranks, acc_steps,
    every contribution counted twice), the usual bugs behind it."""
    n, acc = case.nranks, case.acc_steps
    f = float(factor)
    frac = _simple(case, f)
    f = float(frac) if frac is not None else f
    scaled_off_root = case.average and not case.reduce_avg  # Paddle's rule off the root
    counted = _counted(f)
    also = f", or {counted}" if counted else ""
    if n > 1 and abs(f - n) < 1e-9:
        why = ("kept the unscaled own gradient off the root where Paddle's rule scales it "
               "by 1/n (check --reduce-avg if the collective averaged)"
               if own and scaled_off_root else "the own gradient times nranks off the root"
               if own else "summed where a mean was expected (a missing 1/n)"
               if case.average else "a sum where a sum was expected, times nranks again")
        text = f"every element is the reference times {n} = nranks: {why}{also}"
    elif n > 1 and abs(f - 1.0 / n) < 1e-12:
        why = ("scaled by 1/n twice off the root" if own and scaled_off_root else
               "scaled by 1/n off the root although the collective averaged "
               "(use_reduce_avg: drop --reduce-avg?)" if own and case.average else
               "scaled by 1/n off the root, but the spec sums (average false)" if own else
               "averaged twice (divided by nranks once more, e.g. a mean collective and a "
               "1/n scale both)" if case.average else
               "averaged where a sum was expected (the spec says average false)")
        text = f"every element is the reference times 1/{n} = 1/nranks: {why}"
    elif acc > 1 and abs(f - 1.0 / acc) < 1e-12:
        text = (f"every element is the reference times 1/{acc} = 1/acc_steps: the "
                f"accumulated gradient averaged over micro-steps (or scaled by the loss "
                f"twice)")
    elif acc > 1 and abs(f - acc) < 1e-12:
        text = f"every element is the reference times {acc} = acc_steps{also}"
    elif f == -1:
        text = "every element is the reference negated (a sign flipped)"
    elif f == 0:
        text = "every element is 0: the output was never written (zeroed buffer)"
    elif counted:
        text = f"every element is the reference times {fmt_factor(f)}: {counted}"
    else:
        text = f"every element is the reference times {fmt_factor(f)}"
    return Diagnosis("scale", text, list(ranks), factor=f)


# --------------------------------------------------------------------------- the models


def _value(case: ParamCase, ranks: list, unit: Callable[[int], np.ndarray]) -> Optional[tuple]:
    """``(v, elements)``: the one value with ``out ~ v * model(unit(rank))`` on every rank
    (least squares), or None."""
    num = den = 0.0
    count = 0
    for r in ranks:
        ro = case.outputs[r]
        base, _ = model(case, ro, unit(r), ro.sample)
        out = ro.out[ro.sample]
        num += float(base @ out)
        den += float(base @ base)
        count += int(ro.sample.size)
    return (num / den, count) if den > 0 else None


def _simple_value(case: ParamCase, v: float, c: float, count: int) -> Optional[float]:
    """``v`` snapped to ``c`` times a simple fraction; an odd value is kept only where more
    than one element backs it (any value fits one element)."""
    frac = _simple(case, v / c)
    if frac is not None:
        return c * float(frac)
    return v if count >= 2 else None


def _fraction_of(case: ParamCase, v: float, c: float) -> float:
    frac = _simple(case, v / c)
    return c * float(frac) if frac is not None else v


def _own_mask(case: ParamCase, rank: int) -> np.ndarray:
    own = np.zeros(case.n)
    own[rank * case.acc_steps:(rank + 1) * case.acc_steps] = 1.0
    return own


def _local(case: ParamCase, v: float) -> bool:
    """Whether one rank's own contributions times ``v`` read as a local-only result: at 2
    ranks one rank's own gradient halved is as much the mean missing the other rank, and
    is called so (gloo's reduce leaves it on the non-root); every rank holding its own is
    :func:`_local_pattern`."""
    return case.nranks > 2 or abs(v - 1) < 1e-9


def _own_scale(case: ParamCase, ranks: list) -> Optional[float]:
    """``v`` (positive) with every one of ``ranks`` holding its own accumulated gradient
    times ``v``, or None."""
    fit = _value(case, ranks, lambda r: _own_mask(case, r))
    c = 1.0 / case.nranks if case.average else 1.0  # the expected weight
    v = None if fit is None else _simple_value(case, fit[0], c, fit[1])
    if v is None or v <= 0 or _worst(case, ranks, lambda r: _own_mask(case, r) * v) > 1:
        return None
    return v


def _local_pattern(case: ParamCase, ranks: list, shared: frozenset) -> Dict[int, Diagnosis]:
    """``local_only`` on every one of ``ranks`` where each holds its own accumulated
    gradient times one factor (the collective skipped, or run on a copy, everywhere),
    whatever the rank count: each rank missing a different rank is no one bug."""
    if len(ranks) < 2 or any(case.outputs[r].own or r in shared for r in ranks):
        return {}
    v = _own_scale(case, ranks)
    return {} if v is None else {r: _local_only(case, r, v) for r in ranks}


def _common_scale(case: ParamCase, ranks: list) -> Optional[float]:
    """One factor (not 1) times the expected output explaining every one of ``ranks``, or
    None."""
    def unit(r: int) -> np.ndarray:
        e = expected_weights(case, r, case.outputs[r])
        return e / e.max()

    c = float(expected_weights(case, ranks[0], case.outputs[ranks[0]]).max())
    fit = _value(case, ranks, unit)
    v = None if fit is None else _simple_value(case, fit[0], c, fit[1])
    if v is None or abs(v / c - 1) <= 1e-9 or _worst(case, ranks, lambda r: unit(r) * v) > 1:
        return None
    return v / c


def _fitted(case: ParamCase, ranks: list, rows: dict) -> Optional[tuple]:
    """``(m, v)``: the first least-squares weight model (:func:`_bases`) explaining every
    one of ``ranks``, or None."""
    c = float(expected_weights(case, ranks[0], case.outputs[ranks[0]]).max())
    for basis in _bases(case):
        got = _fit(case, [rows[r][0] for r in ranks], basis)
        if got is None and all(rows[r][1] is not None for r in ranks):
            got = _fit(case, [rows[r][1] for r in ranks], basis)  # the right elements too
        if got is not None:
            m, v = got[0], _fraction_of(case, got[1], c)
            if _worst(case, ranks, lambda r: v * m) <= 1:
                return m, v
    return None


def _jointly(case: ParamCase, ranks: list, rows: dict,
             shared: frozenset = frozenset()) -> Dict[int, Diagnosis]:
    """One model for all ``ranks`` (the usual case: the same bug on every rank, and the
    only way to fit pieces too small to fit alone), the first that explains: each rank
    its own gradient (:func:`_local_pattern`), a lost contribution (:func:`_dropped`), a
    scale of the expected output, the least-squares weights (:func:`_fitted`). A lost
    contribution comes before a scale and the fit: within the bound it explains the output
    as well as they do, and it is the bug (a rank whose gradients are 1% of the others',
    lost, is within a bf16 bound of a scale of 0.99 too, and least squares cannot weigh so
    small a contribution). Returns the ranks it explains."""
    local = _local_pattern(case, ranks, shared)
    if local:
        return local
    weights = _dropped(case, ranks)
    if weights is None:
        scale = _common_scale(case, ranks)
        if scale is not None:
            return {r: _scale(case, [r], scale, case.outputs[r].own) for r in ranks}
        weights = _fitted(case, ranks, rows)
    if weights is None:
        return {}
    m, v = weights[:2]
    alone = len(ranks) == 1 and ranks[0] not in shared
    found = {r: _classify(case, r, case.outputs[r], m, v, alone) for r in ranks}
    return {r: d for r, d in found.items() if d is not None}


def _alone(case: ParamCase, rank: int, rows: dict, shared: frozenset) -> Optional[Diagnosis]:
    """Models of one rank's output: its own accumulated gradient (``local_only``, or at 2
    ranks the mean missing the other rank), then :func:`_jointly`'s fitted to it alone."""
    ro = case.outputs[rank]
    v = None if ro.own or case.nranks < 2 else _own_scale(case, [rank])
    if v is not None:
        d = _classify(case, rank, ro, _own_mask(case, rank), v, alone=rank not in shared)
        if d is not None:
            return d
    return _jointly(case, [rank], rows, shared).get(rank)


# --------------------------------------------------------------------------- diagnose


def _nonfinite(case: ParamCase) -> Optional[Diagnosis]:
    counts = {"nonfinite": 0, "mismatched": 0, "overflow": 0}
    for r in case.failing:
        s = case.outputs[r].stats if r in case.outputs else None
        if s is None:
            ro = case.outputs.get(r)
            if ro is not None:
                fin_o, fin_e = np.isfinite(ro.out), np.isfinite(ro.expected)
                counts["nonfinite"] += int(np.count_nonzero(~fin_o & fin_e))
                counts["mismatched"] += int(np.count_nonzero(fin_o & ~fin_e))
            continue
        for k in counts:
            counts[k] += int(getattr(s, k, 0) or 0)
    if not any(counts.values()):
        return None
    parts = []
    if counts["nonfinite"]:
        parts.append(f"{counts['nonfinite']} NaN/Inf output(s) where the reference is finite "
                     f"(an overflow in a narrow dtype, a division by 0, or memory never "
                     f"written)")
    if counts["mismatched"]:
        parts.append(f"{counts['mismatched']} element(s) where the reference is Inf/NaN (Inf/"
                     f"NaN in the inputs) but the output is not the same")
    if counts["overflow"]:
        parts.append(f"{counts['overflow']} element(s) whose float64 reference overflows "
                     f"(finite inputs too large to check)")
    return Diagnosis("nonfinite", "; ".join(parts), list(case.failing))


def _unexplained(case: ParamCase) -> Diagnosis:
    worst, where = 0.0, None
    for r in case.failing:
        ro = case.outputs.get(r)
        if ro is None:
            continue
        with np.errstate(divide="ignore", invalid="ignore"):  # a 0 bound (exact): inf
            ratio = np.abs(ro.out - ro.expected) / ro.bound
        ratio = np.where(np.isnan(ratio), np.inf, ratio)[ro.wrong]
        if ratio.size and float(ratio.max()) >= worst:
            worst, where = float(ratio.max()), (r, ratio.size, ro.out.size)
    stat = (f": on rank {where[0]}, {where[1]} of {where[2]} element(s) beyond the bound "
            f"(worst {worst:.3g}x)" if where else "")
    return Diagnosis("unexplained", f"no simple model fits (not a scale, a missing or "
                     f"doubled contribution, a local-only result, a shift, a swap or a "
                     f"narrower dtype){stat}", list(case.failing))


def _merge(case: ParamCase, found: List[Diagnosis]) -> Diagnosis:
    """One diagnosis for the param: the kind most wrong ranks share, with those ranks'
    fields. Where other ranks have another diagnosis, the text starts with the ranks the
    first part (and the fields) hold for and goes on with each other group's ranks, kind
    and text: every wrong rank's output is explained, not only the most common one."""
    groups: Dict[tuple, List[Diagnosis]] = {}
    for d in found:
        groups.setdefault(d.key(), []).append(d)
    ordered = sorted(groups.values(), key=lambda g: -sum(len(d.ranks) for d in g))
    head = ordered[0][0]
    ranks = sorted({r for d in found for r in d.ranks})

    def on(group: List[Diagnosis]) -> str:
        return f"on {names_of(sorted({r for d in group for r in d.ranks}), 'rank')}"

    if len(ordered) > 1:
        text = f"{on(ordered[0])}: {head.text}" + "".join(
            f"; {on(g)}: {g[0].kind}: {g[0].text}" for g in ordered[1:])
    else:
        text = f"{head.text} (wrong output {on(ordered[0])})"
    return Diagnosis(head.kind, text, ranks, head.factor, head.from_ranks, head.steps,
                     head.offset, head.with_, head.dtype)


def diagnose(case: ParamCase) -> Diagnosis:
    """The likely bug behind one failing param (see the module docstring for the method).

    Advice only: the check's verdict never depends on it.

    Args:
        case: the failing param's inputs, outputs, reference and bound.

    Returns:
        A :class:`Diagnosis`; its ``kind`` is ``unexplained`` when no model fits.
    """
    failing = [r for r in case.failing if r in case.outputs]
    if not failing:
        return Diagnosis("unexplained", "no output to diagnose", list(case.failing))
    nonfinite = _nonfinite(case)
    if nonfinite is not None:
        return nonfinite
    twins = _twins(case, failing)  # all_reduce: every rank the same wrong output, once
    failing = sorted(twins)
    rng = np.random.default_rng(0)
    share = max(FIT_ELEMENTS // len(failing), case.n * 4)
    for r in failing:
        case.outputs[r].sample = _sample(case.outputs[r], rng, share)
    rows = {r: _rows(case, case.outputs[r], rng, share) for r in failing}
    for r in failing:
        case.outputs[r].columns = rows[r][0][0]
    regular = [r for r in failing if not case.outputs[r].own]
    # an output other ranks hold too is never one rank's own gradient (local_only)
    shared = frozenset(r for r, ts in twins.items() if len(ts) > 1)
    found = _jointly(case, regular, rows, shared) if regular else {}
    for r in failing:
        if r not in found:
            d = _alone(case, r, rows, shared)
            if d is not None:
                found[r] = d
    rest = [r for r in failing if r not in found]
    result = list(found.values())
    wrong = sum(int(np.count_nonzero(case.outputs[r].wrong)) for r in found)
    size = sum(case.outputs[r].out.size for r in found)
    if found and wrong < size:  # the model explains the wrong elements; the rest are right
        for d in result:
            d.text += f"; in {wrong} of {size} elements, the rest right"
    if rest:
        # precision first: it reads no other param (its rounding-size test keeps a swapped
        # or shifted output out); then swap before shift (a param's whole slot shifted onto
        # another's of its size is a swap)
        d = find_precision(case, rest)
        if d is None and all(not case.outputs[r].own for r in rest):
            # an all-zero output (scale 0) may be the same shift reading padding
            zeros = [r for r, z in found.items() if z.kind == "scale" and z.factor == 0
                     and not case.outputs[r].own]
            buf = ReducedBuffer(case)
            d = find_swap(case, rest) or (zeros and find_shift(case, buf, sorted(rest + zeros))
                                      ) or find_shift(case, buf, rest)
            if d is not None and d.kind == "shift" and set(d.ranks) > set(rest):
                result = [x for r, x in found.items() if r not in d.ranks]
        result.append(d or _unexplained_for(case, rest))
    for d in result:  # each rank stands for its twins
        d.ranks = sorted(t for r in d.ranks for t in twins.get(r, [r]))
    return _merge(case, result)


def _twins(case: ParamCase, ranks: list) -> Dict[int, list]:
    """``{rank: [ranks holding the same output]}``, one key per distinct output (the
    same elements, expected the same way, the same values)."""
    out: Dict[int, list] = {}
    seen: Dict[tuple, int] = {}
    for r in ranks:
        ro = case.outputs[r]
        key = (ro.begin, ro.end, ro.own, hashlib.blake2b(
            np.ascontiguousarray(ro.out).tobytes(), digest_size=16).digest())
        if ro.own or key not in seen:  # an own output is expected per rank: never a twin
            seen[key] = r
            out[r] = [r]
        else:
            out[seen[key]].append(r)
    return out


def _unexplained_for(case: ParamCase, ranks: list) -> Diagnosis:
    sub = ParamCase(**{**case.__dict__, "failing": ranks})
    return _unexplained(sub)


# --------------------------------------------------------------------------- from check


def references_from_dumps(spec: Any, nranks: int, labels: list,
                          files: list) -> Callable[[str], tuple]:
    """``reference_of(name) -> (reference, bound)`` (flat float64) of any fused param,
    recomputed from the dumps' inputs when asked (``shift`` and ``swap`` candidates)."""
    params = {p.name: p for p in spec.fused_params()}
    cache: Dict[str, tuple] = {}  # the last few asked (shift and swap ask for the same ones)

    def reference_of(name: str) -> tuple:
        if name not in cache:
            if len(cache) >= REFERENCE_CACHE:
                cache.pop(next(iter(cache)))
            cache[name] = _reference(name)
        return cache[name]

    def _reference(name: str) -> tuple:
        p = params[name]
        grad_dtype = dtype_name(grad_dtype_for(p.dtype, spec.use_main_grad))
        total = ReferenceSum()
        for lab, f in zip(labels, files):
            for k in range(spec.acc_steps):
                x = read_array(f, lab, f"in/{name}/{k}", p.shape, p.dtype, missing_ok=True)
                total.add(np.zeros(p.shape) if x is None else x)
        ref = total.total / nranks if spec.average else total.total
        bound = error_bound(total.absolute, grad_dtype=grad_dtype, nranks=nranks,
                            acc_steps=spec.acc_steps, average=spec.average)
        return ref.reshape(-1), bound.reshape(-1)

    return reference_of


def diagnose_failure(p: Any, spec: Any, nranks: int, reduce_avg: bool, reference: np.ndarray,
                     bound: np.ndarray, inputs: list, seen: dict, per_rank: dict,
                     labels: list, files: list) -> Diagnosis:
    """The diagnosis ``check`` records for a failing param, from what it has at hand:
    ``inputs[rank][k]``, ``seen[rank] = (out, expected, bound, offset)`` of each failing
    output (``expected``/``bound`` None: the param's ``reference``/``bound`` from ``offset``;
    ranks with the same output may share one array, converted to float64 once),
    ``per_rank`` its ErrorStats. Never raises: a diagnosis that cannot be made is
    ``unexplained`` (the verdict does not depend on it)."""
    failing = sorted(r for r, s in per_rank.items() if not s.ok)
    try:
        grad_dtype = dtype_name(grad_dtype_for(p.dtype, spec.use_main_grad))
        reference = np.asarray(reference, dtype=np.float64).reshape(-1)
        bound = np.asarray(bound, dtype=np.float64).reshape(-1)
        outputs, wide = {}, {}  # wide: id of an output array -> its float64 copy
        for rank, (out, want, tol, offset) in seen.items():
            if id(out) not in wide:
                wide[id(out)] = (out, np.asarray(out, dtype=np.float64).reshape(-1))
            out = wide[id(out)][1]
            lo, hi = int(offset), int(offset) + out.size
            outputs[rank] = RankOutput(
                out, lo, hi,
                reference[lo:hi] if want is None else np.asarray(want, np.float64).reshape(-1),
                bound[lo:hi] if tol is None else np.asarray(tol, np.float64).reshape(-1),
                own=spec.act == "reduce" and rank != spec.dst, stats=per_rank.get(rank))
        wide = {}
        layout = next((buf.layout for buf in spec.plan(nranks)
                       if any(q.name == p.name for q in buf.params)), None)
        case = ParamCase(
            p.name, grad_dtype, nranks, spec.acc_steps, spec.act, bool(spec.average),
            [[np.asarray(x).reshape(-1) for x in xs] for xs in inputs],  # no float64 copy
            outputs, failing, reference, bound, dst=spec.dst,
            reduce_avg=reduce_avg, layout=layout,
            others={q.name: q.numel for q in spec.fused_params()},
            reference_of=references_from_dumps(spec, nranks, labels, files))
        return diagnose(case)
    except Exception as exc:  # the diagnosis is advice: never a reason for check to fail
        return Diagnosis("unexplained", f"no diagnosis ({type(exc).__name__}: {exc})",
                         failing)
