"""``mpifusion info``, ``bench`` dispatch, ``python -m mpifusion`` and usage errors."""
from __future__ import annotations

import json
import sys

import mpi4py
import numpy as np
import pytest

from mpifusion.tools.cli import byte_size

from tests.helpers import run_cli, run_cmd


def test_info_json(capsys):
    code, out, _ = run_cli(capsys, "info", "--json")
    info = json.loads(out)
    assert code == 0
    assert info["mpi4py"] == mpi4py.__version__ and info["numpy"] == np.__version__
    assert info["thread_level"] in ("single", "funneled", "serialized", "multiple")
    assert isinstance(info["cuda_aware_mpi"], bool) and info["world_size"] >= 1
    assert info["mpi_library"] and info["mpi_standard"].count(".") == 1
    # one rank: one node, named as MPI names it
    assert info["nodes"] == [{"name": info["processor"], "ranks": [0]}], info
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and "MPI library:" in out and "CUDA-aware MPI:" in out
    assert f"nodes:          1 ({info['processor']}: rank 0)\n" in out, out


def test_info_nodes_line_names_every_node_and_its_ranks():
    """Ranks as ranges in rank order (nodes need not hold consecutive ranks), and past
    NODES_SHOWN nodes a count of the rest instead of an endless line."""
    from mpifusion.tools.cli import NODES_SHOWN, nodes_line

    assert nodes_line([{"name": "a", "ranks": [0, 1]}, {"name": "b", "ranks": [2, 3]}]) == \
        "2 (a: ranks 0-1, b: ranks 2-3)"
    assert nodes_line([{"name": "a", "ranks": [0, 2, 3, 4, 7]}, {"name": "b", "ranks": [1]},
                       {"name": "c", "ranks": [5, 6]}]) == \
        "3 (a: ranks 0, 2-4, 7, b: rank 1, c: ranks 5-6)"
    many = [{"name": f"n{i}", "ranks": [i]} for i in range(NODES_SHOWN + 3)]
    line = nodes_line(many)
    assert line.startswith(f"{NODES_SHOWN + 3} (n0: rank 0, n1: rank 1, "), line
    assert line.endswith(f", n{NODES_SHOWN - 1}: rank {NODES_SHOWN - 1}, ... (3 more))"), line


def test_info_says_the_default_segment_size_and_where_it_comes_from(capsys, monkeypatch,
                                                                    tmp_path):
    """Mixed nodes take the smallest segment over ranks: info shows each rank's and why."""
    from mpifusion.machine import machine_key, segment_rule

    monkeypatch.delenv("MPIFUSION_SEGMENT_BYTES", raising=False)
    tune = tmp_path / "tune.json"
    monkeypatch.setenv("MPIFUSION_TUNE_FILE", str(tune))
    info = json.loads(run_cli(capsys, "info", "--json")[1])
    assert info["segment_bytes"] == segment_rule()
    assert info["segment_source"].startswith(("L2 rule", "fallback")), info
    tune.write_text(json.dumps({"version": 1,
                                "machines": {machine_key(): {"segment_bytes": 3 << 20}}}))
    info = json.loads(run_cli(capsys, "info", "--json")[1])
    assert info["segment_bytes"] == 3 << 20 and str(tune) in info["segment_source"]
    monkeypatch.setenv("MPIFUSION_SEGMENT_BYTES", "65536")
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and "segment size:   65536 bytes (MPIFUSION_SEGMENT_BYTES)" in out
    monkeypatch.setenv("MPIFUSION_SEGMENT_BYTES", "4M")
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and "segment size:   refused: MPIFUSION_SEGMENT_BYTES" in out


def test_info_says_the_strategy_and_why(capsys, monkeypatch):
    """The strategy a default buffer uses, where the choice came from, and a refused one."""
    monkeypatch.delenv("MPIFUSION_COMM_STRATEGY", raising=False)
    info = json.loads(run_cli(capsys, "info", "--json")[1])
    assert (info["strategy"], info["strategy_source"]) == ("thread", "auto: one rank"), info
    monkeypatch.setenv("MPIFUSION_COMM_STRATEGY", "shm")
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and "strategy:       shm (chosen (strategy= or " in out, out
    assert "shared memory:  1 of 1 rank(s) on this node (shm can run)" in out, out
    monkeypatch.setenv("MPIFUSION_COMM_STRATEGY", "fast")
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and "strategy:       none (refused: MPIFUSION_COMM_STRATEGY" in out, out


