"""The site's pictures, drawn with matplotlib when the docs are built (no image is committed).

Each function of :data:`FIGURES` returns a matplotlib ``Figure``; ``generated.py`` writes
them as SVG into ``docs/_generated/figures/`` and the pages show them with ``{figure}``.
Where a picture states what the code does (a layout, the choice of ``auto``), it is drawn
from the code or from cases that ``tests/docs/test_concepts_page.py`` checks against it.
Coordinates are inches: a figure of ``W x H`` inches has axes from 0 to W and 0 to H.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from mpifusion.plan.layout import (ALIGNMENT_BYTES, TensorMeta, group_indices_by_size,
                                   plan_flat, plan_sharded)

INK = "#262626"
MUTED = "#6b6b6b"
PAD_FACE = "#f0f0f0"
#: one colour per param of the example model, and per rank
PARAM_COLOURS = ("#8ecae6", "#ffb703", "#b5e48c", "#f4a3c1", "#cdb4db")
RANK_COLOURS = ("#8ecae6", "#ffb703", "#b5e48c")
REDUCED = "#5e548e"
QUESTION = "#f6f6f6"
STRATEGY_COLOURS = {"thread": "#8ecae6", "nonblocking": "#ffd6a5", "shm": "#b5e48c",
                    "hierarchical": "#cdb4db"}

#: The example model of the layout and hook pictures: (name, shape), all float32, grouped
#: with a limit of EXAMPLE_GROUP_BYTES (Paddle's rule: a group closes right after the
#: param that brings it to the limit).
EXAMPLE_PARAMS = (("embed", (8, 8)), ("fc.weight", (6, 10)), ("fc.bias", (10,)),
                  ("head.weight", (5, 10)), ("head.bias", (3,)))
EXAMPLE_GROUP_BYTES = 512

#: How ``auto`` resolves, as the strategy picture draws it: per answer, the arguments of
#: ``mpifusion.comm.communicator.resolve_strategy`` that lead there and the strategy it
#: must return (the test calls it with each). ``AUTO_SMALL_BYTES`` is the drawn threshold.
AUTO_SMALL_BYTES = 256 << 10
AUTO_CASES = (
    ("not at MPI_THREAD_MULTIPLE", dict(size=8, per_node=8, thread_multiple=False),
     "nonblocking"),
    ("one rank", dict(size=1, per_node=1, thread_multiple=True), "thread"),
    ("nodes of unequal size", dict(size=5, per_node=2, uneven="nodes hold 3, 2 ranks",
                                   thread_multiple=True), "thread"),
    ("all ranks on one node", dict(size=8, per_node=8, thread_multiple=True), "shm"),
    ("one rank per node", dict(size=4, per_node=1, thread_multiple=True), "thread"),
    ("several nodes, small buffer", dict(size=8, per_node=4, thread_multiple=True,
                                         nbytes=AUTO_SMALL_BYTES - 4), "thread"),
    ("several nodes, large buffer", dict(size=8, per_node=4, thread_multiple=True,
                                         nbytes=AUTO_SMALL_BYTES), "hierarchical"),
    ("several nodes, size unknown", dict(size=8, per_node=4, thread_multiple=True),
     "hierarchical"),
)


# --------------------------------------------------------------------------- drawing helpers


def canvas(width: float, height: float) -> tuple:
    """A figure of ``width x height`` inches whose data coordinates are inches."""
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def box(ax, x: float, y: float, w: float, h: float, text: str = "", face: str = "white",
        size: float = 8.5, weight: str = "normal", edge: str = INK, round_: bool = True,
        align: str = "center", lw: float = 0.9) -> FancyBboxPatch:
    """A box with its lower-left corner at (x, y) and ``text`` in it."""
    style = "round,pad=0,rounding_size=0.07" if round_ else "square,pad=0"
    patch = FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=face, edgecolor=edge,
                           linewidth=lw)
    ax.add_patch(patch)
    if text:
        tx = x + w / 2 if align == "center" else x + 0.08
        ax.text(tx, y + h / 2, text, ha=align, va="center", fontsize=size, color=INK,
                weight=weight, linespacing=1.25)
    return patch


def arrow(ax, a, b, text: str = "", rad: float = 0.0, at: Optional[tuple] = None,
          size: float = 7.5, colour: str = INK, style: str = "-|>", ha: str = "center",
          lw: float = 0.9) -> FancyArrowPatch:
    """An arrow from ``a`` to ``b`` (points, or patches: it then starts and ends at their
    edges), curved by ``rad``, with ``text`` at ``at`` (default: the middle)."""
    kwargs = dict(arrowstyle=style, mutation_scale=9, color=colour, linewidth=lw,
                  connectionstyle=f"arc3,rad={rad}", shrinkA=1, shrinkB=1)
    if isinstance(a, tuple) and isinstance(b, tuple):
        patch = FancyArrowPatch(a, b, **kwargs)
        mid = ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)
    else:
        ca, cb = _centre(a), _centre(b)
        patch = FancyArrowPatch(ca, cb, patchA=None if isinstance(a, tuple) else a,
                                patchB=None if isinstance(b, tuple) else b, **kwargs)
        mid = ((ca[0] + cb[0]) / 2, (ca[1] + cb[1]) / 2)
    ax.add_patch(patch)
    if text:
        x, y = at if at is not None else mid
        ax.text(x, y, text, ha=ha, va="center", fontsize=size, color=colour,
                linespacing=1.2,
                bbox=dict(boxstyle="square,pad=0.08", facecolor="white", edgecolor="none"))
    return patch


def _centre(obj) -> tuple:
    if isinstance(obj, tuple):
        return obj
    return (obj.get_x() + obj.get_width() / 2, obj.get_y() + obj.get_height() / 2)


def note(ax, x: float, y: float, text: str, size: float = 8, colour: str = MUTED,
         ha: str = "left", va: str = "center", **kwargs) -> None:
    ax.text(x, y, text, ha=ha, va=va, fontsize=size, color=colour, linespacing=1.25,
            **kwargs)


def title(ax, x: float, y: float, text: str, size: float = 9.5) -> None:
    ax.text(x, y, text, ha="left", va="center", fontsize=size, color=INK, weight="bold")


def flat_bar(ax, x0: float, y: float, layout, scale: float, h: float, colours: dict,
             light: bool = False) -> None:
    """A flat buffer: each slot in its param's colour, alignment padding hatched."""
    for slot in layout.slots:
        ax.add_patch(Rectangle((x0 + slot.offset * scale, y), slot.numel * scale, h,
                               facecolor=colours[slot.name], edgecolor=INK, linewidth=0.6,
                               alpha=0.55 if light else 1.0))
        pad = slot.padded_numel - slot.numel
        if pad:
            ax.add_patch(Rectangle((x0 + slot.end * scale, y), pad * scale, h,
                                   facecolor=PAD_FACE, edgecolor=MUTED, linewidth=0.5,
                                   hatch="////"))
    ax.add_patch(Rectangle((x0, y), layout.numel * scale, h, fill=False, edgecolor=INK,
                           linewidth=1.1))


