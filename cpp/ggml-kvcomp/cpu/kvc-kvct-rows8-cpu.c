// kvct rows decoded eight at a time, one row per lane, into the columns of an F32 tile
// (kvc_t_decoder_rows8, kvc-kvct-cpu.h). Built where rows are otherwise decoded 8 coefficients
// at a time (AVX2, AVX-512 without VBMI); elsewhere kvc_t_rows8_floats says 0 and the
// attention kernel keeps the row decoder.

#include "kvc-kvct-cpu.h"
#include "kvc-kvct-simd.h"
#include "kvc-common.h"

#include <string.h>

#if defined(KVC_T_AVX2)

// Coefficient j's table: its 2^bits levels times sigma, at least 8 (a whole vector); up to 5
// bits read by permutes, wider ones gathered (on AMD Zen 4, picking 6 and 7 bits' magnitudes
// by permutes and the sign from the code's top bit was 5% slower).
static int32_t kvc_t_rows8_entries(int32_t bits) {
    return bits <= 3 ? 8 : 1 << bits;
}

size_t kvc_t_rows8_floats(const kvc_t_plan * plan) {
    size_t n = 0;
    for (int32_t j = 0; j < plan->d; ++j) {
        n += (size_t) kvc_t_rows8_entries(plan->bits[j]);
    }
    return n;
}

void kvc_t_rows8_init(kvc_t_rows8 * r, const kvc_t_decoder * dec, float * tab) {
    const kvc_t_plan * plan = dec->plan;
    const float * levels = kvc_t_levels_of(1);
    const int32_t rb = (int32_t) dec->row_bytes;
    r->n_words = (rb + 3) / 4;
    r->tail    = rb % 4;
    int32_t bit = 8, n = 0;
    for (int32_t j = 0; j < plan->d; ++j) {
        const int32_t b = plan->bits[j];
        // a coefficient of 0 bits reads code 0 of the last word; its entries are the row
        // decoder's level times sigma (0), so the sum below is the row decoder's
        const int32_t at = b > 0 ? bit : 0;
        r->word[j]  = at / 32;
        r->shift[j] = at % 32;
        r->mask[j]  = (1 << b) - 1;
        r->split[j] = at % 32 + b > 32;
        r->kind[j]  = b <= 3 ? 0 : b <= 5 ? b - 3 : 3;
        r->toff[j]  = n;
        const int32_t m = kvc_t_rows8_entries(b);
        // the row decoder's products: the level times sigma (the row's scale comes after)
        for (int32_t i = 0; i < m; ++i) {
            tab[n + i] = i < (1 << b) ? levels[dec->lvl[j] + i] * dec->sig[j] : 0.0f;
        }
        n   += m;
        bit += b;
    }
    r->tab = tab;
}

// word k of the 8 rows: lane i from x0 + i stride; a last word that is not whole is read from
// the row's last 4 bytes and shifted down, so that no row is read past its end
KVC_T_INLINE __m256i kvc_t_rows8_word(const kvc_t_rows8 * r, const uint8_t * x0, __m256i idx, int32_t k) {
    if (k == r->n_words - 1 && r->tail) {
        const __m256i w = _mm256_i32gather_epi32((const int *) (x0 + 4 * k + r->tail - 4), idx, 1);
        return _mm256_srl_epi32(w, _mm_cvtsi32_si128(8 * (4 - r->tail)));
    }
    return _mm256_i32gather_epi32((const int *) (x0 + 4 * k), idx, 1);
}

