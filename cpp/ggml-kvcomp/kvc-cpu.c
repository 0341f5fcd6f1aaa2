// CPU kernels of the kvc types. The scalar versions are the reference; the AVX2 versions
// must match them to float rounding (cpp/tests/test-kvc-quants.cpp checks it).

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "kvc-cpu.h"
#include "ggml-cpu.h"
#include "kvc-simd.h"
#include "quants.h"
#include "vec.h"

#include <assert.h>
#include <math.h>
#include <string.h>

void quantize_row_kvc8(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_kvc8_ref(x, (block_kvc8 *) y, k);
}

#if defined(KVC_AVX2)
// The step search with the candidate steps in the lanes: each lane finds its levels and adds
// its squared errors in value order with the reference's roundings, so the bytes are the
// reference's (test-kvc-quants compares them).
KVC_NO_FP_CONTRACT
static void kvc_sub_errors_avx2(const kvc_codebook * cb, const float * v, int n, const float * d, const float * id,
                                int n_cand, float * err) {
    KVC_NO_FP_CONTRACT_BODY
    float lv[32] = { 0 };
    for (int j = 0; j < cb->n; ++j) {
        lv[j] = cb->levels[j];
    }
    const __m256 lo = _mm256_loadu_ps(lv);
    const __m256 hi = _mm256_loadu_ps(lv + 8);
    for (int c0 = 0; c0 < n_cand; c0 += 8) {
        const int m = n_cand - c0 < 8 ? n_cand - c0 : 8;
        float dd[8] = { 0 }, ii[8] = { 0 }, e[8];
        memcpy(dd, d + c0, m * sizeof(float));
        memcpy(ii, id + c0, m * sizeof(float));
        const __m256 vd  = _mm256_loadu_ps(dd);
        const __m256 vid = _mm256_loadu_ps(ii);
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < n; ++i) {
            const __m256 vi = _mm256_set1_ps(v[i]);
            const __m256 t  = _mm256_mul_ps(vi, vid);
            __m256i c = _mm256_setzero_si256();
            for (int j = 0; j + 1 < cb->n; ++j) {
                c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(t, _mm256_set1_ps(cb->mid[j]), _CMP_GT_OQ)));
            }
            __m256 level;
            if (cb->n > 16) {
                level = _mm256_i32gather_ps(lv, c, 4);
            } else if (cb->n > 8) {
                const __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(7)));
                level = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, c), _mm256_permutevar8x32_ps(hi, c), upper);
            } else {
                level = _mm256_permutevar8x32_ps(lo, c);
            }
            const __m256 diff = _mm256_sub_ps(vi, _mm256_mul_ps(vd, level));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(diff, diff));
        }
        _mm256_storeu_ps(e, acc);
        memcpy(err + c0, e, m * sizeof(float));
    }
}
// the sub-block quantizer with the AVX2 step search
static uint8_t kvc_quantize_sub_avx2(const kvc_codebook * cb, const float * x, int n, uint8_t * codes) {
    return kvc_quantize_sub_search(cb, x, n, codes, kvc_sub_errors_avx2);
}

#if defined(__AVX512F__)
// A sub-block of 16 values in one vector, with every candidate step in another: the step
// search as kvc_sub_errors_avx2 with each level found by halving the thresholds (sorted, so
// the same index as counting them), then the chosen step's codes the same way, the values
// side by side. The search was a sixth of a prompt's time over a kvc4 cache, and the scalar
// rest of the sub-block (the candidates' steps, the codes) as much again, the whole being
// most of what a kvc cache's decode step adds to f16's on a small model (docs/results.md).
static_assert(KVC_SEARCH_UP + KVC_SEARCH_DOWN + 1 <= 16, "the candidate steps fit one vector");
static_assert(QK_KVC_SUB == 16, "a sub-block is one vector");

