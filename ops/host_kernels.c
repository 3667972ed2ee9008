/* Host kernels of a step (ops/host_kernels.py loads them with ctypes): admission's and
 * staging's passes over a batch's small index arrays, and the CPU device's greedy pick.
 *
 * Admission and staging read a batch's few index arrays a dozen ways each step (ranges,
 * duplicates, the rows' resident lengths, the slot-owner map, the staging copy); in numpy or
 * torch every one of those is a call of a microsecond or more. Each function here does one
 * stage's whole pass in one call. The checks only say "every rule holds" (0) or "look closer"
 * (1): the caller then runs its Python rules, which name the field and the rule, so the
 * rules' messages live in one place and a batch these kernels pass is one Python passes too.
 *
 * Index arrays are int32 or int64 (`es`: their element size in bytes); lengths, tables and
 * counts are int64. Portable C11; on x86-64 the argmax uses SSE2, which every such CPU has.
 */
#include <math.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define HK_ABI_VERSION 2

int hk_version(void) { return HK_ABI_VERSION; }

static inline int64_t at(const void *p, int es, int64_t i) {
    return es == 4 ? (int64_t)((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* 1 if some value appears twice (0 otherwise; -1: no memory for the sort). */
static int has_duplicate(const void *p, int es, int64_t n) {
    if (n < 2) return 0;
    if (n <= 64) { /* quadratic, no copy: a decode batch's rows and slots */
        for (int64_t i = 1; i < n; i++) {
            int64_t v = at(p, es, i);
            for (int64_t j = 0; j < i; j++)
                if (at(p, es, j) == v) return 1;
        }
        return 0;
    }
    int64_t *copy = malloc((size_t)n * sizeof(int64_t));
    if (copy == NULL) return -1;
    for (int64_t i = 0; i < n; i++) copy[i] = at(p, es, i);
    qsort(copy, (size_t)n, sizeof(int64_t), cmp_i64);
    int dup = 0;
    for (int64_t i = 1; i < n && !dup; i++) dup = copy[i] == copy[i - 1];
    free(copy);
    return dup;
}

static int in_range(const void *p, int es, int64_t n, int64_t lo, int64_t hi) {
    for (int64_t i = 0; i < n; i++) {
        int64_t v = at(p, es, i);
        if (v < lo || v > hi) return 0;
    }
    return 1;
}

/* The value rules of a DECODE batch of `bs` requests (executor/validation.py, for a batch
 * without positions, releases or future-slot fields): input ids in [id_lo, id_hi], a negative
 * id -k only where assigned[k] (NULL: none is); rows in [1, max_reqs] and unique; slots in
 * [1, kv_slots] and unique; seq_lens in [1, max_ctx]; each row holds seq_lens - 1 tokens
 * (resident[row]). stats: [max seq_len, sum of seq_lens, negative ids]. 0: every rule holds. */
int hk_check_decode(int64_t bs, const void *ids, int ids_es, int64_t id_lo, int64_t id_hi,
                    const uint8_t *assigned, const void *rows, int rows_es, int64_t max_reqs,
                    const void *slots, int slots_es, int64_t kv_slots, const void *seq,
                    int seq_es, int64_t max_ctx, const int64_t *resident, int64_t *stats) {
    int64_t negatives = 0, max_len = 0, sum = 0;
    for (int64_t i = 0; i < bs; i++) {
        int64_t id = at(ids, ids_es, i);
        if (id < id_lo || id > id_hi) return 1;
        if (id < 0) {
            if (assigned == NULL || !assigned[-id]) return 1;
            negatives++;
        }
    }
    if (!in_range(rows, rows_es, bs, 1, max_reqs) || !in_range(slots, slots_es, bs, 1, kv_slots))
        return 1;
    if (has_duplicate(rows, rows_es, bs) != 0 || has_duplicate(slots, slots_es, bs) != 0) return 1;
    for (int64_t i = 0; i < bs; i++) {
        int64_t len = at(seq, seq_es, i);
        if (len < 1 || len > max_ctx) return 1;
        if (len - 1 > resident[at(rows, rows_es, i)]) return 1;
        if (len > max_len) max_len = len;
        sum += len;
    }
    stats[0] = max_len;
    stats[1] = sum;
    stats[2] = negatives;
    return 0;
}

/* The sampling parameters' rules (temperature finite and >= 0, top_p in (0, 1], top_k >= 0,
 * min_p in [0, 1]) and, when they hold, the sampling plan (ops/sampling.py SamplingPlan):
 * plan = [any truncating, any top_k, all top_k, max top_k, any top_p, any min_p, any seeded,
 * any sampled, any processed]. A row samples when its temperature is >= greedy_below; it
 * truncates when it samples or its logprobs are processed (the truncation figures are over
 * those rows; seeds count on sampled rows). 0: the rules hold. */
int hk_sampling(int64_t n, const float *temps, const float *top_ps, const int64_t *top_ks,
                const float *min_ps, const uint8_t *has_seed, const uint8_t *processed,
                float greedy_below, int64_t *plan) {
    int64_t truncating = 0, any_k = 0, all_k = 1, max_k = 0, any_p = 0, any_min_p = 0;
    int64_t seeded = 0, sampled = 0, any_processed = 0;
    for (int64_t i = 0; i < n; i++) {
        float t = temps[i], p = top_ps[i], m = min_ps[i];
        if (!isfinite(t) || !(t >= 0.0f)) return 1;
        if (!(p > 0.0f && p <= 1.0f)) return 1;
        if (top_ks[i] < 0) return 1;
        if (!(m >= 0.0f && m <= 1.0f)) return 1;
        int samples = t >= greedy_below, proc = processed[i] != 0;
        any_processed |= proc;
        if (samples) {
            sampled = 1;
            if (has_seed[i]) seeded = 1;
        }
        if (!samples && !proc) continue;
        if (truncating == 0 || top_ks[i] > max_k) max_k = top_ks[i];
        truncating++;
        if (top_ks[i] > 0) any_k = 1; else all_k = 0;
        if (p < 1.0f) any_p = 1;
        if (m > 0.0f) any_min_p = 1;
    }
    plan[0] = truncating > 0;
    plan[1] = any_k;
    plan[2] = truncating > 0 && all_k;
    plan[3] = truncating > 0 ? max_k : 0;
    plan[4] = any_p;
    plan[5] = any_min_p;
    plan[6] = seeded;
    plan[7] = sampled;
    plan[8] = any_processed;
    return 0;
}

/* A DECODE batch's derived host fields (executor/batch_prep.py complete_batch): positions[i] =
 * seq[i] - 1 (int64); stats = [max seq_len, sum of seq_lens, negative input ids]. n >= 1. */
void hk_decode_fields(int64_t n, const void *ids, int ids_es, const void *seq, int seq_es,
                      int64_t *positions, int64_t *stats) {
    int64_t max_len = at(seq, seq_es, 0), sum = 0, negatives = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t len = at(seq, seq_es, i);
        positions[i] = len - 1;
        if (len > max_len) max_len = len;
        sum += len;
        negatives += at(ids, ids_es, i) < 0;
    }
    stats[0] = max_len;
    stats[1] = sum;
    stats[2] = negatives;
}

/* A DECODE batch's row-table cells, without releases: cell i is (rows[i], seq[i] - 1) =
 * slots[i]. Fills cols[i] = seq[i] - 1, the cell's flat index (rows[i] * stride + cols[i])
 * and old_lens[i] = resident[rows[i]] (the row's length
 * before the step), and checks the slot-owner map (refs NULL: there is none): 0 when no cell
 * overwrites one its row holds, no row is rewound and no new slot is held by a live row; 1
 * when the caller must run the full check; 2 (nothing filled) when an index is out of the
 * tables' bounds. */
int hk_decode_cells(int64_t n, const int64_t *rows, const int64_t *seq, const int64_t *slots,
                    const int64_t *resident, int64_t n_resident, const int64_t *refs,
                    int64_t n_refs, int64_t stride, int64_t *cols, int64_t *index,
                    int64_t *old_lens) {
    int pass = 1;
    for (int64_t i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= n_resident) return 2;
        int64_t held = resident[rows[i]];
        cols[i] = seq[i] - 1;
        index[i] = rows[i] * stride + cols[i];
        old_lens[i] = held;
        if (refs == NULL) continue;
        if (slots[i] < 0 || slots[i] >= n_refs) return 2;
        if (cols[i] < held || held > seq[i] || (slots[i] != 0 && refs[slots[i]] > 0)) pass = 0;
    }
    return !pass;
}

/* The owner map takes a step's cells: old[i] = table[rows[i] * stride + cols[i]], then the cell
 * holds slots[i] and refs[slots[i]] counts one more. */
void hk_owners_apply(int64_t n, const int64_t *rows, const int64_t *cols, const int64_t *slots,
                     int64_t *table, int64_t stride, int64_t *refs, int64_t *old) {
    for (int64_t i = 0; i < n; i++) {
        int64_t cell = rows[i] * stride + cols[i];
        old[i] = table[cell];
        table[cell] = slots[i];
        refs[slots[i]]++;
    }
}

/* The largest value of a row (a NaN in it: *nan set, the value then meaningless). */
static float row_max(const float *row, int64_t cols, int *nan) {
    float best = row[0];
    int64_t j = 0;
    *nan = 0;
#if defined(__SSE2__)
    if (cols >= 8) { /* maxps(a, m) is a > m ? a : m, the loop below, four lanes at a time */
        __m128 m0 = _mm_loadu_ps(row), m1 = _mm_loadu_ps(row + 4);
        __m128 n = _mm_setzero_ps();
        for (; j + 8 <= cols; j += 8) {
            __m128 a = _mm_loadu_ps(row + j), b = _mm_loadu_ps(row + j + 4);
            m0 = _mm_max_ps(a, m0);
            m1 = _mm_max_ps(b, m1);
            n = _mm_or_ps(n, _mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)));
        }
        float lanes[8];
        _mm_storeu_ps(lanes, m0);
        _mm_storeu_ps(lanes + 4, m1);
        for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
        *nan = _mm_movemask_ps(n) != 0;
    }
