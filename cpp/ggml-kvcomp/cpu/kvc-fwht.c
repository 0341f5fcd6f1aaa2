// The Walsh-Hadamard rotation upstream applies to Q, K and V around a quantized KV cache (a
// MUL_MAT hinted GGML_HINT_SRC0_IS_HADAMARD), with a row held in AVX-512 registers: every
// stage of butterflies, the first four inside each register too, where upstream's first
// stages run scalar. The stages are upstream's, in its order, so the floats are its floats
// (test-kvc-ops compares them bit for bit). Upstream's rotation is 12% of a 512-token prompt
// over a kvc4 cache on the KV-bound synthetic model (perf; AMD EPYC Zen 4, 2 threads).

#include "kvc-cpu.h"
#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"

#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define KVC_FWHT_MAX_REGS 16 // rows of up to 256 values

// One butterfly stage of span len < 16 inside a register: lane i pairs with lane i ^ len;
// the lower of the two takes u + v, the upper u - v, u the lower's value.
static inline __m512 kvc_fwht_in_reg(__m512 x, __m512i partner, __mmask16 upper) {
    const __m512 p = _mm512_permutexvar_ps(partner, x);
    const __m512 s = _mm512_add_ps(x, p);
    const __m512 d = _mm512_sub_ps(p, x);
    return _mm512_mask_blend_ps(upper, s, d);
}

static void kvc_fwht_row(const void * src, bool src_f16, float * dst, int64_t n, float scale) {
    const int     nr = (int) (n / 16);
    const __m512  vs = _mm512_set1_ps(scale);
    __m512        r[KVC_FWHT_MAX_REGS];
    for (int i = 0; i < nr; ++i) {
        const __m512 x = src_f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) ((const ggml_fp16_t *) src + 16 * i)))
                                 : _mm512_loadu_ps((const float *) src + 16 * i);
        r[i] = _mm512_mul_ps(x, vs);
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int len = 1; len < 16; len <<= 1) {
        const __m512i   partner = _mm512_xor_si512(lane, _mm512_set1_epi32(len));
        const __mmask16 upper   = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(len));
        for (int i = 0; i < nr; ++i) {
            r[i] = kvc_fwht_in_reg(r[i], partner, upper);
        }
    }
    for (int len = 1; len < nr; len <<= 1) {
        for (int i = 0; i < nr; i += 2 * len) {
            for (int j = i; j < i + len; ++j) {
                const __m512 u = r[j];
                const __m512 v = r[j + len];
                r[j]       = _mm512_add_ps(u, v);
                r[j + len] = _mm512_sub_ps(u, v);
            }
        }
    }
    for (int i = 0; i < nr; ++i) {
        _mm512_storeu_ps(dst + 16 * i, r[i]);
    }
}
#endif

bool ggml_kvc_cpu_fwht(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
#if defined(__AVX512F__)
    const struct ggml_tensor * src1 = dst->src[1];
    const int64_t n = src1->ne[0];
    if ((src1->type != GGML_TYPE_F32 && src1->type != GGML_TYPE_F16) || dst->type != GGML_TYPE_F32 || n < 16 ||
        n > 16 * KVC_FWHT_MAX_REGS || (n & (n - 1)) != 0 || src1->nb[0] != (size_t) ggml_type_size(src1->type) ||
        dst->nb[0] != sizeof(float)) {
        return false;
    }
    const int64_t nr    = src1->ne[1] * src1->ne[2] * src1->ne[3];
    const int64_t per   = (nr + params->nth - 1) / params->nth;
    const int64_t r0    = params->ith * per;
    const int64_t r1    = r0 + per < nr ? r0 + per : nr;
    const float   scale = 1.0f / sqrtf((float) n);
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t i3 = r / (src1->ne[1] * src1->ne[2]);
        const int64_t i2 = (r - i3 * src1->ne[1] * src1->ne[2]) / src1->ne[1];
        const int64_t i1 = r - i3 * src1->ne[1] * src1->ne[2] - i2 * src1->ne[1];
        kvc_fwht_row((const char *) src1->data + i1 * src1->nb[1] + i2 * src1->nb[2] + i3 * src1->nb[3],
                     src1->type == GGML_TYPE_F16,
                     (float *) ((char *) dst->data + i1 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]), n, scale);
    }
    return true;
#else
    (void) params;
    (void) dst;
    return false;
#endif
}
