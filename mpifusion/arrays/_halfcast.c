/* Half <-> float32 conversion kernels for mpifusion.arrays.halfcast (see its docstring).
 *
 * The portable kernels use integer arithmetic only (plus one exact int->float conversion for
 * fp16 subnormals), so results do not depend on the FPU's rounding mode or on flush-to-zero /
 * denormals-are-zero flags another library may have set. Their loops are branch-free so the
 * compiler vectorises them; on x86-64 Linux an AVX2 clone is picked at load time
 * (target_clones). On x86-64 with AVX2 and F16C, fp16 goes through F16C (only while MXCSR's
 * FTZ/DAZ are off) and bf16 rounding through AVX2 intrinsics: both at memory speed.
 * Every kernel releases the GIL and returns the number of NaN inputs it saw: the Python side
 * re-casts those few elements with the reference cast (numpy / ml_dtypes), so NaN payloads are
 * whatever those produce.
 *
 * Buffers come in through the buffer protocol as raw bytes (uint16 / uint32 views), so no
 * numpy headers are needed to build this file.
 */
/* -ffast-math, -Ofast or -funsafe-math-optimizations (e.g. in $CFLAGS, which pip passes to
 * the compiler and the linker) make GCC link crtfastmath.o into this shared object: loading
 * it would turn on flush-to-zero and denormals-are-zero for the whole process, so numpy's
 * fp32 sums, scaling and bf16 casts would flush subnormals to 0; -ffinite-math-only would
 * drop the NaN tests that hand NaN results back to numpy. Refuse such a build: the
 * extension is optional, and halfcast falls back to numpy's and ml_dtypes' casts. */
#if defined(__FAST_MATH__) || defined(__ASSOCIATIVE_MATH__) || defined(__RECIPROCAL_MATH__) \
    || defined(__NO_SIGNED_ZEROS__) || (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__)
#error "_halfcast.c must not be built with -ffast-math/-Ofast/-funsafe-math-optimizations/\
-ffinite-math-only: loading it would set flush-to-zero for the whole process, or NaNs would \
go unseen (unset them in CFLAGS)"
#endif

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__INTEL_COMPILER)
#define HC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HC_CLONES
#endif

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
/* branch-free select (the loops must have no control flow to vectorise) */
static inline uint32_t sel(uint32_t cond, uint32_t a, uint32_t b)
{ uint32_t m = 0u - cond; return (a & m) | (b & ~m); }

/* The loops run in chunks of CHUNK elements with a 32-bit NaN counter, which keeps every
 * lane 32 bits wide (a 64-bit counter stops GCC from vectorising). */
#define CHUNK 4096
#define CHUNKED(body)                                                              \
    Py_ssize_t nans = 0;                                                           \
    for (Py_ssize_t lo = 0; lo < n; lo += CHUNK) {                                 \
        int m = (int)(n - lo < CHUNK ? n - lo : CHUNK);                            \
        const_src_t *restrict s_ = src + lo;                                       \
        dst_t *restrict d_ = dst + lo;                                             \
        uint32_t c = 0;                                                            \
        for (int i = 0; i < m; i++) { body }                                       \
        nans += c;                                                                 \
    }                                                                              \
    return nans;

/* fp16 -> fp32 (exact). NaN payloads shift up unchanged (numpy's rule). */
HC_CLONES static Py_ssize_t
widen_f16(const uint16_t *restrict src, uint32_t *restrict dst, Py_ssize_t n)
{
    typedef const uint16_t const_src_t; typedef uint32_t dst_t;
    CHUNKED(
        uint32_t h = s_[i];
        uint32_t sign = (h & 0x8000u) << 16;
        uint32_t em = h & 0x7fffu;
        uint32_t norm = (em << 13) + 0x38000000u;          /* exponent bias 15 -> 127 */
        uint32_t sub = f2u((float)(int32_t)em * 0x1p-24f);  /* exact: em < 2^10, result normal */
        uint32_t infnan = (em << 13) | 0x7f800000u;
        uint32_t r = sel(em < 0x0400u, sub, sel(em >= 0x7c00u, infnan, norm));
        c += em > 0x7c00u;
        d_[i] = r | sign;
    )
}

/* fp32 -> fp16, round to nearest even; overflow -> inf; subnormal results rounded exactly.
 * NaN: payload truncated, kept a NaN (numpy's rule). The scalar form is the reference; GCC
 * does not auto-vectorise it (mixed 16/32-bit lanes), so GCC/Clang get the same steps written
 * with vector extensions, 8 lanes at a time. */
