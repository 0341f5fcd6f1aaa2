// The pieces of the CPU attention kernel over kvc caches (kvc-fattn.cpp): a node's sources and
// rows, its work units and tiles, and the two parts of a row's keys (the main cells, the exact
// keys) that kvc-fattn-parts.cpp computes. Internal to the CPU backend.

#pragma once

#include "kvc-kvct-cpu.h"
#include "ggml.h"
#include "ggml-cpu.h"
#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvc_fa {

constexpr int64_t KVC_FA_TILE_Q  = GGML_FA_TILE_Q;  // prompt rows per tile (the plan sizes the scratch for these)
constexpr int64_t KVC_FA_TILE_KV = GGML_FA_TILE_KV; // prompt keys per tile
constexpr int64_t KVC_FA_PAD     = 16;              // floats between two threads' scratch (a cache line)
constexpr int64_t KVC_MAX_ROW    = 1024;            // prompt K row bound (a stack row before the transpose)
constexpr int     KVC_FA_N_SRC   = 3;               // key sources of a node, one after the other
constexpr size_t  KVC_FA_SHARED_MAX = (size_t) 256 << 20; // bytes of a prompt's shared tiles (shared_floats)

typedef void (*row_to_f32_t)(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n);

// One K or V source of the node: rows of n keys, indexed [key, KV head, stream].
struct fa_src {
    const char * data = nullptr;
    size_t       nb1 = 0, nb2 = 0, nb3 = 0;
    ggml_type    type = GGML_TYPE_COUNT;
    int64_t      n = 0;
    int64_t      r3 = 1; // query streams per source stream
    const kvc_t_decoder * plans = nullptr; // per KV head, for kvct rows
    const kvc_t_rows8 *   rows8 = nullptr; // per KV head, where this build decodes rows 8 at a time
    bool ref = false;                    // kvct rows through the format's reference
    // kvct rows coded before RoPE: the layer's RoPE and the positions of the cache's cells
    // ([cells, streams]; this source's first stream is s0)
    const kvc_t_rope *       rope  = nullptr;
    const kvc_t_rope_steps * steps = nullptr;
    const int32_t *          pos   = nullptr;
    int64_t            pos_ne0 = 0, s0 = 0;

    const char * row(int64_t j, int64_t hk, int64_t s) const {
        return data + j * nb1 + hk * nb2 + (s / r3) * nb3;
    }

    // the position of cell j in stream s (rows coded before RoPE)
    int64_t key_pos(int64_t j, int64_t s) const {
        return pos[(s0 + s / r3) * pos_ne0 + j];
    }

    // row j of KV head hk in stream s, as F32 (to_f32: the row converter of a type without
    // plans); a row coded before RoPE is turned to its key's position, through `walk` (which
    // rope set up) or, for the reference, from the exact angles
    void row_f32(row_to_f32_t to_f32, int64_t j, int64_t hk, int64_t s, float * y, int64_t d, kvc_t_rope_walk * walk) const {
        const uint8_t * x = (const uint8_t *) row(j, hk, s);
        if (!plans) {
            to_f32(x, y, d);
            return;
        }
        if (!rope) {
            if (ref) {
                dequantize_row_kvct(plans[hk].plan, x, y);
            } else {
                kvc_t_decoder_row(&plans[hk], x, y);
            }
            return;
        }
        const int64_t p = key_pos(j, s);
        if (ref) {
            float c[KVC_T_MAX_D / 2], sn[KVC_T_MAX_D / 2];
            dequantize_row_kvct(plans[hk].plan, x, y);
            kvc_t_rope_cs(rope, p, c, sn);
            kvc_t_rope_row(plans[hk].plan, c, sn, 0, y);
        } else {
            kvc_t_rope_walk_to(walk, p);
            kvc_t_decoder_row_at(&plans[hk], x, walk, y);
        }
    }

    // the walk of this source's keys of KV head hk (unused without a RoPE)
    void walk_init(kvc_t_rope_walk & w, int64_t hk) const {
        if (rope) {
            kvc_t_rope_walk_init(&w, rope, steps, &plans[hk]);
        }
    }
};

