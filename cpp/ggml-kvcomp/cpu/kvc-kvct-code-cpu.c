// Coding kvct rows on the CPU (a kvct cache's writes, kvc-set-rows.c): quantize_row_kvct_ref's
// steps, with the row scale's search (most of a row's coding: 21 candidate codes, each a pass
// over the coefficients) done with AVX-512 or AVX2 for all candidates at once, one per lane.
// Each lane computes its candidate's error with the reference's operations in the reference's
// order (float products and differences rounded as such, the squares added in double
// coefficient by coefficient), so the errors, the chosen code and the row's bytes are the
// reference's.

#include "kvc-kvct-code-cpu.h"
#include "kvc-common.h"
#include "kvc-lloyd-max.h"

#if defined(__AVX512F__) && defined(__GNUC__)
#include <immintrin.h>
#define KVC_T_CODE_AVX512
#elif defined(__AVX2__) && defined(__GNUC__)
#include <immintrin.h>
#define KVC_T_CODE_AVX2
#endif

#if defined(KVC_T_CODE_AVX512) || defined(KVC_T_CODE_AVX2)
// x keeps the rounding of the operation that made it: the compiler may not fuse that operation
// into the next one (GCC contracts vector arithmetic into FMAs, which round once)
#define KVC_T_KEEP(x) __asm__("" : "+v"(x))

// the candidates' lanes: code e0 - KVC_T_SEARCH_DOWN + i in lane i
#define KVC_T_N_CAND (KVC_T_SEARCH_DOWN + KVC_T_SEARCH_UP + 1)
static_assert(KVC_T_N_CAND <= 24, "the row scale's candidates fit two vectors of 16 lanes or three of 8");

// the Lloyd-Max thresholds of each bit count in the order a binary search meets them
static const float kvc_t_mids_tree[] = KVC_LM_MIDS_TREE;

// The row scale's candidate codes, lane i code e0 - KVC_T_SEARCH_DOWN + i, and their inverses;
// lanes outside [1, KVC_E8_MAX] compute something finite and are not chosen.
static void kvc_t_candidates(uint8_t e0, float * sv, float * iv, int n) {
    for (int i = 0; i < n; ++i) {
        const int c = (int) e0 - KVC_T_SEARCH_DOWN + i;
        sv[i] = kvc_e8_to_fp32((uint8_t) (c < 1 ? 1 : c > KVC_E8_MAX ? KVC_E8_MAX : c));
        iv[i] = 1.0f / sv[i];
    }
}

// The code of the least error in ev (lane i code e0 - KVC_T_SEARCH_DOWN + i): ties to e0, then
// to the smaller code, as kvc_t_row_search_ref.
static uint8_t kvc_t_best_candidate(const double * ev, uint8_t e0) {
    uint8_t e    = e0;
    double  best = ev[KVC_T_SEARCH_DOWN];
    for (int i = 0; i < KVC_T_N_CAND; ++i) {
        const int c = (int) e0 - KVC_T_SEARCH_DOWN + i;
        if (c >= 1 && c <= KVC_E8_MAX && c != e0 && ev[i] < best) {
            best = ev[i];
            e    = (uint8_t) c;
        }
    }
    return e;
}
#endif

#if defined(KVC_T_CODE_AVX512)

// Entry idx (lanes) of a table of n floats: from registers by permutes up to 64 entries (the
// levels of up to 6 bits, a search's thresholds but the last level of 7 and 8 bits), else by a
// gather.
static inline __m512 kvc_t_lookup16(const float * tab, int n, __m512i idx) {
    if (n <= 16) {
        return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps((__mmask16) ((1u << n) - 1), tab));
    }
    if (n <= 32) {
        return _mm512_permutex2var_ps(_mm512_loadu_ps(tab), idx, _mm512_maskz_loadu_ps((__mmask16) ((1u << (n - 16)) - 1), tab + 16));
    }
    if (n <= 64) {
        const __m512 lo = _mm512_permutex2var_ps(_mm512_loadu_ps(tab), idx, _mm512_loadu_ps(tab + 16));
        const __m512 hi = _mm512_permutex2var_ps(_mm512_loadu_ps(tab + 32), idx,
                                                 _mm512_maskz_loadu_ps((__mmask16) ((1u << (n - 48)) - 1), tab + 48));
        return _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), lo, hi);
    }
    return _mm512_i32gather_ps(idx, tab, 4);
}

