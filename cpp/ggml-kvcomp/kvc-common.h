#pragma once

// Block layouts of the kvc types and the reference kernels shared by every backend.
//
// All types use blocks of QK_KVC = 32 values along the head dimension, so a block never
// straddles two heads when the head size is a multiple of 32 (64, 96, 128, 256). The
// low-bit types split a block into two sub-blocks of 16 values, each with an 8-bit
// log-domain step (see kvc_e8_to_fp32), and store codes into a small table of
// non-uniform int8 levels fitted to Hadamard-rotated, near-Gaussian rows.

#include "ggml-kvcomp.h"
#include "kvc-transform.h"

#include <assert.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QK_KVC     32
#define QK_KVC_SUB 16

// 8.5 bits per value: int8 codes, fp16 step chosen by an MSE search.
typedef struct {
    uint16_t d;             // fp16 step
    int8_t   qs[QK_KVC];
} block_kvc8;
static_assert(sizeof(block_kvc8) == sizeof(uint16_t) + QK_KVC, "wrong kvc8 block size/padding");

// 5.5 bits per value: 32 levels; the low four bits of a code sit as kvc4's, the fifth bit of
// value i in qh[i / 8] at bit i % 8.
typedef struct {
    uint8_t e[2];
    uint8_t qs[QK_KVC / 2];
    uint8_t qh[QK_KVC / 8];
} block_kvc5;
static_assert(sizeof(block_kvc5) == 2 + QK_KVC / 2 + QK_KVC / 8, "wrong kvc5 block size/padding");

// 4.5 bits per value: 16 levels; qs[j] holds value j (low nibble) and value j + 16 (high nibble).
typedef struct {
    uint8_t e[2];           // log-domain steps of the two sub-blocks
    uint8_t qs[QK_KVC / 2];
} block_kvc4;
static_assert(sizeof(block_kvc4) == 2 + QK_KVC / 2, "wrong kvc4 block size/padding");

// 3.5 bits per value: 8 levels; the low two bits of value 8*g + j sit in ql[j] at bit 2*g,
// the third bit of value i in qh[i / 8] at bit i % 8.
typedef struct {
    uint8_t e[2];
    uint8_t ql[QK_KVC / 4];
    uint8_t qh[QK_KVC / 8];
} block_kvc3;
static_assert(sizeof(block_kvc3) == 2 + QK_KVC / 4 + QK_KVC / 8, "wrong kvc3 block size/padding");

// 2.5 bits per value: 4 levels, packed like kvc3's ql.
typedef struct {
    uint8_t e[2];
    uint8_t qs[QK_KVC / 4];
} block_kvc2;
static_assert(sizeof(block_kvc2) == 2 + QK_KVC / 4, "wrong kvc2 block size/padding");

// The shared low-bit quantizer writes the two step codes at the start of every block.
static_assert(offsetof(block_kvc5, e) == 0 && offsetof(block_kvc4, e) == 0 && offsetof(block_kvc3, e) == 0 &&
              offsetof(block_kvc2, e) == 0,
              "kvc low-bit blocks must start with their step codes");

// Level tables in units of the sub-block step (Lloyd-Max levels of a unit Gaussian, scaled so
// the outermost level is 127), spelled once for the C tables and the GPU kernels.
#define KVC_LEVELS_KVC5 { -127, -105, -90, -79, -70, -62, -54, -47, -41, -35, -29, -24, -18, -13, -8, -3, \
                           3, 8, 13, 18, 24, 29, 35, 41, 47, 54, 62, 70, 79, 90, 105, 127 }
#define KVC_LEVELS_KVC4 { -127, -96, -75, -58, -44, -31, -18, -6, 6, 18, 31, 44, 58, 75, 96, 127 }
#define KVC_LEVELS_KVC3 { -127, -79, -45, -14, 14, 45, 79, 127 }
#define KVC_LEVELS_KVC2 { -127, -38, 38, 127 }

// How far below the absmax-matching step the MSE search goes, in 1/8 octaves: clipping the
// largest values of a 16-value Gaussian block by up to ~35% can lower the total error.
#define KVC_SEARCH_DOWN 12
#define KVC_SEARCH_UP   1

extern const int8_t kvalues_kvc5[32];
extern const int8_t kvalues_kvc4[16];
extern const int8_t kvalues_kvc3[8];
extern const int8_t kvalues_kvc2[4];

