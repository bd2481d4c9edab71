"""mpifusion.arrays.halfcast (and backend.scale_) against the reference casts (numpy for fp16,
ml_dtypes for bf16), bit for bit: every fp16/bf16 pattern, millions of fp32 patterns, the
edges (ties, NaN payloads, overflow, subnormals) on every kernel path this machine has, and
inputs that overlap, are not contiguous, run under numpy's ``raise`` error mode, or come
from a kernel built with other flags or another source.
"""
import os
import shutil
import sys
import sysconfig

import numpy as np
import pytest

from mpifusion.arrays import backend, halfcast
from mpifusion.dtypes import bfloat16, finfo, float16, float32
from mpifusion.errors import OptionError

from tests.helpers import run_cmd

HALVES = [pytest.param(float16, id="fp16"), pytest.param(bfloat16, id="bf16")]


K = halfcast._kernels


ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def ref_narrow(x32: np.ndarray, dt) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x32.astype(dt)


def narrow_paths(dt):
    """(name, fn(src_f32, out_half)) for the public function and each raw kernel."""
    paths = [("public", halfcast.narrow)]
    if K is not None:
        raw = [K.narrow_f16, K.narrow_f16_int] if dt == float16 else [K.narrow_bf16,
                                                                       K.narrow_bf16_int]
        for fn in raw:
            def run(src, out, fn=fn):
                if fn(src.view(np.uint32), out.view(np.uint16)):  # patch NaNs like the wrapper
                    nan = np.isnan(src)
                    out[nan] = ref_narrow(src[nan], dt)
                return out
            paths.append((fn.__name__, run))
    return paths


def widen_paths(dt):
    paths = [("public", halfcast.widen)]
    if K is not None:
        raw = [K.widen_f16, K.widen_f16_int] if dt == float16 else [K.widen_bf16]
        for fn in raw:
            def run(src, out, fn=fn):
                if fn(src.view(np.uint16), out.view(np.uint32)):
                    nan = np.isnan(src)
                    out[nan] = src[nan].astype(float32)
                return out
            paths.append((fn.__name__, run))
    return paths


def assert_bits(got: np.ndarray, want: np.ndarray, src: np.ndarray, what: str) -> None:
    gu = got.view(np.uint16 if got.itemsize == 2 else np.uint32)
    wu = want.view(gu.dtype)
    bad = np.flatnonzero(gu != wu)
    if bad.size:
        su = src.view(np.uint16 if src.itemsize == 2 else np.uint32)
        ex = ", ".join(f"{su[i]:#x}->{gu[i]:#x} (want {wu[i]:#x})" for i in bad[:5])
        raise AssertionError(f"{what}: {bad.size} of {src.size} differ: {ex}")


def test_kernel_is_built():
    """The compiled kernel is what makes half precision fast; a silent fallback would hide a
    broken build (set MPIFUSION_HALFCAST=numpy to run without it on purpose)."""
    assert K is not None, "mpifusion.arrays._halfcast is not built: pip install -e ."
    assert halfcast.path() in ("f16c", "integer")


@pytest.mark.parametrize("dt", HALVES)
def test_widen_every_pattern(dt):
    src = ALL16.view(dt)
    want = src.astype(float32)
    for name, fn in widen_paths(dt):
        assert_bits(fn(src, np.empty(src.size, float32)), want, src, f"widen {name}")


@pytest.mark.parametrize("dt", HALVES)
def test_widen_then_narrow_every_pattern(dt):
    src = ALL16.view(dt)
    wide = src.astype(float32)
    want = ref_narrow(wide, dt)
    for name, fn in narrow_paths(dt):
        assert_bits(fn(wide, np.empty(src.size, dt)), want, wide, f"round trip {name}")
    # finite non-NaN values come back unchanged
    keep = ~np.isnan(wide)
    assert np.array_equal(halfcast.narrow(wide, np.empty(src.size, dt)).view(np.uint16)[keep],
                          ALL16[keep])


