// kvct rows on the CPU: a row decoded to its coefficients, turned to its position, and scored
// against queries (kvc_t_decoder_dots), per instruction set; the decoder's and the RoPE walk's
// setup is in kvc-kvct-init-cpu.c.

#include "kvc-kvct-cpu.h"
#include "kvc-kvct-simd.h"
#include "kvc-common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

static const float kvc_t_zeros[KVC_T_MAX_D] = { 0 };

#if defined(__AVX512F__)
// The angles of 16 pairs from p: the walk's base plus (tc, ts)
static inline void kvc_t_angles16(const kvc_t_rope_walk * w, const float * tc, const float * ts, int32_t p, __m512 * c, __m512 * s) {
    const __m512 bc = _mm512_loadu_ps(w->bc + p), bs = _mm512_loadu_ps(w->bs + p);
    const __m512 tcp = _mm512_loadu_ps(tc + p), tsp = _mm512_loadu_ps(ts + p);
    *c = _mm512_fmsub_ps(bc, tcp, _mm512_mul_ps(bs, tsp));
    *s = _mm512_fmadd_ps(bs, tcp, _mm512_mul_ps(bc, tsp));
}

#endif

#if defined(KVC_T_VBMI)
static inline __mmask64 kvc_t_bytes_mask(int64_t n) {
    return n <= 0 ? 0 : n >= 64 ? ~(__mmask64) 0 : (((__mmask64) 1 << n) - 1);
}

static inline __m512i kvc_t_load64(const uint8_t * p) {
    return _mm512_loadu_si512((const void *) p);
}

// Chunk m of row x (row scale vs): its 64 coefficients plus base (both in the lane layout), in
// f[0..3]. Only the row's own bytes are read (masked loads).
static inline void kvc_t_vbmi_chunk(const kvc_t_decoder * dec, const uint8_t * x, int32_t m, __m512 vs, const float * base,
                                    __m512 f[4]) {
    const int32_t c0 = 64 * m;
    const int64_t n  = (int64_t) dec->row_bytes - dec->vb_w0[m];
    const __m512i lo = _mm512_maskz_loadu_epi8(kvc_t_bytes_mask(n), x + dec->vb_w0[m]);
    const __m512i hi = n > 64 ? _mm512_maskz_loadu_epi8(kvc_t_bytes_mask(n - 64), x + dec->vb_w0[m] + 64) : _mm512_setzero_si512();
    const __m512i wa = _mm512_permutex2var_epi8(lo, kvc_t_load64(dec->vb_perm_a + c0), hi);
    const __m512i wb = _mm512_permutex2var_epi8(lo, kvc_t_load64(dec->vb_perm_b + c0), hi);
    const __m512i ctrl = kvc_t_load64(dec->vb_ctrl + c0);
    __m512i code = _mm512_multishift_epi64_epi8(ctrl, wa);
    code = _mm512_mask_multishift_epi64_epi8(code, 0xF0F0F0F0F0F0F0F0ull, ctrl, wb);
    code = _mm512_and_si512(code, kvc_t_load64(dec->vb_mask + c0));
    // a level in the upper half is +magnitude[code - top], one in the lower -magnitude[top - 1 - code]
    const __mmask64 up  = _mm512_test_epi8_mask(code, kvc_t_load64(dec->vb_top + c0));
    const __m512i   low = kvc_t_load64(dec->vb_low + c0);
    const __m512i   k   = _mm512_and_si512(_mm512_mask_blend_epi8(up, _mm512_xor_si512(code, low), code), low);
    const __m512i   idx = _mm512_add_epi8(k, kvc_t_load64(dec->vb_moff + c0));
    __m512i pl[4];
    for (int p = 0; p < 4; ++p) {
        pl[p] = _mm512_permutex2var_epi8(kvc_t_load64(kvc_t_vbmi_plane[p]), idx, kvc_t_load64(kvc_t_vbmi_plane[p] + 64));
    }
    if (dec->vb_has8[m]) {
        const __mmask64 k8 = _mm512_cmpge_epu8_mask(idx, _mm512_set1_epi8((char) 128));
        for (int p = 0; p < 4; ++p) {
            const __m512i t = _mm512_permutex2var_epi8(kvc_t_load64(kvc_t_vbmi_plane[p] + 128), idx,
                                                       kvc_t_load64(kvc_t_vbmi_plane[p] + 192));
            pl[p] = _mm512_mask_mov_epi8(pl[p], k8, t);
        }
    }
    pl[3] = _mm512_xor_si512(pl[3], _mm512_maskz_mov_epi8(~up, _mm512_set1_epi8((char) 0x80)));
    const __m512i w_lo = _mm512_unpacklo_epi8(pl[0], pl[1]), w_hi = _mm512_unpackhi_epi8(pl[0], pl[1]);
    const __m512i v_lo = _mm512_unpacklo_epi8(pl[2], pl[3]), v_hi = _mm512_unpackhi_epi8(pl[2], pl[3]);
    const __m512i lv[4] = {
        _mm512_unpacklo_epi16(w_lo, v_lo), _mm512_unpackhi_epi16(w_lo, v_lo),
        _mm512_unpacklo_epi16(w_hi, v_hi), _mm512_unpackhi_epi16(w_hi, v_hi),
    };
    for (int q = 0; q < 4; ++q) {
        const int32_t c = c0 + 16 * q;
        const __m512 l = _mm512_mul_ps(_mm512_castsi512_ps(lv[q]), _mm512_loadu_ps(dec->vb_sig + c));
        f[q] = _mm512_fmadd_ps(l, vs, _mm512_loadu_ps(base + c));
    }
}

