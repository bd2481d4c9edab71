"""Default segment size: cache-size rule, tune file, and their precedence under explicit
options and $MPIFUSION_SEGMENT_BYTES (no MPI)."""
import json

import pytest

from mpifusion import machine
from mpifusion.config import CommOptions

from tests.helpers import private_tune_file  # noqa: F401  (autouse fixture)

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


def test_cache_sizes_are_plausible():
    sizes = machine.cache_sizes()
    for key, value in sizes.items():
        assert key in ("L1d", "L2", "L3", "L4") and value >= 1024


def test_no_tune_file_gives_the_rule(private_tune_file):
    assert not private_tune_file.exists()
    assert machine.default_segment_bytes() == machine.segment_rule()
    assert CommOptions(strategy="thread").segment == machine.segment_rule()
    assert CommOptions(strategy="nonblocking").segment == machine.segment_rule()
    assert "rule" in machine.default_segment_source() or "fallback" in \
        machine.default_segment_source()


def test_tune_file_beats_rule_and_env_beats_tune_file(private_tune_file, monkeypatch):
    path = machine.write_tune({"segment_bytes": 3 * MiB, "nranks": 2})
    assert path == str(private_tune_file)
    data = json.loads(private_tune_file.read_text())
    assert data["version"] == 1 and data["machines"][machine.machine_key()]["nranks"] == 2
    assert machine.default_segment_bytes() == 3 * MiB
    assert CommOptions().segment == 3 * MiB
    assert "tuned" in machine.default_segment_source()
    assert CommOptions(segment_bytes=5 * MiB).segment == 5 * MiB  # explicit option wins
    monkeypatch.setenv("MPIFUSION_SEGMENT_BYTES", str(6 * MiB))
    assert CommOptions.from_env().segment == 6 * MiB  # the environment wins too
    assert CommOptions.from_env(segment_bytes=7 * MiB).segment == 7 * MiB


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
                                     # found by a red-team review: 1 byte made a step 90x
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
    """Found by a red-team review: tune writers sharing one file (a home directory seen by
    several node types) read, changed and rewrote it without a lock, so one dropped what
    another had just recorded. Every writer's last entry must survive."""
    import subprocess
    import sys

    writers, rounds = 6, 25
    go = tmp_path / "go"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = dict(__import__("os").environ,
               PYTHONPATH=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    procs = [subprocess.Popen([sys.executable, str(script), f"cpu {k}|L2={k}",
                               str(private_tune_file), str(go), str(rounds)], env=env)
             for k in range(writers)]
    go.write_text("")
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    data = json.loads(private_tune_file.read_text())
    assert data["version"] == 1
    assert {key: entry["segment_bytes"] for key, entry in data["machines"].items()} == \
        {f"cpu {k}|L2={k}": 4096 * rounds for k in range(writers)}
    leftovers = sorted(p.name for p in tmp_path.iterdir()
                       if p.name not in ("tune.json", "go", "writer.py", "tune.json.lock"))
    assert leftovers == []  # no temporary files left behind
