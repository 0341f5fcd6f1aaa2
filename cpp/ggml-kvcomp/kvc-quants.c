// Reference quantization of the kvc types (scalar, backend independent).

#include "kvc-common.h"
#include "ggml-impl.h"

#include <math.h>
#include <string.h>

const int8_t kvalues_kvc5[32] = KVC_LEVELS_KVC5;
const int8_t kvalues_kvc4[16] = KVC_LEVELS_KVC4;
const int8_t kvalues_kvc3[8]  = KVC_LEVELS_KVC3;
const int8_t kvalues_kvc2[4]  = KVC_LEVELS_KVC2;

static void kvc_codebook_init(kvc_codebook * cb, const int8_t * levels, int n) {
    cb->levels    = levels;
    cb->n         = n;
    cb->zero_code = n / 2;
    for (int i = 0; i + 1 < n; ++i) {
        cb->mid[i] = 0.5f * (levels[i] + levels[i + 1]);
    }
    // one pass over the sorted thresholds (a row's quantization makes its codebook): the
    // thresholds in bucket b are those counted below b + 1 and not below b
    int i = 0;
    for (int b = 0; b < KVC_BUCKETS; ++b) {
        const float lo = b == 0 ? -INFINITY : KVC_BUCKET_W * (float) (b - KVC_BUCKETS / 2);
        while (i + 1 < n && cb->mid[i] < lo) {
            ++i;
        }
        cb->below[b] = i;
    }
    cb->bucketed = n - 1 - cb->below[KVC_BUCKETS - 1] <= 1;
    for (int b = 0; b + 1 < KVC_BUCKETS; ++b) {
        cb->bucketed &= cb->below[b + 1] - cb->below[b] <= 1;
    }
}

// Round to nearest (ties to even) for |v| < 2^22 without a libm call: the base library is
// built for baseline x86-64, where roundf is not inlined.
static inline int kvc_nearest_int(float v) {
    union { float f; int32_t i; } u = { v + 12582912.0f };
    return (u.i & 0x007fffff) - 0x00400000;
}

static inline int kvc_clamp127(int q) {
    return q < -127 ? -127 : q > 127 ? 127 : q;
}

// Non-finite inputs are quantized as zero so they cannot poison the block's step or
// any other block; they come back as the level nearest zero (exactly 0 for kvc8).
static inline float kvc_finite_or_zero(float v) {
    return isfinite(v) ? v : 0.0f;
}