// nv vectors of the row in the lane layout, plus its base (dec->vb_base) where `base`: chunks
// c0, c0 + cstep, ... in F[0..3], F[4..7], ...; turned to the position `delta` steps from the
// walk's base for a decoder of pairing `turn` (1 or 2; 0: no turn), or only by those steps
// where `steps_only` (the caller turns its queries back by the base's angles instead). The
// pairs' first channels are F[2k] (side by side) or F[k] (NEOX) and their second F[2k + 1] or
// F[k + nv/2], pairs 16 k .. 16 k + 15 of the block, whose first pair is 32 c0 (side by side)
// or 64 c0 (NEOX): a whole row (c0 = 0, cstep = 1) or half of a row of 256 (cstep 1 for pairs
// side by side, 2 for NEOX, whose pairs lie d/2 channels apart). Callers pass nv, turn and
// cstep as constants where they can, so that F stays in registers.
KVC_T_INLINE void kvc_t_vbmi_row(const kvc_t_decoder * dec, const uint8_t * x, float rs, bool base, int32_t nv, int32_t turn,
                                 bool steps_only, const kvc_t_rope_walk * w, int32_t delta, int32_t c0, int32_t cstep,
                                 __m512 * F) {
    for (int32_t i = 0; i < nv / 4; ++i) {
        kvc_t_vbmi_chunk(dec, x, c0 + cstep * i, _mm512_set1_ps(rs), base ? dec->vb_base : kvc_t_zeros, F + 4 * i);
    }
    if (turn == 0) {
        return;
    }
    const int32_t p0 = turn == 1 ? 32 * c0 : 64 * c0;
    const float * tc = w->steps->c[delta];
    const float * ts = w->steps->s[delta];
    for (int32_t k = 0; k < nv / 2; ++k) {
        const int32_t va = turn == 1 ? 2 * k : k, vb = turn == 1 ? 2 * k + 1 : k + nv / 2, p = p0 + 16 * k;
        __m512 c, sn;
        if (steps_only) {
            c  = _mm512_loadu_ps(tc + p);
            sn = _mm512_loadu_ps(ts + p);
        } else {
            kvc_t_angles16(w, tc, ts, p, &c, &sn);
        }
        const __m512 a = F[va], b = F[vb];
        F[va] = _mm512_fmsub_ps(c, a, _mm512_mul_ps(sn, b));
        F[vb] = _mm512_fmadd_ps(sn, a, _mm512_mul_ps(c, b));
    }
}

// F (the lane layout) in channel order
static inline void kvc_t_vbmi_store(const kvc_t_decoder * dec, const __m512 * F, float * y) {
    const int32_t nv = dec->plan->d / 16;
    if (dec->pairing != 1) {
        for (int32_t v = 0; v < nv; ++v) {
            _mm512_storeu_ps(y + 16 * v, F[v]);
        }
        return;
    }
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int32_t v = 0; v < nv; v += 2) {
        _mm512_storeu_ps(y + 16 * v,      _mm512_permutex2var_ps(F[v], lo, F[v + 1]));
        _mm512_storeu_ps(y + 16 * v + 16, _mm512_permutex2var_ps(F[v], hi, F[v + 1]));
    }
}

// The coefficients of row x plus the decoder's base where `base`, in channel order: the same
// products as the scalar decoder, 64 at a time.
static void kvc_t_decoder_coefs(const kvc_t_decoder * dec, const uint8_t * x, bool base, float * v) {
    const float s = kvc_e8_to_fp32(x[0]);
    if (!(s > 0.0f)) {
        memcpy(v, base ? dec->base : kvc_t_zeros, dec->plan->d * sizeof(float));
        return;
    }
    __m512 F[KVC_T_MAX_D / 16];
    kvc_t_vbmi_row(dec, x, s, base, dec->plan->d / 16, 0, false, NULL, 0, 0, 1, F);
    kvc_t_vbmi_store(dec, F, v);
}
#elif defined(KVC_T_AVX2)
// A row as the AVX2 decoder reads it: its own bytes, and for the groups from av_safe on a copy
// of its bytes from av_tail with zeros after it (those groups' windows start in the row's
// last 15 bytes: the copy is shorter than 16 bytes and their windows end within 32).
typedef struct {
    const uint8_t * x;
    uint8_t tail[32];
} kvc_t_avx2_row;

KVC_T_INLINE void kvc_t_avx2_row_init(const kvc_t_decoder * dec, const uint8_t * x, kvc_t_avx2_row * r) {
    r->x = x;
    _mm256_storeu_si256((__m256i *) r->tail, _mm256_setzero_si256());
    memcpy(r->tail, x + dec->av_tail, dec->row_bytes - dec->av_tail);
}

// Coefficients c .. c + 7 of row r (scale vs) plus base, the decoder's av_ fields; the products
// of the VBMI decoder
KVC_T_INLINE __m256 kvc_t_avx2_coefs8(const kvc_t_decoder * dec, const float * levels, const kvc_t_avx2_row * r, int32_t c,
                                      __m256 vs, const float * base) {
    const bool      in  = c < dec->av_safe;
    const uint8_t * src = in ? r->x : r->tail;
    const int32_t   off = in ? 0 : dec->av_tail;
    const __m256i win = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) (src + dec->av_win[c / 8] - off)));
    const __m256i wds = _mm256_shuffle_epi8(win, _mm256_loadu_si256((const __m256i *) (dec->av_ctrl + 4 * c)));
    const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(wds, _mm256_loadu_si256((const __m256i *) (dec->shift + c))),
                                          _mm256_loadu_si256((const __m256i *) (dec->mask + c)));
    __m256 l;
    if (dec->av_wide[c / 8] < 2) {
        // a level in the upper half is +magnitude[code - top], one in the lower -magnitude[top - 1 - code]
        const __m256i top = _mm256_loadu_si256((const __m256i *) (dec->av_top + c));
        const __m256i low = _mm256_sub_epi32(top, _mm256_set1_epi32(1));
        const __m256i up  = _mm256_cmpeq_epi32(_mm256_and_si256(code, top), top);
        const __m256i k   = _mm256_and_si256(_mm256_blendv_epi8(_mm256_xor_si256(code, low), code, up), low);
        const __m256i idx = _mm256_add_epi32(k, _mm256_loadu_si256((const __m256i *) (dec->av_moff + c)));
        // the magnitude among 8 by the index's low 3 bits, among 16 by its bit 3, 31 by its bit 4
        const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
        __m256 mag = _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(dec->av_mag), idx),
                                      _mm256_permutevar8x32_ps(_mm256_loadu_ps(dec->av_mag + 8), idx), bit3);
        if (dec->av_wide[c / 8] == 1) {
            const __m256 mag5 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(dec->av_mag + 16), idx),
                                                 _mm256_permutevar8x32_ps(_mm256_loadu_ps(dec->av_mag + 24), idx), bit3);
            mag = _mm256_blendv_ps(mag, mag5, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27)));
        }
        l = _mm256_xor_ps(mag, _mm256_castsi256_ps(_mm256_andnot_si256(up, _mm256_set1_epi32(INT32_MIN))));
    } else {
        int32_t i[8];
        _mm256_storeu_si256((__m256i *) i, _mm256_add_epi32(code, _mm256_loadu_si256((const __m256i *) (dec->lvl + c))));
        l = _mm256_setr_ps(levels[i[0]], levels[i[1]], levels[i[2]], levels[i[3]], levels[i[4]], levels[i[5]], levels[i[6]],
                           levels[i[7]]);
    }
    return _mm256_fmadd_ps(_mm256_mul_ps(l, _mm256_loadu_ps(dec->sig + c)), vs, _mm256_loadu_ps(base + c));
}

