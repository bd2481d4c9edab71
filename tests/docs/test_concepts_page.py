"""docs/concepts.md: its pictures are drawn at build time and follow the code (the layout from
mpifusion's planner, ``auto``'s choices from ``resolve_strategy``), every picture is shown
on a page, and its ``fused_parameters`` example runs under mpiexec as it says."""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest

from mpifusion import FusedCommBuffer, fused_parameters, obtain_storage
from mpifusion.config import STRATEGIES
from tests.helpers import run_job
from tests.docs.pages import load_ext

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGE = DOCS / "concepts.md"
FIGURE_REF = re.compile(r"_generated/figures/([\w-]+)\.svg")


@pytest.fixture(scope="module")
def ext():
    return load_ext("figures"), load_ext("generated")


def test_every_figure_is_shown_and_every_shown_figure_is_drawn(ext):
    figures, _ = ext
    shown = {m.group(1): page.name for page in DOCS.glob("*.md")
             for m in FIGURE_REF.finditer(page.read_text())}
    assert set(shown) == set(figures.FIGURES), (sorted(shown), sorted(figures.FIGURES))
    assert "state-machine" in (DOCS / "state-machine.md").read_text()
    for name in ("layout", "hooks", "actions", "strategies", "oracle"):
        assert f"_generated/figures/{name}.svg" in PAGE.read_text(), name


def test_figures_draw_the_same_svg_every_time(ext):
    figures, generated = ext
    for name, draw in figures.FIGURES.items():
        svg = generated.figure_svg(draw)
        assert svg.startswith(b"<?xml") and b"<svg" in svg, name
    again = generated.figure_svg(figures.FIGURES["layout"])
    assert again == generated.figure_svg(figures.FIGURES["layout"])


def test_the_layout_picture_follows_the_planner(ext):
    figures, _ = ext
    groups = figures.example_groups()
    # the example shows both grouping cases (a group closed at the limit, one left open)
    # and both slot cases (a param already aligned, padded ones)
    assert len(groups) == 2
    sizes = [sum(figures.example_metas()[i].nbytes for i in group) for group, _ in groups]
    assert sizes[0] >= figures.EXAMPLE_GROUP_BYTES > sizes[1]
    slots = [s for _, layout in groups for s in layout.slots]
    assert any(s.padded_numel == s.numel for s in slots)
    assert any(s.padded_numel > s.numel for s in slots)
    assert all((s.offset * 4) % 256 == 0 for s in slots)


def test_auto_resolves_as_drawn(ext):
    figures, _ = ext
    from mpifusion.comm import communicator
    from mpifusion.comm.communicator import resolve_strategy

    try:  # the threshold of auto across nodes (a Tuning field; once a module constant)
        from mpifusion.comm import tuning
        threshold = tuning.current().auto_hierarchical_min_bytes
    except ImportError:
        threshold = communicator.AUTO_HIERARCHICAL_MIN_BYTES
    assert figures.AUTO_SMALL_BYTES == threshold
    for case, kwargs, expected in figures.AUTO_CASES:
        got, why = resolve_strategy("auto", **kwargs)
        assert got == expected, (case, kwargs, got, why)
    assert {c[2] for c in figures.AUTO_CASES} == set(STRATEGIES)
    # the page's table says the same
    text = PAGE.read_text()
    for strategy in STRATEGIES:
        assert f"| `{strategy}` |" in text, strategy


def example_code() -> str:
    text = PAGE.read_text()
    section = text[text.index("## A whole model: `fused_parameters`"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_fused_parameters_takes_acc_step_where_the_buffer_takes_acc_steps():
    assert "acc_step" in inspect.signature(fused_parameters).parameters
    assert "acc_steps" not in inspect.signature(fused_parameters).parameters
    assert "acc_steps" in inspect.signature(FusedCommBuffer).parameters
    assert "acc_steps" in inspect.signature(obtain_storage).parameters
    assert "acc_step=2" in example_code()


@pytest.mark.timeout(240)
def test_fused_parameters_example_runs_under_mpiexec(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example_code())
    out = run_job(2, [sys.executable, str(script)], timeout=180, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # (the launcher may join the ranks' lines: match each one, not whole lines)
    lines = sorted(re.findall(r"rank (\d): (buffers .*?expected [\d.]+)", out.stdout))
    said = ("buffers [['embed', 'fc.weight'], ['fc.bias']], fc.bias.grad[0] = 3.0, "
            "expected 3.0")
    assert lines == [("0", said), ("1", said)], out.stdout
    assert said.replace("\n", " ") in " ".join(PAGE.read_text().split())