inline fa_src make_src(const ggml_tensor * t, int64_t n_stream) {
    fa_src s;
    if (t) {
        s.data = (const char *) t->data;
        s.nb1 = t->nb[1];
        s.nb2 = t->nb[2];
        s.nb3 = t->nb[3];
        s.type = t->type;
        s.n = t->ne[1];
        s.r3 = n_stream / t->ne[3];
    }
    return s;
}

struct fa_node {
    const ggml_tensor * q;
    const ggml_tensor * mask;
    const ggml_tensor * sinks;
    ggml_tensor *       dst;
    fa_src   k[KVC_FA_N_SRC], v[KVC_FA_N_SRC]; // main cells, exact slots, exact rows of the ubatch (F32 read as F16)
    const int32_t * order = nullptr; // per stream, the exact keys in the order they are taken (-1 ends a list)
    int64_t  order_ld = 0;
    int64_t  DK, DV, n_q, n_head, n_head_kv, n_stream, G, n_keys;
    float    scale, softcap, max_bias, m0, m1;
    uint32_t n_head_log2;
    bool     ref;

    float slope(int64_t h) const {
        if (max_bias <= 0.0f) {
            return 1.0f;
        }
        return (uint32_t) h < n_head_log2 ? powf(m0, (float) (h + 1)) : powf(m1, (float) (2 * (h - n_head_log2) + 1));
    }

    const float * q_row(int64_t iq, int64_t h, int64_t s) const {
        return (const float *) ((const char *) q->data + iq * q->nb[1] + h * q->nb[2] + s * q->nb[3]);
    }

    const ggml_fp16_t * mask_row(int64_t iq, int64_t h, int64_t s) const {
        if (!mask) {
            return nullptr;
        }
        return (const ggml_fp16_t *) ((const char *) mask->data + iq * mask->nb[1] +
                                      (h % mask->ne[2]) * mask->nb[2] + (s % mask->ne[3]) * mask->nb[3]);
    }

    // dst is [DV, n_head, n_q, n_stream]
    float * out_row(int64_t iq, int64_t h, int64_t s) const {
        return (float *) ((char *) dst->data + ((s * n_q + iq) * n_head + h) * dst->nb[1]);
    }

    // the score of a key: scaled dot product, softcap, then the mask (already times the slope)
    float score(float dot, float mv) const {
        float x = dot * scale;
        if (softcap != 0.0f) {
            x = softcap * tanhf(x);
        }
        return x + mv;
    }
};

// A node's work units: (stream, KV head, group of at most max_group of its query heads).
struct fa_units {
    int64_t n_hg; // groups per KV head
    int64_t gh;   // query heads per group (the last may have fewer)
    int64_t n;

    fa_units(int64_t G, int64_t n_stream, int64_t n_head_kv, int64_t max_group) :
        n_hg((G + max_group - 1) / max_group), gh((G + n_hg - 1) / n_hg), n(n_stream * n_head_kv * n_hg) {}
    fa_units(const fa_node & a, int64_t max_group) : fa_units(a.G, a.n_stream, a.n_head_kv, max_group) {}

    struct unit {
        int64_t s, hk, h0, gn; // stream, KV head, first query head, query heads
    };

    unit at(const fa_node & a, int64_t i) const {
        const int64_t hg = i % n_hg;
        const int64_t hk = (i / n_hg) % a.n_head_kv;
        return { i / (n_hg * a.n_head_kv), hk, hk * a.G + hg * gh, std::min(gh, a.G - hg * gh) };
    }
};

constexpr int64_t KVC_FA_SEG = 256; // main cells a decode step scores per work item

static_assert(KVC_FA_SEG % KVC_FA_TILE_KV == 0, "a segment is whole tiles");

// floats of a prompt work item's scores, at most (fewer rows per item past them)
constexpr int64_t KVC_FA_SCORES_MAX = (int64_t) 1 << 21;

inline size_t prompt_scratch_floats(int64_t DK, int64_t DV) {
    return KVC_FA_TILE_Q * DK + 2 * KVC_FA_TILE_Q * KVC_FA_TILE_KV + KVC_FA_TILE_Q * DV + KVC_FA_TILE_KV * DV +
           KVC_FA_TILE_KV * DK + KVC_FA_PAD;
}