// The 8-bit step code: e = 0 is an exact zero, otherwise the step is 2^((e - 160) / 8),
// 2^-20 .. 2^9 in 1/8-octave increments. Built from exponent bits so that the hot
// dequantization loops need no exp2f. Codes above KVC_E8_MAX are not produced and not
// accepted from a state file: with them the outermost level would leave F16's range, the
// range every other cache type (and the residual buffer's exact rows) can hold.
#define KVC_E8_MAX 232
#define KVC_E8_FRAC { 1.0f, 1.09050773f, 1.18920712f, 1.29683955f, 1.41421356f, 1.54221083f, 1.68179283f, 1.83400809f }

static inline float kvc_e8_to_fp32(uint8_t e) {
    static const float frac[8] = KVC_E8_FRAC;
    union { uint32_t u; float f; } p;
    p.u = (uint32_t) ((e >> 3) + 107) << 23;
    return e ? frac[e & 7] * p.f : 0.0f;
}

// Values scaled to the levels' range fall in KVC_BUCKETS buckets of width KVC_BUCKET_W,
// [-128, 128) split evenly, the outer two open to the side: a bucket holding at most one
// threshold finds a value's level with one comparison (the SIMD quantizers).
#define KVC_BUCKETS  32
#define KVC_BUCKET_W 8.0f

// A low-bit type's levels and the decision thresholds between neighbours.
typedef struct {
    const int8_t * levels;
    int            n;
    float          mid[31];   // decision thresholds between neighbouring levels
    int            zero_code; // code of the level with the smallest magnitude
    // per bucket, the thresholds below its lower end; valid when no bucket holds two
    int32_t        below[KVC_BUCKETS];
    bool           bucketed;
} kvc_codebook;

// Index of the level nearest to v (ties go down). A branch-free count of the thresholds
// below v measured faster here than a binary search or a cell table.
static inline int kvc_nearest(const kvc_codebook * cb, float v) {
    int c = 0;
    for (int i = 0; i + 1 < cb->n; ++i) {
        c += v > cb->mid[i];
    }
    return c;
}

// The step search of a sub-block: err[c] = sum over the n values v of (v - d[c] * level)^2,
// level the one nearest to v * id[c], products and sums rounded one at a time in value order.
// The quantizers differ only in this function (scalar reference, SIMD), so they write the
// same bytes.
// Marks a function whose float products and sums must not be fused (before it, and first in
// its body): a compiler targeting FMA would otherwise round them once instead of twice.
#if defined(__clang__)
#define KVC_NO_FP_CONTRACT
#define KVC_NO_FP_CONTRACT_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define KVC_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#define KVC_NO_FP_CONTRACT_BODY
#else
#define KVC_NO_FP_CONTRACT
#define KVC_NO_FP_CONTRACT_BODY
#endif

typedef void (*kvc_sub_errors_t)(const kvc_codebook * cb, const float * v, int n, const float * d, const float * id,
                                 int n_cand, float * err);

// The step code nearest to a step of d (log domain), before clamping to the codes made.
static inline int kvc_fp32_to_e8_unclamped(float d) {
    return (int) lrintf(8.0f * log2f(d)) + 160;
}

// The step code matching a sub-block whose largest magnitude is amax (*e_max), and the
// candidate codes of its search: from KVC_SEARCH_UP above it to KVC_SEARCH_DOWN below, in
// that order, those in 1..KVC_E8_MAX.
static inline int kvc_step_candidates(float amax, float top_level, int * e_max, int * cand) {
    const int e = kvc_fp32_to_e8_unclamped(amax / top_level);
    *e_max = e < 1 ? 1 : e > KVC_E8_MAX ? KVC_E8_MAX : e;
    int n_cand = 0;
    for (int c = *e_max + KVC_SEARCH_UP; c >= *e_max - KVC_SEARCH_DOWN; --c) {
        if (c >= 1 && c <= KVC_E8_MAX) {
            cand[n_cand++] = c;
        }
    }
    return n_cand;
}

// Each candidate code's step (kvc_e8_to_fp32) and its inverse.
static inline void kvc_step_values(const int * cand, int n_cand, float * d, float * id) {
    for (int c = 0; c < n_cand; ++c) {
        d[c]  = kvc_e8_to_fp32((uint8_t) cand[c]);
        id[c] = 1.0f / d[c];
    }
}

// The candidate with the first smallest error (every error infinite: the matching step e_max).
static inline int kvc_best_step(const float * err, const int * cand, int n_cand, int e_max) {
    int   best_e   = e_max;
    float best_err = INFINITY;
    for (int c = 0; c < n_cand; ++c) {
        if (err[c] < best_err) {
            best_err = err[c];
            best_e   = cand[c];
        }
    }
    return best_e;
}

