"""docs/environment.md's table of environment variables is made from their single definition,
``mpifusion.config.ENVIRONMENT``: every ``MPIFUSION_`` name the library or its batch script
uses is defined there, the library's constants and readers come from it, and the table the
docs build writes (``docs/_ext/generated.py``) has one row per definition, as it reads now."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from mpifusion import config
from mpifusion.config import ENVIRONMENT, CommOptions
from tests.docs.pages import load_ext

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SBATCH = "scripts/mpifusion.sbatch"
NAME = re.compile(r"\b(?:MPIFUSION_[A-Z0-9_]*[A-Z0-9]|FLAGS_[a-z_]+)\b")


@pytest.fixture(scope="module")
def generated():
    return load_ext("generated")


def names_in(paths) -> dict:
    """{name: first file using it} over ``paths``."""
    found: dict = {}
    for path in paths:
        for name in NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def defined(reader=None) -> set:
    return {v.name for v in ENVIRONMENT if reader is None or v.reader == reader}


def test_every_name_the_library_uses_is_defined():
    sources = [p for p in (ROOT / "mpifusion").rglob("*")
               if p.suffix in (".py", ".c") and p.is_file()]
    used = names_in(sources)
    assert "MPIFUSION_COMM_STRATEGY" in used  # the scan sees the library
    missing = {n: f for n, f in used.items() if n not in defined()}
    assert not missing, ("environment variables used in mpifusion/ but missing from "
                         f"mpifusion.config.ENVIRONMENT: {missing}")


def test_every_library_definition_is_used_by_the_library():
    source = "\n".join(p.read_text() for p in (ROOT / "mpifusion").rglob("*.py")
                       if p.name != "config.py")
    readers = {v.name for v in ENVIRONMENT if v.field} | set(config.NANINF_ENV) | {
        config.CUDA_AWARE_ENV, config.TUNE_FILE_ENV, config.HALFCAST_ENV}
    unread = defined("mpifusion") - readers
    assert not unread, f"defined for the library but read by nothing: {sorted(unread)}"
    # the readers outside config.py import the constants, never spell the names
    for constant in ("CUDA_AWARE_ENV", "HALFCAST_ENV"):
        assert constant in source


def test_the_batch_script_variables_are_defined_both_ways():
    script = names_in([ROOT / SBATCH])
    assert set(script) <= defined(), sorted(set(script) - defined())
    assert defined(SBATCH) <= set(script), sorted(defined(SBATCH) - set(script))
    assert {v.reader for v in ENVIRONMENT} == {"mpifusion", SBATCH}


def test_definitions_are_complete_and_unique():
    names = [v.name for v in ENVIRONMENT]
    assert len(names) == len(set(names)), names
    for var in ENVIRONMENT:
        assert all(str(x).strip() for x in (var.option, var.values, var.default, var.meaning)), var
        assert "|" not in var.meaning + var.values + var.default + var.option, var


def test_comm_options_read_their_variables_from_the_definition():
    fields = {f for f in CommOptions.__dataclass_fields__}
    named = {v.field: v.name for v in ENVIRONMENT if v.field}
    assert set(named) <= fields, set(named) - fields
    # each variable of a CommOptions field reaches that field through from_env
    samples = {"strategy": "nonblocking", "segment_bytes": "4096", "timeout": "7",
               "check_agreement": "0", "window": "3", "order": "negotiated",
               "verify_order": "0", "allreduce": "ring", "node_size": "2", "pipeline": "1"}
    assert set(samples) == set(named), "a new CommOptions variable needs a sample here"
    for field, name in named.items():
        value = getattr(CommOptions.from_env({name: samples[field]}), field)
        assert value != getattr(CommOptions(), field), (name, field, value)
    assert config.STRATEGY_ENV == named["strategy"]
    assert config.NANINF_ENV == ("MPIFUSION_CHECK_NANINF", "FLAGS_pp_check_naninf")
    assert config.naninf_check_from_env({"FLAGS_pp_check_naninf": "1"})


def table_rows(text: str) -> list:
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]


def test_the_table_has_one_row_per_definition_in_order(generated):
    table = generated.environment_table()
    assert table_rows(table) == [v.name for v in ENVIRONMENT]
    flat = " ".join(table.split())
    for var in ENVIRONMENT:
        for text in (var.values, var.default, var.meaning):
            assert " ".join(text.split()) in flat, (var.name, text)


def test_the_page_includes_the_table_the_build_writes(generated, tmp_path):
    page = (DOCS / "environment.md").read_text()
    assert "```{include} _generated/environment.md\n```" in page
    assert '"generated"' in (DOCS / "conf.py").read_text()
    written = generated.generate(tmp_path)
    assert (tmp_path / "environment.md").read_text() == generated.environment_table()
    assert tmp_path / "environment.md" in written
    assert not generated.generate(tmp_path), "a second run must leave unchanged files alone"


def test_the_pages_name_only_defined_or_development_variables():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    tooling = names_in([p for d in ("scripts", "tests", "benchmarks", ".ci")
                        for p in (ROOT / d).rglob("*") if p.is_file()
                        and p.suffix in ("", ".py", ".sh", ".sbatch")])
    unknown = {n: f for n, f in names_in(pages).items()
               if n not in defined() and n not in tooling}
    assert not unknown, f"pages name variables that nothing reads: {unknown}"
