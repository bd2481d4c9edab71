"""Build hook for the optional C kernels; all metadata lives in setup.cfg.

mpifusion.arrays._halfcast (half <-> float32 casts at memory speed) needs only a C compiler
and Python's headers. It is optional: when it cannot be built, the install still succeeds and
mpifusion.arrays.halfcast falls back to numpy's and ml_dtypes' own casts (same results).
"""
import hashlib

from setuptools import Extension, setup

SOURCE = "mpifusion/arrays/_halfcast.c"
# The build records which source it came from: an optional extension whose rebuild failed
# leaves the previous .so in place, and halfcast.py refuses one built from another source.
with open(SOURCE, "rb") as f:
    DIGEST = hashlib.sha256(f.read()).hexdigest()[:16]

setup(ext_modules=[Extension(
    "mpifusion.arrays._halfcast", [SOURCE],
    define_macros=[("HALFCAST_SOURCE", f'"{DIGEST}"')],
    extra_compile_args=["-O3", "-std=gnu99", "-Wno-psabi"], optional=True)])
