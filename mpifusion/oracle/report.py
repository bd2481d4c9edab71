"""What :func:`~mpifusion.oracle.check` reports: per-param gradient statistics, the pieces
no rank (or several ranks) held, the param all-gathers, and the verdict.

Kept apart from the checking itself (``check``), which fills it in: the report is what a
user reads, prints, saves as JSON or plots, and none of that needs the dumps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import OracleMismatch, OracleWarning, WeakCheckError
from .bound import ErrorStats, format_ratio


@dataclass(frozen=True)
class CoverageIssue:
    """Elements ``[begin, end)`` of a flattened param that no rank holds (``gap``: those
    elements are unchecked, so the param fails) or that several ranks hold (``overlap``:
    reported, each rank's values are still checked)."""

    #: the param's name
    name: str
    #: ``"out"`` (reduce-scattered grads) or ``"shard"`` (param shards)
    what: str
    #: ``"gap"`` or ``"overlap"``
    kind: str
    #: the first element of the range
    begin: int
    #: one past its last element
    end: int
    #: the ranks that hold it (an overlap)
    ranks: tuple = ()

    @property
    def fails(self) -> bool:
        """Whether it fails the param (a gap does; an overlap is only reported)."""
        return self.kind == "gap"

    def __str__(self) -> str:
        who = (f"held by ranks {', '.join(map(str, self.ranks))}" if self.kind == "overlap"
               else "held by no rank")
        return f"{self.name}: {self.what}/ {self.kind} [{self.begin}, {self.end}) {who}"


@dataclass
class SyncStats:
    """The param all-gather of one param: every rank's ``param/{name}`` against the shards."""

    #: the param's name
    name: str
    #: elements compared, over every rank
    compared: int = 0
    #: elements differing in bits from the shard that holds them
    mismatched: int = 0
    #: ranks whose gathered param differs
    ranks: list = field(default_factory=list)
    #: elements where overlapping shards disagree
    conflicts: int = 0

    @property
    def ok(self) -> bool:
        """Whether the gathered param is bit-exact on every rank, with no conflict."""
        return self.mismatched == 0 and self.conflicts == 0


@dataclass
class CheckReport:
    """Result of :func:`check`: per-param gradient stats in spec order (``stats``), the same
    per rank (``rank_stats[name][rank]``), the bound per grad dtype, shard coverage issues and
    the all-gather stats (``sync``)."""

    #: one :class:`ErrorStats` per param, in spec order
    stats: list
    #: grad dtype -> the bound's formula (:attr:`BoundModel.formula`)
    bounds: dict
    #: name -> rank -> :class:`ErrorStats` of that rank's output
    rank_stats: dict = field(default_factory=dict)
    #: the :class:`CoverageIssue` of every gap or overlap of the shards
    coverage: list = field(default_factory=list)
    #: one :class:`SyncStats` per param whose all-gather was checked
    sync: list = field(default_factory=list)
    #: the :class:`~mpifusion.spec.Spec` checked
    spec: Any = None
    #: where the dumps came from (a folder), for the report's head
    source: str = ""
    #: whether the mean was taken in the collective (``check(reduce_avg=True)``)
    reduce_avg: bool = False
    #: checked with exact inputs (``check(exact=True)``), so 0 difference or the mean's rounding
    exact: bool = False
    #: the params whose pieces came with ``range/`` entries (any split of the gradient)
    ranged: list = field(default_factory=list)
    #: what this check could not tell, in words (printed as ``note:`` lines, JSON ``notes``):
    #: a bound too coarse to see one lost input, inputs that cannot reveal a missing
    #: reduction, keys of params the spec does not fuse
    notes: list = field(default_factory=list)
    #: name -> :class:`~mpifusion.oracle.Diagnosis` of every failing param's grads:
    #: what most likely went wrong (a sum for a mean, a missing rank, ...); advice only, the
    #: verdict never depends on it
    diagnoses: dict = field(default_factory=dict)
    #: why these inputs cannot reveal a missing reduction, one ``"{name}: why"`` per param
    #: (identical inputs on every rank, all-zero inputs): a PASS proves little, and
    #: ``assert_matches_reference`` and the pytest fixture fail on it unless ``allow_weak``
    weak: list = field(default_factory=list)
    #: grad dtypes whose bound is coarser than one input's contribution (a result missing one
    #: rank or micro-step may pass): the fixture and ``assert_matches_reference`` warn
    coarse: list = field(default_factory=list)
    #: inputs whose loss the bound cannot see (each one's share of the result within the
    #: bound on every element): ``"rank 1"``/``"rank 0 micro-step 1"`` -> the params
    #: (said in ``notes`` and ``coarse``)
    unseen: dict = field(default_factory=dict)

    # ---------------------------------------------------------------- verdicts
    def failures(self) -> list:
        """``(name, kind, why)`` for every failure, in spec order; ``kind`` is ``grad``
        (beyond the bound, Inf/NaN), ``gap`` (elements no rank holds) or ``gather`` (the
        all-gather differs from the shards)."""
        items = []
        for s in self.stats:
            if not s.ok:
                simple = not (s.nonfinite or getattr(s, "mismatched", 0)
                              or getattr(s, "overflow", 0))
                wrong = self.wrong_ranks(s.name)
                where = (f"on rank {s.worst_rank}" if len(wrong) <= 1 else
                         f"on ranks {wrong}, worst at rank {s.worst_rank}")
                items.append((s.name, "grad", f"err/bound {format_ratio(s.max_ratio)} {where}"
                              if simple else (s.reason or "nonfinite")))
        for c in self.coverage:
            if c.fails:
                items.append((c.name, "gap", f"{c.what}/ gap [{c.begin}, {c.end})"))
        for s in self.sync:
            if not s.ok:
                what = []
                if s.mismatched:
                    what.append(f"all-gather differs on rank(s) {', '.join(map(str, s.ranks))}")
                if s.conflicts:
                    what.append(f"overlapping shards disagree in {s.conflicts} element(s)")
                items.append((s.name, "gather", "; ".join(what)))
        if self.spec is not None:
            order = {p.name: i for i, p in enumerate(self.spec.params)}
            items.sort(key=lambda item: order.get(item[0], len(order)))
        return items

    def reasons(self) -> dict:
        """name -> why it fails (in spec order), for every failing param."""
        out: dict = {}
        for name, _, why in self.failures():
            out.setdefault(name, []).append(why)
        return {k: "; ".join(v) for k, v in out.items()}

    @property
    def failing(self) -> list:
        """The names of the failing params, in spec order (empty when :attr:`ok`)."""
        return list(self.reasons())

    def wrong_ranks(self, name: str) -> list:
        """The ranks whose gradient of ``name`` strays (every one, not only the worst: one
        rank's bad contribution makes every rank's reduced result wrong)."""
        return sorted(r for r, s in self.rank_stats.get(name, {}).items() if not s.ok)

    def weak_summary(self) -> str:
        """One line: why a PASS of these inputs proves little (empty when it does not)."""
        if not self.weak:
            return ""
        by_why: dict = {}
        for item in self.weak:
            name, _, why = item.partition(": ")
            by_why.setdefault(why, []).append(name)
        return "; ".join(f"{why} ({', '.join(names[:4])}{' ...' if len(names) > 4 else ''})"
                         for why, names in by_why.items())

    @property
    def failing_ranks(self) -> list:
        """The ranks whose output strays for some param (their grads, or their gathered
        params), sorted."""
        ranks = set()
        for name, per in self.rank_stats.items():
            ranks.update(r for r, s in per.items() if not s.ok)
        for s in self.sync:
            ranks.update(s.ranks)
        return sorted(ranks)

    @property
    def ok(self) -> bool:
        """Whether nothing mismatches (a weak check is ok too, see :meth:`verdict`)."""
        return not self.failing

    def verdict(self, allow_weak: bool = False) -> str:
        """``FAIL`` (a mismatch), ``WEAK`` (no mismatch, but on inputs that cannot reveal a
        missing reduction: ``weak``; ``PASS`` where ``allow_weak``) or ``PASS``."""
        return verdict_of(self, allow_weak)

    def within(self) -> str:
        """How the params matched: ``within the bound``, or with exact inputs ``bit-exact
        (exact inputs)`` / ``within the rounding of the mean (exact inputs)``."""
        if not self.exact:
            return "within the bound"
        return ("bit-exact (exact inputs)" if all("bit-exact" in f for f in self.bounds.values())
                else "within the rounding of the mean (exact inputs)")

    def raise_for_failure(self) -> "CheckReport":
        """Raise :class:`OracleMismatch` naming the failing params and ranks; else return self
        (so ``check(...).raise_for_failure()`` chains in tests)."""
        if self.ok:
            return self
        reasons = self.reasons()
        head = "; ".join(f"{n} ({why})" for n, why in list(reasons.items())[:10])
        more = f" and {len(reasons) - 10} more" if len(reasons) > 10 else ""
        ranks = self.failing_ranks
        where = f" on rank(s) {', '.join(map(str, ranks))}" if ranks else ""
        raise OracleMismatch(f"oracle: {len(reasons)} param(s) do not match the reference"
                             f"{where}: {head}{more}\n{self}", self)

    def raise_for_weakness(self, allow_weak: bool = False) -> "CheckReport":
        """Raise :class:`~mpifusion.errors.WeakCheckError` (one line: why, and how to fix
        the inputs) where these inputs cannot reveal a missing reduction, unless
        ``allow_weak``; warn (:class:`~mpifusion.errors.OracleWarning`) where the bound is
        coarser than one input; return self."""
        return enforce_strength(self, allow_weak)

    def passed(self) -> str:
        """What a verdict without a mismatch says was checked: ``6 params within the
        bound``, ``..., 2 gathered params exact``."""
        parts = [f"{len(self.stats)} params {self.within()}"] if self.stats else []
        if self.sync:
            parts.append(f"{len(self.sync)} gathered params exact")
        checked = len({*(s.name for s in self.stats), *(s.name for s in self.sync)})
        return ", ".join(parts) or f"{checked} params"

    # ---------------------------------------------------------------- output
    def to_json(self, spec: Any = None, *, allow_weak: bool = False) -> dict:
        """The report as JSON-ready data (``null`` for an infinite ratio); ``verdict`` as
        :meth:`verdict` gives it.

        Args:
            spec: the spec to describe (default the report's own).
            allow_weak: as in :meth:`verdict`.
        """
        spec = spec if spec is not None else self.spec

        def num(x: float) -> Optional[float]:
            return None if math.isinf(x) or math.isnan(x) else x

        def row(s: ErrorStats) -> dict:
            return {"name": s.name, "compared": s.compared, "max_abs_err": num(s.max_abs),
                    "max_rel_err": num(s.max_rel), "err_over_bound": num(s.max_ratio),
                    "worst_rank": s.worst_rank, "nonfinite": s.nonfinite,
                    "nonfinite_reference": s.nonfinite_ref, "nonfinite_mismatch": s.mismatched,
                    "overflow": s.overflow, "beyond_bound": s.beyond, "ok": s.ok,
                    "reason": s.reason, "wrong_ranks": self.wrong_ranks(s.name)}

        params = []
        for s in self.stats:
            entry = row(s)
            entry["ranks"] = [{"rank": r, "compared": rs.compared,
                               "err_over_bound": num(rs.max_ratio), "ok": rs.ok}
                              for r, rs in sorted(self.rank_stats.get(s.name, {}).items())]
            if s.name in self.diagnoses:
                entry["diagnosis"] = self.diagnoses[s.name].to_json()
            params.append(entry)
        doc = {"verdict": self.verdict(allow_weak)}
        if spec is not None:
            doc.update({"act": spec.act, "nranks": spec.nranks, "acc_steps": spec.acc_steps,
                        "average": spec.average, "dst": spec.dst})
        doc.update({
            "bound": self.bounds, "params": params,
            "coverage": [{"name": c.name, "what": c.what, "kind": c.kind, "begin": c.begin,
                          "end": c.end, "ranks": list(c.ranks)} for c in self.coverage],
            "sync_params": [{"name": s.name, "compared": s.compared,
                             "mismatched": s.mismatched, "ranks": s.ranks,
                             "conflicts": s.conflicts, "ok": s.ok} for s in self.sync],
            "failing": self.reasons(),
            "notes": list(self.notes),
            "exact": self.exact,
            "weak": list(self.weak),
            "coarse": list(self.coarse),
        })
        return doc

    def lines(self, allow_weak: bool = False) -> list:
        """The human report, one string per line (what ``mpifusion check`` prints); the last
        is the verdict: ``PASS: ...``, ``WEAK: ...`` (why, and the fix; ``PASS (weak,
        allowed: ...)`` where ``allow_weak``) or ``FAIL: ...``."""
        spec = self.spec
        out = []
        if spec is not None:
            cut = ("each rank's range/ of the flattened gradient" if self.ranged else
                   "each rank's slice of the padded gradient")
            what = {"all_reduce": "full gradient on every rank" if not self.ranged else
                    "full gradient, or the range/ of it a rank holds",
                    "reduce": f"on root {spec.dst}",
                    "reduce_scatter": cut}[spec.act]
            out.append(f"check {self.source}: {spec.act} ({what}), {spec.nranks} rank(s), "
                       f"acc_steps {spec.acc_steps}, {'mean' if spec.average else 'sum'} over "
                       f"ranks")
        for dtype, formula in self.bounds.items():
            out.append(f"bound for {dtype} grads: {formula}")
        if self.stats:
            width = max(len("param"), *(len(s.name) for s in self.stats))
            out.append(f"{'param':<{width}}  {'elements':>10}  {'max abs err':>11}  "
                       f"{'max rel err':>11}  {'err/bound':>9}  {'worst':>5}  status")
            for s in self.stats:
                status = "ok" if s.ok else ("NONFINITE" if s.nonfinite else "FAIL")
                if not s.ok and self.wrong_ranks(s.name):  # worst is one rank; wrong, all
                    wrong = self.wrong_ranks(s.name)
                    status += f": wrong on rank{'s' if len(wrong) > 1 else ''} {wrong}"
                rank = "-" if s.worst_rank is None else s.worst_rank
                out.append(f"{s.name:<{width}}  {s.compared:>10}  {s.max_abs:>11.3g}  "
                           f"{s.max_rel:>11.3g}  {format_ratio(s.max_ratio):>9}  {rank:>5}  "
                           f"{status}")
            for s in self.stats:
                why = getattr(s, "reason", None)
                if why:
                    out.append(f"{s.name}: {why}")
                if s.name in self.diagnoses:
                    d = self.diagnoses[s.name]
                    out.append(f"diagnosis: {s.name}: {d.kind}: {d.text}")
        for c in self.coverage:
            out.append(f"{'GAP' if c.fails else 'note'}: {c}")
        if self.sync:
            width = max(len("param"), *(len(s.name) for s in self.sync))
            out.append("sync_params (all-gather, bit-exact):")
            out.append(f"{'param':<{width}}  {'elements':>10}  {'differ':>8}  ranks")
            for s in self.sync:
                ranks = ", ".join(map(str, s.ranks)) or "-"
                extra = f"  ({s.conflicts} conflicting shard element(s))" if s.conflicts else ""
                out.append(f"{s.name:<{width}}  {s.compared:>10}  {s.mismatched:>8}  {ranks}"
                           f"{extra}")
        out.extend(f"note: {n}" for n in self.notes)
        reasons = self.reasons()
        if not reasons:
            out.append(pass_line(self, self.passed(), allow_weak))
        elif all(kind == "grad" for _, kind, _ in self.failures()):
            bad = list(reasons)
            out.append(f"FAIL: {len(bad)} param(s) beyond the bound: {', '.join(bad[:10])}"
                       f"{' ...' if len(bad) > 10 else ''}")
        else:
            items = list(reasons.items())
            out.append(f"FAIL: {len(items)} param(s): "
                       + ", ".join(f"{n} ({why})" for n, why in items[:10])
                       + (" ..." if len(items) > 10 else ""))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


#: how to make inputs that can reveal a missing reduction (the weak-check message's tail)
WEAK_FIX = ("give each rank its own data (a per-rank seed, e.g. torch.manual_seed(seed + "
            "rank), or mpifusion.oracle.exact_inputs), or pass allow_weak=True")


#: the same, where ``mpifusion check`` prints it (the last line of a WEAK verdict)
WEAK_FIX_CLI = ("give each rank its own data (a per-rank seed, or "
                "mpifusion.oracle.exact_inputs), or accept it: --allow-weak (allow_weak=True)")


def verdict_of(report: Any, allow_weak: bool = False) -> str:
    """``FAIL``, ``WEAK`` or ``PASS`` of a CheckReport or a StepsReport."""
    if not report.ok:
        return "FAIL"
    return "WEAK" if report.weak and not allow_weak else "PASS"


def pass_line(report: Any, what: str, allow_weak: bool = False, brief: bool = False) -> str:
    """The last line of a report without a mismatch: ``PASS: {what}``; for weak inputs
    ``WEAK: {what}, but {why}: ...; {the fix}`` (``brief``: ``WEAK ({why}): {what}``, a
    step's line), or ``PASS (weak, allowed: {why}): {what}`` where ``allow_weak``."""
    if not report.weak:
        return f"PASS: {what}"
    why = report.weak_summary()
    if allow_weak:
        return f"PASS (weak, allowed: {why}): {what}"
    if brief:
        return f"WEAK ({why}): {what}"
    return (f"WEAK: {what}, but {why}: these inputs cannot reveal a missing reduction (a "
            f"reducer that does nothing passes too); {WEAK_FIX_CLI}")


def weak_message(report: Any) -> str:
    """The one line a weak check fails with: why these inputs prove little, and the fix."""
    return (f"mpifusion oracle: weak check: {report.weak_summary()}: these inputs cannot reveal "
            f"a missing reduction (a reducer that does nothing passes too); {WEAK_FIX}")


def enforce_strength(report: Any, allow_weak: bool = False) -> Any:
    """What ``assert_matches_reference`` and the fixture do after a PASS: refuse a weak one
    (unless ``allow_weak``), warn of a coarse bound. ``report``: a CheckReport or a
    StepsReport (both have ``weak``, ``coarse`` and ``weak_summary``)."""
    import warnings

    if report.weak and not allow_weak:
        raise WeakCheckError(weak_message(report), report)
    for why in dict.fromkeys(report.coarse):
        warnings.warn(OracleWarning(f"mpifusion oracle: {why}: a result missing one rank's or "
                                    f"one micro-step's gradient may pass"), stacklevel=4)
    return report
