#pragma once

// The transform-coded K row (layout and rules in docs/formats.md, "kvct"): one
// KV head's row of d values, coded with a plan fixed per layer and KV head from measured
// statistics. The plan turns each RoPE pair of channels by its own 2x2 rotation (the pair's
// principal axes before RoPE; the identity for rows after RoPE), removes a mean, and gives
// each coefficient its own scale and number of bits (0..8), spending the row's budget
// where the query-weighted energy is (greedy reverse water-filling). A row is one 8-bit
// scale code and the coefficients' Lloyd-Max codes, packed one after the other.
//
// This is the scalar reference, backend independent: the plan's fitting, a row's coding and
// decoding. Kernels and the cache's use of it build on it.

#include "ggml.h"

#include <assert.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_T_MAX_D    256 // the largest head size a plan holds
#define KVC_T_MAX_BITS 8   // bits of one coefficient at most

// The cache types GGML_TYPE_KVCT5 (5.5 bits per value), GGML_TYPE_KVCT4 (4.5), GGML_TYPE_KVCT3
// (3.5) and GGML_TYPE_KVCT2 (2.25) count their rows in blocks of QK_KVCT values: a row of d
// values (a multiple of QK_KVCT) is d / QK_KVCT blocks' bytes, coded as one row with its
// plan's row_bits = bpe * d (the block is only the unit of size, not of coding).
#define QK_KVCT 64

typedef struct {
    uint8_t qs[QK_KVCT * 11 / 16];
} block_kvct5;
static_assert(sizeof(block_kvct5) == QK_KVCT * 11 / 16, "wrong kvct5 block size/padding");

typedef struct {
    uint8_t qs[QK_KVCT * 9 / 16];
} block_kvct4;
static_assert(sizeof(block_kvct4) == QK_KVCT * 9 / 16, "wrong kvct4 block size/padding");

typedef struct {
    uint8_t qs[QK_KVCT * 7 / 16];
} block_kvct3;
static_assert(sizeof(block_kvct3) == QK_KVCT * 7 / 16, "wrong kvct3 block size/padding");

typedef struct {
    uint8_t qs[QK_KVCT * 9 / 32];
} block_kvct2;
static_assert(sizeof(block_kvct2) == QK_KVCT * 9 / 32, "wrong kvct2 block size/padding");

// The plan's row_bits for a row of d values of a kvct type (0 for another type, or a d that
// is not a multiple of QK_KVCT or is larger than KVC_T_MAX_D).
GGML_API int32_t kvc_t_type_row_bits(enum ggml_type type, int64_t d);

typedef struct {
    int32_t d;                          // coefficients per row (the head size, even)
    int32_t row_bits;                   // bits of a coded row: 8 (its scale) + the sum of bits[]
    int16_t pair[KVC_T_MAX_D / 2][2];   // the channels of each RoPE pair (every channel once)
    float   rot[KVC_T_MAX_D / 2][2];    // (cos, sin) of each pair's rotation
    float   mean[KVC_T_MAX_D];          // removed before the rotation
    float   sigma[KVC_T_MAX_D];         // scale of coefficient j (its RMS when the plan was fitted)
    uint8_t bits[KVC_T_MAX_D];          // bits of coefficient j
} kvc_t_plan;

// How a plan's rotation is chosen: the principal axes of each pair's second moments (K
// before RoPE), or none, with the pair's two channels pooled (K after RoPE, where a pair's
// energy does not depend on the position but its direction does).
enum kvc_t_basis {
    KVC_T_BASIS_PAIR_AXES,
    KVC_T_BASIS_POOLED,
};

// The statistics a plan is fitted from, per RoPE pair p of channels (a, b) = pair[p]:
// mean[a], mean[b], the centred second moments k2[p] = {E[ka ka], E[ka kb], E[kb kb]}, and the
// queries' weight w[p] = {W[a][a], W[a][b], W[b][b]} (W = E[q q'] of the queries that read the
// head, or the identity to weigh every channel alike).
typedef struct {
    int32_t       d;
    const int16_t (*pair)[2];
    const float * mean;
    const float (*k2)[3];
    const float (*w)[3];
} kvc_t_stats;

// The RoPE of a layer whose plans were fitted before RoPE (KVC_T_BASIS_PAIR_AXES): rows are
// coded as the model computed them before its RoPE, and a kernel turns each decoded row to its
// key's position, pair p of the plan by the angle pos * theta[p] with the gain mscale (YaRN's,
// 1 for most models). n_pairs == 0: the rows were coded after RoPE and are read as they are.
typedef struct {
    int32_t n_pairs;
    float   mscale;
    float   theta[KVC_T_MAX_D / 2];
} kvc_t_rope;

// A node's plans tensor (ggml_kvct_set_plans) holds one kvc_t_plan per KV head, then the
// layer's kvc_t_rope. The KV heads of a plans tensor of nbytes bytes (0 when it has another size).
static inline int64_t kvc_t_plans_n_head(size_t nbytes) {
    return nbytes > sizeof(kvc_t_rope) && (nbytes - sizeof(kvc_t_rope)) % sizeof(kvc_t_plan) == 0 ?
        (int64_t) ((nbytes - sizeof(kvc_t_rope)) / sizeof(kvc_t_plan)) : 0;
}

