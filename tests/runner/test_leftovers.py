"""What a run leaves behind (tests/leftovers.py): a segment is removed only when it is new,
this user's and used by no live process; processes are found by the run's token."""
import mmap
import os
import subprocess
import sys
import uuid

import pytest

from tests import leftovers

pytestmark = pytest.mark.skipif(not leftovers.SHM.is_dir() or not os.path.isdir("/proc"),
                                reason="needs Linux /dev/shm and /proc")


@pytest.fixture
def segment():
    """A file named like MPICH's segments, removed at the end whatever happens."""
    path = leftovers.SHM / f"mpich_shm_test{uuid.uuid4().hex[:8]}_0"
    yield path
    path.unlink(missing_ok=True)


def test_a_new_unused_segment_is_a_leftover_and_is_removed(segment):
    before = leftovers.snapshot()
    segment.write_bytes(b"\0" * 4096)
    assert segment in leftovers.leftovers(before, min_age=0)
    assert leftovers.sweep(before, min_age=0) == [segment]
    assert not segment.exists()


def test_a_segment_that_was_there_before_is_left_alone(segment):
    segment.write_bytes(b"\0" * 4096)
    before = leftovers.snapshot()
    assert segment not in leftovers.leftovers(before, min_age=0)


def test_a_young_segment_is_left_alone(segment):
    """A live job maps its segment right after creating it: a young one may be in between."""
    before = leftovers.snapshot()
    segment.write_bytes(b"\0" * 4096)
    assert segment not in leftovers.leftovers(before, min_age=60)


def test_a_segment_made_just_before_the_sweep_is_waited_for(segment):
    """A job killed in a session's last seconds leaves a segment too young to judge at the
    session's end: the sweep waits until it is old enough, then removes it if unused."""
    before = leftovers.snapshot()
    segment.write_bytes(b"\0" * 4096)
    assert leftovers.sweep(before, min_age=0.5, settle=False) == []
    assert leftovers.sweep(before, min_age=0.5) == [segment]
    assert not segment.exists()


def test_a_mapped_segment_is_left_alone(segment):
    before = leftovers.snapshot()
    segment.write_bytes(b"\0" * 4096)
    with open(segment, "r+b") as f, mmap.mmap(f.fileno(), 4096) as m:
        f.close()
        assert segment not in leftovers.leftovers(before, min_age=0)
        m[0] = 1
    assert segment in leftovers.leftovers(before, min_age=0)


def test_a_segment_another_process_names_is_left_alone(segment):
    before = leftovers.snapshot()
    segment.write_bytes(b"\0" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE, env=dict(os.environ, HOLD=str(segment)))
    try:
        assert segment not in leftovers.leftovers(before, min_age=0)
    finally:
        holder.communicate(b"", timeout=60)
    assert segment in leftovers.leftovers(before, min_age=0)


def test_processes_of_the_run_are_found_by_its_token():
    token = uuid.uuid4().hex
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE, env=dict(os.environ,
                                                             **{leftovers.RUN_ENV: token}))
    try:
        assert [pid for pid, _ in leftovers.run_processes(token)] == [child.pid]
    finally:
        child.communicate(b"", timeout=60)
    assert leftovers.run_processes(token) == []
