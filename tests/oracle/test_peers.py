"""Real peers checked by the oracle through the capture adapters: Paddle 3.3.1's own
FusedCommBuffer (two CPU ranks over gloo), PyTorch FSDP2 and DDP (two CPU ranks over gloo),
JAX (pmap over two CPU devices). Each peer runs once per module (tests/oracle/peers/*.py, under
mpiexec with a hard timeout) and writes one dump per case; every case must pass, and its
corrupted variant must fail naming the perturbed param (and only it).

Skipped, with the reason, where a framework is not installed (scripts/test.sh installs
torch, jax and paddle).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from mpifusion.errors import OracleMismatch
from mpifusion.oracle import check

from tests.helpers import free_ports, run_job

PEERS = Path(__file__).resolve().parent / "peers"


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[{module}]')")




def _run_peer(tmp_path_factory, name: str, argv: list, nranks: int = 2, env=None) -> Path:
    out = tmp_path_factory.mktemp(name)
    proc = run_job(nranks, [sys.executable, str(PEERS / f"{name}.py"), str(out), *argv],
                   timeout=150, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out


def _check_case(out: Path, case: str, victim: str, rank: int) -> None:
    report = check(out / case / "spec.json", out / case)
    assert report.ok, str(report)
    bad = check(out / case / "spec.json", out / f"{case}_corrupt")
    assert bad.failing == [victim], str(bad)
    assert bad.failing_ranks == [rank]
    with pytest.raises(OracleMismatch, match=rf"{victim} \(err/bound [\d.e+]+ on rank {rank}\)"):
        bad.raise_for_failure()


# ------------------------------------------------------------------ Paddle


@pytest.fixture(scope="module")
def paddle_out(tmp_path_factory):
    _need("paddle")
    return _run_peer(tmp_path_factory, "paddle_fused", ["--port", str(free_ports(2))])


@pytest.mark.parametrize("acc", [1, 2, 3])
@pytest.mark.parametrize("scaling", ["pre", "post"])
def test_paddle_fused_comm_buffer_all_reduce(paddle_out, acc, scaling):
    """ALL_REDUCE with release_grads; 1/n before (scale_after_comm=False) or after."""
    _check_case(paddle_out, f"ar_acc{acc}_{scaling}", "2.weight", 1)


def test_paddle_fused_comm_buffer_reduce_on_root(paddle_out):
    _check_case(paddle_out, "reduce_acc2", "2.weight", 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_paddle_reduce_scatter_slices_as_paddle_cuts_them(paddle_out, rank):
    """record_buffer_outputs: each param's slice of a REDUCE_SCATTER grad buffer (one-rank
    groups: gloo has no reduce_scatter), checked with the oracle's default (Paddle's) cut;
    a nonzero padding element fails."""
    import numpy as np

    case = paddle_out / f"rs_solo_rank{rank}"
    report = check(case / "spec.json", case)
    assert report.ok and sum(s.compared for s in report.stats) == 576 + 64 + 192 + 64  # padded
    with np.load(case / "rank0.npz") as f:
        record = {k: f[k] for k in f.files}
    record["out/0.bias"] = record["out/0.bias"].copy()
    record["out/0.bias"][-1] = 1.0  # padding after the 33 values
    assert check(case / "spec.json", [record]).failing == ["0.bias"]


def test_paddle_sync_params_all_gather_bit_exact(paddle_out):
    """A REDUCE_SCATTER buffer's sync_params, each rank's shard cut as Paddle cuts it."""
    report = check(paddle_out / "gather" / "spec.json", paddle_out / "gather")
    assert report.ok and len(report.sync) == 4 and all(s.compared for s in report.sync)
    bad = check(paddle_out / "gather" / "spec.json", paddle_out / "gather_corrupt")
    assert bad.failing == ["2.weight"] and bad.failing_ranks == [1]
    assert bad.reasons()["2.weight"] == "all-gather differs on rank(s) 1"


# ------------------------------------------------------------------ PyTorch


@pytest.fixture(scope="module")
def torch_out(tmp_path_factory):
    _need("torch")
    return _run_peer(tmp_path_factory, "torch_peer", [])


@pytest.mark.parametrize("acc", [1, 2])
def test_torch_fsdp2_dim0_shards_through_ranges(torch_out, acc):
    case = f"fsdp2_acc{acc}"
    _check_case(torch_out, case, "fc2.weight", 1)
    report = check(torch_out / case / "spec.json", torch_out / case)
    assert not report.coverage  # the dim-0 shards tile every param
    assert [s.name for s in report.sync] == [s.name for s in report.stats]  # all-gathers


def test_torch_fsdp2_in_memory_gather(torch_out):
    """rank 0 checked every rank's record gathered over torch.distributed (no files)."""
    assert (torch_out / "fsdp2_acc2" / "in_memory.txt").read_text().strip() == "PASS"


def test_torch_ddp_no_sync_micro_steps(torch_out):
    _check_case(torch_out, "ddp_acc2", "fc2.weight", 1)


# ------------------------------------------------------------------ JAX


@pytest.fixture(scope="module")
def jax_out(tmp_path_factory):
    _need("jax")
    return _run_peer(tmp_path_factory, "jax_peer", [], nranks=1)


@pytest.mark.parametrize("case", ["pmean_acc1", "pmean_acc3", "psum_bf16"])
def test_jax_pmap_grads(jax_out, case):
    _check_case(jax_out, case, "dense/kernel", 1)
