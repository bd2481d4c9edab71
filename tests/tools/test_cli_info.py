"""``mpifusion info``, ``bench`` dispatch, ``python -m mpifusion`` and usage errors."""
from __future__ import annotations

import json
import subprocess
import sys

import mpi4py
import numpy as np
import pytest

from mpifusion.tools.cli import byte_size

from tests.helpers import run_cli


def test_info_json(capsys):
    code, out, _ = run_cli(capsys, "info", "--json")
    info = json.loads(out)
    assert code == 0
    assert info["mpi4py"] == mpi4py.__version__ and info["numpy"] == np.__version__
    assert info["thread_level"] in ("single", "funneled", "serialized", "multiple")
    assert isinstance(info["cuda_aware_mpi"], bool) and info["world_size"] >= 1
    assert info["mpi_library"] and info["mpi_standard"].count(".") == 1
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and "MPI library:" in out and "CUDA-aware MPI:" in out


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

@pytest.mark.mpi
def test_info_under_mpiexec_rank0_prints_world_size(comm, capsys):
    code, out, _ = run_cli(capsys, "info", "--json")
    assert code == 0
    if comm.Get_rank() == 0:
        assert json.loads(out)["world_size"] == comm.Get_size()
    else:
        assert out == ""


@pytest.mark.parametrize("argv", [["layout", "--preset", "gpt2-small"],
                                  ["layout", "--preset", "tiny", "--act", "reduce_scatter",
                                   "--nranks", "3", "--json"],
                                  ["check", "--spec", "nosuch.json", "nosuch_dir"]])
def test_layout_and_check_never_initialise_mpi(argv):
    """Planning and checking run anywhere: they must not even import mpi4py.MPI."""
    code = ("import sys\nfrom mpifusion.tools.cli import main\nrc = main(sys.argv[1:])\n"
            "print('MPI imported' if 'mpi4py.MPI' in sys.modules else 'no MPI', rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip().splitlines()[-1] in ("no MPI 0", "no MPI 2"), proc.stdout[-500:]


def test_bench_dispatches_arguments(capsys, monkeypatch):
    seen = []
    fake = type(sys)("mpifusion.tools.bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "mpifusion.tools.bench", fake)
    assert run_cli(capsys, "bench", "--quick", "-n", "3")[0] == 0
    assert seen == [["--quick", "-n", "3"]]


def test_python_dash_m_and_usage_errors():
    proc = subprocess.run([sys.executable, "-m", "mpifusion", "layout", "--nranks", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--nranks: expected an integer >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "mpifusion", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "layout" in proc.stdout and "check" in proc.stdout


@pytest.mark.parametrize("text, value", [("268435456", 268435456), ("256M", 256 << 20),
                                         ("256MiB", 256 << 20), ("1g", 1 << 30), ("0", 0)])
def test_byte_size(text, value):
    assert byte_size(text) == value
