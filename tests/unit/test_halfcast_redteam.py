"""Red-team checks of mpifusion.arrays.halfcast and backend.scale_: inputs the main tests do
not cover, each against the reference cast (numpy for fp16, ml_dtypes for bf16) bit for bit."""
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from mpifusion.arrays import backend, halfcast
from mpifusion.dtypes import bfloat16, float16, float32

HALVES = [pytest.param(float16, id="fp16"), pytest.param(bfloat16, id="bf16")]


def _values(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    return (rng.standard_normal(n) * 300).astype(float32)


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("n", [1, 4, 9, 100, 10007])
@pytest.mark.parametrize("where", ["low", "high", "middle"])
def test_widen_in_place_overlap(dt, n, where):
    """Half values stored inside the fp32 output (widening in place). The overlapping case
    went to numpy's plain cast, which copies forward element by element and overwrote
    halves not yet read: [1, 2, 3, 4] widened to [1, 1.875, 0, 1.984375]."""
    want = _values(n).astype(dt)
    buf = np.zeros(n, float32)
    start = {"low": 0, "high": n, "middle": n // 2}[where]
    src = buf.view(dt)[start:start + n]
    src[...] = want
    halfcast.widen(src, buf)
    assert buf.tobytes() == want.astype(float32).tobytes()


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("n", [1, 4, 9, 100, 10007])
@pytest.mark.parametrize("where", ["low", "high", "middle"])
def test_narrow_in_place_overlap(dt, n, where):
    """fp32 values rounded into half precision over their own memory (the output starts
    at the first, middle or second half of the fp32 array)."""
    x = _values(n)
    want = x.astype(dt)
    buf = x.copy()
    start = {"low": 0, "high": n, "middle": n // 2}[where]
    out = buf.view(dt)[start:start + n]
    halfcast.narrow(buf, out)
    assert out.tobytes() == want.tobytes()


def _layouts(dt) -> list:
    """(name, array) views of half-precision memory: contiguous, transposed, gapped."""
    base = _values(6 * 70).astype(dt).reshape(6, 70)
    return [("contiguous", base.copy()), ("transposed", base.copy().T),
            ("gapped", base.copy()[:, 3:60]), ("every other", base.copy()[::2, ::3]),
            ("3-D", base.copy().reshape(6, 7, 10).transpose(2, 0, 1)[::-1])]


@pytest.mark.parametrize("dt", HALVES)
def test_scale_non_contiguous_half(dt):
    """``scale_`` is in place: on a non-contiguous 2-D half view, reshape(-1) made a copy,
    the copy was scaled and the view was left unchanged (a silent no-op)."""
    for name, arr in _layouts(dt):
        want = (arr.astype(float32) * np.float32(1 / 3)).astype(dt)
        backend.scale_(arr, 1 / 3)
        assert arr.tobytes() == want.tobytes(), name


@pytest.mark.parametrize("dt", HALVES)
def test_scale_half_under_numpy_raise(dt):
    """A caller's ``np.seterr(all='raise')`` (a common way to hunt NaNs) made ``scale_`` of
    an fp16 buffer raise FloatingPointError ('underflow encountered in cast') at a tiny
    gradient rounding to a subnormal, after earlier chunks were scaled: the buffer was left
    half scaled. The rounding is the library's own (halfcast.narrow never raises): exact
    bits, no exception, whatever the caller's error state."""
    tiny = np.float32(3 * 2.0 ** -24 if dt == float16 else 3 * 2.0 ** -133)
    x = np.ones(3 * (1 << 16) + 5, float32)
    x[-4:] = [tiny, -tiny, np.inf, np.nan]
    arr = x.astype(dt)
    want = (arr.astype(float32) * np.float32(0.5)).astype(dt)
    with np.errstate(all="raise"):
        backend.scale_(arr, 0.5)
    assert arr.tobytes() == want.tobytes()


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("mode", ["auto", "numpy"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_narrow_under_numpy_raise(dt, mode, layout, monkeypatch):
    """The same for :func:`halfcast.narrow`: the kernel never raised, but the plain cast
    (``MPIFUSION_HALFCAST=numpy``, no compiled module, a strided array) raised
    FloatingPointError under ``np.seterr(under='raise')``, so the paths differed."""
    monkeypatch.setenv("MPIFUSION_HALFCAST", mode)
    tiny = np.float32(1.5 * 2.0 ** -24 if dt == float16 else 1.5 * 2.0 ** -133)
    x = np.full(64, tiny, float32)
    x[:4] = [-tiny, 1e6, 3.4e38, np.nan]
    if layout == "strided":
        x = x[::2]
    with np.errstate(all="raise"):
        out = halfcast.narrow(x, np.empty(x.size, dt))
    with np.errstate(all="ignore"):
        want = x.astype(dt)
    assert out.tobytes() == want.tobytes()


_PROBE = """
import sys
import numpy as np
def subnormals_kept():
    x = np.full(4, 1e-39, np.float32)
    return bool((x * np.float32(1.0))[0] != 0)
before = subnormals_kept()
sys.path.insert(0, sys.argv[1])
import _halfcast
print(before, subnormals_kept())
"""


def _compiler() -> bool:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(cc.split()[0]) is not None


@pytest.mark.skipif(not _compiler(), reason="no C compiler")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("flag", ["-ffast-math", "-funsafe-math-optimizations"])
def test_fast_math_build_cannot_flush_subnormals(flag, tmp_path):
    """pip passes $CFLAGS to the compiler and the linker; with -ffast-math (common in HPC
    environments) GCC linked crtfastmath.o into the kernel, and importing halfcast turned on
    flush-to-zero for the whole process: afterwards numpy computed 1e-39 * 1 = 0 and
    ml_dtypes cast 1e-39 to bf16 0. Such a build must fail (the extension is optional: the
    install goes on with numpy's casts) or, if it succeeds, leave subnormals alone."""
    src = os.path.join(os.path.dirname(halfcast.__file__), "_halfcast.c")
    shutil.copy(src, tmp_path / "_halfcast.c")
    (tmp_path / "setup.py").write_text(
        "from setuptools import Extension, setup\n"
        "setup(name='hc', ext_modules=[Extension('_halfcast', ['_halfcast.c'], "
        "extra_compile_args=['-O1', '-std=gnu99', '-Wno-psabi'])])\n")
    env = dict(os.environ, CFLAGS=flag)
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    if build.returncode != 0:
        assert "must not be built with" in build.stdout + build.stderr
        return
    probe = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path)], env=env,
                           capture_output=True, text=True, check=True)
    assert probe.stdout.split() == ["True", "True"], probe.stdout


def test_the_built_kernel_matches_its_source():
    """setup.py records the source digest in the build; an install whose kernel was built
    from another _halfcast.c (a failed rebuild keeps the old .so) must not use it."""
    if halfcast._kernels is None and halfcast.STALE is None:
        pytest.skip("no compiled kernel in this install")
    here = os.path.dirname(halfcast.__file__)
    assert halfcast.STALE is None, halfcast.STALE
    assert halfcast._kernels.SOURCE == halfcast._source_digest(here)


class _Built:
    SOURCE = "0123456789abcdef"


def test_a_kernel_built_from_another_source_is_refused(monkeypatch):
    assert halfcast._stale(_Built, "0123456789abcdef") is None
    assert halfcast._stale(_Built, None) is None  # no source shipped: trusted
    assert halfcast._stale(None, "fedcba9876543210") is None  # nothing built
    why = halfcast._stale(_Built, "fedcba9876543210")
    assert "built from another _halfcast.c" in why and "pip install -e ." in why
    assert "before builds were recorded" in halfcast._stale(object(), "fedcba9876543210")
    # asked for by name, the refusal says why
    monkeypatch.setattr(halfcast, "_kernels", None)
    monkeypatch.setattr(halfcast, "STALE", why)
    monkeypatch.setenv("MPIFUSION_HALFCAST", "kernel")
    with pytest.raises(ImportError, match="built from another _halfcast.c"):
        halfcast.path()
    monkeypatch.setenv("MPIFUSION_HALFCAST", "auto")
    assert halfcast.path() == "numpy"