def edge_patterns(dt) -> np.ndarray:
    """fp32 bit patterns at the edges of rounding to ``dt``."""
    with np.errstate(invalid="ignore"):
        finite = ALL16.view(dt).astype(np.float64)
    finite = np.unique(np.abs(finite[np.isfinite(finite)]))  # every non-negative value
    mids = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)  # exact: 12 / 9 bits
    top = finite[-1]  # largest finite: its tie with the next (not representable) step
    top_mid = np.float32(top + (top - finite[-2]) / 2)
    vals = np.concatenate([mids, [top_mid], finite.astype(np.float32)])
    bits = vals.view(np.uint32)
    near = np.concatenate([bits.astype(np.int64) + d for d in (-2, -1, 0, 1, 2)])
    near = near[(near >= 0) & (near < 0x7f800000)].astype(np.uint32)
    specials = np.array([0, 1, 2, 0x7fffff, 0x800000, 0x7f7fffff, 0x7f800000,  # sub/max/inf
                         0x7f800001, 0x7f800fff, 0x7f801000, 0x7f802000, 0x7fbfffff,  # sNaN
                         0x7fc00000, 0x7fc00001, 0x7fffffff, 0x7fffe000, 0x7f80e000],  # qNaN
                        np.uint32)
    # fp16: the overflow boundary around 65504/65520/65536 and the subnormal range, densely
    dense = [np.arange(0x477fe000 - 4096, 0x47800000 + 4096, dtype=np.uint32),
             np.arange(0x33000000 - 4096, 0x33000000 + 4096, dtype=np.uint32),  # 2^-25
             np.arange(0x387fe000, 0x38802000, dtype=np.uint32)]  # 2^-14
    every = np.concatenate([near, specials] + dense)
    return np.concatenate([every, every | np.uint32(0x80000000)])


@pytest.mark.parametrize("dt", HALVES)
def test_narrow_edges(dt):
    src = edge_patterns(dt).view(float32)
    want = ref_narrow(src, dt)
    for name, fn in narrow_paths(dt):
        assert_bits(fn(src, np.empty(src.size, dt)), want, src, f"narrow edges {name}")


@pytest.mark.parametrize("dt", HALVES)
def test_narrow_random_patterns(dt):
    """4M random fp32 bit patterns (about 0.4% NaN), plus 4M in the exponent range where
    rounding to ``dt`` gives subnormals."""
    rng = np.random.default_rng(13)
    uniform = rng.integers(0, 1 << 32, size=1 << 22, dtype=np.uint64).astype(np.uint32)
    lo, hi = (0x32800000, 0x38900000) if dt == float16 else (0x00000000, 0x00900000)
    small = rng.integers(lo, hi, size=1 << 22, dtype=np.uint64).astype(np.uint32)
    small |= (rng.integers(0, 2, size=small.size, dtype=np.uint32) << np.uint32(31))
    for bits in (uniform, small):
        src = bits.view(float32)
        want = ref_narrow(src, dt)
        for name, fn in narrow_paths(dt):
            assert_bits(fn(src, np.empty(src.size, dt)), want, src, f"narrow random {name}")


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 4095, 4097, 100003])
def test_lengths_and_tails(dt, n):
    """Vector bodies, scalar tails and chunk edges: NaNs in the tail are patched too."""
    rng = np.random.default_rng(n)
    src = rng.standard_normal(n).astype(float32) * 1000
    if n:
        src[-1] = np.nan
        src[0] = np.float32(np.frombuffer(np.uint32(0x7f800001).tobytes(), np.float32)[0])
    out = halfcast.narrow(src, np.empty(n, dt))
    assert_bits(out, ref_narrow(src, dt), src, "narrow")
    assert_bits(halfcast.widen(out), out.astype(float32), out, "widen")


