"""The conformance matrix: real peers run as written and with the bugs users put in, each
checked by the oracle (tests/oracle/test_conformance.py asserts every row).

Each peer runs once (``launch``) and writes one dump directory per case; ``observe`` reads
what the oracle says about a case (verdict, failing params, failing ranks, each failing
param's diagnosis; for a peer that checks several training steps, ``step{k}/`` dumps, the
diagnosis of the first step each param fails in, every failing step's kept in ``steps``);
``render`` makes README's table from the observations. Regenerate the table after a change
(runs every peer, about 40 s)::

    python -m tests.oracle.conformance --write     # or --check: exit 1 when README differs
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

PEERS = Path(__file__).resolve().parent / "peers"
README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- conformance:start -->", "<!-- conformance:end -->"
NRANKS = 2

TINY = ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias",
        "head.weight", "head.bias"]
#: the params of Megatron's bucket 0 (bucket_size=500: the last layers, fc2 and head)
MEGATRON_BUCKET0 = ["fc2.weight", "fc2.bias", "head.weight", "head.bias"]
#: the Megatron bug both kinds of its DDP run with
PER_TOKEN_LOSS = ("`calculate_per_token_loss=True`, the loss still the mean and nothing "
                  "dividing by the token count")
BLOCKS = ["stem.weight", "stem.bias", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
          "blocks.1.bias", "head.weight", "head.bias"]

#: peer -> (script under peers/, its extra argv, the framework it needs)
SCRIPTS = {"torch": ("torch_buggy", [], "torch"),
           "paddle": ("paddle_fused", ["--cases", "ar_acc2_pre,ar_acc2_pre_dropped"], "paddle"),
           "megatron": ("megatron_peer", [], "megatron")}
#: peer -> seconds its whole run may take (``launch``'s default otherwise); megatron-core's
#: import alone takes some 7 s, its 13 cases about 20 s at 2 ranks
TIMEOUTS = {"megatron": 120}


@dataclass(frozen=True)
class Case:
    """One row of the matrix: ``case`` is the dump directory the peer script writes."""

    peer: str            # key of SCRIPTS
    case: str
    who: str             # the peer, in words
    bug: Optional[str]   # how the bug was put in, in words; None: the peer as written
    failing: tuple = ()  # params that must fail (spec order)
    ranks: tuple = ()    # ranks on which they are wrong
    kind: Optional[str] = None          # the right diagnosis of every failing param
    fields: Dict[str, Any] = field(default_factory=dict)  # its key fields
    #: params whose output, held by one rank, cannot tell ``kind`` from another reading (own
    #: grad x 1/2 is also the mean missing the other rank): their diagnosis may name the
    #: other reading, and must then name ``kind`` in its text too (README shows both)
    ambiguous: tuple = ()

    @property
    def verdict(self) -> str:
        return "FAIL" if self.failing else "PASS"


MATRIX: List[Case] = [
    Case("torch", "ddp", "DDP", None),
    Case("torch", "ddp_hook_sum", "DDP",
         "`register_comm_hook` that all-reduces the bucket without dividing",
         tuple(TINY), (0, 1), "scale", {"factor": 2.0}),
    Case("torch", "ddp_no_sync_all", "DDP",
         "every micro-step under `no_sync()`, the last one included",
         tuple(TINY), (0, 1), "local_only"),
    Case("torch", "loop", "all-reduce loop", None),
    Case("torch", "loop_divide_twice", "all-reduce loop",
         "`g /= world` in the loop, and again by the caller",
         tuple(TINY), (0, 1), "scale", {"factor": 0.5}),
    Case("torch", "loop_reduce", "all-reduce loop",
         "`dist.reduce` to rank 0 where an all-reduce was meant (gloo leaves partial sums)",
         tuple(TINY), (1,), "missing", {"from_ranks": [0], "steps": [0, 1]}),
    Case("torch", "loop_bf16", "all-reduce loop",
         "the sum in bfloat16 (`g.to(torch.bfloat16)`, all-reduce, back)",
         tuple(TINY), (0, 1), "precision", {"dtype": "bfloat16"}),
    Case("torch", "hooks", "hook reducer", None),
    Case("torch", "hooks_twice", "hook reducer",
         "rank 1 registers `fc2`'s grad hooks again before micro-step 1",
         ("fc2.weight", "fc2.bias"), (0, 1), "duplicate", {"from_ranks": [1], "steps": [1]}),
    Case("torch", "flat", "flat buffer", None),
    Case("torch", "flat_packed", "flat buffer",
         "grads read back without the 256-byte alignment padding",
         tuple(BLOCKS[1:]), (0, 1), "shift", {"offset": "-padding before the param"}),
    Case("torch", "flat_reversed", "flat buffer",
         "grads read back with the two equal blocks in backward order",
         tuple(BLOCKS[2:6]), (0, 1), "swap",
         {"with": {"blocks.0.weight": "blocks.1.weight", "blocks.1.weight": "blocks.0.weight",
                   "blocks.0.bias": "blocks.1.bias", "blocks.1.bias": "blocks.0.bias"}}),
    Case("torch", "fsdp2", "FSDP2", None),
    Case("torch", "fsdp2_divide_factor", "FSDP2",
         "`set_gradient_divide_factor(world * micro_steps)`",
         tuple(TINY), (0, 1), "scale", {"factor": 0.5}),
    Case("paddle", "ar_acc2_pre", "Paddle `FusedCommBuffer`", None),
    Case("paddle", "ar_acc2_pre_dropped", "Paddle `FusedCommBuffer`",
         "rank 1's hook drops `2.weight`'s grad of micro-step 0 before `add_grad`",
         ("2.weight",), (0, 1), "missing", {"from_ranks": [1], "steps": [0]}),
    # Megatron-core DDP: 2 training steps (step{k}/ dumps; its first step launches the
    # collectives from finish_grad_sync, the second from the backward hooks), 3 buckets:
    # bucket 0 = fc2 + head (params laid out in reverse: head.bias first in the buffer)
    Case("megatron", "megatron", "Megatron DDP", None),
    Case("megatron", "megatron_per_token_loss", "Megatron DDP",
         PER_TOKEN_LOSS,
         tuple(TINY), (0, 1), "scale", {"factor": 2.0}),
    Case("megatron", "megatron_scale_after", "Megatron DDP",
         "`model.scale_gradients(0.5)` after `finish_grad_sync()`",
         tuple(TINY), (0, 1), "scale", {"factor": 0.5}),
    Case("megatron", "megatron_bucket_copy", "Megatron DDP",
         "bucket 0's `start_grad_sync` overridden to all-reduce a `grad_data.clone()`, never "
         "copied back",
         tuple(MEGATRON_BUCKET0), (0, 1), "local_only"),
    Case("megatron", "megatron_bf16_bucket", "Megatron DDP",
         "bucket 0 all-reduced through a bfloat16 copy (`grad_data.to(torch.bfloat16)`, back)",
         tuple(MEGATRON_BUCKET0), (0, 1), "precision", {"dtype": "bfloat16"}),
    Case("megatron", "megatron_rank1_zeroes", "Megatron DDP",
         "rank 1 zeroes its buckets right before they are reduced (its batch skipped)",
         tuple(TINY), (0, 1), "missing", {"from_ranks": [1], "steps": [0, 1]}),
    Case("megatron", "megatron_zero_between", "Megatron DDP",
         "`zero_grad_buffer()` between the micro-steps too",
         tuple(TINY), (0, 1), "missing", {"from_ranks": [0, 1], "steps": [0]}),
    Case("megatron", "megatron_views_early", "Megatron DDP",
         "after the sync, `main_grad` re-pointed one element early "
         "(`grad_data[start - 1:end - 1]`; `head.bias`, first in the buffer, keeps its view)",
         tuple(TINY[:-1]), (0, 1), "shift", {"offset": -1}),
    Case("megatron", "megatron_param_twice", "Megatron DDP",
         "`head.weight` (bucket 0) all-reduced once more with bucket 0's all-reduce",
         ("head.weight",), (0, 1), "scale", {"factor": 2.0}),
    # the distributed optimizer: reduce-scatter per bucket, each rank keeping its shard
    # (out/ pieces with range/); a param wholly in one rank's shard is wrong on that rank only
    Case("megatron", "megatron_distopt", "Megatron DDP + distributed optimizer", None),
    Case("megatron", "megatron_distopt_per_token_loss", "Megatron DDP + distributed optimizer",
         PER_TOKEN_LOSS,
         tuple(TINY), (0, 1), "scale", {"factor": 2.0}),
    Case("megatron", "megatron_distopt_bucket_copy", "Megatron DDP + distributed optimizer",
         "bucket 0's `start_grad_sync` overridden to reduce-scatter a `grad_data.clone()` into "
         "its own shard, never copied back",
         tuple(MEGATRON_BUCKET0), (0, 1), "local_only",
         ambiguous=("fc2.bias", "head.weight", "head.bias")),
    Case("megatron", "megatron_distopt_rank1_zeroes", "Megatron DDP + distributed optimizer",
         "rank 1 zeroes its buckets right before they are reduced (its batch skipped)",
         tuple(TINY), (0, 1), "missing", {"from_ranks": [1], "steps": [0, 1]}),
]

BY_NAME = {c.case: c for c in MATRIX}


def launch(peer: str, out: Path, timeout: Optional[float] = None) -> None:
    """Run one peer script under mpiexec (2 ranks, killed whole past ``timeout``: the
    peer's in ``TIMEOUTS``, else 150 s); every case of that peer lands in ``out/{case}``."""
    from tests.helpers import free_ports, run_job

    script, extra, _ = SCRIPTS[peer]
    timeout = timeout if timeout is not None else TIMEOUTS.get(peer, 150)
    argv = [sys.executable, str(PEERS / f"{script}.py"), str(out), *extra]
    if peer == "paddle":
        argv += ["--port", str(free_ports(NRANKS))]
    proc = run_job(NRANKS, argv, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@dataclass
class Observed:
    case: str
    verdict: str
    failing: list
    ranks: list
    nparams: int
    diagnosis: dict  # failing param -> its diagnosis dict ({} where the report has none)
    #: step{k}/ dumps: failing step -> {failing param -> its diagnosis} ({} for one step)
    steps: dict = field(default_factory=dict)
    #: param -> the ranks whose dump holds its out/ (all of them unless sharded)
    holders: dict = field(default_factory=dict)


def observe(out: Path, case: str) -> Observed:
    """What the oracle says about ``out/{case}`` (one step, or ``step{k}/`` folders: the
    diagnosis of the first step a param fails in, every failing step's in ``steps``)."""
    import numpy as np

    from mpifusion.oracle import check

    d = out / case
    report = check(d / "spec.json", d)
    doc = report.to_json()
    per_step = [(s["step"], s) for s in doc["steps"]] if "steps" in doc else [(None, doc)]
    diag: dict = {}
    steps: dict = {}
    for k, one in per_step:
        bad = {p["name"]: p.get("diagnosis") or {} for p in one["params"] if not p["ok"]}
        for name, dg in bad.items():
            diag.setdefault(name, dg)
        if k is not None and bad:
            steps[k] = bad
    first = d / f"step{per_step[0][0]}" if per_step[0][0] is not None else d
    holders: dict = {}
    for r in range(NRANKS):
        with np.load(first / f"rank{r}.npz") as z:
            for key in z.files:
                if key.startswith("out/"):
                    holders.setdefault(key[4:], []).append(r)
    return Observed(case, doc["verdict"], list(report.failing), list(report.failing_ranks),
                    len(per_step[0][1]["params"]), diag, steps, holders)


# --------------------------------------------------------------------------- the table

def _num(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _fields(kind: str, diags: list) -> str:
    """The key field of one kind over the params that have it."""
    if kind == "scale":
        vals = sorted({_num(d.get("factor")) for d in diags})
        return f"factor {', '.join(vals)}"
    if kind in ("missing", "duplicate"):
        parts = []
        for key, word in (("from_ranks", "rank"), ("steps", "micro-step")):
            vals = sorted({tuple(d.get(key) or ()) for d in diags})
            if len(vals) == 1 and vals[0]:
                plural = "s" if len(vals[0]) > 1 else ""
                parts.append(f"{word}{plural} {', '.join(map(str, vals[0]))}")
        return "from " + ", ".join(parts) if parts else ""
    if kind == "shift":
        vals = sorted({int(d["offset"]) for d in diags if "offset" in d})
        if len(vals) == 1:
            return f"offset {vals[0]}"
        return f"offsets {vals[-1]} .. {vals[0]}" if vals else ""
    if kind == "swap":
        pairs = sorted({tuple(sorted((d.get("name", "?"), str(d.get("with"))))) for d in diags})
        return ", ".join(f"{a} with {b}" for a, b in pairs)
    if kind == "precision":
        return ", ".join(sorted({str(d.get("dtype")) for d in diags}))
    return ""


def kind_cell(obs: Observed) -> str:
    if obs.verdict == "PASS":
        return "-"
    groups: Dict[str, list] = {}
    for name in obs.failing:
        d = dict(obs.diagnosis.get(name) or {}, name=name)
        groups.setdefault(d.get("kind") or "none", []).append(d)
    cells = []
    for kind, diags in groups.items():
        text = f"`{kind}`"
        extra = _fields(kind, diags)
        if extra:
            text += f" ({extra})"
        if len(groups) > 1:
            names = [d["name"] for d in diags]
            text += f": {', '.join(names)}" if len(names) <= 2 else f": {len(names)} params"
        cells.append(text)
    return "; ".join(cells)


def verdict_cell(obs: Observed) -> str:
    if obs.verdict == "PASS":
        return "PASS"
    which = (f"all {obs.nparams} params" if len(obs.failing) == obs.nparams else
             ", ".join(obs.failing) if len(obs.failing) <= 2 else
             f"{len(obs.failing)} of {obs.nparams} params")
    return f"FAIL: {which}, rank{'s' if len(obs.ranks) > 1 else ''} " \
           f"{', '.join(map(str, obs.ranks))}"


def render(observed: Dict[str, Observed]) -> str:
    """README's table: one row for the peers as written, one per bug (verdict and kind as
    observed; where a kind differs from the right one, the right one is named)."""
    lines = ["| peer | bug, as put in | oracle | diagnosis |", "| --- | --- | --- | --- |"]
    clean = [c for c in MATRIX if c.bug is None]
    verdicts = {observed[c.case].verdict for c in clean}
    whos = ", ".join(dict.fromkeys(c.who for c in clean))
    lines.append(f"| {whos} | none (as written) | {' / '.join(sorted(verdicts))} | - |")
    for c in MATRIX:
        if c.bug is None:
            continue
        obs = observed[c.case]
        kind = kind_cell(obs)
        wrong = sorted({d.get("kind") for n, d in obs.diagnosis.items()} - {c.kind})
        if obs.verdict == "FAIL" and wrong:
            kind += f" (right: `{c.kind}`)"
        lines.append(f"| {c.who} | {c.bug} | {verdict_cell(obs)} | {kind} |")
    return "\n".join(lines)


_SECTION = re.compile(re.escape(START) + r"\n(.*?)" + re.escape(END), re.S)


def readme_table(text: str) -> Optional[str]:
    """The table between README's markers (None without them)."""
    m = _SECTION.search(text)
    return m.group(1).rstrip("\n") if m else None


def write_readme(table: str, path: Path = README) -> bool:
    """Put ``table`` between the markers; True when README changed."""
    text = path.read_text(encoding="utf-8")
    if readme_table(text) is None:
        raise SystemExit(f"{path}: no {START} ... {END} markers")
    new = _SECTION.sub(lambda _: f"{START}\n{table}\n{END}", text, count=1)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def observe_all(root: Path) -> Dict[str, Observed]:
    for peer in SCRIPTS:
        (root / peer).mkdir(parents=True, exist_ok=True)
        launch(peer, root / peer)
    return {c.case: observe(root / c.peer, c.case) for c in MATRIX}


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite README's table")
    parser.add_argument("--check", action="store_true", help="exit 1 when README differs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        table = render(observe_all(Path(tmp)))
    print(table)
    if args.write:
        print("README.md:", "rewritten" if write_readme(table) else "already current")
    if args.check and readme_table(README.read_text(encoding="utf-8")) != table:
        print("README.md: the table differs (python -m tests.oracle.conformance --write)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
