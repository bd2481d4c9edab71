"""Build hook for the optional C kernels; all metadata lives in setup.cfg.

mpifusion.arrays._halfcast (half <-> float32 casts at memory speed) needs only a C compiler
and Python's headers. It is optional: when it cannot be built, the install still succeeds and
mpifusion.arrays.halfcast falls back to numpy's and ml_dtypes' own casts (same results).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "mpifusion.arrays._halfcast", ["mpifusion/arrays/_halfcast.c"],
    extra_compile_args=["-O3", "-std=gnu99", "-Wno-psabi"], optional=True)])
