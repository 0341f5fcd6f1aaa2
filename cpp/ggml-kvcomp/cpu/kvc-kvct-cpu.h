#pragma once

// Reading kvct rows on the CPU (the attention kernels of kvc-fattn.cpp): a plan's decoder,
// set up once per node and KV head, that finds each coded coefficient's bits with one load
// instead of walking the row bit by bit as the reference does, or decodes 64 coefficients at a
// time with AVX-512 VBMI, 8 with AVX2 or AVX-512 without VBMI (docs/formats.md, "kvct").
// Internal to the CPU backend.

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
    // The AVX-512 VBMI decoder (filled where it is built): a chunk of 64 coefficients at a time,
    // its codes cut out of the row by byte shuffles and bit-field shifts, their levels looked up
    // as 4 byte planes of a table of magnitudes, the sign from the code's top bit. Interleaving
    // the planes within 128-bit lanes gives 4 vectors of 16 floats whose lane l of vector q is
    // code byte 16 (l / 4) + 4 q + l % 4. Which channel each vector lane holds is the decoder's
    // lane layout (kvc_t_vbmi_channel): with pairs side by side, 16 pairs' first channels in
    // one vector and their second in the next, so that RoPE turns them without a permute. Per
    // chunk: the row byte its window starts at and whether it has 8-bit codes; per code byte:
    // the window bytes of the two 8-byte words its qword lane reads (its first 4 codes from
    // one, its last 4 from the other), its first bit in its word, its mask, the top bit of its
    // code, that bit minus one, and where its magnitudes start (in one table for every plan);
    // per lane: sig and base.
    int32_t vb_w0[KVC_T_MAX_D / 64];
    bool    vb_has8[KVC_T_MAX_D / 64];
    uint8_t vb_perm_a[KVC_T_MAX_D], vb_perm_b[KVC_T_MAX_D], vb_ctrl[KVC_T_MAX_D], vb_mask[KVC_T_MAX_D];
    uint8_t vb_top[KVC_T_MAX_D], vb_low[KVC_T_MAX_D], vb_moff[KVC_T_MAX_D];
    float   vb_sig[KVC_T_MAX_D], vb_base[KVC_T_MAX_D];
    // The AVX2 decoder (filled where it is built): 8 coefficients at a time, each one's 4 bytes
    // picked by a byte shuffle (av_ctrl) from the group's 16-byte window of the row at av_win
    // (in both 128-bit lanes), then shifted and masked as above. In a group whose
    // coefficients have at most 5 bits (av_wide 0 or 1) the sign is the code's top
    // bit (av_top) and the magnitude comes from the 31 of 1-5 bits (av_mag, b's from av_moff)
    // in registers, two of them when the group has at most 4 bits (av_wide 0); groups with
    // wider coefficients (av_wide 2) read their levels one at a time. The groups from
    // coefficient av_safe on have a window that reaches past the row's end: they read a copy of
    // the row's bytes from av_tail on, with zeros after it, so that no row is read past its end
    // and none is copied whole.
    int32_t av_win[KVC_T_MAX_D / 8];
    int32_t av_safe, av_tail;
    uint8_t av_ctrl[4 * KVC_T_MAX_D];
    int32_t av_top[KVC_T_MAX_D], av_moff[KVC_T_MAX_D];
    uint8_t av_wide[KVC_T_MAX_D / 8];
    float   av_mag[32];
} kvc_t_decoder;

void kvc_t_decoder_init(kvc_t_decoder * dec, const kvc_t_plan * plan);

// The angles of one key position after another. Keys come in cell order, mostly one position
// apart; each key's angles are its base's turned by a table of the first KVC_T_ROPE_STEPS
// steps (no chain from one key to the next). The base is the multiple of KVC_T_ROPE_STEPS at
// or below the key; its angles are taken exact (kvc_t_rope_cs) at the multiple of
// KVC_T_ROPE_EXACT below it and turned by the step table's last row once per KVC_T_ROPE_STEPS
// positions from there. So a key's angles depend on its position alone, not on the key the
// walk came from: a row reads the same in a tile that starts at another cell, as it must for
// a request whose cells other sequences of a unified cache sit between. For a decoder of
// pairing 1 or 2 the angles include its plan's rotation (kvc_t_decoder_row_at).
#define KVC_T_ROPE_STEPS 16
#define KVC_T_ROPE_EXACT 256

// (cos, sin) of j steps of a RoPE, j = 0 .. KVC_T_ROPE_STEPS, one table per node; ct and st
// hold the same values by pair, so that 8 keys' steps of one pair are one load.
typedef struct {
    float c[KVC_T_ROPE_STEPS + 1][KVC_T_MAX_D / 2];
    float s[KVC_T_ROPE_STEPS + 1][KVC_T_MAX_D / 2];
    float ct[KVC_T_MAX_D / 2][KVC_T_ROPE_STEPS + 1];
    float st[KVC_T_MAX_D / 2][KVC_T_ROPE_STEPS + 1];
} kvc_t_rope_steps;

