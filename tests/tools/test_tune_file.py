"""The default segment size: the cache-size rule, the tune file that ``mpifusion tune``
writes, and their precedence under explicit options and $MPIFUSION_SEGMENT_BYTES.

What ``tune`` writes must stay readable by everyone who read it before, land where the path
points, never drop entries it could not read, and never go to a folder that depends on the
current one. Under mpiexec (``mpi``): a tiny sweep writes the file the library reads, and
ranks whose tune files differ (different node types, one rank's file missing, broken or
unreadable) still use one segment size, the smallest, and reduce correctly.
"""
import argparse
import errno
import json
import os
import re
import stat
import sys

import numpy as np
import pytest

from mpifusion import machine
from mpifusion.comm import Communicator
from mpifusion.config import CommOptions, OptionError
from mpifusion.tools import tune

from tests.helpers import private_tune_file  # noqa: F401  (autouse fixture)
from tests.helpers import run_cmd, run_cmds

MiB = 1 << 20


@pytest.mark.parametrize("l2, want", [(2 * MiB, 4 * MiB), (1 * MiB, 2 * MiB),
                                      (512 * 1024, 2 * MiB), (3 * MiB, 4 * MiB),
                                      (1280 * 1024, 2 * MiB), (4 * MiB, 8 * MiB),
                                      (64 * MiB, 16 * MiB)])
def test_segment_rule(l2, want):
    assert machine.segment_rule({"L2": l2}) == want


def test_segment_rule_without_cache_sizes():
    assert machine.segment_rule({}) == machine.FALLBACK_SEGMENT_BYTES


@pytest.mark.parametrize("text, want", [("1024K", 1 << 20), ("32M", 32 << 20), ("512", 512),
                                        ("", None), ("abcK", None)])
def test_parse_size(text, want):
    assert machine._parse_size(text) == want


def test_cache_sizes_read_from_a_faked_sysfs(tmp_path, monkeypatch):
    """The sysfs reading on a made-up machine (not this one: its caches are whatever they
    are): data and unified caches by level, instruction caches left out."""
    import builtins

    base = "/sys/devices/system/cpu/cpu0/cache"
    fake = tmp_path / "cache"
    for name, level, kind, size in (("index0", 1, "Data", "48K"), ("index1", 1, "Instruction",
                                    "32K"), ("index2", 2, "Unified", "1024K"),
                                    ("index3", 3, "Unified", "32768K"), ("power", 0, "", "")):
        folder = fake / name
        folder.mkdir(parents=True)
        for field, value in (("level", level), ("type", kind), ("size", size)):
            (folder / field).write_text(f"{value}\n")
    real_open, real_listdir = builtins.open, os.listdir

    def moved(path):
        return str(path).replace(base, str(fake), 1) if str(path).startswith(base) else path

    # cache_sizes is cached per process: read afresh here, and leave no made-up sizes behind
    # for later tests (their machine_key would differ from their subprocesses')
    machine.cache_sizes.cache_clear()
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(moved(path), *a, **k))
    monkeypatch.setattr(os, "listdir", lambda path=".": real_listdir(moved(path)))
    try:
        assert machine.cache_sizes() == {"L1d": 48 * 1024, "L2": MiB, "L3": 32 * MiB}
        assert machine.segment_rule() == machine.segment_rule({"L2": MiB}) == 2 * MiB
    finally:
        monkeypatch.undo()
        machine.cache_sizes.cache_clear()


def test_cache_sizes_of_this_machine_are_well_formed():
    """Whatever this machine has (possibly nothing): levels named as the rule reads them."""
    for key, value in machine.cache_sizes().items():
        assert re.fullmatch(r"L\d+d?", key) and isinstance(value, int) and value > 0


def test_no_tune_file_gives_the_rule(private_tune_file):
    assert not private_tune_file.exists()
    assert machine.default_segment_bytes() == machine.segment_rule()
    assert machine.segment_for(CommOptions(strategy="thread")) == machine.segment_rule()
    assert machine.segment_for(CommOptions(strategy="nonblocking")) == machine.segment_rule()
    assert "rule" in machine.default_segment_source() or "fallback" in \
        machine.default_segment_source()