// Quantizes one sub-block of n values to codes of cb's levels and returns its step code: the
// step search with the given error function. The reference (kvc_quantize_sub_ref) is this with
// the scalar one.
GGML_API uint8_t kvc_quantize_sub_search(const kvc_codebook * cb, const float * x, int n, uint8_t * codes,
                                         kvc_sub_errors_t errors);
GGML_API uint8_t kvc_quantize_sub_ref(const kvc_codebook * cb, const float * x, int n, uint8_t * codes);

typedef uint8_t (*kvc_quantize_sub_t)(const kvc_codebook * cb, const float * x, int n, uint8_t * codes);

// The low-bit quantizers (kvc5, kvc4, kvc3, kvc2) with the given sub-block quantizer, which
// must write kvc_quantize_sub_ref's bytes; quantize_row_<t>_ref is this with the reference.
GGML_API void kvc_quantize_row_lowbit(enum ggml_type type, const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k,
                                      kvc_quantize_sub_t quantize_sub);

GGML_API void quantize_row_kvc8_ref(const float * GGML_RESTRICT x, block_kvc8 * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_kvc5_ref(const float * GGML_RESTRICT x, block_kvc5 * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_kvc4_ref(const float * GGML_RESTRICT x, block_kvc4 * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_kvc3_ref(const float * GGML_RESTRICT x, block_kvc3 * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_kvc2_ref(const float * GGML_RESTRICT x, block_kvc2 * GGML_RESTRICT y, int64_t k);

GGML_API void dequantize_row_kvc8(const block_kvc8 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_kvc5(const block_kvc5 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_kvc4(const block_kvc4 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_kvc3(const block_kvc3 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_kvc2(const block_kvc2 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);

// Whether nb blocks of a kvc type hold only what its quantizer writes: step codes up to
// KVC_E8_MAX, a finite kvc8 step and kvc8 codes in [-127, 127] (ggml_validate_row_data's kvc
// cases; a state file with other bytes is refused).
GGML_API bool ggml_validate_row_data_kvc(enum ggml_type type, const void * data, size_t nb);

// Entries for ggml.c's type_traits table.
#define GGML_KVCOMP_TYPE_TRAIT(name, NAME)                                  \
    [GGML_TYPE_##NAME] = {                                                  \
        .type_name      = #name,                                            \
        .blck_size      = QK_KVC,                                           \
        .type_size      = sizeof(block_##name),                             \
        .is_quantized   = true,                                             \
        .to_float       = (ggml_to_float_t) dequantize_row_##name,          \
        .from_float_ref = (ggml_from_float_t) quantize_row_##name##_ref,    \
    }

// A kvct row needs its plan to be read or written (kvc-transform.h): no plan-free to_float or
// from_float, so an op outside kvcomp's kernels cannot silently misread one.
#define GGML_KVCOMP_KVCT_TRAIT(name, NAME)                                  \
    [GGML_TYPE_##NAME] = {                                                  \
        .type_name      = #name,                                            \
        .blck_size      = QK_KVCT,                                          \
        .type_size      = sizeof(block_##name),                             \
        .is_quantized   = true,                                             \
    }

#define GGML_KVCOMP_TYPE_TRAITS             \
    GGML_KVCOMP_TYPE_TRAIT(kvc8, KVC8),     \
    GGML_KVCOMP_TYPE_TRAIT(kvc4, KVC4),     \
    GGML_KVCOMP_TYPE_TRAIT(kvc3, KVC3),     \
    GGML_KVCOMP_TYPE_TRAIT(kvc2, KVC2),     \
    GGML_KVCOMP_KVCT_TRAIT(kvct4, KVCT4),   \
    GGML_KVCOMP_KVCT_TRAIT(kvct3, KVCT3),   \
    GGML_KVCOMP_KVCT_TRAIT(kvct2, KVCT2),   \
    GGML_KVCOMP_KVCT_TRAIT(kvct5, KVCT5),   \
    GGML_KVCOMP_TYPE_TRAIT(kvc5, KVC5)

// Case labels for upstream switches that list the quantized types.
#define GGML_KVCOMP_TYPE_CASES \
    case GGML_TYPE_KVC8:       \
    case GGML_TYPE_KVC4:       \
    case GGML_TYPE_KVC3:       \
    case GGML_TYPE_KVC2:       \
    case GGML_TYPE_KVC5

// ... and for the switches that also take the kvct types (ggml_validate_row_data)
#define GGML_KVCOMP_ALL_TYPE_CASES \
    GGML_KVCOMP_TYPE_CASES:        \
    case GGML_TYPE_KVCT4:          \
    case GGML_TYPE_KVCT3:          \
    case GGML_TYPE_KVCT2:          \
    case GGML_TYPE_KVCT5

#ifdef __cplusplus
}
#endif
