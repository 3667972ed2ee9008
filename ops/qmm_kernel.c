/* Group-quantized matrix multiply on the CPU: y[M, N] = x[M, K] @ W[N, K]^T.
 *
 * W is stored in groups of 32 inputs per row, each group with its own scale and min (IEEE
 * halves, as GGUF stores them):
 *   4-bit: w = q * scale + min, q in 0..15, 16 bytes a group (low nibbles are the group's
 *          inputs 0..15, high nibbles 16..31: GGUF's Q4_0/Q4_1 byte order);
 *   8-bit: w = q * scale + min, q in -128..127, 32 bytes a group (GGUF's Q8_0).
 * x is quantized to int8 per half group of 16 with its own scale (dx = max|x| / 127: halves
 * rather than whole groups keep an outlier from coarsening 31 neighbours), and each group's
 * exact float sum sx is kept, so a group's dot product is
 *   scale * (dx_lo * sum_lo(q * qx) + dx_hi * sum_hi(q * qx)) + min * sx
 * with sum(q * qx) an integer dot product (AVX2: vpmaddubsw + vpmaddwd; AVX-VNNI: vpdpbusd).
 *
 * Rows of W are split across OpenMP threads (the process's one OpenMP runtime: torch's); every
 * row's groups are read once per block of up to ROW_BLOCK activation rows, which stay in the
 * cache meanwhile. Built and loaded by ops/qmm.py; the scalar code is the reference of the
 * vector code and runs where AVX2 is missing.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QMM_AVX2 1
#endif

#define GROUP 32
#define HALF 16
#define ROW_BLOCK 64
#define PARALLEL_MIN_PRODUCTS (1 << 17)

/* ABI version: ops/qmm.py refuses a library whose version differs from its own. */
int qmm_version(void) { return 4; }

/* Which code paths this build holds: "avx2", "avx2+vnni" or "scalar". */
const char *qmm_isa(void) {
#if defined(QMM_AVX2) && defined(__AVXVNNI__)
    return "avx2+vnni";
#elif defined(QMM_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}

/* x [m, k] float -> qx [m, k] int8, dx [m, k / 16] and sx [m, k / 32] float. */
static void qmm_quantize(const float *x, int64_t m, int64_t k, int8_t *qx, float *dx, float *sx) {
    const int64_t halves = k / HALF;
#pragma omp parallel for schedule(static) if (m * k >= (1 << 16))
    for (int64_t r = 0; r < m; r++) {
        for (int64_t h = 0; h < halves; h++) {
            const float *v = x + r * k + h * HALF;
            int8_t *q = qx + r * k + h * HALF;
            float amax = 0.0f, sum = 0.0f;
            for (int i = 0; i < HALF; i++) {
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
                sum += v[i];
            }
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int i = 0; i < HALF; i++) q[i] = (int8_t)nearbyintf(v[i] * id);
            dx[r * halves + h] = amax / 127.0f;
            if (h % 2 == 0)
                sx[r * (halves / 2) + h / 2] = sum;
            else
                sx[r * (halves / 2) + h / 2] += sum;
        }
    }
}

#ifdef QMM_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight int32 sums of products of 32 unsigned bytes u with 32 signed bytes s. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

/* An IEEE half (the scales' and mins' storage: GGUF's own fp16) as a float. */
static inline float half_to_float(uint16_t h) {
#ifdef QMM_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (man << 13); /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13); /* normal */
    } else if (man == 0) {
        bits = sign; /* zero */
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* sum over groups of mn[g] * sx[g]: the weights' mins times the activations' exact sums. */
static inline float min_term(const uint16_t *mn, const float *sx, int64_t groups) {
    float extra = 0.0f;
    int64_t g = 0;
#ifdef QMM_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + g))),
                              _mm256_loadu_ps(sx + g), acc);
    extra = hsum8(acc);
#endif
    for (; g < groups; g++) extra += half_to_float(mn[g]) * sx[g];
    return extra;
}

/* One weight row (4- or 8-bit) against NR quantized activation rows (NR <= 4, a constant
 * where it is inlined): the weight group is unpacked once for all of them. */
