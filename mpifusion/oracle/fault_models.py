"""What a diagnosis says (:class:`Diagnosis`, its JSON contract) and what it is made from
(:class:`ParamCase`: one failing param's inputs and outputs), with the models that compare
outputs element by element: the reduced buffer shifted (``shift``), another param's
reduction (``swap``), the reduction in a narrower dtype (``precision``).

The weight fit and the driver are in ``diagnose.py``; this module is its leaf (numpy only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np

from ..dtypes import as_dtype
from .bound import bound_model, reduce_dtype, unit_roundoff

#: every kind, in the order they are tried (nonfinite first, unexplained last)
KINDS = ("nonfinite", "scale", "missing", "duplicate", "local_only", "shift", "swap",
         "precision", "unexplained")
#: the JSON fields each kind adds to ``kind``, ``text`` and ``ranks``
FIELDS = {"scale": ("factor",), "missing": ("from_ranks", "steps"),
          "duplicate": ("from_ranks", "steps"), "local_only": ("factor",), "shift": ("offset",),
          "swap": ("with",), "precision": ("dtype",)}
#: narrower dtypes a reduction may have been done in, tried in this order
NARROW_DTYPES = ("float16", "bfloat16")
#: slots on each side of the param whose references a shift may read from
NEIGHBOURS = 4
#: params of the same size tried as a swap, nearest in the buffer first (each one's
#: reference is recomputed from the dumps)
SWAP_CANDIDATES = 16
#: half the smallest subnormal spacing of each: a subnormal rounding's absolute error
_UNDERFLOW = {"float16": 2.0 ** -25, "bfloat16": 2.0 ** -134}


@dataclass
class Diagnosis:
    """What most likely went wrong with one failing param: ``kind`` (one of
    :data:`~mpifusion.oracle.fault_models.KINDS`), ``text`` (one line, with the usual cause),
    ``ranks`` (the ranks whose output is wrong) and the fields of the kind
    (:data:`~mpifusion.oracle.fault_models.FIELDS`; ``with_`` is JSON ``with``)."""

    kind: str
    text: str
    ranks: list
    #: for ``scale`` and ``local_only``, the factor the output is off by (2.0 for a sum
    #: taken as the mean of two ranks)
    factor: Optional[float] = None
    #: for ``missing`` and ``duplicate``, the ranks whose contribution is lost or counted twice
    from_ranks: Optional[list] = None
    #: for ``missing`` and ``duplicate``, the micro-steps concerned
    steps: Optional[list] = None
    #: for ``shift``, by how many elements the result is displaced
    offset: Optional[int] = None
    #: for ``swap``, the param whose reduction the output holds
    with_: Optional[str] = None
    #: for ``precision``, the narrower dtype the reduction was done in
    dtype: Optional[str] = None

    def to_json(self) -> dict:
        """``{"kind", "text", "ranks"}`` plus the kind's fields
        (:data:`~mpifusion.oracle.fault_models.FIELDS`)."""
        doc: Dict[str, Any] = {"kind": self.kind, "text": self.text,
                               "ranks": [int(r) for r in self.ranks]}
        for name in FIELDS.get(self.kind, ()):
            value = getattr(self, "with_" if name == "with" else name)
            doc[name] = list(value) if isinstance(value, (list, tuple)) else value
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> "Diagnosis":
        """The inverse of :meth:`to_json` (for tools reading a saved report).

        Args:
            doc: a dict :meth:`to_json` made (JSON-loaded).
        """
        extra = {("with_" if k == "with" else k): doc[k]
                 for k in FIELDS.get(doc["kind"], ()) if k in doc}
        return cls(doc["kind"], doc["text"], list(doc["ranks"]), **extra)

    def key(self) -> tuple:
        """What two ranks must share to get one diagnosis (kind and fields)."""
        return (self.kind,) + tuple(
            tuple(v) if isinstance(v, list) else v
            for v in (getattr(self, "with_" if n == "with" else n)
                      for n in FIELDS.get(self.kind, ())))


@dataclass
class RankOutput:
    """One rank's output of a param: ``out`` (flat float64) covering elements ``[begin,
    end)`` of the flattened param (``end`` may pass numel: Paddle's cut includes padding,
    expected 0), with what was expected there (``expected``, ``bound``); ``own``: the
    expectation is the rank's own accumulated gradient (``reduce`` off the root)."""

    out: np.ndarray
    begin: int
    end: int
    expected: np.ndarray
    bound: np.ndarray
    own: bool = False
    stats: Any = None  # the rank's ErrorStats, for nonfinite counts
    #: up to a few thousand wrong, finite elements (indices into ``out``): what the weights
    #: are fitted on, and where a model is tried before every element is
    sample: Optional[np.ndarray] = None
    #: the contributions' values at ``sample`` (elements x contributions), where built: a
    #: model is tried there by one product (dozens of models are tried per output)
    columns: Optional[np.ndarray] = None

    @property
    def wrong(self) -> np.ndarray:
        """The elements beyond the bound (or not finite): the ones a model must explain
        (the others are right whatever the bug)."""
        with np.errstate(invalid="ignore"):
            return ~(np.abs(self.out - self.expected) <= self.bound)


