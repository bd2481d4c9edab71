"""The options table of docs/api.md lists exactly FusedCommBuffer's keyword arguments, with
their defaults: the options are defined once (runtime/options.py), and the page must follow
that definition instead of becoming another list that drifts."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

from mpifusion import FusedCommBuffer
from mpifusion.runtime.options import BufferOptions

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"
#: positional arguments named in the table's heading, not in its rows
POSITIONAL = ("id", "params", "comm_group")


def table_rows() -> dict:
    """{option: default as written, or None} from the first column of the options table."""
    text = PAGE.read_text()
    section = text[text.index("## Options of `FusedCommBuffer"):]
    section = section[:section.index("\n\n", section.index("| option"))]
    rows = {}
    for line in section.splitlines()[3:]:
        for cell in re.findall(r"`([^`]+)`", line.split("|")[1]):
            name, _, default = cell.partition("=")
            rows[name] = default or None
    return rows


def test_the_table_lists_every_keyword_argument_with_its_default():
    rows = table_rows()
    params = {n: p for n, p in inspect.signature(FusedCommBuffer).parameters.items()
              if n not in POSITIONAL}
    assert sorted(rows) == sorted(params), "docs/api.md's options table and FusedCommBuffer differ"
    for name, default in rows.items():
        if default is not None:
            assert default == repr(params[name].default), (name, default, params[name].default)


def test_every_option_of_the_definition_is_in_the_table():
    rows = table_rows()
    missing = [f for f in BufferOptions.__dataclass_fields__ if f not in rows]
    assert not missing, f"docs/api.md does not describe {missing}"
