"""``mpifusion.oracle.check`` as a library: in-memory and file dumps, any shard layout given by
``range/{name}`` (FSDP2 dim-0, ZeRO flat partitions, Megatron buffer shards), gaps and
overlaps, the param all-gather, REDUCE off the root, the report and the pytest helpers; and
the inputs it must refuse or note rather than pass (raw two-byte values, bounds too coarse,
inputs sharing memory with a result, keys of unfused params, odd rank and step names).

References are independent: fp32 numpy sums computed here, cut by layouts computed here.
"""
from __future__ import annotations

import json
import sys
import textwrap
import zipfile

import ml_dtypes
import numpy as np
import pytest

from mpifusion.dtypes import finfo
from mpifusion.errors import FusionError, OptionError, OracleMismatch
from mpifusion.oracle import assert_matches_reference, check, error_bound
from mpifusion.oracle.dumps import DumpError

from tests.helpers import run_cmd
from tests.reference import fp32_reduction, rank_grads

SHAPES = {"emb": (37, 5), "w": (7, 3), "b": (13,), "odd": (3, 1, 11)}


def _spec(nranks, act="reduce_scatter", acc=1, average=True, dtype="float32", **kw):
    return {"params": [{"name": n, "shape": list(s), "dtype": dtype} for n, s in SHAPES.items()],
            "act": act, "nranks": nranks, "acc_steps": acc, "average": average, **kw}


def _grads(nranks, acc, seed, dtype=np.float32):
    return rank_grads(nranks, acc, SHAPES, seed, dtype)


def _inputs(g):
    return {f"in/{n}/{k}": x for n, xs in g.items() for k, x in enumerate(xs)}