def test_tune_file_beats_rule_and_env_beats_tune_file(private_tune_file, monkeypatch):
    path = machine.write_tune({"segment_bytes": 3 * MiB, "nranks": 2})
    assert path == str(private_tune_file)
    data = json.loads(private_tune_file.read_text())
    assert data["version"] == 1 and data["machines"][machine.machine_key()]["nranks"] == 2
    assert machine.default_segment_bytes() == 3 * MiB
    assert machine.segment_for(CommOptions()) == 3 * MiB
    assert "tuned" in machine.default_segment_source()
    assert machine.segment_for(CommOptions(segment_bytes=5 * MiB)) == 5 * MiB  # explicit option wins
    monkeypatch.setenv("MPIFUSION_SEGMENT_BYTES", str(6 * MiB))
    assert machine.segment_for(CommOptions.from_env()) == 6 * MiB  # the environment wins too
    assert machine.segment_for(CommOptions.from_env(segment_bytes=7 * MiB)) == 7 * MiB


def test_other_machines_entries_are_kept(private_tune_file):
    private_tune_file.write_text(json.dumps(
        {"version": 1, "machines": {"other cpu|L2=1": {"segment_bytes": 123}}}))
    machine.write_tune({"segment_bytes": 2 * MiB})
    data = json.loads(private_tune_file.read_text())
    assert data["machines"]["other cpu|L2=1"] == {"segment_bytes": 123}
    assert machine.tuned_segment_bytes() == 2 * MiB


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]),
                                     json.dumps({"version": 99, "machines": {}}),
                                     json.dumps({"version": 1, "machines": {"KEY": {
                                         "segment_bytes": -1}}}),
                                     json.dumps({"version": 1, "machines": {"KEY": {
                                         "segment_bytes": True}}}),
                                     # before: 1 byte made a step 90x
                                     # slower, 10**30 and deep nesting crashed every job
                                     json.dumps({"version": 1, "machines": {"KEY": {
                                         "segment_bytes": 1}}}),
                                     json.dumps({"version": 1, "machines": {"KEY": {
                                         "segment_bytes": 10 ** 30}}}),
                                     "[" * 100000 + "]" * 100000,
                                     " " * (2 << 20) + "{}"])
def test_broken_tune_file_falls_back_to_the_rule(private_tune_file, content):
    """A tune file only sets a default: a broken one must not stop training."""
    private_tune_file.write_text(content.replace("KEY", machine.machine_key()))
    assert machine.default_segment_bytes() == machine.segment_rule()


def test_cli_tune_at_one_rank_says_how_to_run_it(capsys):
    from mpifusion.tools import cli

    assert cli.main(["tune", "--dry-run"]) == 2
    assert "mpiexec -n 2" in capsys.readouterr().err


def test_a_tune_file_that_is_no_regular_file_is_not_read(private_tune_file, monkeypatch):
    """/dev/zero or a FIFO as MPIFUSION_TUNE_FILE hung every job (json.load read forever)."""
    import os
    fifo = private_tune_file.parent / "fifo.json"
    os.mkfifo(fifo)
    assert machine.read_tune(str(fifo)) == {}
    assert machine.read_tune("/dev/zero") == {}


_WRITER = r"""
import os, sys, time
from mpifusion import machine
key, path, go, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
machine.machine_key = lambda: key
while not os.path.exists(go):
    time.sleep(0.001)
for i in range(n):
    machine.write_tune({"segment_bytes": 4096 * (i + 1), "writer": key}, path)
"""


def test_concurrent_writers_keep_every_machine(private_tune_file, tmp_path):
    """Tune writers sharing one file (a home directory seen by
    several node types) read, changed and rewrote it without a lock, so one dropped what
    another had just recorded. Every writer's last entry must survive."""
    writers, rounds = 6, 25
    go = tmp_path / "go"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    procs = run_cmds([[sys.executable, str(script), f"cpu {k}|L2={k}", str(private_tune_file),
                       str(go), str(rounds)] for k in range(writers)],
                     timeout=60, started=lambda: go.write_text(""))
    assert [p.returncode for p in procs] == [0] * writers, [p.stderr for p in procs]
    data = json.loads(private_tune_file.read_text())
    assert data["version"] == 1
    assert {key: entry["segment_bytes"] for key, entry in data["machines"].items()} == \
        {f"cpu {k}|L2={k}": 4096 * rounds for k in range(writers)}
    leftovers = sorted(p.name for p in tmp_path.iterdir()
                       if p.name not in ("tune.json", "go", "writer.py", "tune.json.lock"))
    assert leftovers == []  # no temporary files left behind


