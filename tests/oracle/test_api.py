"""``mpifusion.oracle.check`` as a library: in-memory and file dumps, any shard layout given by
``range/{name}`` (FSDP2 dim-0, ZeRO flat partitions, Megatron buffer shards), gaps and
overlaps, the param all-gather, REDUCE off the root, the report and the pytest helpers.

References are independent: fp32 numpy sums computed here, cut by layouts computed here."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from mpifusion.errors import FusionError, OracleMismatch
from mpifusion.oracle import (DumpError, assert_matches_reference, check)

SHAPES = {"emb": (37, 5), "w": (7, 3), "b": (13,), "odd": (3, 1, 11)}


def _spec(nranks, act="reduce_scatter", acc=1, average=True, dtype="float32", **kw):
    return {"params": [{"name": n, "shape": list(s), "dtype": dtype} for n, s in SHAPES.items()],
            "act": act, "nranks": nranks, "acc_steps": acc, "average": average, **kw}


def _grads(nranks, acc, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [{n: [rng.standard_normal(s).astype(dtype) for _ in range(acc)]
             for n, s in SHAPES.items()} for _ in range(nranks)]


def _fp32_result(grads, average):
    """A correct fp32 implementation: local accumulation, cross-rank sum, then 1/n."""
    out = {}
    for n in SHAPES:
        local = [sum(g[n][1:], start=g[n][0].astype(np.float32).copy()) for g in grads]
        total = local[0].copy()
        for x in local[1:]:
            total += x
        if average:
            total *= np.float32(1.0 / len(grads))
        out[n] = total
    return out


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
    result = _fp32_result(grads, average=True)
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
    result = _fp32_result(grads, average=False)
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
    result = _fp32_result(grads, average=True)
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
    result = _fp32_result(grads, average=True)
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
    result = _fp32_result(grads, average=True)
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
    result = _fp32_result(grads, average=True)
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
    dropped = _fp32_result([{n: xs[:acc] for n, xs in g.items()} for g in grads], True)
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
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(test)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "FAIL: 1 param(s) beyond the bound: w" in proc.stdout


def test_range_dumps_from_files_and_the_cli(tmp_path, capsys):
    from tests.helpers import run_cli

    nranks = 3
    grads = _grads(nranks, 1, seed=8)
    result = _fp32_result(grads, average=True)
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
    result = _fp32_result(grads, average=True)
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
    result = _fp32_result(grads, average=False)
    spec = _spec(3, act="all_reduce", average=False)
    del spec["nranks"]
    records = ({**_inputs(g), **{f"out/{n}": result[n] for n in SHAPES}} for g in grads)
    report = check(spec, records)  # a generator of records works too
    assert report.ok and report.spec.nranks == 3 and "3 rank(s)" in str(report)