static inline uint32_t
narrow_f16_1(uint32_t x, uint32_t *isnan)
{
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    /* normal fp16 result (a >= 2^-14): rebias, round the 13 dropped bits to even */
    uint32_t norm = (a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    /* subnormal fp16 result: round(mantissa * 2^(e - 126)) to even; shift kept in [1, 31] */
    uint32_t mant = (a & 0x007fffffu) | 0x00800000u;
    uint32_t sh = 126u - (a >> 23);            /* >= 14 where used */
    sh = sh > 31u ? 31u : (sh < 1u ? 1u : sh);
    uint32_t q = mant >> sh;
    uint32_t rem = mant & ((1u << sh) - 1u);
    uint32_t half = 1u << (sh - 1u);
    uint32_t sub = q + ((rem > half) | ((rem == half) & q & 1u));
    uint32_t nan = 0x7c00u | ((a >> 13) & 0x03ffu);
    nan += nan == 0x7c00u;
    *isnan = a > 0x7f800000u;
    uint32_t r = *isnan ? nan
               : a >= 0x477ff000u ? 0x7c00u             /* >= 65520 rounds to inf */
               : a >= 0x38800000u ? norm : sub;
    return r | sign;
}

#if defined(__GNUC__)
typedef uint32_t u32x8 __attribute__((vector_size(32)));
#define V(c) ((u32x8){c, c, c, c, c, c, c, c})
#define VSEL(m, a, b) (((a) & (m)) | ((b) & ~(m)))   /* m: all-ones or zero lanes */
#endif

HC_CLONES static Py_ssize_t
narrow_f16(const uint32_t *restrict src, uint16_t *restrict dst, Py_ssize_t n)
{
    Py_ssize_t nans = 0, i = 0;
#if defined(__GNUC__)
    while (i + 8 <= n) {
        Py_ssize_t stop = i + 8 * (Py_ssize_t)(CHUNK / 8);
        if (stop > n - 8) stop = n - 8;
        u32x8 c = V(0u);
        for (; i <= stop; i += 8) {
            u32x8 x;
            memcpy(&x, src + i, sizeof x);
            u32x8 sign = (x >> 16) & V(0x8000u);
            u32x8 a = x & V(0x7fffffffu);
            u32x8 norm = (a - V(0x38000000u) + V(0x0fffu) + ((a >> 13) & V(1u))) >> 13;
            u32x8 mant = (a & V(0x007fffffu)) | V(0x00800000u);
            u32x8 sh = V(126u) - (a >> 23);
            sh = VSEL((u32x8)(sh > 31u), V(31u), VSEL((u32x8)(sh < 1u), V(1u), sh));
            u32x8 q = mant >> sh;
            u32x8 rem = mant & ((V(1u) << sh) - 1u);
            u32x8 half = V(1u) << (sh - 1u);
            u32x8 sub = q - ((u32x8)(rem > half) | ((u32x8)(rem == half) & -(q & 1u)));
            u32x8 nan = V(0x7c00u) | ((a >> 13) & V(0x03ffu));
            nan -= (u32x8)(nan == 0x7c00u);
            u32x8 isnan = (u32x8)(a > 0x7f800000u);
            u32x8 r = VSEL(isnan, nan, VSEL((u32x8)(a >= 0x477ff000u), V(0x7c00u),
                                            VSEL((u32x8)(a >= 0x38800000u), norm, sub)));
            c -= isnan;
            r |= sign;
            for (int k = 0; k < 8; k++)
                dst[i + k] = (uint16_t)r[k];
        }
        nans += c[0] + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7];
    }
#endif
    for (; i < n; i++) {
        uint32_t isnan;
        dst[i] = (uint16_t)narrow_f16_1(src[i], &isnan);
        nans += isnan;
    }
    return nans;
}

/* bf16 -> fp32 (exact): the bits move up by 16. */
HC_CLONES static Py_ssize_t
widen_bf16(const uint16_t *restrict src, uint32_t *restrict dst, Py_ssize_t n)
{
    typedef const uint16_t const_src_t; typedef uint32_t dst_t;
    CHUNKED(
        uint32_t h = s_[i];
        c += (h & 0x7fffu) > 0x7f80u;
        d_[i] = h << 16;
    )
}

/* fp32 -> bf16, round to nearest even (overflow -> inf, subnormals rounded like normals).
 * NaN: quiet NaN with the sign kept (ml_dtypes' rule). */
HC_CLONES static Py_ssize_t
narrow_bf16(const uint32_t *restrict src, uint16_t *restrict dst, Py_ssize_t n)
{
    typedef const uint32_t const_src_t; typedef uint16_t dst_t;
    CHUNKED(
        uint32_t x = s_[i];
        uint32_t isnan = (x & 0x7fffffffu) > 0x7f800000u;
        uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
        r = sel(isnan, ((x >> 16) & 0x8000u) | 0x7fc0u, r);
        c += isnan;
        d_[i] = (uint16_t)r;
    )
}

/* x86-64: F16C converts 8 lanes per instruction (round-to-nearest-even given in the
 * instruction, so MXCSR's rounding mode does not matter). It is used only while this thread's
 * MXCSR has flush-to-zero and denormals-are-zero off (checked on every call), so subnormals
 * convert exactly as the integer code above does; NaNs are counted and re-cast by the caller
 * (hardware quiets signalling NaNs, numpy does not). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HC_F16C 1

static int
cpu_usable(void)   /* AVX2 and F16C on this CPU (and enabled by the OS) */
{
    static int cpu = -1;
    if (cpu < 0) {
        __builtin_cpu_init();
        cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    }
    return cpu;
}

static int
f16c_usable(void)
{
    return cpu_usable() && (_mm_getcsr() & 0x8040u) == 0;   /* FTZ (bit 15), DAZ (bit 6) off */
}

__attribute__((target("avx2,f16c"))) static Py_ssize_t
widen_f16_hw(const uint16_t *restrict src, uint32_t *restrict dst, Py_ssize_t n)
{
    Py_ssize_t nans = 0, i = 0;
    const __m128i mag = _mm_set1_epi16(0x7fff), inf = _mm_set1_epi16(0x7c00);
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        _mm256_storeu_ps((float *)(dst + i), _mm256_cvtph_ps(h));
        int m = _mm_movemask_epi8(_mm_cmpgt_epi16(_mm_and_si128(h, mag), inf));
        if (m)
            nans += __builtin_popcount((unsigned)m) / 2;
    }
    return nans + widen_f16(src + i, dst + i, n - i);
}

__attribute__((target("avx2,f16c"))) static Py_ssize_t
narrow_f16_hw(const uint32_t *restrict src, uint16_t *restrict dst, Py_ssize_t n)
{
    Py_ssize_t nans = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps((const float *)(src + i));
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        int m = _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        if (m)
            nans += __builtin_popcount((unsigned)m);
    }
    return nans + narrow_f16(src + i, dst + i, n - i);
}

/* bf16 rounding, 16 lanes per step with an exact pack (GCC's own vectorisation of the loop
 * above narrows lane by lane) */
__attribute__((target("avx2"))) static inline __m256i
round_bf16_8(__m256i x, __m256i *nanacc)
{
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    const __m256i mag = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i qnan = _mm256_set1_epi32(0x7fc0);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, bias), lsb), 16);
    __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(x, mag), inf);
    __m256i nanv = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(x, 16),
                                                    _mm256_set1_epi32(0x8000)), qnan);
    *nanacc = _mm256_or_si256(*nanacc, isnan);
    return _mm256_blendv_epi8(r, nanv, isnan);
}

