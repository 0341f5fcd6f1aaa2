// The kvc low-bit quantizers' sub-block search on the CPU: the candidate steps in the lanes
// (AVX2, AVX-512), each writing the reference's bytes (kvc_quantize_sub_ref). Apart from the
// rest of the CPU kernels so that test-kvc-quants-isa builds it at each x86 level.

#include "kvc-quantize-cpu.h"

#include <math.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVC_AVX2 1
#endif

#if defined(KVC_AVX2)
// the index of the level nearest to each lane of t: the thresholds below it, counted (by
// buckets as AVX-512 does, kvc4's search measured 4% faster on Zen 4, with twice the code)
static inline __m256i kvc_nearest8(__m256 t, const kvc_codebook * cb) {
    __m256i c = _mm256_setzero_si256();
    for (int j = 0; j + 1 < cb->n; ++j) {
        c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(t, _mm256_set1_ps(cb->mid[j]), _CMP_GT_OQ)));
    }
    return c;
}

// The step search with the candidate steps in the lanes: each lane finds its levels and adds
// its squared errors in value order with the reference's roundings, so the bytes are the
// reference's (test-kvc-quants and test-kvc-quants-isa compare them).
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
            const __m256  vi = _mm256_set1_ps(v[i]);
            const __m256i c  = kvc_nearest8(_mm256_mul_ps(vi, vid), cb);
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

// A sub-block of 16 values in two vectors: the finite mask, the maximum, the search
// (kvc_sub_errors_avx2) and the chosen step's codes 8 at a time, where the scalar reference's
// codes took as long as the search.
KVC_NO_FP_CONTRACT
static uint8_t kvc_quantize_sub_avx2(const kvc_codebook * cb, const float * x, int n, uint8_t * codes) {
    KVC_NO_FP_CONTRACT_BODY
    if (n != QK_KVC_SUB || cb->n > 16) {
        return kvc_quantize_sub_search(cb, x, n, codes, kvc_sub_errors_avx2);
    }
    // the values, those that are not finite (all exponent bits set) zeroed
    const __m256i exp = _mm256_set1_epi32(0x7f800000);
    const __m256  abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[2];
    float  vs[QK_KVC_SUB];
    __m256 vmax = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
        const __m256  xv  = _mm256_loadu_ps(x + 8 * h);
        const __m256i bad = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(xv), exp), exp);
        v[h] = _mm256_andnot_ps(_mm256_castsi256_ps(bad), xv);
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(v[h], abs));
        _mm256_storeu_ps(vs + 8 * h, v[h]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    if (amax == 0.0f) {
        memset(codes, cb->zero_code, n);
        return 0;
    }

    int   cand[KVC_SEARCH_UP + KVC_SEARCH_DOWN + 1];
    float d[KVC_SEARCH_UP + KVC_SEARCH_DOWN + 1], id[KVC_SEARCH_UP + KVC_SEARCH_DOWN + 1], err[KVC_SEARCH_UP + KVC_SEARCH_DOWN + 1];
    int   e_max;
    const int n_cand = kvc_step_candidates(amax, cb->levels[cb->n - 1], &e_max, cand);
    kvc_step_values(cand, n_cand, d, id);
    kvc_sub_errors_avx2(cb, vs, n, d, id, n_cand, err);
    const int best_e = kvc_best_step(err, cand, n_cand, e_max);

    const __m256 id_best = _mm256_set1_ps(1.0f / kvc_e8_to_fp32((uint8_t) best_e));
    for (int h = 0; h < 2; ++h) {
        int32_t c[8];
        _mm256_storeu_si256((__m256i *) c, kvc_nearest8(_mm256_mul_ps(v[h], id_best), cb));
        for (int i = 0; i < 8; ++i) {
            codes[8 * h + i] = (uint8_t) c[i];
        }
    }
    return (uint8_t) best_e;
}

#if defined(__AVX512F__)
// A sub-block of 16 values in one vector, with every candidate step in another: the step
// search as kvc_sub_errors_avx2 with each level found by its bucket, then the chosen step's
// codes the same way, the values side by side. kvc4 takes 6.8 ns a value this way, 16.3 with
// only the search in AVX-512 and the rest of the sub-block (the candidates' steps, the codes)
// scalar (from_float over 256 rows of 1024 Gaussian values; AMD EPYC Zen 4).
static_assert(KVC_SEARCH_UP + KVC_SEARCH_DOWN + 1 <= 16, "the candidate steps fit one vector");
static_assert(QK_KVC_SUB == 16, "a sub-block is one vector");

// The index of the level nearest to each lane of t (a bucketed codebook): the thresholds below
// the lane's bucket (below_lo, below_hi: its 32 counts) plus one if the lane passes the next
// threshold up, the bucket's own if it has one (mids_inf: the thresholds, +inf past the last).
// Nine operations where halving the thresholds takes 16 for 16 levels.
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
    if (n != QK_KVC_SUB || !cb->bucketed || cb->n > 16) {
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

    float lv[16], mv[16];
    for (int j = 0; j < 16; ++j) {
        lv[j] = j < cb->n ? cb->levels[j] : 0.0f;
        mv[j] = j + 1 < cb->n ? cb->mid[j] : INFINITY;
    }
    const __m512  levels   = _mm512_loadu_ps(lv);
    const __m512  mids_inf = _mm512_loadu_ps(mv);
    const __m512i below_lo = _mm512_loadu_si512((const void *) cb->below);
    const __m512i below_hi = _mm512_loadu_si512((const void *) (cb->below + 16));
    float vs[16];
    _mm512_storeu_ps(vs, v);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < QK_KVC_SUB; ++i) {
        const __m512  vi   = _mm512_set1_ps(vs[i]);
        const __m512  t    = _mm512_mul_ps(vi, vid);
        const __m512i c    = kvc_nearest16_bucketed(t, below_lo, below_hi, mids_inf);
        const __m512  diff = _mm512_sub_ps(vi, _mm512_mul_ps(vd, _mm512_permutexvar_ps(c, levels)));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(diff, diff));
    }
    float err[16];
    _mm512_storeu_ps(err, acc);

    const int best_e = kvc_best_step(err, cand, n_cand, e_max);
    const __m512  t = _mm512_mul_ps(v, _mm512_set1_ps(1.0f / kvc_e8_to_fp32((uint8_t) best_e)));
    const __m512i c = kvc_nearest16_bucketed(t, below_lo, below_hi, mids_inf);
    _mm_storeu_si128((__m128i *) codes, _mm512_cvtepi32_epi8(c));
    return (uint8_t) best_e;
}
#endif
#endif

kvc_quantize_sub_t kvc_cpu_quantize_sub(void) {
#if defined(KVC_AVX2) && defined(__AVX512F__)
    return kvc_quantize_sub_avx512;
#elif defined(KVC_AVX2)
    return kvc_quantize_sub_avx2;
#else
    return kvc_quantize_sub_ref;
#endif
}