// the index of the level nearest to each lane of t: the thresholds below it, counted by halving
static inline __m512i kvc_nearest16(__m512 t, __m512 mids, int n_bits) {
    __m512i c = _mm512_setzero_si512();
    for (int k = n_bits - 1; k >= 0; --k) {
        // the threshold just below the upper half of what is left
        const __m512i   at = _mm512_add_epi32(c, _mm512_set1_epi32((1 << k) - 1));
        const __mmask16 gt = _mm512_cmp_ps_mask(t, _mm512_permutexvar_ps(at, mids), _CMP_GT_OQ);
        c = _mm512_mask_add_epi32(c, gt, c, _mm512_set1_epi32(1 << k));
    }
    return c;
}

// The same index by the lane's bucket (cb->bucketed): the thresholds below the bucket
// (below_lo, below_hi: its 32 counts) plus one if the lane passes the next threshold up, the
// bucket's own if it has one (mids_inf: the thresholds, +inf past the last). Nine operations
// where the halving takes 16 for 16 levels.
static inline __m512i kvc_nearest16_bucketed(__m512 t, __m512i below_lo, __m512i below_hi, __m512 mids_inf) {
    // t / KVC_BUCKET_W exactly (a power of two), held to the outer buckets before its floor
    const __m512    tb = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.0f / KVC_BUCKET_W)),
                                                      _mm512_set1_ps(-KVC_BUCKETS / 2)),
                                       _mm512_set1_ps(KVC_BUCKETS / 2 - 0.5f));
    const __m512i   b  = _mm512_add_epi32(_mm512_cvt_roundps_epi32(tb, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                          _mm512_set1_epi32(KVC_BUCKETS / 2));
    const __m512i   j  = _mm512_permutex2var_epi32(below_lo, b, below_hi);
    const __mmask16 gt = _mm512_cmp_ps_mask(t, _mm512_permutexvar_ps(j, mids_inf), _CMP_GT_OQ);
    return _mm512_mask_add_epi32(j, gt, j, _mm512_set1_epi32(1));
}
static_assert(KVC_BUCKETS == 32, "the bucket counts fill two vectors");

KVC_NO_FP_CONTRACT
static uint8_t kvc_quantize_sub_avx512(const kvc_codebook * cb, const float * x, int n, uint8_t * codes) {
    KVC_NO_FP_CONTRACT_BODY
    int n_bits = 0;
    while ((1 << n_bits) < cb->n) {
        ++n_bits;
    }
    if (n != QK_KVC_SUB || (1 << n_bits) != cb->n || cb->n > 16) {
        return kvc_quantize_sub_avx2(cb, x, n, codes);
    }
    // the values, those that are not finite (all exponent bits set) zeroed
    const __m512    xv  = _mm512_loadu_ps(x);
    const __m512i   exp = _mm512_set1_epi32(0x7f800000);
    const __mmask16 ok  = _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(xv), exp), exp);
    const __m512    v   = _mm512_maskz_mov_ps(ok, xv);
    const float     amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
    if (amax == 0.0f) {
        memset(codes, cb->zero_code, n);
        return 0;
    }

    int cand[16] = { 0 };
    int e_max;
    const int n_cand = kvc_step_candidates(amax, cb->levels[cb->n - 1], &e_max, cand);
    // each candidate's step as kvc_e8_to_fp32 makes it, and its inverse (both correctly rounded)
    static const float frac[8] = KVC_E8_FRAC;
    const __mmask16 m  = (__mmask16) ((1u << n_cand) - 1);
    const __m512i   ce = _mm512_maskz_loadu_epi32(m, cand);
    const __m512    p2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_srli_epi32(ce, 3), _mm512_set1_epi32(107)), 23));
    const __m512    fr = _mm512_permutexvar_ps(_mm512_and_si512(ce, _mm512_set1_epi32(7)), _mm512_castps256_ps512(_mm256_loadu_ps(frac)));
    const __m512    vd  = _mm512_maskz_mul_ps(m, fr, p2);
    const __m512    vid = _mm512_maskz_div_ps(m, _mm512_set1_ps(1.0f), vd);

    float lv[16] = { 0 }, mv[16] = { 0 };
    for (int j = 0; j < cb->n; ++j) {
        lv[j] = cb->levels[j];
    }
    for (int j = 0; j + 1 < cb->n; ++j) {
        mv[j] = cb->mid[j];
    }
    const __m512 levels = _mm512_loadu_ps(lv);
    const __m512 mids   = _mm512_loadu_ps(mv);
    const __m512 mids_inf = _mm512_mask_mov_ps(mids, (__mmask16) (0xffffu << (cb->n - 1)), _mm512_set1_ps(INFINITY));
    const __m512i below_lo = _mm512_loadu_si512((const void *) cb->below);
    const __m512i below_hi = _mm512_loadu_si512((const void *) (cb->below + 16));
    float vs[16];
    _mm512_storeu_ps(vs, v);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < QK_KVC_SUB; ++i) {
        const __m512  vi   = _mm512_set1_ps(vs[i]);
        const __m512  t    = _mm512_mul_ps(vi, vid);
        const __m512i c    = cb->bucketed ? kvc_nearest16_bucketed(t, below_lo, below_hi, mids_inf) : kvc_nearest16(t, mids, n_bits);
        const __m512  diff = _mm512_sub_ps(vi, _mm512_mul_ps(vd, _mm512_permutexvar_ps(c, levels)));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(diff, diff));
    }
    float err[16];
    _mm512_storeu_ps(err, acc);

    const int best_e = kvc_best_step(err, cand, n_cand, e_max);
    const __m512  t = _mm512_mul_ps(v, _mm512_set1_ps(1.0f / kvc_e8_to_fp32((uint8_t) best_e)));
    const __m512i c = cb->bucketed ? kvc_nearest16_bucketed(t, below_lo, below_hi, mids_inf) : kvc_nearest16(t, mids, n_bits);
    _mm_storeu_si128((__m128i *) codes, _mm512_cvtepi32_epi8(c));
    return (uint8_t) best_e;
}
#define KVC_QUANTIZE_SUB kvc_quantize_sub_avx512
#else
#define KVC_QUANTIZE_SUB kvc_quantize_sub_avx2
#endif
#else
#define KVC_QUANTIZE_SUB kvc_quantize_sub_ref
#endif

