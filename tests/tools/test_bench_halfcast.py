"""``benchmarks/bench_halfcast.py --sums`` on a tiny input: one row per kernel path this CPU has
and kind of data, each a ratio to the fp16 sum of the same round (the table that compares
CPUs: a bf16 sum that depends on the data shows there)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpifusion.arrays import halfcast

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_sums_table_has_every_path_and_kind_of_data():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_halfcast.py"),
                           "--sums", "--elements", "5000", "--rounds", "1", "--no-record"],
                          capture_output=True, text=True, timeout=100)
    if halfcast.kernel_path() == "numpy":  # no kernel in use: nothing is timed, it says so
        assert proc.returncode == 1 and "no sum to time" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line for line in proc.stdout.splitlines()
            if line.startswith("| ") and "ms (median)" not in line and "---" not in line}
    kinds = ("normal", "ones", "subnormal")
    want = {f"fp16, {k}" for k in kinds}
    want |= {f"bf16 {p}, {k}" for p in halfcast.kernel_paths() for k in kinds}
    want |= {f"fp16, {k}, mean" for k in kinds}
    want |= {f"bf16 {halfcast.kernel_path()}, {k}, mean" for k in kinds}
    assert set(rows) == want, proc.stdout
    assert rows["fp16, normal"].split(" | ")[2].startswith("1.00 ")  # the round's base
    assert "bf16 paths here" in proc.stdout