// The coefficients of row x plus the decoder's base where `base`, 8 at a time
static void kvc_t_decoder_coefs(const kvc_t_decoder * dec, const uint8_t * x, bool plus_base, float * v) {
    const float * base = plus_base ? dec->base : kvc_t_zeros;
    const float s = kvc_e8_to_fp32(x[0]);
    if (!(s > 0.0f)) {
        memcpy(v, base, dec->plan->d * sizeof(float));
        return;
    }
    kvc_t_avx2_row r;
    kvc_t_avx2_row_init(dec, x, &r);
    const float * levels = kvc_t_levels_of(1);
    for (int32_t c = 0; c < dec->plan->d; c += 8) {
        _mm256_storeu_ps(v + c, kvc_t_avx2_coefs8(dec, levels, &r, c, _mm256_set1_ps(s), base));
    }
}
#else
// The coefficients of row x plus the decoder's base where `base`, in channel order. The row is
// copied with room after it for the 4-byte loads of its last codes.
static void kvc_t_decoder_coefs(const kvc_t_decoder * dec, const uint8_t * x, bool plus_base, float * v) {
    const int32_t d = dec->plan->d;
    const float * base = plus_base ? dec->base : kvc_t_zeros;
    const float * levels = kvc_t_levels_of(1);
    uint8_t buf[(8 + KVC_T_MAX_BITS * KVC_T_MAX_D) / 8 + 8];
    memcpy(buf, x, dec->row_bytes);
    memset(buf + dec->row_bytes, 0, 8);
    const float s = kvc_e8_to_fp32(buf[0]);
    if (!(s > 0.0f)) {
        memcpy(v, base, d * sizeof(float));
        return;
    }
    for (int32_t c = 0; c < d; ++c) {
        uint32_t w;
        memcpy(&w, buf + dec->boff[c], sizeof(w));
        const uint32_t code = (w >> dec->shift[c]) & (uint32_t) dec->mask[c];
        v[c] = levels[dec->lvl[c] + (int32_t) code] * dec->sig[c] * s + base[c];
    }
}
#endif

void kvc_t_decoder_row(const kvc_t_decoder * dec, const uint8_t * x, float * y) {
    const kvc_t_plan * plan = dec->plan;
    if (dec->identity) {
        kvc_t_decoder_coefs(dec, x, false, y);
        return;
    }
    float v[KVC_T_MAX_D];
    kvc_t_decoder_coefs(dec, x, false, v);
    if (dec->pairing == 0) {
        kvc_t_inverse(plan, v, y);
        return;
    }
    // kvc_t_inverse over RoPE's own pairing: channel a of pair p is ia * p, b is a + ib
    const int32_t n = plan->d / 2;
    const int32_t ia = dec->pairing == 1 ? 2 : 1, ib = dec->pairing == 1 ? 1 : n;
    for (int32_t p = 0; p < n; ++p) {
        const int32_t a = ia * p, b = a + ib;
        const float rc = plan->rot[p][0], rs = plan->rot[p][1];
        y[a] = rc * v[a] - rs * v[b] + plan->mean[a];
        y[b] = rs * v[a] + rc * v[b] + plan->mean[b];
    }
}

#if defined(__AVX512F__)
// 8 pairs (2p, 2p+1) side by side in a, turned by the angles of pairs h*8 .. h*8+7 of (c, s):
// c a -+ s a', a' the pairs swapped
static inline __m512 kvc_t_turn_pairs8(__m512 a, __m512 c, __m512 s, int h) {
    const __m512i dup = _mm512_add_epi32(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), _mm512_set1_epi32(8 * h));
    const __m512  sw  = _mm512_mul_ps(_mm512_permutexvar_ps(dup, s), _mm512_permute_ps(a, 0xB1));
    return _mm512_fmaddsub_ps(_mm512_permutexvar_ps(dup, c), a, sw);
}
#endif

#if defined(KVC_T_AVX2)
// 4 pairs (2p, 2p+1) side by side in a, turned by the angles of pairs h*4 .. h*4+3 of (c, s):
// c a -+ s a', a' the pairs swapped
static inline __m256 kvc_t_turn_pairs4(__m256 a, __m256 c, __m256 s, int h) {
    const __m256i dup = _mm256_add_epi32(_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_set1_epi32(4 * h));
    const __m256  sw  = _mm256_mul_ps(_mm256_permutevar8x32_ps(s, dup), _mm256_permute_ps(a, 0xB1));
    return _mm256_fmaddsub_ps(_mm256_permutevar8x32_ps(c, dup), a, sw);
}
#endif