void quantize_row_kvc5(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC5, x, y, k, KVC_QUANTIZE_SUB);
}

void quantize_row_kvc4(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC4, x, y, k, KVC_QUANTIZE_SUB);
}

void quantize_row_kvc3(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC3, x, y, k, KVC_QUANTIZE_SUB);
}

void quantize_row_kvc2(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC2, x, y, k, KVC_QUANTIZE_SUB);
}

ggml_from_float_t ggml_kvc_cpu_get_from_float(enum ggml_type type) {
    return ggml_get_type_traits_cpu(type)->from_float;
}

void * ggml_kvc_cpu_get_proc_address(const char * name) {
    // unions: ISO C has no cast from a function pointer to void *
    union {
        ggml_kvc_cpu_get_from_float_t fn;
        void * p;
    } get = { ggml_kvc_cpu_get_from_float };
    union {
        void (*fn)(const ggml_fp16_t *, float *, int64_t);
        void * p;
    } fp16 = { ggml_cpu_fp16_to_fp32 };
    union {
        ggml_kvc_cpu_get_to_float_t fn;
        void * p;
    } get_to = { ggml_kvc_cpu_get_to_float };
    union {
        ggml_custom_op_t fn;
        void * p;
    } offset_rows = { ggml_kvc_cpu_offset_rows };
    if (strcmp(name, "ggml_kvc_cpu_offset_rows") == 0) {
        return offset_rows.p;
    }
    if (strcmp(name, "ggml_kvc_cpu_get_from_float") == 0) {
        return get.p;
    }
    if (strcmp(name, "ggml_kvc_cpu_get_to_float") == 0) {
        return get_to.p;
    }
    if (strcmp(name, "ggml_cpu_fp16_to_fp32") == 0) {
        return fp16.p;
    }
    return NULL;
}

// Shared head of every vec_dot: one row pair, blocks aligned with q8_0's.
#define KVC_VEC_DOT_PROLOGUE(name)                                              \
    assert(n % QK_KVC == 0);                                                    \
    assert(nrc == 1);                                                           \
    GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by); GGML_UNUSED(nrc);        \
    const block_##name * GGML_RESTRICT x = (const block_##name *) vx;           \
    const block_q8_0   * GGML_RESTRICT y = (const block_q8_0 *) vy

