"""Every bf16 kernel path this CPU has (halfcast.kernel_paths(): 'generic', 'avx2', 'avx512',
'avx512bf16'), forced one by one, against two references built apart from the kernel: a
float64 round-to-nearest-even written with numpy's rint, and ml_dtypes' cast; bit for bit,
over edge and random fp32 patterns (NaN, Inf, subnormals, ties, overflow) and over the shm
sum (widen, add in order, scale, round) with tails of every length a vector step leaves.
"""
import numpy as np
import pytest

from mpifusion.arrays import halfcast
from mpifusion.dtypes import bfloat16, float32

from tests.arrays.test_halfcast import edge_patterns, half_edges, ref_sum

pytestmark = pytest.mark.skipif(halfcast._kernels is None, reason="needs the compiled kernel")

PATHS = ["generic", "avx2", "avx512", "avx512bf16"]


def on(path: str) -> str:
    if path not in halfcast.kernel_paths():
        pytest.skip(f"this CPU has no {path} path")
    return path


def ref64(bits: np.ndarray) -> np.ndarray:
    """bf16 bits of fp32 ``bits`` rounded to nearest even in float64 (exact here: 24-bit
    values), NaN as ml_dtypes writes it (the quiet NaN 0x7fc0 with the sign)."""
    with np.errstate(invalid="ignore"):  # signalling NaNs
        x = bits.view(float32).astype(np.float64)
    sign = (bits >> np.uint32(16)).astype(np.uint16) & np.uint16(0x8000)
    nan = np.isnan(x)
    a = np.abs(np.where(nan, 0.0, x))
    _, e = np.frexp(a)  # a = m * 2**e, 0.5 <= m < 1: its exponent is e - 1
    ulp = np.ldexp(1.0, np.maximum(e - 1, -126) - 7)  # 8 significant bits; subnormal below
    r = np.rint(a / ulp) * ulp  # rint: ties to even
    r[r >= 2.0 ** 128] = np.inf  # past the largest bf16 (and fp32 inf itself)
    out = (r.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16) | sign
    out[nan] = sign[nan] | np.uint16(0x7fc0)
    return out


def patterns() -> np.ndarray:
    rng = np.random.default_rng(29)
    uniform = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    small = rng.integers(0, 0x01000000, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    small |= rng.integers(0, 2, size=small.size, dtype=np.uint32) << np.uint32(31)
    ties = (rng.integers(0, 1 << 16, size=1 << 16, dtype=np.uint32) << np.uint32(16)) | 0x8000
    return np.concatenate([edge_patterns(bfloat16), uniform, small, ties, ties ^ np.uint32(1)])


def test_the_path_in_use_is_one_of_the_cpus():
    paths = halfcast.kernel_paths()
    assert paths[0] == "generic" and set(paths) <= set(PATHS)
    assert halfcast.kernel_path() == paths[-1]  # the best one this CPU has
    with open("/proc/cpuinfo") as f:
        flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        assert "avx512bf16" in paths


def test_the_float64_reference_is_ml_dtypes():
    """The two references agree, so a kernel matching one matches both."""
    bits = patterns()
    with np.errstate(over="ignore", invalid="ignore"):
        ml = bits.view(float32).astype(bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ref64(bits), ml)


def test_numpy_mode_names_no_kernel(monkeypatch):
    monkeypatch.setenv("MPIFUSION_HALFCAST", "numpy")
    assert halfcast.kernel_path() == "numpy"


@pytest.mark.parametrize("path", PATHS)
def test_unknown_or_absent_paths_are_refused(path):
    with pytest.raises(ValueError):
        halfcast._narrow_bf16_on("avx1024", np.zeros(4, float32), np.zeros(4, bfloat16))
    if path not in halfcast.kernel_paths():
        with pytest.raises(ValueError):
            halfcast._narrow_bf16_on(path, np.zeros(4, float32), np.zeros(4, bfloat16))


@pytest.mark.parametrize("path", PATHS)
def test_narrow_on_each_path(path):
    bits = patterns()
    src = bits.view(float32)
    got = halfcast._narrow_bf16_on(on(path), src, np.full(src.size, 7, bfloat16))
    want = ref64(bits)
    bad = np.flatnonzero(got.view(np.uint16) != want)
    assert not bad.size, [f"{bits[i]:#x}->{got.view(np.uint16)[i]:#x} (want {want[i]:#x})"
                          for i in bad[:5]]
    # the raw kernel writes the reference's quiet NaN too, and counts every NaN
    raw = np.full(src.size, 7, np.uint16)
    assert halfcast._kernels.narrow_bf16_at(path, bits, raw) == np.isnan(src).sum()
    np.testing.assert_array_equal(raw, want)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [*range(0, 70), 1023, 1024, 1025, 4099])
