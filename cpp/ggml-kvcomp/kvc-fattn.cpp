// CPU flash attention over kvc caches and over several sources: the main cells (any cache
// type) and the residual buffer's exact F16 rows (ggml_flash_attn_ext_add_exact: its slots,
// then the ubatch's own rows), under one softmax and one mask. The main cells are dequantized
// in 64-key tiles, once per node when several blocks of query tokens read them (into the
// plan's buffer, at most KVC_FA_SHARED_MAX bytes), else into per-thread scratch.
//
// One kernel serves decode steps and prompts ("One arithmetic per query" below), with a scalar
// reference (params->use_ref) that the SIMD path is held to (cpp/tests/test-kvc-ops.cpp). Its
// rows (query tokens x the query heads of a KV head, at most 64) meet 64-key tiles of the main
// cells dequantized to F32 and multiplied as upstream's tiled F16 kernel does; a prompt makes
// the tiles once for all its blocks (shared_tiles). A kvct K cache (ggml_kvct_set_plans) is
// read through its KV head's plan (kvc-kvct-cpu.h), each row decoded to F32 and turned to its
// key's position by angles that depend on the position alone (kvc_t_rope_walk).

#include "kvc-cpu.h"
#include "kvc-kvct-cpu.h"
#include "kvc-simd.h"
#include "ggml-kvcomp.h"
#include "ggml-cpu.h"
#include "common.h"
#include "simd-gemm.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t KVC_FA_TILE_Q  = GGML_FA_TILE_Q;  // prompt rows per tile (the plan sizes the scratch for these)
constexpr int64_t KVC_FA_TILE_KV = GGML_FA_TILE_KV; // prompt keys per tile
constexpr int64_t KVC_FA_PAD     = 16;              // floats between two threads' scratch (a cache line)
constexpr int64_t KVC_MAX_ROW    = 1024;            // prompt K row bound (a stack row before the transpose)
constexpr int     KVC_FA_N_SRC   = 3;               // key sources of a node, one after the other
constexpr size_t  KVC_FA_SHARED_MAX = (size_t) 256 << 20; // bytes of a prompt's shared tiles (shared_floats)

typedef void (*row_to_f32_t)(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n);

void row_f32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    memcpy(y, x, n * sizeof(float));
}

void row_f16_simd(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) x, y, n);
}

// F32 rows read as the F16 values the buffer's slots keep of them (the ubatch's exact rows);
// both directions round to nearest even in either version, so they agree bit for bit.
void row_f32_as_f16_ref(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        y[i] = GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(((const float *) x)[i]));
    }
}

void row_f32_as_f16_simd(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    ggml_fp16_t h[KVC_MAX_ROW];
    GGML_ASSERT(n <= KVC_MAX_ROW);
    ggml_cpu_fp32_to_fp16((const float *) x, h, n);
    ggml_cpu_fp16_to_fp32(h, y, n);
}

// as_f16: F32 rows are read as their F16 rounding
row_to_f32_t get_row_to_f32(ggml_type t, bool ref, bool as_f16 = false) {
    if (t == GGML_TYPE_F32) {
        return as_f16 ? (ref ? row_f32_as_f16_ref : row_f32_as_f16_simd) : row_f32;
    }
    if (ref) {
        return ggml_get_type_traits(t)->to_float;
    }
    return t == GGML_TYPE_F16 ? row_f16_simd : ggml_kvc_cpu_get_to_float(t);
}

void scale_f32(float * y, float s, int64_t n, bool ref) {
    if (ref) {
        for (int64_t i = 0; i < n; ++i) {
            y[i] *= s;
        }
        return;
    }
    ggml_vec_scale_f32((int) n, y, s);
}

// y[j] = exp(x[j] - m) (exp(-inf) = 0; y may be x); each value alike at any index of a tile
// of n = KVC_FA_TILE_KV (whole SIMD vectors).
void exp_tile(float * y, const float * x, int n, float m, bool ref) {
    if (ref) {
        for (int j = 0; j < n; ++j) {
            y[j] = x[j] == -INFINITY ? 0.0f : expf(x[j] - m);
        }
    } else {
        ggml_vec_soft_max_f32(n, y, x, m);
    }
}

// C[M x N] += A[M x K] * B[K x N]
void gemm_f32(float * C, const float * A, const float * B, int M, int K, int N, bool ref) {
    if (!ref) {
        simd_gemm(C, A, B, M, K, N);
        return;
    }
    // one chain per output value, continued from C as simd_gemm continues it
    for (int i = 0; i < M; ++i) {
        for (int j = 0; j < N; ++j) {
            float s = C[i * N + j];
            for (int k = 0; k < K; ++k) {
                s += A[i * K + k] * B[k * N + j];
            }
            C[i * N + j] = s;
        }
    }
}

