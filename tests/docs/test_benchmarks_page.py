"""docs/benchmarks.md and docs/performance.md's headline table are what
``benchmarks/report.py`` builds from the latest results in ``benchmarks/results/``: a new or
changed result, or a change of the default strategy, leaves them stale until ``python
benchmarks/report.py --write``; each table says the date, the commit and the machine of its
results, and a table whose results predate today's default says so; BENCHMARKS.md (the
archive) points to the current page."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")


def _load_report():
    spec = importlib.util.spec_from_file_location(
        "benchmarks_report_under_test", os.path.join(ROOT, "benchmarks", "report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report = _load_report()


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        return fh.read()


def _block(text: str, name: str) -> str:
    start, end = report.MARK.format(name), report.END.format(name)
    assert text.count(start) == 1 and text.count(end) == 1, name
    return text[text.index(start) + len(start):text.index(end)]


def test_the_pages_are_what_the_results_build():
    stale = report.stale()
    assert stale == [], (f"{', '.join(stale)}: not what benchmarks/results/ builds; run "
                         "python benchmarks/report.py --write")


def test_a_new_result_makes_the_pages_stale(tmp_path):
    """The check can fail: the latest default-step run of one MPI, 10% faster, is a new
    result the pages do not show yet."""
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    entries = report.load(str(results))
    latest = report.latest_per_mpi(report.of(entries, "default-step", ".json"))[0]
    path = report.path(latest, ".json")
    with open(path) as fh:
        res = json.load(fh)
    step = res["steps"][f"ALL_REDUCE [{res['meta']['default_strategy']}]"]
    step["median_s"] *= 0.9
    step["times_s"] = [t * 0.9 for t in step["times_s"]]
    with open(path, "w") as fh:
        json.dump(res, fh)
    assert sorted(report.stale(folder=str(results))) == ["docs/benchmarks.md",
                                                         "docs/performance.md"]
    # and a result of a target with no table yet still lands in the index block
    index = json.loads((results / "index.json").read_text())
    index["results"].append(dict(index["results"][-1], id="extra", files=["extra.txt"],
                                 target="floors", date="2030-01-01T00:00:00Z"))
    (results / "extra.txt").write_text("| a |\n| --- |\n| 1 |\n")
    (results / "index.json").write_text(json.dumps(index))
    blocks = report.build(report.load(str(results)))
    assert "`extra`" in blocks["index"] and "`floors`" not in blocks["current"].split(
        "No recorded result yet")[-1]


def _sections(block: str):
    """{title: text} of the ``### `` sections of a generated block."""
    parts = re.split(r"^### (.+)$", block, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_table_says_when_where_and_whether_it_is_current():
    entries = {e["id"]: e for e in report.load()}
    sections = _sections(_block(_read("docs/benchmarks.md"), "current"))
    tables = {t: s for t, s in sections.items() if "| --- |" in s}
    assert len(tables) >= 10, sorted(sections)
    for title, text in tables.items():
        said = text.split("\n\n", 2)[1] if text.startswith("\n\n") else text
        assert re.search(r"Measured .*\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", said), title
        assert re.search(r"commit [0-9a-f]{7}", said), title
        assert re.search(r"\d+ cores", said), title
        ids = re.findall(r"\(`([\w-]+)`\)", said.splitlines()[0]) or re.findall(
            r"`([\w-]+)`", said.splitlines()[0])
        used = [entries[i] for i in ids if i in entries]
        assert used, title
        for e in used:
            assert e["machine"]["cpu"] in said and e["date"][:10] in said, title
        then = {e["default_strategy"] for e in used} - {None}
        if not then:
            assert "Does not depend on the communication strategy" in said, title
            continue
        setting = next(e["setting"] for e in used if e["setting"])
        now = report.current_default(setting)
        if then != {now}:
            assert "**Old results only**" in said and f"now takes `{now}`" in said, title
        else:
            assert "Old results" not in said and f"`{now}` then and takes it now" in said, title


def test_the_old_defaults_targets_are_marked_old_on_the_page():
    sections = _sections(_block(_read("docs/benchmarks.md"), "current"))
    old = {t for t, s in sections.items() if "**Old results only**" in s}
    # measured while thread was the default, none measured since (BENCHMARKS.md has them)
    for part in ("deadline", "window", "Segment size", "Growth with buffer size"):
        assert any(part in t for t in old), (part, sorted(old))
    assert not any("default path" in t for t in old)


def test_the_performance_headline_is_the_current_defaults_run():
    perf = _read("docs/performance.md")
    head = _block(perf, "headline")
    now = report.current_default("one node")
    assert f"| default step: `{now}` |" in head
    assert f"`{now}` then and takes it now" in head
    assert "Machine-dependent" in head
    assert re.search(r"Measured (by )?\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC[^,]*, commit "
                     r"[0-9a-f]{7}", head)
    assert re.search(r"on [^,]+, \d+ cores", head)
    # the thread-era headline (its table and plot) is the archive's now, not this page's
    assert "../benchmarks/bench_sync_mpich.png" not in perf
    assert "| 148 | 136 |" not in perf
    assert "up to 5x" not in perf


def test_the_current_page_is_in_the_site_and_the_archive_points_to_it():
    index = _read("docs/index.md")
    tree = index[index.index("```{toctree}"):]
    assert re.search(r"^benchmarks$", tree, flags=re.M)
    opening = "\n".join(_read("BENCHMARKS.md").splitlines()[:12])
    assert "docs/benchmarks.md" in opening and "archive" in opening
    page = _read("docs/benchmarks.md")
    assert "BENCHMARKS.md" in page.split(report.MARK.format("current"))[0]