// Scalar reference. The low-bit types decode each block into int8 level values first, so
// all of them share one integer dot product with two sub-block steps.

static inline void kvc_decode_kvc5(const block_kvc5 * b, int8_t v[QK_KVC]) {
    for (int i = 0; i < QK_KVC; ++i) {
        const int c = ((b->qs[i % 16] >> (4 * (i / 16))) & 0xf) | ((b->qh[i / 8] >> (i % 8)) & 1) << 4;
        v[i] = kvalues_kvc5[c];
    }
}

static inline void kvc_decode_kvc4(const block_kvc4 * b, int8_t v[QK_KVC]) {
    for (int j = 0; j < QK_KVC / 2; ++j) {
        v[j]              = kvalues_kvc4[b->qs[j] & 0xf];
        v[j + QK_KVC / 2] = kvalues_kvc4[b->qs[j] >> 4];
    }
}

static inline void kvc_decode_kvc3(const block_kvc3 * b, int8_t v[QK_KVC]) {
    for (int i = 0; i < QK_KVC; ++i) {
        const int c = ((b->ql[i % 8] >> (2 * (i / 8))) & 3) | ((b->qh[i / 8] >> (i % 8)) & 1) << 2;
        v[i] = kvalues_kvc3[c];
    }
}

static inline void kvc_decode_kvc2(const block_kvc2 * b, int8_t v[QK_KVC]) {
    for (int i = 0; i < QK_KVC; ++i) {
        v[i] = kvalues_kvc2[(b->qs[i % 8] >> (2 * (i / 8))) & 3];
    }
}

static inline float kvc_dot_sub(const int8_t v[QK_KVC], const block_q8_0 * y, float d0, float d1) {
    int s0 = 0;
    int s1 = 0;
    for (int i = 0; i < QK_KVC_SUB; ++i) {
        s0 += v[i] * y->qs[i];
        s1 += v[i + QK_KVC_SUB] * y->qs[i + QK_KVC_SUB];
    }
    return GGML_CPU_FP16_TO_FP32(y->d) * (d0 * (float) s0 + d1 * (float) s1);
}

#define KVC_VEC_DOT_GENERIC(name)                                                                     \
void ggml_vec_dot_##name##_q8_0_generic(int n, float * GGML_RESTRICT s, size_t bs,                   \
        const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) { \
    KVC_VEC_DOT_PROLOGUE(name);                                                                       \
    float sumf = 0.0f;                                                                                \
    for (int ib = 0; ib < n / QK_KVC; ++ib) {                                                         \
        int8_t v[QK_KVC];                                                                             \
        kvc_decode_##name(&x[ib], v);                                                                 \
        sumf += kvc_dot_sub(v, &y[ib], kvc_e8_to_fp32(x[ib].e[0]), kvc_e8_to_fp32(x[ib].e[1]));       \
    }                                                                                                 \
    *s = sumf;                                                                                        \
}

KVC_VEC_DOT_GENERIC(kvc5)
KVC_VEC_DOT_GENERIC(kvc4)
KVC_VEC_DOT_GENERIC(kvc3)
KVC_VEC_DOT_GENERIC(kvc2)

void ggml_vec_dot_kvc8_q8_0_generic(int n, float * GGML_RESTRICT s, size_t bs,
        const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {
    KVC_VEC_DOT_PROLOGUE(kvc8);
    float sumf = 0.0f;
    for (int ib = 0; ib < n / QK_KVC; ++ib) {
        int sumi = 0;
        for (int i = 0; i < QK_KVC; ++i) {
            sumi += x[ib].qs[i] * y[ib].qs[i];
        }
        sumf += GGML_CPU_FP16_TO_FP32(x[ib].d) * GGML_CPU_FP16_TO_FP32(y[ib].d) * (float) sumi;
    }
    *s = sumf;
}

// The multi-row dot products' reference: one vec_dot per query row.
#define KVC_VEC_DOT_MULTI_LOOP(fn)                                                                    \
static void fn##_multi(int n, float * GGML_RESTRICT s, const void * GGML_RESTRICT vx,                \
                       const void * GGML_RESTRICT vy, size_t by, int ny) {                            \
    for (int g = 0; g < ny; ++g) {                                                                    \
        fn(n, &s[g], 0, vx, 0, (const char *) vy + g * by, 0, 1);                                     \
    }                                                                                                 \
}

