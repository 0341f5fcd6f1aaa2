// CPU kernels of the kvc types. The scalar versions are the reference; the AVX2 versions
// must match them to float rounding (cpp/tests/test-kvc-quants.cpp checks it).

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "kvc-cpu.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"

#include <assert.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVC_AVX2 1
#endif

void quantize_row_kvc8(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_kvc8_ref(x, (block_kvc8 *) y, k);
}

void quantize_row_kvc4(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_kvc4_ref(x, (block_kvc4 *) y, k);
}

void quantize_row_kvc3(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_kvc3_ref(x, (block_kvc3 *) y, k);
}

void quantize_row_kvc2(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_kvc2_ref(x, (block_kvc2 *) y, k);
}

// Shared head of every vec_dot: one row pair, blocks aligned with q8_0's.
#define KVC_VEC_DOT_PROLOGUE(name)                                              \
    assert(n % QK_KVC == 0);                                                    \
    assert(nrc == 1);                                                           \
    GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by); GGML_UNUSED(nrc);        \
    const block_##name * GGML_RESTRICT x = (const block_##name *) vx;           \
    const block_q8_0   * GGML_RESTRICT y = (const block_q8_0 *) vy

// Scalar reference. The low-bit types decode each block into int8 level values first, so
// all four share one integer dot product with two sub-block steps.

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

#if defined(KVC_AVX2)

static inline float kvc_hsum_f32_8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// Signed int8 x int8 products summed in groups of four: lanes 0-3 cover values 0..15,
// lanes 4-7 values 16..31. The levels are within +-127 so maddubs cannot saturate.
static inline __m256i kvc_dot_i8_groups(__m256i x, __m256i y) {
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
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

// Bit i of 32 bits spread to byte i as 0 or 4.
static inline __m256i kvc_unpack_bit2_avx2(const uint8_t * q) {
    uint32_t u;
    memcpy(&u, q, sizeof(u));
    const __m256i idx  = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i bits = _mm256_set1_epi64x((long long) 0x8040201008040201ULL);
    const __m256i b    = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int) u), idx), bits);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, bits), _mm256_set1_epi8(4));
}

static inline __m256i kvc_lut_avx2(const int8_t * levels, int n) {
    int8_t t[16] = { 0 };
    memcpy(t, levels, n);
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) t));
}

// Level indices of one block, byte i = code of value i.
static inline __m256i kvc4_codes_avx2(const block_kvc4 * b) {
    const __m128i q  = _mm_loadu_si128((const __m128i *) b->qs);
    const __m128i m4 = _mm_set1_epi8(0xf);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

static inline __m256i kvc3_codes_avx2(const block_kvc3 * b) {
    return _mm256_or_si256(kvc_unpack2_avx2(b->ql), kvc_unpack_bit2_avx2(b->qh));
}

static inline __m256i kvc2_codes_avx2(const block_kvc2 * b) {
    return kvc_unpack2_avx2(b->qs);
}

#define KVC_VEC_DOT_AVX2(name, n_levels)                                                              \
void ggml_vec_dot_##name##_q8_0(int n, float * GGML_RESTRICT s, size_t bs,                           \
        const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) { \
    KVC_VEC_DOT_PROLOGUE(name);                                                                       \
    const __m256i lut = kvc_lut_avx2(kvalues_##name, n_levels);                                       \
    __m256 acc = _mm256_setzero_ps();                                                                 \
    for (int ib = 0; ib < n / QK_KVC; ++ib) {                                                         \
        const __m256i v = _mm256_shuffle_epi8(lut, name##_codes_avx2(&x[ib]));                        \
        const __m256i p = kvc_dot_i8_groups(v, _mm256_loadu_si256((const __m256i *) y[ib].qs));       \
        const __m256  d = kvc_sub_scales(kvc_e8_to_fp32(x[ib].e[0]), kvc_e8_to_fp32(x[ib].e[1]),      \
                                         GGML_CPU_FP16_TO_FP32(y[ib].d));                             \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc);                                         \
    }                                                                                                 \
    *s = kvc_hsum_f32_8(acc);                                                                         \
}

KVC_VEC_DOT_AVX2(kvc4, 16)
KVC_VEC_DOT_AVX2(kvc3, 8)
KVC_VEC_DOT_AVX2(kvc2, 4)

void ggml_vec_dot_kvc8_q8_0(int n, float * GGML_RESTRICT s, size_t bs,
        const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {
    KVC_VEC_DOT_PROLOGUE(kvc8);

    __m256 acc = _mm256_setzero_ps();
    for (int ib = 0; ib < n / QK_KVC; ++ib) {
        const __m256i p = kvc_dot_i8_groups(_mm256_loadu_si256((const __m256i *) x[ib].qs),
                                            _mm256_loadu_si256((const __m256i *) y[ib].qs));
        const __m256  d = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].d) * GGML_CPU_FP16_TO_FP32(y[ib].d));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc);
    }
    *s = kvc_hsum_f32_8(acc);
}

#else

#define KVC_VEC_DOT_FALLBACK(name)                                                                    \
void ggml_vec_dot_##name##_q8_0(int n, float * GGML_RESTRICT s, size_t bs,                           \
        const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) { \
    ggml_vec_dot_##name##_q8_0_generic(n, s, bs, vx, bx, vy, by, nrc);                                \
}

KVC_VEC_DOT_FALLBACK(kvc8)
KVC_VEC_DOT_FALLBACK(kvc4)
KVC_VEC_DOT_FALLBACK(kvc3)
KVC_VEC_DOT_FALLBACK(kvc2)

#endif
