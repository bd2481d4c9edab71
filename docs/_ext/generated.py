"""A Sphinx extension that writes the site's generated parts into ``docs/_generated/`` when
the build starts, from their single definitions in the code:

* ``environment.md``: the table of every environment variable, from
  ``mpifusion.config.ENVIRONMENT`` (included by ``environment.md``);
* ``figures/{name}.svg``: the pictures of ``figures.py`` (shown by ``concepts.md`` and
  ``state-machine.md``).

A file is rewritten only when its bytes change, so a rebuild stays incremental.
``docs/_generated/`` is not committed (.gitignore): the build always makes it afresh.
"""
from __future__ import annotations

import io
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "_generated"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def environment_table(environment=None) -> str:
    """The Markdown table of ``environment`` (default: ``mpifusion.config.ENVIRONMENT``)."""
    if environment is None:
        from mpifusion.config import ENVIRONMENT as environment
    lines = ["| variable | sets | takes | when unset | meaning |",
             "| --- | --- | --- | --- | --- |"]
    for var in environment:
        sets = f"`{var.option}`" if var.field or "(" in var.option else var.option
        if var.reader != "mpifusion":
            sets += f" (`{var.reader}`)"
        lines.append("| " + " | ".join(_cell(c) for c in (
            f"`{var.name}`", sets, var.values, var.default, var.meaning)) + " |")
    return "\n".join(lines) + "\n"


def figure_svg(draw) -> bytes:
    """One figure of ``figures.FIGURES`` as SVG bytes, the same bytes on every build."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import rc_context

    with rc_context({"svg.hashsalt": "mpifusion", "svg.fonttype": "path",
                     "font.family": "DejaVu Sans"}):
        fig = draw()
        out = io.BytesIO()
        fig.savefig(out, format="svg", metadata={"Date": None})
    return out.getvalue()


def write_if_changed(path: Path, data: bytes) -> bool:
    """Write ``data`` unless ``path`` already holds it; True when written."""
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temporary file of this process's own, then renamed: two builds at once (tests running
    # side by side) never read a half-written file or rename each other's
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(data)
    os.replace(f.name, path)
    return True


def generate(out: Path = OUT) -> list:
    """Every generated file under ``out``; returns the paths written (those that changed)."""
    if str(HERE) not in sys.path:  # figures.py beside this file (conf.py adds it too)
        sys.path.insert(0, str(HERE))
    from figures import FIGURES

    written = []
    files = {out / "environment.md": environment_table().encode()}
    for name, draw in FIGURES.items():
        files[out / "figures" / f"{name}.svg"] = figure_svg(draw)
    for path, data in files.items():
        if write_if_changed(path, data):
            written.append(path)
    return written


def _builder_inited(app) -> None:
    generate()


def setup(app):
    app.connect("builder-inited", _builder_inited)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