inline int64_t n_tiles_of(int64_t n) {
    return (n + KVC_FA_TILE_KV - 1) / KVC_FA_TILE_KV;
}

// query tokens of a prompt's work item over n_main main cells: as many as fill a tile's rows
// with the units' query heads, fewer where their scores would pass KVC_FA_SCORES_MAX
inline int64_t prompt_block(const fa_units & units, int64_t n_main) {
    const int64_t per_token = units.gh * std::max<int64_t>(1, n_tiles_of(n_main)) * KVC_FA_TILE_KV;
    return std::max<int64_t>(1, std::min(KVC_FA_TILE_Q / units.gh, KVC_FA_SCORES_MAX / per_token));
}

// The main cells' K and V tiles, converted once per node for all blocks of query tokens, in
// the plan's buffer: K [stream][KV head][tile][DK][TK], then V [stream][KV head][tile][TK][DV].
// A block converting every tile it sees again is what made prompts over a kvct cache slower
// than over kvc4: a 512-token ubatch of 3 or 4 query heads per KV head is 25-32 blocks.
struct shared_tiles {
    int64_t n_tiles = 0;         // per stream and KV head
    float * k = nullptr;         // nullptr: each block converts the tiles it sees
    float * v = nullptr;
    int64_t n_sk = 0, n_sv = 0;  // streams of K and V
    int64_t n_head_kv = 0, DK = 0, DV = 0;

    // Lays the tiles out from p (none: only counts); returns the floats they take.
    size_t layout(const fa_src & ks, const fa_src & vs, int64_t n_stream, int64_t n_head_kv_, int64_t DK_, int64_t DV_, float * p) {
        n_head_kv = n_head_kv_;
        DK = DK_;
        DV = DV_;
        n_tiles = n_tiles_of(ks.n);
        n_sk = ks.n ? n_stream / ks.r3 : 0;
        n_sv = ks.n ? n_stream / vs.r3 : 0;
        const size_t nk = (size_t) (n_sk * n_head_kv * n_tiles * KVC_FA_TILE_KV * DK);
        k = p;
        v = p ? p + nk : nullptr;
        return nk + (size_t) (n_sv * n_head_kv * n_tiles * KVC_FA_TILE_KV * DV);
    }

    const float * k_tile(int64_t sk, int64_t hk, int64_t j0) const {
        return k + ((sk * n_head_kv + hk) * n_tiles + j0 / KVC_FA_TILE_KV) * KVC_FA_TILE_KV * DK;
    }
    const float * v_tile(int64_t sv, int64_t hk, int64_t j0) const {
        return v + ((sv * n_head_kv + hk) * n_tiles + j0 / KVC_FA_TILE_KV) * KVC_FA_TILE_KV * DV;
    }
};
// The rows of a work item: query tokens [t0, t1) x query heads h0 .. h0 + gn - 1 of KV head hk
// in stream s, row r = (t - t0) * gn + g; and this thread's scratch (prompt_scratch_floats).
struct fa_rows {
    int64_t s, hk, h0, gn, t0, t1;
    float * Qt;  // [R][DK] the queries
    float * KQ;  // [R][TK] scores, then probabilities
    float * MK;  // [R][TK] mask times slope
    float * VKQ; // [R][DV] a part's output
    float * V32; // [TK][DV]
    float * K32; // [DK][TK], a tile transposed
    float   M[KVC_FA_TILE_Q], S[KVC_FA_TILE_Q]; // a part's maximum and sum per row

    fa_rows(const fa_node & a, const fa_units::unit & u, int64_t t0_, int64_t t1_, float * scratch) :
        s(u.s), hk(u.hk), h0(u.h0), gn(u.gn), t0(t0_), t1(t1_) {
        Qt  = scratch;
        KQ  = Qt + KVC_FA_TILE_Q * a.DK;
        MK  = KQ + KVC_FA_TILE_Q * KVC_FA_TILE_KV;
        VKQ = MK + KVC_FA_TILE_Q * KVC_FA_TILE_KV;
        V32 = VKQ + KVC_FA_TILE_Q * a.DV;
        K32 = V32 + KVC_FA_TILE_KV * a.DV;
        for (int r = 0; r < n(); ++r) {
            memcpy(Qt + r * a.DK, a.q_row(token(r), head(r), s), a.DK * sizeof(float));
        }
    }