// v = x with non-finite values zeroed; returns the largest magnitude. v is finite, so the
// comparison needs none of fmaxf's NaN rule, which cost a call per value.
static inline float kvc_finite_amax(const float * x, float * v, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) {
        v[i] = kvc_finite_or_zero(x[i]);
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

// The reference kvc_sub_errors_t. Products and sums are rounded one at a time (no fused
// multiply-add), the rounding the SIMD versions reproduce.
KVC_NO_FP_CONTRACT
static void kvc_sub_errors_ref(const kvc_codebook * cb, const float * v, int n, const float * d, const float * id,
                               int n_cand, float * err) {
    KVC_NO_FP_CONTRACT_BODY
    for (int c = 0; c < n_cand; ++c) {
        float e = 0.0f;
        for (int i = 0; i < n; ++i) {
            const float diff = v[i] - d[c] * cb->levels[kvc_nearest(cb, v[i] * id[c])];
            e += diff * diff;
        }
        err[c] = e;
    }
}

// Chooses the step of one sub-block by minimizing the squared error over a window of
// 8-bit step codes, and writes the codes of the chosen step.
uint8_t kvc_quantize_sub_search(const kvc_codebook * cb, const float * x, int n, uint8_t * codes, kvc_sub_errors_t errors) {
    float v[QK_KVC_SUB];
    const float amax = kvc_finite_amax(x, v, n);
    if (amax == 0.0f) {
        memset(codes, cb->zero_code, n);
        return 0;
    }

    int   cand[KVC_SEARCH_UP + KVC_SEARCH_DOWN + 1];
    float d[KVC_SEARCH_UP + KVC_SEARCH_DOWN + 1];
    float id[KVC_SEARCH_UP + KVC_SEARCH_DOWN + 1];
    float err[KVC_SEARCH_UP + KVC_SEARCH_DOWN + 1];
    int e_max;
    const int n_cand = kvc_step_candidates(amax, cb->levels[cb->n - 1], &e_max, cand);
    kvc_step_values(cand, n_cand, d, id);
    errors(cb, v, n, d, id, n_cand, err);

    const int best_e = kvc_best_step(err, cand, n_cand, e_max);

    const float id_best = 1.0f / kvc_e8_to_fp32((uint8_t) best_e);
    for (int i = 0; i < n; ++i) {
        codes[i] = (uint8_t) kvc_nearest(cb, v[i] * id_best);
    }
    return (uint8_t) best_e;
}

uint8_t kvc_quantize_sub_ref(const kvc_codebook * cb, const float * x, int n, uint8_t * codes) {
    return kvc_quantize_sub_search(cb, x, n, codes, kvc_sub_errors_ref);
}

// Packs the low two bits of 32 codes: value 8*g + j goes to byte j, bits 2*g.
static void kvc_pack2(const uint8_t codes[QK_KVC], uint8_t q[QK_KVC / 4]) {
    for (int j = 0; j < QK_KVC / 4; ++j) {
        q[j] = (uint8_t) ((codes[j] & 3) | (codes[j + 8] & 3) << 2 | (codes[j + 16] & 3) << 4 | (codes[j + 24] & 3) << 6);
    }
}

void quantize_row_kvc8_ref(const float * GGML_RESTRICT x, block_kvc8 * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_KVC == 0);
    const int64_t nb = k / QK_KVC;

    for (int64_t b = 0; b < nb; ++b) {
        float v[QK_KVC];
        const float amax = kvc_finite_amax(x + b * QK_KVC, v, QK_KVC);

        // The candidates include q8_0's absmax step, so the error is never above q8_0's;
        // the search only pays off on blocks with an isolated large value.
        uint16_t best_d   = GGML_FP32_TO_FP16(amax / 127.0f);
        float    best_err = INFINITY;
        for (int s = 0; s < 8 && amax > 0.0f; ++s) {
            const uint16_t dh = GGML_FP32_TO_FP16(amax / 127.0f * (1.0f - 0.03f * s));
            const float    d  = GGML_FP16_TO_FP32(dh);
            if (d == 0.0f) {
                continue;
            }
            const float id = 1.0f / d;
            float err = 0.0f;
            for (int i = 0; i < QK_KVC; ++i) {
                const float q    = (float) kvc_clamp127(kvc_nearest_int(v[i] * id));
                const float diff = v[i] - d * q;
                err += diff * diff;
            }
            if (err < best_err) {
                best_err = err;
                best_d   = dh;
            }
        }

        const float d  = GGML_FP16_TO_FP32(best_d);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = best_d;
        for (int i = 0; i < QK_KVC; ++i) {
            y[b].qs[i] = (int8_t) kvc_clamp127(kvc_nearest_int(v[i] * id));
        }
    }
}

// Packs the codes of one block into its type's layout (the steps are written by the caller).
typedef void (*kvc_pack_t)(const uint8_t codes[QK_KVC], void * block);

// Packs the low four bits of 32 codes: value j in the low nibble of byte j, value j + 16 in
// its high nibble.
static void kvc_pack4(const uint8_t codes[QK_KVC], uint8_t q[QK_KVC / 2]) {
    for (int j = 0; j < QK_KVC / 2; ++j) {
        q[j] = (uint8_t) ((codes[j] & 0xf) | (codes[j + QK_KVC / 2] & 0xf) << 4);
    }
}

// Packs bit `bit` of 32 codes: value i's in byte i / 8, at bit i % 8.
static void kvc_pack_bit(const uint8_t codes[QK_KVC], int bit, uint8_t q[QK_KVC / 8]) {
    memset(q, 0, QK_KVC / 8);
    for (int i = 0; i < QK_KVC; ++i) {
        q[i / 8] |= (uint8_t) (((codes[i] >> bit) & 1) << (i % 8));
    }
}

static void kvc_pack_kvc5(const uint8_t codes[QK_KVC], void * block) {
    block_kvc5 * b = (block_kvc5 *) block;
    kvc_pack4(codes, b->qs);
    kvc_pack_bit(codes, 4, b->qh);
}

