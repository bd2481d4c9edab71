"""The MPI test harness itself: a failing or hanging rank ends the whole job, it never hangs;
no test and no job it starts sees a developer's own tune file."""
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cmd, run_job

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

FAILING = '''
import pytest

from tests.helpers import run_job
pytestmark = pytest.mark.mpi

def test_one_rank_fails(comm):
    if comm.Get_rank() == 1:
        assert False, "rank 1 disagrees"
    comm.Barrier()  # rank 0 would wait here forever without the abort
'''

HANGING = '''
import time
import pytest

from tests.helpers import run_job
pytestmark = pytest.mark.mpi

@pytest.mark.timeout(3)
def test_one_rank_hangs(comm):
    if comm.Get_rank() == 0:
        time.sleep(3600)
    comm.Barrier()
'''


@pytest.mark.parametrize("body, expect", [(FAILING, "rank 1 disagrees"), (HANGING, "Timeout")])
def test_bad_rank_ends_the_job(tmp_path, body, expect):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_case.py").write_text(body)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 60\ntimeout_method = thread\n")
    out = run_job(2, [sys.executable, "-m", "mpi4py", "-m", "pytest", "--only-mpi", "-q",
                      "-p", "no:cacheprovider", str(tmp_path)], cwd=str(tmp_path), timeout=90)
    assert out.returncode != 0
    assert expect in out.stdout + out.stderr


def test_jobs_never_see_a_developers_tune_file(isolated_tune_file):
    """The session's tune file (and XDG cache folder) is a fresh temp one, here and in every
    job a test starts, so a developer's ~/.cache/mpifusion/tune.json or $MPIFUSION_TUNE_FILE
    never changes a default segment size under test."""
    import os

    from mpifusion import machine

    here = machine.tune_path()
    assert here == str(isolated_tune_file) and not isolated_tune_file.exists()
    assert "MPIFUSION_SEGMENT_BYTES" not in os.environ
    assert os.environ["XDG_CACHE_HOME"].startswith(str(isolated_tune_file.parent))
    code = ("import os; from mpifusion import machine; "
            "print(machine.tune_path(), os.environ.get('MPIFUSION_SEGMENT_BYTES'))")
    out = run_cmd([sys.executable, "-c", code], timeout=60)
    assert out.returncode == 0 and out.stdout.split() == [here, "None"], out.stdout + out.stderr