def test_narrow_tails_on_each_path(path, n):
    """Masked last steps: nothing written past n, every lane before it rounded."""
    rng = np.random.default_rng(n)
    bits = rng.integers(0, 1 << 32, size=n + 40, dtype=np.uint64).astype(np.uint32)
    out = np.full(n + 40, 0x1234, np.uint16)
    halfcast._narrow_bf16_on(on(path), bits[:n].view(float32), out[:n].view(bfloat16))
    np.testing.assert_array_equal(out[:n], ref64(bits[:n]))
    assert (out[n:] == 0x1234).all()


def subnormal_heavy(n, rng):
    """bf16 values a third of them subnormal (the lanes vcvtne2ps2bf16 would zero), the rest
    small normals, so sums cancel into and round within the subnormal range."""
    e = rng.integers(0, 4, n, dtype=np.uint16)
    bits = (e << 7) | rng.integers(0, 128, n, dtype=np.uint16)
    bits |= rng.integers(0, 2, n, dtype=np.uint16) << 15
    return bits.view(bfloat16)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("nsrc", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("scale", [None, 0.5, 1 / 3, 0.125, 3.0])
@pytest.mark.parametrize("data", ["edges", "subnormal"])
def test_sum_on_each_path(path, nsrc, scale, data):
    on(path)
    for n in [1, 15, 16, 17, 31, 32, 33, 63, 1025, 5003]:
        rng = np.random.default_rng(nsrc * 7919 + n)
        make = half_edges if data == "edges" else (lambda dt, m, r: subnormal_heavy(m, r))
        sources = [make(bfloat16, n, rng) for _ in range(nsrc)]
        want = ref_sum(sources, scale).view(np.uint16)
        np.testing.assert_array_equal(ref64(
            _fp32_sum(sources, scale).view(np.uint32)), want)  # both references agree
        dests = [np.full(n + 8, 7, bfloat16) for _ in range(2)]
        acc = np.empty(n, float32)
        assert halfcast._sum_bf16_on(path, sources, [d[:n] for d in dests], scale, acc) == n
        for d in dests:
            np.testing.assert_array_equal(d[:n].view(np.uint16), want)
            assert (d[n:] == 7).all()
        own = [s.copy() for s in sources]  # a rank's own buffer: a source and a dest
        assert halfcast._sum_bf16_on(path, own, [own[0]], scale, acc) == n
        np.testing.assert_array_equal(own[0].view(np.uint16), want)


def _fp32_sum(sources, scale):
    acc = sources[0].astype(float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for s in sources[1:]:
            acc = acc + s.astype(float32)
        if scale is not None and float(scale) != 1.0:
            acc = acc * np.float32(scale)
    return acc


@pytest.mark.parametrize("path", PATHS)
def test_sum_stops_before_a_nan_on_each_path(path):
    on(path)
    n = 5000
    rng = np.random.default_rng(3)
    sources = [half_edges(bfloat16, n, rng) for _ in range(2)]
    sources[0][2100], sources[1][2100] = np.inf, -np.inf
    want = ref_sum(sources, 0.5).view(np.uint16)
    dest = np.full(n, 7, bfloat16)
    done = halfcast._sum_bf16_on(path, sources, [dest], 0.5, np.empty(n, float32))
    assert done <= 2100 < done + 1024, done
    np.testing.assert_array_equal(dest[:done].view(np.uint16), want[:done])
    assert (dest[done:] == 7).all()


@pytest.mark.stress  # all 2^32 fp32 patterns on every path: ~2 minutes, pytest --stress
@pytest.mark.timeout(1200)
def test_every_fp32_pattern_on_every_path():
    k = halfcast._kernels
    chunk = 1 << 24
    ref = np.empty(chunk, np.uint16)
    out = np.empty(chunk, np.uint16)
    for base in range(0, 1 << 32, chunk):
        bits = np.arange(base, base + chunk, dtype=np.uint64).astype(np.uint32)
        nans = k.narrow_bf16_int(bits, ref)  # itself checked against ml_dtypes in
        for path in halfcast.kernel_paths():  # test_halfcast's all-pattern test
            assert k.narrow_bf16_at(path, bits, out) == nans, (path, base)
            assert np.array_equal(out, ref), (path, base)