// the 32 bytes at x + i stride (i = 0..7) as 8 words of 8 lanes: w[k] lane i = word k of row i
KVC_T_INLINE void kvc_t_rows8_transpose(const uint8_t * x, int64_t stride, __m256i * w) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm256_loadu_ps((const float *) (x + i * stride));
    }
    for (int i = 0; i < 4; ++i) {
        t[2 * i]     = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        for (int h = 0; h < 2; ++h) {
            r[4 * i + 2 * h]     = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0x44);
            r[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0xEE);
        }
    }
    for (int i = 0; i < 4; ++i) {
        w[i]     = _mm256_castps_si256(_mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        w[i + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

// entry idx of each lane among the 8, 16 or 32 at t
KVC_T_INLINE __m256 kvc_t_rows8_pick8(const float * t, __m256i idx) {
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(t), idx);
}

KVC_T_INLINE __m256 kvc_t_rows8_pick16(const float * t, __m256i idx) {
    return _mm256_blendv_ps(kvc_t_rows8_pick8(t, idx), kvc_t_rows8_pick8(t + 8, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

KVC_T_INLINE __m256 kvc_t_rows8_pick32(const float * t, __m256i idx) {
    return _mm256_blendv_ps(kvc_t_rows8_pick16(t, idx), kvc_t_rows8_pick16(t + 16, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27)));
}

// coefficient j's levels times sigma for the 8 codes
KVC_T_INLINE __m256 kvc_t_rows8_levels(const kvc_t_rows8 * r, int32_t j, __m256i code) {
    const float * t = r->tab + r->toff[j];
    switch (r->kind[j]) {
        case 0:  return kvc_t_rows8_pick8(t, code);
        case 1:  return kvc_t_rows8_pick16(t, code);
        case 2:  return kvc_t_rows8_pick32(t, code);
        default: return _mm256_i32gather_ps(t, code, 4);
    }
}

// coefficient j of the 8 rows (their words w, scales vs): the row decoder's products, and a
// zero row's base where `zero` (lanes whose scale code is 0) when any is
KVC_T_INLINE __m256 kvc_t_rows8_coef(const kvc_t_decoder * dec, const kvc_t_rows8 * r, const __m256i * w, int32_t j, __m256 vs,
                                     bool any_zero, __m256 zero) {
    const __m256i sh = _mm256_set1_epi32(r->shift[j]);
    __m256i code = _mm256_srlv_epi32(w[r->word[j]], sh);
    if (r->split[j]) {
        code = _mm256_or_si256(code, _mm256_sllv_epi32(w[r->word[j] + 1], _mm256_sub_epi32(_mm256_set1_epi32(32), sh)));
    }
    code = _mm256_and_si256(code, _mm256_set1_epi32(r->mask[j]));
    const __m256 base = _mm256_set1_ps(dec->base[j]);
    const __m256 v = _mm256_fmadd_ps(kvc_t_rows8_levels(r, j, code), vs, base);
    return any_zero ? _mm256_blendv_ps(v, base, zero) : v;
}

// the turn's angles of pair p for the 8 keys: the walk's base plus each key's steps (delta d0
// + lane when the keys follow one another, else their own), the row decoder's products
KVC_T_INLINE void kvc_t_rows8_angles(const kvc_t_rope_walk * w, int32_t p, bool run, int32_t d0, __m256i delta, __m256 * c,
                                      __m256 * s) {
    const __m256 bc = _mm256_set1_ps(w->bc[p]), bs = _mm256_set1_ps(w->bs[p]);
    const float * ct = w->steps->ct[p];
    const float * st = w->steps->st[p];
    const __m256 tc = run ? _mm256_loadu_ps(ct + d0) : _mm256_i32gather_ps(ct, delta, 4);
    const __m256 ts = run ? _mm256_loadu_ps(st + d0) : _mm256_i32gather_ps(st, delta, 4);
    *c = _mm256_fmsub_ps(bc, tc, _mm256_mul_ps(bs, ts));
    *s = _mm256_fmadd_ps(bs, tc, _mm256_mul_ps(bc, ts));
}

bool kvc_t_decoder_rows8(const kvc_t_decoder * dec, const kvc_t_rows8 * r, kvc_t_rope_walk * w, const uint8_t * x0,
                         int64_t stride, const int64_t * pos, float * y, int64_t ld) {
    const int32_t d = dec->plan->d, n = d / 2;
#if defined(__AVX512F__)
    const int32_t lanes = 16; // the row decoder turns 16 pairs at a time here, or goes scalar
#else
    const int32_t lanes = 8;
#endif
    if (!w->fold || n % lanes != 0 || stride <= 0 || stride > INT32_MAX / 8) {
        return false;
    }
    kvc_t_rope_walk_to(w, pos[0]);
    int32_t dl[8];
    bool run = true;
    for (int i = 0; i < 8; ++i) {
        if (pos[i] < w->base || pos[i] - w->base >= KVC_T_ROPE_STEPS) {
            return false;
        }
        dl[i] = (int32_t) (pos[i] - w->base);
        run = run && dl[i] == dl[0] + i;
    }
    const __m256i delta = _mm256_loadu_si256((const __m256i *) dl);
    const __m256i idx   = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int32_t) stride));

    __m256i words[(8 + KVC_T_MAX_BITS * KVC_T_MAX_D) / 32 + 8];
    int32_t k = 0;
    // 8 whole words of each row at a time: 8 loads and a transpose in registers (a gather a
    // word was 10% of a row's time on Zen 4)
    for (const int32_t whole = r->n_words - (r->tail ? 1 : 0); k + 8 <= whole; k += 8) {
        kvc_t_rows8_transpose(x0 + 4 * k, stride, words + k);
    }
    for (; k < r->n_words; ++k) {
        words[k] = kvc_t_rows8_word(r, x0, idx, k);
    }
    // each row's scale, kvc_e8_to_fp32 of its first byte; a zero row (code 0) is its base
    static const float frac[8] = KVC_E8_FRAC;
    const __m256i e    = _mm256_and_si256(words[0], _mm256_set1_epi32(0xFF));
    const __m256  pw   = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_srli_epi32(e, 3), _mm256_set1_epi32(107)), 23));
    const __m256  vs   = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(frac), e), pw);
    const __m256  zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    const bool    any_zero = _mm256_movemask_ps(zero) != 0;

    __m256 v[KVC_T_MAX_D];
    for (int32_t j = 0; j < d; ++j) {
        v[j] = kvc_t_rows8_coef(dec, r, words, j, vs, any_zero, zero);
    }

    // the turn of kvc_t_decoder_row_at: pairs side by side take fmaddsub's products, NEOX's
    // pairs its own
    const int32_t ia = dec->pairing == 1 ? 2 : 1, ib = dec->pairing == 1 ? 1 : n;
    for (int32_t p = 0; p < n; ++p) {
        __m256 c, s;
        kvc_t_rows8_angles(w, p, run, dl[0], delta, &c, &s);
        const int32_t ja = ia * p, jb = ja + ib;
        const __m256 a = v[ja], b = v[jb];
        _mm256_storeu_ps(y + ja * ld, _mm256_fmsub_ps(c, a, _mm256_mul_ps(s, b)));
        if (dec->pairing == 1) {
            _mm256_storeu_ps(y + jb * ld, _mm256_fmadd_ps(c, b, _mm256_mul_ps(s, a)));
        } else {
            _mm256_storeu_ps(y + jb * ld, _mm256_fmadd_ps(s, a, _mm256_mul_ps(c, b)));
        }
    }
    return true;
}

#else

size_t kvc_t_rows8_floats(const kvc_t_plan * plan) {
    (void) plan;
    return 0;
}

void kvc_t_rows8_init(kvc_t_rows8 * r, const kvc_t_decoder * dec, float * tab) {
    (void) dec;
    memset(r, 0, sizeof(*r));
    r->tab = tab;
}

bool kvc_t_decoder_rows8(const kvc_t_decoder * dec, const kvc_t_rows8 * r, kvc_t_rope_walk * w, const uint8_t * x0,
                         int64_t stride, const int64_t * pos, float * y, int64_t ld) {
    (void) dec; (void) r; (void) w; (void) x0; (void) stride; (void) pos; (void) y; (void) ld;
    return false;
}

#endif