void kvc_t_rope_steps_init(kvc_t_rope_steps * st, const kvc_t_rope * rope);

typedef struct {
    const kvc_t_rope *       rope;
    const kvc_t_rope_steps * steps;
    const kvc_t_decoder *    dec;
    bool    fold;   // the plan's rotation is in the angles
    int64_t base;   // the position of bc and bs, a multiple of KVC_T_ROPE_STEPS (INT64_MIN: none yet)
    int32_t delta;  // the key's position: base + delta, 0 <= delta < KVC_T_ROPE_STEPS
    float   bc[KVC_T_MAX_D / 2], bs[KVC_T_MAX_D / 2];
} kvc_t_rope_walk;

void kvc_t_rope_walk_init(kvc_t_rope_walk * w, const kvc_t_rope * rope, const kvc_t_rope_steps * steps, const kvc_t_decoder * dec);
void kvc_t_rope_walk_to(kvc_t_rope_walk * w, int64_t pos);

// The row's values: the floats dequantize_row_kvct gives (the same products in the same order).
void kvc_t_decoder_row(const kvc_t_decoder * dec, const uint8_t * x, float * y);

// The row of a cache coded before RoPE, turned to the position the walk is at (kvc_t_rope_row
// of the row's values by kvc_t_rope_cs's angles, up to the walk's rounding).
void kvc_t_decoder_row_at(const kvc_t_decoder * dec, const uint8_t * x, const kvc_t_rope_walk * w, float * y);

// Eight rows at once, one row per vector lane (kvc-kvct-rows8-cpu.c, built with AVX2 and with
// AVX-512 without VBMI): each coefficient is cut out of the 8 rows' 32-bit words by the same
// shift and mask, its levels times sigma read from a table of its own (permutes up to 5
// bits, a gather above), and the 8 rows come out as the columns of an F32 tile, the layout
// attention multiplies, turned to their positions with the products of kvc_t_decoder_row_at. A row decoded one coefficient group at a time spends most of its
// time on the group's mixed widths; across rows every lane has the same width.
typedef struct {
    int32_t n_words;            // 32-bit words of a row
    int32_t tail;               // bytes in a last word that is not whole (0: none)
    int32_t word[KVC_T_MAX_D];  // coefficient j's first word
    int32_t shift[KVC_T_MAX_D]; // its first bit in that word
    int32_t mask[KVC_T_MAX_D];  // 2^bits - 1
    int32_t split[KVC_T_MAX_D]; // whether its code goes on into the next word
    int32_t kind[KVC_T_MAX_D];  // its table: 0 8 entries, 1 16, 2 32 (permutes), 3 2^bits (gathered)
    int32_t toff[KVC_T_MAX_D];  // its table's first entry
    const float * tab;          // levels times sigma (kvc_t_rows8_floats of them)
} kvc_t_rows8;

// Floats of a plan's tables for kvc_t_rows8_init; 0 where this build has no such decoder.
size_t kvc_t_rows8_floats(const kvc_t_plan * plan);

// Sets r up for the decoder's plan, its tables in tab (kvc_t_rows8_floats of them).
void kvc_t_rows8_init(kvc_t_rows8 * r, const kvc_t_decoder * dec, float * tab);

// Rows x0 + i stride (i = 0..7) of a cache coded before RoPE, at positions pos[i], as
// kvc_t_decoder_row_at gives them (bit for bit), written as 8 columns: channel c of row i at
// y[c * ld + i]. The walk is moved to pos[0]. False, with nothing written, when the rows cannot
// be taken together (positions in more than one run of KVC_T_ROPE_STEPS from a multiple of it,
// a walk without the plan's rotation, a stride past 32 bits); the caller reads them one by one.
bool kvc_t_decoder_rows8(const kvc_t_decoder * dec, const kvc_t_rows8 * r, kvc_t_rope_walk * w, const uint8_t * x0,
                         int64_t stride, const int64_t * pos, float * y, int64_t ld);

// The most queries kvc_t_decoder_dots scores a row against.
#define KVC_T_DOTS_MAX_Q 16

// Scores of n rows of one KV head against gn <= KVC_T_DOTS_MAX_Q queries of the plan's head
// size: d[g * ld + i] = q[g] . (row i). Row i lies at rows[i]; with a walk (a cache coded before
// RoPE) it is turned to position pos[i], the walk moving from row to row as it would over
// kvc_t_decoder_row_at. One call decodes each row once for all the queries and adds up 16 rows'
// products at a time, so a decode step pays neither a call nor a horizontal sum per key.
void kvc_t_decoder_dots(const kvc_t_decoder * dec, kvc_t_rope_walk * w, const uint8_t * const * rows, const int64_t * pos,
                        int32_t n, const float * const * q, int32_t gn, float * d, int32_t ld);

#ifdef __cplusplus
}
#endif
