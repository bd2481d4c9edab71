"""The diagnosis of a failing param (``report.diagnoses``, JSON ``params[i]["diagnosis"]``,
the ``diagnosis:`` line): every kind, built the way the bug computes it, for the three
actions (``reduce_scatter`` both cut by Paddle and by ``range/``), 2-8 ranks and 1-4
micro-steps; a PASS has none, and the diagnosis never changes the verdict.

The buggy outputs are fp32 reductions (per-rank accumulation, the sum over ranks in rank
order, the scale) of random inputs, so the fit sees ordinary rounding, not exact values.
"""
from __future__ import annotations

import inspect
import json
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mpifusion.oracle import check
from mpifusion.oracle.diagnose import KINDS, Diagnosis
from mpifusion.spec import Spec

from tests.helpers import run_cmd

CHECK_MODULE = sys.modules["mpifusion.oracle.check"]
#: "a" and "c" share a size (swap); "b" sits between them in the buffer (shift)
SHAPES = {"a": (24, 12), "b": (50,), "c": (24, 12)}
ACTS = ["all_reduce", "reduce", "rs_paddle", "rs_range"]
#: (nranks, acc_steps): every rank count 2, 3, 4, 8 and every acc_steps 1-4
SIZES = [(2, 1), (3, 4), (4, 2), (8, 3)]
DST = 1
SHIFT = 64
#: the fields of a local-only output (the own sum, unscaled); "kind" is checked as a field
LOCAL = {"kind": "local_only", "factor": 1.0}


def _spec(nranks, acc, act, average=True):
    return {"params": [{"name": n, "shape": list(s), "dtype": "float32"}
                       for n, s in SHAPES.items()],
            "act": "reduce_scatter" if act.startswith("rs_") else act, "nranks": nranks,
            "acc_steps": acc, "average": average, "dst": DST}


def _grads(nranks, acc, seed):
    rng = np.random.default_rng(seed)
    return [{n: [rng.standard_normal(s).astype(np.float32).reshape(-1) for _ in range(acc)]
             for n, s in SHAPES.items()} for _ in range(nranks)]


def _reduce(grads, name, mult, scale, dtype=np.float32):
    """The reduction a bug computes: contribution (r, k) added ``mult[r][k]`` times, per-rank
    accumulation then the sum over ranks in rank order, in ``dtype``, then ``* scale``."""
    total = None
    for r, g in enumerate(grads):
        local = None
        for k, x in enumerate(g[name]):
            for _ in range(int(mult[r][k])):
                x_d = x.astype(dtype)
                local = x_d if local is None else (local + x_d).astype(dtype)
        if local is not None:
            total = local if total is None else (total + local).astype(dtype)
    if scale != 1:
        total = (total * np.asarray(scale).astype(dtype)).astype(dtype)
    return total.astype(np.float32)


def _ones(nranks, acc, value=1):
    return [[value] * acc for _ in range(nranks)]


def _layout(spec):
    return {p.name: buf.layout for buf in Spec.from_dict(spec).plan() for p in buf.params}


