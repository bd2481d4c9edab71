"""Which skips a strict run allows, and the check that every test ran somewhere.

A test skips when something it needs is missing. On a developer's machine that is fine (a
plain ``pytest`` without torch skips the torch tests and says so with ``-ra``); in
``scripts/test.sh`` and CI it is not: a missing framework, Slurm or Open MPI would turn tests
into skips that nobody reads. With ``--strict-skips`` (or ``MPIFUSION_STRICT_SKIPS=1``) a
skip fails the run unless its reason falls in a category allowed here:

- always: ``gpu`` (this machine has no GPU: the cupy and CUDA-aware paths run on a GPU
  runner), ``cpu`` (a half-precision kernel path this CPU lacks, e.g. AVX-512: a CPU that has
  it runs it, and every path this CPU has runs here) and ``ranks`` (a test needs another rank
  count; the run at that count takes it, and ``report`` checks across the runs that it did);
- when the machine cannot do better: ``root`` for a non-root user, ``compiler`` where no C
  compiler is installed (the half-precision kernel is an optional extension);
- only when asked with ``MPIFUSION_ALLOW_SKIPS=cat1,cat2`` (scripts/test.sh asks for what it
  was told not to install): ``frameworks``, ``openmpi``, ``impi``, ``slurm``.

Every other reason, including one no category knows, fails: a new skip is reviewed once,
here, instead of being ignored in every run.

With ``MPIFUSION_SKIP_LOG=<folder>`` each run writes its outcomes to ``<folder>/<label>.json``
and ``python tests/skips.py report <folder>`` prints the skips of every run and fails when a
test skipped for its rank count in every run (it then ran nowhere).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

STRICT_ENV = "MPIFUSION_STRICT_SKIPS"
ALLOW_ENV = "MPIFUSION_ALLOW_SKIPS"
LOG_ENV = "MPIFUSION_SKIP_LOG"
LABEL_ENV = "MPIFUSION_RUN_LABEL"


def _not_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() != 0


def _no_compiler() -> bool:
    return not any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))


@dataclass(frozen=True)
class Category:
    name: str
    pattern: str
    why: str
    #: allowed without being asked when this holds (None: only when asked, or always below)
    auto: Optional[Callable[[], bool]] = None
    always: bool = False

    def matches(self, reason: str) -> bool:
        return re.search(self.pattern, reason) is not None


#: first match wins, so the narrower categories come first
CATEGORIES: Tuple[Category, ...] = (
    Category("gpu", r"cupy|\bGPU\b|CUDA|one device only",
             "no GPU here: the cupy and CUDA-aware MPI paths run on a GPU runner", always=True),
    Category("cpu", r"this CPU has no",
             "a kernel path this CPU lacks: a CPU that has it runs it", always=True),
    Category("ranks", r"\branks?\b|MPI processes",
             "another rank count runs it (report checks that one did)", always=True),
    Category("openmpi", r"Open ?MPI|OPENMPI",
             "the Open MPI runs need a second venv (.ci/run makes .venv-ompi)"),
    Category("impi", r"Intel MPI|IMPI",
             "the Intel MPI runs need a third venv (.ci/run makes .venv-impi)"),
    Category("slurm", r"[Ss]lurm|sbatch",
             "the Slurm tests need root and apt-get, or an installed Slurm"),
    Category("root", r"needs root",
             "a non-root user cannot start a process as another user", auto=_not_root),
    Category("compiler", r"no C compiler|no compiled kernel",
             "the half-precision kernel is an optional C extension; without a compiler the "
             "install uses numpy's casts, which every run tests", auto=_no_compiler),
    Category("frameworks", r"\b(torch|jax|paddle|megatron|matplotlib)\b",
             "scripts/test.sh installs torch, jax, paddle and megatron-core unless "
             "MPIFUSION_TEST_EXTRAS says otherwise"),
)


def category(reason: str) -> Optional[Category]:
    """The first category whose pattern the skip reason matches, or None."""
    return next((c for c in CATEGORIES if c.matches(reason)), None)


def asked(env: Optional[Dict[str, str]] = None) -> List[str]:
    """The categories named in MPIFUSION_ALLOW_SKIPS (unknown names are refused)."""
    raw = (env if env is not None else os.environ).get(ALLOW_ENV, "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    known = {c.name for c in CATEGORIES}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"{ALLOW_ENV}: unknown categories {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    return names


def allowed(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Category name -> why it may skip in this run."""
    named = set(asked(env))
    out = {}
    for c in CATEGORIES:
        if c.always:
            out[c.name] = c.why
        elif c.name in named:
            out[c.name] = f"{c.why} ({ALLOW_ENV})"
        elif c.auto is not None and c.auto():
            out[c.name] = c.why
    return out


def refused(skips: Iterable[Tuple[str, str]],
            env: Optional[Dict[str, str]] = None) -> List[Tuple[str, str]]:
    """The (nodeid, reason) skips that no allowed category covers."""
    ok = allowed(env)
    out = []
    for nodeid, reason in skips:
        cat = category(reason)
        if cat is None or cat.name not in ok:
            out.append((nodeid, reason))
    return out


def skip_reason(report) -> str:
    """The reason of a skipped pytest report (longrepr is (file, line, 'Skipped: why'))."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def write_log(folder: str, label: str, outcomes: Dict[str, Tuple[str, str]]) -> Path:
    """Store one run's outcomes (nodeid -> (outcome, reason)) for :func:`report`."""
    path = Path(folder) / f"{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"label": label, "outcomes": outcomes}, indent=0))
    return path


def report(folder: str, out=None) -> int:
    """Print every run's skips by reason; 1 when a test skipped for its rank count in every
    run that collected it."""
    out = out or sys.stdout
    runs = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]
    if not runs:
        out.write(f"skips: no run logs in {folder}\n")
        return 1
    ran: Dict[str, bool] = {}
    rank_skips: Dict[str, str] = {}
    for run in runs:
        by_reason: Dict[str, int] = {}
        for nodeid, (outcome, reason) in run["outcomes"].items():
            if outcome == "skipped":
                by_reason[reason] = by_reason.get(reason, 0) + 1
                cat = category(reason)
                if cat is not None and cat.name == "ranks":
                    rank_skips.setdefault(nodeid, reason)
                ran.setdefault(nodeid, False)
            else:
                ran[nodeid] = True
        total = sum(by_reason.values())
        out.write(f"skips in {run['label']}: {total}\n")
        for reason, count in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])):
            cat = category(reason)
            out.write(f"  {count:5d}  [{cat.name if cat else 'unknown'}] {reason}\n")
    never = sorted(n for n in rank_skips if not ran.get(n))
    for nodeid in never:
        out.write(f"skips: {nodeid} ran at no rank count ({rank_skips[nodeid]})\n")
    if never:
        out.write(f"skips: FAILED: {len(never)} test(s) skipped for their rank count in every "
                  f"run\n")
        return 1
    out.write("skips: every test skipped for its rank count ran in another run\n")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 2 and args[0] == "report":
        return report(args[1])
    if args == ["allowed"]:
        for name, why in allowed().items():
            print(f"{name}: {why}")
        return 0
    sys.stderr.write("usage: python tests/skips.py report FOLDER | allowed\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