def offsets(ax, x0: float, y: float, layout, scale: float) -> None:
    """The element offsets of a buffer's slots, under it."""
    marks = sorted({s.offset for s in layout.slots} | {layout.numel})
    for m in marks:
        ax.text(x0 + m * scale, y, str(m), ha="center", va="top", fontsize=7, color=MUTED)


# --------------------------------------------------------------------------- the pictures


def example_metas() -> list:
    return [TensorMeta(name, shape, "float32") for name, shape in EXAMPLE_PARAMS]


def example_groups() -> list:
    """The example model's buffers: ``[(indices, FlatLayout)]``, planned by mpifusion."""
    metas = example_metas()
    return [(group, plan_flat([metas[i] for i in group]))
            for group in group_indices_by_size(metas, EXAMPLE_GROUP_BYTES)]


def layout_figure() -> Figure:
    """Params -> one flat, aligned buffer per group -> param and grad views."""
    metas = example_metas()
    colours = {m.name: c for m, c in zip(metas, PARAM_COLOURS)}
    groups = example_groups()
    scale, gap, x0 = 0.024, 0.55, 0.95
    width = x0 + sum(layout.numel for _, layout in groups) * scale + gap + 0.25
    fig, ax = canvas(width, 5.6)
    starts, x = [], x0
    for _, layout in groups:
        starts.append(x)
        x += layout.numel * scale + gap

    # the params, as the model lists them, above the slot each one gets
    note(ax, 0.1, 4.86, "params", colour=INK, weight="bold")
    for (group, layout), start in zip(groups, starts):
        for slot in layout.slots:
            m = metas[[mm.name for mm in metas].index(slot.name)]
            px = start + slot.offset * scale
            ax.add_patch(Rectangle((px, 4.7), m.numel * scale, 0.3, facecolor=colours[m.name],
                                   edgecolor=INK, linewidth=0.6))
            ax.text(px, 5.04, f"{m.name} {list(m.shape)}", ha="left", va="bottom",
                    fontsize=7, color=INK)
            arrow(ax, (px + m.numel * scale / 2, 4.68), (px + m.numel * scale / 2, 3.92),
                  colour=MUTED, lw=0.7)
        nbytes = [metas[i].nbytes for i in group]
        closing = sum(nbytes) >= EXAMPLE_GROUP_BYTES
        total = " + ".join(str(b) for b in nbytes)
        why = (f"{total} = {sum(nbytes)} B >= {EXAMPLE_GROUP_BYTES} B: closes after "
               f"{metas[group[-1]].name}" if closing else
               f"{total} = {sum(nbytes)} B: the rest, left open at the end")
        ax.plot([start, start + layout.numel * scale], [5.3, 5.3], color=MUTED, linewidth=0.8)
        note(ax, start, 5.45, f"group {groups.index((group, layout))}: {why}", size=7)

    # the flat buffers: params, then grads at the same element offsets
    note(ax, 0.1, 3.7, "param\nbuffer", colour=INK, weight="bold")
    note(ax, 0.1, 2.85, "grad\nbuffer", colour=INK, weight="bold")
    for i, ((_, layout), start) in enumerate(zip(groups, starts)):
        flat_bar(ax, start, 3.5, layout, scale, 0.4, colours)
        offsets(ax, start, 3.46, layout, scale)
        flat_bar(ax, start, 2.65, layout, scale, 0.4, colours, light=True)
        offsets(ax, start, 2.61, layout, scale)
        note(ax, start, 2.28, f"buffer {i}: {layout.numel} float32 = {layout.nbytes} B",
             size=7.5, colour=INK)
    # the views
    first = groups[0][1].slots[1]
    vx = starts[0] + (first.offset + first.numel / 2) * scale
    note(ax, 0.1, 1.75,
         f"views: p.data = param_buffer[offset : offset + numel].reshape(shape); p.grad "
         f"(p.main_grad) = the same slice of the grad buffer,\nso backward and the optimizer "
         f"write straight into the buffers. e.g. {first.name}: "
         f"[{first.offset} : {first.end}] of buffer 0", size=7.5, colour=INK)
    arrow(ax, (vx, 1.98), (vx, 2.63), colour=INK, lw=0.8)

    # the legend and the rules
    ax.add_patch(Rectangle((0.1, 0.98), 0.3, 0.2, facecolor=PAD_FACE, edgecolor=MUTED,
                           linewidth=0.5, hatch="////"))
    note(ax, 0.5, 1.08,
         f"padding (zero): each param's bytes rounded up to a multiple of {ALIGNMENT_BYTES}, "
         f"i.e. {ALIGNMENT_BYTES // 4} float32 or {ALIGNMENT_BYTES // 2} float16/bfloat16 "
         f"elements", size=7.5)
    sharded = plan_sharded([metas[i] for i in groups[1][0]], 2)
    note(ax, 0.1, 0.52,
         f"REDUCE_SCATTER buffers pad each param to a multiple of ({ALIGNMENT_BYTES} B / "
         f"itemsize) x nranks elements instead, so the buffer splits into nranks equal "
         f"shards\n(buffer 1 at 2 ranks: {sharded.numel} elements, rank r owns "
         f"[r x {sharded.shard_numel}, (r + 1) x {sharded.shard_numel}); a shard may cut "
         f"a param).", size=7.5)
    return fig


