"""The MPI test harness itself: a failing or hanging rank ends the whole job, it never hangs."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

FAILING = '''
import pytest
pytestmark = pytest.mark.mpi

def test_one_rank_fails(comm):
    if comm.Get_rank() == 1:
        assert False, "rank 1 disagrees"
    comm.Barrier()  # rank 0 would wait here forever without the abort
'''

HANGING = '''
import time
import pytest
pytestmark = pytest.mark.mpi

@pytest.mark.timeout(3)
def test_one_rank_hangs(comm):
    if comm.Get_rank() == 0:
        time.sleep(3600)
    comm.Barrier()
'''


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@pytest.mark.parametrize("body, expect", [(FAILING, "rank 1 disagrees"), (HANGING, "Timeout")])
def test_bad_rank_ends_the_job(tmp_path, body, expect):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_case.py").write_text(body)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 60\ntimeout_method = thread\n")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pytest",
                          "--only-mpi", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode != 0
    assert expect in out.stdout + out.stderr