__attribute__((target("avx2"))) static Py_ssize_t
narrow_bf16_hw(const uint32_t *restrict src, uint16_t *restrict dst, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    __m256i nanacc = _mm256_setzero_si256();
    for (; i + 16 <= n; i += 16) {
        __m256i lo = round_bf16_8(_mm256_loadu_si256((const __m256i *)(src + i)), &nanacc);
        __m256i hi = round_bf16_8(_mm256_loadu_si256((const __m256i *)(src + i + 8)), &nanacc);
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
        _mm256_storeu_si256((__m256i *)(dst + i), p);
    }
    Py_ssize_t tail = narrow_bf16(src + i, dst + i, n - i);
    if (_mm256_testz_si256(nanacc, nanacc))
        return tail;
    return narrow_bf16(src, dst, i) + tail;   /* NaNs seen: count them (rare) */
}
#endif

typedef Py_ssize_t (*kernel_fn)(const void *, void *, Py_ssize_t);

/* kernel(src, dst): src and dst are C-contiguous buffers of the same element count. */
static PyObject *
run(PyObject *args, kernel_fn fn, Py_ssize_t src_size, Py_ssize_t dst_size)
{
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst))
        return NULL;
    PyObject *res = NULL;
    if (src.len % src_size || dst.len % dst_size || src.len / src_size != dst.len / dst_size) {
        PyErr_SetString(PyExc_ValueError, "halfcast: source and destination sizes differ");
    } else {
        Py_ssize_t n = src.len / src_size, nans;
        Py_BEGIN_ALLOW_THREADS
        nans = fn(src.buf, dst.buf, n);
        Py_END_ALLOW_THREADS
        res = PyLong_FromSsize_t(nans);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return res;
}

static PyObject *py_widen_f16(PyObject *self, PyObject *args)
{
#ifdef HC_F16C
    if (f16c_usable())
        return run(args, (kernel_fn)widen_f16_hw, 2, 4);
#endif
    return run(args, (kernel_fn)widen_f16, 2, 4);
}
static PyObject *py_narrow_f16(PyObject *self, PyObject *args)
{
#ifdef HC_F16C
    if (f16c_usable())
        return run(args, (kernel_fn)narrow_f16_hw, 4, 2);
#endif
    return run(args, (kernel_fn)narrow_f16, 4, 2);
}
/* which fp16 path runs on this thread now: "f16c" or "integer" (for tests and benchmarks) */
static PyObject *py_f16_path(PyObject *self, PyObject *noargs)
{
#ifdef HC_F16C
    if (f16c_usable())
        return PyUnicode_FromString("f16c");
#endif
    return PyUnicode_FromString("integer");
}
/* the portable kernels, whatever the CPU: so tests cover both paths */
static PyObject *py_widen_f16_int(PyObject *self, PyObject *args)
{ return run(args, (kernel_fn)widen_f16, 2, 4); }
static PyObject *py_narrow_f16_int(PyObject *self, PyObject *args)
{ return run(args, (kernel_fn)narrow_f16, 4, 2); }
static PyObject *py_narrow_bf16_int(PyObject *self, PyObject *args)
{ return run(args, (kernel_fn)narrow_bf16, 4, 2); }
static PyObject *py_widen_bf16(PyObject *self, PyObject *args)
{ return run(args, (kernel_fn)widen_bf16, 2, 4); }
static int bf16_best(void);
static kernel_fn bf16_narrow_fn(int p);
static PyObject *py_narrow_bf16(PyObject *self, PyObject *args)
{   /* integer or vcvtne2ps2bf16 (its own rounding): MXCSR does not matter */
    return run(args, bf16_narrow_fn(bf16_best()), 4, 2);
}

/* The shm reduction of half-precision buffers (shm_collectives._sum_into) in one pass per
 * SUM_GROUP sources: per block of SUM_BLOCK elements, widen the first source with the kernel
 * above, add every other source widened, in the order given (fp32 additions as numpy's
 * np.add makes them: IEEE binary32, under the same rounding mode and MXCSR flags), multiply
 * by ``scale`` (fp32) unless it is 1, round with the kernel above and store the result in
 * every destination: bit for bit halfcast.widen, np.add, np.multiply and halfcast.narrow,
 * with the block in L1 instead of four passes over a chunk. More sources take one pass per
 * group, keeping the sum in ``acc`` (fp32, n elements): a few streams per pass keep the
 * hardware prefetchers ahead (eight sources in one pass ran 1.4x slower than numpy's pass per
 * source). Sources and destinations may be the same memory (a rank's own buffer is both): a
 * block is read in full before any of it is written, at the same offsets. A block whose
 * result has a NaN stops the last pass before it is written: the caller finishes from there
 * with the reference casts (NaN payloads). Returns the number of elements done. */
#define SUM_BLOCK 1024
#define SUM_GROUP 4
#define SUM_MAX 64

HC_CLONES static void
add_into(float *restrict a, const float *restrict b, int m)
{
    for (int i = 0; i < m; i++)
        a[i] = a[i] + b[i];
}

HC_CLONES static void
scale_by(float *a, float s, int m)
{
    for (int i = 0; i < m; i++)
        a[i] = a[i] * s;
}

static Py_ssize_t
sum_half(kernel_fn widen, kernel_fn narrow, const uint16_t *const *src, Py_ssize_t nsrc,
         uint16_t *const *dst, Py_ssize_t ndst, float scale, int scaled, float *acc,
         Py_ssize_t n)
{
    float local[SUM_BLOCK], wide[SUM_BLOCK];
    uint16_t out[SUM_BLOCK];
    for (Py_ssize_t g0 = 0; g0 < nsrc; g0 += SUM_GROUP) {
        Py_ssize_t g1 = g0 + SUM_GROUP < nsrc ? g0 + SUM_GROUP : nsrc;
        int first = g0 == 0, last = g1 == nsrc;
        for (Py_ssize_t lo = 0; lo < n; lo += SUM_BLOCK) {
            int m = (int)(n - lo < SUM_BLOCK ? n - lo : SUM_BLOCK);
            float *a = (first && last) ? local : acc + lo;
            Py_ssize_t k = g0;
            if (first) {
                widen(src[0] + lo, a, m);   /* NaN counts: a NaN reaches the result */
                k = 1;
            }
            for (; k < g1; k++) {
                widen(src[k] + lo, wide, m);
                add_into(a, wide, m);
            }
            if (!last)
                continue;
            if (scaled)
                scale_by(a, scale, m);
            if (narrow(a, out, m))
                return lo;
            for (Py_ssize_t d = 0; d < ndst; d++)
                memcpy(dst[d] + lo, out, (size_t)m * 2);
        }
    }
    return n;
}

