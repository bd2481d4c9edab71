"""``mpifusion check --plot``: error/bound per param and rank, so a reader sees at a glance
where an implementation strays. matplotlib is imported only here (``pip install
'mpifusion[bench]'``)."""
from __future__ import annotations

import math
import os
from typing import Any

from ..errors import FusionError

#: ratios below this (bit-exact results included) are drawn at this floor of the log axis
FLOOR = 1e-6


class PlotError(FusionError, ValueError):
    """The plot cannot be drawn (matplotlib missing, or the file cannot be written)."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotError("matplotlib is not installed (pip install matplotlib, or "
                        "pip install 'mpifusion[bench]')") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_path(path: Any) -> str:
    """The file ``plot_report`` writes for ``path``: ``path`` itself when it has an extension
    (which picks the format, as matplotlib does), else ``path`` + ``.png``. A path that names
    a directory (an existing one, or one ending in a separator) is a :class:`PlotError`."""
    text = os.fspath(path)
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    if not text or text.endswith(seps) or os.path.basename(text) in ("", ".", "..") or \
            os.path.isdir(text):
        raise PlotError(f"{text or repr(text)}: names a directory, not a file (give a file "
                        f"name such as {os.path.join(text or '.', 'check.png')})")
    if not os.path.splitext(text)[1][1:]:  # no extension (or a trailing dot): PNG
        text = text.rstrip(".") + ".png"
        if os.path.isdir(text):
            raise PlotError(f"{text}: names a directory, not a file")
    return text


def plot_report(report: Any, path: Any) -> str:
    """Horizontal bars of max |error| / bound per param (rows) and rank (one colour each) on
    a log axis with the bound (1) marked; failing params in red, all-gather mismatches and
    shard gaps listed below. Returns the path written (:func:`plot_path`)."""
    path = plot_path(path)
    fmt = os.path.splitext(path)[1][1:].lower()
    plt = _pyplot()
    names = [s.name for s in report.stats]
    ranks = sorted({r for per in report.rank_stats.values() for r in per})
    reasons = report.reasons()
    extra = [f"{n}: {why}" for n, kind, why in report.failures() if kind != "grad"]
    rows = max(len(names), 1)
    fig_h = min(2.0 + 0.32 * rows * max(1.0, len(ranks) / 3) + 0.22 * min(len(extra), 12), 60)
    fig, ax = plt.subplots(figsize=(10, fig_h))
    if names:
        height = 0.8 / max(len(ranks), 1)
        cmap = plt.get_cmap("tab10")
        top = max([1.0] + [st.max_ratio for per in report.rank_stats.values()
                           for st in per.values() if math.isfinite(st.max_ratio)])
        right = top * 40  # the axis' end: an infinite ratio is drawn up to it, hatched
        for i, rank in enumerate(ranks):
            for j, name in enumerate(names):
                st = report.rank_stats.get(name, {}).get(rank)
                if st is None:
                    continue
                ratio = st.max_ratio
                y = j - 0.4 + height * (i + 0.5)
                inf = not math.isfinite(ratio)
                x = right if inf else max(ratio, FLOOR)
                ax.barh([y], [x], height=height * 0.9, color=cmap(i % 10),
                        hatch="xx" if inf else None, edgecolor="white" if inf else None,
                        linewidth=0,
                        label=f"rank {rank}" if j == min(
                            k for k, nm in enumerate(names)
                            if rank in report.rank_stats.get(nm, {})) else None)
                label = "inf (Inf/NaN or exceeds a zero bound)" if inf else (
                    "0" if ratio == 0 else f"{ratio:.2g}")
                if inf:
                    ax.annotate(label, (1.0, y), xytext=(6, 0), textcoords="offset points",
                                va="center", ha="left", fontsize=7, color="red",
                                fontweight="bold",
                                bbox={"boxstyle": "round,pad=0.15", "fc": "white",
                                      "ec": "red", "lw": 0.6})
                elif len(names) * len(ranks) <= 60:
                    ax.annotate(label, (x, y), xytext=(3, 0), textcoords="offset points",
                                va="center", fontsize=7)
        ax.set_xscale("log")
        ax.set_xlim(FLOOR / 2, right)
        ax.axvline(1.0, color="red", linestyle="--", linewidth=1.2, label="bound (1)")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        for tick, name in zip(ax.get_yticklabels(), names):
            if name in reasons:
                tick.set_color("red")
                tick.set_fontweight("bold")
        ax.invert_yaxis()
        ax.set_xlabel(f"max |error| / bound (log; bit-exact drawn at {FLOOR:g}; > 1 fails)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no gradients checked (all-gather only)", ha="center")
    spec = report.spec
    verdict = (f"FAIL ({len(reasons)} param(s))" if not report.ok else
               "WEAK (inputs cannot reveal a missing reduction)" if report.weak else "PASS")
    title = f"mpifusion check: {verdict}"
    if spec is not None:
        title += (f"\n{spec.act}, {spec.nranks} rank(s), acc_steps {spec.acc_steps}, "
                  f"{'mean' if spec.average else 'sum'}")
    ax.set_title(title, fontsize=10, color="black" if report.ok else "red")
    if extra:
        shown = extra[:12] + ([f"... and {len(extra) - 12} more"] if len(extra) > 12 else [])
        fig.text(0.01, 0.01, "\n".join(shown), fontsize=7, color="red", va="bottom",
                 family="monospace")
        fig.subplots_adjust(bottom=min(0.5, 0.06 + 0.22 * len(shown) / fig_h))
    fig.tight_layout(rect=(0, min(0.5, 0.22 * len(extra[:13]) / fig_h), 1, 1))
    try:
        fig.savefig(path, dpi=110, format=fmt)  # the format given: matplotlib adds nothing
    except (OSError, ValueError) as exc:
        raise PlotError(f"{path}: cannot write: {getattr(exc, 'strerror', None) or exc}") from None
    finally:
        plt.close(fig)
    return path
