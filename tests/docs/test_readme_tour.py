"""The README's API tour runs as written under mpiexec -n 4 and prints what it promises."""
import re
import sys
from pathlib import Path

from tests.helpers import run_job

ROOT = Path(__file__).resolve().parents[2]


def tour_code():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using the API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_example_file_is_the_readme_block():
    example = (ROOT / "examples" / "api_tour.py").read_text()
    assert example.endswith(tour_code())


def test_api_tour_runs_under_mpiexec(tmp_path):
    script = tmp_path / "tour.py"
    script.write_text(tour_code())
    out = run_job(4, [sys.executable, str(script)], timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = re.findall(r"rank (\d) (\w+): .*?([\d.]+), expected ([\d.]+)", out.stdout)
    # all-reduce and reduce-scatter on 4 ranks, reduce on its root only
    assert sorted((act, rank) for rank, act, _, _ in lines) == sorted(
        [("ALL_REDUCE", str(r)) for r in range(4)] + [("REDUCE", "0")]
        + [("REDUCE_SCATTER", str(r)) for r in range(4)])
    assert all(float(got) == float(want) == 5.0 for _, _, got, want in lines)