#ifdef HC_F16C
/* bf16 with AVX2 and at most SUM_GROUP sources: the steps of sum_half for 16 lanes at a time
 * in registers (widen, add in order, scale, round, store every destination), with no pass
 * over a block: 0.29 ns per element against 0.49 for sum_half's five passes (2 sources,
 * 256K elements). Returns the lanes done: all full vectors, or those before 16 lanes whose
 * result has a NaN; sum_half goes on from there (and stops at once on that NaN). */
__attribute__((target("avx2"))) static inline __m256
widen_bf16_8(const uint16_t *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

__attribute__((target("avx2"))) static Py_ssize_t
sum_bf16_hw(const uint16_t *const *src, Py_ssize_t nsrc, uint16_t *const *dst,
            Py_ssize_t ndst, float scale, int scaled, Py_ssize_t n)
{
    const __m256 sc = _mm256_set1_ps(scale);
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 lo = widen_bf16_8(src[0] + i), hi = widen_bf16_8(src[0] + i + 8);
        for (Py_ssize_t k = 1; k < nsrc; k++) {
            lo = _mm256_add_ps(lo, widen_bf16_8(src[k] + i));
            hi = _mm256_add_ps(hi, widen_bf16_8(src[k] + i + 8));
        }
        if (scaled) {
            lo = _mm256_mul_ps(lo, sc);
            hi = _mm256_mul_ps(hi, sc);
        }
        __m256i nan = _mm256_setzero_si256();
        __m256i rlo = round_bf16_8(_mm256_castps_si256(lo), &nan);
        __m256i rhi = round_bf16_8(_mm256_castps_si256(hi), &nan);
        if (!_mm256_testz_si256(nan, nan))
            return i;
        __m256i r = _mm256_permute4x64_epi64(_mm256_packus_epi32(rlo, rhi), 0xd8);
        for (Py_ssize_t d = 0; d < ndst; d++)
            _mm256_storeu_si256((__m256i *)(dst[d] + i), r);
    }
    return i;
}

/* fp16 the same way with F16C (only while MXCSR's FTZ/DAZ are off, as widen/narrow_f16_hw):
 * 8 lanes at a time, rounded by the instruction to nearest even */
__attribute__((target("avx2,f16c"))) static Py_ssize_t
sum_f16_hw(const uint16_t *const *src, Py_ssize_t nsrc, uint16_t *const *dst,
           Py_ssize_t ndst, float scale, int scaled, Py_ssize_t n)
{
    const __m256 sc = _mm256_set1_ps(scale);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src[0] + i)));
        for (Py_ssize_t k = 1; k < nsrc; k++)
            x = _mm256_add_ps(x, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src[k] + i))));
        if (scaled)
            x = _mm256_mul_ps(x, sc);
        if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)))
            return i;
        __m128i r = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        for (Py_ssize_t d = 0; d < ndst; d++)
            _mm_storeu_si128((__m128i *)(dst[d] + i), r);
    }
    return i;
}

/* AVX-512 (F, BW, VL: Skylake-SP and later, Zen 4): the bf16 sum and rounding 32 lanes per
 * step, the last lanes through masks, so no element is left to sum_half's block passes.
 * AVX512-BF16 (vcvtne2ps2bf16, Cooper Lake, Sapphire Rapids, Zen 4) packs 32 lanes in one
 * instruction, always to nearest even whatever MXCSR says, but it reads fp32 subnormals as
 * zero (DAZ: 0x00008001 gives 0x0000, ml_dtypes 0x0001) and keeps NaN payloads (0x7f810000
 * gives 0x7fc1, ml_dtypes 0x7fc0): checked over all 2^32 patterns, every other input rounds
 * alike. So a step with a subnormal lane takes the integer rounding for that step, and NaNs
 * stop the sum / are counted and re-cast by the caller as elsewhere. The fp32 adds and the
 * scale are the same instructions as numpy's (MXCSR rounding and FTZ/DAZ), 16 lanes wide;
 * that is what still depends on the data: bf16 values (unlike fp16 ones) can be fp32
 * subnormals, and a multiply that reads or makes one runs slower in hardware (all-subnormal
 * sources: 2-3.7x the time on a Zen 4). Flushing them would change the bits. */
#if (defined(__clang__) && __clang_major__ >= 11) || (!defined(__clang__) && __GNUC__ >= 10)
#define HC_AVX512 1
#define T512 "avx512f,avx512bw,avx512vl"
#define T512BF16 "avx512f,avx512bw,avx512vl,avx512bf16"

__attribute__((target(T512))) static inline __m512
widen_bf16_16(const uint16_t *p, __mmask16 k)
{
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* the integer rounding of narrow_bf16 on 16 lanes (NaN lanes: the quiet NaN it writes) */
__attribute__((target(T512))) static inline __m512i
round_bf16_16(__m512i x, __mmask16 isnan)
{
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    __m512i nanv = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(x, 16),
                                                    _mm512_set1_epi32(0x8000)),
                                   _mm512_set1_epi32(0x7fc0));
    return _mm512_mask_mov_epi32(r, isnan, nanv);
}

/* an integer compare, as narrow_bf16's NaN test */
__attribute__((target(T512))) static inline __mmask16
nan_lanes(__m512 x)
{
    __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
    return _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
}