static void kvc_pack_kvc4(const uint8_t codes[QK_KVC], void * block) {
    kvc_pack4(codes, ((block_kvc4 *) block)->qs);
}

static void kvc_pack_kvc3(const uint8_t codes[QK_KVC], void * block) {
    block_kvc3 * b = (block_kvc3 *) block;
    kvc_pack2(codes, b->ql);
    kvc_pack_bit(codes, 2, b->qh);
}

static void kvc_pack_kvc2(const uint8_t codes[QK_KVC], void * block) {
    kvc_pack2(codes, ((block_kvc2 *) block)->qs);
}

// Every low-bit block starts with its two step codes, followed by the packed codes.
void kvc_quantize_row_lowbit(enum ggml_type type, const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k,
                             kvc_quantize_sub_t quantize_sub) {
    assert(k % QK_KVC == 0);
    kvc_codebook cb;
    size_t       block_size;
    kvc_pack_t   pack;
    switch (type) {
        case GGML_TYPE_KVC5: kvc_codebook_init(&cb, kvalues_kvc5, 32); block_size = sizeof(block_kvc5); pack = kvc_pack_kvc5; break;
        case GGML_TYPE_KVC4: kvc_codebook_init(&cb, kvalues_kvc4, 16); block_size = sizeof(block_kvc4); pack = kvc_pack_kvc4; break;
        case GGML_TYPE_KVC3: kvc_codebook_init(&cb, kvalues_kvc3,  8); block_size = sizeof(block_kvc3); pack = kvc_pack_kvc3; break;
        case GGML_TYPE_KVC2: kvc_codebook_init(&cb, kvalues_kvc2,  4); block_size = sizeof(block_kvc2); pack = kvc_pack_kvc2; break;
        default:             GGML_ABORT("kvc_quantize_row_lowbit: %s is not a low-bit kvc type", ggml_type_name(type));
    }

    for (int64_t b = 0; b < k / QK_KVC; ++b) {
        uint8_t * block = (uint8_t *) y + b * block_size;
        uint8_t   codes[QK_KVC];
        block[0] = quantize_sub(&cb, x + b * QK_KVC,              QK_KVC_SUB, codes);
        block[1] = quantize_sub(&cb, x + b * QK_KVC + QK_KVC_SUB, QK_KVC_SUB, codes + QK_KVC_SUB);
        pack(codes, block);
    }
}

void quantize_row_kvc5_ref(const float * GGML_RESTRICT x, block_kvc5 * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC5, x, y, k, kvc_quantize_sub_ref);
}

void quantize_row_kvc4_ref(const float * GGML_RESTRICT x, block_kvc4 * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC4, x, y, k, kvc_quantize_sub_ref);
}

void quantize_row_kvc3_ref(const float * GGML_RESTRICT x, block_kvc3 * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC3, x, y, k, kvc_quantize_sub_ref);
}

void quantize_row_kvc2_ref(const float * GGML_RESTRICT x, block_kvc2 * GGML_RESTRICT y, int64_t k) {
    kvc_quantize_row_lowbit(GGML_TYPE_KVC2, x, y, k, kvc_quantize_sub_ref);
}

void dequantize_row_kvc8(const block_kvc8 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_KVC == 0);
    for (int64_t b = 0; b < k / QK_KVC; ++b) {
        const float d = GGML_FP16_TO_FP32(x[b].d);
        for (int i = 0; i < QK_KVC; ++i) {
            y[b * QK_KVC + i] = d * x[b].qs[i];
        }
    }
}

void dequantize_row_kvc5(const block_kvc5 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_KVC == 0);
    for (int64_t b = 0; b < k / QK_KVC; ++b) {
        const float d0 = kvc_e8_to_fp32(x[b].e[0]);
        const float d1 = kvc_e8_to_fp32(x[b].e[1]);
        const uint8_t * qh = x[b].qh;
        float * yb = y + b * QK_KVC;
        for (int j = 0; j < QK_KVC / 2; ++j) {
            const int q = x[b].qs[j];
            yb[j]              = d0 * kvalues_kvc5[(q & 0xf) | ((qh[j / 8]     >> (j % 8)) & 1) << 4];
            yb[j + QK_KVC / 2] = d1 * kvalues_kvc5[(q >> 4)  | ((qh[j / 8 + 2] >> (j % 8)) & 1) << 4];
        }
    }
}