// y = the coefficients v (pairs as `pairing`) turned pair by pair by the angles of the walk's
// base plus those of its steps since (tc, ts): the sum is taken here, per row, so that no key's
// angles wait on the last key's
static void kvc_t_turn(int32_t pairing, int32_t n, const float * v, const kvc_t_rope_walk * w, const float * tc,
                       const float * ts, float * y) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        for (int32_t p = 0; p < n; p += 16) {
            __m512 cp, sp;
            kvc_t_angles16(w, tc, ts, p, &cp, &sp);
            if (pairing == 1) {
                for (int h = 0; h < 2; ++h) {
                    _mm512_storeu_ps(y + 2 * p + 16 * h, kvc_t_turn_pairs8(_mm512_loadu_ps(v + 2 * p + 16 * h), cp, sp, h));
                }
            } else {
                const __m512 a = _mm512_loadu_ps(v + p), b = _mm512_loadu_ps(v + p + n);
                _mm512_storeu_ps(y + p,     _mm512_fmsub_ps(cp, a, _mm512_mul_ps(sp, b)));
                _mm512_storeu_ps(y + p + n, _mm512_fmadd_ps(sp, a, _mm512_mul_ps(cp, b)));
            }
        }
        return;
    }
#elif defined(KVC_T_AVX2)
    if (n % 8 == 0) {
        for (int32_t p = 0; p < n; p += 8) {
            const __m256 bc = _mm256_loadu_ps(w->bc + p), bs = _mm256_loadu_ps(w->bs + p);
            const __m256 tcp = _mm256_loadu_ps(tc + p), tsp = _mm256_loadu_ps(ts + p);
            const __m256 cp = _mm256_fmsub_ps(bc, tcp, _mm256_mul_ps(bs, tsp));
            const __m256 sp = _mm256_fmadd_ps(bs, tcp, _mm256_mul_ps(bc, tsp));
            if (pairing == 1) {
                for (int h = 0; h < 2; ++h) {
                    _mm256_storeu_ps(y + 2 * p + 8 * h, kvc_t_turn_pairs4(_mm256_loadu_ps(v + 2 * p + 8 * h), cp, sp, h));
                }
            } else {
                const __m256 a = _mm256_loadu_ps(v + p), b = _mm256_loadu_ps(v + p + n);
                _mm256_storeu_ps(y + p,     _mm256_fmsub_ps(cp, a, _mm256_mul_ps(sp, b)));
                _mm256_storeu_ps(y + p + n, _mm256_fmadd_ps(sp, a, _mm256_mul_ps(cp, b)));
            }
        }
        return;
    }
#endif
    const float * bc = w->bc;
    const float * bs = w->bs;
    const int32_t ia = pairing == 1 ? 2 : 1, ib = pairing == 1 ? 1 : n;
    for (int32_t p = 0; p < n; ++p) {
        const float c = bc[p] * tc[p] - bs[p] * ts[p];
        const float s = bs[p] * tc[p] + bc[p] * ts[p];
        const int32_t ja = ia * p, jb = ja + ib;
        const float a = v[ja], b = v[jb];
        y[ja] = c * a - s * b;
        y[jb] = s * a + c * b;
    }
}

// kvc_t_decoder_row_at, inlined where kvc_t_decoder_dots scores rows
KVC_T_INLINE void kvc_t_row_at(const kvc_t_decoder * dec, const uint8_t * x, const kvc_t_rope_walk * w, float * y) {
    const int32_t n = dec->plan->d / 2;
    const float * tc = w->steps->c[w->delta];
    const float * ts = w->steps->s[w->delta];
    if (!w->fold) {
        float c[KVC_T_MAX_D / 2], s[KVC_T_MAX_D / 2];
        memcpy(c, w->bc, n * sizeof(float));
        memcpy(s, w->bs, n * sizeof(float));
        kvc_t_add_angles(n, c, s, tc, ts);
        kvc_t_decoder_row(dec, x, y);
        kvc_t_rope_row(dec->plan, c, s, 0, y);
        return;
    }
#if defined(KVC_T_VBMI)
    const float rs = kvc_e8_to_fp32(x[0]);
    if (rs > 0.0f) {
        __m512 F[KVC_T_MAX_D / 16];
        kvc_t_vbmi_row(dec, x, rs, true, dec->plan->d / 16, dec->pairing, false, w, w->delta, 0, 1, F);
        kvc_t_vbmi_store(dec, F, y);
        return;
    }
#endif
    float v[KVC_T_MAX_D];
    kvc_t_decoder_coefs(dec, x, true, v);
    kvc_t_turn(dec->pairing, n, v, w, tc, ts, y);
}

void kvc_t_decoder_row_at(const kvc_t_decoder * dec, const uint8_t * x, const kvc_t_rope_walk * w, float * y) {
    kvc_t_row_at(dec, x, w, y);
}

// The walk at key position pos: a key one of the next steps after the walk's base takes that
// step without a call.
KVC_T_INLINE void kvc_t_walk_step(kvc_t_rope_walk * w, int64_t pos) {
    if (w->base != INT64_MIN && pos >= w->base && pos - w->base < KVC_T_ROPE_STEPS) {
        w->delta = (int32_t) (pos - w->base);
    } else {
        kvc_t_rope_walk_to(w, pos);
    }
}

// Row x's values in y: turned to the walk's key position with a walk, as they are without.
KVC_T_INLINE void kvc_t_row_to(const kvc_t_decoder * dec, const kvc_t_rope_walk * w, const uint8_t * x, float * y) {
    if (w) {
        kvc_t_row_at(dec, x, w, y);
    } else {
        kvc_t_decoder_row(dec, x, y);
    }
}