// err[0..2] (lanes 0-7, 8-15 of r[0], 0-7 of r[1]) += w * r * r, each product rounded in double
static inline void kvc_t_add_errors(__m512d * err, double w, const __m512 * r) {
    const __m256 h[3] = {
        _mm512_castps512_ps256(r[0]),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r[0]), 1)),
        _mm512_castps512_ps256(r[1]),
    };
    const __m512d wv = _mm512_set1_pd(w);
    for (int i = 0; i < 3; ++i) {
        const __m512d rd = _mm512_cvtps_pd(h[i]);
        __m512d t = _mm512_mul_pd(wv, rd);
        KVC_T_KEEP(t);
        t = _mm512_mul_pd(t, rd);
        KVC_T_KEEP(t);
        err[i] = _mm512_add_pd(err[i], t);
    }
}

// The search of kvc_t_row_search_ref; codes[j][i]: coefficient j's code at candidate i's scale.
static uint8_t kvc_t_row_search_avx512(const kvc_t_plan * plan, const float * u, uint8_t e0, uint8_t (*codes)[32]) {
    float sv[32], iv[32];
    kvc_t_candidates(e0, sv, iv, 32);
    const __m512 s[2]   = { _mm512_loadu_ps(sv), _mm512_loadu_ps(sv + 16) };
    const __m512 inv[2] = { _mm512_loadu_ps(iv), _mm512_loadu_ps(iv + 16) };
    __m512d err[3] = { _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd() };
    // every bit count's levels, one after the other from those of 1 bit
    const float * levels = kvc_t_levels_of(1);

    for (int32_t j = 0; j < plan->d; ++j) {
        const int    b  = plan->bits[j];
        const double w  = (double) plan->sigma[j] * (double) plan->sigma[j];
        const __m512 uj = _mm512_set1_ps(u[j]);
        __m512 r[2];
        if (b == 0) {
            r[0] = r[1] = uj;
        } else {
            const float * tree = kvc_t_mids_tree + (1 << b) - b - 1; // b's thresholds, level by level
            const __m512  x[2] = { _mm512_mul_ps(uj, inv[0]), _mm512_mul_ps(uj, inv[1]) };
            // the level's index: the thresholds below x, found in b halvings as the reference
            // does; halving k compares with the (lo >> (b - k))-th threshold of level k
            __m512i lo[2] = { _mm512_setzero_si512(), _mm512_setzero_si512() };
            for (int k = 0; k < b; ++k) {
                const __m512i step = _mm512_set1_epi32(1 << (b - 1 - k));
                for (int h = 0; h < 2; ++h) {
                    const __m512    t  = kvc_t_lookup16(tree + (1 << k) - 1, 1 << k, _mm512_srli_epi32(lo[h], (unsigned) (b - k)));
                    const __mmask16 gt = _mm512_cmp_ps_mask(x[h], t, _CMP_GT_OQ);
                    lo[h] = _mm512_mask_add_epi32(lo[h], gt, lo[h], step);
                }
            }
            const float * lb = levels + (1 << b) - 2; // kvc_t_levels_of(b)
            for (int h = 0; h < 2; ++h) {
                _mm_storeu_si128((__m128i *) (codes[j] + 16 * h), _mm512_cvtepi32_epi8(lo[h]));
                __m512 p = _mm512_mul_ps(s[h], kvc_t_lookup16(lb, 1 << b, lo[h]));
                KVC_T_KEEP(p);
                r[h] = _mm512_sub_ps(uj, p);
            }
        }
        kvc_t_add_errors(err, w, r);
    }

    double ev[24];
    for (int i = 0; i < 3; ++i) {
        _mm512_storeu_pd(ev + 8 * i, err[i]);
    }
    return kvc_t_best_candidate(ev, e0);
}
#endif

#if defined(KVC_T_CODE_AVX2)
// Entry idx (lanes) of a table of n floats: from registers by permutes up to 16 entries (the
// levels of up to 4 bits, the thresholds of a search's first 5 halvings), else one at a time
// (a gather measured slower on AMD Zen 1). Only the table's own entries are read.
static inline __m256 kvc_t_lookup8(const float * tab, int n, __m256i idx) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    if (n <= 8) {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
        return _mm256_permutevar8x32_ps(_mm256_maskload_ps(tab, m), idx);
    }
    if (n <= 16) {
        const __m256i m  = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane);
        const __m256  lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab), idx);
        const __m256  hi = _mm256_permutevar8x32_ps(_mm256_maskload_ps(tab + 8, m), idx);
        // bit 3 of the index, moved to the sign bit, picks the upper 8
        return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    }
    int32_t i[8];
    _mm256_storeu_si256((__m256i *) i, idx);
    return _mm256_setr_ps(tab[i[0]], tab[i[1]], tab[i[2]], tab[i[3]], tab[i[4]], tab[i[5]], tab[i[6]], tab[i[7]]);
}