static inline void rows_dot(int bits, const uint8_t *qw, const uint16_t *scale, const uint16_t *mn,
                            const int8_t *qx, const float *dx, const float *sx, int64_t k,
                            int64_t groups, int nr, float *out, int64_t out_stride) {
#ifdef QMM_AVX2
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        __m256i u, sgn;
        if (bits == 4) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(qw + g * 16));
            u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low),
                                 _mm_and_si128(raw, low));
            sgn = _mm256_setzero_si256();
        } else {
            sgn = _mm256_loadu_si256((const __m256i *)(qw + g * GROUP));
            u = _mm256_sign_epi8(sgn, sgn); /* |w|; x takes w's sign below */
        }
        const __m256 sg = _mm256_set1_ps(half_to_float(scale[g]));
        for (int r = 0; r < nr; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + r * k + g * GROUP));
            if (bits == 8) xv = _mm256_sign_epi8(xv, sgn);
            const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(u, xv));
            /* lanes 0-3 hold inputs 0..15 of the group, lanes 4-7 inputs 16..31 */
            const float *d = dx + r * 2 * groups + 2 * g;
            const __m256 ds = _mm256_set_m128(_mm_set1_ps(d[1]), _mm_set1_ps(d[0]));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(sg, ds), p, acc[r]);
        }
    }
    for (int r = 0; r < nr; r++)
        out[r * out_stride] = hsum8(acc[r]) + min_term(mn, sx + r * groups, groups);
#else
    for (int r = 0; r < nr; r++) {
        const int8_t *xr = qx + r * k;
        float total = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            int32_t lo = 0, hi = 0; /* inputs 0..15 and 16..31 of the group */
            if (bits == 4) {
                for (int i = 0; i < 16; i++) {
                    lo += (qw[g * 16 + i] & 0x0F) * xr[g * GROUP + i];
                    hi += (qw[g * 16 + i] >> 4) * xr[g * GROUP + 16 + i];
                }
            } else {
                const int8_t *w = (const int8_t *)qw + g * GROUP;
                for (int i = 0; i < 16; i++) {
                    lo += w[i] * xr[g * GROUP + i];
                    hi += w[16 + i] * xr[g * GROUP + 16 + i];
                }
            }
            const float *d = dx + r * 2 * groups + 2 * g;
            total += half_to_float(scale[g]) * (d[0] * (float)lo + d[1] * (float)hi);
        }
        out[r * out_stride] = total + min_term(mn, sx + r * groups, groups);
    }
#endif
}

/* y [m, n] = x @ W^T with x given quantized (qmm_quantize); bits 4 or 8. */
static void qmm_matmul(const int8_t *qx, const float *dx, const float *sx, int64_t m,
                       int64_t k, const void *qw, const uint16_t *scale, const uint16_t *mn,
                       int64_t n, int bits, float *y) {
    const int64_t groups = k / GROUP;
    const int64_t row_bytes = bits == 4 ? k / 2 : k;
    /* A team only where the work pays for its start and its barrier (~1e5 products). */
    const int parallel = m * n * k >= PARALLEL_MIN_PRODUCTS;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
        const int64_t r1 = r0 + ROW_BLOCK < m ? r0 + ROW_BLOCK : m;
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *w = (const uint8_t *)qw + j * row_bytes;
            const uint16_t *s = scale + j * groups;
            const uint16_t *mj = mn + j * groups;
            int64_t r = r0;
            for (; r + 4 <= r1; r += 4)
                rows_dot(bits, w, s, mj, qx + r * k, dx + r * 2 * groups, sx + r * groups, k,
                         groups, 4, y + r * n + j, n);
            for (; r < r1; r++)
                rows_dot(bits, w, s, mj, qx + r * k, dx + r * 2 * groups, sx + r * groups, k,
                         groups, 1, y + r * n + j, n);
        }
    }
}

/* y [m, n] = x [m, k] @ W^T in one call: the activations quantized into scratch that lives for
 * the call only. Returns 0, or -1 when the scratch cannot be allocated (y is then untouched). */
int qmm_forward(const float *x, int64_t m, int64_t k, const void *qw, const float *scale,
                const float *mn, int64_t n, int bits, float *y) {
    const int64_t halves = k / HALF;
    int8_t *qx = malloc((size_t)(m * k));
    float *dx = malloc(sizeof(float) * (size_t)(m * halves));
    float *sx = malloc(sizeof(float) * (size_t)(m * (halves / 2)));
    int rc = -1;
    if (qx && dx && sx) {
        qmm_quantize(x, m, k, qx, dx, sx);
        qmm_matmul(qx, dx, sx, m, k, qw, scale, mn, n, bits, y);
        rc = 0;
    }
    free(qx);
    free(dx);
    free(sx);
    return rc;
}
