"""``benchmarks/results/`` and its manifest: every result file belongs to one entry, every
entry says when (date), at which commit and on what machine (CPU, cores, MPI) it was
measured and which strategy a default buffer took; the scripts in ``benchmarks/`` write new
results there with that metadata (``benchmarks/record.py``); and ``benchmarks/report.py``
marks a target whose latest result predates today's default as old."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from mpifusion.config import STRATEGIES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
RESULTS = os.path.join(BENCH, "results")
#: the files of the results folder that are not results
NOT_RESULTS = {"index.json", "README.md"}
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}_under_test",
                                                  os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


record = _load("record")
report = _load("report")


def _index(folder: str = RESULTS) -> dict:
    with open(os.path.join(folder, "index.json")) as fh:
        return json.load(fh)


# ------------------------------------------------------------------------- the manifest

def test_every_result_file_is_in_the_manifest_once():
    index = _index()
    assert index["format"] == record.FORMAT
    listed = [f for e in index["results"] for f in e["files"]]
    assert len(listed) == len(set(listed)), sorted(f for f in listed if listed.count(f) > 1)
    present = set(os.listdir(RESULTS)) - NOT_RESULTS
    assert present - set(listed) == set(), "result files with no manifest entry"
    assert set(listed) - present == set(), "manifest entries naming missing files"
    ids = [e["id"] for e in index["results"]]
    assert len(ids) == len(set(ids))
    assert len(index["results"]) >= 40  # the results recorded before the manifest existed


def test_benchmarks_holds_scripts_and_the_results_folder_only():
    stray = [f for f in os.listdir(BENCH)
             if not f.endswith(".py") and f not in ("results", "__pycache__")]
    assert stray == [], "results beside the scripts: they belong in benchmarks/results/"


def _commits_exist(commits):
    proc = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, text=True,
                          input="".join(f"{c}^{{commit}}\n" for c in commits),
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if "missing" in line]


def test_every_entry_says_date_commit_machine_and_default():
    entries = _index()["results"]
    for e in entries:
        where = e["id"]
        assert DATE.match(e["date"]), where
        assert e["target"] in record.TARGETS, where
        assert e["what"].strip(), where
        assert e["date_source"] and e["commit_source"], where
        assert re.fullmatch(r"[0-9a-f]{40}", e["commit"] or ""), where
        m = e["machine"]
        assert m["cpu"].strip() and m["cpu"] != "unknown", where
        assert isinstance(m["cores"], int) and m["cores"] >= 1, where
        assert isinstance(m["mpi"], list) and all(re.search(r"\d+\.\d+", v) for v in m["mpi"])
        # a strategy and the setting that decides it, both or neither
        assert (e["default_strategy"] is None) == (e["setting"] is None), where
        assert e["default_strategy"] in STRATEGIES + (None,), where
        assert e["setting"] in record.SETTINGS + (None,), where
    # a shallow clone lacks the old commits, and a copy of the files (the suite's run as
    # another user) has no history at all: there the commits' form is what is checked
    probe = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                           capture_output=True, text=True)
    if probe.returncode == 0 and probe.stdout.strip() == "false":
        assert _commits_exist(sorted({e["commit"] for e in entries})) == []


def test_results_of_mpi_jobs_name_their_mpi_library():
    for e in _index()["results"]:
        if e["default_strategy"] is not None:
            assert e["machine"]["mpi"], e["id"]


# ------------------------------------------------------------- new results: record.py

def _args(tmp_path, no_record=False):
    return argparse.Namespace(results=str(tmp_path), no_record=no_record)


def test_a_recorded_run_has_its_header_and_manifest_entry(tmp_path, capsys):
    info = {"mpi": ["MPICH 5.0.2"], "nranks": 2, "default_strategy": "shm",
            "setting": "one node"}
    with record.recorded(_args(tmp_path), "bench_x", "small-messages", "a try",
                         job_info=info, extra=(".json",)) as prefix:
        print("| size | us |\n| --- | --- |\n| 4 KiB | 1.0 |")
        with open(prefix + ".json", "w") as fh:
            json.dump({"rows": []}, fh)
    assert "| 4 KiB | 1.0 |" in capsys.readouterr().out  # still printed
    index = _index(str(tmp_path))
    (e,) = index["results"]
    base = os.path.basename(prefix)
    assert re.fullmatch(r"bench_x_mpich_n2_\d{8}-\d{6}", base)
    assert e["files"] == [base + ".txt", base + ".json"] and e["id"] == base
    assert DATE.match(e["date"]) and e["date_source"] == "the run"
    head, body = (tmp_path / (base + ".txt")).read_text().split("\n", 1)
    assert body.startswith("| size | us |")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or None  # None: a copy, no history
    assert e["commit"] == commit and (commit is None or commit in head)
    assert e["machine"]["cpu"] in head and "MPICH 5.0.2" in head and e["date"] in head
    assert e["machine"]["cores"] == os.cpu_count() and e["machine"]["mpi"] == ["MPICH 5.0.2"]
    assert (e["default_strategy"], e["setting"]) == ("shm", "one node")
    # a second run gets a name of its own and a second entry
    second = record.save(_args(tmp_path), "bench_x", "small-messages", "again", job_info=info,
                         text="t", data={"a": 1})
    assert second != prefix
    saved = json.loads(open(second + ".json").read())
    assert saved["a"] == 1 and saved["record"]["commit"] == commit
    assert [x["id"] for x in _index(str(tmp_path))["results"]] == [base, os.path.basename(second)]


def test_a_failed_run_leaves_nothing_and_no_record_writes_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with record.recorded(_args(tmp_path), "bench_y", "deadline", "fails") as prefix:
            print("half a table")
            raise RuntimeError("boom")
    assert not os.path.exists(prefix + ".txt")
    assert not (tmp_path / "index.json").exists()
    with record.recorded(_args(tmp_path, no_record=True), "bench_y", "deadline", "x") as p:
        assert p is None
    assert record.save(_args(tmp_path, no_record=True), "bench_y", "deadline", "x",
                       text="t") is None
    assert os.listdir(tmp_path) == []


def test_register_refuses_unknown_targets_missing_files_and_twice(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown target"):
        record.entry([str(tmp_path / "a.txt")], "speed", "x", folder=str(tmp_path))
    with pytest.raises(ValueError, match="not a file directly in"):
        record.entry([str(tmp_path.parent / "a.txt")], "deadline", "x", folder=str(tmp_path))
    e = record.entry([str(tmp_path / "a.txt")], "deadline", "x", folder=str(tmp_path))
    record.register(e, str(tmp_path))
    with pytest.raises(ValueError, match="already in"):
        record.register(e, str(tmp_path))
    gone = dict(e, id="b", files=["b.txt"])
    with pytest.raises(ValueError, match="not in"):
        record.register(gone, str(tmp_path))


def test_record_add_registers_a_result_made_by_hand(tmp_path):
    (tmp_path / "bench_sync_by_hand.json").write_text("{}")
    rc = record.main(["add", str(tmp_path / "bench_sync_by_hand.json"), "--target",
                      "default-step", "--what", "mpifusion bench by hand", "--mpi",
                      "Open MPI v5.0.11", "--default-strategy", "shm", "--setting", "one node",
                      "--date", "2026-12-07T10:00:00Z", "--results", str(tmp_path)])
    assert rc == 0
    (e,) = _index(str(tmp_path))["results"]
    assert e["date"] == "2026-12-07T10:00:00Z" and e["date_source"] == "given"
    assert e["machine"]["mpi"] == ["Open MPI v5.0.11"]


def test_every_script_records_its_results():
    """Each script takes --results/--no-record and goes through record.py: none writes a
    result beside the scripts or without its entry."""
    for name in sorted(os.listdir(BENCH)):
        if not name.endswith(".py") or name in ("record.py", "report.py"):
            continue
        text = open(os.path.join(BENCH, name)).read()
        assert "record.add_arguments(" in text, name
        assert re.search(r"record\.(recorded|save|start)\(", text), name
        # no default output path next to the scripts (the old "benchmarks/<name>_<mpi>")
        assert not re.search(r"""["']benchmarks/(?!results)\w+\.(txt|json|png)""", text), name