@dataclass
class ParamCase:
    """Everything :func:`diagnose` needs about one failing param: its sync (``act``, ...),
    the inputs ``inputs[rank][k]`` (flat, any float dtype), the outputs per rank, the
    failing ranks, the full reference and bound, and, for ``shift``/``swap``, the param's
    buffer ``layout``
    (a :class:`~mpifusion.plan.layout.FlatLayout`), the sizes of the other fused params
    (``others``: name -> numel) and ``reference_of(name) -> (reference, bound)`` (flat,
    computed on demand: a check streams params and keeps one reference at a time)."""

    name: str
    #: the dtype the grads are summed in
    grad_dtype: str
    #: ranks of the sync
    nranks: int
    #: micro-steps per step
    acc_steps: int
    act: str
    #: whether the result is the mean over ranks
    average: bool
    inputs: list
    outputs: dict
    failing: list
    reference: np.ndarray
    bound: np.ndarray
    #: the root of ``reduce``
    dst: int = 0
    #: the mean was taken in the collective (non-root ranks of ``reduce`` keep their sum)
    reduce_avg: bool = False
    layout: Any = None
    others: dict = field(default_factory=dict)
    reference_of: Optional[Callable[[str], tuple]] = None

    @property
    def n(self) -> int:
        """The number of contributions, one per rank and micro-step (index
        ``rank * acc_steps + k``)."""
        return self.nranks * self.acc_steps

    @property
    def numel(self) -> int:
        """Elements of the param."""
        return int(self.reference.size)


# --------------------------------------------------------------------------- helpers


def names_of(items: Sequence[int], what: str) -> str:
    items = list(items)
    return f"{what}{'s' if len(items) != 1 else ''} {', '.join(map(str, items))}"


def simple_fraction(x: float, max_den: int, max_num: Optional[int] = None) -> Optional[Fraction]:
    """``x`` as a simple fraction (denominator <= max_den, numerator <= max_num) when it is
    one to 1e-3."""
    if not math.isfinite(x) or x == 0:
        return Fraction(0) if x == 0 else None
    f = Fraction(x).limit_denominator(max_den)
    if max_num is not None and abs(f.numerator) > max_num:
        return None
    return f if abs(float(f) - x) <= 1e-3 * abs(x) else None


def fmt_factor(f: float) -> str:
    frac = simple_fraction(f, 64)
    if frac is not None and frac.denominator != 1:
        return f"{frac.numerator}/{frac.denominator}"
    return f"{int(frac)}" if frac is not None else f"{f:.6g}"


