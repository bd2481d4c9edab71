"""The three patterns of the docs (docs/patterns-spawn.md, patterns-steps.md,
patterns-in-rank.md) run as a user runs them: each page's ``python`` blocks, in order, are
written out as one test file, and a pytest of its own (``-p mpifusion.oracle.pytest_plugin``,
as the pages say) runs the three files once; each test here reads what that run said of one
of the user's tests. The code comes from the pages, so the pages cannot drift from it."""
from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.helpers import run_cmd

ROOT = Path(__file__).resolve().parents[2]
PAGES = {"spawn": "patterns-spawn.md", "steps": "patterns-steps.md",
         "in_rank": "patterns-in-rank.md"}


def page(name: str) -> str:
    return (ROOT / "docs" / PAGES[name]).read_text(encoding="utf-8")


def blocks(name: str, lang: str) -> list:
    return re.findall(rf"^```{lang}\n(.*?)^```", page(name), re.S | re.M)


@pytest.fixture(scope="module")
def user_run(tmp_path_factory) -> dict:
    """``{test name: (outcome, text)}`` of one pytest run over the pages' test files;
    ``text`` is what pytest reported of a failure (the longrepr), else ''."""
    pytest.importorskip("torch")
    work = tmp_path_factory.mktemp("user")
    for name in PAGES:
        (work / f"test_{name}_pattern.py").write_text("\n\n".join(blocks(name, "python")),
                                                      encoding="utf-8")
    xml = work / "junit.xml"
    out = run_cmd([sys.executable, "-m", "pytest", "-p", "mpifusion.oracle.pytest_plugin",
                   "-p", "no:cacheprovider", "-q", "-rA", f"--junitxml={xml}",
                   f"--basetemp={work / 'tmp'}", "-W", "error::mpifusion.errors.OracleWarning",
                   str(work)], timeout=400, cwd=str(work), stderr_to_stdout=True)
    assert xml.exists(), out.stdout[-5000:]
    results = {"__stdout__": ("", out.stdout)}
    for case in ET.parse(xml).getroot().iter("testcase"):
        failed = case.find("failure")
        if failed is None:
            failed = case.find("error")
        if failed is not None:
            results[case.get("name")] = ("failed", failed.text or "")
        elif case.find("skipped") is not None:
            results[case.get("name")] = ("skipped", case.find("skipped").get("message", ""))
        else:
            results[case.get("name")] = ("passed", "")
    return results


def outcome(results: dict, test: str) -> tuple:
    assert test in results, f"{test}: not run\n{results['__stdout__'][1][-5000:]}"
    return results[test]


def test_the_pages_hold_the_patterns():
    assert [len(blocks(n, "python")) for n in PAGES] == [3, 2, 2]
    # the development page says how the suite runs the pages (user pages cite no test
    # file), and each page is in the docs' toctree
    development = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    assert "tests/oracle/test_user_patterns.py" in development
    for name in PAGES:
        assert PAGES[name][:-3] in (ROOT / "docs" / "index.md").read_text(encoding="utf-8")


def test_spawned_ranks_save_and_the_fixture_passes(user_run):
    assert outcome(user_run, "test_bucket_reducer") == ("passed", "")


def test_no_reduction_on_the_same_data_fails_with_one_line(user_run):
    """A reducer that does nothing, the same seed on every rank: passed before ("1
    passed"); now the fixture fails it with the page's one line, and nothing else."""
    state, text = outcome(user_run, "test_no_reduction_same_data")
    assert state == "failed"
    (line,) = blocks("spawn", "text")
    assert text.strip() == line.strip(), text


def test_allow_weak_passes_without_a_warning(user_run):
    assert outcome(user_run, "test_no_reduction_same_data_allowed") == ("passed", "")
    # -W error::OracleWarning would have failed it; and pytest printed no warning of ours
    assert "OracleWarning" not in user_run["__stdout__"][1]


def test_steps_pass_and_a_missing_zero_grad_is_stale_at_step_1(user_run):
    assert outcome(user_run, "test_two_steps") == ("passed", "")
    state, text = outcome(user_run, "test_two_steps_without_zero_grad")
    assert state == "failed"
    assert text.startswith("mpifusion oracle: FAIL\n"), text[:500]
    (shown,) = blocks("steps", "text")
    for line in shown.strip().splitlines():
        assert line in text.splitlines(), f"{line!r} not in\n{text}"
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert f"step 1: {name}: stale: holds step 1's result plus step 0's" in text, text
    assert text.rstrip().splitlines()[-1].startswith("FAIL: step 1 of 2: "), text[-300:]


def test_in_rank_check_fails_with_the_report_first(user_run):
    assert outcome(user_run, "test_in_rank") == ("passed", "")
    state, text = outcome(user_run, "test_in_rank_sum_for_mean")
    assert state == "failed"
    lines = text.strip().splitlines()
    (shown,) = blocks("in_rank", "text")
    for i, want in enumerate(shown.strip().splitlines()):
        if want == "...":
            break
        pattern = ".*".join(map(re.escape, want.split("...")))
        assert re.fullmatch(pattern, lines[i]), f"line {i}: {lines[i]!r}\nexpected {want!r}"
    assert "Traceback" not in text and "ProcessRaisedException" not in text, text
    assert len(lines) < 40, text  # the report, not a child's traceback
    assert "FAIL: wrong on ranks [0, 1]" in text, text


def test_a_capture_leaves_no_reference_cycle_through_the_params():
    """The hooks hold the capture weakly: a cycle param -> hook -> capture -> param was freed
    only by the cyclic GC, at worst at the spawned rank's interpreter exit, after torch's own
    teardown, and the rank aborted now and then (SIGABRT)."""
    import gc

    torch = pytest.importorskip("torch")
    from mpifusion.capture import TorchCapture

    def step():
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        cap = TorchCapture(model)
        for _ in range(2):
            model(torch.randn(2, 3)).sum().backward()
        cap.record_outputs()
        assert cap.acc_steps == 2 and sorted(cap.to_dict())[0] == "in/0.bias/0"

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        step()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = [type(o).__name__ for o in gc.garbage
                 if type(o).__name__ in ("TorchCapture", "Parameter")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert found == [], found
