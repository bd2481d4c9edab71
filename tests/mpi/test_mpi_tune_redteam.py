"""Red-team review of the machine default segment size across ranks: ranks whose tune files
differ (different node types, one rank's file missing, broken or unreadable) must still use
one segment size, the smallest, and reduce correctly.

Run with ``mpiexec -n N python -m mpi4py -m pytest --only-mpi tests/mpi/test_mpi_tune_redteam.py``.
"""
import json

import numpy as np
import pytest

from mpifusion import machine
from mpifusion.comm import Communicator
from mpifusion.config import CommOptions

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def _rank_file(comm, tmp_path, content):
    """This rank's own tune file (a folder per rank: each rank is its own 'machine')."""
    path = tmp_path / f"tune-{comm.Get_rank()}.json"
    if content is not None:
        path.write_text(content)
    return path


@pytest.mark.parametrize("strategy", ["thread", "nonblocking"])
def test_ranks_with_different_tune_files_agree_on_the_smallest(comm, tmp_path, monkeypatch,
                                                               strategy):
    rank, n = comm.Get_rank(), comm.Get_size()
    key = machine.machine_key()
    contents = [
        json.dumps({"version": 1, "machines": {key: {"segment_bytes": 8192}}}),
        None,                                   # no tune file: the rule
        "{truncated",                           # broken: the rule
        json.dumps({"version": 1, "machines": {key: {"segment_bytes": 1 << 20}}}),
    ]
    path = _rank_file(comm, tmp_path, contents[rank % len(contents)])
    monkeypatch.setenv("MPIFUSION_TUNE_FILE", str(path))
    monkeypatch.delenv("MPIFUSION_SEGMENT_BYTES", raising=False)
    mine = CommOptions(strategy=strategy).segment
    want = comm.allreduce(mine, op=__import__("mpi4py").MPI.MIN)
    c = Communicator(comm, CommOptions(strategy=strategy))
    assert c.segment_bytes == want
    assert comm.allgather(c.segment_bytes) == [want] * n
    x = np.arange(100_000, dtype=np.float32) + rank
    c.allreduce(x, scale=1.0 / n).wait()
    ref = (np.arange(100_000, dtype=np.float64) * n + n * (n - 1) / 2) / n
    np.testing.assert_allclose(x, ref, rtol=1e-6)


def test_tune_refusing_a_file_it_cannot_read_stops_every_rank(comm, tmp_path, monkeypatch):
    """A tune file of another version is left as it was; every rank returns 1 (none waits
    for the others in a collective)."""
    import argparse

    from mpifusion.tools import tune

    if comm.Get_size() < 2:
        pytest.skip("tune needs 2 ranks")
    path = comm.bcast(str(tmp_path / "tune.json"), root=0)
    content = json.dumps({"version": 2, "machines": {"other": {"segment_bytes": 8192}}})
    if comm.Get_rank() == 0:
        with open(path, "w") as f:
            f.write(content)
    comm.Barrier()
    ns = argparse.Namespace(mb=1.0, segments="0.0625,0.25", dtype="float32", rounds=1,
                            output=path, dry_run=False)
    assert tune.run(ns, say=lambda line: None) == 1
    comm.Barrier()
    with open(path) as f:
        assert f.read() == content