// One K or V source of the node: rows of n keys, indexed [key, KV head, stream].
struct fa_src {
    const char * data = nullptr;
    size_t       nb1 = 0, nb2 = 0, nb3 = 0;
    ggml_type    type = GGML_TYPE_COUNT;
    int64_t      n = 0;
    int64_t      r3 = 1; // query streams per source stream
    const kvc_t_decoder * plans = nullptr; // per KV head, for kvct rows
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

fa_src make_src(const ggml_tensor * t, int64_t n_stream) {
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

// Folds the sink logit s into a running (M, S, acc).
void add_sink(float s, float & M, float & S, float * acc, int64_t DV, bool ref) {
    if (s > M) {
        const float ms = expf(M - s);
        scale_f32(acc, ms, DV, ref);
        S = S * ms + 1.0f;
        M = s;
    } else {
        S += expf(s - M);
    }
}

// out = acc / S (zeros when nothing was visible)
void write_row(float * out, const float * acc, float S, int64_t DV) {
    const float inv = S == 0.0f ? 0.0f : 1.0f / S;
    for (int64_t i = 0; i < DV; ++i) {
        out[i] = acc[i] * inv;
    }
}

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

// ---------------------------------------------------------------------------------------
// One arithmetic per query
//
// A row's output depends on the keys it sees, taken in the order of their cells, and on
// nothing else: not on the ubatch its token came in, not on whether the token is decoded again
// after a cut-back, not on which cells other sequences of a unified cache hold between its own.
//  - the main cells take two passes over 64-cell tiles. The first scores every key (simd_gemm:
//    one chain of fused multiply-adds per score whatever the tile) and takes each row's exact
//    maximum. The second turns the scores into exp(score - maximum), adds them to the row's
//    sum one after the other in cell order, and adds each key's value to the row's outputs in
//    that order (simd_gemm continues one chain per output value from tile to tile). A key the
//    row does not see adds exact zeros, so where the tiles start among its cells, and what
//    the cells between its own hold, change nothing; nor does a tile or a segment rescale.
//  - the exact keys (the slots and the ubatch's own rows) are taken in the node's order (the
//    cells they hold, ggml_flash_attn_ext_set_exact_order) against each row's maximum over
//    them, each key's terms added to the row's sums in that order: a key read from a slot in
//    a decode step is read from the ubatch's rows in a prompt, and neither where it lies nor
//    which other keys are masked changes its turn;
//  - the two parts are combined in order, then the sinks.
// A decode step spreads the first pass over (unit, segment of cells) and the second over
// (unit, slice of the output values); a prompt's work item runs both for its block of rows.

constexpr int64_t KVC_FA_SEG = 256; // main cells a decode step scores per work item

static_assert(KVC_FA_SEG % KVC_FA_TILE_KV == 0, "a segment is whole tiles");

// floats of a prompt work item's scores, at most (fewer rows per item past them)
constexpr int64_t KVC_FA_SCORES_MAX = (int64_t) 1 << 21;

// Folds a part's (pM, pS, pacc) into a running (M, S, acc); a part that saw nothing is left out.
void combine(float & M, float & S, float * acc, float pM, float pS, const float * pacc, int64_t DV) {
    if (pS == 0.0f) {
        return;
    }
    const float Mn = std::max(M, pM);
    const float so = expf(M - Mn);
    const float sn = expf(pM - Mn);
    for (int64_t i = 0; i < DV; ++i) {
        acc[i] = acc[i] * so + pacc[i] * sn;
    }
    S = S * so + pS * sn;
    M = Mn;
}

size_t prompt_scratch_floats(int64_t DK, int64_t DV) {
    return KVC_FA_TILE_Q * DK + 2 * KVC_FA_TILE_Q * KVC_FA_TILE_KV + KVC_FA_TILE_Q * DV + KVC_FA_TILE_KV * DV +
           KVC_FA_TILE_KV * DK + KVC_FA_PAD;
}

int64_t n_tiles_of(int64_t n) {
    return (n + KVC_FA_TILE_KV - 1) / KVC_FA_TILE_KV;
}

// query tokens of a prompt's work item over n_main main cells: as many as fill a tile's rows
// with the units' query heads, fewer where their scores would pass KVC_FA_SCORES_MAX
int64_t prompt_block(const fa_units & units, int64_t n_main) {
    const int64_t per_token = units.gh * std::max<int64_t>(1, n_tiles_of(n_main)) * KVC_FA_TILE_KV;
    return std::max<int64_t>(1, std::min(KVC_FA_TILE_Q / units.gh, KVC_FA_SCORES_MAX / per_token));
}

// Keys [j0, j0 + nk) of KV head hk in stream s as one tile of F32 columns, K32[DK][TK] (the
// layout gemm_f32 multiplies), the columns past nk zero.
void k_tile_f32(const fa_src & K, row_to_f32_t to_f32, int64_t j0, int nk, int64_t hk, int64_t s, int64_t DK,
                kvc_t_rope_walk * walk, float * K32) {
    const int64_t TK = KVC_FA_TILE_KV;
    float kt[KVC_MAX_ROW];
    for (int c = 0; c < nk; ++c) {
        K.row_f32(to_f32, j0 + c, hk, s, kt, DK, walk);
        for (int64_t d = 0; d < DK; ++d) {
            K32[d * TK + c] = kt[d];
        }
    }
    for (int c = nk; c < TK; ++c) {
        for (int64_t d = 0; d < DK; ++d) {
            K32[d * TK + c] = 0.0f;
        }
    }
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

// Floats of the shared tiles: 0 when a node has one block of query tokens per KV head (nothing
// to share) and past KVC_FA_SHARED_MAX bytes (a long context keeps the per-block conversion).
size_t shared_floats(const fa_src & ks, const fa_src & vs, int64_t n_stream, int64_t n_head_kv, int64_t DK, int64_t DV,
                     int64_t n_q, int64_t G) {
    if (n_q <= prompt_block(fa_units(G, 1, n_head_kv, KVC_FA_TILE_Q), ks.n)) {
        return 0;
    }
    const size_t n = shared_tiles().layout(ks, vs, n_stream, n_head_kv, DK, DV, nullptr);
    return n * sizeof(float) > KVC_FA_SHARED_MAX ? 0 : n;
}

// Keys [j0, j0 + nk) of KV head hk in stream s as one tile of F32 rows, V32[TK][DV], the rows
// past nk zero.
void v_tile_f32(const fa_src & V, row_to_f32_t to_f32, int64_t j0, int nk, int64_t hk, int64_t s, int64_t DV, float * V32) {
    for (int c = 0; c < nk; ++c) {
        to_f32(V.row(j0 + c, hk, s), V32 + c * DV, DV);
    }
    if (nk < KVC_FA_TILE_KV) {
        memset(V32 + nk * DV, 0, (size_t) (KVC_FA_TILE_KV - nk) * DV * sizeof(float));
    }
}
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

// A row's scores of a tile from its dot products kq and its mask mk (-inf: not seen).
void score_row(const fa_node & a, float * kq, const float * mk) {
    for (int c = 0; c < KVC_FA_TILE_KV; ++c) {
        kq[c] = mk[c] == -INFINITY ? -INFINITY : a.score(kq[c], mk[c]);
    }
}

// The rows' scores of the main cells' tiles [t0, t1): tile t at sc + t * ld * TK, row r at
// + r * TK (-inf where the row does not see the key); each row's maximum folded into M.
void main_scores(const fa_node & a, fa_rows & rows, int64_t t0, int64_t t1, const shared_tiles & sh, float * sc, int64_t ld,
                 float * M) {
    const bool     ref = a.ref;
    const fa_src & K = a.k[0];
    const int64_t  DK = a.DK, TK = KVC_FA_TILE_KV;
    const int      R = rows.n();
    const row_to_f32_t k_to_f32 = K.plans ? nullptr : get_row_to_f32(K.type, ref);

    kvc_t_rope_walk walk;
    K.walk_init(walk, rows.hk);
    int64_t cols[KVC_FA_TILE_KV];
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t j0 = t * TK;
        const int     nk = (int) std::min(TK, K.n - j0);
        float * st = sc + t * ld * TK;
        std::iota(cols, cols + nk, j0);
        if (!rows.mask_tile(a, cols, nk)) {
            std::fill(st, st + R * TK, -INFINITY);
            continue;
        }
        const float * Kt = rows.K32;
        if (sh.k) {
            Kt = sh.k_tile(rows.s / K.r3, rows.hk, j0);
        } else {
            k_tile_f32(K, k_to_f32, j0, nk, rows.hk, rows.s, DK, &walk, rows.K32);
        }
        memset(st, 0, (size_t) R * TK * sizeof(float));
        gemm_f32(st, rows.Qt, Kt, R, (int) DK, (int) TK, ref);
        for (int r = 0; r < R; ++r) {
            float * kq = st + r * TK;
            score_row(a, kq, rows.MK + r * TK);
            for (int c = 0; c < TK; ++c) {
                M[r] = std::max(M[r], kq[c]);
            }
        }
    }
}

// The rows' output values [d0, d0 + W) over the main cells, from their scores sc (laid out as
// main_scores lays them) and maxima M: acc[r][W] gets each key's value times exp(score - M),
// one chain per value in cell order, and S (unless null) each row's sum of those in the same
// order. A tile no row sees is left out: it would add exact zeros.
void main_values(const fa_node & a, fa_rows & rows, const float * sc, int64_t ld, const float * M, int64_t d0, int64_t W,
                 float * acc, float * S, const shared_tiles & sh) {
    const fa_src & V = a.v[0];
    const int64_t  TK = KVC_FA_TILE_KV, n_t = n_tiles_of(V.n);
    const int      R = rows.n();
    const row_to_f32_t v_to_f32 = get_row_to_f32(V.type, a.ref);
    const size_t   off = ggml_row_size(V.type, d0);
    float * p = rows.KQ;
    for (int64_t t = 0; t < n_t; ++t) {
        bool any = false;
        for (int r = 0; r < R; ++r) {
            const float * st = sc + (t * ld + r) * TK;
            float *       pr = p + r * TK;
            if (M[r] == -INFINITY) {
                memset(pr, 0, TK * sizeof(float));
                continue;
            }
            exp_tile(pr, st, (int) TK, M[r], a.ref);
            for (int c = 0; c < TK && !any; ++c) {
                any = pr[c] != 0.0f;
            }
        }
        if (!any) {
            continue;
        }
        if (S) {
            for (int r = 0; r < R; ++r) {
                for (int c = 0; c < TK; ++c) {
                    S[r] += p[r * TK + c];
                }
            }
        }
        const int64_t j0 = t * TK;
        const float * Vt = rows.V32;
        if (sh.v && W == a.DV) {
            Vt = sh.v_tile(rows.s / V.r3, rows.hk, j0);
        } else {
            const int nk = (int) std::min(TK, V.n - j0);
            for (int c = 0; c < nk; ++c) {
                v_to_f32(V.row(j0 + c, rows.hk, rows.s) + off, rows.V32 + c * W, W);
            }
            if (nk < TK) {
                memset(rows.V32 + nk * W, 0, (size_t) (TK - nk) * W * sizeof(float));
            }
        }
        gemm_f32(acc, p, Vt, R, (int) TK, (int) W, a.ref);
    }
}

// The exact keys (the slots, then the ubatch's rows: keys e of [0, n1 + n2)) for the rows:
// their part in rows.M, S and VKQ. The keys come in tiles of the node's order, which a prompt
// and a decode step fill with different keys, so nothing may depend on a tile's bounds: a
// first pass takes each row's maximum over the keys it sees, a second adds each key's
// probability and value to the row's running sum and output one key after the other (as
// simd_gemm adds a tile's keys), where an unseen key adds an exact zero.
void exact_part(const fa_node & a, fa_rows & rows) {
    const bool    ref = a.ref;
    const int64_t DK = a.DK, DV = a.DV, TK = KVC_FA_TILE_KV;
    const int     R = rows.n();
    const int64_t n1 = a.k[1].n, n_x = n1 + a.k[2].n, off = a.k[0].n;
    const int32_t * order = a.order ? a.order + rows.s * a.order_ld : nullptr;
    const row_to_f32_t k_to_f32[2] = { get_row_to_f32(a.k[1].type, ref), get_row_to_f32(a.k[2].type, ref, true) };
    const row_to_f32_t v_to_f32[2] = { get_row_to_f32(a.v[1].type, ref), get_row_to_f32(a.v[2].type, ref, true) };
    rows.reset(DV);

    int64_t keys[KVC_FA_TILE_KV], cols[KVC_FA_TILE_KV];
    // the tile of the order's entries [i0, i0 + TK): its keys and their mask in rows.MK, its
    // scores in rows.KQ; 0 when the order has ended, -1 when no row sees any of its keys
    const auto tile = [&](int64_t i0) -> int {
        int nk = 0;
        for (; nk < TK && i0 + nk < n_x; ++nk) {
            const int64_t e = order ? order[i0 + nk] : i0 + nk;
            if (e < 0) {
                break;
            }
            keys[nk] = e;
            cols[nk] = off + e;
        }
        if (nk == 0) {
            return 0;
        }
        if (!rows.mask_tile(a, cols, nk)) {
            return -1;
        }
        float kt[KVC_MAX_ROW];
        for (int c = 0; c < TK; ++c) {
            if (c < nk) {
                const int p = keys[c] < n1 ? 0 : 1;
                k_to_f32[p](a.k[1 + p].row(keys[c] - p * n1, rows.hk, rows.s), kt, DK);
            }
            for (int64_t d = 0; d < DK; ++d) {
                rows.K32[d * TK + c] = c < nk ? kt[d] : 0.0f;
            }
        }
        memset(rows.KQ, 0, (size_t) R * TK * sizeof(float));
        gemm_f32(rows.KQ, rows.Qt, rows.K32, R, (int) DK, (int) TK, ref);
        for (int r = 0; r < R; ++r) {
            score_row(a, rows.KQ + r * TK, rows.MK + r * TK);
        }
        return nk;
    };

    for (int64_t i0 = 0, nk; (nk = tile(i0)) != 0; i0 += TK) {
        if (nk < 0) {
            continue;
        }
        for (int r = 0; r < R; ++r) {
            const float * kq = rows.KQ + r * TK;
            for (int c = 0; c < TK; ++c) {
                rows.M[r] = std::max(rows.M[r], kq[c]);
            }
        }
    }
    for (int64_t i0 = 0, nk; (nk = tile(i0)) != 0; i0 += TK) {
        if (nk < 0) {
            continue;
        }
        for (int r = 0; r < R; ++r) {
            float * kq = rows.KQ + r * TK;
            if (rows.M[r] == -INFINITY) {
                memset(kq, 0, TK * sizeof(float));
                continue;
            }
            exp_tile(kq, kq, (int) TK, rows.M[r], ref);
            for (int c = 0; c < TK; ++c) {
                rows.S[r] += kq[c];
            }
        }
        // A key no row sees adds a zero row: its slot may hold another sequence's non-finite
        // values, which a zero weight would still turn into NaN in simd_gemm's products.
        for (int c = 0; c < TK; ++c) {
            float * vt = rows.V32 + c * DV;
            bool seen = false;
            for (int r = 0; r < R && c < nk && !seen; ++r) {
                seen = rows.MK[r * TK + c] != -INFINITY;
            }
            if (seen) {
                const int p = keys[c] < n1 ? 0 : 1;
                v_to_f32[p](a.v[1 + p].row(keys[c] - p * n1, rows.hk, rows.s), vt, DV);
            } else {
                memset(vt, 0, DV * sizeof(float));
            }
        }
        gemm_f32(rows.VKQ, rows.KQ, rows.V32, R, (int) TK, (int) DV, ref);
    }
}

// The end of a row: the sinks, then out = acc / S (zeros when nothing was visible).
void finish_row(const fa_node & a, int64_t h, float & M, float & S, float * acc) {
    if (a.sinks) {
        add_sink(((const float *) a.sinks->data)[h], M, S, acc, a.DV, a.ref);
    }
    write_row(acc, acc, S, a.DV);
}

// Where a decode step keeps its work between the barriers, after the threads' scratch: each
// unit's scores [tile][gh][TK], each unit's maxima per segment [segment][gh], and each output
// row's two parts (main cells, exact keys) as (M, S, acc[DV]).
struct decode_plan {
    int64_t n_t, n_seg, tps, gh, n_units, n_slice, W, part_size;
    size_t  n_sc, n_max, n_parts;

    decode_plan(const fa_src * ks, const fa_src * vs, int64_t n_stream, int64_t n_head, int64_t n_head_kv, int64_t DV, int nth) {
        const fa_units units(n_head / n_head_kv, n_stream, n_head_kv, KVC_FA_TILE_Q);
        n_t     = n_tiles_of(ks[0].n);
        tps     = KVC_FA_SEG / KVC_FA_TILE_KV;
        n_seg   = (n_t + tps - 1) / tps;
        gh      = units.gh;
        n_units = units.n;
        part_size = 2 + DV;
        // slices of whole blocks of V, enough for two items a thread; each slice's chains are
        // the same whatever the slicing, so the thread count changes no value
        const int64_t blck = vs[0].n ? ggml_blck_size(vs[0].type) : 1;
        const int64_t w0   = std::max<int64_t>(32, blck);
        const int64_t n_max_slice = w0 % blck == 0 && DV % w0 == 0 ? DV / w0 : 1;
        const int64_t want = std::max<int64_t>(1, (2 * nth + n_units - 1) / n_units);
        n_slice = 1;
        for (int64_t k = 1; k <= n_max_slice; ++k) {
            if (n_max_slice % k == 0 && k <= want) {
                n_slice = k;
            }
        }
        W       = DV / n_slice;
        n_sc    = (size_t) (n_units * n_t * gh * KVC_FA_TILE_KV);
        n_max   = (size_t) (n_units * n_seg * gh);
        n_parts = (size_t) (n_stream * n_head * 2 * part_size);
    }

    size_t floats() const { return n_sc + n_max + n_parts; }
};

// One query token per stream: (1) the (unit, segment) items score their cells and take their
// maxima, and an item per unit takes the exact keys' part; (2) the (unit, slice) items add the
// main cells' values of their slice; (3) each output row combines its parts.
void fa_decode(const ggml_compute_params * params, const fa_node & a) {
    const int ith = params->ith;
    const int nth = params->nth;

    const size_t per_thread = prompt_scratch_floats(a.DK, a.DV);
    const fa_units    units(a, KVC_FA_TILE_Q);
    const decode_plan pl(a.k, a.v, a.n_stream, a.n_head, a.n_head_kv, a.DV, nth);
    GGML_ASSERT(params->wsize >= (per_thread * nth + pl.floats()) * sizeof(float) && "kvcomp: flash attention scratch too small");
    float * scratch = (float *) params->wdata + per_thread * ith;
    float * sc      = (float *) params->wdata + per_thread * nth;
    float * seg_max = sc + pl.n_sc;
    float * parts   = seg_max + pl.n_max;
    const shared_tiles none;
    const bool has_exact = a.k[1].n + a.k[2].n > 0;

    const auto part = [&](const fa_rows & rows, int r, int64_t which) {
        return parts + ((rows.s * a.n_head + rows.head(r)) * 2 + which) * pl.part_size;
    };
    const auto row_max = [&](int64_t u, float * M) {
        for (int64_t r = 0; r < pl.gh; ++r) {
            M[r] = -INFINITY;
            for (int64_t g = 0; g < pl.n_seg; ++g) {
                M[r] = std::max(M[r], seg_max[(u * pl.n_seg + g) * pl.gh + r]);
            }
        }
    };

    for (int64_t i = ith; i < units.n * (pl.n_seg + (has_exact ? 1 : 0)); i += nth) {
        const int64_t u = i % units.n, g = i / units.n;
        fa_rows rows(a, units.at(a, u), 0, 1, scratch);
        if (g < pl.n_seg) {
            float * M = seg_max + (u * pl.n_seg + g) * pl.gh;
            std::fill(M, M + pl.gh, -INFINITY);
            main_scores(a, rows, g * pl.tps, std::min(pl.n_t, (g + 1) * pl.tps), none, sc + u * pl.n_t * pl.gh * KVC_FA_TILE_KV,
                        pl.gh, M);
        } else {
            exact_part(a, rows);
            for (int r = 0; r < rows.n(); ++r) {
                float * d = part(rows, r, 1);
                d[0] = rows.M[r];
                d[1] = rows.S[r];
                memcpy(d + 2, rows.VKQ + r * a.DV, a.DV * sizeof(float));
            }
        }
    }
    ggml_barrier(params->threadpool);

    for (int64_t i = ith; i < units.n * pl.n_slice; i += nth) {
        const int64_t u = i % units.n, l = i / units.n;
        fa_rows rows(a, units.at(a, u), 0, 1, scratch);
        const int R = rows.n();
        float M[KVC_FA_TILE_Q];
        row_max(u, M);
        rows.reset(pl.W);
        main_values(a, rows, sc + u * pl.n_t * pl.gh * KVC_FA_TILE_KV, pl.gh, M, l * pl.W, pl.W, rows.VKQ,
                    l == 0 ? rows.S : nullptr, none);
        for (int r = 0; r < R; ++r) {
            float * d = part(rows, r, 0);
            if (l == 0) {
                d[0] = M[r];
                d[1] = rows.S[r];
            }
            memcpy(d + 2 + l * pl.W, rows.VKQ + r * pl.W, pl.W * sizeof(float));
        }
    }
    ggml_barrier(params->threadpool);

    for (int64_t row = ith; row < a.n_stream * a.n_head; row += nth) {
        float * out = a.out_row(0, row % a.n_head, row / a.n_head);
        float M = -INFINITY, S = 0.0f;
        memset(out, 0, a.DV * sizeof(float));
        for (int64_t which = 0; which < 2; ++which) {
            if (which == 0 ? a.k[0].n > 0 : has_exact) {
                const float * d = parts + (row * 2 + which) * pl.part_size;
                combine(M, S, out, d[0], d[1], d + 2, a.DV);
            }
        }
        finish_row(a, row % a.n_head, M, S, out);
    }
}

// Several query tokens: a work item is (unit, block of query tokens); it runs the main cells'
// two passes over its scores sc, then the exact keys, and combines them in its output rows.
void prompt_item(const fa_node & a, const fa_units::unit & u, int64_t t0, int64_t t1, float * scratch, float * sc,
                 const shared_tiles & sh) {
    fa_rows rows(a, u, t0, t1, scratch);
    const int R = rows.n();
    float M[KVC_FA_TILE_Q], S[KVC_FA_TILE_Q];
    for (int r = 0; r < R; ++r) {
        M[r] = -INFINITY;
        S[r] = 0.0f;
        memset(a.out_row(rows.token(r), rows.head(r), rows.s), 0, a.DV * sizeof(float));
    }
    const auto fold = [&]() {
        for (int r = 0; r < R; ++r) {
            combine(M[r], S[r], a.out_row(rows.token(r), rows.head(r), rows.s), rows.M[r], rows.S[r], rows.VKQ + r * a.DV, a.DV);
        }
    };
    if (a.k[0].n > 0) {
        const int64_t n_t = n_tiles_of(a.k[0].n);
        rows.reset(a.DV);
        main_scores(a, rows, 0, n_t, sh, sc, R, rows.M);
        main_values(a, rows, sc, R, rows.M, 0, a.DV, rows.VKQ, rows.S, sh);
        fold();
    }
    if (a.k[1].n + a.k[2].n > 0) {
        exact_part(a, rows);
        fold();
    }
    for (int r = 0; r < R; ++r) {
        finish_row(a, rows.head(r), M[r], S[r], a.out_row(rows.token(r), rows.head(r), rows.s));
    }
}

// floats of a prompt work item's scores
size_t prompt_scores_floats(const fa_units & units, int64_t n_main) {
    return (size_t) (prompt_block(units, n_main) * units.gh * n_tiles_of(n_main) * KVC_FA_TILE_KV);
}

void fa_prompt(const ggml_compute_params * params, const fa_node & a) {
    const int ith = params->ith;
    const int nth = params->nth;

    const size_t per_thread = prompt_scratch_floats(a.DK, a.DV);
    const fa_units units(a, KVC_FA_TILE_Q);
    const int64_t  qb       = prompt_block(units, a.k[0].n);
    const int64_t  n_qb     = (a.n_q + qb - 1) / qb;
    const int64_t  n_items  = units.n * n_qb;
    const size_t   n_scores = prompt_scores_floats(units, a.k[0].n);
    GGML_ASSERT(params->wsize >= (per_thread + n_scores) * nth * sizeof(float) && "kvcomp: flash attention scratch too small");
    float * scratch = (float *) params->wdata + per_thread * ith;
    float * sc      = (float *) params->wdata + per_thread * nth + n_scores * ith;

    // The main cells' tiles, shared by the blocks and split over the threads; a K tile's rows
    // are turned to their positions by angles of the position alone, so its floats do not
    // depend on which thread made it.
    shared_tiles  sh;
    const size_t  n_shared = a.ref ? 0 : shared_floats(a.k[0], a.v[0], a.n_stream, a.n_head_kv, a.DK, a.DV, a.n_q, a.G);
    if (n_shared > 0 && params->wsize >= ((per_thread + n_scores) * nth + n_shared) * sizeof(float)) {
        const fa_src & K = a.k[0];
        const fa_src & V = a.v[0];
        sh.layout(K, V, a.n_stream, a.n_head_kv, a.DK, a.DV, (float *) params->wdata + (per_thread + n_scores) * nth);
        const int64_t n_t = sh.n_tiles;
        const row_to_f32_t k_to_f32 = K.plans ? nullptr : get_row_to_f32(K.type, false);
        const row_to_f32_t v_to_f32 = get_row_to_f32(V.type, false);
        const int64_t n_k = sh.n_sk * a.n_head_kv * n_t;
        const int64_t n_v = sh.n_sv * a.n_head_kv * n_t;
        for (int64_t u = ith; u < n_k + n_v; u += nth) {
            const int64_t uu = u < n_k ? u : u - n_k;
            const int64_t hk = uu / n_t % a.n_head_kv;
            const int64_t j0 = uu % n_t * KVC_FA_TILE_KV;
            const int     nk = (int) std::min(KVC_FA_TILE_KV, K.n - j0);
            const int64_t st = uu / (n_t * a.n_head_kv);
            if (u < n_k) {
                kvc_t_rope_walk walk;
                K.walk_init(walk, hk);
                k_tile_f32(K, k_to_f32, j0, nk, hk, st * K.r3, a.DK, &walk, sh.k + uu * KVC_FA_TILE_KV * a.DK);
            } else {
                v_tile_f32(V, v_to_f32, j0, nk, hk, st * V.r3, a.DV, sh.v + uu * KVC_FA_TILE_KV * a.DV);
            }
        }
    }

    if (ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);

    // the last query blocks see the most keys of a causal prompt: they go first
    for (int64_t i = ith; i < n_items; i = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        const int64_t b = n_qb - 1 - i / units.n;
        prompt_item(a, units.at(a, i % units.n), b * qb, std::min(a.n_q, (b + 1) * qb), scratch, sc, sh);
    }
}


bool readable(ggml_type t) {
    return t == GGML_TYPE_F32 || ggml_get_type_traits(t)->to_float != nullptr;
}

// What a thread reads a kvct K cache with, made from the node's plans tensor: a decoder per KV
// head and its RoPE's steps (rows coded before RoPE). Made anew by every thread for every node
// they cost about 2 us a node (the steps' angles in double, the decoders' tables: a decode node
// over 64 keys took 9.0 us, now 7.0, F16's 6.0); each thread keeps them per plans tensor and
// makes them again when its bytes change (a context that loads other statistics).
struct kvct_read {
    std::vector<uint8_t>              bytes; // the plans tensor they were made from
    std::vector<kvc_t_decoder>        dec;
    std::unique_ptr<kvc_t_rope_steps> steps;
};

constexpr size_t KVC_FA_READ_CACHE = 512; // plans tensors a thread keeps (a model's layers, a few contexts)

const kvct_read & kvct_read_of(const ggml_tensor * kp, int64_t n_head) {
    thread_local std::unordered_map<const void *, kvct_read> cache;
    if (cache.size() >= KVC_FA_READ_CACHE && cache.find(kp->data) == cache.end()) {
        cache.clear();
    }
    kvct_read &   r  = cache[kp->data];
    const size_t  nb = ggml_nbytes(kp);
    const auto *  p  = (const uint8_t *) kp->data;
    if (r.bytes.size() == nb && memcmp(r.bytes.data(), p, nb) == 0) {
        return r;
    }
    r.bytes.assign(p, p + nb);
    r.dec.resize(n_head);
    for (int64_t h = 0; h < n_head; ++h) {
        kvc_t_decoder_init(&r.dec[h], (const kvc_t_plan *) kp->data + h);
    }
    const kvc_t_rope * rope = (const kvc_t_rope *) ((const kvc_t_plan *) kp->data + n_head);
    r.steps.reset();
    if (rope->n_pairs > 0) {
        r.steps.reset(new kvc_t_rope_steps);
        kvc_t_rope_steps_init(r.steps.get(), rope);
    }
    return r;
}

// the shapes and types these kernels take
bool fits(const ggml_tensor * q, const ggml_tensor * k, const ggml_tensor * v) {
    return q->type == GGML_TYPE_F32 && (ggml_kvcomp_is_kvct(k->type) || readable(k->type)) && readable(v->type) &&
           k->ne[0] <= KVC_MAX_ROW && k->ne[0] % QK_KVC == 0 && q->ne[2] % k->ne[2] == 0 && k->ne[2] == v->ne[2] &&
           q->ne[3] % k->ne[3] == 0 && q->ne[3] % v->ne[3] == 0;
}

// a node these kernels run: it reads a kvc or kvct cache or a second, exact source
bool ours(const ggml_tensor * dst) {
    const ggml_tensor * k = dst->src[1];
    return dst->src[GGML_KVCOMP_FA_SRC_K_EXACT] || ggml_kvcomp_is_kvc(k->type) || ggml_kvcomp_is_kvc(dst->src[2]->type) ||
           ggml_kvcomp_is_kvct(k->type);
}

} // namespace

size_t ggml_kvc_cpu_flash_attn_ext_work_size(const struct ggml_tensor * dst, int n_threads) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    if (!ours(dst) || !fits(q, k, v)) {
        return 0;
    }
    const fa_src ks[KVC_FA_N_SRC] = { make_src(k, q->ne[3]), make_src(dst->src[GGML_KVCOMP_FA_SRC_K_EXACT], q->ne[3]),
                                      make_src(dst->src[GGML_KVCOMP_FA_SRC_K_UBATCH], q->ne[3]) };
    const fa_src vs[KVC_FA_N_SRC] = { make_src(v, q->ne[3]), make_src(dst->src[GGML_KVCOMP_FA_SRC_V_EXACT], q->ne[3]),
                                      make_src(dst->src[GGML_KVCOMP_FA_SRC_V_UBATCH], q->ne[3]) };
    // the threads' scratch takes KVC_FA_PAD floats more than upstream's
    const size_t pad = (size_t) (KVC_FA_PAD * n_threads);
    if (q->ne[1] == 1) {
        return (pad + decode_plan(ks, vs, q->ne[3], q->ne[2], k->ne[2], v->ne[0], n_threads).floats()) * sizeof(float);
    }
    const fa_units units(q->ne[2] / k->ne[2], q->ne[3], k->ne[2], KVC_FA_TILE_Q);
    return (pad + prompt_scores_floats(units, ks[0].n) * n_threads +
            shared_floats(ks[0], vs[0], q->ne[3], k->ne[2], k->ne[0], v->ne[0], q->ne[1], q->ne[2] / k->ne[2])) *
           sizeof(float);
}

