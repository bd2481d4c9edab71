"""``check_steps``: several training steps checked in one call, naming the step that fails.

A capture with a step label (``cap.step(k)``) saves ``DIR/step{k}/rank{r}.npz``; each step is
checked on its own, in order. Where a step fails and the step before it is there, the
failure is tested against the two ways an earlier step leaks into a later one: an
accumulator not zeroed between steps (the output holds this step's result plus the earlier
steps') and a stale buffer (the output still holds the previous step's result). Without that
test a gradient never zeroed shows up as an unexplained excess at step 1.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..errors import OracleMismatch
from .check import as_spec
from .check import check as check_one
from .dumps import DumpError, rank_files
from .report import CheckReport, enforce_strength, pass_line, verdict_of

#: a step folder of a steps directory (ASCII digits, no leading zeros: step0, step1, ...)
STEP_DIR = re.compile(r"step(0|[1-9][0-9]{0,8})", flags=re.ASCII)
_RANK_FILE = re.compile(r"rank(0|[1-9][0-9]{0,8})\.npz", flags=re.ASCII)


def step_dirs(directory: str) -> list:
    """``[(k, path)]`` of the ``step{k}/`` folders in ``directory``, by ``k`` (empty if none)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in names
             for m in [STEP_DIR.fullmatch(n)] if m and os.path.isdir(os.path.join(directory, n))]
    return sorted(found)


def is_steps_dir(dumps: Any) -> bool:
    """A directory holding ``step{k}/`` folders and no ``rank{r}.npz`` of its own."""
    if not isinstance(dumps, (str, os.PathLike)) or not os.path.isdir(dumps):
        return False
    directory = os.fspath(dumps)
    if any(_RANK_FILE.fullmatch(n) for n in os.listdir(directory)):
        return False
    return bool(step_dirs(directory))


@dataclass(frozen=True)
class StepDiagnosis:
    """Why ``name`` fails at ``step``: ``kind`` is ``accumulated`` (the output holds the
    results of steps ``since`` .. ``step`` summed: an accumulator not zeroed) or ``stale``
    (the output holds step ``since``'s result: the buffer was not updated)."""

    step: int
    name: str
    kind: str
    since: int

    def __str__(self) -> str:
        if self.kind == "stale":
            return (f"step {self.step}: {self.name}: stale: holds step {self.since}'s result, "
                    f"not step {self.step}'s (the output was not updated at step {self.step})")
        held = (f"step {self.step}'s result plus step {self.since}'s"
                if self.since == self.step - 1 else
                f"the sum of the results of steps {self.since} .. {self.step}")
        return (f"step {self.step}: {self.name}: stale: holds {held} (a gradient accumulator "
                f"not zeroed between steps: zero it after each step, e.g. zero_grad())")


