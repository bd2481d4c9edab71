"""``mpifusion layout``: the printed plan is what the core builds."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mpifusion import Param, assign_group_by_size, fused_parameters
from mpifusion.plan.layout import plan_sharded
from mpifusion.presets import get_preset

from tests.helpers import run_cli

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