@pytest.mark.parametrize("dt", HALVES)
def test_shapes_and_fallbacks(dt, monkeypatch):
    rng = np.random.default_rng(1)
    src = (rng.standard_normal((64, 33)) * 300).astype(float32)
    want = ref_narrow(src, dt)
    out = halfcast.narrow(src, np.empty((64, 33), dt))  # 2-D, same shape
    assert_bits(out.reshape(-1), want.reshape(-1), src.reshape(-1), "2-D")
    flat = halfcast.narrow(src, np.empty(src.size, dt))  # same size, other shape
    assert_bits(flat, want.reshape(-1), src.reshape(-1), "reshaped")
    strided = np.empty((64, 66), dt)[:, ::2]  # non-contiguous out: plain cast
    halfcast.narrow(src, strided)
    assert_bits(np.ascontiguousarray(strided).reshape(-1), want.reshape(-1), src.reshape(-1),
                "strided")
    gappy = np.empty((64, 66), dt)[:, :33]  # not even a 1-D strided view
    halfcast.narrow(src, gappy)
    assert_bits(np.ascontiguousarray(gappy).reshape(-1), want.reshape(-1), src.reshape(-1),
                "gappy")
    wide_out = np.empty((64, 40), float32)[:, :33]
    halfcast.widen(want, wide_out)
    assert np.array_equal(wide_out.view(np.uint32), want.astype(float32).view(np.uint32))
    wide = halfcast.widen(want[:, ::3])  # non-contiguous source
    assert np.array_equal(wide.view(np.uint32), want[:, ::3].astype(float32).view(np.uint32))
    monkeypatch.setenv("MPIFUSION_HALFCAST", "numpy")
    assert halfcast.path() == "numpy"
    assert_bits(halfcast.narrow(src, np.empty(src.size, dt)), want.reshape(-1),
                src.reshape(-1), "numpy path")


def test_user_errors(monkeypatch):
    x = np.zeros(4, float32)
    with pytest.raises(TypeError, match="output dtype"):
        halfcast.narrow(x, np.empty(4, np.float64))
    with pytest.raises(TypeError, match="source dtype"):
        halfcast.narrow(x.astype(np.float64), np.empty(4, float16))
    with pytest.raises(TypeError, match="source dtype"):
        halfcast.widen(x)
    with pytest.raises(ValueError, match="4 elements, output 3"):
        halfcast.narrow(x, np.empty(3, bfloat16))
    monkeypatch.setenv("MPIFUSION_HALFCAST", "fast")
    with pytest.raises(OptionError, match="MPIFUSION_HALFCAST"):
        halfcast.path()


@pytest.mark.stress  # all 2^32 fp32 patterns take ~1-2 minutes: pytest --stress runs it
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("dt", HALVES)
def test_narrow_every_fp32_pattern(dt):
    step = 1 << 22
    out = np.empty(step, dt)
    for lo in range(0, 1 << 32, step):
        src = np.arange(lo, lo + step, dtype=np.uint64).astype(np.uint32).view(float32)
        assert_bits(halfcast.narrow(src, out), ref_narrow(src, dt), src, f"block {lo:#x}")