bool ggml_kvc_cpu_flash_attn_ext(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const ggml_tensor * q  = dst->src[0];
    const ggml_tensor * k  = dst->src[1];
    const ggml_tensor * v  = dst->src[2];
    const ggml_tensor * ke = dst->src[GGML_KVCOMP_FA_SRC_K_EXACT];
    const ggml_tensor * ve = dst->src[GGML_KVCOMP_FA_SRC_V_EXACT];
    const ggml_tensor * kn = dst->src[GGML_KVCOMP_FA_SRC_K_UBATCH];
    const ggml_tensor * vn = dst->src[GGML_KVCOMP_FA_SRC_V_UBATCH];

    const bool kvct = ggml_kvcomp_is_kvct(k->type);
    if (!ours(dst)) {
        return false;
    }
    const ggml_tensor * kp = dst->src[GGML_KVCOMP_FA_SRC_K_PLANS];
    if (kvct) {
        GGML_ASSERT(kp && "kvcomp: a kvct K cache is read with its plans (llama_kvcomp_set_k_stats)");
        const kvc_t_plan * plan = (const kvc_t_plan *) kp->data;
        GGML_ASSERT(kvc_t_plans_n_head(ggml_nbytes(kp)) == k->ne[2] && plan[0].d == k->ne[0] &&
                    plan[0].row_bits == kvc_t_type_row_bits(k->type, k->ne[0]) && "kvcomp: kvct plans of another shape");
    }
    if (!fits(q, k, v)) {
        GGML_ASSERT(!ke && "kvcomp: two-source attention needs F32 queries, readable K/V and head sizes that are multiples of 32 up to 1024");
        return false;
    }

    fa_node a;
    a.q     = q;
    a.mask  = dst->src[3];
    a.sinks = dst->src[4];
    a.dst   = dst;
    a.n_stream  = q->ne[3];
    a.k[0] = make_src(k, a.n_stream);
    if (kvct) {
        const kvct_read & kr = kvct_read_of(kp, k->ne[2]);
        a.k[0].plans = kr.dec.data();
        a.k[0].ref   = params->use_ref;
        const kvc_t_rope * rope = (const kvc_t_rope *) ((const kvc_t_plan *) kp->data + k->ne[2]);
        if (rope->n_pairs > 0) {
            const ggml_tensor * pos = ggml_kvct_get_positions(dst);
            GGML_ASSERT(rope->n_pairs * 2 == k->ne[0] && pos && pos->type == GGML_TYPE_I32 &&
                        "kvcomp: kvct rows coded before RoPE are read with their cells' positions");
            a.k[0].rope    = rope;
            a.k[0].steps   = kr.steps.get();
            a.k[0].pos     = (const int32_t *) pos->data;
            a.k[0].pos_ne0 = pos->ne[0];
            // the view's first stream of the cache
            a.k[0].s0      = k->view_src ? (int64_t) (k->view_offs / k->nb[3]) : 0;
            GGML_ASSERT(k->ne[1] <= pos->ne[0] && a.k[0].s0 + k->ne[3] <= pos->ne[1]);
        }
    }
    a.v[0] = make_src(v, a.n_stream);
    a.k[1] = make_src(ke, a.n_stream);
    a.v[1] = make_src(ve, a.n_stream);
    a.k[2] = make_src(kn, a.n_stream);
    a.v[2] = make_src(vn, a.n_stream);
    a.DK = k->ne[0];
    a.DV = v->ne[0];
    a.n_q = q->ne[1];
    a.n_head = q->ne[2];
    a.n_head_kv = k->ne[2];
    a.G = a.n_head / a.n_head_kv;
    a.n_keys = a.k[0].n + a.k[1].n + a.k[2].n;
    a.ref = params->use_ref;
    if (a.mask) {
        GGML_ASSERT(a.mask->ne[0] >= a.n_keys && "kvcomp: the mask must have a column for every key of every source");
    }

    memcpy(&a.scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&a.max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&a.softcap,  (const float *) dst->op_params + 2, sizeof(float));
    if (a.softcap != 0.0f) {
        a.scale /= a.softcap;
    }
    a.n_head_log2 = 1u << (uint32_t) floor(log2((double) a.n_head));
    a.m0 = powf(2.0f, -(a.max_bias       ) / a.n_head_log2);
    a.m1 = powf(2.0f, -(a.max_bias / 2.0f) / a.n_head_log2);

    if (const ggml_tensor * order = ggml_flash_attn_ext_get_exact_order(dst)) {
        GGML_ASSERT(order->type == GGML_TYPE_I32 && order->ne[0] >= a.k[1].n + a.k[2].n && order->ne[1] >= a.n_stream);
        a.order    = (const int32_t *) order->data;
        a.order_ld = order->nb[1] / sizeof(int32_t);
    }

    if (a.n_q == 1) {
        fa_decode(params, a);
    } else {
        fa_prompt(params, a);
    }
    return true;
}
