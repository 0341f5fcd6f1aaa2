// CPU kernels of the kvc types. The scalar versions are the reference; the AVX2 versions
// must match them to float rounding (cpp/tests/test-kvc-quants.cpp checks it).

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "kvc-cpu.h"
#include "ggml-cpu-impl.h"
#include "quants.h"
#include "simd-mappings.h"
#include "vec.h"

#include <assert.h>
#include <math.h>
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
    if (n == 16) {
        return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) levels));
    }
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

// Row dequantization, the same products as the scalar reference (level times step in float),
// so the two agree bit for bit. Attention's V rows and the buffer's casts of the cache go
// through here.
static inline void kvc_store_levels_avx2(float * y, __m256i v, float d0, float d1) {
    const __m128i lo = _mm256_castsi256_si128(v);
    const __m128i hi = _mm256_extracti128_si256(v, 1);
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
    const __m256i lut = kvc_lut_avx2(kvalues_##name, n_levels);                                       \
    for (int64_t ib = 0; ib < k / QK_KVC; ++ib) {                                                     \
        kvc_store_levels_avx2(y + ib * QK_KVC, _mm256_shuffle_epi8(lut, name##_codes_avx2(&x[ib])),   \
                              kvc_e8_to_fp32(x[ib].e[0]), kvc_e8_to_fp32(x[ib].e[1]));                \
    }                                                                                                 \
}

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

// One K row decoded for several dot products: per block, the int8 levels and the two
// sub-block steps laid out as kvc_dot_i8_groups' lanes.
typedef void (*kvc_row_levels_t)(const void * GGML_RESTRICT row, int64_t n_blocks, __m256i * lv, __m256 * d);

#define KVC_ROW_LEVELS_AVX2(name, n_levels)                                                           \
static void kvc_row_levels_##name(const void * GGML_RESTRICT row, int64_t n_blocks, __m256i * lv, __m256 * d) { \
    const block_##name * GGML_RESTRICT x = (const block_##name *) row;                                \
    const __m256i lut = kvc_lut_avx2(kvalues_##name, n_levels);                                       \
    for (int64_t ib = 0; ib < n_blocks; ++ib) {                                                       \
        lv[ib] = _mm256_shuffle_epi8(lut, name##_codes_avx2(&x[ib]));                                 \
        d[ib]  = kvc_sub_scales(kvc_e8_to_fp32(x[ib].e[0]), kvc_e8_to_fp32(x[ib].e[1]), 1.0f);        \
    }                                                                                                 \
}

KVC_ROW_LEVELS_AVX2(kvc4, 16)
KVC_ROW_LEVELS_AVX2(kvc3, 8)
KVC_ROW_LEVELS_AVX2(kvc2, 4)

static void kvc_row_levels_kvc8(const void * GGML_RESTRICT row, int64_t n_blocks, __m256i * lv, __m256 * d) {
    const block_kvc8 * GGML_RESTRICT x = (const block_kvc8 *) row;
    for (int64_t ib = 0; ib < n_blocks; ++ib) {
        lv[ib] = _mm256_loadu_si256((const __m256i *) x[ib].qs);
        d[ib]  = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].d));
    }
}

static kvc_row_levels_t kvc_get_row_levels(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_KVC8: return kvc_row_levels_kvc8;
        case GGML_TYPE_KVC4: return kvc_row_levels_kvc4;
        case GGML_TYPE_KVC3: return kvc_row_levels_kvc3;
        case GGML_TYPE_KVC2: return kvc_row_levels_kvc2;
        default:             return NULL;
    }
}

// Keys per online-softmax step: the running maximum and the accumulators are rescaled once
// per tile instead of once per key, and the exponentials are taken a tile at a time.
#define KVC_FA_TILE      32
#define KVC_FA_MAX_GROUP 16
#define KVC_FA_MAX_D     256