def hooks_figure() -> Figure:
    """The hook order of two micro-steps over the example model's two buffers."""
    groups = example_groups()
    metas = example_metas()
    names = [m.name for m in metas]
    owner = {names[i]: b for b, (group, _) in enumerate(groups) for i in group}
    lanes = {"backward": 1.15, 1: 3.55, 0: 5.75, "comm": 7.85}
    acc_steps, row, top = 2, 0.27, 4.55
    fig, ax = canvas(9.0, 5.3)
    heads = {"backward": "backward\n(one hook per param)",
             1: "buffer 1: " + ", ".join(names[i] for i in groups[1][0]),
             0: "buffer 0: " + ", ".join(names[i] for i in groups[0][0]),
             "comm": "communication\n(one stream, start order)"}
    for key, x in lanes.items():
        ax.text(x, top + 0.47, heads[key], ha="center", va="center", fontsize=8,
                weight="bold", color=INK)
    y = top
    counts = dict.fromkeys(names, 0)
    checked = [0, 0]
    starts = {}
    for k in range(acc_steps):
        note(ax, 0.08, y, f"micro-step {k}", colour=INK, size=7.5, weight="bold")
        y -= row
        for name in reversed(names):  # backward visits the params in reverse
            b = owner[name]
            counts[name] += 1
            done = counts[name] == acc_steps
            checked[b] += done
            arrow(ax, (lanes["backward"] + 0.05, y), (lanes[b] - 0.05, y),
                  f"add_grad({name})", colour=INK, size=7,
                  at=((lanes["backward"] + lanes[b]) / 2 + 0.15, y + 0.1))
            state = f"{name}: {counts[name]}/{acc_steps}"
            if done:
                state += f", checked in ({checked[b]}/{len(groups[b][0])})"
            note(ax, lanes[b] + 0.08, y, state, size=6.8, colour=INK if done else MUTED)
            if checked[b] == len(groups[b][0]) and b not in starts:
                starts[b] = y
                arrow(ax, (lanes[b] + 0.05, y - 0.12), (lanes["comm"] - 0.05, y - 0.12),
                      "last check-in: start", colour=REDUCED, size=6.8,
                      at=(lanes["comm"] - 0.75, y - 0.12))
            y -= row
    # the collectives run in start order on the communication stream, beside the backward
    end = top
    for b in sorted(starts, key=lambda key: -starts[key]):
        begin = min(starts[b] - 0.12, end)
        length = 3.2 * row
        ax.add_patch(Rectangle((lanes["comm"] - 0.12, begin - length), 0.24, length,
                               facecolor=REDUCED, edgecolor=INK, linewidth=0.6))
        note(ax, lanes["comm"] + 0.2, begin - length / 2, f"buffer {b}:\ncollective",
             size=7, colour=INK)
        end = begin - length - 0.06
    y = min(y, end) - 0.12
    for x in lanes.values():
        ax.plot([x, x], [y + 0.15, top + 0.25], color="#c8c8c8", linewidth=0.8, zorder=0)
    note(ax, 0.08, y,
         "then, before the optimizer: scale_grads() on each buffer: wait for its collective, "
         "x 1/nranks if asked, counters back to 0 (step + 1)", colour=INK, size=7.5)
    return fig