/* 32 rounded lanes (lo, hi: 16 each, values < 2^16) as 32 uint16 in order */
__attribute__((target(T512))) static inline __m512i
pack_32(__m512i lo, __m512i hi)
{
    const __m512i order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
    return _mm512_permutexvar_epi64(order, _mm512_packus_epi32(lo, hi));
}

/* lanes that are fp32 subnormals (nonzero, exponent field 0): those vcvtne2ps2bf16 zeroes */
__attribute__((target(T512))) static inline __mmask16
subnormal_lanes(__m512 x)
{
    __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
    return _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(1)),
                                   _mm512_set1_epi32(0x007fffff));
}

__attribute__((target(T512BF16))) static inline __m512i
round_bf16_32_hw(__m512 lo, __m512 hi)
{
    if (subnormal_lanes(lo) | subnormal_lanes(hi))   /* rare: DAZ would zero them */
        return pack_32(round_bf16_16(_mm512_castps_si512(lo), 0),
                       round_bf16_16(_mm512_castps_si512(hi), 0));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

#define SUM_BF16_512(NAME, TARGET, ROUND32)                                                 \
__attribute__((target(TARGET))) static Py_ssize_t                                          \
NAME(const uint16_t *const *src, Py_ssize_t nsrc, uint16_t *const *dst, Py_ssize_t ndst,  \
     float scale, int scaled, Py_ssize_t n)                                                \
{                                                                                          \
    const __m512 sc = _mm512_set1_ps(scale);                                               \
    Py_ssize_t i = 0;                                                                      \
    for (; i < n; i += 32) {                                                               \
        Py_ssize_t left = n - i;                                                           \
        __mmask16 klo = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);              \
        __mmask16 khi = left >= 32 ? 0xffff : left <= 16 ? 0                               \
                      : (__mmask16)((1u << (left - 16)) - 1u);                             \
        __m512 lo = widen_bf16_16(src[0] + i, klo), hi = widen_bf16_16(src[0] + i + 16, khi); \
        for (Py_ssize_t k = 1; k < nsrc; k++) {                                            \
            lo = _mm512_add_ps(lo, widen_bf16_16(src[k] + i, klo));                        \
            hi = _mm512_add_ps(hi, widen_bf16_16(src[k] + i + 16, khi));                   \
        }                                                                                  \
        if (scaled) {                                                                      \
            lo = _mm512_mul_ps(lo, sc);                                                    \
            hi = _mm512_mul_ps(hi, sc);                                                    \
        }                                                                                  \
        if (nan_lanes(lo) | nan_lanes(hi))   /* masked-off lanes are 0: never NaN */       \
            return i;                                                                      \
        __m512i r = ROUND32(lo, hi);                                                       \
        __mmask32 k = (__mmask32)klo | ((__mmask32)khi << 16);                             \
        for (Py_ssize_t d = 0; d < ndst; d++)                                              \
            _mm512_mask_storeu_epi16(dst[d] + i, k, r);                                    \
    }                                                                                      \
    return n;                                                                              \
}

__attribute__((target(T512))) static inline __m512i
round_bf16_32(__m512 lo, __m512 hi)
{
    return pack_32(round_bf16_16(_mm512_castps_si512(lo), 0),
                   round_bf16_16(_mm512_castps_si512(hi), 0));
}

SUM_BF16_512(sum_bf16_512, T512, round_bf16_32)
SUM_BF16_512(sum_bf16_512bf16, T512BF16, round_bf16_32_hw)

/* narrow_bf16 32 lanes per step; NaN lanes get narrow_bf16's quiet NaN and are counted */
#define NARROW_BF16_512(NAME, TARGET, ROUND32)                                              \
__attribute__((target(TARGET))) static Py_ssize_t                                          \
NAME(const uint32_t *restrict src, uint16_t *restrict dst, Py_ssize_t n)                   \
{                                                                                          \
    Py_ssize_t nans = 0;                                                                   \
    for (Py_ssize_t i = 0; i < n; i += 32) {                                               \
        Py_ssize_t left = n - i;                                                           \
        __mmask16 klo = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);              \
        __mmask16 khi = left >= 32 ? 0xffff : left <= 16 ? 0                               \
                      : (__mmask16)((1u << (left - 16)) - 1u);                             \
        __m512 lo = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(klo, src + i));           \
        __m512 hi = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(khi, src + i + 16));      \
        __mmask16 nlo = nan_lanes(lo), nhi = nan_lanes(hi);                                \
        __m512i r;                                                                         \
        if (nlo | nhi) {                                                                   \
            nans += __builtin_popcount((unsigned)nlo) + __builtin_popcount((unsigned)nhi); \
            r = pack_32(round_bf16_16(_mm512_castps_si512(lo), nlo),                       \
                        round_bf16_16(_mm512_castps_si512(hi), nhi));                      \
        } else {                                                                           \
            r = ROUND32(lo, hi);                                                           \
        }                                                                                  \
        _mm512_mask_storeu_epi16(dst + i, (__mmask32)klo | ((__mmask32)khi << 16), r);     \
    }                                                                                      \
    return nans;                                                                           \
}
NARROW_BF16_512(narrow_bf16_512, T512, round_bf16_32)
NARROW_BF16_512(narrow_bf16_512bf16, T512BF16, round_bf16_32_hw)
#endif
#endif

/* The bf16 paths (rounding, and the fused sum of up to SUM_GROUP sources), picked at run
 * time from what this CPU has: the wheel is built for any x86-64 (or aarch64, where only
 * "generic" exists) and every path gives the same bits (tests run each one this CPU has). */
enum { BF16_GENERIC, BF16_AVX2, BF16_AVX512, BF16_AVX512BF16, BF16_NPATHS };
static const char *const bf16_names[BF16_NPATHS] = {"generic", "avx2", "avx512", "avx512bf16"};
#ifdef HC_F16C
#define HC_F16C_NOW() f16c_usable()
#else
#define HC_F16C_NOW() 0
#endif
typedef Py_ssize_t (*fused_fn)(const uint16_t *const *, Py_ssize_t, uint16_t *const *,
                               Py_ssize_t, float, int, Py_ssize_t);