#if defined(__AVX512F__)
// The lane sums of a[0..15], lane i of the result a[i]'s: pairs of vectors are interleaved and
// added (16 -> 8 -> 4), then their 128-bit lanes (4 -> 2 -> 1): 45 instructions for 16 sums
// where one sum alone takes 8 in a chain.
static inline __m512 kvc_t_hsum16(const __m512 * a) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; ++i) {
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    }
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i) {
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

#if defined(KVC_T_VBMI)
// acc[g][i + r] = the lanes whose sum is Q[g] . (row x[r] turned by its steps delta[r]), for nr
// rows (1 or 2: two rows decoded side by side give the core two independent chains to overlap)
KVC_T_INLINE void kvc_t_vbmi_score(const kvc_t_decoder * dec, const kvc_t_rope_walk * w, int32_t nr, const uint8_t * const * x,
                                   const int32_t * delta, int32_t nv, int32_t turn, __m512 (*Q)[KVC_T_MAX_D / 16], int32_t gn,
                                   __m512 (*acc)[16], int32_t i) {
    // a row of 256 in two halves of 8 vectors, which leave the registers room
    const int32_t nb = nv == 16 ? 2 : 1, nvb = nv / nb, cstep = nb == 2 && turn == 2 ? 2 : 1;
    for (int32_t h = 0; h < nb; ++h) {
        const int32_t c0 = cstep == 2 ? h : 2 * h;
        __m512 F[2][KVC_T_MAX_D / 16];
        for (int32_t r = 0; r < nr; ++r) {
            kvc_t_vbmi_row(dec, x[r], kvc_e8_to_fp32(x[r][0]), true, nvb, turn, true, w, delta[r], c0, cstep, F[r]);
        }
        for (int32_t g = 0; g < gn; ++g) {
            for (int32_t r = 0; r < nr; ++r) {
                __m512 a = h == 0 ? _mm512_setzero_ps() : acc[g][i + r];
                for (int32_t v = 0; v < nvb; ++v) {
                    a = _mm512_fmadd_ps(F[r][v], Q[g][4 * (c0 + cstep * (v / 4)) + v % 4], a);
                }
                acc[g][i + r] = a;
            }
        }
    }
}

// kvc_t_decoder_dots where every row is decoded in registers: rows coded before RoPE under a plan
// whose pairs RoPE turns (turn = the decoder's pairing, 1 or 2), or rows after RoPE under a plan
// of no rotation and no mean (turn 0, no walk). The queries are put in the decoder's lane layout
// once, so that a row's vectors meet them as they come out of the decoder and the turn, with no
// store and no permute. q . R(base + steps) k = (R(base)' q) . R(steps) k: the queries are
// turned back by the walk's base whenever it moves (every 16 keys along a run), and each row
// only by its steps from there, whose angles are read, not made.
KVC_T_INLINE void kvc_t_vbmi_dots_nv(const kvc_t_decoder * dec, kvc_t_rope_walk * w, const uint8_t * const * rows,
                                     const int64_t * pos, int32_t n, const float * const * q, int32_t gn, float * d, int32_t ld,
                                     int32_t nv, int32_t turn) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    __m512 Q[KVC_T_DOTS_MAX_Q][KVC_T_MAX_D / 16];
    for (int32_t g = 0; g < gn; ++g) {
        for (int32_t v = 0; v < nv; v += 2) {
            const __m512 lo = _mm512_loadu_ps(q[g] + 16 * v), hi = _mm512_loadu_ps(q[g] + 16 * v + 16);
            Q[g][v]     = dec->pairing == 1 ? _mm512_permutex2var_ps(lo, ev, hi) : lo;
            Q[g][v + 1] = dec->pairing == 1 ? _mm512_permutex2var_ps(lo, od, hi) : hi;
        }
    }
    __m512 QT[KVC_T_DOTS_MAX_Q][KVC_T_MAX_D / 16];
    int64_t qbase = INT64_MIN;
    __m512 acc[KVC_T_DOTS_MAX_Q][16];
    for (int32_t i0 = 0; i0 < n; i0 += 16) {
        const int32_t m = n - i0 < 16 ? n - i0 : 16;
        for (int32_t i = 0; i < m;) {
            // rows of 64 two at a time where both are at steps of the same base (longer rows
            // leave the registers no room for two: slower by a fifth at 128 and 256 on AMD Zen 4)
            const uint8_t * x[2] = { rows[i0 + i], i + 1 < m ? rows[i0 + i + 1] : NULL };
            int32_t delta[2] = { 0, 0 };
            bool two = nv == 4 && i + 1 < m;
            if (turn != 0) {
                kvc_t_walk_step(w, pos[i0 + i]);
                if (w->base != qbase) {
                    qbase = w->base;
                    for (int32_t k = 0; k < nv / 2; ++k) {
                        const int32_t va = turn == 1 ? 2 * k : k, vb = turn == 1 ? 2 * k + 1 : k + nv / 2;
                        const __m512 c = _mm512_loadu_ps(w->bc + 16 * k), sn = _mm512_loadu_ps(w->bs + 16 * k);
                        for (int32_t g = 0; g < gn; ++g) {
                            QT[g][va] = _mm512_fmadd_ps(c, Q[g][va], _mm512_mul_ps(sn, Q[g][vb]));
                            QT[g][vb] = _mm512_fmsub_ps(c, Q[g][vb], _mm512_mul_ps(sn, Q[g][va]));
                        }
                    }
                }
                const int64_t step = two ? pos[i0 + i + 1] - w->base : -1;
                two      = step >= 0 && step < KVC_T_ROPE_STEPS;
                delta[0] = w->delta;
                if (two) {
                    delta[1] = (int32_t) step;
                    w->delta = delta[1];
                }
            }
            if (two) {
                kvc_t_vbmi_score(dec, w, 2, x, delta, nv, turn, turn != 0 ? QT : Q, gn, acc, i);
                i += 2;
            } else {
                kvc_t_vbmi_score(dec, w, 1, x, delta, nv, turn, turn != 0 ? QT : Q, gn, acc, i);
                i += 1;
            }
        }
        for (int32_t i = m; i < 16; ++i) {
            for (int32_t g = 0; g < gn; ++g) {
                acc[g][i] = _mm512_setzero_ps();
            }
        }
        for (int32_t g = 0; g < gn; ++g) {
            _mm512_mask_storeu_ps(d + g * ld + i0, (__mmask16) ((1u << m) - 1), kvc_t_hsum16(acc[g]));
        }
    }
}