def _dim0_ranges(shape, nranks):
    """FSDP2's cut: torch.chunk along dim 0 (ceil-sized chunks, the last ones short/empty)."""
    rows = shape[0]
    row = int(np.prod(shape[1:]))
    chunk = -(-rows // nranks)
    return [(min(r * chunk, rows) * row, min((r + 1) * chunk, rows) * row) for r in range(nranks)]


def _flat_ranges(nranks):
    """ZeRO-style: all params concatenated (no padding), the flat buffer cut evenly; each rank's
    piece of a param is the intersection of its partition with the param."""
    total = sum(int(np.prod(s)) for s in SHAPES.values())
    part = -(-total // nranks)
    out, start = {}, 0
    for n, s in SHAPES.items():
        numel = int(np.prod(s))
        out[n] = [(min(max(r * part - start, 0), numel), min(max((r + 1) * part - start, 0), numel))
                  for r in range(nranks)]
        start += numel
    return out


def _sharded_dumps(grads, result, ranges):
    dumps = []
    for r, g in enumerate(grads):
        d = _inputs(g)
        for n in SHAPES:
            b, e = ranges[n][r]
            d[f"range/{n}"] = np.array([b, e], dtype=np.int64)
            d[f"out/{n}"] = result[n].reshape(-1)[b:e].copy()
        dumps.append(d)
    return dumps


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["dim0", "flat"])
def test_range_layouts_pass_and_a_corrupt_piece_fails(nranks, layout):
    grads = _grads(nranks, 2, seed=nranks)
    result = fp32_reduction(grads, average=True)
    ranges = ({n: _dim0_ranges(s, nranks) for n, s in SHAPES.items()} if layout == "dim0"
              else _flat_ranges(nranks))
    dumps = _sharded_dumps(grads, result, ranges)
    report = check(_spec(nranks, acc=2), dumps)
    assert report.ok, str(report)
    assert [s.compared for s in report.stats] == [int(np.prod(s)) for s in SHAPES.values()]
    assert not report.coverage
    # one element of one rank's piece off by far more than the bound
    victim = max(range(nranks), key=lambda r: ranges["odd"][r][1] - ranges["odd"][r][0])
    piece = dumps[victim]["out/odd"]
    piece[len(piece) // 2] += np.float32(1e-3)
    report = check(_spec(nranks, acc=2), dumps)
    assert report.failing == ["odd"]
    assert report.failing_ranks == [victim]
    with pytest.raises(OracleMismatch, match=rf"odd \(err/bound .* on rank {victim}\)") as exc:
        report.raise_for_failure()
    assert isinstance(exc.value, FusionError) and exc.value.params == ["odd"]


def test_megatron_style_padded_buffer_shards():
    """Params in a bucket with their own padding (here: each param aligned to 16 elements, the
    bucket a multiple of nranks*16), each rank owning one contiguous shard of the bucket; the
    range of a param is its intersection with the shard, in param coordinates."""
    nranks = 3
    grads = _grads(nranks, 1, seed=11)
    result = fp32_reduction(grads, average=False)
    offsets, start = {}, 0
    for n, s in SHAPES.items():
        offsets[n] = start
        start += -(-int(np.prod(s)) // 16) * 16
    bucket = -(-start // (nranks * 16)) * nranks * 16
    shard = bucket // nranks
    ranges = {}
    for n, s in SHAPES.items():
        numel, off = int(np.prod(s)), offsets[n]
        ranges[n] = []
        for r in range(nranks):
            b, e = max(off, r * shard) - off, min(off + numel, (r + 1) * shard) - off
            ranges[n].append((b, e) if b < e else (0, 0))
    report = check(_spec(nranks, average=False), _sharded_dumps(grads, result, ranges))
    assert report.ok, str(report)


def test_gaps_fail_and_overlaps_are_reported():
    nranks = 2
    grads = _grads(nranks, 1, seed=3)
    result = fp32_reduction(grads, average=True)
    ranges = {n: _dim0_ranges(s, nranks) for n, s in SHAPES.items()}
    numel = int(np.prod(SHAPES["emb"]))
    ranges["emb"] = [(0, 60), (70, numel)]          # [60, 70) held by nobody
    ranges["b"] = [(0, 10), (5, 13)]                # [5, 10) held twice (both correct)
    report = check(_spec(nranks), _sharded_dumps(grads, result, ranges))
    gaps = [(c.name, c.begin, c.end) for c in report.coverage if c.kind == "gap"]
    overlaps = [(c.name, c.begin, c.end, c.ranks) for c in report.coverage if c.kind == "overlap"]
    assert gaps == [("emb", 60, 70)]
    assert overlaps == [("b", 5, 10, (0, 1))]
    assert report.failing == ["emb"]
    text = str(report)
    assert "GAP: emb: out/ gap [60, 70) held by no rank" in text
    assert "note: b: out/ overlap [5, 10) held by ranks 0, 1" in text
    doc = report.to_json()
    assert doc["verdict"] == "FAIL" and doc["failing"] == {"emb": "out/ gap [60, 70)"}


def test_paddle_cut_stays_the_default_and_ranges_override_it(tmp_path):
    """Without range/ the reduce_scatter piece is Paddle's slice of the padded buffer
    (fp32: every param padded to a multiple of 64 * nranks elements)."""
    nranks = 2
    grads = _grads(nranks, 1, seed=5)
    result = fp32_reduction(grads, average=True)
    flat = []
    for n, s in SHAPES.items():
        numel = int(np.prod(s))
        padded = -(-numel // (64 * nranks)) * 64 * nranks
        flat.append(np.concatenate([result[n].ravel(), np.zeros(padded - numel, np.float32)]))
    full = np.concatenate(flat)
    shard = full.size // nranks
    dumps, start = [_inputs(g) for g in grads], 0
    for n, s in SHAPES.items():
        padded = -(-int(np.prod(s)) // (64 * nranks)) * 64 * nranks
        for r in range(nranks):
            b, e = max(start, r * shard), min(start + padded, (r + 1) * shard)
            if b < e:
                dumps[r][f"out/{n}"] = full[b:e]
        start += padded
    assert check(_spec(nranks), dumps).ok
    for r, d in enumerate(dumps):  # the same values saved to files: same verdict
        np.savez(tmp_path / f"rank{r}.npz", **d)
    assert check(_spec(nranks), str(tmp_path)).ok
    assert check(_spec(nranks), [str(tmp_path / f"rank{r}.npz") for r in range(nranks)]).ok
    # a rank giving range/ for one param while another gives Paddle's cut: bad input
    dumps[0]["range/w"] = np.array([0, 3])
    with pytest.raises(DumpError, match=r"rank 1 \(in memory\): range/w: missing"):
        check(_spec(nranks), dumps)


def _gather_dumps(nranks, ranges, params, dtype=np.float32, shards_from=None):
    dumps = []
    for r in range(nranks):
        d = {}
        for n in SHAPES:
            b, e = ranges[n][r]
            d[f"range/{n}"] = np.array([b, e])
            d[f"shard/{n}"] = (shards_from or params)[n].reshape(-1)[b:e].copy()
            d[f"param/{n}"] = params[n].copy()
        dumps.append(d)
    return dumps


@pytest.mark.parametrize("nranks", [1, 3, 4])
def test_param_all_gather_is_checked_bit_exact(nranks):
    rng = np.random.default_rng(nranks)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    ranges = {n: _dim0_ranges(s, nranks) for n, s in SHAPES.items()}
    dumps = _gather_dumps(nranks, ranges, params)
    report = check(_spec(nranks), dumps)
    assert report.ok and not report.stats and [s.name for s in report.sync] == list(SHAPES)
    assert str(report).splitlines()[-1] == f"PASS: {len(SHAPES)} gathered params exact"
    # one ulp off on the last rank's gathered copy of w
    bad = dumps[-1]["param/w"].reshape(-1)
    bad[4] = np.nextafter(bad[4], np.float32(np.inf))
    report = check(_spec(nranks), dumps)
    assert report.failing == ["w"] and report.failing_ranks == [nranks - 1]
    assert report.sync[1].mismatched == 1
    # -0.0 against +0.0 is a different bit pattern
    dumps = _gather_dumps(nranks, ranges, {**params, "b": np.zeros(13, np.float32)})
    dumps[0]["param/b"] = -dumps[0]["param/b"]
    assert check(_spec(nranks), dumps).failing == ["b"]


def test_param_all_gather_with_paddle_cut_and_bf16():
    """Paddle's sync_params: each rank's shard is its slice of the padded param buffer (bf16:
    128 * nranks elements per param), given without range/; padding is ignored."""
    nranks = 2
    rng = np.random.default_rng(2)
    params = {n: rng.standard_normal(s).astype(ml_dtypes.bfloat16) for n, s in SHAPES.items()}
    flat = []
    for n, s in SHAPES.items():
        numel = int(np.prod(s))
        padded = -(-numel // (128 * nranks)) * 128 * nranks
        flat.append(np.concatenate([params[n].ravel(), np.zeros(padded - numel, params[n].dtype)]))
    full = np.concatenate(flat)
    shard = full.size // nranks
    dumps = [{f"param/{n}": params[n].view(np.uint16) for n in SHAPES} for _ in range(nranks)]
    start = 0
    for n, s in SHAPES.items():
        padded = -(-int(np.prod(s)) // (128 * nranks)) * 128 * nranks
        for r in range(nranks):
            b, e = max(start, r * shard), min(start + padded, (r + 1) * shard)
            if b < e:
                dumps[r][f"shard/{n}"] = full[b:e].view(np.uint16)
        start += padded
    spec = _spec(nranks, dtype="bfloat16", use_main_grad=True)
    assert check(spec, dumps).ok
    dumps[1]["param/emb"] = dumps[1]["param/emb"].copy()
    dumps[1]["param/emb"].reshape(-1)[0] ^= 1  # one bit
    assert check(spec, dumps).failing == ["emb"]


def test_gather_gap_and_conflicting_overlap():
    nranks = 2
    rng = np.random.default_rng(9)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    ranges = {n: _dim0_ranges(s, nranks) for n, s in SHAPES.items()}
    ranges["w"] = [(0, 10), (12, 21)]
    ranges["b"] = [(0, 8), (4, 13)]
    dumps = _gather_dumps(nranks, ranges, params)
    dumps[1]["shard/b"] = dumps[1]["shard/b"] + np.float32(1)  # disagrees with rank 0 on [4, 8)
    report = check(_spec(nranks), dumps)
    assert [(c.name, c.what, c.kind, c.begin, c.end) for c in report.coverage] == [
        ("w", "shard", "gap", 10, 12), ("b", "shard", "overlap", 4, 8)]
    reasons = report.reasons()
    assert set(reasons) == {"w", "b"}
    assert "overlapping shards disagree in 4 element(s)" in reasons["b"]


def test_reduce_off_the_root_follows_paddles_rule():
    nranks, dst = 3, 1
    grads = _grads(nranks, 2, seed=4)
    result = fp32_reduction(grads, average=True)
    dumps = []
    for r, g in enumerate(grads):
        d = _inputs(g)
        for n in SHAPES:
            local = g[n][0] + g[n][1]
            d[f"out/{n}"] = result[n] if r == dst else local * np.float32(1 / nranks)
        dumps.append(d)
    spec = _spec(nranks, act="reduce", acc=2, dst=dst)
    report = check(spec, dumps)
    assert report.ok, str(report)
    assert sorted(report.rank_stats["w"]) == [0, 1, 2]
    dumps[2]["out/b"] = dumps[2]["out/b"] * np.float32(nranks)  # forgot the 1/n off the root
    report = check(spec, dumps)
    assert report.failing == ["b"] and report.failing_ranks == [2]


def test_report_text_json_and_assert_helper():
    nranks = 2
    grads = _grads(nranks, 1, seed=1)
    result = fp32_reduction(grads, average=True)
    dumps = [{**_inputs(g), **{f"out/{n}": result[n] for n in SHAPES}} for g in grads]
    spec = _spec(nranks, act="all_reduce")
    report = assert_matches_reference(spec, dumps)
    lines = str(report).splitlines()
    assert lines[0].startswith("check 2 in-memory rank record(s): all_reduce")
    assert lines[-1] == f"PASS: {len(SHAPES)} params within the bound"
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["verdict"] == "PASS" and [p["name"] for p in doc["params"]] == list(SHAPES)
    assert [r["rank"] for r in doc["params"][0]["ranks"]] == [0, 1]
    dumps[1]["out/emb"] = dumps[1]["out/emb"] * np.float32(2)
    with pytest.raises(AssertionError, match=r"^oracle: 1 param\(s\) do not match the "
                       r"reference on rank\(s\) 1: emb \(err/bound"):
        assert_matches_reference(spec, dumps)


def test_bad_input_is_one_line_naming_rank_and_key():
    grads = _grads(2, 1, seed=1)
    dumps = [_inputs(g) for g in grads]
    spec = _spec(2)
    for r, d in enumerate(dumps):
        d["range/emb"] = np.array([0, 199])
    with pytest.raises(DumpError, match=r"^rank 0 \(in memory\): range/emb: \[0, 199\) is not "
                       r"within \[0, 185\)"):
        check(spec, dumps)
    dumps[0]["range/emb"] = np.array([0.0, 3.0])
    with pytest.raises(DumpError, match=r"range/emb: expected two ints"):
        check(spec, dumps)
    with pytest.raises(DumpError, match=r"3 rank record\(s\) given, but the spec says nranks=2"):
        check(spec, dumps + [{}])
    with pytest.raises(DumpError, match="nothing to check"):
        check(spec, [{}, {}])
    with pytest.raises(DumpError, match=r"param/w: missing on every rank"):
        check(spec, [{"range/w": np.array([0, 21]), "shard/w": np.zeros(21, np.float32)}, {}])


def test_keys_the_spec_does_not_expect_are_bad_input(tmp_path, capsys):
    """A micro-step beyond acc_steps (or a param the spec lacks) would be left out of the
    reference: an implementation that dropped that micro-step would pass. Bad input instead,
    from memory, from files and on the command line."""
    from tests.helpers import run_cli

    nranks, acc = 2, 2
    grads = _grads(nranks, acc + 1, seed=5)  # three micro-steps recorded
    dropped = fp32_reduction([{n: xs[:acc] for n, xs in g.items()} for g in grads], True)
    dumps = [{**_inputs(g), **{f"out/{n}": dropped[n] for n in SHAPES}} for g in grads]
    spec = _spec(nranks, act="all_reduce", acc=acc)
    with pytest.raises(DumpError, match=r"^rank 0 \(in memory\): in/(\w+)/2: micro-step 2, but "
                       r"the spec says acc_steps=2 \(expected in/\1/0 \.\. in/\1/1\)"):
        check(spec, dumps)
    # the right spec: the implementation that dropped micro-step 2 fails naming the params
    report = check(_spec(nranks, act="all_reduce", acc=acc + 1), dumps)
    assert not report.ok and set(report.failing) == set(SHAPES)
    good = [{**_inputs({n: xs[:acc] for n, xs in g.items()}), **{f"out/{n}": dropped[n]
             for n in SHAPES}} for g in grads]
    assert check(spec, good).ok
    for key, why in [("in/extra/0", r"no param 'extra' in the spec"),
                     ("out/extra", r"no param 'extra' in the spec"),
                     ("range/extra", r"no param 'extra' in the spec"),
                     ("in/emb/x", r"micro-step 'x'"), ("in/emb/01", r"micro-step '01'"),
                     ("in/emb", r"expected in/\{name\}/\{k\}")]:
        bad = [dict(d) for d in good]
        bad[1][key] = np.zeros(3, np.float32)
        with pytest.raises(DumpError, match=rf"^rank 1 \(in memory\): {key}: .*{why}"):
            check(spec, bad)
    good[0]["meta/note"] = np.zeros(1)  # other prefixes are the dumper's business
    assert check(spec, good).ok
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    for r, d in enumerate(dumps):
        np.savez(tmp_path / f"rank{r}.npz", **d)
    code, out, err = run_cli(capsys, "check", "--spec", str(spec_path), str(tmp_path))
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and "rank0.npz: in/b/2: micro-step 2, but the spec" in err, err


def test_pytest_plugin_fixture_fails_a_test_naming_the_param(tmp_path):
    test = tmp_path / "test_peer.py"
    test.write_text(textwrap.dedent("""
        import numpy as np
        pytest_plugins = ["mpifusion.oracle.pytest_plugin"]
        SPEC = {"params": [{"name": "w", "shape": [3], "dtype": "float32"}],
                "act": "all_reduce", "nranks": 2}
        X = [np.array([1, 2, 3], np.float32), np.array([4, 5, 6], np.float32)]

        def test_good(mpifusion_oracle, tmp_path):
            report = mpifusion_oracle(SPEC, [{"in/w/0": x, "out/w": X[0] + X[1]} for x in X])
            assert report.ok and (tmp_path / "oracle-report.json").exists()

        def test_bad(mpifusion_oracle):
            mpifusion_oracle(SPEC, [{"in/w/0": x, "out/w": X[0].copy()} for x in X])
    """))
    proc = run_cmd([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                   timeout=120, cwd=str(tmp_path))
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "FAIL: 1 param(s) beyond the bound: w" in proc.stdout


def test_range_dumps_from_files_and_the_cli(tmp_path, capsys):
    from tests.helpers import run_cli

    nranks = 3
    grads = _grads(nranks, 1, seed=8)
    result = fp32_reduction(grads, average=True)
    ranges = {n: _dim0_ranges(s, nranks) for n, s in SHAPES.items()}
    ranges["emb"] = [(0, 60), (70, 150), (150, 185)]
    for r, d in enumerate(_sharded_dumps(grads, result, ranges)):
        np.savez(tmp_path / f"rank{r}.npz", **d)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(nranks)))
    report = check(str(spec), str(tmp_path))
    assert report.failing == ["emb"] and report.coverage[0].begin == 60
    code, out, _ = run_cli(capsys, "check", "--spec", str(spec), str(tmp_path))
    assert code == 1
    assert out.strip().splitlines()[-1] == "FAIL: 1 param(s): emb (out/ gap [60, 70))"
    code, out, _ = run_cli(capsys, "check", "--spec", str(spec), str(tmp_path), "--json")
    assert code == 1 and json.loads(out)["coverage"][0]["kind"] == "gap"


def test_plot_draws_error_over_bound_per_param_and_rank(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from tests.helpers import run_cli

    nranks = 3
    grads = _grads(nranks, 2, seed=2)
    result = fp32_reduction(grads, average=True)
    dumps = [{**_inputs(g), **{f"out/{n}": result[n].copy() for n in SHAPES}} for g in grads]
    dumps[1]["out/w"].reshape(-1)[3] += np.float32(1e-4)
    dumps[2]["out/b"].reshape(-1)[0] = np.nan
    for r, d in enumerate(dumps):
        np.savez(tmp_path / f"rank{r}.npz", **d)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(nranks, act="all_reduce", acc=2)))
    png = tmp_path / "err.png"
    code, out, _ = run_cli(capsys, "check", "--spec", str(spec), str(tmp_path), "--plot", str(png))
    assert code == 1 and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    code, _, err = run_cli(capsys, "check", "--spec", str(spec), str(tmp_path), "--plot",
                           str(tmp_path / "no" / "such" / "dir.png"))
    assert code == 2 and "--plot" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("nranks", [2, 3, 8])
def test_reduce_non_root_rule_agrees_with_mpifusion_runtime(tmp_path, nranks):
    """mpifusion's REDUCE buffer (every rank dumped) passes the oracle's non-root rule for
    every way of scaling; use_reduce_avg needs reduce_avg=True (non-roots stay unscaled)."""
    from pathlib import Path

    from tests.helpers import run_job

    script = Path(__file__).resolve().parent / "peers" / "mpifusion_reduce.py"
    proc = run_job(nranks, [sys.executable, "-m", "mpi4py", str(script), str(tmp_path)],
                   timeout=150, env={"MPIFUSION_TIMEOUT": "60"})  # a stuck rank says where
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case in ("pre", "post"):
        report = check(tmp_path / case / "spec.json", tmp_path / case)
        assert report.ok, str(report)
        assert sorted(report.rank_stats["w1"]) == list(range(nranks))
        assert not check(tmp_path / case / "spec.json", tmp_path / case, reduce_avg=True).ok
    assert check(tmp_path / "avg" / "spec.json", tmp_path / "avg", reduce_avg=True).ok
    assert check(tmp_path / "avg" / "spec.json", tmp_path / "avg").failing == ["w0", "w1", "w2"]


def test_nranks_from_the_records_when_the_spec_has_none():
    grads = _grads(3, 1, seed=6)
    result = fp32_reduction(grads, average=False)
    spec = _spec(3, act="all_reduce", average=False)
    del spec["nranks"]
    records = ({**_inputs(g), **{f"out/{n}": result[n] for n in SHAPES}} for g in grads)
    report = check(spec, records)  # a generator of records works too
    assert report.ok and report.spec.nranks == 3 and "3 rank(s)" in str(report)


# -------------------------------------------------- values, bounds and keys it must refuse or note


BF16 = ml_dtypes.bfloat16


def spec_of(dtype="float32", nranks=2, shape=(3,), **kw):
    return {"params": [{"name": "w", "shape": list(shape), "dtype": dtype}], "nranks": nranks,
            **kw}


def test_raw_two_byte_values_of_an_fp16_param_are_refused_not_read_as_bf16():
    a = np.array([1.0, 2.0, 3.0], np.float16)
    # a wrong fp16 result built to look right when its bytes are read as bfloat16
    fake = (a.view(BF16).astype(np.float32) * 2).astype(BF16).view(np.uint16)
    for raw in (fake.view("V2"), fake):
        with pytest.raises(DumpError, match=r"out/w: dtype .*raw 2-byte .*spec says float16"):
            check(spec_of("float16"), [{"in/w/0": a, "out/w": raw}] * 2)


def test_raw_two_byte_values_in_an_npz_of_an_fp32_param_are_refused(tmp_path):
    x = np.array([1.0, 2.0, 3.0], np.float32)
    for r in range(2):
        np.savez(tmp_path / f"rank{r}.npz", **{"in/w/0": x,
                                              "out/w": (2 * x).astype(BF16).view("V2")})
    with pytest.raises(DumpError, match=r"rank0.npz: out/w: dtype .*spec says float32"):
        check(spec_of(), str(tmp_path))


def test_raw_two_byte_values_of_a_bf16_param_are_still_read():
    x = np.array([1.0, 2.0, 3.0], np.float32).astype(BF16)
    out = (2 * x.astype(np.float32)).astype(BF16)
    report = check(spec_of("bfloat16"),
                   [{"in/w/0": x.view("V2"), "out/w": out.view(np.uint16)}] * 2)
    assert report.ok, report


def test_a_bound_that_would_pass_zero_is_refused():
    rng = np.random.default_rng(0)
    k = 128
    x = rng.uniform(0.5, 1, (2, k, 3)).astype(BF16)
    recs = [{**{f"in/w/{s}": x[r, s] for s in range(k)}, "out/w": np.zeros(3, BF16)}
            for r in range(2)]
    with pytest.raises(OptionError, match="even 0 would pass"):
        check(spec_of("bfloat16", acc_steps=k, average=True), recs)


def test_a_bound_too_coarse_to_see_one_lost_input_says_so():
    rng = np.random.default_rng(1)
    k = 16
    x = rng.uniform(0.5, 1, (2, k, 3)).astype(BF16)
    # one rank's last micro-step left out of the result: within this (worst-case) bound
    wrong = (x.astype(np.float64).sum(axis=(0, 1)) - x[1, -1].astype(np.float64)) / 2
    recs = [{**{f"in/w/{s}": x[r, s] for s in range(k)}, "out/w": wrong.astype(BF16)}
            for r in range(2)]
    report = check(spec_of("bfloat16", acc_steps=k, average=True), recs)
    assert report.ok  # the worst-case bound cannot tell, and the report says so
    assert any("missing one rank's or one micro-step's gradient may pass" in n
               for n in report.notes), report.notes
    assert "note: bfloat16 grads: the bound allows" in str(report)
    assert report.to_json()["notes"] == report.notes
    # fp32 at 2 ranks has no such note
    y = rng.uniform(0.5, 1, (2, 3)).astype(np.float32)
    fine = check(spec_of(), [{"in/w/0": y[r], "out/w": y.sum(axis=0)} for r in range(2)])
    assert fine.ok and not fine.notes


def test_a_spec_without_fused_params_is_refused():
    spec = {"params": [{"name": "w", "shape": [3], "dtype": "float32", "stop_gradient": True}],
            "nranks": 2, "average": True}
    recs = [{"in/w/0": np.ones(3, np.float32) * (r + 1), "out/w": np.full(3, 123.0, np.float32)}
            for r in range(2)]
    with pytest.raises(DumpError, match="no param is fused.*nothing to check"):
        check(spec, recs)


def test_keys_of_unfused_params_are_named_as_not_checked():
    spec = {"params": [{"name": "w", "shape": [3], "dtype": "float32"},
                       {"name": "frozen", "shape": [2], "dtype": "float32",
                        "stop_gradient": True}], "nranks": 2}
    x = np.array([1.0, 2.0, 3.0], np.float32)
    recs = [{"in/w/0": x, "out/w": 2 * x, "out/frozen": np.full(2, 99.0, np.float32)}] * 2
    report = check(spec, recs)
    assert report.ok and any("out/frozen" in n and "not checked" in n for n in report.notes)


def test_a_duplicate_npz_member_is_refused(tmp_path):
    x = np.array([1.0, 2.0, 3.0], np.float32)
    for r in range(2):
        path = tmp_path / f"rank{r}.npz"
        np.savez(path, **{"in/w/0": x, "out/w": 2 * x})
        with pytest.warns(UserWarning, match="Duplicate name"):  # zipfile says so, and writes
            with zipfile.ZipFile(path, "a") as z, z.open("out/w.npy", "w") as f:
                np.lib.format.write_array(f, np.zeros(3, np.float32))
    with pytest.raises(DumpError, match=r"out/w: not a valid .npz \(two members"):
        check(spec_of(), str(tmp_path))
    assert np.load(tmp_path / "rank0.npz")["out/w"].tolist() == [0, 0, 0]  # what numpy shows


def test_inputs_sharing_memory_with_a_result_are_refused():
    grads = [np.array([1.0, 2, 3], np.float32), np.array([5.0, 6, 7], np.float32)]
    recs = [{"in/w/0": g, "out/w": g} for g in grads]
    for g in grads:  # an in-place all-reduce that got it wrong, inputs overwritten
        g[:] = [100, 200, 300]
    with pytest.raises(DumpError, match=r"in/w/0: shares memory with out/w .*copies"):
        check(spec_of(average=True), recs)
    # a view of another rank's result is caught too
    buf = np.zeros(6, np.float32)
    with pytest.raises(DumpError, match="shares memory"):
        check(spec_of(), [{"in/w/0": buf[:3], "out/w": np.ones(3, np.float32)},
                          {"in/w/0": np.ones(3, np.float32), "out/w": buf[1:4]}])


def test_interleaved_views_of_one_buffer_do_not_share_memory():
    buf = np.arange(12, dtype=np.float32)
    ins, outs = buf[0::2][:3], buf[1::2][:3]   # spans overlap, elements do not
    ins[:] = [1, 2, 3]
    outs[:] = [2, 4, 6]
    other = np.array([1.0, 2, 3], np.float32)
    report = check(spec_of(), [{"in/w/0": ins, "out/w": outs},
                               {"in/w/0": other, "out/w": outs.copy()}])
    assert report.ok, report


def test_identical_inputs_of_a_mean_and_zero_inputs_are_noted():
    x = np.array([1.0, 2.0, 3.0], np.float32)
    same = check(spec_of(average=True), [{"in/w/0": x.copy(), "out/w": x.copy()}
                                         for _ in range(2)])
    assert same.ok and any("every rank fed the same inputs" in n for n in same.notes)
    zero = check(spec_of(), [{"in/w/0": np.zeros(3, np.float32),
                              "out/w": np.zeros(3, np.float32)} for _ in range(2)])
    assert zero.ok and any("every input is 0" in n for n in zero.notes)
    # a sum of identical inputs reveals a skipped reduction, not inputs that were recorded
    # already reduced (a data-parallel hook ahead of the capture's): noted too
    total = check(spec_of(), [{"in/w/0": x.copy(), "out/w": 2 * x} for _ in range(2)])
    assert total.ok and any("after a reduction" in n for n in total.notes), total.notes
    differ = check(spec_of(), [{"in/w/0": x * (r + 1), "out/w": 3 * x} for r in range(2)])
    assert differ.ok and not differ.notes


def test_values_and_arguments_of_the_wrong_kind():
    x = np.ones(3, np.float32)
    for bad in (None, "1,2,3", {"a": 1}):
        with pytest.raises(DumpError, match=r"rank 0 \(in memory\): out/w: expected an array"):
            check(spec_of(), [{"in/w/0": x, "out/w": bad}, {"in/w/0": x, "out/w": 2 * x}])
    with pytest.raises(DumpError, match="dumps: expected a directory"):
        check(spec_of(), b"/tmp")
    with pytest.raises(DumpError, match="reduce_avg: expected True or False, got 'no'"):
        check(spec_of(), [{"in/w/0": x, "out/w": 2 * x}] * 2, reduce_avg="no")


def test_a_not_convertible_value_names_its_key_once():
    class Bad:
        def __array__(self, *a, **k):
            raise RuntimeError("on a device")

    x = np.ones(3, np.float32)
    with pytest.raises(DumpError) as err:
        check(spec_of(), [{"in/w/0": x, "out/w": Bad()}, {"in/w/0": x, "out/w": 2 * x}])
    assert str(err.value).count("rank 0 (in memory): out/w") == 1, str(err.value)


# --------------------------------------------- half averages, rank orders, names and shared memory


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("nranks", [5, 8, 16])
def test_prescaled_half_average_in_the_subnormal_range_passes(dtype, nranks):
    """Paddle's (and FusedCommBuffer's) scale_after_comm=False on fp16/bf16 grads: every rank
    multiplies its buffer by fp32(1/R) in fp32 and rounds to the half dtype, then the ranks
    sum in fp32, rounded once. Where the scaled grads are subnormal, each rank's rounding is
    an absolute error of up to half the smallest subnormal, R of them; the bound's eta
    counted one, so a correct result failed (up to 4x the bound at 8 ranks)."""
    import ml_dtypes

    half = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    tiny = float(finfo(half).smallest_subnormal)
    rng = np.random.default_rng(nranks)
    xs = [(rng.integers(1, 12, 64) * tiny).astype(half) for _ in range(nranks)]
    scale = np.float32(1.0 / nranks)
    pre = [(x.astype(np.float32) * scale).astype(half) for x in xs]  # mpifusion's scale_
    out = np.sum([p.astype(np.float32) for p in pre], axis=0, dtype=np.float32).astype(half)
    spec = spec_of(dtype, nranks, shape=(64,), average=True)
    raw = (lambda a: a.view(np.uint16)) if dtype == "bfloat16" else (lambda a: a)
    report = check(spec, [{"in/w/0": raw(x), "out/w": raw(out)} for x in xs])
    assert report.ok, report
    # still the bound of a few roundings: one subnormal step more on every element fails
    worse = (out.astype(np.float32) + np.float32(nranks * tiny)).astype(half)
    assert not check(spec, [{"in/w/0": raw(x), "out/w": raw(worse)} for x in xs]).ok


def _sequential(values, order):
    s = 0.0
    for i in order:
        s = s + values[i]
    return s


def test_float64_sum_in_another_rank_order_passes():
    """For float64 grads the reference (a float64 sum in rank order) rounds as often as the
    implementation does: a correct sum in another order was up to 1.33x the bound at 4
    ranks. The bound now counts the reference's own roundings."""
    x = [2.0 ** -53, 2.0 ** -52, 1.0, -float.fromhex("0x1.ffffffffffff8p-54")]
    out = _sequential(x, (0, 2, 3, 1))  # an MPI library's order
    report = check(spec_of("float64", 4, shape=(1,)),
                   [{"in/w/0": np.array([v]), "out/w": np.array([out])} for v in x])
    assert report.ok, report
    # every permutation of a 4-rank sum, on values built to round both ways: one element
    # per (value set, order), so each element is its own case and one check covers them all
    rng = np.random.default_rng(7)
    import itertools

    sets, orders = [], list(itertools.permutations(range(4)))
    for _ in range(200):
        v = [1.0] + [float(rng.choice([-1, 1]) * 2.0 ** -53 * rng.choice([1, 2, 3])
                           * (1 + int(rng.integers(-3, 4)) * 2.0 ** -50)) for _ in range(3)]
        rng.shuffle(v)
        sets.append(v)
    cases = [(v, order) for v in sets for order in orders]
    ins = np.array([v for v, _ in cases])  # element i: rank r's input v[r]
    for avg in (False, True):
        spec = spec_of("float64", 4, shape=(len(cases),), average=avg)
        out = np.array([_sequential(v, order) * (0.25 if avg else 1.0) for v, order in cases])
        report = check(spec, [{"in/w/0": ins[:, r].copy(), "out/w": out} for r in range(4)])
        assert report.ok, (avg, str(report))


def test_one_rank_one_step_sum_is_still_bit_exact():
    assert error_bound(np.array([1.0]), grad_dtype="float64", nranks=1, acc_steps=1,
                       average=False)[0] == 0.0
    x = np.array([0.1, 0.2])
    assert not check(spec_of("float64", 1, shape=(2,)),
                     [{"in/w/0": x, "out/w": np.nextafter(x, 1)}]).ok


def test_memoryview_inputs_sharing_memory_with_a_result_are_refused():
    """The aliasing refusal looked at numpy arrays only: an input handed over as any other
    array-like sharing the result's memory (here a memoryview; a torch tensor below) was
    read after the in-place collective had overwritten it, and a sum-instead-of-mean
    passed."""
    grads = [np.array([1.0, 2, 3], np.float32), np.array([5.0, 6, 7], np.float32)]
    recs = [{"in/w/0": memoryview(g), "out/w": g} for g in grads]
    for g in grads:
        g[:] = [6, 8, 10]  # summed, not averaged
    with pytest.raises(DumpError, match=r"in/w/0: shares memory with out/w"):
        check(spec_of(average=True), recs)


def test_torch_tensor_inputs_sharing_memory_with_a_result_are_refused():
    torch = pytest.importorskip("torch")
    grads = [torch.tensor([1.0, 2, 3]), torch.tensor([5.0, 6, 7])]
    recs = [{"in/w/0": g, "out/w": g} for g in grads]
    for g in grads:  # an in-place all-reduce that summed instead of averaging
        g[:] = torch.tensor([6.0, 8, 10])
    with pytest.raises(DumpError, match=r"in/w/0: shares memory with out/w"):
        check(spec_of(average=True), recs)
    # numpy input, torch result of the same memory
    arrays = [np.array([1.0, 2, 3], np.float32), np.array([5.0, 6, 7], np.float32)]
    recs = [{"in/w/0": a, "out/w": torch.from_numpy(a)} for a in arrays]
    for a in arrays:
        a[:] = [6, 8, 10]
    with pytest.raises(DumpError, match="shares memory"):
        check(spec_of(average=True), recs)
    # copies pass (and a wrong mean still fails)
    xs = [torch.tensor([1.0, 2, 3]), torch.tensor([5.0, 6, 7])]
    good = [{"in/w/0": x.clone(), "out/w": (xs[0] + xs[1]) / 2} for x in xs]
    assert check(spec_of(average=True), good).ok
    bad = [{"in/w/0": x.clone(), "out/w": xs[0] + xs[1]} for x in xs]
    assert not check(spec_of(average=True), bad).ok


@pytest.mark.parametrize("k", ["\u00b2", "1" * 5000])
def test_a_micro_step_key_of_odd_digits_is_one_line(tmp_path, capsys, k):
    """``in/w/²`` ('²'.isdigit() is True, int('²') raises) and a 5000-digit micro-step
    (int() refuses more than 4300 digits) crashed the check with a ValueError traceback,
    exit 1 (the FAIL code), instead of bad input (exit 2, one line)."""
    from mpifusion.tools.cli import main

    x = np.ones(3, np.float32)
    recs = [{"in/w/0": x, f"in/w/{k}": x, "out/w": 2 * x}] * 2
    with pytest.raises(DumpError, match=r"in/w/.*micro-step"):
        check(spec_of(), recs)
    for r in range(2):
        np.savez(tmp_path / f"rank{r}.npz", **recs[r])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_of()))
    assert main(["check", "--spec", str(spec), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "micro-step" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_rank_file_named_with_non_ascii_digits_is_not_a_rank(tmp_path):
    """``rank1\u0663.npz`` matched the rank pattern (``\\d`` takes any Unicode digit) and was
    read as rank 13: the error named a file ``rank13.npz`` that does not exist."""
    x = np.ones(3, np.float32)
    for r in range(2):
        np.savez(tmp_path / f"rank{r}.npz", **{"in/w/0": x, "out/w": 2 * x})
    np.savez(tmp_path / "rank1\u0663.npz", **{"in/w/0": x, "out/w": 2 * x})
    assert check(spec_of(), str(tmp_path)).ok  # not a rank file: ignored like notes.txt


@pytest.mark.parametrize("act", ["all_reduce", "reduce_scatter"])
def test_an_empty_param_gather_is_not_called_missing(act):
    """A 0-element param's shards (shape (0,), range [0, 0)) were given on every rank, but
    the check said 'shard/e: missing on every rank' and refused a correct dump."""
    spec = {"params": [{"name": "e", "shape": [0], "dtype": "float32"},
                       {"name": "w", "shape": [4], "dtype": "float32"}], "nranks": 2, "act": act}
    full = np.arange(4, dtype=np.float32)
    recs = [{"shard/e": np.zeros(0, np.float32), "param/e": np.zeros(0, np.float32),
             "range/e": np.array([0, 0]), "shard/w": full[2 * r:2 * r + 2], "param/w": full,
             "range/w": np.array([2 * r, 2 * r + 2])} for r in range(2)]
    report = check(spec, recs)
    assert report.ok, report
    # the real param is still checked
    recs[1]["param/w"] = full[::-1].copy()
    assert not check(spec, recs).ok


def test_shards_that_hold_only_padding_are_a_gap_not_missing():
    """Paddle's cut of a 3-element fp32 param over 2 ranks gives rank 1 only padding; a dump
    of rank 1's shard alone was refused as 'missing on every rank' (it is there, and holds
    none of the param: a gap)."""
    spec = {"params": [{"name": "w", "shape": [3], "dtype": "float32"}], "nranks": 2,
            "act": "reduce_scatter"}
    from mpifusion.spec import Spec

    lay = {p.name: b.layout for b in Spec.from_dict(spec).plan(2) for p in b.params}["w"]
    lo, hi = lay.slice_of("w", 1)
    recs = [{}, {"shard/w": np.zeros(hi - lo, np.float32), "param/w": np.ones(3, np.float32)}]
    report = check(spec, recs)
    assert not report.ok and any(c.kind == "gap" for c in report.coverage), report


def test_out_keys_of_a_dump_without_inputs_are_noted_as_not_checked(tmp_path, capsys):
    """A dump with out/, shard/ and param/ but no in/ (a dumper that forgot the inputs):
    the gather was checked and the report said 'PASS: 1 gathered params exact', with no word
    that out/w (here garbage) was never compared: without inputs there is no reference."""
    spec = {"params": [{"name": "w", "shape": [4], "dtype": "float32"}], "nranks": 2}
    full = np.arange(4, dtype=np.float32)
    recs = [{"out/w": np.full(4, 123.0, np.float32), "shard/w": full[2 * r:2 * r + 2],
             "range/w": np.array([2 * r, 2 * r + 2]), "param/w": full} for r in range(2)]
    report = check(spec, recs)
    assert report.ok  # the all-gather is right
    assert any("out/w" in n and "not checked" in n and "in/" in n for n in report.notes), \
        report.notes
    assert "note: not checked" in str(report)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_inputs_not_representable_in_the_grad_dtype_are_refused(dtype):
    """float64 inputs recorded for a lower-precision param: the implementation rounded them
    to its grad dtype and summed those, the reference summed the unrounded ones, and a
    correct result FAILed with a misleading excess. Now a DumpError naming the key, the
    count and the first value; inputs that are values of the grad dtype (stored wider)
    pass, and fp32 inputs of a bf16 param with main grads are fine."""
    import ml_dtypes

    low = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(8) for _ in range(2)]  # float64, not values of `low`
    out = np.mean([x.astype(low).astype(np.float32) for x in xs], axis=0).astype(low)
    raw = (lambda a: a.view(np.uint16)) if dtype == "bfloat16" else (lambda a: a)
    spec = spec_of(dtype, 2, shape=(8,), average=True)
    with pytest.raises(DumpError, match=rf"rank 0 \(in memory\): in/w/0: 8 value\(s\) not representable in "
                                        rf"{dtype}, the grad dtype of the spec \(first at flat "
                                        rf"index 0: {float(xs[0][0])!r}\); expected the grads"):
        check(spec, [{"in/w/0": x, "out/w": raw(out)} for x in xs])
    # the same values rounded first, then stored as float64: accepted and right
    rounded = [x.astype(low).astype(np.float64) for x in xs]
    assert check(spec, [{"in/w/0": x, "out/w": raw(out)} for x in rounded]).ok


def test_fp32_inputs_of_a_bf16_param_with_main_grads_are_accepted():
    """With use_main_grad the grad dtype is float32: float32 inputs of a bfloat16 param are
    values of it (no refusal); a NaN input stays allowed (NaN is a value of every dtype)."""
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(8).astype(np.float32) for _ in range(2)]
    xs[1][3] = np.nan
    out = np.mean(xs, axis=0, dtype=np.float32)
    spec = spec_of("bfloat16", 2, shape=(8,), average=True, use_main_grad=True)
    report = check(spec, [{"in/w/0": x, "out/w": out} for x in xs])
    assert report.ok, report


# ---------------------------------------------------------------- range/ under all_reduce
def _megatron_do(nranks=4, acc=2, seed=3):
    """all_reduce whose result each rank keeps a shard of (Megatron's distributed optimizer):
    ``out/`` is the rank's 1-D piece of the all-reduced grad, ``range/`` where it lies."""
    shapes = {"0.weight": (16, 8), "0.bias": (10,)}
    spec = {"params": [{"name": n, "shape": list(s), "dtype": "float32"}
                       for n, s in shapes.items()],
            "act": "all_reduce", "nranks": nranks, "acc_steps": acc, "average": True}
    grads = rank_grads(nranks, acc, shapes, seed)
    full = fp32_reduction(grads, average=True)
    dumps = []
    for r in range(nranks):
        d = {f"in/{n}/{k}": x for n, xs in grads[r].items() for k, x in enumerate(xs)}
        for n, x in full.items():
            flat = x.reshape(-1)
            b, e = r * flat.size // nranks, (r + 1) * flat.size // nranks
            d[f"out/{n}"], d[f"range/{n}"] = flat[b:e].copy(), np.array([b, e])
        dumps.append(d)
    return spec, dumps


def test_range_under_all_reduce_checks_each_rank_piece():
    spec, dumps = _megatron_do()
    report = assert_matches_reference(spec, dumps)
    assert [s.compared for s in report.stats] == [128, 10]
    assert report.ranged == ["0.weight", "0.bias"]
    assert "(full gradient, or the range/ of it a rank holds)" in report.lines()[0]
    # a wrong element on rank 1's piece: named, on rank 1
    dumps[1]["out/0.weight"][3] += 1
    report = check(spec, dumps)
    assert report.failing == ["0.weight"] and report.wrong_ranks("0.weight") == [1]
    # a rank that keeps no piece: its elements are a gap (a failure), not a shape error
    spec, dumps = _megatron_do()
    del dumps[3]["out/0.weight"], dumps[3]["range/0.weight"]
    report = check(spec, dumps)
    assert not report.ok and "0.weight: out/ gap [96, 128) held by no rank" in str(report)
    # a full out/ next to other ranks' range/: every rank holding a piece names it
    spec, dumps = _megatron_do()
    del dumps[2]["range/0.bias"]
    with pytest.raises(DumpError, match=r"rank 2 \(in memory\): range/0.bias: missing"):
        check(spec, dumps)


def test_range_under_reduce_is_refused_in_one_line():
    spec, dumps = _megatron_do()
    spec.update(act="reduce", dst=0)
    with pytest.raises(DumpError) as exc:
        check(spec, dumps)
    assert str(exc.value) == (
        "rank 0 (in memory): range/0.weight: counts for out/ under act reduce_scatter or "
        "all_reduce (a rank's piece of the reduced gradient), not reduce, whose root holds the "
        "whole: give out/0.weight shaped [16, 8] and no range/0.weight")