def actions_figure() -> Figure:
    """What the collective leaves on 3 ranks for each action, and sync_params."""
    rows = (
        ("ALL_REDUCE", "all-reduce", [["S", "S", "S"]] * 3,
         "every rank holds\nthe result"),
        ("REDUCE (dst=0)", "reduce to dst", [["S", "S", "S"], ["L", "L", "L"], ["L", "L", "L"]],
         "only dst holds it;\nthe others keep\ntheir local values"),
        ("REDUCE_SCATTER", "reduce-scatter:\nrank r's shard r", [
            ["S0", "L", "L"], ["L", "S1", "L"], ["L", "L", "S2"]],
         "each rank holds its\nown shard, in place\n(where Paddle has it)"),
        ("sync_params", "all-gather", [["P0", "P1", "P2"]] * 3,
         "every rank holds\nevery shard again"),
    )
    fig, ax = canvas(9.0, 6.15)
    bar_w, bar_h, x_before, x_after, top = 2.1, 0.22, 2.0, 5.6, 5.55
    ax.text(x_before + bar_w / 2, 5.92, "before", ha="center", fontsize=8.5, weight="bold")
    ax.text(x_after + bar_w / 2, 5.92, "after", ha="center", fontsize=8.5, weight="bold")
    for i, (name, what, after, says) in enumerate(rows):
        y0 = top - i * 1.32
        ax.text(0.1, y0 - 0.37, name, ha="left", va="center", fontsize=8.5, weight="bold")
        note(ax, x_after + bar_w + 0.2, y0 - 0.37, says, size=7.2)
        for r in range(3):
            y = y0 - r * (bar_h + 0.07) - bar_h
            ax.text(x_before - 0.08, y + bar_h / 2, f"rank {r}", ha="right", va="center",
                    fontsize=7, color=MUTED)
            for part in range(3):
                w = bar_w / 3
                if name == "sync_params":  # before: only the own shard is up to date
                    before = f"P{r}" if part == r else "old"
                else:
                    before = "L"
                _cell(ax, x_before + part * w, y, w, bar_h, before, r)
                _cell(ax, x_after + part * w, y, w, bar_h, after[r][part], r)
        arrow(ax, (x_before + bar_w + 0.12, y0 - 0.37), (x_after - 0.12, y0 - 0.37), what,
              size=7.5, at=(x_before + bar_w + (x_after - x_before - bar_w) / 2, y0 - 0.1))
    note(ax, 0.1, 0.18,
         "L: the rank's own (local) gradient   S: the sum (or mean) over every rank   "
         "S_r: the reduced shard r   P_r: rank r's updated param shard   old: stale params",
         size=7.5, colour=INK)
    return fig


