#pragma once

// AVX2 building blocks of the kvc CPU kernels (kvc-cpu.c); KVC_AVX2 also tells the attention
// kernels (kvc-fattn.cpp) whether they have AVX2. Internal to the CPU backend.

#include "kvc-common.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"

#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVC_AVX2 1
#endif

#if defined(KVC_AVX2)

static inline float kvc_hsum_f32_8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// Signed int8 x int8 products summed in groups of four: lanes 0-3 cover values 0..15,
// lanes 4-7 values 16..31, given ax = |x|. The levels are within +-127, so maddubs cannot
// saturate and VNNI's one instruction gives the same sums.
static inline __m256i kvc_dot_i8_groups_abs(__m256i ax, __m256i x, __m256i y) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, _mm256_sign_epi8(y, x));
#else
    const __m256i p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(y, x));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
#endif
}

static inline __m256 kvc_sub_scales(float d0, float d1, float dy) {
    return _mm256_set_m128(_mm_set1_ps(d1 * dy), _mm_set1_ps(d0 * dy));
}

// Two-bit fields of 8 bytes spread to 32 bytes: byte 8*g + j = (q[j] >> 2*g) & 3.
static inline __m256i kvc_unpack2_avx2(const uint8_t * q) {
    uint64_t u;
    memcpy(&u, q, sizeof(u));
    const __m256i v = _mm256_srlv_epi64(_mm256_set1_epi64x((long long) u), _mm256_set_epi64x(6, 4, 2, 0));
    return _mm256_and_si256(v, _mm256_set1_epi8(3));
}

// Bit i of 32 bits spread to byte i as 0 or `value`.
static inline __m256i kvc_unpack_bit_avx2(const uint8_t * q, char value) {
    uint32_t u;
    memcpy(&u, q, sizeof(u));
    const __m256i idx  = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i bits = _mm256_set1_epi64x((long long) 0x8040201008040201ULL);
    const __m256i b    = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int) u), idx), bits);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, bits), _mm256_set1_epi8(value));
}

// The levels as shuffle tables (hi: levels 16-31, for kvc5's 32), loaded straight from the
// array: a copy through the stack (an 8-byte store read back as 16 bytes) cannot be
// forwarded and stalled every row's conversion, a third of kvc3's in a decode step.
typedef struct {
    __m256i lo;
    __m256i hi;
} kvc_lut;

static inline kvc_lut kvc_lut_avx2(const int8_t * levels, int n) {
    kvc_lut lut;
    lut.hi = n == 32 ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) (levels + 16))) : _mm256_setzero_si256();
    __m128i t;
    if (n >= 16) {
        t = _mm_loadu_si128((const __m128i *) levels);
    } else if (n == 8) {
        t = _mm_loadl_epi64((const __m128i *) levels);
    } else {
        int32_t w;
        memcpy(&w, levels, sizeof(w));
        t = _mm_cvtsi32_si128(w);
    }
    lut.lo = _mm256_broadcastsi128_si256(t);
    return lut;
}

// The level bytes of 32 codes of a type with n levels (a constant where it is called).
static inline __m256i kvc_lookup_avx2(kvc_lut lut, __m256i codes, int n) {
    const __m256i lo = _mm256_shuffle_epi8(lut.lo, codes);
    if (n <= 16) {
        return lo;
    }
    // bit 4 of each code moved to its byte's top bit, which blendv reads
    return _mm256_blendv_epi8(lo, _mm256_shuffle_epi8(lut.hi, codes), _mm256_slli_epi16(codes, 3));
}

// Level indices of one block, byte i = code of value i.
static inline __m256i kvc_unpack4_avx2(const uint8_t * qs) {
    const __m128i q  = _mm_loadu_si128((const __m128i *) qs);
    const __m128i m4 = _mm_set1_epi8(0xf);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

static inline __m256i kvc4_codes_avx2(const block_kvc4 * b) {
    return kvc_unpack4_avx2(b->qs);
}

static inline __m256i kvc5_codes_avx2(const block_kvc5 * b) {
    return _mm256_or_si256(kvc_unpack4_avx2(b->qs), kvc_unpack_bit_avx2(b->qh, 16));
}

static inline __m256i kvc3_codes_avx2(const block_kvc3 * b) {
    return _mm256_or_si256(kvc_unpack2_avx2(b->ql), kvc_unpack_bit_avx2(b->qh, 4));
}

static inline __m256i kvc2_codes_avx2(const block_kvc2 * b) {
    return kvc_unpack2_avx2(b->qs);
}

#endif