KVC_VEC_DOT_MULTI_LOOP(ggml_vec_dot_kvc8_q8_0_generic)
KVC_VEC_DOT_MULTI_LOOP(ggml_vec_dot_kvc5_q8_0_generic)
KVC_VEC_DOT_MULTI_LOOP(ggml_vec_dot_kvc4_q8_0_generic)
KVC_VEC_DOT_MULTI_LOOP(ggml_vec_dot_kvc3_q8_0_generic)
KVC_VEC_DOT_MULTI_LOOP(ggml_vec_dot_kvc2_q8_0_generic)

#if defined(KVC_AVX2)

// One kernel per type for one and for several query rows: the row is decoded a chunk of
// blocks at a time and the rows meet the chunk in turn, each with its own accumulator, so a
// row's sum is the same whatever the number of rows. The single-row vec_dot is this kernel at
// ny = 1. Queries are the outer loop over a chunk: with the accumulators of every query live
// across a block, GCC kept them in registers behind a flag per query and spilled them at the
// end of each call, and a decode step (one call per key) slowed by a fifth or not with where
// its stack fell (llama-bench against the same step in another program).
#define KVC_DOT_CHUNK 8

#define KVC_VEC_DOT_MULTI_AVX2(name, n_levels)                                                        \
static inline void kvc_vec_dot_multi_##name##_avx2(int n, float * GGML_RESTRICT s, const void * GGML_RESTRICT vx, \
                                                   const void * GGML_RESTRICT vy, size_t by, int ny) { \
    assert(n % QK_KVC == 0 && ny <= GGML_KVC_DOT_MULTI_MAX);                                          \
    const block_##name * GGML_RESTRICT x = (const block_##name *) vx;                                 \
    const kvc_lut lut = kvc_lut_avx2(kvalues_##name, n_levels);                                       \
    const int nb = n / QK_KVC;                                                                        \
    __m256 acc[GGML_KVC_DOT_MULTI_MAX];                                                               \
    for (int ib0 = 0; ib0 < nb; ib0 += KVC_DOT_CHUNK) {                                               \
        const int nc = nb - ib0 < KVC_DOT_CHUNK ? nb - ib0 : KVC_DOT_CHUNK;                           \
        __m256i v[KVC_DOT_CHUNK], av[KVC_DOT_CHUNK];                                                  \
        float   d0[KVC_DOT_CHUNK], d1[KVC_DOT_CHUNK];                                                 \
        for (int c = 0; c < nc; ++c) {                                                                \
            v[c]  = kvc_lookup_avx2(lut, name##_codes_avx2(&x[ib0 + c]), n_levels);                   \
            av[c] = _mm256_sign_epi8(v[c], v[c]);                                                     \
            d0[c] = kvc_e8_to_fp32(x[ib0 + c].e[0]);                                                  \
            d1[c] = kvc_e8_to_fp32(x[ib0 + c].e[1]);                                                  \
        }                                                                                             \
        for (int g = 0; g < ny; ++g) {                                                                \
            const block_q8_0 * y = (const block_q8_0 *) ((const char *) vy + g * by) + ib0;           \
            __m256 a = ib0 > 0 ? acc[g] : _mm256_setzero_ps();                                        \
            for (int c = 0; c < nc; ++c) {                                                            \
                const __m256i p = kvc_dot_i8_groups_abs(av[c], v[c], _mm256_loadu_si256((const __m256i *) y[c].qs)); \
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), kvc_sub_scales(d0[c], d1[c], GGML_CPU_FP16_TO_FP32(y[c].d)), a); \
            }                                                                                         \
            acc[g] = a;                                                                               \
        }                                                                                             \
    }                                                                                                 \
    for (int g = 0; g < ny; ++g) {                                                                    \
        s[g] = nb > 0 ? kvc_hsum_f32_8(acc[g]) : 0.0f;                                                \
    }                                                                                                 \
}