def _cell(ax, x: float, y: float, w: float, h: float, kind: str, rank: int) -> None:
    if kind.startswith("S"):
        face, text, colour = REDUCED, ("S" + ("_" + kind[1:] if kind[1:] else "")), "white"
    elif kind.startswith("P"):
        face, text, colour = RANK_COLOURS[int(kind[1:])], "P_" + kind[1:], INK
    elif kind == "old":
        face, text, colour = PAD_FACE, "old", MUTED
    else:
        face, text, colour = RANK_COLOURS[rank], "L", INK
    ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor=INK, linewidth=0.6))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=6.8, color=colour)


def strategies_figure() -> Figure:
    """How ``strategy="auto"`` picks one of the four strategies (``resolve_strategy``)."""
    fig, ax = canvas(9.0, 5.2)
    qx, qw, qh, lx, lw = 0.15, 2.75, 0.46, 3.75, 5.15
    questions = (
        ("MPI at MPI_THREAD_MULTIPLE?", "no", "nonblocking",
         "non-blocking calls (Iallreduce, ...) in segments, a window of\n"
         "them in flight; they move while a rank calls into mpifusion"),
        ("more than one rank, nodes of equal size?", "no", "thread",
         "blocking collectives in cache-sized segments, on a\ncommunication thread"),
        ("all ranks on one node?", "yes", "shm",
         "buffers in shared memory: each rank sums its slice of\n"
         "every rank's buffer; no messages"),
        ("several ranks per node?", "no", "thread", "as above: MPI between the nodes"),
        (f"buffer of {AUTO_SMALL_BYTES >> 10} KiB or more per rank?", "no", "thread",
         "one all-reduce: faster than two levels for small buffers"),
    )
    y = 4.3
    note(ax, qx, 5.0, 'strategy="auto" (the default); a strategy set by strategy= or '
         "MPIFUSION_COMM_STRATEGY is taken as is", colour=INK, size=8)
    previous = None
    for i, (question, leave, strategy, what) in enumerate(questions):
        q = box(ax, qx, y, qw, qh, question, face=QUESTION, size=8)
        if previous is not None:
            arrow(ax, previous, q, "yes" if questions[i - 1][1] == "no" else "no", size=7.5,
                  at=(qx + qw / 2 + 0.18, y + qh + 0.13))
        leaf = box(ax, lx, y - 0.02, lw, qh + 0.04, "", face=STRATEGY_COLOURS[strategy])
        ax.text(lx + 0.1, y + qh / 2, strategy, ha="left", va="center", fontsize=8.5,
                weight="bold", color=INK)
        ax.text(lx + 1.25, y + qh / 2, what, ha="left", va="center", fontsize=6.9, color=INK,
                linespacing=1.15)
        arrow(ax, q, leaf, leave, size=7.5, at=((qx + qw + lx) / 2, y + qh / 2 + 0.14))
        previous = q
        y -= 0.82
    last = box(ax, lx, y - 0.02, lw, qh + 0.04, "", face=STRATEGY_COLOURS["hierarchical"])
    ax.text(lx + 0.1, y + qh / 2, "hierarchical", ha="left", va="center", fontsize=8.5,
            weight="bold", color=INK)
    ax.text(lx + 1.25, y + qh / 2, "shm within each node, then MPI between the ranks\n"
            "that hold the same slice on every node", ha="left", va="center", fontsize=6.9,
            color=INK, linespacing=1.15)
    arrow(ax, (qx + qw / 2, y + 0.82), (lx - 0.03, y + qh / 2), "yes", rad=0.25, size=7.5,
          at=(qx + qw / 2 + 0.55, y + 0.25))
    return fig


