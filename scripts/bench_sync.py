#!/usr/bin/env python3
"""Gradient-sync benchmark: ``mpiexec -n 2 python scripts/bench_sync.py [--help]``.

A thin wrapper around :func:`mpifusion.bench.main` (also ``mpifusion bench``), so the
benchmark runs from a checkout without installing the package.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpifusion.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