    int     n() const { return (int) ((t1 - t0) * gn); }
    int64_t token(int r) const { return t0 + r / gn; }
    int64_t head(int r) const { return h0 + r % gn; }

    // MK[r][c] = the mask of column cols[c] times the row's slope, -inf past nk; whether any
    // row sees any of them
    bool mask_tile(const fa_node & a, const int64_t * cols, int nk) {
        bool any = false;
        for (int r = 0; r < n(); ++r) {
            const ggml_fp16_t * mp = a.mask_row(token(r), head(r), s);
            const float slope = a.slope(head(r));
            float * mk = MK + r * KVC_FA_TILE_KV;
            for (int c = 0; c < nk; ++c) {
                mk[c] = mp ? slope * GGML_CPU_FP16_TO_FP32(mp[cols[c]]) : 0.0f;
                any |= mk[c] != -INFINITY;
            }
            for (int c = nk; c < KVC_FA_TILE_KV; ++c) {
                mk[c] = -INFINITY;
            }
        }
        return any;
    }

    void reset(int64_t DV) {
        for (int r = 0; r < n(); ++r) {
            M[r] = -INFINITY;
            S[r] = 0.0f;
        }
        memset(VKQ, 0, (size_t) n() * DV * sizeof(float));
    }
};

// as_f16: F32 rows are read as their F16 rounding
row_to_f32_t get_row_to_f32(ggml_type t, bool ref, bool as_f16 = false);

// Folds a part's (pM, pS, pacc) into a running (M, S, acc); a part that saw nothing is left out.
void combine(float & M, float & S, float * acc, float pM, float pS, const float * pacc, int64_t DV);

// Keys [j0, j0 + nk) of KV head hk in stream s as one tile of F32 columns, K32[DK][TK] (the
// layout gemm_f32 multiplies), the columns past nk zero.
void k_tile_f32(const fa_src & K, row_to_f32_t to_f32, int64_t j0, int nk, int64_t hk, int64_t s, int64_t DK,
                kvc_t_rope_walk * walk, float * K32);

// Keys [j0, j0 + nk) of KV head hk in stream s as one tile of F32 rows, V32[TK][DV], the rows
// past nk zero.
void v_tile_f32(const fa_src & V, row_to_f32_t to_f32, int64_t j0, int nk, int64_t hk, int64_t s, int64_t DV, float * V32);

// The rows' scores of the main cells' tiles [t0, t1): tile t at sc + t * ld * TK, row r at
// + r * TK (-inf where the row does not see the key); each row's maximum folded into M.
void main_scores(const fa_node & a, fa_rows & rows, int64_t t0, int64_t t1, const shared_tiles & sh, float * sc, int64_t ld,
                 float * M);

// The rows' output values [d0, d0 + W) over the main cells, from their scores sc (laid out as
// main_scores lays them) and maxima M: acc[r][W] gets each key's value times exp(score - M),
// one chain per value in cell order, and S (unless null) each row's sum of those in the same
// order. A tile no row sees is left out: it would add exact zeros.
void main_values(const fa_node & a, fa_rows & rows, const float * sc, int64_t ld, const float * M, int64_t d0, int64_t W,
                 float * acc, float * S, const shared_tiles & sh);

// The exact keys (the slots, then the ubatch's rows: keys e of [0, n1 + n2)) for the rows:
// their part in rows.M, S and VKQ. The keys come in tiles of the node's order, which a prompt
// and a decode step fill with different keys, so nothing may depend on a tile's bounds: a
// first pass takes each row's maximum over the keys it sees, a second adds each key's
// probability and value to the row's running sum and output one key after the other (as
// simd_gemm adds a tile's keys), where an unseen key adds an exact zero.
void exact_part(const fa_node & a, fa_rows & rows);

// The end of a row: the sinks, then out = acc / S (zeros when nothing was visible).
void finish_row(const fa_node & a, int64_t h, float & M, float & S, float * acc);

} // namespace kvc_fa