static int
bf16_has(int p)
{
    switch (p) {
    case BF16_GENERIC:
        return 1;
#ifdef HC_F16C
    case BF16_AVX2:
        return cpu_usable();
#ifdef HC_AVX512
    case BF16_AVX512:
    case BF16_AVX512BF16: {
        static int has[2] = {-1, -1};
        int j = p == BF16_AVX512BF16;
        if (has[j] < 0) {   /* libgcc's check includes the OS saving the zmm/mask state */
            __builtin_cpu_init();
            has[j] = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                     && __builtin_cpu_supports("avx512vl")
                     && (!j || __builtin_cpu_supports("avx512bf16"));
        }
        return has[j];
    }
#endif
#endif
    default:
        return 0;
    }
}

static int
bf16_best(void)
{
    static const int order[] = {BF16_AVX512BF16, BF16_AVX512, BF16_AVX2};
    for (size_t k = 0; k < sizeof order / sizeof order[0]; k++)
        if (bf16_has(order[k]))
            return order[k];
    return BF16_GENERIC;
}

static kernel_fn
bf16_narrow_fn(int p)
{
    switch (p) {
#ifdef HC_F16C
    case BF16_AVX2: return (kernel_fn)narrow_bf16_hw;
#ifdef HC_AVX512
    case BF16_AVX512: return (kernel_fn)narrow_bf16_512;
    case BF16_AVX512BF16: return (kernel_fn)narrow_bf16_512bf16;
#endif
#endif
    default: return (kernel_fn)narrow_bf16;
    }
}

static fused_fn
bf16_sum_fn(int p)
{
    switch (p) {
#ifdef HC_F16C
    case BF16_AVX2: return sum_bf16_hw;
#ifdef HC_AVX512
    case BF16_AVX512: return sum_bf16_512;
    case BF16_AVX512BF16: return sum_bf16_512bf16;
#endif
#endif
    default: return NULL;
    }
}

/* the path index named by a str argument, or -1 with ValueError (not a path of this CPU) */
static int
bf16_path_arg(PyObject *name)
{
    const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (s == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "bf16 path: a str");
        return -1;
    }
    for (int p = 0; p < BF16_NPATHS; p++)
        if (strcmp(s, bf16_names[p]) == 0) {
            if (bf16_has(p))
                return p;
            break;
        }
    PyErr_Format(PyExc_ValueError, "bf16 path %R: not one this CPU and build have", name);
    return -1;
}

static void
release_views(Py_buffer *views, Py_ssize_t got)
{
    for (Py_ssize_t k = 0; k < got; k++)
        PyBuffer_Release(&views[k]);
}

/* sum_bf16 / sum_f16(sources, dests, scale or None, acc) -> elements done (see sum_half):
 * sources and dests are tuples of uint16 buffers of n elements, acc a float32 buffer of n */
static PyObject *
sum_call(PyObject *args, int bf16, int path)   /* path: a BF16_ index, -1: the best here */
{
    int portable = path == BF16_GENERIC;
    PyObject *srcs, *dsts, *scale_obj, *acc_obj;
    if (!PyArg_ParseTuple(args, "O!O!OO", &PyTuple_Type, &srcs, &PyTuple_Type, &dsts,
                          &scale_obj, &acc_obj))
        return NULL;
    Py_ssize_t ns = PyTuple_GET_SIZE(srcs), nd = PyTuple_GET_SIZE(dsts);
    if (ns < 1 || ns > SUM_MAX || nd > SUM_MAX) {
        PyErr_SetString(PyExc_ValueError, "halfcast sum: 1-64 sources and at most 64 dests");
        return NULL;
    }
    float scale = 1.0f;
    int scaled = scale_obj != Py_None;
    if (scaled) {
        double d = PyFloat_AsDouble(scale_obj);
        if (d == -1.0 && PyErr_Occurred())
            return NULL;
        scale = (float)d;
        scaled = scale != 1.0f;   /* x * 1 == x: the reference skips the pass too */
    }
    kernel_fn widen = (kernel_fn)widen_bf16, narrow = (kernel_fn)narrow_bf16;
    if (!bf16) {
        widen = (kernel_fn)widen_f16;
        narrow = (kernel_fn)narrow_f16;
    }
    int bp = path < 0 ? bf16_best() : path;
    fused_fn bf16_sum = NULL;
    if (bf16) {
        narrow = bf16_narrow_fn(bp);
        bf16_sum = bf16_sum_fn(bp);
    }
#ifdef HC_F16C
    if (!bf16 && !portable && f16c_usable()) {
        widen = (kernel_fn)widen_f16_hw;
        narrow = (kernel_fn)narrow_f16_hw;
    }
#endif
    Py_buffer views[2 * SUM_MAX + 1];
    const uint16_t *sp[SUM_MAX];
    uint16_t *dp[SUM_MAX];
    Py_ssize_t got = 0, len = -1, total = ns + nd + 1;
    PyObject *res = NULL;
    for (Py_ssize_t k = 0; k < total; k++) {
        PyObject *obj = k < ns ? PyTuple_GET_ITEM(srcs, k)
                      : k < ns + nd ? PyTuple_GET_ITEM(dsts, k - ns) : acc_obj;
        int flags = k < ns ? PyBUF_C_CONTIGUOUS : (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE);
        if (PyObject_GetBuffer(obj, &views[k], flags) < 0)
            goto done;
        got++;
        if (len < 0)
            len = views[k].len;
        if (k < total - 1 ? views[k].len != len || len % 2 : views[k].len < 2 * len) {
            PyErr_SetString(PyExc_ValueError, "halfcast sum: buffers of different sizes");
            goto done;
        }
        if (k < ns)
            sp[k] = (const uint16_t *)views[k].buf;
        else if (k < ns + nd)
            dp[k - ns] = (uint16_t *)views[k].buf;
    }
    Py_ssize_t done_n;
    float *acc = (float *)views[total - 1].buf;
    int fused = 0;   /* 1: bf16_sum, 2: sum_f16_hw */
    if (ns <= SUM_GROUP && !portable)
        fused = bf16 ? bf16_sum != NULL : 2 * HC_F16C_NOW();
    Py_ssize_t n = len / 2;
    Py_BEGIN_ALLOW_THREADS
    done_n = 0;
    if (fused == 1)
        done_n = bf16_sum(sp, ns, dp, nd, scale, scaled, n);
#ifdef HC_F16C
    else if (fused == 2)
        done_n = sum_f16_hw(sp, ns, dp, nd, scale, scaled, n);
#endif
    if (done_n < n) {   /* all, the lanes past the last vector, or from a NaN's lanes on */
        for (Py_ssize_t k = 0; k < ns; k++)
            sp[k] += done_n;
        for (Py_ssize_t d = 0; d < nd; d++)
            dp[d] += done_n;
        done_n += sum_half(widen, narrow, sp, ns, dp, nd, scale, scaled, acc + done_n,
                           n - done_n);
    }
    Py_END_ALLOW_THREADS
    res = PyLong_FromSsize_t(done_n);
done:
    release_views(views, got);
    return res;
}