def column(case: ParamCase, j: int, begin: int, end: int,
           idx: Optional[np.ndarray] = None) -> np.ndarray:
    """Contribution ``j``'s values over ``[begin, end)`` (zeros past the param: padding),
    or at the elements ``idx`` of that range only."""
    x = case.inputs[j // case.acc_steps][j % case.acc_steps]
    if idx is not None:
        pos = begin + idx
        inside = pos < x.size
        out = np.zeros(idx.size)
        out[inside] = x[pos[inside]]
        return out
    seg = np.asarray(x[begin:min(end, x.size)], dtype=np.float64)  # inputs stay in their dtype
    if end > x.size:
        seg = np.concatenate([seg, np.zeros(end - max(begin, x.size))])
    return seg


def model(case: ParamCase, ro: RankOutput, w: np.ndarray,
          idx: Optional[np.ndarray] = None) -> tuple:
    """``(sum_j w_j x_j, sum_j |w_j| |x_j|)`` over the rank's elements (or ``idx`` of them),
    one column at a time (never the whole elements x contributions matrix)."""
    size = ro.end - ro.begin if idx is None else idx.size
    value, mag, tmp = np.zeros(size), np.zeros(size), np.empty(size)
    for j in np.flatnonzero(w):
        col = column(case, int(j), ro.begin, ro.end, idx)
        np.multiply(col, w[j], out=tmp)
        value += tmp
        np.abs(tmp, out=tmp)
        mag += tmp
    return value, mag


def model_bound(case: ParamCase) -> tuple:
    """``(rel, absolute)`` of the bound a model is checked within: the stated bound's
    constants with an average's roundings counted, doubled (a duplicate adds roundings)."""
    try:
        m = bound_model(grad_dtype=case.grad_dtype, nranks=case.nranks,
                        acc_steps=case.acc_steps, average=True)
    except ValueError:
        m = bound_model(grad_dtype=case.grad_dtype, nranks=case.nranks,
                        acc_steps=case.acc_steps, average=case.average)
    return 2 * m.rel, 2 * m.absolute


def misfit(case: ParamCase, ro: RankOutput, w: np.ndarray) -> float:
    """The largest error of weights ``w``'s model on the rank's elements beyond the stated
    bound, in units of the model's bound (:func:`model_bound`): at most 1 where the model
    explains the output. Two models that both explain an output are compared by it (the
    one closer to the output explains it better). The sample is tried first: most models
    fail there, and their misfit is then a lower bound (above 1 anyway)."""
    rel, absolute = model_bound(case)
    worst = 0.0
    for idx in ((ro.sample, None) if ro.sample is not None else (None,)):
        if idx is not None and ro.columns is not None:
            value, mag = ro.columns @ w, np.abs(ro.columns) @ np.abs(w)
        else:
            value, mag = model(case, ro, w, idx)
        out, bound = (ro.out, ro.bound) if idx is None else (ro.out[idx], ro.bound[idx])
        tol = rel * mag + absolute + np.where(np.isfinite(bound), bound, 0)
        wrong = ro.wrong if idx is None else np.ones(idx.size, dtype=bool)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            ratio = (np.abs(out - value) / tol)[wrong]
        if ratio.size:
            worst = max(worst, float(np.max(np.where(np.isnan(ratio), np.inf, ratio))))
        if worst > 1:
            break
    return worst


def explains(case: ParamCase, ro: RankOutput, w: np.ndarray) -> bool:
    """Whether weights ``w`` explain the rank's output within the model's bound on every
    element beyond the stated bound (a bug may touch part of a param only: gloo's reduce
    leaves a partial sum in one chunk and the full sum in the next)."""
    return misfit(case, ro, w) <= 1


def expected_weights(case: ParamCase, rank: int, ro: RankOutput) -> np.ndarray:
    """The weight each contribution has in a correct output of this rank."""
    n, acc = case.nranks, case.acc_steps
    if ro.own:
        w = np.zeros(case.n)
        w[rank * acc:(rank + 1) * acc] = 1.0 / n if case.average and not case.reduce_avg else 1.0
        return w
    return np.full(case.n, 1.0 / n if case.average else 1.0)


# --------------------------------------------------------------------------- shift, swap


class ReducedBuffer:
    """The reduced flat buffer around the param (the param's slot and its neighbours,
    padding 0), with its bound; built on demand."""

    def __init__(self, case: ParamCase) -> None:
        self.case = case
        self.values: Optional[np.ndarray] = None

    def build(self) -> None:
        """Lay the references of the param and of :data:`NEIGHBOURS` slots each side at
        their offsets (computed now: only a shift needs them)."""
        case = self.case
        lay = case.layout
        if lay is None or case.name not in lay or case.reference_of is None:
            self.start, self.names = 0, [(case.name, 0, case.numel)]
            self.values, self.tol = case.reference.copy(), case.bound.copy()
            self.slot = 0
            return
        order = [s.name for s in lay.slots]
        i = order.index(case.name)
        near = lay.slots[max(i - NEIGHBOURS, 0):i + NEIGHBOURS + 1]
        self.start = near[0].offset
        size = near[-1].padded_end - self.start
        self.values, self.tol = np.zeros(size), np.zeros(size)
        self.names = []
        for s in near:
            ref, bnd = ((case.reference, case.bound) if s.name == case.name
                        else case.reference_of(s.name))
            lo = s.offset - self.start
            self.values[lo:lo + s.numel] = ref
            self.tol[lo:lo + s.numel] = bnd
            self.names.append((s.name, lo, lo + s.numel))
        self.slot = lay[case.name].offset - self.start


def candidate_offsets(out: np.ndarray, pos: np.ndarray, values: np.ndarray) -> list:
    """Candidate offsets ``d`` (output element at buffer position ``p`` holds
    ``values[p + d]``), most votes first: a few distinctive output values looked up in
    the sorted buffer."""
    ok = np.flatnonzero(np.isfinite(out) & (out != 0))
    if not ok.size:
        return []
    probe = ok[np.argsort(-np.abs(out[ok]), kind="stable")[:24]]
    order = np.argsort(values, kind="stable")
    sv = values[order]
    votes: Dict[int, int] = {}
    for i in probe:
        t = 1e-3 * abs(out[i])
        lo, hi = np.searchsorted(sv, out[i] - t), np.searchsorted(sv, out[i] + t, "right")
        for src in order[lo:min(hi, lo + 8)]:
            d = int(src) - int(pos[i])
            if d:
                votes[d] = votes.get(d, 0) + 1
    need = min(3, probe.size)  # a 2-element param has 2 values to match
    return [d for d, c in sorted(votes.items(), key=lambda kv: -kv[1]) if c >= need][:4]


def find_shift(case: ParamCase, buf: ReducedBuffer, ranks: list) -> Optional[Diagnosis]:
    """``shift``: one offset ``d`` with every output element ``i`` equal to the reduced
    buffer's element ``i + d`` within the bound (a flat buffer read back at the wrong
    offset, without its padding, or with a wrong slice), on every one of ``ranks``."""
    if buf.values is None:
        buf.build()
    found = None
    edge = 0  # elements at one end of an output that the shift does not explain (most)
    span = None  # [lo, hi) of the buffer positions the explained elements come from
    # the offset comes from the output with the most values to match (not a zero one)
    for rank in sorted(ranks, key=lambda r: -int(np.count_nonzero(case.outputs[r].out))):
        ro = case.outputs[rank]
        pos = buf.slot + ro.begin + np.arange(ro.out.size)
        cands = [found] if found is not None else candidate_offsets(ro.out, pos, buf.values)
        for d in cands:
            src = pos + d
            valid = (src >= 0) & (src < buf.values.size)
            if valid.mean() < 0.5:
                continue
            match = np.zeros(ro.out.size, dtype=bool)
            s = src[valid]
            tol = 2 * buf.tol[s] + np.where(np.isfinite(ro.bound), ro.bound, 0)[valid]
            with np.errstate(invalid="ignore"):
                match[valid] = np.abs(ro.out[valid] - buf.values[s]) <= tol
            rest = _end_run(match)
            if rest is not None and match.sum() >= max(0.75 * valid.sum(), 1):
                found, edge = d, max(edge, rest)
                used = src[match]
                span = (int(used.min()), int(used.max()) + 1) if span is None else (
                    min(span[0], int(used.min())), max(span[1], int(used.max()) + 1))
                break
        else:
            return None
    if found is None:
        return None
    lo, hi = span
    from_ = [name for name, a, b in buf.names if name != case.name and a < hi and lo < b]
    where = (f", partly from the neighbour {' and '.join(map(repr, from_))} in the buffer"
             if from_ else " within the param")
    also = (f"; the {edge} element(s) at one end hold other values (zeros, wrapped or "
            f"stale data where the shifted read had none)" if edge else "")
    return Diagnosis("shift", f"the right values at the wrong elements: output element i "
                     f"holds the reference's element i{found:+d}{where}{also} (a flat-buffer "
                     f"offset or slice off by {abs(found)} element(s))", list(ranks),
                     offset=found)


def _end_run(match: np.ndarray) -> Optional[int]:
    """How many elements at one end of an output are not explained (0: none), or None
    when unexplained ones lie elsewhere too: a shifted read (``roll``, a slice padded with
    zeros) leaves its gap at the start or the end, never in the middle."""
    bad = np.flatnonzero(~match)
    if not bad.size:
        return 0
    n = match.size
    if bad[0] == 0 and bad[-1] == bad.size - 1:        # one run at the start
        return int(bad.size)
    if bad[-1] == n - 1 and bad[0] == n - bad.size:    # one run at the end
        return int(bad.size)
    return None


def find_swap(case: ParamCase, ranks: list) -> Optional[Diagnosis]:
    """``swap``: another param of the same size whose reference the output is, within the
    bound, on every one of ``ranks`` (two params' gradients exchanged)."""
    if case.reference_of is None:
        return None
    names = [n for n, numel in case.others.items() if numel == case.numel and n != case.name]
    if case.layout is not None:  # buffer neighbours first
        order = {s.name: i for i, s in enumerate(case.layout.slots)}
        here = order.get(case.name, 0)
        names.sort(key=lambda n: abs(order[n] - here) if n in order else len(order) + 1)
    for other in names[:SWAP_CANDIDATES]:
        ref, bnd = case.reference_of(other)
        ok = True
        for rank in ranks:
            ro = case.outputs[rank]
            hi = min(ro.end, ref.size)
            want = np.concatenate([ref[ro.begin:hi], np.zeros(ro.end - max(hi, ro.begin))])
            tol = np.concatenate([bnd[ro.begin:hi], np.zeros(ro.end - max(hi, ro.begin))])
            tol = 2 * tol + np.where(np.isfinite(ro.bound), ro.bound, 0)
            with np.errstate(invalid="ignore"):
                if not np.all(np.abs(ro.out - want) <= tol):
                    ok = False
                    break
        if ok:
            return Diagnosis("swap", f"the output is {other!r}'s reduced gradient (two "
                             f"params' gradients swapped: a name or offset mix-up between "
                             f"params of the same size)", list(ranks), with_=other)
    return None


# --------------------------------------------------------------------------- precision


def simulate(case: ParamCase, ro: RankOutput, rank: int, dtype: str) -> np.ndarray:
    """The correct reduction done in ``dtype`` throughout (per-rank accumulation, the sum
    over ranks in rank order, the scale), rounded to the grad dtype at the end."""
    dt, acc = as_dtype(dtype), case.acc_steps
    e = expected_weights(case, rank, ro)
    total = None
    with np.errstate(over="ignore", invalid="ignore"):  # fp16 overflows: inf, never chosen
        for r in range(case.nranks):
            if not e[r * acc]:
                continue
            local = None
            for k in range(acc):
                x = column(case, r * acc + k, ro.begin, ro.end).astype(dt)
                local = x if local is None else (local + x).astype(dt)
            total = local if total is None else (total + local).astype(dt)
        scale = float(e[e != 0][0])
        if scale != 1:
            total = (total * np.asarray(scale).astype(dt)).astype(dt)
        return total.astype(as_dtype(case.grad_dtype)).astype(np.float64)


def find_precision(case: ParamCase, ranks: list) -> Optional[Diagnosis]:
    """Within the worst-case bound of the reduction in a narrower dtype; of the dtypes
    that fit, the one whose simulated error is the closest in size to the observed."""
    stated = unit_roundoff(reduce_dtype(case.grad_dtype))
    best = None
    for dtype in NARROW_DTYPES:
        u = unit_roundoff(dtype)
        if u <= stated:
            continue
        fits, score = True, 0.0
        for rank in ranks:
            ro = case.outputs[rank]
            e = expected_weights(case, rank, ro)
            _, mag = model(case, ro, e)
            terms = int(np.count_nonzero(e))
            rounds = terms - 1 + (2 if e[e != 0][0] != 1 else 0) + 2
            theta = rounds * u
            if theta >= 0.5:
                fits = False
                break
            tol = (mag * theta / (1 - theta) + rounds * _UNDERFLOW[dtype]
                   + np.where(np.isfinite(ro.bound), ro.bound, 0))
            err = np.abs(ro.out - ro.expected)
            with np.errstate(invalid="ignore"):
                if not np.all(err <= tol):
                    fits = False
                    break
            sim = np.abs(simulate(case, ro, rank, dtype) - ro.expected)
            with np.errstate(over="ignore", invalid="ignore"):
                obs_rms = float(np.sqrt(np.mean(err ** 2)))
                sim_rms = float(np.sqrt(np.mean(sim ** 2)))
                # a narrow reduction strays on most elements, not on a few: one corrupted
                # element whose error happens to fit the narrow bound is no precision loss
                obs_n = int(np.count_nonzero(err > ro.bound))
                sim_n = int(np.count_nonzero(sim > ro.bound))
            if obs_n * 4 < sim_n:
                fits = False
                break
            if not (math.isfinite(obs_rms) and math.isfinite(sim_rms)):
                score = math.inf
            elif obs_rms > 0 and sim_rms > 0:
                score = max(score, abs(math.log(obs_rms / sim_rms)))
            elif obs_rms != sim_rms:
                score = math.inf
        # the coarse worst-case bound alone would take random noise for a narrow dtype: the
        # error must also be of the size that dtype's rounding makes (within a factor 6)
        if fits and score <= math.log(6) and (best is None or score < best[1]):
            best = (dtype, score)
    if best is None:
        return None
    dtype = best[0]
    # the stated bound sums in fp32 even for half grads: name what it allows, not only a dtype
    cause = ("a collective on half-precision data" if dtype == case.grad_dtype else
             "a collective on half-precision data, or no fp32 main grads")
    return Diagnosis("precision", f"within the bound of the same reduction done in "
                     f"{dtype} throughout, but beyond the stated bound ({case.grad_dtype} "
                     f"grads summed in {reduce_dtype(case.grad_dtype)}): accumulated or "
                     f"reduced in {dtype} ({cause})", list(ranks), dtype=dtype)