def oracle_figure() -> Figure:
    """The oracle's flow: a framework's step, captured, checked, reported."""
    fig, ax = canvas(9.0, 4.5)
    w, h = 2.6, 1.45
    top, bottom = 2.6, 0.3
    xs = (0.2, 3.2, 6.2)
    step = box(ax, xs[0], top, w, h,
               "the step under test\n\nDDP, FSDP2, Megatron DDP,\nPaddle's FusedCommBuffer, JAX,"
               "\nyour own reducer", face="#ffffff")
    capture = box(ax, xs[1], top, w, h,
                  "capture\n\nTorchCapture, PaddleCapture,\nJaxCapture: hooks record each "
                  "rank's\nlocal grads per micro-step, then\nrecord_outputs() after the sync;"
                  "\ngather() or save(dir)",
                  face="#e9f5fb")
    records = box(ax, xs[2], top, w, h,
                  "records + spec\n\nrank{r}.npz or dicts: in/{name}/{k},\nout/{name} "
                  "(range/, shard/, param/);\nspec: act, nranks, acc_steps,\naverage, dst",
                  face="#e9f5fb")
    check = box(ax, xs[2], bottom, w, h,
                "check\n\nexact reference: each element's\nexact sum or mean, rounded once;"
                "\nbound: the implementation's own\nroundings; every element, every rank",
                face="#efeaf7")
    report = box(ax, xs[1], bottom, w, h,
                 "report\n\nPASS; FAIL naming params, ranks\nand a diagnosis (scale, missing, "
                 "\nshift, ...); WEAK: inputs that\ncannot reveal a lost reduction",
                 face="#efeaf7")
    outputs = box(ax, xs[0], bottom, w, h,
                  "where it goes\n\nmpifusion check: exit 0 / 1 / 4\n(2: bad input), --json, "
                  "--plot;\nassert_matches_reference, the\nmpifusion_oracle pytest fixture",
                  face="#ffffff")
    arrow(ax, step, capture)
    arrow(ax, capture, records)
    arrow(ax, records, check, "mpifusion check\n--spec SPEC DIR", at=(xs[2] + w + 0.05, 2.25),
          ha="right")
    arrow(ax, check, report)
    arrow(ax, report, outputs)
    note(ax, 0.2, 4.3, "optional: exact_inputs(spec, rank, k) feeds inputs whose sums are "
         "exact in any order, so check(..., exact=True) demands every bit;\n"
         "several training steps (step{k}/ folders): check_steps names the step that fails",
         size=7.5, colour=INK)
    return fig