KVC_VEC_DOT_MULTI_AVX2(kvc5, 32)
KVC_VEC_DOT_MULTI_AVX2(kvc4, 16)
KVC_VEC_DOT_MULTI_AVX2(kvc3, 8)
KVC_VEC_DOT_MULTI_AVX2(kvc2, 4)

static inline void kvc_vec_dot_multi_kvc8_avx2(int n, float * GGML_RESTRICT s, const void * GGML_RESTRICT vx,
                                               const void * GGML_RESTRICT vy, size_t by, int ny) {
    assert(n % QK_KVC == 0 && ny <= GGML_KVC_DOT_MULTI_MAX);
    const block_kvc8 * GGML_RESTRICT x = (const block_kvc8 *) vx;
    const int nb = n / QK_KVC;
    __m256 acc[GGML_KVC_DOT_MULTI_MAX];
    for (int ib0 = 0; ib0 < nb; ib0 += KVC_DOT_CHUNK) {
        const int nc = nb - ib0 < KVC_DOT_CHUNK ? nb - ib0 : KVC_DOT_CHUNK;
        __m256i v[KVC_DOT_CHUNK], av[KVC_DOT_CHUNK];
        float   dx[KVC_DOT_CHUNK];
        for (int c = 0; c < nc; ++c) {
            v[c]  = _mm256_loadu_si256((const __m256i *) x[ib0 + c].qs);
            av[c] = _mm256_sign_epi8(v[c], v[c]);
            dx[c] = GGML_CPU_FP16_TO_FP32(x[ib0 + c].d);
        }
        for (int g = 0; g < ny; ++g) {
            const block_q8_0 * y = (const block_q8_0 *) ((const char *) vy + g * by) + ib0;
            __m256 a = ib0 > 0 ? acc[g] : _mm256_setzero_ps();
            for (int c = 0; c < nc; ++c) {
                const __m256i p = kvc_dot_i8_groups_abs(av[c], v[c], _mm256_loadu_si256((const __m256i *) y[c].qs));
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx[c] * GGML_CPU_FP16_TO_FP32(y[c].d)), a);
            }
            acc[g] = a;
        }
    }
    for (int g = 0; g < ny; ++g) {
        s[g] = nb > 0 ? kvc_hsum_f32_8(acc[g]) : 0.0f;
    }
}

#define KVC_VEC_DOT_AVX2(name)                                                                        \
void ggml_vec_dot_##name##_q8_0(int n, float * GGML_RESTRICT s, size_t bs,                           \
        const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) { \
    assert(nrc == 1);                                                                                 \
    GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by); GGML_UNUSED(nrc);                              \
    kvc_vec_dot_multi_##name##_avx2(n, s, vx, vy, 0, 1);                                              \
}

KVC_VEC_DOT_AVX2(kvc8)
KVC_VEC_DOT_AVX2(kvc5)
KVC_VEC_DOT_AVX2(kvc4)
KVC_VEC_DOT_AVX2(kvc3)
KVC_VEC_DOT_AVX2(kvc2)

// Row dequantization, the same products as the scalar reference (level times step in float),
// so the two agree bit for bit. Attention's V rows and the buffer's casts of the cache go
// through here.
static inline void kvc_store_levels_avx2(float * y, __m256i v, float d0, float d1) {
    const __m128i lo = _mm256_castsi256_si128(v);
    const __m128i hi = _mm256_extracti128_si256(v, 1);
#if defined(__AVX512F__)
    _mm512_storeu_ps(y,      _mm512_mul_ps(_mm512_set1_ps(d0), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo))));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_set1_ps(d1), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi))));
    return;
#endif
    const __m256  s0 = _mm256_set1_ps(d0);
    const __m256  s1 = _mm256_set1_ps(d1);
    _mm256_storeu_ps(y +  0, _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))));
    _mm256_storeu_ps(y +  8, _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
    _mm256_storeu_ps(y + 16, _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))));
    _mm256_storeu_ps(y + 24, _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
}