@dataclass
class StepsReport:
    """Result of :func:`check_steps`: one :class:`CheckReport` per step (``steps``, in step
    order), what an earlier step explains of a failure (``diagnoses``), and the same verdict
    interface as a CheckReport (``ok``, ``failing``, ``raise_for_failure()``, ``lines()``,
    ``to_json()``, ``weak``, ``coarse``)."""

    #: ``[(k, CheckReport)]``, in step order
    steps: list
    #: where the dumps came from (a folder), for the report's head
    source: str = ""
    #: what an earlier step explains of a failing param (an accumulator not zeroed, a
    #: stale result), one ``StepDiagnosis`` each
    diagnoses: list = field(default_factory=list)
    #: the :class:`~mpifusion.spec.Spec` checked
    spec: Any = None

    @property
    def failing_steps(self) -> list:
        """The steps whose report fails, in order."""
        return [k for k, r in self.steps if not r.ok]

    @property
    def ok(self) -> bool:
        """Whether every step matches (as :attr:`CheckReport.ok`)."""
        return not self.failing_steps

    def verdict(self, allow_weak: bool = False) -> str:
        """As :meth:`CheckReport.verdict`, over every step (``allow_weak`` likewise)."""
        return verdict_of(self, allow_weak)

    def within(self) -> str:
        """As :meth:`CheckReport.within`: what every step's params met (the loosest)."""
        phrases = {r.within() for _, r in self.steps}
        for loosest in ("within the bound", "within the rounding of the mean (exact inputs)"):
            if loosest in phrases:
                return loosest
        return phrases.pop() if phrases else "within the bound"

    @property
    def failing(self) -> list:
        """The params failing at any step, first failure first (no repeats)."""
        return list(dict.fromkeys(n for _, r in self.steps for n in r.failing))

    @property
    def failing_ranks(self) -> list:
        """The ranks that stray at any step, sorted."""
        return sorted({rk for _, r in self.steps for rk in r.failing_ranks})

    @property
    def weak(self) -> list:
        """Every step's :attr:`CheckReport.weak`, without repeats."""
        return list(dict.fromkeys(w for _, r in self.steps for w in r.weak))

    @property
    def coarse(self) -> list:
        """Every step's :attr:`CheckReport.coarse`, without repeats."""
        return list(dict.fromkeys(c for _, r in self.steps for c in r.coarse))

    @property
    def notes(self) -> list:
        """Every step's :attr:`CheckReport.notes`, without repeats."""
        return list(dict.fromkeys(n for _, r in self.steps for n in r.notes))

    def weak_summary(self) -> str:
        """As :meth:`CheckReport.weak_summary`, over every step."""
        return CheckReport([], {}, weak=self.weak).weak_summary()

    def report(self, step: int) -> CheckReport:
        """The report of step ``step``.

        Args:
            step: the step's ``k`` (its folder ``step{k}/``).

        Raises:
            KeyError: no such step was checked.
        """
        for k, r in self.steps:
            if k == step:
                return r
        raise KeyError(f"step {step}: not checked (steps: {[k for k, _ in self.steps]})")

    def raise_for_failure(self) -> "StepsReport":
        """Raise :class:`OracleMismatch` naming the first failing step, its params and what an
        earlier step explains; else return self."""
        if self.ok:
            return self
        first = self.failing_steps[0]
        reasons = self.report(first).reasons()
        said = {d.name: str(d).split(": ", 2)[2] for d in self.diagnoses if d.step == first}
        head = "; ".join(f"{n} ({why}{'; ' + said[n] if n in said else ''})"
                         for n, why in list(reasons.items())[:10])
        others = [k for k in self.failing_steps if k != first]
        more = f" (also failing: step {', '.join(map(str, others))})" if others else ""
        raise OracleMismatch(f"oracle: step {first} does not match the reference{more}: "
                             f"{head}\n{self}", self)

    def raise_for_weakness(self, allow_weak: bool = False) -> "StepsReport":
        """As :meth:`CheckReport.raise_for_weakness`, over every step (``allow_weak``
        likewise)."""
        return enforce_strength(self, allow_weak)

    def to_json(self, *, allow_weak: bool = False) -> dict:
        """JSON-ready: ``verdict`` (:meth:`verdict`, with ``allow_weak``), ``failing_steps``,
        ``diagnoses`` and each step's report (``steps``: ``[{"step": k,
        ...CheckReport.to_json()}]``)."""
        return {"verdict": self.verdict(allow_weak), "failing_steps": self.failing_steps,
                "diagnoses": [{"step": d.step, "name": d.name, "kind": d.kind,
                               "since": d.since, "text": str(d)} for d in self.diagnoses],
                "weak": self.weak, "coarse": self.coarse,
                "steps": [{"step": k, **r.to_json(allow_weak=allow_weak)}
                          for k, r in self.steps]}

    def lines(self, allow_weak: bool = False) -> list:
        """Each step's verdict, what explains a failure, the first failing step's full
        report, and the overall verdict last (``PASS``, ``WEAK`` or ``FAIL``, as
        :meth:`CheckReport.lines`, ``allow_weak`` likewise)."""
        ks = [k for k, _ in self.steps]
        out = [f"check {self.source}: {len(ks)} step(s) ({', '.join(f'step{k}' for k in ks)})"]
        for k, r in self.steps:
            # a weak step's line is brief: the fix is said once, on the last line
            last = pass_line(r, r.passed(), allow_weak, brief=True) if r.ok else r.lines()[-1]
            out.append(f"step {k}: {last}")
            out.extend(str(d) for d in self.diagnoses if d.step == k)
        if self.ok:
            out.extend(f"note: {n}" for n in self.notes)
            n = max((len(r.stats) + len(r.sync) for _, r in self.steps), default=0)
            out.append(pass_line(self, f"{len(ks)} step(s), {n} params each {self.within()}",
                                 allow_weak))
            return out
        first = self.failing_steps[0]
        out.append(f"--- step {first} ---")
        out.extend(self.report(first).lines()[:-1])  # its notes included
        bad = self.report(first).failing
        others = self.failing_steps[1:]
        out.append(f"FAIL: step {first} of {len(ks)}: {', '.join(bad[:10])}"
                   f"{' ...' if len(bad) > 10 else ''}"
                   + (f" (also failing: step {', '.join(map(str, others))})" if others else ""))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _records(dumps: Any, nranks: int) -> list:
    """One step's records as dicts of arrays (a directory's files loaded)."""
    if isinstance(dumps, (str, os.PathLike)):
        dumps = rank_files(os.fspath(dumps), nranks)
    out = []
    for item in dumps:
        if isinstance(item, Mapping):
            out.append(dict(item))
        else:
            with np.load(os.fspath(item), allow_pickle=False) as z:
                out.append({k: z[k] for k in z.files})
    return out