KVC_T_INLINE void kvc_t_vbmi_dots_turn(const kvc_t_decoder * dec, kvc_t_rope_walk * w, const uint8_t * const * rows,
                                       const int64_t * pos, int32_t n, const float * const * q, int32_t gn, float * d, int32_t ld,
                                       int32_t nv) {
    switch (w ? dec->pairing : 0) {
        case 1:  kvc_t_vbmi_dots_nv(dec, w, rows, pos, n, q, gn, d, ld, nv, 1); break;
        case 2:  kvc_t_vbmi_dots_nv(dec, w, rows, pos, n, q, gn, d, ld, nv, 2); break;
        default: kvc_t_vbmi_dots_nv(dec, NULL, rows, pos, n, q, gn, d, ld, nv, 0); break;
    }
}

static void kvc_t_vbmi_dots(const kvc_t_decoder * dec, kvc_t_rope_walk * w, const uint8_t * const * rows, const int64_t * pos,
                            int32_t n, const float * const * q, int32_t gn, float * d, int32_t ld) {
    switch (dec->plan->d) {
        case 64:  kvc_t_vbmi_dots_turn(dec, w, rows, pos, n, q, gn, d, ld, 4);  break;
        case 128: kvc_t_vbmi_dots_turn(dec, w, rows, pos, n, q, gn, d, ld, 8);  break;
        case 192: kvc_t_vbmi_dots_turn(dec, w, rows, pos, n, q, gn, d, ld, 12); break;
        default:  kvc_t_vbmi_dots_turn(dec, w, rows, pos, n, q, gn, d, ld, 16); break;
    }
}
#endif

// acc[g][i] = the 16 lanes whose sum is q[g] . (row x, turned to pos with a walk)
KVC_T_INLINE void kvc_t_row_dots16(const kvc_t_decoder * dec, kvc_t_rope_walk * w, const uint8_t * x, int64_t pos,
                                   const float * const * q, int32_t gn, __m512 (*acc)[16], int32_t i) {
    const int32_t dd = dec->plan->d;
    if (w) {
        kvc_t_walk_step(w, pos);
    }
    float y[KVC_T_MAX_D];
    kvc_t_row_to(dec, w, x, y);
    for (int32_t g = 0; g < gn; ++g) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(y), _mm512_loadu_ps(q[g]));
        for (int32_t c = 16; c < dd; c += 16) {
            a = _mm512_fmadd_ps(_mm512_loadu_ps(y + c), _mm512_loadu_ps(q[g] + c), a);
        }
        acc[g][i] = a;
    }
}
#endif

#if defined(KVC_T_AVX2)
// The most queries the AVX2 decoder scores a row against in registers
#define KVC_T_AVX2_MAX_G 8

