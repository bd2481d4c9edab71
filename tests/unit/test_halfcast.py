"""mpifusion.arrays.halfcast against the reference casts (numpy for fp16, ml_dtypes for bf16),
bit for bit: every fp16/bf16 pattern, millions of fp32 patterns, and the edges (ties, NaN
payloads, overflow, subnormals), on every kernel path this machine has."""
import numpy as np
import pytest

from mpifusion.arrays import halfcast
from mpifusion.dtypes import bfloat16, float16, float32
from mpifusion.errors import OptionError

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


@pytest.mark.skipif(not __import__("os").environ.get("MPIFUSION_EXHAUSTIVE"),
                    reason="all 2^32 fp32 patterns take ~1-2 minutes: MPIFUSION_EXHAUSTIVE=1")
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("dt", HALVES)
def test_narrow_every_fp32_pattern(dt):
    step = 1 << 22
    out = np.empty(step, dt)
    for lo in range(0, 1 << 32, step):
        src = np.arange(lo, lo + step, dtype=np.uint64).astype(np.uint32).view(float32)
        assert_bits(halfcast.narrow(src, out), ref_narrow(src, dt), src, f"block {lo:#x}")
