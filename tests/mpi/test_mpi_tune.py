"""``mpifusion tune`` under mpiexec: a tiny sweep writes the tune file the library reads."""
import argparse
import json

import pytest

from mpifusion import machine
from mpifusion.config import CommOptions, OptionError
from mpifusion.tools import tune

pytestmark = pytest.mark.mpi


def _args(path, **kw):
    ns = argparse.Namespace(mb=1.0, segments="0.0625,0.25", dtype="float32", rounds=1,
                            output=path, dry_run=False)
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_tune_writes_what_the_library_reads(comm, tmp_path, monkeypatch):
    path = comm.bcast(str(tmp_path / "tune.json"), root=0)  # rank 0's folder for everyone
    monkeypatch.setenv("MPIFUSION_TUNE_FILE", path)
    monkeypatch.delenv("MPIFUSION_SEGMENT_BYTES", raising=False)
    lines = []
    if comm.Get_size() < 2:
        with pytest.raises(OptionError, match="mpiexec -n 2"):
            tune.run(_args(path), say=lines.append)
        return
    assert tune.run(_args(path), say=lines.append) == 0
    comm.Barrier()
    if comm.Get_rank() == 0:
        entry = json.load(open(path))["machines"][machine.machine_key()]
        assert entry["segment_bytes"] in (64 * 1024, 256 * 1024)
        assert entry["nranks"] == comm.Get_size()
        assert any("fastest" in line for line in lines)
        assert CommOptions(strategy="thread").segment == entry["segment_bytes"]
    with pytest.raises(OptionError, match="segments"):
        tune.run(_args(path, segments="1,x"), say=lines.append)