// The lane sums of a[0..7], lane i of the result a[i]'s
static inline __m256 kvc_t_hsum8(const __m256 * a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// a[g] = the lanes whose sum is Q[g] . (row x turned by the angles (tc, ts) as `turn` pairs its
// channels), for G queries: each 8 coefficients are decoded, turned and scored in registers.
KVC_T_INLINE void kvc_t_avx2_score(const kvc_t_decoder * dec, const uint8_t * x, const float * tc, const float * ts, int32_t turn,
                                   float (*Q)[KVC_T_MAX_D], int32_t G, __m256 * a) {
    const int32_t dd = dec->plan->d;
    const float * levels = kvc_t_levels_of(1);
    // scale code 0 (a row at its plan's mean) is a scale of 0: levels times 0, plus base
    const __m256 vs = _mm256_set1_ps(kvc_e8_to_fp32(x[0]));
    kvc_t_avx2_row r;
    kvc_t_avx2_row_init(dec, x, &r);
    for (int32_t g = 0; g < G; ++g) {
        a[g] = _mm256_setzero_ps();
    }
    if (turn == 2) {
        const int32_t n = dd / 2;
        for (int32_t k = 0; k < n; k += 8) {
            const __m256 ka = kvc_t_avx2_coefs8(dec, levels, &r, k, vs, dec->base);
            const __m256 kb = kvc_t_avx2_coefs8(dec, levels, &r, k + n, vs, dec->base);
            const __m256 cp = _mm256_loadu_ps(tc + k), sp = _mm256_loadu_ps(ts + k);
            const __m256 ya = _mm256_fmsub_ps(cp, ka, _mm256_mul_ps(sp, kb));
            const __m256 yb = _mm256_fmadd_ps(sp, ka, _mm256_mul_ps(cp, kb));
            for (int32_t g = 0; g < G; ++g) {
                a[g] = _mm256_fmadd_ps(ya, _mm256_loadu_ps(Q[g] + k), _mm256_fmadd_ps(yb, _mm256_loadu_ps(Q[g] + k + n), a[g]));
            }
        }
    } else if (turn == 1) {
        // the whole row decoded first gives the core independent decodes to overlap (at head
        // size 64 on AMD Zen 4, 52.8 ns a row against 58.0 turning each 16 as they come)
        __m256 F[KVC_T_MAX_D / 8];
        for (int32_t c = 0; c < dd; c += 8) {
            F[c / 8] = kvc_t_avx2_coefs8(dec, levels, &r, c, vs, dec->base);
        }
        for (int32_t c = 0; c < dd; c += 16) {
            const __m256 cp = _mm256_loadu_ps(tc + c / 2), sp = _mm256_loadu_ps(ts + c / 2);
            const __m256 y0 = kvc_t_turn_pairs4(F[c / 8], cp, sp, 0);
            const __m256 y1 = kvc_t_turn_pairs4(F[c / 8 + 1], cp, sp, 1);
            for (int32_t g = 0; g < G; ++g) {
                a[g] = _mm256_fmadd_ps(y0, _mm256_loadu_ps(Q[g] + c), _mm256_fmadd_ps(y1, _mm256_loadu_ps(Q[g] + c + 8), a[g]));
            }
        }
    } else {
        for (int32_t c = 0; c < dd; c += 8) {
            const __m256 y = kvc_t_avx2_coefs8(dec, levels, &r, c, vs, dec->base);
            for (int32_t g = 0; g < G; ++g) {
                a[g] = _mm256_fmadd_ps(y, _mm256_loadu_ps(Q[g] + c), a[g]);
            }
        }
    }
}

// QT[g] = Q[g] turned back by the walk's base: R(base)' q, pairs as `turn`
static void kvc_t_avx2_turn_back(const kvc_t_rope_walk * w, int32_t turn, int32_t dd, float (*Q)[KVC_T_MAX_D],
                                 float (*QT)[KVC_T_MAX_D], int32_t G) {
    const int32_t n = dd / 2;
    if (turn == 2) {
        for (int32_t p = 0; p < n; p += 8) {
            const __m256 c = _mm256_loadu_ps(w->bc + p), sn = _mm256_loadu_ps(w->bs + p);
            for (int32_t g = 0; g < G; ++g) {
                const __m256 qa = _mm256_loadu_ps(Q[g] + p), qb = _mm256_loadu_ps(Q[g] + p + n);
                _mm256_storeu_ps(QT[g] + p,     _mm256_fmadd_ps(c, qa, _mm256_mul_ps(sn, qb)));
                _mm256_storeu_ps(QT[g] + p + n, _mm256_fmsub_ps(c, qb, _mm256_mul_ps(sn, qa)));
            }
        }
        return;
    }
    // pairs side by side: turned by the base's angle taken negative (c qa + s qb, c qb - s qa)
    for (int32_t p = 0; p < n; p += 8) {
        const __m256 c  = _mm256_loadu_ps(w->bc + p);
        const __m256 ns = _mm256_xor_ps(_mm256_loadu_ps(w->bs + p), _mm256_set1_ps(-0.0f));
        for (int32_t h = 0; h < 2; ++h) {
            for (int32_t g = 0; g < G; ++g) {
                _mm256_storeu_ps(QT[g] + 2 * p + 8 * h, kvc_t_turn_pairs4(_mm256_loadu_ps(Q[g] + 2 * p + 8 * h), c, ns, h));
            }
        }
    }
}

// kvc_t_decoder_dots in registers for G queries (gn of them given, the rest zero), as the VBMI
// decoder does it: q . R(base + steps) k = (R(base)' q) . R(steps) k, so the queries are turned
// back whenever the walk's base moves (every 16 keys along a run) and each row only by its
// steps' angles, which are read, not made. G is a constant of each caller: with a run-time
// count the accumulators went through memory (a row of 256 took 270 ns against 170).
KVC_T_INLINE void kvc_t_avx2_dots_g(const kvc_t_decoder * dec, kvc_t_rope_walk * w, const uint8_t * const * rows,
                                    const int64_t * pos, int32_t n, const float * const * q, int32_t gn, float * d, int32_t ld,
                                    int32_t turn, int32_t G) {
    const int32_t dd = dec->plan->d;
    float Q[KVC_T_AVX2_MAX_G][KVC_T_MAX_D], QT[KVC_T_AVX2_MAX_G][KVC_T_MAX_D];
    for (int32_t g = 0; g < G; ++g) {
        if (g < gn) {
            memcpy(Q[g], q[g], dd * sizeof(float));
        } else {
            memset(Q[g], 0, dd * sizeof(float));
        }
    }
    int64_t qbase = INT64_MIN;
    const float * tc = NULL;
    const float * ts = NULL;
    for (int32_t i0 = 0; i0 < n; i0 += 8) {
        const int32_t m = n - i0 < 8 ? n - i0 : 8;
        __m256 acc[KVC_T_AVX2_MAX_G][8];
        for (int32_t i = 0; i < 8; ++i) {
            __m256 a[KVC_T_AVX2_MAX_G];
            if (i < m) {
                if (turn != 0) {
                    kvc_t_walk_step(w, pos[i0 + i]);
                    if (w->base != qbase) {
                        qbase = w->base;
                        kvc_t_avx2_turn_back(w, turn, dd, Q, QT, G);
                    }
                    tc = w->steps->c[w->delta];
                    ts = w->steps->s[w->delta];
                }
                kvc_t_avx2_score(dec, rows[i0 + i], tc, ts, turn, turn != 0 ? QT : Q, G, a);
            }
            for (int32_t g = 0; g < G; ++g) {
                acc[g][i] = i < m ? a[g] : _mm256_setzero_ps();
            }
        }
        for (int32_t g = 0; g < gn; ++g) {
            float out[8];
            _mm256_storeu_ps(out, kvc_t_hsum8(acc[g]));
            memcpy(d + g * ld + i0, out, m * sizeof(float));
        }
    }
}

#define KVC_T_AVX2_DOTS(G, TURN)                                                                                               \
    static void kvc_t_avx2_dots_##G##_##TURN(const kvc_t_decoder * dec, kvc_t_rope_walk * w, const uint8_t * const * rows,    \
                                             const int64_t * pos, int32_t n, const float * const * q, int32_t gn, float * d,   \
                                             int32_t ld) {                                                                     \
        kvc_t_avx2_dots_g(dec, w, rows, pos, n, q, gn, d, ld, TURN, G);                                                        \
    }