def state_figure() -> Figure:
    """A FusedCommBuffer's step (check-in counters, the collective) and a REDUCE_SCATTER
    buffer's param status."""
    fig, ax = canvas(9.0, 6.0)
    title(ax, 0.1, 5.8, "a buffer's step")
    collecting = box(ax, 1.3, 3.85, 2.3, 1.05, "collecting (step k)\nmicro-steps counted "
                     "per param;\nchecked_in < len(params)", face="#e9f5fb")
    flight = box(ax, 5.3, 3.85, 2.3, 1.05, "collective in flight\n(buf.task holds it)",
                 face="#efeaf7")
    ready = box(ax, 1.3, 2.35, 2.3, 0.75, "all checked in, not started", face="#f6f6f6")
    abandoned = box(ax, 5.3, 2.35, 2.3, 0.75, "abandoned: the communicator\nrefuses later "
                    "collectives", face="#fde2e4")
    closed = box(ax, 8.0, 4.15, 0.9, 0.45, "closed", face="#f6f6f6")
    arrow(ax, (3.6, 4.62), (5.3, 4.62), "the last param's last\nadd_grad (use_comm=True)",
          at=(4.45, 4.95))
    arrow(ax, (5.3, 4.1), (3.6, 4.1), "scale_grads(): wait, x 1/n,\ncounters to 0: step "
          "k + 1", at=(4.45, 3.8))
    arrow(ax, (1.9, 4.9), (3.0, 4.9), "add_grad(p), mark_unused(p)", rad=-1.0, at=(2.45, 5.6))
    arrow(ax, (1.3, 4.6), (1.3, 4.15), "", rad=1.4)
    note(ax, 0.08, 4.37, "reset():\nstep k + 1,\ngrads kept", size=7.2, colour=INK)
    arrow(ax, (5.9, 4.9), (7.0, 4.9), "CommTimeoutError:\nwait() again", rad=-1.0,
          at=(6.45, 5.62))
    arrow(ax, (7.6, 4.37), (8.0, 4.37))
    note(ax, 8.45, 4.85, "close()", size=7.2, colour=INK, ha="center")
    note(ax, 7.75, 3.65, "close() from any\nstate waits for\ncollectives in flight",
         size=7, va="top")
    arrow(ax, (2.45, 3.85), (2.45, 3.1), "the last check-in\nwith use_comm=False",
          at=(1.55, 3.45), ha="center")
    arrow(ax, (3.6, 2.75), (5.6, 3.85), "comm_grads()", at=(4.55, 2.95))
    arrow(ax, (6.45, 3.85), (6.45, 3.1), "reset(abandon=True)", at=(6.45, 3.45))
    note(ax, 0.1, 1.92, "An error (GradError, CheckInError, NanInfError, OrderError, "
         "StateError) is raised before anything changes: the state stays as it was.",
         size=7.5, colour=INK)

    title(ax, 0.1, 1.45, "a REDUCE_SCATTER buffer's params (buf.status)")
    y = 0.55
    ready_s = box(ax, 0.6, y, 1.3, 0.45, "READY", face="#b5e48c", weight="bold")
    sharded = box(ax, 3.85, y, 1.3, 0.45, "SHARDED", face="#ffd6a5", weight="bold")
    syncing = box(ax, 7.1, y, 1.3, 0.45, "SYNCING", face="#cdb4db", weight="bold")
    arrow(ax, ready_s, sharded, "clear_param_storage() or\nreset_param_storage()",
          at=(2.87, y + 0.5))
    arrow(ax, sharded, syncing, "sync_params()", at=(6.12, y + 0.4))
    arrow(ax, (7.75, y), (1.25, y), "the all-gather completed", rad=-0.12,
          at=(4.5, 0.12))
    return fig


#: name -> drawing function; the file is ``_generated/figures/{name}.svg``
FIGURES: Dict[str, Callable[[], Figure]] = {
    "layout": layout_figure,
    "hooks": hooks_figure,
    "actions": actions_figure,
    "strategies": strategies_figure,
    "oracle": oracle_figure,
    "state-machine": state_figure,
}
