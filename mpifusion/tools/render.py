"""A planned model (``Spec.plan``) as the ``mpifusion layout`` table or JSON, and layout diffs.

Planning itself is in ``mpifusion.plan`` (no MPI), the same code ``fused_parameters`` uses,
so what is printed here is what a job allocates.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from ..plan.grouping import PlannedBuffer
from ..plan.layout import ALIGNMENT_BYTES
from ..spec import Spec


def layout_json(spec: Spec, buffers: Sequence[PlannedBuffer],
                nranks: Optional[int] = None) -> dict:
    """The documented ``mpifusion layout --json`` schema (README, "Command line")."""
    nranks = spec.nranks if nranks is None else nranks
    sharded = spec.act == "reduce_scatter"
    out_buffers = []
    for b in buffers:
        rows = []
        for p in b.params:
            slot = b.layout[p.name]
            row = {"name": p.name, "shape": list(slot.shape), "offset": slot.offset,
                   "numel": slot.numel, "padded_numel": slot.padded_numel}
            if sharded:
                row["slices"] = [list(s) if s else None for s in b.layout.slices(p.name)]
            rows.append(row)
        out_buffers.append({"index": b.index, "dtype": b.dtype, "grad_dtype": b.grad_dtype,
                            "numel": b.layout.numel, "params": rows})
    return {"act": spec.act, "nranks": nranks, "group_size": spec.group_size,
            "alignment_bytes": ALIGNMENT_BYTES, "buffers": out_buffers}


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} B"  # pragma: no cover


def buffer_summary(b: PlannedBuffer) -> str:
    """One line per buffer: dtypes, action, size and padding overhead."""
    lay = b.layout
    pad = 100.0 * lay.padding / lay.numel if lay.numel else 0.0
    return (f"buffer {b.index}: {b.act}, {len(b.params)} params, dtype {b.dtype}, grad dtype "
            f"{b.grad_dtype}, {lay.numel} elements, grads {_size(b.grad_nbytes)}, "
            f"params {_size(lay.nbytes)}, padding {lay.padding} elements ({pad:.2f}%)")


def _slices_text(slices: list) -> str:
    parts = [f"r{r}[{s[0]},{s[1]})" for r, s in enumerate(slices) if s]
    return " ".join(parts) if parts else "-"


def layout_table(doc: dict, buffers: Sequence[PlannedBuffer]) -> str:
    """A readable table of :func:`layout_json`'s content (plus sizes and padding)."""
    nranks = doc["nranks"] if doc["nranks"] is not None else "any (not sharded)"
    lines = [f"act {doc['act']}, nranks {nranks}, group size {doc['group_size']} bytes, "
             f"alignment {doc['alignment_bytes']} bytes, {len(buffers)} buffer(s)"]
    sharded = doc["act"] == "reduce_scatter"
    for b, jb in zip(buffers, doc["buffers"]):
        lines.append("")
        lines.append(buffer_summary(b))
        width = max(len("name"), *(len(p["name"]) for p in jb["params"]))
        head = f"  {'name':<{width}}  {'shape':>16}  {'offset':>11}  {'numel':>11}  {'padded':>11}"
        lines.append(head + ("  slices (rank[begin,end))" if sharded else ""))
        for p in jb["params"]:
            shape = "x".join(str(s) for s in p["shape"]) or "scalar"
            row = (f"  {p['name']:<{width}}  {shape:>16}  {p['offset']:>11}  {p['numel']:>11}  "
                   f"{p['padded_numel']:>11}")
            lines.append(row + (f"  {_slices_text(p['slices'])}" if sharded else ""))
    total = sum(b.layout.numel for b in buffers)
    pad = sum(b.layout.padding for b in buffers)
    lines.append("")
    lines.append(f"total: {total} elements in {len(buffers)} buffer(s), padding {pad} elements "
                 f"({100.0 * pad / total if total else 0.0:.2f}%)")
    return "\n".join(lines)


def _show(value: Any) -> str:
    return json.dumps(value)


def diff_layouts(ours: Any, theirs: Any, path: str = "") -> list:
    """Every difference between two layout documents, one line each, as ``path: ours X,
    theirs Y``. Param lists are matched by name, so one missing param is one line."""
    where = path or "<top>"
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for key in ours:
            sub = f"{path}.{key}" if path else key
            if key not in theirs:
                out.append(f"{sub}: missing in theirs (ours {_show(ours[key])})")
            else:
                out += diff_layouts(ours[key], theirs[key], sub)
        for key in theirs:
            if key not in ours:
                sub = f"{path}.{key}" if path else key
                out.append(f"{sub}: not in ours (theirs {_show(theirs[key])})")
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        named = all(isinstance(x, dict) and "name" in x for x in ours + theirs) and ours
        if named:
            return _diff_named(ours, theirs, path)
        out = []
        if len(ours) != len(theirs):
            out.append(f"{where}: length ours {len(ours)}, theirs {len(theirs)}")
        for i, (a, b) in enumerate(zip(ours, theirs)):
            out += diff_layouts(a, b, f"{path}[{i}]")
        return out
    if type(ours) is not type(theirs) and not (
            isinstance(ours, (int, float)) and isinstance(theirs, (int, float))
            and not isinstance(ours, bool) and not isinstance(theirs, bool)):
        return [f"{where}: ours {_show(ours)}, theirs {_show(theirs)}"]
    return [] if ours == theirs else [f"{where}: ours {_show(ours)}, theirs {_show(theirs)}"]


def _diff_named(ours: list, theirs: list, path: str) -> list:
    out = []
    mine = {x["name"]: i for i, x in enumerate(ours)}
    other = {x["name"]: i for i, x in enumerate(theirs)}
    common_ours = [n for n in mine if n in other]
    common_theirs = sorted(common_ours, key=other.get)
    if common_ours != common_theirs:  # reordered, not just an insertion or deletion
        out.append(f"{path}: order ours {_show(common_ours)}, theirs {_show(common_theirs)}")
    for name, i in mine.items():
        if name not in other:
            out.append(f"{path}[{i}] ({name}): missing in theirs")
            continue
        out += diff_layouts(ours[i], theirs[other[name]], f"{path}[{i}]({name})")
    for name, j in other.items():
        if name not in mine:
            out.append(f"{path}[{j}] ({name}): not in ours")
    return out