KVC_T_AVX2_DOTS(1, 0) KVC_T_AVX2_DOTS(1, 1) KVC_T_AVX2_DOTS(1, 2)
KVC_T_AVX2_DOTS(2, 0) KVC_T_AVX2_DOTS(2, 1) KVC_T_AVX2_DOTS(2, 2)
KVC_T_AVX2_DOTS(4, 0) KVC_T_AVX2_DOTS(4, 1) KVC_T_AVX2_DOTS(4, 2)
KVC_T_AVX2_DOTS(8, 0) KVC_T_AVX2_DOTS(8, 1) KVC_T_AVX2_DOTS(8, 2)
#undef KVC_T_AVX2_DOTS

typedef void (*kvc_t_avx2_dots_t)(const kvc_t_decoder * dec, kvc_t_rope_walk * w, const uint8_t * const * rows, const int64_t * pos,
                                  int32_t n, const float * const * q, int32_t gn, float * d, int32_t ld);

// gn <= KVC_T_AVX2_MAX_G queries, as many in registers as the next count of 1, 2, 4 and 8 (a
// zero query costs less than a count the compiler does not know: 3 queries as 4 took 52 ns a
// row of 64 against 54 as 3)
static void kvc_t_avx2_dots(const kvc_t_decoder * dec, kvc_t_rope_walk * w, const uint8_t * const * rows, const int64_t * pos,
                            int32_t n, const float * const * q, int32_t gn, float * d, int32_t ld) {
    static const kvc_t_avx2_dots_t dots[4][3] = {
        { kvc_t_avx2_dots_1_0, kvc_t_avx2_dots_1_1, kvc_t_avx2_dots_1_2 },
        { kvc_t_avx2_dots_2_0, kvc_t_avx2_dots_2_1, kvc_t_avx2_dots_2_2 },
        { kvc_t_avx2_dots_4_0, kvc_t_avx2_dots_4_1, kvc_t_avx2_dots_4_2 },
        { kvc_t_avx2_dots_8_0, kvc_t_avx2_dots_8_1, kvc_t_avx2_dots_8_2 },
    };
    const int32_t k = gn <= 1 ? 0 : gn <= 2 ? 1 : gn <= 4 ? 2 : 3;
    dots[k][w ? dec->pairing : 0](dec, w, rows, pos, n, q, gn, d, ld);
}
#endif

void kvc_t_decoder_dots(const kvc_t_decoder * dec, kvc_t_rope_walk * w, const uint8_t * const * rows, const int64_t * pos,
                        int32_t n, const float * const * q, int32_t gn, float * d, int32_t ld) {
    const int32_t dd = dec->plan->d;
#if defined(KVC_T_VBMI)
    if (w ? w->fold : dec->identity) {
        kvc_t_vbmi_dots(dec, w, rows, pos, n, q, gn, d, ld);
        return;
    }
#elif defined(KVC_T_AVX2)
    if (gn <= KVC_T_AVX2_MAX_G && (w ? w->fold : dec->identity)) {
        kvc_t_avx2_dots(dec, w, rows, pos, n, q, gn, d, ld);
        return;
    }
#endif
#if defined(__AVX512F__)
    if (dd % 16 == 0) {
        __m512 acc[KVC_T_DOTS_MAX_Q][16];
        for (int32_t i0 = 0; i0 < n; i0 += 16) {
            const int32_t m = n - i0 < 16 ? n - i0 : 16;
            int32_t i = 0;
            for (; i < m; ++i) {
                kvc_t_row_dots16(dec, w, rows[i0 + i], pos ? pos[i0 + i] : 0, q, gn, acc, i);
            }
            for (; i < 16; ++i) {
                for (int32_t g = 0; g < gn; ++g) {
                    acc[g][i] = _mm512_setzero_ps();
                }
            }
            for (int32_t g = 0; g < gn; ++g) {
                _mm512_mask_storeu_ps(d + g * ld + i0, (__mmask16) ((1u << m) - 1), kvc_t_hsum16(acc[g]));
            }
        }
        return;
    }
#elif defined(KVC_T_AVX2)
    if (dd % 8 == 0) {
        // 8 rows' products a tile, summed across lanes for all 8 at once
        float y[KVC_T_MAX_D];
        for (int32_t i0 = 0; i0 < n; i0 += 8) {
            const int32_t m = n - i0 < 8 ? n - i0 : 8;
            __m256 acc[KVC_T_DOTS_MAX_Q][8];
            for (int32_t i = 0; i < 8; ++i) {
                if (i < m) {
                    if (w) {
                        kvc_t_walk_step(w, pos[i0 + i]);
                    }
                    kvc_t_row_to(dec, w, rows[i0 + i], y);
                }
                for (int32_t g = 0; g < gn; ++g) {
                    __m256 a = _mm256_setzero_ps();
                    for (int32_t c = 0; c < dd && i < m; c += 8) {
                        a = _mm256_fmadd_ps(_mm256_loadu_ps(y + c), _mm256_loadu_ps(q[g] + c), a);
                    }
                    acc[g][i] = a;
                }
            }
            for (int32_t g = 0; g < gn; ++g) {
                float out[8];
                _mm256_storeu_ps(out, kvc_t_hsum8(acc[g]));
                memcpy(d + g * ld + i0, out, m * sizeof(float));
            }
        }
        return;
    }
#endif
    float y[KVC_T_MAX_D];
    for (int32_t i = 0; i < n; ++i) {
        if (w) {
            kvc_t_walk_step(w, pos[i]);
        }
        kvc_t_row_to(dec, w, rows[i], y);
        for (int32_t g = 0; g < gn; ++g) {
            // 8 partial sums, so that the loop vectorizes without reordering a float sum
            float s[8] = { 0 };
            for (int32_t c = 0; c + 8 <= dd; c += 8) {
                for (int32_t l = 0; l < 8; ++l) {
                    s[l] += y[c + l] * q[g][c + l];
                }
            }
            for (int32_t c = dd / 8 * 8; c < dd; ++c) {
                s[0] += y[c] * q[g][c];
            }
            d[g * ld + i] = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
        }
    }
}