// The search of kvc_t_row_search_ref, 8 candidates to a vector.
static uint8_t kvc_t_row_search_avx2(const kvc_t_plan * plan, const float * u, uint8_t e0) {
    float sv[24], iv[24];
    kvc_t_candidates(e0, sv, iv, 24);
    __m256 s[3], inv[3];
    __m256d err[6];
    for (int h = 0; h < 3; ++h) {
        s[h]   = _mm256_loadu_ps(sv + 8 * h);
        inv[h] = _mm256_loadu_ps(iv + 8 * h);
        err[2 * h] = err[2 * h + 1] = _mm256_setzero_pd();
    }
    const float * levels = kvc_t_levels_of(1);

    for (int32_t j = 0; j < plan->d; ++j) {
        const int    b  = plan->bits[j];
        const __m256 uj = _mm256_set1_ps(u[j]);
        __m256 r[3];
        if (b == 0) {
            r[0] = r[1] = r[2] = uj;
        } else {
            const float * tree = kvc_t_mids_tree + (1 << b) - b - 1;
            __m256i lo[3];
            __m256  x[3];
            for (int h = 0; h < 3; ++h) {
                x[h]  = _mm256_mul_ps(uj, inv[h]);
                lo[h] = _mm256_setzero_si256();
            }
            for (int k = 0; k < b; ++k) {
                const __m256i step  = _mm256_set1_epi32(1 << (b - 1 - k));
                const __m128i shift = _mm_cvtsi32_si128(b - k);
                for (int h = 0; h < 3; ++h) {
                    const __m256 t  = kvc_t_lookup8(tree + (1 << k) - 1, 1 << k, _mm256_srl_epi32(lo[h], shift));
                    const __m256 gt = _mm256_cmp_ps(x[h], t, _CMP_GT_OQ);
                    lo[h] = _mm256_add_epi32(lo[h], _mm256_and_si256(_mm256_castps_si256(gt), step));
                }
            }
            const float * lb = levels + (1 << b) - 2;
            for (int h = 0; h < 3; ++h) {
                __m256 p = _mm256_mul_ps(s[h], kvc_t_lookup8(lb, 1 << b, lo[h]));
                KVC_T_KEEP(p);
                r[h] = _mm256_sub_ps(uj, p);
            }
        }
        const __m256d wv = _mm256_set1_pd((double) plan->sigma[j] * (double) plan->sigma[j]);
        for (int h = 0; h < 6; ++h) {
            const __m128  half = h % 2 ? _mm256_extractf128_ps(r[h / 2], 1) : _mm256_castps256_ps128(r[h / 2]);
            const __m256d rd   = _mm256_cvtps_pd(half);
            __m256d t = _mm256_mul_pd(wv, rd);
            KVC_T_KEEP(t);
            t = _mm256_mul_pd(t, rd);
            KVC_T_KEEP(t);
            err[h] = _mm256_add_pd(err[h], t);
        }
    }

    double ev[24];
    for (int h = 0; h < 6; ++h) {
        _mm256_storeu_pd(ev + 4 * h, err[h]);
    }
    return kvc_t_best_candidate(ev, e0);
}
#endif

void kvc_t_quantize_row(const kvc_t_plan * plan, const float * GGML_RESTRICT x, uint8_t * GGML_RESTRICT y) {
    float u[KVC_T_MAX_D];
    const uint8_t e0 = kvc_t_row_start(plan, x, u);
#if defined(KVC_T_CODE_AVX512)
    if (e0 > 0) {
        uint8_t codes[KVC_T_MAX_D][32];
        const uint8_t e = kvc_t_row_search_avx512(plan, u, e0, codes);
        kvc_t_row_pack_codes(plan, &codes[0][e - (e0 - KVC_T_SEARCH_DOWN)], 32, e, y);
        return;
    }
#elif defined(KVC_T_CODE_AVX2)
    if (e0 > 0) {
        // the winner's codes found again: one pass against the search's 21
        kvc_t_row_pack(plan, u, kvc_t_row_search_avx2(plan, u, e0), y);
        return;
    }
#endif
    kvc_t_row_pack(plan, u, e0 == 0 ? 0 : kvc_t_row_search_ref(plan, u, e0), y);
}
