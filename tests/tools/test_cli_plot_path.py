"""``mpifusion check --plot PATH``: the path printed is the file written, and a path that
names a directory is refused (exit 2, one line) before anything is checked or drawn."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers import run_cli

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def dump(tmp_path):
    """A passing 2-rank all_reduce dump of one small param (sum, one micro-step)."""
    rng = np.random.default_rng(0)
    ins = [rng.standard_normal(5).astype(np.float32) for _ in range(2)]
    total = ins[0] + ins[1]
    folder = tmp_path / "dump"
    folder.mkdir()
    for r, x in enumerate(ins):
        np.savez(folder / f"rank{r}.npz", **{"in/w/0": x, "out/w": total})
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"params": [{"name": "w", "shape": [5], "dtype": "float32"}],
                                "act": "all_reduce", "nranks": 2, "acc_steps": 1,
                                "average": False}))
    return str(spec), str(folder)


def _plot_line(out: str) -> str:
    (line,) = [x for x in out.splitlines() if x.startswith("plot: ")]
    return line[len("plot: "):]


def test_path_without_extension_prints_the_png_it_writes(capsys, tmp_path, dump):
    pytest.importorskip("matplotlib")
    spec, folder = dump
    target = tmp_path / "noext"
    code, out, err = run_cli(capsys, "check", "--spec", spec, folder, "--plot", str(target))
    assert code == 0, out + err
    written = _plot_line(out)
    assert written == f"{target}.png"
    assert open(written, "rb").read(8) == PNG and not target.exists()


def test_path_with_extension_is_written_as_given(capsys, tmp_path, dump):
    pytest.importorskip("matplotlib")
    spec, folder = dump
    target = tmp_path / "err.png"
    code, out, _ = run_cli(capsys, "check", "--spec", spec, folder, "--plot", str(target))
    assert code == 0 and _plot_line(out) == str(target)
    assert target.read_bytes()[:8] == PNG


@pytest.mark.parametrize("form", ["slash", "existing", "dot"])
def test_directory_is_refused_with_one_line(capsys, tmp_path, dump, form):
    spec, folder = dump
    plots = tmp_path / "plots"
    plots.mkdir()
    arg = {"slash": str(plots) + os.sep, "existing": str(plots),
           "dot": str(plots / ".")}[form]
    code, out, err = run_cli(capsys, "check", "--spec", spec, folder, "--plot", arg)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"mpifusion check: error: --plot: {arg}: names a directory"), line
    assert os.listdir(plots) == [] and not (tmp_path / "plots.png").exists()


def test_trailing_separator_of_a_missing_directory_is_refused(capsys, tmp_path, dump):
    spec, folder = dump
    arg = str(tmp_path / "nosuch") + os.sep
    code, out, err = run_cli(capsys, "check", "--spec", spec, folder, "--plot", arg)
    assert code == 2 and out == "" and "names a directory" in err
    assert not (tmp_path / "nosuch").exists()
