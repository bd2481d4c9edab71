"""``mpifusion bench``: bad arguments give one line and exit 2 on every rank (no traceback),
sweeps follow the model, only the targets that apply are shown, files go to ``--out``; and
``run`` and ``bench`` share one definition of algbw/busbw (tools.bandwidth)."""
from __future__ import annotations

import json
import math

import pytest

from mpifusion.tools.bandwidth import algbw, bus_factor, busbw, fmt_gbps

from tests.helpers import mpiexec

FAST = ["--iters", "1", "--warmup", "0", "--no-torch", "--strategies", "thread"]


@pytest.mark.parametrize("n, argv, needle", [
    (2, ["--preset", "nosuch"], "mpifusion bench: error: unknown preset 'nosuch'"),
    (2, ["--dtype", "fp8"], "mpifusion bench: error: --dtype: unknown dtype \"fp8\""),
    (3, ["--size-sweep", "12:9:2"], "mpifusion bench: error: --size-sweep: expected"),
    (2, ["--group-sweep", "16,-1"], "mpifusion bench: error: --group-sweep: expected"),
    (2, ["--strategies", "fast"], "mpifusion bench: error: --strategies: expected"),
    (2, ["--iters", "0"], "--iters: expected an integer >= 1, got '0'"),
])
def test_bad_arguments_one_line_exit_2(n, argv, needle):
    proc = mpiexec(n, "bench", *argv, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count(needle) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "#" not in proc.stdout


def test_unwritable_out_exits_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = mpiexec(2, "bench", "--preset", "tiny", "--out", str(blocker / "sub"), *FAST,
                   timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("mpifusion bench: error: --out: cannot create") == 1
    assert "Traceback" not in proc.stderr


def test_tiny_model_small_sweeps_applicable_targets_files_in_out(tmp_path):
    out_dir = tmp_path / "results"
    proc = mpiexec(2, "bench", "--preset", "tiny", "--out", str(out_dir), *FAST[:-1],
                   "thread,shm", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(p.name for p in out_dir.iterdir())
    assert files[0] == "bench_tiny_n2.json", files
    res = json.loads((out_dir / "bench_tiny_n2.json").read_text())
    nbytes = res["meta"]["grad_bytes"]
    # tiny's grads: 11 odd-sized fp32 tensors, each padded to 256 bytes (independent count)
    assert nbytes < 1 << 17
    sizes = [row["bytes"] for row in res["size_sweep"]]
    assert sizes[0] == 4096 and sizes[-1] == 1 << math.ceil(math.log2(nbytes))
    # shm on a plain array (staged) and on one in its window, as a buffer's storage is
    assert all({"mpifusion_shm", "mpifusion_shm_in_window"} <= set(row)
               and "mpifusion_thread_in_window" not in row for row in res["size_sweep"])
    groups = [row["group_mib"] for row in res["group_sweep"]]
    assert groups[0] == 0 and groups[-1] * (1 << 20) >= nbytes > groups[-2] * (1 << 20)
    # bandwidth-bound targets are not shown for 0.08 MB of grads, add_grad's is
    shown = proc.stdout.split("## targets")[1]
    assert "add_grad per param" in shown and "raw collective" not in shown
    assert "target(s) not shown" in proc.stdout
    assert all(not t["applies"] for t in res["targets"] if "raw collective" in t["what"])
    # every strategy beside the memcpy floor (same rounds), the half step too
    side = proc.stdout.split("## strategies side by side")[1].split("\n## ")[0]
    header = next(line for line in side.splitlines() if line.startswith("| step"))
    assert "x memcpy" in header and "x floor+scale" in header
    for row in ("| ALL_REDUCE [thread]", "| ALL_REDUCE [shm]", "| ALL_REDUCE bfloat16 [shm]",
                "| memcpy floor", "| floor + scale: Allreduce"):
        assert row in side, side
    assert res["memcpy"]["bytes"] == nbytes and len(res["memcpy"]["times_s"]) == 1
    assert nbytes // 2 <= res["half_step"]["bytes"] < 0.55 * nbytes  # padding per param
    assert res["skipped_strategies"] == {}
    assert [r["bytes"] for r in res["small_buffers"]] == [4096, 16384, 65536]
    assert "shm / thread, one 4-64 KiB buffer" in shown
    assert all(not t["applies"] for t in res["targets"] if t["what"].startswith("shm ALL"))
    step = res["steps"]["REDUCE [thread]"]
    want = busbw("reduce", step["bytes"], step["median_s"], 2)
    assert f"| {want:.2f}" in next(line for line in proc.stdout.splitlines()
                                   if line.startswith("| REDUCE [thread]"))


def test_strategies_not_usable_are_skipped_with_their_reason():
    from mpi4py import MPI

    from mpifusion.tools.bench.report import table_side_by_side
    from mpifusion.tools.bench.workload import usable_strategies

    every = ["thread", "nonblocking", "shm", "hierarchical"]
    assert usable_strategies(every, MPI.THREAD_MULTIPLE) == (every, {})
    usable, skipped = usable_strategies(every, MPI.THREAD_SERIALIZED)
    assert usable == ["nonblocking"] and sorted(skipped) == ["hierarchical", "shm", "thread"]
    assert all("MPI_THREAD_MULTIPLE" in why for why in skipped.values())
    one = {"median_s": 2.0, "times_s": [2.0, 4.0]}
    res = {"steps": {"ALL_REDUCE [nonblocking]": dict(one), "REDUCE [nonblocking]": one},
           "memcpy": {"name": "memcpy floor", "median_s": 1.0, "times_s": [1.0, 1.0]},
           "floor_with_scale": {"name": "floor+scale: Allreduce 4 MiB segments",
                                "median_s": 4.0, "times_s": [4.0, 4.0]},
           "skipped_strategies": skipped}
    title, header, rows = table_side_by_side(res)
    assert header == ["step", "median ms", "x memcpy", "x floor+scale", "note"]
    assert rows[0][2:4] == ["3.00", "0.75"]  # per-round ratios, median of 2 and 4 / 1 and .5
    assert [r[0] for r in rows[1:3]] == ["memcpy floor", "floor + scale: Allreduce 4 MiB "
                                         "segments"]
    assert [r[0] for r in rows[3:]] == [f"ALL_REDUCE [{s}]" for s in skipped]
    assert all(r[-1].startswith("skipped: needs MPI_THREAD_MULTIPLE") for r in rows[3:])


def test_shm_targets_from_one_run():
    from mpifusion.tools.bench.targets import shm_targets

    def t(*times):
        return {"median_s": sorted(times)[len(times) // 2], "times_s": list(times)}
    res = {"steps": {"ALL_REDUCE [shm]": t(1.0, 1.2, 1.1)},
           "floor_with_scale": t(2.0, 2.0, 2.0), "memcpy": t(1.0, 1.0, 1.0),
           "half_step": dict(t(0.5, 0.6, 0.9), strategy="shm", dtype="bfloat16"),
           "small_buffers": [{"bytes": 4096, "shm": {"x_thread": 0.9}},
                             {"bytes": 65536, "shm": {"x_thread": 1.1}}]}
    got = {x.what: (round(x.value, 3), x.target, x.met) for x in shm_targets(res, True)}
    assert got == {
        "shm ALL_REDUCE step / (best raw Allreduce + 1/n)": (0.55, "<= 0.75", True),
        "shm ALL_REDUCE step / memcpy of the grads": (1.1, "<= 1.25", True),
        "shm ALL_REDUCE step, bfloat16 / float32": (0.5, "<= 0.75", True),
        "shm / thread, one 4-64 KiB buffer (the slowest size)": (1.1, "<= 1.0", False)}
    res["steps"]["ALL_REDUCE [shm]"]["fallback"] = "ran thread: spans nodes"
    assert shm_targets(res, True) == []  # a fallen-back shm is thread: no shm targets


def test_step_rows_take_their_collectives_factor():
    from mpifusion.tools.bench.report import step_kind as _kind

    assert _kind("ALL_REDUCE [thread]") == "all_reduce"
    assert _kind("REDUCE [nonblocking]") == "reduce"
    assert _kind("REDUCE_SCATTER + sync_params [thread]") == "reduce_scatter+allgather"
    assert _kind("torch 2.13 gloo all_reduce (one call)") == "all_reduce"


def test_auto_sweeps_follow_the_model():
    from mpifusion.tools.bench import auto_group_sweep, auto_size_sweep

    mib = 1 << 20
    assert auto_size_sweep(498 * 10 ** 6) == [1 << e for e in range(12, 29, 2)]  # capped
    assert auto_size_sweep(79104) == [4096, 16384, 65536, 131072]
    assert auto_size_sweep(100) == [4096]
    assert auto_group_sweep(498 * 10 ** 6) == [0, 16, 64, 256, 1024]
    assert auto_group_sweep(79104) == [0, 1 / 64, 1 / 16, 1 / 4]
    assert auto_group_sweep(3 * mib) == [0, 1 / 16, 1 / 4, 1, 4]


def test_bandwidth_one_definition():
    # nccl-tests: algbw = bytes / s; busbw factors all-reduce 2(n-1)/n, reduce 1,
    # reduce-scatter / all-gather (n-1)/n; nothing crosses a link with one rank
    assert algbw(3 * 10 ** 9, 2.0) == 1.5
    assert busbw("all_reduce", 4 * 10 ** 9, 1.0, 4) == 4 * 2 * 3 / 4
    assert busbw("reduce", 10 ** 9, 1.0, 8) == 1.0
    assert busbw("reduce_scatter", 10 ** 9, 1.0, 3) == pytest.approx(2 / 3)
    assert busbw("allgather", 10 ** 9, 1.0, 3) == pytest.approx(2 / 3)
    assert bus_factor("allreduce", 2) == bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
    # no time, no bandwidth: both tools print "-" and store null
    assert algbw(100, 0.0) is None and busbw("reduce", 100, 0.0, 2) is None
    assert fmt_gbps(None) == "-" and fmt_gbps(1.23456, 2) == "1.23"
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("broadcast", 2)


def test_run_and_bench_use_the_shared_definition():
    import mpifusion.tools.bench.measure as bench
    import mpifusion.tools.runjob as runjob

    assert runjob.bus_factor is bus_factor and runjob.algbw is algbw
    assert bench.busbw is busbw and bench.algbw is algbw
    assert not hasattr(runjob, "BUS_FACTOR") and not hasattr(bench, "_gbps")


def test_ranks_with_different_tune_files_agree_on_the_default_segment(tmp_path):
    """Mixed nodes: one rank's tune file says 1 MiB, the other has none (the L2 rule). bench
    timed its raw candidates at each rank's own default, so the ranks ran different
    collectives and the job hung; they now take the smallest, as the buffers' agreement
    check does, and the report records it."""
    import sys

    from mpifusion.machine import machine_key

    from tests.helpers import mpiexec_path, run_cmd

    tuned, empty = tmp_path / "tuned.json", tmp_path / "empty.json"
    tuned.write_text(json.dumps({"version": 1,
                                 "machines": {machine_key(): {"segment_bytes": 1 << 20}}}))
    empty.write_text(json.dumps({"version": 1, "machines": {}}))
    out_dir = tmp_path / "out"
    job = [sys.executable, "-m", "mpifusion", "bench", "--preset", "tiny", "--out",
           str(out_dir), *FAST]
    proc = run_cmd([mpiexec_path(), "-n", "1", "env", f"MPIFUSION_TUNE_FILE={tuned}", *job,
                    ":", "-n", "1", "env", f"MPIFUSION_TUNE_FILE={empty}", *job],
                   timeout=120, hang_ok=True)
    assert proc.returncode == 0, (proc.stdout or "") + (proc.stderr or "")
    res = json.loads((out_dir / "bench_tiny_n2.json").read_text())
    assert res["meta"]["default_segment_bytes"] == 1 << 20