# --------------------------------------------------------------------------- writing the tune file


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_tune_file_is_readable_as_umask_allows(private_tune_file):
    """The tune file was written through mkstemp, so it was always mode 0600: on a tune file
    shared by a group (a project folder in MPIFUSION_TUNE_FILE) every other user silently
    fell back to the L2 rule after one of them ran ``tune``."""
    old = os.umask(0o022)
    try:
        machine.write_tune({"segment_bytes": 2 * MiB})
    finally:
        os.umask(old)
    assert _mode(private_tune_file) == 0o644


def test_rewriting_keeps_the_files_mode(private_tune_file):
    """An existing 0664 (group-writable, shared) file came back 0600."""
    machine.write_tune({"segment_bytes": 2 * MiB})
    os.chmod(private_tune_file, 0o664)
    machine.write_tune({"segment_bytes": 4 * MiB})
    assert _mode(private_tune_file) == 0o664
    assert machine.tuned_segment_bytes() == 4 * MiB


def test_a_symlinked_tune_file_is_written_through(tmp_path, private_tune_file):
    """A tune file linked to a shared one (``ln -s /project/tune.json ~/.cache/mpifusion/``)
    was replaced by a private copy: the shared file never got the new entry and the link was
    gone. The target is updated and the link kept."""
    shared = tmp_path / "shared" / "tune.json"
    shared.parent.mkdir()
    shared.write_text(json.dumps({"version": 1, "machines": {"other|L2=1": {
        "segment_bytes": 8192}}}))
    private_tune_file.symlink_to(shared)
    machine.write_tune({"segment_bytes": 2 * MiB})
    assert private_tune_file.is_symlink()
    data = json.loads(shared.read_text())
    assert data["machines"]["other|L2=1"] == {"segment_bytes": 8192}
    assert data["machines"][machine.machine_key()] == {"segment_bytes": 2 * MiB}
    assert (shared.parent / "tune.json.lock").exists()  # one lock for every link to it


@pytest.mark.parametrize("content, why", [
    (json.dumps({"version": 2, "machines": {"other|L2=1": {"segment_bytes": 8192}}}),
     "version 2"),
    ('{"version": 1, "machines": {"other|L2=1": {"segment_bytes": 81', "not valid JSON"),
    (json.dumps([{"segment_bytes": 8192}]), "not a tune file"),
    (json.dumps({"version": 1, "machines": ["other"]}), "not a tune file"),
    (b"\xff\xfe{}", "not valid UTF-8"),
    (json.dumps({"version": 1, "machines": {}, "pad": " " * (2 * MiB)}), "larger than"),
])
def test_a_file_tune_cannot_read_is_not_overwritten(private_tune_file, content, why):
    """A tune file that was not version 1 (a newer mpifusion's), truncated or hand-edited
    into invalid JSON was silently replaced by one holding only this machine: every other
    machine's entry was lost. Now it is refused, naming the file and the problem, and left
    as it was."""
    if isinstance(content, str):
        content = content.encode()
    private_tune_file.write_bytes(content)
    with pytest.raises(machine.TuneFileError) as info:
        machine.write_tune({"segment_bytes": 2 * MiB})
    message = str(info.value)
    assert str(private_tune_file) in message and why in message, message
    assert "nothing was changed" in message and "--output" in message
    assert private_tune_file.read_bytes() == content
    assert machine.tuned_segment_bytes() is None  # readers still ignore it


def test_a_tune_file_that_is_a_device_or_fifo_is_not_replaced(private_tune_file):
    """``tune --output /dev/null`` (to throw the result away) as root renamed a regular file
    over /dev/null; a FIFO was replaced the same way. Refused, and left as it was."""
    os.mkfifo(private_tune_file)
    with pytest.raises(machine.TuneFileError, match="not a regular file"):
        machine.write_tune({"segment_bytes": 2 * MiB})
    assert stat.S_ISFIFO(os.stat(private_tune_file).st_mode)


def test_an_empty_tune_file_is_replaced(private_tune_file):
    """An empty file holds no entries to lose (``touch``, a full disk): it is written."""
    private_tune_file.write_text("\n")
    machine.write_tune({"segment_bytes": 2 * MiB})
    assert machine.tuned_segment_bytes() == 2 * MiB