/* fp32/fp64: out = scale * (s0 + s1 + ...), added left to right in the order of the sources
 * and each step rounded to the type, as numpy's add and multiply (skipped for a scale of 1)
 * compute it; one call instead of numpy's 2-3 passes, for the small all-reduce of shm (2
 * sources of 1024 fp32: 0.69 us with the buffer checks, against 1.3 us, mostly numpy's call
 * overhead). Returns the elements done: all, or up to the block of a NaN result (numpy
 * decides NaN payloads; the caller finishes from there). out must be apart from every
 * source. */
#define WIDE_BLOCK 256
#define SUM_WIDE(NAME, T)                                                              \
static Py_ssize_t                                                                       \
NAME(const T *const *src, Py_ssize_t ns, T *out, T scale, int scaled, Py_ssize_t n)    \
{                                                                                       \
    for (Py_ssize_t lo = 0; lo < n; lo += WIDE_BLOCK) {                                 \
        Py_ssize_t m = n - lo < WIDE_BLOCK ? n - lo : WIDE_BLOCK;                       \
        T *restrict o = out + lo;                                                       \
        const T *restrict a = src[0] + lo;                                              \
        if (ns == 1) {                                                                  \
            for (Py_ssize_t i = 0; i < m; i++)                                          \
                o[i] = a[i];                                                            \
        } else {                                                                        \
            const T *restrict b = src[1] + lo;                                          \
            for (Py_ssize_t i = 0; i < m; i++)                                          \
                o[i] = a[i] + b[i];                                                     \
        }                                                                               \
        for (Py_ssize_t k = 2; k < ns; k++) {                                           \
            const T *restrict c = src[k] + lo;                                          \
            for (Py_ssize_t i = 0; i < m; i++)                                          \
                o[i] = o[i] + c[i];                                                     \
        }                                                                               \
        if (scaled)                                                                     \
            for (Py_ssize_t i = 0; i < m; i++)                                          \
                o[i] = o[i] * scale;                                                    \
        int nan = 0;                                                                    \
        for (Py_ssize_t i = 0; i < m; i++)                                              \
            nan |= o[i] != o[i];                                                        \
        if (nan)                                                                        \
            return lo;                                                                  \
    }                                                                                   \
    return n;                                                                           \
}
SUM_WIDE(sum_wide_f32, float)
SUM_WIDE(sum_wide_f64, double)

