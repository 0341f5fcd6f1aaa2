#pragma once

// Reading kvct rows on the CPU (the attention kernels of kvc-fattn.cpp): a plan's decoder,
// set up once per node and KV head, that finds each coded coefficient's bits with one load
// instead of walking the row bit by bit as the reference does. Internal to the CPU backend.

#include "kvc-transform.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const kvc_t_plan * plan;
    bool    identity;  // no rotation and no mean: the coefficients are the row's values
    int32_t pairing;   // RoPE's pairs: 1 (2p, 2p+1), 2 NEOX (p, p + d/2), 0 any other
    size_t  row_bytes;
    // per coefficient j, in channel order (a coefficient of 0 bits reads a code of 0 bits at
    // its neighbour's byte and has sig 0, so one branch-free pass decodes the row)
    int32_t boff[KVC_T_MAX_D];  // byte of its first bit
    int32_t shift[KVC_T_MAX_D]; // its first bit in that byte
    int32_t mask[KVC_T_MAX_D];  // 2^bits - 1
    int32_t lvl[KVC_T_MAX_D];   // its levels in the table of kvc_t_levels_of(1)
    float   sig[KVC_T_MAX_D];   // plan->sigma[j], 0 for 0 bits
    // the plan's mean turned back by its rotation (pairing 1 and 2): a row decoded before RoPE is
    // R(pos) (T' v + mean) = R(pos + rot) (v + base), one turn by the sum of both angles
    float   base[KVC_T_MAX_D];
} kvc_t_decoder;

void kvc_t_decoder_init(kvc_t_decoder * dec, const kvc_t_plan * plan);

// The angles of one key position after another: a key one position after the last is turned
// from the last one's angles by one step (exact ones again every KVC_T_ROPE_RESYNC steps), any
// other position from kvc_t_rope_cs. Keys come in cell order, mostly one position apart. For a
// decoder of pairing 1 or 2 the angles include its plan's rotation (kvc_t_decoder_row_at).
#define KVC_T_ROPE_RESYNC 256

typedef struct {
    const kvc_t_rope *    rope;
    const kvc_t_decoder * dec;
    bool    fold;   // the plan's rotation is in c and s
    int64_t pos;    // the position of c and s (INT64_MIN: none yet)
    int32_t n_step; // steps since they were exact
    float   c[KVC_T_MAX_D / 2], s[KVC_T_MAX_D / 2];
} kvc_t_rope_walk;

void kvc_t_rope_walk_init(kvc_t_rope_walk * w, const kvc_t_rope * rope, const kvc_t_decoder * dec);
void kvc_t_rope_walk_to(kvc_t_rope_walk * w, int64_t pos);

// The row's values: the floats dequantize_row_kvct gives (the same products in the same order).
void kvc_t_decoder_row(const kvc_t_decoder * dec, const uint8_t * x, float * y);

// The row of a cache coded before RoPE, turned to the position the walk is at (kvc_t_rope_row
// of the row's values by kvc_t_rope_cs's angles, up to the walk's rounding).
void kvc_t_decoder_row_at(const kvc_t_decoder * dec, const uint8_t * x, const kvc_t_rope_walk * w, float * y);

#ifdef __cplusplus
}
#endif
