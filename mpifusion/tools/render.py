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
    """The documented ``mpifusion layout --json`` schema (docs/cli.md)."""
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
        named = all(isinstance(x, dict) and isinstance(x.get("name"), str)
                    for x in ours + theirs) and ours
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
    """Lists of ``{"name": ...}`` objects matched by name. A name twice in one list is a
    difference of its own (never silently one of the two): the first is compared, the others
    are reported as duplicates."""
    out = []
    mine, mine_dups = _first_by_name(ours)
    other, other_dups = _first_by_name(theirs)
    for side, dups in (("ours", mine_dups), ("theirs", other_dups)):
        for name, first, again in dups:
            out.append(f"duplicate param name {name} in {side} ({path}[{first}] and "
                       f"{path}[{again}])")
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


def _first_by_name(items: list) -> tuple:
    """``{name: index of its first use}`` and ``[(name, first, later)]`` for every repeat."""
    first: dict = {}
    dups = []
    for i, x in enumerate(items):
        name = x["name"]
        if name in first:
            dups.append((name, first[name], i))
        else:
            first[name] = i
    return first, dups


def duplicate_params(doc: dict, side: str) -> list:
    """One line per param name used in two different buffers of a layout document (a name
    repeated within one buffer is reported by :func:`diff_layouts`)."""
    seen: dict = {}
    out = []
    buffers = doc.get("buffers") if isinstance(doc, dict) else None
    for i, b in enumerate(buffers if isinstance(buffers, list) else []):
        params = b.get("params") if isinstance(b, dict) else None
        for j, p in enumerate(params if isinstance(params, list) else []):
            name = p.get("name") if isinstance(p, dict) else None
            if not isinstance(name, str):
                continue
            if name in seen and seen[name][0] != i:
                k, l = seen[name]
                out.append(f"duplicate param name {name} in {side} (buffers[{k}].params[{l}] "
                           f"and buffers[{i}].params[{j}])")
            seen.setdefault(name, (i, j))
    return out


def compare_layouts(ours: dict, theirs: dict) -> list:
    """Every difference between our layout document and theirs (``mpifusion layout
    --layout``): a param name used twice on either side, then :func:`diff_layouts`."""
    return duplicate_params(ours, "ours") + duplicate_params(theirs, "theirs") + \
        diff_layouts(ours, theirs)


# ------------------------------------------------------------------ their document, validated

class LayoutDocError(ValueError):
    """THEIRS is not a layout document: one line naming the field (``buffers[0].params[1].name:
    expected a string, got list``)."""


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {_show(value)}"
    if isinstance(value, str):
        text = _show(value)
        return f"string {text if len(text) <= 40 else text[:37] + '...'}"
    if isinstance(value, (int, float)):
        text = _show(value)
        return f"number {text if len(text) <= 40 else text[:37] + '...'}"
    return {list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _want_int(value: Any, where: str, *, null: bool = False) -> None:
    if null and value is None:
        return
    if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise LayoutDocError(f"{where}: expected an integer{' or null' if null else ''}, "
                             f"got {_kind(value)}")


def _want_str(value: Any, where: str) -> None:
    if not isinstance(value, str):
        raise LayoutDocError(f"{where}: expected a string, got {_kind(value)}")


def _want(value: Any, kind: type, where: str) -> None:
    if not isinstance(value, kind):
        name = "a list" if kind is list else "an object"
        raise LayoutDocError(f"{where}: expected {name}, got {_kind(value)}")


def check_layout_doc(doc: Any) -> None:
    """Raise :class:`LayoutDocError` unless ``doc`` has the ``mpifusion layout --json``
    shape wherever the comparator reads it: ``buffers`` a list of objects whose ``params``
    are objects with a string ``name``; the fields of the schema that are present of their
    type (integers, strings, a list of integers for ``shape``, ``null`` or ``[begin, end]``
    per rank for ``slices``). Missing or extra fields other than these are differences,
    reported by :func:`compare_layouts`, not errors."""
    if not isinstance(doc, dict) or "buffers" not in doc:
        raise LayoutDocError("buffers: missing (expected the layout --json schema)")
    for key in ("act",):
        if key in doc:
            _want_str(doc[key], key)
    if "nranks" in doc:
        _want_int(doc["nranks"], "nranks", null=True)
    for key in ("group_size", "alignment_bytes"):
        if key in doc:
            _want_int(doc[key], key)
    _want(doc["buffers"], list, "buffers")
    for i, b in enumerate(doc["buffers"]):
        where = f"buffers[{i}]"
        _want(b, dict, where)
        for key in ("index", "numel"):
            if key in b:
                _want_int(b[key], f"{where}.{key}")
        for key in ("dtype", "grad_dtype"):
            if key in b:
                _want_str(b[key], f"{where}.{key}")
        if "params" not in b:
            continue
        _want(b["params"], list, f"{where}.params")
        for j, p in enumerate(b["params"]):
            at = f"{where}.params[{j}]"
            _want(p, dict, at)
            if "name" not in p:
                raise LayoutDocError(f"{at}.name: missing (params are matched by name)")
            _want_str(p["name"], f"{at}.name")
            for key in ("offset", "numel", "padded_numel"):
                if key in p:
                    _want_int(p[key], f"{at}.{key}")
            if "shape" in p:
                _want(p["shape"], list, f"{at}.shape")
                for k, dim in enumerate(p["shape"]):
                    _want_int(dim, f"{at}.shape[{k}]")
            if "slices" in p:
                _want(p["slices"], list, f"{at}.slices")
                for r, piece in enumerate(p["slices"]):
                    if piece is None:
                        continue
                    if not isinstance(piece, list) or len(piece) != 2:
                        raise LayoutDocError(f"{at}.slices[{r}]: expected null or [begin, "
                                             f"end], got {_kind(piece)}")
                    for k, bound in enumerate(piece):
                        _want_int(bound, f"{at}.slices[{r}][{k}]")