#endif
    for (; j < cols; j++) {
        float v = row[j];
        best = v > best ? v : best;
        *nan |= v != v;
    }
    return best;
}

/* The first j with row[j] == value (or, `nan`: the first NaN); the value is in the row. */
static int64_t row_find(const float *row, int64_t cols, float value, int nan) {
    int64_t j = 0;
#if defined(__SSE2__)
    __m128 want = _mm_set1_ps(value);
    for (; j + 4 <= cols; j += 4) {
        __m128 a = _mm_loadu_ps(row + j);
        int hits = _mm_movemask_ps(nan ? _mm_cmpunord_ps(a, a) : _mm_cmpeq_ps(a, want));
        if (hits) return j + __builtin_ctz((unsigned)hits);
    }
#endif
    for (; j < cols; j++)
        if (nan ? row[j] != row[j] : row[j] == value) return j;
    return 0;
}

/* Row-wise argmax of a [rows, cols] float32 matrix whose rows start `stride` elements apart:
 * the index of the first maximal value, a NaN counting as the maximum (torch.argmax's rule).
 * torch's CPU argmax over a vocabulary-wide row is tens of times slower than these two
 * passes (the maximum, then where it first is). */
void hk_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        int nan;
        float best = row_max(row, cols, &nan);
        out[r] = row_find(row, cols, best, nan);
    }
}

/* Pack n fields into `base`: field k copies desc[4k + 3] elements from src[k] (element size
 * desc[4k]) to base + desc[4k + 1] (element size desc[4k + 2]). Equal sizes are copied as bytes
 * (the caller asks so only for equal dtypes); 8 -> 4 and 4 -> 8 convert int64 <-> int32. */
void hk_pack(int64_t n, const int64_t *src, const int64_t *desc, uint8_t *base) {
    for (int64_t k = 0; k < n; k++) {
        const int64_t *d = desc + 4 * k;
        const void *from = (const void *)(intptr_t)src[k];
        int64_t ses = d[0], des = d[2], count = d[3];
        uint8_t *dst = base + d[1];
        if (ses == des) {
            memcpy(dst, from, (size_t)(count * ses));
        } else if (ses == 8) { /* int64 -> int32 */
            const int64_t *s = from;
            int32_t *o = (int32_t *)dst;
            for (int64_t i = 0; i < count; i++) o[i] = (int32_t)s[i];
        } else { /* int32 -> int64 */
            const int32_t *s = from;
            int64_t *o = (int64_t *)dst;
            for (int64_t i = 0; i < count; i++) o[i] = s[i];
        }
    }
}
