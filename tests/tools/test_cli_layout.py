"""``mpifusion layout``: the printed plan is what the core builds, and hostile spec files
(FIFOs, deep JSON, a billion ranks) are one line and exit 2 at once."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from mpifusion import Param, assign_group_by_size, fused_parameters
from mpifusion.plan.layout import plan_sharded
from mpifusion.presets import get_preset

from tests.helpers import one_line_error, run_cli, run_cmd

MiB = 1024 * 1024


def _lazy_params(preset: str) -> list:
    """Params without memory (broadcast zeros): layouts need shapes and dtypes only."""
    return [Param(p["name"], np.broadcast_to(np.float32(0), tuple(p["shape"])))
            for p in get_preset(preset)]


def test_gpt2_reduce_scatter_json_matches_core(capsys):
    code, out, _ = run_cli(capsys, "layout", "--preset", "gpt2-small", "--act",
                           "reduce_scatter", "--nranks", "8", "--json")
    assert code == 0
    doc = json.loads(out)
    assert (doc["act"], doc["nranks"], doc["group_size"], doc["alignment_bytes"]) == \
        ("reduce_scatter", 8, 256 * MiB, 256)
    groups = list(assign_group_by_size(_lazy_params("gpt2-small"), 256 * MiB).values())
    assert len(doc["buffers"]) == len(groups) == 2
    for index, (group, jb) in enumerate(zip(groups, doc["buffers"])):
        layout = plan_sharded(group, 8)
        assert jb["index"] == index and jb["numel"] == layout.numel
        assert (jb["dtype"], jb["grad_dtype"]) == ("float32", "float32")
        assert [p["name"] for p in jb["params"]] == [p.name for p in group]
        shard = layout.numel // 8
        for p, row in zip(group, jb["params"]):
            slot = layout[p.name]
            assert (row["offset"], row["numel"], row["padded_numel"], tuple(row["shape"])) == \
                (slot.offset, p.numel, slot.padded_numel, p.shape)
            assert row["padded_numel"] % (64 * 8) == 0  # fp32: 64 elements x 8 ranks
            # independent: the padded slot cut at multiples of the shard size
            want = []
            for r in range(8):
                b, e = max(slot.offset, r * shard), min(slot.offset + slot.padded_numel,
                                                        (r + 1) * shard)
                want.append([b, e] if b < e else None)
            assert row["slices"] == want


def test_all_reduce_json_has_aligned_padding_and_no_slices(capsys):
    code, out, _ = run_cli(capsys, "layout", "--preset", "tiny-bf16", "--json")
    assert code == 0
    doc = json.loads(out)
    (buf,) = doc["buffers"]
    assert (buf["dtype"], buf["grad_dtype"]) == ("bfloat16", "float32")  # main grads
    offset = 0
    for row in buf["params"]:
        assert "slices" not in row
        assert row["offset"] == offset
        assert row["padded_numel"] == -(-row["numel"] // 128) * 128  # 256 bytes of bf16
        offset += row["padded_numel"]
    assert buf["numel"] == offset


def test_spec_file_splits_like_fused_parameters(capsys, tmp_path):
    spec = {"params": [
        {"name": "a", "shape": [10, 3], "dtype": "float32", "decay": True},
        {"name": "b", "shape": [7], "dtype": "float32", "need_clip": False},
        {"name": "c", "shape": [5], "dtype": "float32"},
        {"name": "d", "shape": [4], "dtype": "float32", "is_distributed": True},
        {"name": "frozen", "shape": [4], "dtype": "float32", "trainable": False},
    ], "act": "all_reduce"}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    code, out, _ = run_cli(capsys, "layout", "--spec", str(path), "--json")
    assert code == 0
    doc = json.loads(out)
    # the core, on real params: (fp32, dist, clip) splits, decay first
    params = [Param(p["name"], np.zeros(p["shape"], np.float32),
                    is_distributed=p.get("is_distributed", False),
                    need_clip=p.get("need_clip", True)) for p in spec["params"][:4]]
    _, _, buffers = fused_parameters(params, comm_overlap=True, act="all_reduce",
                                     apply_decay_param_fun=lambda n: n == "a")
    assert [[p["name"] for p in b["params"]] for b in doc["buffers"]] == \
        [[p.name for p in b.params] for b in buffers] == [["d"], ["a"], ["c"], ["b"]]
    assert [b["numel"] for b in doc["buffers"]] == [b.buffer_size for b in buffers]


def test_table_shows_sizes_padding_and_slices(capsys):
    code, out, _ = run_cli(capsys, "layout", "--preset", "tiny", "--act", "reduce_scatter",
                           "--nranks", "4", "--group-size", "16K")
    assert code == 0
    assert "group size 16384 bytes" in out
    assert "buffer 0: reduce_scatter" in out and "padding" in out
    assert "r0[0," in out and "fc1.weight" in out


def test_compare_with_their_layout(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "layout", "--preset", "tiny", "--act", "reduce_scatter",
                           "--nranks", "3", "--json")
    ours = json.loads(out)
    same = tmp_path / "same.json"
    same.write_text(out)
    assert run_cli(capsys, "layout", "--preset", "tiny", "--act", "reduce_scatter",
                   "--nranks", "3", "--layout", str(same))[0] == 0
    theirs = json.loads(out)
    theirs["buffers"][0]["params"][2]["offset"] += 64
    theirs["buffers"][0]["params"][4]["slices"][1] = None
    del theirs["buffers"][0]["params"][6]
    bad = tmp_path / "theirs.json"
    bad.write_text(json.dumps(theirs))
    code, out, _ = run_cli(capsys, "layout", "--preset", "tiny", "--act", "reduce_scatter",
                           "--nranks", "3", "--layout", str(bad))
    assert code == 1
    names = [p["name"] for p in ours["buffers"][0]["params"]]
    assert f"({names[2]}).offset: ours" in out
    assert f"({names[4]}).slices[1]" in out
    assert f"({names[6]}): missing in theirs" in out
    assert out.strip().splitlines()[-1].startswith("FAIL: 3 difference(s)")


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--act", "reduce_scatter"], "nranks: reduce_scatter needs"),
    (["--spec", "/nonexistent/spec.json"], "/nonexistent/spec.json: cannot read"),
    (["--layout", "/nonexistent/theirs.json"], "/nonexistent/theirs.json: cannot read"),
    # before: --dst -1 quietly meant rank 0
    (["--act", "reduce", "--dst", "-1"], "--dst: expected a rank >= 0, got -1"),
    (["--act", "reduce", "--nranks", "4", "--dst", "4"],
     "--dst: expected a rank in [0, 4) (--nranks 4), got 4"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, needle):
    code, out, err = run_cli(capsys, "layout", *argv)
    assert code == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1


def test_malformed_spec_names_file_and_field(capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"params": [{"name": "w", "shape": [2, -1], "dtype": "fp32"}]}))
    code, _, err = run_cli(capsys, "layout", "--spec", str(path))
    assert code == 2
    assert f"{path}: params[0].shape" in err


@pytest.mark.mpi
def test_layout_json_matches_buffers_built_under_mpi(comm, capsys):
    """Under mpiexec: the plan for this world size equals what fused_parameters allocates,
    and only rank 0 prints it."""
    n, rank = comm.Get_size(), comm.Get_rank()
    params = [Param(p["name"], np.zeros(p["shape"], np.float32)) for p in get_preset("tiny")]
    _, _, buffers = fused_parameters(params, fuse_param=False, comm_overlap=True,
                                     comm_group=comm, act="reduce_scatter",
                                     group_size=16 * 1024)
    code, out, _ = run_cli(capsys, "layout", "--preset", "tiny", "--act", "reduce_scatter",
                           "--nranks", str(n), "--group-size", "16K", "--json")
    assert code == 0
    if rank != 0:
        assert out == ""
    doc = json.loads(comm.bcast(out if rank == 0 else None, root=0))
    assert len(doc["buffers"]) == len(buffers) > 1
    for jb, buf in zip(doc["buffers"], buffers):
        assert jb["numel"] == buf.buffer_size
        assert [row["name"] for row in jb["params"]] == [p.name for p in buf.params]
        for row, p in zip(jb["params"], buf.params):
            assert row["offset"] == buf.layout[p.name].offset
            piece = buf.layout.slice_of(p.name, rank)
            assert row["slices"][rank] == (list(piece) if piece else None)


def _ours(capsys, *argv: str) -> dict:
    code, out, _ = run_cli(capsys, "layout", *argv, "--json")
    assert code == 0
    return json.loads(out)


def _compare(capsys, tmp_path, theirs, *argv: str, text: bool = False) -> tuple:
    path = tmp_path / "theirs.json"
    path.write_text(theirs if text else json.dumps(theirs))
    code, out, err = run_cli(capsys, "layout", *argv, "--layout", str(path))
    return code, out, err, str(path)


def _index(doc: dict, name: str) -> tuple:
    for i, b in enumerate(doc["buffers"]):
        for j, p in enumerate(b["params"]):
            if p["name"] == name:
                return i, j
    raise KeyError(name)


def test_duplicate_name_inserted_before_the_real_one_fails(capsys, tmp_path):
    """A second fc1.bias at another offset ahead of the real one: it used to win the name
    map and the comparison said PASS."""
    theirs = _ours(capsys)
    params = theirs["buffers"][0]["params"]
    j = [p["name"] for p in params].index("fc1.bias")
    params.insert(j, dict(params[j], offset=params[j]["offset"] + 64))
    code, out, err, path = _compare(capsys, tmp_path, theirs)
    assert code == 1 and err == "", out + err
    assert (f"duplicate param name fc1.bias in theirs (buffers[0].params[{j}] and "
            f"buffers[0].params[{j + 1}])") in out.splitlines()
    assert "PASS" not in out
    assert out.strip().splitlines()[-1].startswith("FAIL: ")


def test_duplicate_name_appended_at_the_end_is_a_duplicate_not_an_order_change(capsys,
                                                                               tmp_path):
    theirs = _ours(capsys)
    params = theirs["buffers"][0]["params"]
    j = [p["name"] for p in params].index("fc1.bias")
    params.append(dict(params[j]))  # an exact copy: nothing else differs
    code, out, _, path = _compare(capsys, tmp_path, theirs)
    assert code == 1
    assert out.strip().splitlines() == [
        f"duplicate param name fc1.bias in theirs (buffers[0].params[{j}] and "
        f"buffers[0].params[{len(params) - 1}])",
        f"FAIL: 1 difference(s) from {path}"]


def test_duplicate_name_in_another_buffer_is_named_with_both_places(capsys, tmp_path):
    theirs = _ours(capsys, "--group-size", "16K")
    assert len(theirs["buffers"]) > 2
    i, j = _index(theirs, "fc1.bias")
    last = theirs["buffers"][-1]["params"]
    last.append(dict(theirs["buffers"][i]["params"][j]))
    code, out, _, _ = _compare(capsys, tmp_path, theirs, "--group-size", "16K")
    assert code == 1
    k = len(theirs["buffers"]) - 1
    assert (f"duplicate param name fc1.bias in theirs (buffers[{i}].params[{j}] and "
            f"buffers[{k}].params[{len(last) - 1}])") in out.splitlines()


def test_duplicates_on_our_side_are_reported_too():
    from mpifusion.tools.render import compare_layouts

    ours = {"buffers": [{"params": [{"name": "a", "offset": 0}, {"name": "a", "offset": 64}]},
                        {"params": [{"name": "b", "offset": 0}]}]}
    theirs = {"buffers": [{"params": [{"name": "a", "offset": 0}]},
                          {"params": [{"name": "b", "offset": 0}, {"name": "a", "offset": 0}]}]}
    diffs = compare_layouts(ours, theirs)
    assert "duplicate param name a in ours (buffers[0].params[0] and buffers[0].params[1])" \
        in diffs
    assert "duplicate param name a in theirs (buffers[0].params[0] and buffers[1].params[1])" \
        in diffs


@pytest.mark.parametrize("name, kind", [
    (["fc1.bias"], "list"), ({"n": "fc1.bias"}, "object"), (7, "number 7"), (None, "null"),
    (True, "boolean true"),
])
def test_non_string_name_is_bad_input(capsys, tmp_path, name, kind):
    theirs = _ours(capsys)
    theirs["buffers"][0]["params"][0]["name"] = name
    code, out, err, path = _compare(capsys, tmp_path, theirs)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"mpifusion layout: error: {path}: buffers[0].params[0].name: expected a string, "
        f"got {kind}"]


@pytest.mark.parametrize("edit, where, words", [
    (lambda d: d["buffers"][0]["params"][1].pop("name"), "buffers[0].params[1].name",
     "missing"),
    (lambda d: d["buffers"][0]["params"][1].update(offset="1664"),
     "buffers[0].params[1].offset", 'expected an integer, got string "1664"'),
    (lambda d: d["buffers"][0]["params"][1].update(numel=4369.5),
     "buffers[0].params[1].numel", "expected an integer, got number 4369.5"),
    (lambda d: d["buffers"][0]["params"][1].update(padded_numel=[4416]),
     "buffers[0].params[1].padded_numel", "expected an integer, got list"),
    (lambda d: d["buffers"][0]["params"][1].update(shape=[257, "17"]),
     "buffers[0].params[1].shape[1]", 'expected an integer, got string "17"'),
    (lambda d: d["buffers"][0]["params"][1].update(shape="257x17"),
     "buffers[0].params[1].shape", 'expected a list, got string "257x17"'),
    (lambda d: d["buffers"][0]["params"].__setitem__(1, ["fc1.weight"]),
     "buffers[0].params[1]", "expected an object, got list"),
    (lambda d: d["buffers"][0].update(params={"fc1.weight": {}}),
     "buffers[0].params", "expected a list, got object"),
    (lambda d: d["buffers"][0].update(numel=None), "buffers[0].numel",
     "expected an integer, got null"),
    (lambda d: d["buffers"][0].update(dtype=32), "buffers[0].dtype",
     "expected a string, got number 32"),
    (lambda d: d.update(buffers={"0": {}}), "buffers", "expected a list, got object"),
    (lambda d: d["buffers"].append(7), "buffers[1]", "expected an object, got number 7"),
    (lambda d: d.update(group_size="256M"), "group_size", 'expected an integer, got string'),
    (lambda d: d.update(nranks="all"), "nranks", "expected an integer or null, got string"),
    (lambda d: d.update(act=None), "act", "expected a string, got null"),
])
def test_malformed_field_of_theirs_is_bad_input(capsys, tmp_path, edit, where, words):
    theirs = _ours(capsys)
    edit(theirs)
    code, out, err, path = _compare(capsys, tmp_path, theirs)
    assert code == 2 and out == "" and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"mpifusion layout: error: {path}: {where}: {words}"), line


@pytest.mark.parametrize("edit, where, words", [
    (lambda p: p.update(slices="r0"), "slices", "expected a list, got string"),
    (lambda p: p["slices"].__setitem__(1, [0, 64, 128]), "slices[1]",
     "expected null or [begin, end], got list"),
    (lambda p: p["slices"].__setitem__(0, [0, None]), "slices[0][1]",
     "expected an integer, got null"),
])
def test_malformed_slices_of_theirs_are_bad_input(capsys, tmp_path, edit, where, words):
    argv = ("--act", "reduce_scatter", "--nranks", "3")
    theirs = _ours(capsys, *argv)
    edit(theirs["buffers"][0]["params"][0])
    code, out, err, path = _compare(capsys, tmp_path, theirs, *argv)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"mpifusion layout: error: {path}: buffers[0].params[0].{where}: "
                           f"{words}"), line


@pytest.mark.parametrize("text, words", [
    ('{"buffers": [{"params": [{"name": "a", "name": "b"}]}]}', 'duplicate key "name"'),
    ('{"buffers": [], "nranks": NaN}', "NaN is not allowed"),
])
def test_ambiguous_json_in_theirs_is_bad_input(capsys, tmp_path, text, words):
    code, out, err, path = _compare(capsys, tmp_path, text, text=True)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"mpifusion layout: error: {path}: ") and words in line, line


def test_integral_floats_and_extra_fields_are_still_compared_not_refused(capsys, tmp_path):
    theirs = _ours(capsys)
    theirs["buffers"][0]["params"][1]["offset"] = 1664.0  # equal as a number
    theirs["buffers"][0]["params"][1]["note"] = "extra"
    code, out, _, _ = _compare(capsys, tmp_path, theirs)
    assert code == 1
    assert out.strip().splitlines()[:-1] == [
        'buffers[0].params[1](fc1.weight).note: not in ours (theirs "extra")']


def test_non_string_name_under_mpiexec_is_one_line_and_exit_2(tmp_path):
    import sys

    from tests.helpers import run_job

    theirs = {"act": "all_reduce", "buffers": [{"params": [{"name": ["fc1.bias"]}]}]}
    path = tmp_path / "theirs.json"
    path.write_text(json.dumps(theirs))
    res = run_job(2, [sys.executable, "-m", "mpifusion", "layout", "--layout", str(path)],
                  timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout == "" and "Traceback" not in res.stderr
    assert [line for line in res.stderr.splitlines() if line.strip()] == [
        f"mpifusion layout: error: {path}: buffers[0].params[0].name: expected a string, "
        f"got list"]


# ------------------------------------------------------------------------------ hostile spec files


def test_layout_spec_fifo_does_not_block(tmp_path):
    os.mkfifo(tmp_path / "spec.json")
    res = run_cmd([sys.executable, "-m", "mpifusion", "layout", "--spec",
                   str(tmp_path / "spec.json")], timeout=60)
    assert res.returncode == 2 and "not a regular file (a FIFO)" in res.stderr


@pytest.mark.parametrize("text, words", [
    ('{"params": [{"name": "w", "shape": [' + "9" * 5000 + '], "dtype": "fp32"}]}',
     "5000 digits"),
    ("[" * 100000 + "]" * 100000, "nested 100000 deep"),
])
def test_layout_hostile_json_exits_2(capsys, tmp_path, text, words):
    path = tmp_path / "hostile.json"
    path.write_text(text)
    code, _, err = run_cli(capsys, "layout", "--spec", str(path))
    assert code == 2 and words in one_line_error(err, "layout")
    code, _, err = run_cli(capsys, "layout", "--layout", str(path))
    assert code == 2 and words in one_line_error(err, "layout")


def test_layout_with_a_billion_ranks_is_refused_at_once(capsys):
    code, _, err = run_cli(capsys, "layout", "--act", "reduce_scatter", "--nranks",
                           "1000000000")
    line = one_line_error(err, "layout")
    assert code == 2 and "nranks 1000000000" in line and "at most" in line