// The RoPE of a GGML_OP_ROPE node (its op_params and frequency factors, NULL for none) for
// rows of d values, pairs ordered as RoPE orders them (NEOX: (p, p + d/2), else (2p, 2p+1)).
// False for a RoPE that turns fewer than d channels or a multi-section one.
GGML_API bool kvc_t_rope_from_op(kvc_t_rope * rope, const int32_t * op_params, const float * freq_factors, int64_t d);

// The (cos, sin) of every pair's angle at pos, times mscale (the angle in double precision).
GGML_API void kvc_t_rope_cs(const kvc_t_rope * rope, int64_t pos, float * c, float * s);

// Turns row x (d = 2 * rope->n_pairs values, pairs as in the plan) in place by the angles of
// kvc_t_rope_cs, forward (RoPE) or back (inverse != 0; undoes the gain too).
GGML_API void kvc_t_rope_row(const kvc_t_plan * plan, const float * c, const float * s, int inverse, float * x);

// Bytes of a coded row of `row_bits` bits.
static inline size_t kvc_t_row_size(int32_t row_bits) {
    return (size_t) (row_bits + 7) / 8;
}

// Fits a plan to the statistics with a budget of row_bits bits per row (the row scale
// included): rotations by `basis`, each coefficient's scale from its variance, and bits by
// greedy allocation of the largest drop in weighted distortion (variance x query weight x
// the Lloyd-Max distortion step), at most 8 per coefficient, ties to the lower index.
// Returns false, leaving the plan untouched, for an odd or too large d, pairs that do not
// cover every channel once, non-finite or negative statistics, or a budget outside
// [8, 8 + 8d].
GGML_API bool kvc_t_plan_fit(kvc_t_plan * plan, const kvc_t_stats * stats, enum kvc_t_basis basis, int32_t row_bits);

// Whether a plan is one kvc_t_plan_fit could have written (a plan read from a file is
// checked before use): sizes, pairs, unit rotations, finite means, positive finite scales,
// bits and their sum.
GGML_API bool kvc_t_plan_valid(const kvc_t_plan * plan);

// The plan's transform of a row and its inverse (orthogonal: y = T (x - mean), x = T' y + mean).
GGML_API void kvc_t_forward(const kvc_t_plan * plan, const float * GGML_RESTRICT x, float * GGML_RESTRICT y);
GGML_API void kvc_t_inverse(const kvc_t_plan * plan, const float * GGML_RESTRICT y, float * GGML_RESTRICT x);

// One row of plan->d values to kvc_t_row_size(plan->row_bits) bytes and back. A non-finite
// value is taken as the plan's mean of its channel (it adds nothing to the row).
GGML_API void quantize_row_kvct_ref(const kvc_t_plan * plan, const float * GGML_RESTRICT x, uint8_t * GGML_RESTRICT y);
GGML_API void dequantize_row_kvct(const kvc_t_plan * plan, const uint8_t * GGML_RESTRICT x, float * GGML_RESTRICT y);

// quantize_row_kvct_ref in its three steps, for coders that do the middle one their own way:
// the row's coefficients in units of their sigma (u) and the row scale code the search starts
// from (0: the row codes as zeros); the search, over the codes KVC_T_SEARCH_DOWN below to
// KVC_T_SEARCH_UP above it (1/8 octaves; ties to the start, then to the smaller code), of the
// one whose levels code u with the least squared error in K's units, that error added in
// double in coefficient order; the row coded at the chosen code.
#define KVC_T_SEARCH_DOWN 4
#define KVC_T_SEARCH_UP   16
GGML_API uint8_t kvc_t_row_start(const kvc_t_plan * plan, const float * GGML_RESTRICT x, float * GGML_RESTRICT u);
GGML_API uint8_t kvc_t_row_search_ref(const kvc_t_plan * plan, const float * u, uint8_t e0);
GGML_API void    kvc_t_row_pack(const kvc_t_plan * plan, const float * u, uint8_t e, uint8_t * GGML_RESTRICT y);
// The row at scale code e > 0 from its coefficients' codes (coefficient j's at codes[j * stride]):
// the scale's byte, then the codes' bits one after the other from the lowest.
GGML_API void    kvc_t_row_pack_codes(const kvc_t_plan * plan, const uint8_t * codes, size_t stride, uint8_t e,
                                      uint8_t * GGML_RESTRICT y);

// Whether nb bytes of kvct rows of d values hold only what quantize_row_kvct_ref writes: every
// head's row scale code at most KVC_E8_MAX (any code bits are levels). A state file with
// other bytes is refused.
GGML_API bool kvc_t_validate_rows(enum ggml_type type, int64_t d, const void * data, size_t nb);

// The 2^b Lloyd-Max levels of b bits (1..8), in units of a coefficient's sigma times the row
// scale: what dequantize_row_kvct multiplies, for kernels that decode rows their own way.
GGML_API const float * kvc_t_levels_of(int bits);

// The Lloyd-Max distortion of a unit Gaussian at b bits (1 at 0 bits), from the shared table.
GGML_API float kvc_t_lloyd_max_dist(int bits);

#ifdef __cplusplus
}
#endif
