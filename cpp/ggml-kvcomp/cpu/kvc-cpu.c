// CPU kernels of the kvc types. The scalar versions are the reference; the AVX2 versions
// must match them to float rounding (cpp/tests/test-kvc-quants.cpp checks it).

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "kvc-cpu.h"
#include "kvc-quantize-cpu.h"
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

void quantize_row_kvc5(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC5, x, y, k, kvc_cpu_quantize_sub());
}

void quantize_row_kvc4(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC4, x, y, k, kvc_cpu_quantize_sub());
}

void quantize_row_kvc3(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC3, x, y, k, kvc_cpu_quantize_sub());
}

void quantize_row_kvc2(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC2, x, y, k, kvc_cpu_quantize_sub());
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