bool ggml_kvc_cpu_fa_decode_chunk(const struct ggml_tensor * dst, int64_t ic0, int64_t ic1,
                                  float * partials, int64_t partial_stride) {
    const struct ggml_tensor * q     = dst->src[0];
    const struct ggml_tensor * k     = dst->src[1];
    const struct ggml_tensor * v     = dst->src[2];
    const struct ggml_tensor * mask  = dst->src[3];
    const struct ggml_tensor * sinks = dst->src[4];

    const kvc_row_levels_t k_levels   = kvc_get_row_levels(k->type);
    const ggml_to_float_t  v_to_float = ggml_kvc_cpu_get_to_float(v->type);

    float scale, max_bias, softcap;
    memcpy(&scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap,  (const float *) dst->op_params + 2, sizeof(float));

    const int64_t DK = k->ne[0];
    const int64_t DV = v->ne[0];
    const int64_t n_head    = q->ne[2];
    const int64_t n_head_kv = k->ne[2];
    if (!ggml_kvc_cpu_fa_split_kv(k->type, v->type) || max_bias != 0.0f ||
        q->type != GGML_TYPE_F32 || q->ne[1] != 1 || q->ne[3] != 1 || k->ne[3] != 1 || v->ne[3] != 1 ||
        v->ne[2] != n_head_kv || n_head % n_head_kv != 0 || n_head / n_head_kv > KVC_FA_MAX_GROUP ||
        DK > KVC_FA_MAX_D || DV > KVC_FA_MAX_D || (mask && mask->type != GGML_TYPE_F16)) {
        return false;
    }
    if (softcap != 0.0f) {
        scale /= softcap;
    }

    const int64_t G   = n_head / n_head_kv;
    const int64_t nbk = DK / QK_KVC;
    // most models give every head the same mask row
    const bool shared_mask = !mask || mask->ne[2] == 1;

    block_q8_0 qy[KVC_FA_MAX_GROUP][KVC_FA_MAX_D / QK8_0];
    float      qd[KVC_FA_MAX_GROUP][KVC_FA_MAX_D / QK8_0]; // qy's block scales as float
    float      acc[KVC_FA_MAX_GROUP][KVC_FA_MAX_D];
    float      sc[KVC_FA_MAX_GROUP][KVC_FA_TILE];
    float      M[KVC_FA_MAX_GROUP], S[KVC_FA_MAX_GROUP];
    float      vt[KVC_FA_TILE][KVC_FA_MAX_D];
    __m256i    lv[KVC_FA_MAX_D / QK_KVC];
    __m256     kd[KVC_FA_MAX_D / QK_KVC];

    for (int64_t hk = 0; hk < n_head_kv; ++hk) {
        const ggml_fp16_t * mp[KVC_FA_MAX_GROUP];
        for (int64_t g = 0; g < G; ++g) {
            const int64_t h = hk * G + g;
            quantize_row_q8_0((const float *) ((const char *) q->data + h * q->nb[2]), qy[g], DK);
            for (int64_t ib = 0; ib < nbk; ++ib) {
                qd[g][ib] = GGML_CPU_FP16_TO_FP32(qy[g][ib].d);
            }
            mp[g] = mask ? (const ggml_fp16_t *) ((const char *) mask->data + (h % mask->ne[2]) * mask->nb[2]) : NULL;
            memset(acc[g], 0, DV * sizeof(float));
            M[g] = -INFINITY;
            S[g] = 0.0f;
        }

        for (int64_t t0 = ic0; t0 < ic1; t0 += KVC_FA_TILE) {
            const int n = (int) MIN(KVC_FA_TILE, ic1 - t0);

            for (int j = 0; j < n; ++j) {
                const int64_t ic = t0 + j;
                bool any = false;
                if (shared_mask) {
                    const float mv = mp[0] ? GGML_CPU_FP16_TO_FP32(mp[0][ic]) : 0.0f;
                    for (int64_t g = 0; g < G; ++g) {
                        sc[g][j] = mv;
                    }
                    any = mv != -INFINITY;
                } else {
                    for (int64_t g = 0; g < G; ++g) {
                        sc[g][j] = GGML_CPU_FP16_TO_FP32(mp[g][ic]);
                        any |= sc[g][j] != -INFINITY;
                    }
                }
                if (!any) {
                    continue;
                }
                k_levels((const char *) k->data + ic * k->nb[1] + hk * k->nb[2], nbk, lv, kd);
                for (int64_t g = 0; g < G; ++g) {
                    if (sc[g][j] == -INFINITY) {
                        continue;
                    }
                    __m256 a = _mm256_setzero_ps();
                    for (int64_t ib = 0; ib < nbk; ++ib) {
                        const __m256i p = kvc_dot_i8_groups(lv[ib], _mm256_loadu_si256((const __m256i *) qy[g][ib].qs));
                        const __m256  d = _mm256_mul_ps(kd[ib], _mm256_set1_ps(qd[g][ib]));
                        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, a);
                    }
                    float s = kvc_hsum_f32_8(a) * scale;
                    if (softcap != 0.0f) {
                        s = softcap * tanhf(s);
                    }
                    sc[g][j] += s;
                }
            }

            for (int64_t g = 0; g < G; ++g) {
                float m = -INFINITY;
                for (int j = 0; j < n; ++j) {
                    m = MAX(m, sc[g][j]);
                }
                if (m == -INFINITY) {
                    memset(sc[g], 0, n * sizeof(float));
                    continue;
                }
                if (m > M[g]) {
                    const float ms = expf(M[g] - m);
                    ggml_vec_scale_f32((int) DV, acc[g], ms);
                    S[g] *= ms;
                    M[g] = m;
                }
                S[g] += (float) ggml_vec_soft_max_f32(n, sc[g], sc[g], M[g]);
            }

            // the tile's V rows are decoded once; each head then accumulates them with its
            // output slice held in registers
            int live[KVC_FA_TILE];
            int n_live = 0;
            for (int j = 0; j < n; ++j) {
                bool any = false;
                for (int64_t g = 0; g < G; ++g) {
                    any |= sc[g][j] != 0.0f;
                }
                if (any) {
                    v_to_float((const char *) v->data + (t0 + j) * v->nb[1] + hk * v->nb[2], vt[n_live], DV);
                    live[n_live++] = j;
                }
            }
            for (int64_t g = 0; g < G; ++g) {
                for (int64_t d0 = 0; d0 < DV; d0 += 32) {
                    __m256 a0 = _mm256_loadu_ps(acc[g] + d0 +  0);
                    __m256 a1 = _mm256_loadu_ps(acc[g] + d0 +  8);
                    __m256 a2 = _mm256_loadu_ps(acc[g] + d0 + 16);
                    __m256 a3 = _mm256_loadu_ps(acc[g] + d0 + 24);
                    for (int i = 0; i < n_live; ++i) {
                        const __m256  w  = _mm256_set1_ps(sc[g][live[i]]);
                        const float * vr = vt[i] + d0;
                        a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr +  0), a0);
                        a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr +  8), a1);
                        a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 16), a2);
                        a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 24), a3);
                    }
                    _mm256_storeu_ps(acc[g] + d0 +  0, a0);
                    _mm256_storeu_ps(acc[g] + d0 +  8, a1);
                    _mm256_storeu_ps(acc[g] + d0 + 16, a2);
                    _mm256_storeu_ps(acc[g] + d0 + 24, a3);
                }
            }
        }

        for (int64_t g = 0; g < G; ++g) {
            const int64_t h = hk * G + g;
            if (sinks && ic0 == 0) {
                const float s = ((const float *) sinks->data)[h];
                if (s > M[g]) {
                    const float ms = expf(M[g] - s);
                    ggml_vec_scale_f32((int) DV, acc[g], ms);
                    S[g] = S[g] * ms + 1.0f;
                    M[g] = s;
                } else {
                    S[g] += expf(s - M[g]);
                }
            }
            float * out = partials + h * partial_stride;
            out[0] = M[g];
            out[1] = S[g];
            memcpy(out + 2, acc[g], DV * sizeof(float));
        }
    }
    return true;
}