/* sum_f32 / sum_f64(sources, out, scale or None) -> elements done (see SUM_WIDE) */
static PyObject *
sum_wide_call(PyObject *args, int f64)
{
    PyObject *srcs, *out_obj, *scale_obj;
    if (!PyArg_ParseTuple(args, "O!OO", &PyTuple_Type, &srcs, &out_obj, &scale_obj))
        return NULL;
    Py_ssize_t ns = PyTuple_GET_SIZE(srcs), size = f64 ? 8 : 4;
    if (ns < 1 || ns > SUM_MAX) {
        PyErr_SetString(PyExc_ValueError, "sum_wide: 1-64 sources");
        return NULL;
    }
    double d = 1.0;
    if (scale_obj != Py_None && (d = PyFloat_AsDouble(scale_obj)) == -1.0 && PyErr_Occurred())
        return NULL;
    Py_buffer views[SUM_MAX + 1];
    const char *sp[SUM_MAX];
    Py_ssize_t got = 0;
    PyObject *res = NULL;
    const char *want = f64 ? "d" : "f";   /* native byte order only */
    if (PyObject_GetBuffer(out_obj, &views[0],
                           PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return NULL;
    got = 1;
    const char *o0 = (const char *)views[0].buf, *o1 = o0 + views[0].len;
    for (Py_ssize_t k = 0; k <= ns; k++) {
        if (k && PyObject_GetBuffer(PyTuple_GET_ITEM(srcs, k - 1), &views[k],
                                    PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        got = k + 1;
        if (views[k].format == NULL || strcmp(views[k].format, want) != 0) {
            PyErr_SetString(PyExc_ValueError, "sum_wide: not all of the one native dtype");
            goto done;
        }
        if (!k)
            continue;
        sp[k - 1] = (const char *)views[k].buf;
        if (views[k].len != views[0].len || views[0].len % size) {
            PyErr_SetString(PyExc_ValueError, "sum_wide: buffers of different sizes");
            goto done;
        }
        if (views[0].len && sp[k - 1] < o1 && o0 < sp[k - 1] + views[0].len) {
            PyErr_SetString(PyExc_ValueError, "sum_wide: the output overlaps a source");
            goto done;
        }
    }
    Py_ssize_t n = views[0].len / size, done_n;
    int scaled = scale_obj != Py_None && (f64 ? d != 1.0 : (float)d != 1.0f);
    Py_BEGIN_ALLOW_THREADS
    if (f64)
        done_n = sum_wide_f64((const double *const *)sp, ns, (double *)views[0].buf, d,
                              scaled, n);
    else
        done_n = sum_wide_f32((const float *const *)sp, ns, (float *)views[0].buf, (float)d,
                              scaled, n);
    Py_END_ALLOW_THREADS
    res = PyLong_FromSsize_t(done_n);
done:
    release_views(views, got);
    return res;
}
static PyObject *py_sum_f32(PyObject *self, PyObject *args) { return sum_wide_call(args, 0); }
static PyObject *py_sum_f64(PyObject *self, PyObject *args) { return sum_wide_call(args, 1); }

static PyObject *py_sum_bf16(PyObject *self, PyObject *args) { return sum_call(args, 1, -1); }
static PyObject *py_sum_f16(PyObject *self, PyObject *args) { return sum_call(args, 0, -1); }
/* sum_half over the portable kernels only, whatever the CPU: so tests cover that path */
static PyObject *py_sum_bf16_int(PyObject *self, PyObject *args)
{ return sum_call(args, 1, BF16_GENERIC); }
static PyObject *py_sum_f16_int(PyObject *self, PyObject *args)
{ return sum_call(args, 0, BF16_GENERIC); }

/* the bf16 path sum_bf16 and narrow_bf16 take here, and every path this CPU has */
static PyObject *py_bf16_path(PyObject *self, PyObject *noargs)
{ return PyUnicode_FromString(bf16_names[bf16_best()]); }
static PyObject *py_bf16_paths(PyObject *self, PyObject *noargs)
{
    PyObject *t = PyTuple_New(0);
    for (int p = 0; t != NULL && p < BF16_NPATHS; p++) {
        if (!bf16_has(p))
            continue;
        PyObject *name = PyUnicode_FromString(bf16_names[p]);
        if (name == NULL || _PyTuple_Resize(&t, PyTuple_GET_SIZE(t) + 1) < 0) {
            Py_XDECREF(name);
            Py_XDECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, PyTuple_GET_SIZE(t) - 1, name);
    }
    return t;
}

/* sum_bf16_at(path, ...) / narrow_bf16_at(path, ...): sum_bf16 / narrow_bf16 on the named
 * path (one of bf16_paths()), so tests cover every path of the CPU they run on */
static PyObject *
call_at(PyObject *args, int sum)
{
    if (PyTuple_GET_SIZE(args) < 1) {
        PyErr_SetString(PyExc_TypeError, "the path name first");
        return NULL;
    }
    int p = bf16_path_arg(PyTuple_GET_ITEM(args, 0));
    if (p < 0)
        return NULL;
    PyObject *rest = PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args));
    if (rest == NULL)
        return NULL;
    PyObject *res = sum ? sum_call(rest, 1, p) : run(rest, bf16_narrow_fn(p), 4, 2);
    Py_DECREF(rest);
    return res;
}
static PyObject *py_sum_bf16_at(PyObject *self, PyObject *args) { return call_at(args, 1); }
static PyObject *py_narrow_bf16_at(PyObject *self, PyObject *args) { return call_at(args, 0); }

static PyMethodDef methods[] = {
    {"widen_f16", py_widen_f16, METH_VARARGS, "widen_f16(src_u16, dst_u32) -> NaN count"},
    {"narrow_f16", py_narrow_f16, METH_VARARGS, "narrow_f16(src_u32, dst_u16) -> NaN count"},
    {"widen_bf16", py_widen_bf16, METH_VARARGS, "widen_bf16(src_u16, dst_u32) -> NaN count"},
    {"narrow_bf16", py_narrow_bf16, METH_VARARGS, "narrow_bf16(src_u32, dst_u16) -> NaN count"},
    {"widen_f16_int", py_widen_f16_int, METH_VARARGS, "widen_f16 without F16C"},
    {"narrow_f16_int", py_narrow_f16_int, METH_VARARGS, "narrow_f16 without F16C"},
    {"narrow_bf16_int", py_narrow_bf16_int, METH_VARARGS, "narrow_bf16, portable loop"},
    {"sum_bf16", py_sum_bf16, METH_VARARGS,
     "sum_bf16(sources_u16, dests_u16, scale, acc_f32) -> elements done (a NaN stops it)"},
    {"sum_f16", py_sum_f16, METH_VARARGS,
     "sum_f16(sources_u16, dests_u16, scale, acc_f32) -> elements done (a NaN stops it)"},
    {"sum_bf16_int", py_sum_bf16_int, METH_VARARGS, "sum_bf16, portable kernels only"},
    {"sum_f16_int", py_sum_f16_int, METH_VARARGS, "sum_f16, portable kernels only"},
    {"sum_f32", py_sum_f32, METH_VARARGS,
     "sum_f32(sources, out, scale) -> elements done (a NaN stops it)"},
    {"sum_f64", py_sum_f64, METH_VARARGS,
     "sum_f64(sources, out, scale) -> elements done (a NaN stops it)"},
    {"f16_path", py_f16_path, METH_NOARGS, "'f16c' or 'integer': the fp16 path used now"},
    {"bf16_path", py_bf16_path, METH_NOARGS,
     "the bf16 path used here: 'avx512bf16', 'avx512', 'avx2' or 'generic'"},
    {"bf16_paths", py_bf16_paths, METH_NOARGS, "every bf16 path this CPU and build have"},
    {"sum_bf16_at", py_sum_bf16_at, METH_VARARGS, "sum_bf16 on the named path (tests)"},
    {"narrow_bf16_at", py_narrow_bf16_at, METH_VARARGS, "narrow_bf16 on the named path (tests)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_halfcast", "Half <-> float32 conversion kernels.", -1, methods,
};

/* sha256 prefix of this file, given by setup.py: halfcast.py uses the module only when it
   matches the source next to it (a failed rebuild of an optional extension keeps the old .so) */
#ifndef HALFCAST_SOURCE
#define HALFCAST_SOURCE "unknown"
#endif

PyMODINIT_FUNC PyInit__halfcast(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE", HALFCAST_SOURCE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