def _merged(steps: list, last: Any, acc: int) -> list:
    """Records whose inputs are ``steps``' (renumbered as micro-steps of one step) and whose
    results are ``last``'s: what the output would be checked against if it held their sum."""
    merged = []
    for r, own in enumerate(last):
        rec = {k: v for k, v in own.items() if not k.startswith("in/")}
        for i, records in enumerate(steps):
            for key, value in records[r].items():
                if key.startswith("in/"):
                    name, _, m = key[3:].rpartition("/")
                    rec[f"in/{name}/{i * acc + int(m)}"] = value
        merged.append(rec)
    return merged


def _diagnose(spec: Any, k: int, load: Any, have: set, report: CheckReport,
              options: dict) -> list:
    """What earlier steps explain of step ``k``'s failing params (see the module doc);
    ``load(j)`` gives step ``j``'s records as dicts, ``have`` the steps there are."""
    bad = [name for name, kind, _ in report.failures() if kind == "grad"]
    if not bad or k - 1 not in have:
        return []
    acc = spec.acc_steps
    found: dict = {}
    candidates = []
    j = k - 1
    while j in have:  # the sum of steps j..k: an accumulator not zeroed since step j
        candidates.append(("accumulated", j, list(range(j, k + 1))))
        j -= 1
    candidates.append(("stale", k - 1, [k - 1]))  # the previous step's result
    for kind, since, steps in candidates:
        todo = [n for n in bad if n not in found]
        if not todo:
            break
        try:
            alt = check_one(dataclasses.replace(spec, acc_steps=acc * len(steps)),
                        _merged([load(i) for i in steps], load(k), acc), **options)
        except (DumpError, ValueError, OSError):
            continue  # a record the merge cannot express: no diagnosis, the failure stands
        fine = {s.name for s in alt.stats if s.ok}
        for name in todo:
            if name in fine:
                found[name] = StepDiagnosis(k, name, kind, since)
    return [found[n] for n in bad if n in found]


@functools.wraps(check_one)
def check(spec: Any, dumps: Any, **options: Any) -> Any:  # noqa: D103 - check_one's docstring
    if is_steps_dir(dumps):  # step{k}/ folders (cap.step(k)): each step, naming the failing one
        return check_steps(spec, dumps, **options)
    return check_one(spec, dumps, **options)


def check_steps(spec: Any, dumps: Any, **options: Any) -> StepsReport:
    """Check every step of a run, in order, and name the step that fails.

    ``dumps``: a directory of ``step{k}/`` folders, each holding ``rank{r}.npz`` (what
    ``cap.step(k)`` then ``cap.save(dir)`` writes), or a mapping ``{k: records}`` (each as
    :func:`~mpifusion.oracle.check` takes them). ``options`` go to ``check``. Bad input raises
    ``DumpError`` naming the step.

    Args:
        spec: the spec the run followed (a :class:`~mpifusion.spec.Spec`, a dict or a JSON
            path).
        dumps: as above.
        options: ``check``'s keyword arguments (``reduce_avg``, ``exact``).

    Returns:
        A :class:`StepsReport`; it fails (``ok`` False) if any step does.

    Raises:
        DumpError: no steps, or a step whose dumps cannot be read.
        SpecError: an invalid spec.
    """
    spec = as_spec(spec)
    if isinstance(dumps, (str, os.PathLike)):
        directory = os.fspath(dumps)
        found = step_dirs(directory)
        if not found:
            raise DumpError(f"{directory}: no step{{k}}/ folders (expected step0/ ... each "
                            f"holding rank0.npz ...: what cap.step(k) and cap.save(dir) write)")
        source = directory
    elif isinstance(dumps, Mapping):
        found = []
        for k, records in dumps.items():
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
                raise DumpError(f"dumps: step key {k!r}: expected an int >= 0")
            found.append((int(k), records))
        found.sort(key=lambda item: item[0])
        source = f"{len(found)} step(s) in memory"
    else:
        raise DumpError(f"dumps: expected a directory of step{{k}}/ folders or a mapping "
                        f"{{step: records}}, got {type(dumps).__name__}")
    if not found:
        raise DumpError("dumps: no step to check")
    result = StepsReport([], source=source, spec=spec)
    sources = dict(found)
    cache: dict = {}

    def load(j: int) -> list:  # only when a step fails: a passing run reads each file once
        if j not in cache:
            records = sources[j]
            n = spec.nranks if spec.nranks is not None else len(records)
            cache[j] = _records(records, n)
        return cache[j]

    for k, records in found:
        try:
            report = check_one(spec, records, **options)
        except DumpError as exc:
            raise DumpError(str(exc) if isinstance(records, (str, os.PathLike))
                            else f"step {k}: {exc}") from None
        result.steps.append((k, report))
        if not report.ok:
            result.diagnoses.extend(_diagnose(spec, k, load, set(sources), report, options))
            cache.clear()
    return result