ggml_to_float_t ggml_kvc_cpu_get_to_float(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_KVC8: return kvc_to_float_kvc8_avx2;
        case GGML_TYPE_KVC4: return kvc_to_float_kvc4_avx2;
        case GGML_TYPE_KVC3: return kvc_to_float_kvc3_avx2;
        case GGML_TYPE_KVC2: return kvc_to_float_kvc2_avx2;
        default:             return ggml_get_type_traits(type)->to_float;
    }
}

#else

ggml_to_float_t ggml_kvc_cpu_get_to_float(enum ggml_type type) {
    return ggml_get_type_traits(type)->to_float;
}

bool ggml_kvc_cpu_fa_decode_chunk(const struct ggml_tensor * dst, int64_t ic0, int64_t ic1,
                                  float * partials, int64_t partial_stride) {
    GGML_UNUSED(dst); GGML_UNUSED(ic0); GGML_UNUSED(ic1); GGML_UNUSED(partials); GGML_UNUSED(partial_stride);
    return false;
}

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

bool ggml_kvc_cpu_fa_split_kv(enum ggml_type type_k, enum ggml_type type_v) {
    return type_k >= GGML_KVCOMP_TYPE_FIRST && type_k <= GGML_KVCOMP_TYPE_LAST &&
           type_v >= GGML_KVCOMP_TYPE_FIRST && type_v <= GGML_KVCOMP_TYPE_LAST;
}