# -------------------------------------------------------- report.py: old is said to be old

def _entry(**kw):
    e = {"id": "r", "files": ["r.txt"], "target": "deadline", "what": "x",
         "date": "2026-12-03T10:00:00Z", "commit": "a" * 40,
         "machine": {"cpu": "AMD EPYC", "cores": 2, "memory_gib": 23, "mpi": ["MPICH 5.0.2"]},
         "default_strategy": "shm", "setting": "one node"}
    e.update(kw)
    return e


def test_a_result_under_another_default_is_marked_old():
    now = report.current_default("one node")
    assert now in STRATEGIES
    other = next(s for s in ("thread", "shm") if s != now)
    old = " ".join(report.provenance([_entry(default_strategy=other)]))
    assert "**Old results only**" in old and f"`{other}`" in old and f"`{now}`" in old
    current = " ".join(report.provenance([_entry(default_strategy=now)]))
    assert "Old results" not in current and current.count("Current:") == 1
    mixed = " ".join(report.provenance([_entry(default_strategy=now),
                                        _entry(id="s", default_strategy=other)]))
    assert "**Old results only**" in mixed
    neutral = " ".join(report.provenance([_entry(default_strategy=None, setting=None,
                                                 machine=dict(_entry()["machine"], mpi=[]))]))
    assert "Does not depend on the communication strategy" in neutral
    # the date, the commit and the machine are always said
    for text in (old, current, neutral):
        assert "2026-12-03 10:00 UTC" in text and "commit aaaaaaa" in text
        assert "AMD EPYC, 2 cores, 23 GiB" in text


def test_the_latest_result_of_each_mpi_is_the_one_shown():
    a = _entry(id="a", date="2026-12-01T00:00:00Z")
    b = _entry(id="b", date="2026-12-02T00:00:00Z")
    c = _entry(id="c", date="2026-12-01T12:00:00Z",
               machine=dict(_entry()["machine"], mpi=["Open MPI v5.0.11"]))
    assert [e["id"] for e in report.latest_per_mpi([a, c, b])] == ["b", "c"]


def test_the_scripts_import_the_helpers_by_name():
    """``python benchmarks/x.py`` puts benchmarks/ first on sys.path: ``import record``
    must find benchmarks/record.py (no module of that name elsewhere on the path wins)."""
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]);"
                           " import record, report; print(record.__file__, report.__file__)",
                           BENCH], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [os.path.join(BENCH, "record.py"),
                                   os.path.join(BENCH, "report.py")]