# -------------------------------------------------------- overlap, strides, error modes, the build


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
    env = {"CFLAGS": flag}
    build = run_cmd([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                    cwd=str(tmp_path), env=env, timeout=300)
    if build.returncode != 0:
        assert "must not be built with" in build.stdout + build.stderr
        return
    probe = run_cmd([sys.executable, "-c", _PROBE, str(tmp_path)], env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr
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


def test_half_holds_fp16_and_bf16_only():
    """``HALF`` answers membership by name (so an fp32 buffer never imports ml_dtypes) and
    still lists the two dtype objects."""
    from mpifusion.dtypes import HALF

    for half in (np.float16, bfloat16, "bf16", "half", np.dtype(bfloat16)):
        assert half in HALF, half
    for other in (np.float32, np.float64, np.int16, np.uint16, "fp32"):
        assert other not in HALF, other
    assert list(HALF) == [np.dtype(np.float16), np.dtype(bfloat16)]


def ref_sum(sources, scale):
    """The shm reduction of half chunks as numpy (and ml_dtypes) spell it: widened, added in
    the order given in fp32, scaled by fp32(scale) unless None or 1, rounded once."""
    acc = sources[0].astype(float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for src in sources[1:]:
            acc = acc + src.astype(float32)
        if scale is not None and float(scale) != 1.0:
            acc = acc * np.float32(scale)
        return ref_narrow(acc, sources[0].dtype)


def half_edges(dt, n, rng):
    """``n`` values of ``dt``: random bit patterns of every class but NaN, the largest
    finite values (their sums overflow to inf), infinities, zeros of both signs, subnormals
    and values whose sums round at a tie."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    vals = bits.view(dt).copy()
    vals[np.isnan(vals)] = 2.0
    big = 65504.0 if dt == float16 else 3.3895e38
    tiny = 6e-8 if dt == float16 else 1e-40
    step = 2.0 ** -10 if dt == float16 else 2.0 ** -7
    specials = np.array([0.0, -0.0, np.inf, -np.inf, big, -big, tiny, -tiny, 1.0, 1 + step,
                         1 + step / 2], np.float32).astype(dt)
    at = np.arange(0, n, 7)[: len(specials)]
    vals[at] = specials[: len(at)]
    return vals


def portable_sum(dt):
    """The compiled sum over the portable kernels only (what a CPU without AVX2/F16C, or
    with FTZ/DAZ set, runs), called as halfcast.sum_half calls the kernel."""
    kernel = K.sum_f16_int if dt == float16 else K.sum_bf16_int

    def run(sources, dests, scale, acc):
        return kernel(tuple(x.view(np.uint16) for x in sources),
                      tuple(x.view(np.uint16) for x in dests),
                      None if scale is None else float(np.float32(scale)), acc.view(np.uint32))
    return run


SUM_PATHS = ["public", "portable"]


@pytest.mark.skipif(K is None, reason="needs the compiled kernel")
@pytest.mark.parametrize("path", SUM_PATHS)
@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("nsrc", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("scale", [None, 1.0, 0.5, 1 / 3, 0.125])
@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 20011])
def test_sum_half_is_the_reference_bit_for_bit(dt, nsrc, scale, n, path):
    fn = halfcast.sum_half if path == "public" else portable_sum(dt)
    rng = np.random.default_rng(nsrc * 1000 + n)
    sources = [half_edges(dt, n, rng) for _ in range(nsrc)]
    want = ref_sum(sources, scale)
    dests = [np.full(n, 7, dt) for _ in range(3)]
    acc = np.empty(n, float32)
    assert fn(sources, dests, scale, acc) == n
    for d in dests:
        np.testing.assert_array_equal(d.view(np.uint16), want.view(np.uint16))
    # a rank's own buffer is a source and a dest at once: read before written
    own = [s.copy() for s in sources]
    assert fn(own, [own[0], dests[0]], scale, acc) == n
    np.testing.assert_array_equal(own[0].view(np.uint16), want.view(np.uint16))


@pytest.mark.skipif(K is None, reason="needs the compiled kernel")
@pytest.mark.parametrize("path", SUM_PATHS)
@pytest.mark.parametrize("dt", HALVES)
def test_sum_half_stops_before_the_block_of_a_nan(dt, path):
    """A NaN result (a NaN input, or inf - inf) stops the kernel before its block (or its
    16 lanes) is written: what it did is the reference, the rest is left for the caller."""
    fn = halfcast.sum_half if path == "public" else portable_sum(dt)
    n, block = 5000, 1024
    rng = np.random.default_rng(5)
    sources = [half_edges(dt, n, rng) for _ in range(2)]
    sources[0][2100], sources[1][2100] = np.inf, -np.inf  # inf + -inf: NaN in block 2
    want = ref_sum(sources, 0.5)
    dest = np.full(n, 7, dt)
    done = fn(sources, [dest], 0.5, np.empty(n, float32))
    assert done <= 2100 < done + block, done  # the NaN's block (or 16 lanes) left undone
    np.testing.assert_array_equal(dest[:done].view(np.uint16), want[:done].view(np.uint16))
    assert (dest[done:] == 7).all()
    sources[0][2100] = np.nan  # a NaN input: the same
    assert fn(sources, [dest], 0.5, np.empty(n, float32)) == done


def test_sum_half_without_the_kernel_does_nothing(monkeypatch):
    monkeypatch.setenv("MPIFUSION_HALFCAST", "numpy")
    src = [np.ones(10, bfloat16)] * 2
    dest = np.zeros(10, bfloat16)
    assert halfcast.sum_half(src, [dest], None, np.empty(10, float32)) == 0
    assert not dest.any()


# -- sum_wide: the shm small all-reduce's compiled fp32/fp64 sum and scaling -------------

WIDE = [pytest.param(np.float32, np.uint32, id="fp32"),
        pytest.param(np.float64, np.uint64, id="fp64")]
SCALES = [None, 1.0, 0.5, 1 / 3, 1 / 7, 1.00000001, 3e38, -2.0]


def ref_sum_scaled(sources, scale):
    """rank-order np.add, then np.multiply by dtype(scale) unless None or 1: what every
    other path of mpifusion computes"""
    with np.errstate(all="ignore"):
        out = sources[0].copy()
        for s in sources[1:]:
            out = out + s
        if scale is not None and float(scale) != 1.0:
            out = out * out.dtype.type(scale)
    return out


def wide_patterns(rng, n, dt, ut):
    """every kind of value: random bits (NaNs of all payloads, infs, subnormals), normals
    over the whole exponent range, exact ties, signed zeros"""
    kind = rng.integers(0, 3)
    if kind == 0:
        return rng.integers(0, np.iinfo(ut).max, n, dtype=ut, endpoint=True).view(dt)
    if kind == 1:
        exp = rng.integers(finfo(dt).minexp - 20, finfo(dt).maxexp, n)
        with np.errstate(over="ignore"):
            return np.ldexp(rng.standard_normal(n), exp).astype(dt)
    return rng.choice(np.array([0.0, -0.0, 1.0, 2.0 ** -24, finfo(dt).max,
                                finfo(dt).smallest_subnormal], dtype=dt), n)


@pytest.mark.parametrize("dt,ut", WIDE)
def test_sum_wide_is_numpys_sum_bit_for_bit(dt, ut):
    """The shm path's _sum_scaled (compiled kernel, numpy from a NaN on) gives the bits of
    the rank-order numpy sum and scaling, NaN payloads included, and the kernel did the
    whole of every NaN-free sum (so this is not numpy compared with itself)."""
    from mpifusion.comm.shm_collectives import _sum_scaled
    rng = np.random.default_rng(29)
    whole = 0
    for trial in range(1500):
        n = int(rng.choice([0, 1, 7, 255, 256, 257, 1024, 1031]))
        sources = [wide_patterns(rng, n, dt, ut) for _ in range(int(rng.integers(1, 6)))]
        scale = SCALES[trial % len(SCALES)]
        want = ref_sum_scaled(sources, scale)
        got = np.full(n, 7, dt)
        _sum_scaled(sources, got, scale)
        bad = np.flatnonzero(got.view(ut) != want.view(ut))
        assert not bad.size, (trial, scale, [s[bad[:3]] for s in sources], got[bad[:3]])
        if K is not None and not np.isnan(want).any():
            assert halfcast.sum_wide(sources, np.empty(n, dt), scale) == n
            whole += 1
    assert K is None or whole > 300


def test_sum_wide_declines_what_it_cannot_take(monkeypatch):
    """0 (numpy does it) for other dtypes (a source of another dtype but the same bytes,
    byte-swapped arrays), strided arrays, other sizes, an output that overlaps a source,
    and without the compiled module; a NaN stops it at its block."""
    if K is None:
        pytest.skip("the compiled module is not built here")
    a, b = np.arange(512, dtype=np.float32), np.ones(512, np.float32)
    out = np.empty(512, np.float32)
    assert halfcast.sum_wide([a, b], out, 0.5) == 512
    np.testing.assert_array_equal(out, (a + b) * np.float32(0.5))
    assert halfcast.sum_wide([a.astype(np.int32)], out.view(np.int32), None) == 0
    assert halfcast.sum_wide([a[:256].astype(np.float64)], out, None) == 0  # same bytes
    assert halfcast.sum_wide([a.astype(">f4")], out, None) == 0
    assert halfcast.sum_wide([a], out.view(">f4"), None) == 0
    assert halfcast.sum_wide([a[::2]], out[:256], None) == 0
    assert halfcast.sum_wide([a[:256]], out[::2], None) == 0
    assert halfcast.sum_wide([a[:300]], out, None) == 0
    assert halfcast.sum_wide([out, a], out, None) == 0
    assert halfcast.sum_wide([a[1:], b[1:]], a[:-1], None) == 0
    b[300] = np.nan
    assert halfcast.sum_wide([a, b], out, None) == 256  # the block holding the NaN on
    monkeypatch.setattr(halfcast, "_kernels", None)
    assert halfcast.sum_wide([a, b], out, None) == 0