#define KVC_TO_FLOAT_AVX2(name, n_levels)                                                             \
static void kvc_to_float_##name##_avx2(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) { \
    assert(k % QK_KVC == 0);                                                                          \
    const block_##name * GGML_RESTRICT x = (const block_##name *) vx;                                 \
    const kvc_lut lut = kvc_lut_avx2(kvalues_##name, n_levels);                                       \
    for (int64_t ib = 0; ib < k / QK_KVC; ++ib) {                                                     \
        kvc_store_levels_avx2(y + ib * QK_KVC, kvc_lookup_avx2(lut, name##_codes_avx2(&x[ib]), n_levels), \
                              kvc_e8_to_fp32(x[ib].e[0]), kvc_e8_to_fp32(x[ib].e[1]));                \
    }                                                                                                 \
}

KVC_TO_FLOAT_AVX2(kvc5, 32)
KVC_TO_FLOAT_AVX2(kvc4, 16)
KVC_TO_FLOAT_AVX2(kvc3, 8)
KVC_TO_FLOAT_AVX2(kvc2, 4)

static void kvc_to_float_kvc8_avx2(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_KVC == 0);
    const block_kvc8 * GGML_RESTRICT x = (const block_kvc8 *) vx;
    for (int64_t ib = 0; ib < k / QK_KVC; ++ib) {
        const float d = GGML_CPU_FP16_TO_FP32(x[ib].d);
        kvc_store_levels_avx2(y + ib * QK_KVC, _mm256_loadu_si256((const __m256i *) x[ib].qs), d, d);
    }
}

#define KVC_VEC_DOT_MULTI(name) kvc_vec_dot_multi_##name##_avx2

ggml_to_float_t ggml_kvc_cpu_get_to_float(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_KVC8: return kvc_to_float_kvc8_avx2;
        case GGML_TYPE_KVC5: return kvc_to_float_kvc5_avx2;
        case GGML_TYPE_KVC4: return kvc_to_float_kvc4_avx2;
        case GGML_TYPE_KVC3: return kvc_to_float_kvc3_avx2;
        case GGML_TYPE_KVC2: return kvc_to_float_kvc2_avx2;
        default:             return ggml_get_type_traits(type)->to_float;
    }
}

#else

#define KVC_VEC_DOT_MULTI(name) ggml_vec_dot_##name##_q8_0_generic_multi

ggml_to_float_t ggml_kvc_cpu_get_to_float(enum ggml_type type) {
    return ggml_get_type_traits(type)->to_float;
}

#define KVC_VEC_DOT_FALLBACK(name)                                                                    \
void ggml_vec_dot_##name##_q8_0(int n, float * GGML_RESTRICT s, size_t bs,                           \
        const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) { \
    ggml_vec_dot_##name##_q8_0_generic(n, s, bs, vx, bx, vy, by, nrc);                                \
}

KVC_VEC_DOT_FALLBACK(kvc8)
KVC_VEC_DOT_FALLBACK(kvc5)
KVC_VEC_DOT_FALLBACK(kvc4)
KVC_VEC_DOT_FALLBACK(kvc3)
KVC_VEC_DOT_FALLBACK(kvc2)

#endif

ggml_kvc_vec_dot_multi_t ggml_kvc_cpu_get_vec_dot_multi(enum ggml_type type, bool ref) {
    switch (type) {
        case GGML_TYPE_KVC8: return ref ? ggml_vec_dot_kvc8_q8_0_generic_multi : KVC_VEC_DOT_MULTI(kvc8);
        case GGML_TYPE_KVC5: return ref ? ggml_vec_dot_kvc5_q8_0_generic_multi : KVC_VEC_DOT_MULTI(kvc5);
        case GGML_TYPE_KVC4: return ref ? ggml_vec_dot_kvc4_q8_0_generic_multi : KVC_VEC_DOT_MULTI(kvc4);
        case GGML_TYPE_KVC3: return ref ? ggml_vec_dot_kvc3_q8_0_generic_multi : KVC_VEC_DOT_MULTI(kvc3);
        case GGML_TYPE_KVC2: return ref ? ggml_vec_dot_kvc2_q8_0_generic_multi : KVC_VEC_DOT_MULTI(kvc2);
        default:             return NULL;
    }
}