void dequantize_row_kvc4(const block_kvc4 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_KVC == 0);
    for (int64_t b = 0; b < k / QK_KVC; ++b) {
        const float d0 = kvc_e8_to_fp32(x[b].e[0]);
        const float d1 = kvc_e8_to_fp32(x[b].e[1]);
        for (int j = 0; j < QK_KVC / 2; ++j) {
            y[b * QK_KVC + j]              = d0 * kvalues_kvc4[x[b].qs[j] & 0xf];
            y[b * QK_KVC + j + QK_KVC / 2] = d1 * kvalues_kvc4[x[b].qs[j] >> 4];
        }
    }
}

// Byte j of a two-bit plane holds values j, j + 8, j + 16, j + 24; decoding a byte at a time
// keeps the shifts constant, which matters on the V path of attention.
void dequantize_row_kvc3(const block_kvc3 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_KVC == 0);
    for (int64_t b = 0; b < k / QK_KVC; ++b) {
        const float d0 = kvc_e8_to_fp32(x[b].e[0]);
        const float d1 = kvc_e8_to_fp32(x[b].e[1]);
        const uint8_t * qh = x[b].qh;
        float * yb = y + b * QK_KVC;
        for (int j = 0; j < 8; ++j) {
            const int q = x[b].ql[j];
            yb[j]      = d0 * kvalues_kvc3[((q     ) & 3) | ((qh[0] >> j) & 1) << 2];
            yb[j +  8] = d0 * kvalues_kvc3[((q >> 2) & 3) | ((qh[1] >> j) & 1) << 2];
            yb[j + 16] = d1 * kvalues_kvc3[((q >> 4) & 3) | ((qh[2] >> j) & 1) << 2];
            yb[j + 24] = d1 * kvalues_kvc3[((q >> 6)    ) | ((qh[3] >> j) & 1) << 2];
        }
    }
}

void dequantize_row_kvc2(const block_kvc2 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_KVC == 0);
    for (int64_t b = 0; b < k / QK_KVC; ++b) {
        const float d0 = kvc_e8_to_fp32(x[b].e[0]);
        const float d1 = kvc_e8_to_fp32(x[b].e[1]);
        float * yb = y + b * QK_KVC;
        for (int j = 0; j < 8; ++j) {
            const int q = x[b].qs[j];
            yb[j]      = d0 * kvalues_kvc2[(q     ) & 3];
            yb[j +  8] = d0 * kvalues_kvc2[(q >> 2) & 3];
            yb[j + 16] = d1 * kvalues_kvc2[(q >> 4) & 3];
            yb[j + 24] = d1 * kvalues_kvc2[(q >> 6)    ];
        }
    }
}

enum ggml_type ggml_kvcomp_type_from_name(const char * name) {
    for (int t = GGML_KVCOMP_TYPE_FIRST; t < GGML_TYPE_COUNT; ++t) {
        if (strcmp(name, ggml_type_name((enum ggml_type) t)) == 0) {
            return (enum ggml_type) t;
        }
    }
    return GGML_TYPE_COUNT;
}

bool ggml_validate_row_data_kvc(enum ggml_type type, const void * data, size_t nb) {
    if (ggml_kvcomp_is_kvct(type)) {
        // a row's scale code sits at the start of each head's row, which these bytes do not
        // locate: kvcomp's state reader checks kvct rows with the plans' head size
        return true;
    }
    if (type == GGML_TYPE_KVC8) {
        const block_kvc8 * x = (const block_kvc8 *) data;
        for (size_t b = 0; b < nb; ++b) {
            if (!isfinite(GGML_FP16_TO_FP32(x[b].d))) {
                return false;
            }
            for (int j = 0; j < QK_KVC; ++j) {
                if (x[b].qs[j] < -127) {
                    return false;
                }
            }
        }
        return true;
    }
    // every low-bit block starts with its two step codes; any code pattern is a level
    const size_t bs = ggml_type_size(type);
    const uint8_t * p = (const uint8_t *) data;
    for (size_t b = 0; b < nb; ++b) {
        if (p[b * bs] > KVC_E8_MAX || p[b * bs + 1] > KVC_E8_MAX) {
            return false;
        }
    }
    return true;
}