def _no_home(monkeypatch):
    import pwd

    def unknown(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("MPIFUSION_TUNE_FILE", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", unknown)


def test_without_a_home_directory_nothing_is_written_under_the_current_folder(
        tmp_path, monkeypatch):
    """HOME unset for a user the password database does not know (containers run under a
    random uid): '~' stayed unexpanded, so ``tune`` created ./~/.cache/mpifusion/tune.json in
    whatever folder it ran in, and jobs read it only when started from that same folder."""
    _no_home(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(machine.TuneFileError, match="no home directory.*MPIFUSION_TUNE_FILE"):
        machine.write_tune({"segment_bytes": 2 * MiB})
    assert os.listdir(tmp_path) == []
    os.makedirs(tmp_path / "~" / ".cache" / "mpifusion")
    (tmp_path / "~" / ".cache" / "mpifusion" / "tune.json").write_text(json.dumps(
        {"version": 1, "machines": {machine.machine_key(): {"segment_bytes": 8192}}}))
    assert machine.default_segment_bytes() == machine.segment_rule()  # not read either


def test_a_tilde_in_output_is_the_home_directory(tmp_path, monkeypatch):
    """``tune --output '~/tune.json'`` (quoted in a job script) wrote ./~/tune.json."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    machine.write_tune({"segment_bytes": 2 * MiB}, "~/tune.json")
    assert (tmp_path / "home" / "tune.json").exists() and not (tmp_path / "~").exists()
    assert machine.tuned_segment_bytes("~/tune.json") == 2 * MiB


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    """XDG's rule: a relative $XDG_CACHE_HOME is invalid and ignored. It was used relative to
    the current folder, so ranks started in different folders read different tune files."""
    monkeypatch.delenv("MPIFUSION_TUNE_FILE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    assert machine.tune_path() == str(tmp_path / "home" / ".cache" / "mpifusion" / "tune.json")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert machine.tune_path() == str(tmp_path / "xdg" / "mpifusion" / "tune.json")


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_filesystem_without_flock_still_gets_the_file(private_tune_file, monkeypatch, code):
    """Home directories on Lustre mounted without ``flock`` (ENOSYS) or NFS without a lock
    daemon (ENOLCK): ``tune`` measured, then failed with '[Errno 38] Function not
    implemented' and recorded nothing. The write is still atomic; it goes ahead, warning
    that concurrent writers are not serialised."""
    import fcntl

    def no_flock(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.warns(RuntimeWarning, match="without a lock"):
        machine.write_tune({"segment_bytes": 2 * MiB})
    assert machine.tuned_segment_bytes() == 2 * MiB


_AS_OTHER_USER = r"""
import fcntl, os, sys
from mpifusion import limits, machine
machine.machine_key()
os.setgid(65534)  # after the imports: the interpreter's files may be root's only
os.setuid(65534)
machine.write_tune({"segment_bytes": 8192}, sys.argv[1])
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root to run a writer as another user")
def test_another_user_can_update_a_shared_tune_file(tmp_path):
    """The lock file was opened read-write: on a tune file shared by a group, the first
    user's lock file (0644 under umask 022) made every other user's ``tune`` fail with
    'Permission denied: ...tune.json.lock' after measuring. flock needs only read access."""
    import tempfile
    from pathlib import Path

    shared = Path(tempfile.mkdtemp(prefix="mpifusion-shared-"))
    try:
        os.chmod(shared, 0o777)  # a folder the group may write
        path = shared / "tune.json"
        old = os.umask(0o022)
        try:
            machine.write_tune({"segment_bytes": 2 * MiB}, str(path))  # as this user
        finally:
            os.umask(old)
        os.chmod(path, 0o666)
        assert _mode(str(path) + ".lock") == 0o644
        proc = run_cmd([sys.executable, "-c", _AS_OTHER_USER, str(path)], timeout=60)
        assert proc.returncode == 0, proc.stderr
        data = json.loads(path.read_text())
        assert data["machines"][machine.machine_key()] == {"segment_bytes": 8192}
        assert os.stat(path).st_uid == 65534 and _mode(path) == 0o666
    finally:
        import shutil

        shutil.rmtree(shared)


@pytest.mark.parametrize("value, want", [("np64", 4096), ("npu32", 8192),
                                         ("9007199254740993", 9007199254740993)])
def test_segment_bytes_takes_any_integer_exactly(value, want):
    """A numpy integer (a size computed from shapes) was refused with 'expected an int >= 0,
    got np.int64(4096)', unlike acc_steps and root; and digits in MPIFUSION_SEGMENT_BYTES
    went through a float, so values above 2**53 changed silently."""
    import numpy as np

    from mpifusion.config import CommOptions

    value = {"np64": np.int64(4096), "npu32": np.uint32(8192)}.get(value, value)
    assert machine.segment_for(CommOptions(segment_bytes=value)) == want
    assert machine.segment_for(CommOptions.from_env({"MPIFUSION_SEGMENT_BYTES": str(value)})) == want


@pytest.mark.parametrize("value", ["np_true", "np_neg", "4M", "-1", "0.5", "nan", "1e400"])
def test_segment_bytes_still_refuses_what_is_no_byte_count(value):
    import numpy as np

    from mpifusion.config import CommOptions, OptionError

    value = {"np_true": np.bool_(True), "np_neg": np.int64(-1)}.get(value, value)
    with pytest.raises(OptionError, match="segment_bytes: expected"):
        CommOptions(segment_bytes=value)


@pytest.mark.parametrize("content, why", [
    ('{"version": 1, "machines": {"KEY": {"segment_bytes": "4M"}}}', "segment_bytes '4M'"),
    ('{"version": 1, "machines": {"KEY": {"segment_bytes": 4194304.0}}}', "4194304.0"),
    ('{"version": 1, "machines": {"KEY": 4194304}}', "entry is int 4194304"),
    ('{"version": 2, "machines": {}}', "version 2"),
    ('{"version": 1, "machines": {"KEY": {"segment_bytes": 40', "not valid JSON"),
])
def test_an_ignored_tune_file_is_logged_once(private_tune_file, caplog, content, why):
    """A tune file or entry that is ignored fell back to the L2 rule in silence: a
    hand-edited '4M' or 4194304.0, or a newer mpifusion's file, looked as if it was used.
    One warning per process names the file and the problem; the rule is still used."""
    import logging

    private_tune_file.write_text(content.replace("KEY", machine.machine_key()))
    with caplog.at_level(logging.WARNING, logger="mpifusion"):
        assert machine.default_segment_bytes() == machine.segment_rule()
        assert machine.default_segment_bytes() == machine.segment_rule()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert str(private_tune_file) in lines[0] and why in lines[0], lines[0]
    assert "L2 rule" in lines[0]


def test_no_tune_file_and_other_machines_entries_are_not_logged(private_tune_file, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="mpifusion"):
        machine.default_segment_bytes()
        private_tune_file.write_text(json.dumps(
            {"version": 1, "machines": {"other|L2=1": {"segment_bytes": 1}}}))
        machine.default_segment_bytes()
    assert caplog.records == []


@pytest.mark.parametrize("output, needle", [("", "--output: expected a file name, got ''"),
                                            ("DIR", "is a folder; expected a file name")])
def test_tune_output_naming_no_file_is_refused_before_measuring(capsys, tmp_path, output,
                                                                needle):
    """``tune --output ''`` (an unset variable in a job script) measured the whole sweep,
    then failed with "[Errno 21] is a directory: ''"; a folder likewise. Now one line, exit
    2, before anything runs."""
    from tests.helpers import run_cli

    output = str(tmp_path) if output == "DIR" else output
    code, out, err = run_cli(capsys, "tune", "--dry-run", "--output", output)
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


# ------------------------------------------------------------------------ under mpiexec: the sweep


def _args(path, **kw):
    ns = argparse.Namespace(mb=1.0, segments="0.0625,0.25", dtype="float32", rounds=1,
                            output=path, dry_run=False)
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


@pytest.mark.mpi
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
        assert machine.segment_for(CommOptions(strategy="thread")) == entry["segment_bytes"]
    with pytest.raises(OptionError, match="segments"):
        tune.run(_args(path, segments="1,x"), say=lines.append)


# -------------------------------------------------- under mpiexec: ranks with different tune files


def _rank_file(comm, tmp_path, content):
    """This rank's own tune file (a folder per rank: each rank is its own 'machine')."""
    path = tmp_path / f"tune-{comm.Get_rank()}.json"
    if content is not None:
        path.write_text(content)
    return path


@pytest.mark.mpi
@pytest.mark.timeout(120)
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
    mine = machine.segment_for(CommOptions(strategy=strategy))
    want = comm.allreduce(mine, op=__import__("mpi4py").MPI.MIN)
    c = Communicator(comm, CommOptions(strategy=strategy))
    assert c.segment_bytes == want
    assert comm.allgather(c.segment_bytes) == [want] * n
    x = np.arange(100_000, dtype=np.float32) + rank
    c.allreduce(x, scale=1.0 / n).wait()
    ref = (np.arange(100_000, dtype=np.float64) * n + n * (n - 1) / 2) / n
    np.testing.assert_allclose(x, ref, rtol=1e-6)


@pytest.mark.mpi
@pytest.mark.timeout(120)
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