def _dumps(spec, grads, act, full, own=None):
    """Per-rank records: ``full[rank][name]`` is what the rank's output derives from (the
    whole result), cut as the action cuts it; ``own[rank][name]`` overrides a non-root
    ``reduce`` rank (default: Paddle's rule, its own sum times 1/n)."""
    nranks, acc = spec["nranks"], spec["acc_steps"]
    lay = _layout(spec)
    dumps = []
    for r in range(nranks):
        d = {f"in/{n}/{k}": grads[r][n][k].reshape(SHAPES[n]) for n in SHAPES
             for k in range(acc)}
        for n, shape in SHAPES.items():
            res = full[r][n]  # may run on past the param (the buffer's padding and more)
            numel = int(np.prod(shape))
            if act == "all_reduce" or (act == "reduce" and r == DST):
                d[f"out/{n}"] = res[:numel].reshape(shape)
            elif act == "reduce":
                d[f"out/{n}"] = (own[r][n] if own else _reduce(
                    grads[r:r + 1], n, _ones(1, acc), 1 / nranks)).reshape(shape)
            elif act == "rs_range":
                chunk = -(-numel // nranks)
                b, e = min(r * chunk, numel), min((r + 1) * chunk, numel)
                d[f"range/{n}"] = np.array([b, e], dtype=np.int64)
                d[f"out/{n}"] = res[b:e].copy()
            else:  # Paddle's cut: the rank's slice of the padded slot
                piece = lay[n].slice_of(n, r)
                if piece:
                    lo, hi = piece[0] - lay[n][n].offset, piece[1] - lay[n][n].offset
                    padded = np.concatenate([res, np.zeros(max(hi - res.size, 0), np.float32)])
                    d[f"out/{n}"] = padded[lo:hi].copy()
        dumps.append(d)
    return dumps


def _output_ranks(spec, act, name):
    """The ranks whose output of ``name`` holds the reduction (all but the non-roots of
    reduce; for reduce_scatter, those holding a piece)."""
    if act == "reduce":
        return [DST]
    numel = int(np.prod(SHAPES[name]))
    return [r for r in range(spec["nranks"]) if act == "all_reduce" or
            _holds(spec, act, r, name, 0, numel)]


def _exact_grads(spec, nranks, acc, seed):
    """``exact_inputs``: every partial sum exact, each value telling its contribution."""
    from mpifusion.oracle.inputs import exact_inputs

    per = [[exact_inputs(spec, r, k, seed=seed) for k in range(acc)] for r in range(nranks)]
    return [{n: [per[r][k][n].reshape(-1) for k in range(acc)] for n in SHAPES}
            for r in range(nranks)]


def _case(kind, act, nranks, acc, seed=0, exact=False):
    """(spec, dumps, expected {name: (ranks, fields)}) of one bug."""
    spec = _spec(nranks, acc, act)
    grads = _exact_grads(spec, nranks, acc, seed) if exact else _grads(nranks, acc, seed)
    n = nranks
    good = {q: _reduce(grads, q, _ones(n, acc), 1 / n) for q in SHAPES}
    full = [dict(good) for _ in range(n)]
    own = None
    reducing = {q: _output_ranks(spec, act, q) for q in SHAPES}
    names = list(SHAPES)
    expect = {}
    if kind == "scale_sum":  # the 1/n forgotten everywhere (off the root too)
        full = [{q: _reduce(grads, q, _ones(n, acc), 1) for q in SHAPES}] * n
        own = [{q: _reduce(grads[r:r + 1], q, _ones(1, acc), 1) for q in SHAPES}
               for r in range(n)]
        expect = {q: (list(range(n)) if act == "reduce" else reducing[q],
                      {"factor": float(n)}) for q in names}
    elif kind == "scale_twice":
        full = [{q: _reduce(grads, q, _ones(n, acc), 1 / n / n) for q in SHAPES}] * n
        expect = {q: (reducing[q], {"factor": 1 / n}) for q in names}
    elif kind in ("missing_rank", "missing_mean"):  # rank n-1 skipped; divisor n or n-1
        mult = _ones(n, acc)
        mult[-1] = [0] * acc
        div = n if kind == "missing_rank" else n - 1
        full = [{q: _reduce(grads, q, mult, 1 / div) for q in SHAPES}] * n
        expect = {q: (reducing[q], {"from_ranks": [n - 1], "steps": list(range(acc))})
                  for q in names}
        if div == 1:  # the mean over rank 0 alone: where rank 0 alone holds it, local-only
            expect.update({q: ([0], LOCAL) for q in names if reducing[q] == [0]})
    elif kind == "missing_step":  # step 0 overwritten on every rank (or rank 0's only)
        mult = _ones(n, acc)
        if acc > 1:
            for r in range(n):
                mult[r][0] = 0
            fields = {"from_ranks": list(range(n)), "steps": [0]}
        else:
            mult[0][0] = 0
            fields = {"from_ranks": [0], "steps": [0]}
        full = [{q: _reduce(grads, q, mult, 1 / n) for q in SHAPES}] * n
        expect = {q: (reducing[q], fields) for q in names}
    elif kind == "duplicate":  # rank 0's last micro-step added twice
        mult = _ones(n, acc)
        mult[0][-1] = 2
        full = [{q: _reduce(grads, q, mult, 1 / n) for q in SHAPES}] * n
        expect = {q: (reducing[q], {"from_ranks": [0], "steps": [acc - 1]}) for q in names}
    elif kind == "local_only":  # no reduction: each rank keeps its own sum
        full = [{q: _reduce(grads[r:r + 1], q, _ones(1, acc), 1) for q in SHAPES}
                for r in range(n)]
        expect = {q: (reducing[q], LOCAL) for q in names}
    elif kind == "shift":  # the flat buffer copied out SHIFT elements late
        lay = _layout(spec)["a"]
        buf = np.zeros(lay.numel + SHIFT, np.float32)
        for s in lay.slots:
            buf[s.offset:s.end] = good[s.name]
        full = [{s.name: buf[s.offset + SHIFT:s.padded_end + SHIFT].copy()
                 for s in lay.slots}] * n
        if act == "rs_paddle":  # a piece of padding alone may now hold a neighbour's values
            right = _dumps(spec, grads, act, [good] * n)
            wrong = _dumps(spec, grads, act, full)
            reducing = {q: [r for r in range(n) if f"out/{q}" in right[r] and not
                            np.array_equal(right[r][f"out/{q}"], wrong[r][f"out/{q}"])]
                        for q in names}
        expect = {q: (reducing[q], {"offset": SHIFT}) for q in names}
        if act == "rs_range":  # b's shifted window lies in its slot's padding: zeros
            expect["b"] = (reducing["b"], {"factor": 0.0})
    elif kind == "swap":
        full = [{**good, "a": good["c"], "c": good["a"]}] * n
        expect = {"a": (reducing["a"], {"with": "c"}), "c": (reducing["c"], {"with": "a"})}
    elif kind == "precision":  # the whole reduction in bf16
        bf = {q: _reduce(grads, q, _ones(n, acc), 1 / n, ml_dtypes.bfloat16) for q in SHAPES}
        full = [bf] * n
        expect = {q: (reducing[q], {"dtype": "bfloat16"}) for q in names}
    elif kind == "nonfinite":
        bad = dict(good)
        bad["b"] = good["b"].copy()
        bad["b"][[0, 1, 2]] = [np.nan, np.inf, -np.inf]
        full = [bad] * n
        holders = [r for r in reducing["b"] if act not in ("rs_paddle", "rs_range") or
                   _holds(spec, act, r, "b", 0, 3)]
        expect = {"b": (holders, {})}
    elif kind == "unexplained":
        rng = np.random.default_rng(seed + 7)
        bad = dict(good)
        bad["b"] = good["b"].copy()  # a few elements far off, the rest right
        far = rng.choice(50, 5, replace=False)
        bad["b"][far] = bad["b"][far] * np.float32(-3) + np.float32(1)
        full = [bad] * n
        holders = [r for r in reducing["b"] if act not in ("rs_paddle", "rs_range") or
                   any(_holds(spec, act, r, "b", i, i + 1) for i in far)]
        expect = {"b": (holders, {})}
    return spec, _dumps(spec, grads, act, full, own), expect


def _holds(spec, act, rank, name, lo, hi):
    """Whether the rank's piece of ``name`` overlaps elements [lo, hi)."""
    numel = int(np.prod(SHAPES[name]))
    if act == "rs_range":
        chunk = -(-numel // spec["nranks"])
        b, e = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
    else:
        lay = _layout(spec)[name]
        piece = lay.slice_of(name, rank)
        if not piece:
            return False
        b, e = piece[0] - lay[name].offset, piece[1] - lay[name].offset
    return b < hi and lo < e


BUGS = ["scale_sum", "scale_twice", "missing_rank", "missing_mean", "missing_step",
        "duplicate", "local_only", "shift", "swap", "precision", "nonfinite", "unexplained"]
KIND_OF = {"scale_sum": "scale", "scale_twice": "scale", "missing_rank": "missing",
           "missing_mean": "missing", "missing_step": "missing"}


@pytest.mark.parametrize("nranks,acc", SIZES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bug", BUGS)
def test_every_kind_is_named_with_its_fields(bug, act, nranks, acc):
    _assert_diagnosed(bug, act, nranks, acc, exact=False)


EXACT = [pytest.param(bug, act, *SIZES[i % len(SIZES)], id=f"{bug}-{act}")
         for i, (bug, act) in enumerate((b, a) for b in BUGS for a in ACTS)]


@pytest.mark.parametrize("bug,act,nranks,acc", EXACT)
def test_exact_inputs_are_diagnosed_exactly(bug, act, nranks, acc):
    """With ``exact_inputs`` (each value a distinct power of two per contribution) the same
    bugs get the same kinds and fields; the check holds the result to the exact reference
    where it can (``exact=True``)."""
    _assert_diagnosed(bug, act, nranks, acc, exact=True)


@pytest.mark.parametrize("act", ["all_reduce", "rs_range"])
def test_exact_inputs_with_fewer_wrong_elements_than_contributions(act):
    """8 ranks x 4 micro-steps: exact inputs hold 22 of the 32 contributions per element,
    so a doubled one leaves 31 of b's 50 elements wrong, too few to fit 32 weights alone;
    the right elements join the fit (the model must fit them too)."""
    _assert_diagnosed("duplicate", act, 8, 4, exact=True)


def _assert_diagnosed(bug, act, nranks, acc, exact):
    spec, dumps, expect = _case(bug, act, nranks, acc, seed=nranks * 10 + acc, exact=exact)
    exact_check = exact and "exact" in inspect.signature(check).parameters
    report = check(spec, dumps, exact=True) if exact_check else check(spec, dumps)
    assert not report.ok
    assert sorted(report.failing) == sorted(expect), str(report)
    assert set(report.diagnoses) == set(expect)
    for name, (ranks, fields) in expect.items():
        d = report.diagnoses[name]
        kind = fields.get("kind") or ("scale" if "factor" in fields else KIND_OF.get(bug, bug))
        assert d.kind == kind, (name, d, str(report))
        assert d.ranks == sorted(ranks) == report.wrong_ranks(name), (name, d)
        doc = d.to_json()
        for key, value in fields.items():
            got = doc[key]
            assert (got == pytest.approx(value) if isinstance(value, float) else
                    got == value), (name, key, doc)
        assert set(doc) == {"kind", "text", "ranks", *fields}, doc
        assert "\n" not in d.text and d.text


def test_the_usual_causes_are_in_the_text():
    texts = {}
    for bug in ("scale_sum", "scale_twice", "missing_mean"):
        spec, dumps, _ = _case(bug, "all_reduce", 4, 2)
        texts[bug] = check(spec, dumps).diagnoses["a"].text
    assert "nranks: summed where a mean was expected" in texts["scale_sum"]
    assert "averaged twice" in texts["scale_twice"]
    assert "divided by 3" in texts["missing_mean"] and "rank 3" in texts["missing_mean"]


def test_json_round_trip_and_report_lines():
    spec, dumps, _ = _case("missing_rank", "all_reduce", 4, 2)
    report = check(spec, dumps)
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["verdict"] == "FAIL"
    by_name = {p["name"]: p for p in doc["params"]}
    for name, entry in by_name.items():
        d = entry["diagnosis"]
        assert d == {"kind": "missing", "text": d["text"], "ranks": [0, 1, 2, 3],
                     "from_ranks": [3], "steps": [0, 1]}
        assert Diagnosis.from_json(d) == report.diagnoses[name]
    lines = [ln for ln in report.lines() if ln.startswith("diagnosis:")]
    assert lines and lines[0].startswith("diagnosis: a: missing: the contributions of rank 3")
    assert len(lines) == 3


def test_a_pass_has_no_diagnosis():
    spec, dumps, _ = _case("scale_sum", "all_reduce", 3, 2)
    grads = _grads(3, 2, 0)
    good = {q: _reduce(grads, q, _ones(3, 2), 1 / 3) for q in SHAPES}
    report = check(spec, _dumps(spec, grads, "all_reduce", [good] * 3))
    assert report.ok and not report.diagnoses
    assert all("diagnosis" not in p for p in report.to_json()["params"])
    assert not any(ln.startswith("diagnosis:") for ln in report.lines())


def test_only_the_wrong_rank_is_named():
    """all_reduce where rank 2 alone skipped the sync: local_only, ranks [2]."""
    spec, dumps, _ = _case("scale_sum", "all_reduce", 4, 1)
    grads = _grads(4, 1, 0)
    good = {q: _reduce(grads, q, _ones(4, 1), 1 / 4) for q in SHAPES}
    full = [good] * 4
    full[2] = {q: _reduce(grads[2:3], q, _ones(1, 1), 1) for q in SHAPES}
    report = check(spec, _dumps(spec, grads, "all_reduce", full))
    d = report.diagnoses["a"]
    assert (d.kind, d.ranks) == ("local_only", [2])


def test_one_corrupted_element_is_no_precision_loss():
    """One element of one rank off by 2^-7 of itself (within what a bf16 reduction may
    stray, and an error of the size bf16 makes on average over the param): a narrow
    reduction would stray on most elements, not on one, so the kind is not ``precision``."""
    spec, _, _ = _case("scale_sum", "all_reduce", 2, 2)
    grads = _grads(2, 2, 7)
    good = {q: _reduce(grads, q, _ones(2, 2), 1 / 2) for q in SHAPES}
    bad = {q: v.copy() for q, v in good.items()}
    i = int(np.argmax(np.abs(good["a"])))
    bad["a"][i] *= np.float32(1 + 2 ** -7)
    report = check(spec, _dumps(spec, grads, "all_reduce", [good, bad]))
    assert report.failing == ["a"]
    d = report.diagnoses["a"]
    assert d.ranks == [1] and d.kind != "precision", d


@pytest.mark.parametrize("how", ["roll", "zeros_after", "zeros_before"])
def test_a_shift_within_the_param_with_other_values_at_one_end(how):
    """The right values 64 elements off inside the param, the gap at one end filled by
    ``np.roll`` (wrapped) or zeros (a slice copied into a zeroed buffer): ``shift``, offset
    +-64, the text naming the unexplained end; garbage in the middle is no shift."""
    spec, _, _ = _case("scale_sum", "all_reduce", 2, 1)
    grads = _grads(2, 1, 8)
    good = {q: _reduce(grads, q, _ones(2, 1), 1 / 2) for q in SHAPES}
    a = good["a"]
    moved = {"roll": np.roll(a, -SHIFT),
             "zeros_after": np.concatenate([a[SHIFT:], np.zeros(SHIFT, np.float32)]),
             "zeros_before": np.concatenate([np.zeros(SHIFT, np.float32), a[:-SHIFT]])}[how]
    bad = dict(good, a=moved)
    report = check(spec, _dumps(spec, grads, "all_reduce", [bad, bad]))
    d = report.diagnoses["a"]
    want = -SHIFT if how == "zeros_before" else SHIFT
    assert (d.kind, d.offset, d.ranks) == ("shift", want, [0, 1]), d
    # (zeros read from the slot's padding are explained: fewer than SHIFT may be left)
    assert "element(s) at one end hold other values" in d.text, d.text
    assert "within the param" in d.text, d.text
    middle = moved.copy()
    middle[100:180] = np.float32(3.0)  # a run of wrong values inside: not a shifted read
    report = check(spec, _dumps(spec, grads, "all_reduce", [dict(good, a=middle)] * 2))
    assert report.diagnoses["a"].kind != "shift"


def test_a_bug_in_part_of_the_output_is_fitted_on_the_wrong_elements():
    """gloo's reduce where an all-reduce was meant: rank 1 keeps its own sum (halved) in the
    first half and the full mean in the second: rank 0's contributions are missing there."""
    spec, _, _ = _case("scale_sum", "all_reduce", 2, 2)
    grads = _grads(2, 2, 5)
    good = {q: _reduce(grads, q, _ones(2, 2), 1 / 2) for q in SHAPES}
    part = {}
    for q in SHAPES:
        own = _reduce(grads[1:2], q, _ones(1, 2), 1 / 2)
        half = good[q].size // 2
        part[q] = np.concatenate([own[:half], good[q][half:]])
    report = check(spec, _dumps(spec, grads, "all_reduce", [good, part]))
    for q in SHAPES:
        d = report.diagnoses[q]
        assert (d.kind, d.ranks, d.from_ranks, d.steps) == ("missing", [1], [0], [0, 1]), d
        assert "the rest right" in d.text


def test_one_ranks_gradient_on_every_rank_is_missing_not_local():
    """Every rank holds rank 0's own sum (a broadcast where a reduction was meant): the other
    ranks' contributions are missing; it is no rank's local-only result."""
    spec, _, _ = _case("scale_sum", "all_reduce", 4, 2)
    grads = _grads(4, 2, 6)
    root = {q: _reduce(grads[:1], q, _ones(1, 2), 1) for q in SHAPES}
    report = check(spec, _dumps(spec, grads, "all_reduce", [root] * 4))
    d = report.diagnoses["a"]
    assert (d.kind, d.ranks, d.from_ranks, d.steps) == ("missing", [0, 1, 2, 3], [1, 2, 3],
                                                        [0, 1]), d


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_grads(dtype):
    """Half grads (no fp32 main grads): the fit sees their coarser rounding, and still
    names the sum, the missing rank and the swap."""
    half = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    nranks, acc = 4, 2
    spec = {"params": [{"name": n, "shape": [300], "dtype": dtype} for n in ("a", "b")],
            "act": "all_reduce", "nranks": nranks, "acc_steps": acc, "average": True}
    rng = np.random.default_rng(8)
    grads = [{n: [rng.standard_normal(300).astype(half) for _ in range(acc)] for n in "ab"}
             for _ in range(nranks)]

    def reduced(name, skip=None, scale=1 / nranks):  # fp32 accumulation, half buffers
        total = np.zeros(300, np.float32)
        for r in range(nranks):
            if r != skip:
                total += sum(x.astype(np.float32) for x in grads[r][name]).astype(half)
        return (total * np.float32(scale)).astype(half)

    raw = (lambda x: x.view(np.uint16)) if dtype == "bfloat16" else (lambda x: x)
    for bug, out, want in [("sum", lambda n: reduced(n, scale=1), ("scale", 4.0)),
                           ("missing", lambda n: reduced(n, skip=2), ("missing", [2])),
                           ("swap", lambda n: reduced("b" if n == "a" else "a"),
                            ("swap", "b"))]:
        dumps = [{**{f"in/{n}/{k}": raw(grads[r][n][k]) for n in "ab" for k in range(acc)},
                  **{f"out/{n}": raw(out(n)) for n in "ab"}} for r in range(nranks)]
        d = check(spec, dumps).diagnoses["a"]
        got = {"scale": d.factor, "missing": d.from_ranks, "swap": d.with_}[d.kind]
        assert (d.kind, got) == want, (bug, d)


def test_a_reduction_in_fp16_is_told_from_bf16():
    spec, _, _ = _case("scale_sum", "all_reduce", 4, 2)
    grads = _grads(4, 2, 3)
    half = {q: _reduce(grads, q, _ones(4, 2), 1 / 4, np.float16) for q in SHAPES}
    report = check(spec, _dumps(spec, grads, "all_reduce", [half] * 4))
    assert {(d.kind, d.dtype) for d in report.diagnoses.values()} == {("precision", "float16")}


def test_a_mean_where_the_spec_sums():
    spec = _spec(3, 2, "all_reduce", average=False)
    grads = _grads(3, 2, 9)
    mean = {q: _reduce(grads, q, _ones(3, 2), 1 / 3) for q in SHAPES}
    d = check(spec, _dumps(spec, grads, "all_reduce", [mean] * 3)).diagnoses["a"]
    assert (d.kind, d.factor) == ("scale", pytest.approx(1 / 3))
    assert "averaged where a sum was expected" in d.text


def test_off_the_root_with_reduce_avg():
    """reduce with use_reduce_avg: non-root ranks keep their unscaled sum; scaling it by 1/n
    anyway is a scale of 1/nranks on those ranks, and the text points at the option."""
    spec, _, _ = _case("scale_sum", "reduce", 4, 1)
    grads = _grads(4, 1, 4)
    good = {q: _reduce(grads, q, _ones(4, 1), 1 / 4) for q in SHAPES}
    report = check(spec, _dumps(spec, grads, "reduce", [good] * 4), reduce_avg=True)
    d = report.diagnoses["a"]
    assert (d.kind, d.factor, d.ranks) == ("scale", 0.25, [0, 2, 3])
    assert "reduce-avg" in d.text


def test_the_cli_prints_the_diagnosis(tmp_path):
    spec, dumps, _ = _case("scale_sum", "all_reduce", 2, 1)
    for r, d in enumerate(dumps):
        np.savez(tmp_path / f"rank{r}.npz", **d)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = run_cmd([sys.executable, "-m", "mpifusion", "check", "--spec",
                    str(tmp_path / "spec.json"), str(tmp_path)], timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "diagnosis: a: scale: every element is the reference times 2 = nranks" in proc.stdout
    proc = run_cmd([sys.executable, "-m", "mpifusion", "check", "--json", "--spec",
                    str(tmp_path / "spec.json"), str(tmp_path)], timeout=120)
    doc = json.loads(proc.stdout)
    assert doc["params"][0]["diagnosis"]["factor"] == 2.0


def test_kinds_listed():
    assert set(KINDS) == {"scale", "missing", "duplicate", "local_only", "shift", "swap",
                          "precision", "nonfinite", "unexplained"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nranks=st.integers(2, 5), acc=st.integers(1, 3), act=st.sampled_from(ACTS),
       seed=st.integers(0, 2 ** 16), noise=st.sampled_from([0.0, 1e-8, 1e-7, 3e-7, 1e-6, 1e-3]),
       factor=st.sampled_from([1.0, 1.0 + 1e-7, 1.0 + 1e-6, 0.5, 2.0]),
       bug=st.sampled_from([None] * 4 + BUGS))
def test_the_diagnosis_never_changes_the_verdict(nranks, acc, act, seed, noise, factor, bug):
    """Results near the bound (relative noise of the order of the fp32 bound) and far from
    it: the verdict, the failing params and every rank's statistics are those of a check
    without the diagnosis, and exactly the failing params get one."""
    spec = _spec(nranks, acc, act)
    grads = _grads(nranks, acc, seed)
    rng = np.random.default_rng(seed)
    full = []
    for _ in range(nranks):
        out = {}
        for q in SHAPES:
            x = _reduce(grads, q, _ones(nranks, acc), 1 / nranks).astype(np.float64) * factor
            x *= 1 + noise * rng.standard_normal(x.size)
            out[q] = x.astype(np.float32)
        full.append(out)
    dumps = _dumps(spec, grads, act, full)
    if bug is not None:  # one of the bugs above instead
        spec, dumps, _ = _case(bug, act, nranks, acc, seed=seed)
    report = check(spec, dumps)
    bare, called = _without_diagnosis(spec, dumps)
    assert report.ok == bare.ok and report.failing == bare.failing
    assert report.failing_ranks == bare.failing_ranks
    failing = [s.name for s in report.stats if not s.ok]
    assert called == failing and sorted(report.diagnoses) == sorted(failing)
    assert {n: {r: (s.compared, s.max_ratio, s.ok) for r, s in per.items()}
            for n, per in report.rank_stats.items()} == \
        {n: {r: (s.compared, s.max_ratio, s.ok) for r, s in per.items()}
         for n, per in bare.rank_stats.items()}
    assert report.to_json()["verdict"] == bare.to_json()["verdict"]


def _without_diagnosis(spec, dumps):
    """The check with the diagnosis stubbed out, and the params it was asked about."""
    called = []
    saved = CHECK_MODULE.diagnose_failure

    def stub(p, *args, **kwargs):
        called.append(p.name)
        return Diagnosis("unexplained", "-", [])

    CHECK_MODULE.diagnose_failure = stub
    try:
        return check(spec, dumps), called
    finally:
        CHECK_MODULE.diagnose_failure = saved


# --------------------------------------------------------------------------- Megatron-core
# Bugs Megatron-core users met, each built from float64 references (the buggy output is a
# weighted sum of the inputs in float64, rounded once to the grad dtype), awkward sizes, at
# 2, 3 and 4 ranks: a diagnosis names every wrong rank's output right, at every rank count.

#: awkward sizes: a 4-element bias (fewer elements than contributions at 3+ ranks x 2
#: micro-steps), a prime-sized matrix, an odd vector
MEGATRON = {"proj.weight": (37, 11), "proj.bias": (4,), "norm.weight": (129,)}
RANKS = [2, 3, 4]


def _megatron(nranks, acc, weights, *, dtype="float32", act="all_reduce", small=None,
              exact=False, seed=0):
    """``(spec, dumps)``: every rank's output of each param is ``sum_(r,k) W[r][k] x_(r,k)``
    with ``W = weights(rank)`` (nranks x acc), computed in float64 and rounded once to
    ``dtype``; ``small``: a rank whose gradients are 0.01 times the others' (its loss scaled
    by 0.01); ``exact``: ``exact_inputs``; ``act``: all_reduce, or reduce_scatter with each
    rank's ``range/`` piece."""
    from mpifusion.oracle.inputs import exact_inputs

    spec = {"params": [{"name": n, "shape": list(s), "dtype": dtype} for n, s in MEGATRON.items()],
            "act": act, "nranks": nranks, "acc_steps": acc, "average": True}
    half = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    raw = (lambda x: x.astype(half).view(np.uint16)) if dtype == "bfloat16" else (
        lambda x: x.astype(half))
    rng = np.random.default_rng(seed + 100 * nranks + acc)
    grads = [[{n: (exact_inputs(spec, r, k)[n].astype(np.float64) if exact else
                   (rng.standard_normal(s) * (0.01 if r == small else 1.0)).astype(half)
                   .astype(np.float64)) for n, s in MEGATRON.items()}
              for k in range(acc)] for r in range(nranks)]
    dumps = []
    for r in range(nranks):
        w = np.asarray(weights(r), dtype=np.float64).reshape(nranks, acc)
        d = {f"in/{n}/{k}": raw(grads[r][k][n]) for n in MEGATRON for k in range(acc)}
        for n, shape in MEGATRON.items():
            out = sum(w[q, k] * grads[q][k][n] for q in range(nranks) for k in range(acc))
            if act == "reduce_scatter":
                numel = int(np.prod(shape))
                chunk = -(-numel // nranks)
                lo, hi = min(r * chunk, numel), min((r + 1) * chunk, numel)
                d[f"range/{n}"] = np.array([lo, hi], dtype=np.int64)
                out = out.reshape(-1)[lo:hi]
            d[f"out/{n}"] = raw(out)
        dumps.append(d)
    return spec, dumps


def _diagnoses(spec, dumps, exact=False):
    """``{name: diagnosis}`` of a failing check, each naming the param's wrong ranks."""
    report = check(spec, dumps, exact=True) if exact else check(spec, dumps)
    assert not report.ok and sorted(report.diagnoses) == sorted(report.failing), str(report)
    for name, d in report.diagnoses.items():
        assert d.ranks == report.wrong_ranks(name), (name, d)
        assert "\n" not in d.text and "; on rank" not in d.text, (name, d.text)
    return report.diagnoses


@pytest.mark.parametrize("act", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("nranks", RANKS)
def test_a_never_reduced_prescaled_bucket_is_local_only(nranks, act):
    """Megatron pre-scales a bucket by 1/world before its all-reduce; the all-reduce ran on
    a copy: every rank holds its own accumulated gradient times 1/n. ``local_only`` with
    factor 1/n at every rank count: at 2 ranks too, where one rank's halved gradient alone
    would also read as the mean missing the other rank (each rank would miss another)."""
    def own(rank):
        w = np.zeros((nranks, 2))
        w[rank] = 1 / nranks
        return w

    diagnoses = _diagnoses(*_megatron(nranks, 2, own, act=act))
    assert sorted(diagnoses) == sorted(MEGATRON)
    for name, d in diagnoses.items():
        assert (d.kind, d.factor) == ("local_only", pytest.approx(1 / nranks)), (name, d)
        assert d.to_json()["factor"] == pytest.approx(1 / nranks)
        assert f"times 1/{nranks} = 1/nranks" in d.text, d.text


def test_one_rank_halved_at_two_ranks_stays_missing():
    """At 2 ranks one rank alone holding its own gradient halved is the mean missing the
    other rank (gloo's reduce leaves it on the non-root), and the same values as a
    local-only output pre-scaled: ``missing``, the text naming the other reading; only
    every rank holding its own makes it ``local_only``."""
    def w(rank):
        return np.array([[0.0], [0.5]]) if rank == 1 else np.full((2, 1), 0.5)

    d = _diagnoses(*_megatron(2, 1, w))["proj.weight"]
    assert (d.kind, d.ranks, d.from_ranks, d.steps) == ("missing", [1], [0], [0]), d
    assert "the same values as this rank's own gradient times 1/2 (local_only" in d.text


@pytest.mark.parametrize("exact", [False, True], ids=["random", "exact"])
@pytest.mark.parametrize("nranks", RANKS)
def test_a_rank_that_zeroes_its_grads_is_missing_for_small_params(nranks, exact):
    """Rank 1 zeroes its grads before the reduce: every output is (the other ranks' sum)/n.
    The 4-element bias has fewer wrong elements than the 2n contributions, too few for a
    weight per contribution: ``missing`` rank 1 all the same (a weight per rank fits it)."""
    def others(rank):
        w = np.full((nranks, 2), 1 / nranks)
        w[1] = 0
        return w

    diagnoses = _diagnoses(*_megatron(nranks, 2, others, exact=exact), exact=exact)
    assert sorted(diagnoses) == sorted(MEGATRON)
    for name, d in diagnoses.items():
        assert (d.kind, d.from_ranks, d.steps) == ("missing", [1], [0, 1]), (name, d)
        assert f"divided by {nranks} = nranks" in d.text, d.text


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("acc", [1, 2])
@pytest.mark.parametrize("nranks", RANKS)
def test_a_small_magnitude_rank_dropped_is_missing(nranks, acc, seed):
    """bf16 grads, rank 1's loss scaled by 0.01, then rank 1's contribution dropped (the
    others' sum over n): the loss is within the bf16 bound of a scale near 1 and of a bf16
    reduction too, but the dropped rank explains it at least as well, and is the bug."""
    def dropped(rank):
        w = np.full((nranks, acc), 1 / nranks)
        w[1] = 0
        return w

    diagnoses = _diagnoses(*_megatron(nranks, acc, dropped, dtype="bfloat16", small=1,
                                      seed=seed))
    assert diagnoses  # the loss is beyond the bound somewhere
    for name, d in diagnoses.items():
        assert (d.kind, d.from_ranks, d.steps) == ("missing", [1], list(range(acc))), (name, d)


@pytest.mark.parametrize("nranks", RANKS)
def test_a_doubled_micro_step_is_named(nranks):
    """A param in two buckets is reduced twice within a step (2 micro-steps, no_sync on the
    first). Every contribution doubled: ``scale`` 2, the text saying so; micro-step 0
    doubled and micro-step 1 lost: ``duplicate`` of micro-step 0, the text naming the lost
    micro-step too (not a mean over "the ranks present": every rank is present); micro-step
    0 doubled alone: ``duplicate`` of micro-step 0."""
    n = nranks

    def every(rank):
        return np.full((n, 2), 2 / n)

    def first_twice_second_lost(rank):
        return np.tile([2 / n, 0.0], (n, 1))

    def first_twice(rank):
        return np.tile([2 / n, 1 / n], (n, 1))

    for name, d in _diagnoses(*_megatron(n, 2, every)).items():
        assert (d.kind, d.factor) == ("scale", 2.0), (name, d)
        assert "every contribution counted twice" in d.text, d.text
    for weights in (first_twice_second_lost, first_twice):
        lost = weights is first_twice_second_lost
        for name, d in _diagnoses(*_megatron(n, 2, weights)).items():
            assert (d.kind, d.from_ranks, d.steps) == ("duplicate", list(range(n)), [0]), \
                (name, d)
            assert "micro-step 0 on every rank are counted twice" in d.text, d.text
            assert ("those of micro-step 1 on every rank are missing" in d.text) == lost, d.text
            assert "ranks present" not in d.text, d.text
            assert ("or summed where a mean was expected" in d.text) == (lost and n == 2)


def test_a_sum_over_a_wrong_group_is_missing_not_doubled():
    """Whole ranks lost and the rest at a uniform weight is the collective's divisor, never
    a duplicate: rank 3 left out of a sum where a mean was expected (weight 1 = 4 times the
    expected 1/4) is ``missing`` rank 3, "not divided"."""
    def w(rank):
        out = np.ones((4, 2))
        out[3] = 0
        return out

    d = _diagnoses(*_megatron(4, 2, w))["proj.weight"]
    assert (d.kind, d.from_ranks, d.steps) == ("missing", [3], [0, 1]), d
    assert "divided by 1: a sum where a mean was expected" in d.text, d.text


def test_ranks_with_different_bugs_are_each_explained():
    """3 ranks: ranks 1 and 2 hold the sum (``scale`` 3), rank 0 its own gradient
    (``local_only``): the kind is the one most ranks share, the text starts with the ranks
    it holds for, then each other group's ranks, kind and text."""
    def w(rank):
        if rank == 0:
            out = np.zeros((3, 1))
            out[0] = 1
            return out
        return np.ones((3, 1))

    report = check(*_megatron(3, 1, w))
    d = report.diagnoses["proj.weight"]
    assert (d.kind, d.factor, d.ranks) == ("scale", 3.0, [0, 1, 2]), d
    assert d.text.startswith("on ranks 1, 2: every element is the reference times 3"), d.text
    assert "; on rank 0: local_only: the output is the rank's own accumulated gradient" \
        in d.text, d.text


def test_every_text_form_is_documented():
    """docs/oracle.md's Diagnosis section names every kind, every field and every part a
    text may end in or start with."""
    from pathlib import Path

    from mpifusion.oracle.diagnose import FIELDS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "oracle.md").read_text()
    section = doc[doc.index("## Diagnosis"):]
    section = " ".join(section[:section.index("\n## ", 1)].split())  # lines wrapped anywhere
    for kind in KINDS:
        assert f"`{kind}`" in section, kind
    for fields in FIELDS.values():
        for name in fields:
            assert f"`{name}`" in section, name
    for part in ("(wrong output on", "on ranks", "; in k of m elements, the rest right",
                 "counted twice", "the ranks present", "= nranks", "= acc_steps",
                 "element(s) at one end hold other values", "partly from the neighbour",
                 "no diagnosis (", "worst", "the same values as this rank's own gradient"):
        assert part in section, part
