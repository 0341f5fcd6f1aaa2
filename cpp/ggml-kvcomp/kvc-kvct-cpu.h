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
    int32_t n;         // coded coefficients (bits > 0), in the row's order
    bool    identity;  // no rotation and no mean: the coefficients are the row's values
    int32_t pairing;   // RoPE's pairs: 1 (2p, 2p+1), 2 NEOX (p, p + d/2), 0 any other
    size_t  row_bytes;
    int32_t j[KVC_T_MAX_D];     // the coefficient's channel
    int32_t boff[KVC_T_MAX_D];  // byte of its first bit
    int32_t shift[KVC_T_MAX_D]; // its first bit in that byte
    int32_t mask[KVC_T_MAX_D];  // 2^bits - 1
    int32_t lvl[KVC_T_MAX_D];   // its levels in the table of kvc_t_levels_of(1)
} kvc_t_decoder;

void kvc_t_decoder_init(kvc_t_decoder * dec, const kvc_t_plan * plan);

// The angles of one key position after another: a key one position after the last is turned
// from the last one's angles by one step (exact ones again every KVC_T_ROPE_RESYNC steps), any
// other position from kvc_t_rope_cs. Keys come in cell order, mostly one position apart.
#define KVC_T_ROPE_RESYNC 256

typedef struct {
    const kvc_t_rope * rope;
    int64_t pos;    // the position of c and s (INT64_MIN: none yet)
    int32_t n_step; // steps since they were exact
    float   c[KVC_T_MAX_D / 2], s[KVC_T_MAX_D / 2];
} kvc_t_rope_walk;

void kvc_t_rope_walk_init(kvc_t_rope_walk * w, const kvc_t_rope * rope);
void kvc_t_rope_walk_to(kvc_t_rope_walk * w, int64_t pos);

// Turns a decoded row in place by the angles (c, s) of its position (kvc_t_rope_row's result;
// RoPE's own pairings in one pass the compiler vectorizes).
void kvc_t_decoder_turn(const kvc_t_decoder * dec, const float * c, const float * s, float * y);

// The row's values: the floats dequantize_row_kvct gives (the same products in the same order).
void kvc_t_decoder_row(const kvc_t_decoder * dec, const uint8_t * x, float * y);

#ifdef __cplusplus
}
#endif