@pytest.mark.mpi
def test_info_under_mpiexec_rank0_prints_world_size(comm, capsys):
    code, out, _ = run_cli(capsys, "info", "--json")
    assert code == 0
    if comm.Get_rank() == 0:
        info = json.loads(out)
        assert info["world_size"] == comm.Get_size()
        assert info["ranks_on_node"] == comm.Get_size()  # one machine: every rank
        assert info["nodes"] == [{"name": info["processor"],
                                  "ranks": list(range(comm.Get_size()))}], info
        assert info["strategy"] == ("shm" if comm.Get_size() > 1 else "thread"), info
    else:
        assert out == ""


def _good_dump(folder) -> list:
    """``check`` arguments for a 2-rank all-reduce dump that passes: the check reads and
    compares everything, as far as any run of it goes."""
    folder.mkdir()
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"params": [{"name": "w", "shape": [3], "dtype": "float32"}],
                                "act": "all_reduce", "nranks": 2}))
    ins = [np.array([1.0, 2.0, 3.0], np.float32), np.array([0.5, 0.25, -1.0], np.float32)]
    out = ins[0] + ins[1]  # the spec asks for the sum (no "average")
    for r, x in enumerate(ins):
        np.savez(folder / f"rank{r}.npz", **{"in/w/0": x, "out/w": out})
    return ["check", "--spec", str(spec), str(folder)]


@pytest.mark.parametrize("argv, expect", [
    (["layout", "--preset", "gpt2-small"], "no MPI 0"),
    (["layout", "--preset", "tiny", "--act", "reduce_scatter", "--nranks", "3", "--json"],
     "no MPI 0"),
    ("check", "no MPI 0"),
    (["info"], "MPI imported 0"),  # the probe sees MPI where a command does load it
], ids=["layout", "layout-json", "check", "info"])
def test_layout_and_check_never_initialise_mpi(argv, expect, tmp_path):
    """Planning and checking run anywhere: they must not even import mpi4py.MPI, also when
    a check goes all the way (reads every rank's dump, compares, says PASS)."""
    if argv == "check":
        argv = _good_dump(tmp_path / "dump")
    code = ("import sys\nfrom mpifusion.tools.cli import main\nrc = main(sys.argv[1:])\n"
            "print('MPI imported' if 'mpi4py.MPI' in sys.modules else 'no MPI', rc)")
    proc = run_cmd([sys.executable, "-c", code, *argv], timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == expect, proc.stdout[-500:] + proc.stderr[-500:]
    if argv[0] == "check":
        assert "PASS" in proc.stdout, proc.stdout[-500:]


def test_bench_dispatches_arguments(capsys, monkeypatch):
    seen = []
    fake = type(sys)("mpifusion.tools.bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "mpifusion.tools.bench", fake)
    assert run_cli(capsys, "bench", "--quick", "-n", "3")[0] == 0
    assert seen == [["--quick", "-n", "3"]]


def test_python_dash_m_and_usage_errors():
    proc = run_cmd([sys.executable, "-m", "mpifusion", "layout", "--nranks", "0"], timeout=120)
    assert proc.returncode == 2 and "--nranks: expected an integer >= 1" in proc.stderr
    proc = run_cmd([sys.executable, "-m", "mpifusion", "--help"], timeout=120)
    assert proc.returncode == 0 and "layout" in proc.stdout and "check" in proc.stdout


@pytest.mark.parametrize("text, value", [("268435456", 268435456), ("256M", 256 << 20),
                                         ("256MiB", 256 << 20), ("1g", 1 << 30), ("0", 0)])
def test_byte_size(text, value):
    assert byte_size(text) == value
