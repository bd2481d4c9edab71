"""The skip policy of strict runs (tests/skips.py): which reasons may skip, and the report
that a test skipped for its rank count ran at another one."""
import json

import pytest

from tests import skips

REASONS = {
    "needs cupy and a GPU": "gpu",
    "this MPI is not CUDA-aware": "gpu",
    "an order mismatch needs two ranks": "ranks",
    "Test requires 2 MPI processes, only 1 MPI processes specified, skipping test": "ranks",
    "needs root to run a writer as another user": "root",
    "no C compiler": "compiler",
    "MPIFUSION_SLURM_OPENMPI_VENV (a venv with mpi4py on Open MPI) not set": "openmpi",
    "MPIFUSION_IMPI_VENV (a venv with mpi4py on Intel MPI) not set": "impi",
    "no Slurm cluster: Slurm is not installed and installing it needs root": "slurm",
    "could not import 'torch': No module named 'torch'": "frameworks",
    "paddle is not installed (pip install -e '.[paddle]')": "frameworks",
}


@pytest.mark.parametrize("reason, name", sorted(REASONS.items()))
def test_each_known_reason_has_its_category(reason, name):
    assert skips.category(reason).name == name


def test_an_unknown_reason_is_refused_even_when_every_category_is_allowed():
    env = {skips.ALLOW_ENV: ",".join(c.name for c in skips.CATEGORIES)}
    found = skips.refused([("t::a", "thread strategy needs MPI_THREAD_MULTIPLE"),
                           ("t::b", "needs cupy and a GPU")], env)
    assert found == [("t::a", "thread strategy needs MPI_THREAD_MULTIPLE")]


def test_frameworks_slurm_and_open_mpi_skip_only_when_asked():
    wanted = [("t::torch", "could not import 'torch': No module named 'torch'"),
              ("t::slurm", "sbatch not on PATH"),
              ("t::ompi", "MPIFUSION_SLURM_OPENMPI_VENV (a venv with mpi4py on Open MPI) not set")]
    assert skips.refused(wanted, {}) == wanted
    assert skips.refused(wanted, {skips.ALLOW_ENV: "frameworks,slurm"}) == wanted[2:]


def test_an_unknown_category_name_is_refused():
    with pytest.raises(ValueError, match="unknown categories gpus"):
        skips.allowed({skips.ALLOW_ENV: "gpus"})


def _log(folder, label, outcomes):
    (folder / f"{label}.json").write_text(json.dumps({"label": label, "outcomes": outcomes}))


def test_report_fails_for_a_test_skipped_for_its_rank_count_in_every_run(tmp_path, capsys):
    skipped = ["skipped", "needs two ranks"]
    _log(tmp_path, "mpi-n1", {"t::pair": skipped, "t::one": ["passed", ""]})
    _log(tmp_path, "mpi-n2", {"t::pair": ["passed", ""], "t::one": ["passed", ""]})
    assert skips.report(str(tmp_path)) == 0
    _log(tmp_path, "mpi-n2", {"t::pair": skipped, "t::one": ["passed", ""]})
    capsys.readouterr()
    assert skips.report(str(tmp_path)) == 1
    assert "t::pair ran at no rank count" in capsys.readouterr().out
