// CPU flash attention over kvc caches and over several sources: the main cells (any cache
// type) and the residual buffer's exact F16 rows (ggml_flash_attn_ext_add_exact: its slots,
// then the ubatch's own rows), under one online softmax and one mask. A decode step reads the
// rows where they lie; a prompt dequantizes 64-key tiles, once per node when several blocks of
// query tokens read them (into the plan's buffer, at most KVC_FA_SHARED_MAX bytes), else into
// per-thread scratch.
//
// Two kernels, each with a scalar reference (params->use_ref) that the SIMD path is held to
// (cpp/tests/test-kvc-ops.cpp):
//  - decode (one query token per stream): a work item is (stream, KV head, key range); the
//    query heads of the KV head are done together: a packed kvc K row is unpacked once and
//    scored in integers against each query rounded to q8_0, any other K row and every V row
//    is converted to F32 once for all the heads; the keys of all sources are split over the
//    threads, each range written as a partial (running maximum, sum, unnormalized output)
//    and the ranges combined in order;
//  - prompt (several query tokens): a work item is (stream, KV head, block of query tokens);
//    its rows (tokens x query heads, at most 64) meet 64-key tiles dequantized to F32 and
//    multiplied as upstream's tiled F16 kernel does, so a kvc cache costs about what F16 does;
//    the tiles are made once for all blocks (shared_tiles).
// A kvct K cache (ggml_kvct_set_plans) is read through its KV head's plan (kvc-kvct-cpu.h):
// a decode step scores a tile of its rows against the group's heads in one call
// (kvc_t_decoder_dots, the rows decoded in registers), a prompt decodes each row to F32 once
// for all the heads and query blocks of its KV head. (Scoring from the codes with AVX2 gathers, the query
// permuted and scaled by the plan once, measured no faster on this machine's AMD EPYC.)

#include "kvc-cpu.h"
#include "kvc-kvct-cpu.h"
#include "kvc-simd.h"
#include "ggml-kvcomp.h"
#include "ggml-cpu.h"
#include "common.h"
#include "simd-gemm.h"
#include "quants.h"
#include "ggml-quants.h"
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
constexpr int     KVC_DEC_TILE   = 32;              // decode keys per online-softmax step
constexpr int64_t KVC_DEC_GROUP  = 16;              // decode query heads done together
constexpr int64_t KVC_DEC_MAX_D  = 256;             // decode head size bound (stack buffers)
constexpr int64_t KVC_MAX_ROW    = 1024;            // prompt K row bound (a stack row before the transpose)
constexpr int64_t KVC_DEC_MIN_KEYS = 32;            // decode keys a range is worth splitting for
constexpr int     KVC_FA_N_SRC   = 3;               // key sources of a node, one after the other
constexpr int     KVC_FA_SRC_UBATCH = 2;            // the source of the ubatch's own exact rows
constexpr size_t  KVC_FA_SHARED_MAX = (size_t) 256 << 20; // bytes of a prompt's shared tiles (shared_floats)

// one cache line into L1 (a no-op where the target has no prefetch instruction)
inline void kvc_prefetch(const void * p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 3);
#else
    (void) p;
#endif
}

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

float dot_f32(const float * a, const float * b, int64_t n, bool ref) {
    if (ref) {
        float s = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
            s += a[i] * b[i];
        }
        return s;
    }
    float s;
    ggml_vec_dot_f32((int) n, &s, 0, a, 0, b, 0, 1);
    return s;
}

// y += w * x
// d[g] = k . q[g] for the gn query heads of a decoded K row: the row is loaded once per four
// heads (one ggml_vec_dot_f32 call per head cost more than the row's decoding).
void dot_multi_f32(const float * k, const float * const * q, int64_t gn, int64_t n, float * d, bool ref) {
#if defined(KVC_AVX2)
    if (!ref && n % 8 == 0) {
        for (int64_t g0 = 0; g0 < gn; g0 += 4) {
            const int64_t ng = std::min<int64_t>(4, gn - g0);
            __m256 acc[4] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
            for (int64_t i = 0; i < n; i += 8) {
                const __m256 kv = _mm256_loadu_ps(k + i);
                for (int64_t g = 0; g < ng; ++g) {
                    acc[g] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q[g0 + g] + i), acc[g]);
                }
            }
            for (int64_t g = 0; g < ng; ++g) {
                d[g0 + g] = kvc_hsum_f32_8(acc[g]);
            }
        }
        return;
    }
#endif
    for (int64_t g = 0; g < gn; ++g) {
        d[g] = dot_f32(k, q[g], n, ref);
    }
}

void mad_f32(float * y, const float * x, float w, int64_t n, bool ref) {
    if (ref) {
        for (int64_t i = 0; i < n; ++i) {
            y[i] += w * x[i];
        }
        return;
    }
    ggml_vec_mad_f32((int) n, y, x, w);
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

// p[j] = exp(x[j] - m) in place; returns their sum (exp(-inf) = 0), added in index order: a
// masked key adds an exact zero, so where in a tile the visible keys sit does not change the
// sum, and a query sees its keys the same whatever ubatch (and so mask layout) it came in.
float softmax_tile(float * x, int n, float m, bool ref) {
    if (ref) {
        for (int j = 0; j < n; ++j) {
            x[j] = x[j] == -INFINITY ? 0.0f : expf(x[j] - m);
        }
    } else {
        ggml_vec_soft_max_f32(n, x, x, m);
    }
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) {
        sum += x[j];
    }
    return sum;
}

// C[M x N] += A[M x K] * B[K x N]
void gemm_f32(float * C, const float * A, const float * B, int M, int K, int N, bool ref) {
    if (!ref) {
        simd_gemm(C, A, B, M, K, N);
        return;
    }
    for (int i = 0; i < M; ++i) {
        for (int j = 0; j < N; ++j) {
            float s = 0.0f;
            for (int k = 0; k < K; ++k) {
                s += A[i * K + k] * B[k * N + j];
            }
            C[i * N + j] += s;
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

    // d[g * KVC_DEC_TILE + i] = qf[g] . (kvct row j[i] of KV head hk in stream s), as row_f32 turns it
    void dots(const int * j, int n, int64_t hk, int64_t s, const float * const * qf, int64_t gn, float * d,
              kvc_t_rope_walk * walk) const {
        const uint8_t * rows[KVC_DEC_TILE];
        int64_t         p[KVC_DEC_TILE];
        for (int i = 0; i < n; ++i) {
            rows[i] = (const uint8_t *) row(j[i], hk, s);
            p[i]    = rope ? key_pos(j[i], s) : 0;
        }
        kvc_t_decoder_dots(&plans[hk], rope ? walk : nullptr, rows, p, n, qf, (int32_t) gn, d, KVC_DEC_TILE);
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

// One online-softmax step of a query row over a tile of n scores x: the running maximum M
// moves up to the tile's (acc and S rescaled), x becomes the probabilities and S takes their
// sum. A tile with nothing visible becomes zeros and changes nothing.
void fold_tile(float * x, int n, float & M, float & S, float * acc, int64_t DV, bool ref) {
    float m = -INFINITY;
    for (int j = 0; j < n; ++j) {
        m = std::max(m, x[j]);
    }
    if (m == -INFINITY) {
        memset(x, 0, n * sizeof(float));
        return;
    }
    if (m > M) {
        const float ms = expf(M - m);
        scale_f32(acc, ms, DV, ref);
        S *= ms;
        M = m;
    }
    S += softmax_tile(x, n, M, ref);
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
// decode

struct dec_state {
    float M[KVC_DEC_GROUP];
    float S[KVC_DEC_GROUP];
    float acc[KVC_DEC_GROUP][KVC_DEC_MAX_D];
    // the queries rounded to q8_0, for the integer dot products with packed kvc K rows
    block_q8_0 q8[KVC_DEC_GROUP][KVC_DEC_MAX_D / QK8_0];
};

static_assert(KVC_DEC_GROUP <= GGML_KVC_DOT_MULTI_MAX, "a packed K row is scored for all heads of a group at once");
static_assert(KVC_DEC_GROUP <= KVC_T_DOTS_MAX_Q, "a kvct K row is scored for all heads of a group at once");

// acc[DV] += sum over the n rows i of w[i] * vt[i]: the accumulator stays in registers over
// the tile's rows (ggml_vec_mad_f32 would load and store it once per row). Each element is
// the same chain of fused multiply-adds at either width.
void mad_rows(float * acc, const float (*vt)[KVC_DEC_MAX_D], const float * w, int n, int64_t DV, bool ref) {
#if defined(__AVX512F__)
    if (!ref && DV % 32 == 0) {
        for (int64_t d0 = 0; d0 < DV; d0 += 32) {
            __m512 a0 = _mm512_loadu_ps(acc + d0);
            __m512 a1 = _mm512_loadu_ps(acc + d0 + 16);
            for (int i = 0; i < n; ++i) {
                const __m512 wi = _mm512_set1_ps(w[i]);
                a0 = _mm512_fmadd_ps(wi, _mm512_loadu_ps(vt[i] + d0), a0);
                a1 = _mm512_fmadd_ps(wi, _mm512_loadu_ps(vt[i] + d0 + 16), a1);
            }
            _mm512_storeu_ps(acc + d0, a0);
            _mm512_storeu_ps(acc + d0 + 16, a1);
        }
        return;
    }
#elif defined(KVC_AVX2)
    if (!ref && DV % 32 == 0) {
        for (int64_t d0 = 0; d0 < DV; d0 += 32) {
            __m256 a0 = _mm256_loadu_ps(acc + d0 +  0);
            __m256 a1 = _mm256_loadu_ps(acc + d0 +  8);
            __m256 a2 = _mm256_loadu_ps(acc + d0 + 16);
            __m256 a3 = _mm256_loadu_ps(acc + d0 + 24);
            for (int i = 0; i < n; ++i) {
                const __m256  wi = _mm256_set1_ps(w[i]);
                const float * vr = vt[i] + d0;
                a0 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vr +  0), a0);
                a1 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vr +  8), a1);
                a2 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vr + 16), a2);
                a3 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vr + 24), a3);
            }
            _mm256_storeu_ps(acc + d0 +  0, a0);
            _mm256_storeu_ps(acc + d0 +  8, a1);
            _mm256_storeu_ps(acc + d0 + 16, a2);
            _mm256_storeu_ps(acc + d0 + 24, a3);
        }
        return;
    }
#endif
    for (int i = 0; i < n; ++i) {
        mad_f32(acc, vt[i], w[i], DV, ref);
    }
}

// Keys [j0, j1) of source `is` (local indices; mask column off + j) for the gn query heads
// (qf, mp, slopes) of KV head hk in stream s.
void dec_range(const fa_node & a, int is, int64_t off, int64_t j0, int64_t j1, int64_t s, int64_t hk, int64_t gn,
               const float * const * qf, const ggml_fp16_t * const * mp, const float * slopes, dec_state & st) {
    const fa_src & K = a.k[is];
    const fa_src & V = a.v[is];
    const bool ref = a.ref;
    const row_to_f32_t k_to_f32 = K.plans ? nullptr : get_row_to_f32(K.type, ref, is == KVC_FA_SRC_UBATCH);
    const row_to_f32_t v_to_f32 = get_row_to_f32(V.type, ref, is == KVC_FA_SRC_UBATCH);
    const ggml_kvc_vec_dot_multi_t k_dot = K.plans ? nullptr : ggml_kvc_cpu_get_vec_dot_multi(K.type, ref);
    const bool k_tile = K.plans && !ref; // kvct rows: decoded and scored a tile at a time
    const int64_t DK = a.DK, DV = a.DV;
    const bool shared_mask = !a.mask || (a.mask->ne[2] == 1 && a.max_bias <= 0.0f);

    float sc[KVC_DEC_GROUP][KVC_DEC_TILE];
    // key j of the tile gets its dot products d[g * stride] as scores, where a head sees it
    const auto put_scores = [&](int j, const float * d, int64_t stride) {
        for (int64_t g = 0; g < gn; ++g) {
            if (sc[g][j] != -INFINITY) {
                sc[g][j] = a.score(d[g * stride], sc[g][j]);
            }
        }
    };
    float kt[KVC_DEC_MAX_D];
    kvc_t_rope_walk walk;
    K.walk_init(walk, hk);
    float vt[KVC_DEC_TILE][KVC_DEC_MAX_D];
    const size_t k_bytes = ggml_row_size(K.type, DK), v_bytes = ggml_row_size(V.type, DV);

    for (int64_t t0 = j0; t0 < j1; t0 += KVC_DEC_TILE) {
        const int n = (int) std::min<int64_t>(KVC_DEC_TILE, j1 - t0);

        // The next tile's K and V rows are asked for now. A decode step reads each layer's rows
        // once, from memory, and a packed row is read in less time than a miss takes, so the
        // hardware's prefetch alone left a kvct node at 1.3x F16's time inside a model against
        // 1.0x with its rows in cache (docs/results.md). Written out here: GCC took a helper
        // holding only prefetches for a function without effects and dropped its calls.
        for (int64_t j = t0 + n; j < std::min(t0 + n + KVC_DEC_TILE, j1); ++j) {
            const char * kr = K.row(j, hk, s);
            const char * vr = V.row(j, hk, s);
            for (size_t b = 0; b < k_bytes; b += 64) {
                kvc_prefetch(kr + b);
            }
            for (size_t b = 0; b < v_bytes; b += 64) {
                kvc_prefetch(vr + b);
            }
            kvc_prefetch(kr + k_bytes - 1);
            kvc_prefetch(vr + v_bytes - 1);
        }
        int kl[KVC_DEC_TILE]; // kvct keys some head sees, scored together below
        int n_kl = 0;

        for (int j = 0; j < n; ++j) {
            const int64_t col = off + t0 + j;
            bool any = false;
            for (int64_t g = 0; g < gn; ++g) {
                const float mv = mp[g] ? (shared_mask && g > 0 ? sc[0][j] : slopes[g] * GGML_CPU_FP16_TO_FP32(mp[g][col])) : 0.0f;
                sc[g][j] = mv;
                any |= mv != -INFINITY;
            }
            if (!any) {
                continue;
            }
            if (k_tile) {
                kl[n_kl++] = (int) (t0 + j);
                continue;
            }
            if (k_dot) {
                // A packed row meets the query rounded to q8_0 in integers, as upstream scores
                // its quantized K caches, with no F32 copy of the row (the prompt kernel keeps
                // F32 queries; test-kvc-llama bounds what the two differ).
                float d[KVC_DEC_GROUP];
                k_dot((int) DK, d, K.row(t0 + j, hk, s), st.q8, sizeof(st.q8[0]), (int) gn);
                put_scores(j, d, 1);
                continue;
            }
            // decoded once for all heads
            K.row_f32(k_to_f32, t0 + j, hk, s, kt, DK, &walk);
            float d[KVC_DEC_GROUP];
            dot_multi_f32(kt, qf, gn, DK, d, ref);
            put_scores(j, d, 1);
        }

        if (n_kl > 0) {
            float d[KVC_DEC_GROUP][KVC_DEC_TILE];
            K.dots(kl, n_kl, hk, s, qf, gn, d[0], &walk);
            for (int i = 0; i < n_kl; ++i) {
                put_scores((int) (kl[i] - t0), &d[0][i], KVC_DEC_TILE);
            }
        }

        for (int64_t g = 0; g < gn; ++g) {
            fold_tile(sc[g], n, st.M[g], st.S[g], st.acc[g], DV, ref);
        }

        // the tile's V rows are decoded once for all heads
        int live[KVC_DEC_TILE];
        int n_live = 0;
        for (int j = 0; j < n; ++j) {
            bool any = false;
            for (int64_t g = 0; g < gn; ++g) {
                any |= sc[g][j] != 0.0f;
            }
            if (any) {
                v_to_f32(V.row(t0 + j, hk, s), vt[n_live], DV);
                live[n_live++] = j;
            }
        }
        for (int64_t g = 0; g < gn; ++g) {
            float w[KVC_DEC_TILE];
            for (int i = 0; i < n_live; ++i) {
                w[i] = sc[g][live[i]];
            }
            mad_rows(st.acc[g], vt, w, n_live, DV, ref);
        }
    }
}

// Global keys [c0, c1) of both sources for query heads h0 .. h0 + gn - 1 (of KV head hk) of
// stream s; writes a partial per head (part_stride apart) or, without one, the output rows.
void dec_item(const fa_node & a, int64_t s, int64_t hk, int64_t h0, int64_t gn, int64_t c0, int64_t c1,
              float * part, int64_t part_stride) {
    const bool ref = a.ref;

    const float *       qf[KVC_DEC_GROUP] = {};
    const ggml_fp16_t * mp[KVC_DEC_GROUP] = {};
    float               slopes[KVC_DEC_GROUP] = {};
    dec_state           st;
    bool                q8 = false;
    for (int is = 0; is < KVC_FA_N_SRC; ++is) {
        q8 |= a.k[is].n > 0 && ggml_kvcomp_is_kvc(a.k[is].type);
    }

    for (int64_t g = 0; g < gn; ++g) {
        const int64_t h = h0 + g;
        qf[g] = a.q_row(0, h, s);
        mp[g]     = a.mask_row(0, h, s);
        slopes[g] = a.slope(h);
        st.M[g]   = -INFINITY;
        st.S[g]   = 0.0f;
        memset(st.acc[g], 0, a.DV * sizeof(float));
        if (q8 && ref) {
            quantize_row_q8_0_ref(qf[g], st.q8[g], a.DK);
        } else if (q8) {
            quantize_row_q8_0(qf[g], st.q8[g], a.DK);
        }
    }

    // the range [c0, c1) of keys numbered across the sources
    int64_t off = 0;
    for (int is = 0; is < KVC_FA_N_SRC; off += a.k[is].n, ++is) {
        const int64_t j0 = std::max(c0, off) - off;
        const int64_t j1 = std::min(c1, off + a.k[is].n) - off;
        if (j0 < j1) {
            dec_range(a, is, off, j0, j1, s, hk, gn, qf, mp, slopes, st);
        }
    }

    for (int64_t g = 0; g < gn; ++g) {
        const int64_t h = h0 + g;
        if (a.sinks && c0 == 0) {
            add_sink(((const float *) a.sinks->data)[h], st.M[g], st.S[g], st.acc[g], a.DV, ref);
        }
        if (part) {
            float * p = part + (s * a.n_head + h) * part_stride;
            p[0] = st.M[g];
            p[1] = st.S[g];
            memcpy(p + 2, st.acc[g], a.DV * sizeof(float));
        } else {
            write_row(a.out_row(0, h, s), st.acc[g], st.S[g], a.DV);
        }
    }
}

void fa_decode(const ggml_compute_params * params, const fa_node & a) {
    const int ith = params->ith;
    const int nth = params->nth;

    const fa_units units(a, KVC_DEC_GROUP);
    const int64_t  n_units = units.n;

    // Key ranges per unit: just enough that every thread gets the same number of items, while a
    // range keeps some keys and the partials fit the plan's scratch.
    const int64_t part_size = 2 + a.DV;
    const int64_t max_parts = (int64_t) (params->wsize / sizeof(float)) / (a.n_stream * a.n_head * part_size);
    int64_t n_chunks = nth / std::gcd((int64_t) nth, n_units);
    n_chunks = std::min(n_chunks, std::max<int64_t>(1, a.n_keys / KVC_DEC_MIN_KEYS));
    n_chunks = std::max<int64_t>(1, std::min(n_chunks, max_parts));

    float * parts = n_chunks > 1 ? (float *) params->wdata : nullptr;
    const int64_t n_items = n_units * n_chunks;
    for (int64_t i = ith; i < n_items; i += nth) {
        const fa_units::unit u = units.at(a, i % n_units);
        const int64_t chunk = i / n_units;
        const int64_t c0 = a.n_keys * chunk / n_chunks;
        const int64_t c1 = a.n_keys * (chunk + 1) / n_chunks;
        dec_item(a, u.s, u.hk, u.h0, u.gn, c0, c1, parts ? parts + chunk * part_size : nullptr, n_chunks * part_size);
    }
    if (!parts) {
        return;
    }

    ggml_barrier(params->threadpool);

    float acc[KVC_DEC_MAX_D];
    for (int64_t r = ith; r < a.n_stream * a.n_head; r += nth) {
        float M = -INFINITY, S = 0.0f;
        memset(acc, 0, a.DV * sizeof(float));
        for (int64_t c = 0; c < n_chunks; ++c) {
            const float * p = parts + (r * n_chunks + c) * part_size;
            if (p[1] == 0.0f) {
                continue;
            }
            const float Mn = std::max(M, p[0]);
            const float so = expf(M - Mn);
            const float sn = expf(p[0] - Mn);
            for (int64_t i = 0; i < a.DV; ++i) {
                acc[i] = acc[i] * so + p[2 + i] * sn;
            }
            S = S * so + p[1] * sn;
            M = Mn;
        }
        write_row(a.out_row(0, r % a.n_head, r / a.n_head), acc, S, a.DV);
    }
}

// ---------------------------------------------------------------------------------------
// prompt

size_t prompt_scratch_floats(int64_t DK, int64_t DV) {
    return KVC_FA_TILE_Q * DK + 2 * KVC_FA_TILE_Q * KVC_FA_TILE_KV + KVC_FA_TILE_Q * DV + KVC_FA_TILE_KV * DV +
           KVC_FA_TILE_KV * DK + KVC_FA_PAD;
}

// query tokens of a prompt's work item: as many as fill a tile's rows with the units' query heads
int64_t prompt_block(const fa_units & units) {
    return std::max<int64_t>(1, KVC_FA_TILE_Q / units.gh);
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

// Every source's K and V tiles, converted once per node for all blocks of query tokens, in
// the plan's buffer: per source, K [stream][KV head][tile][DK][TK], then V [stream][KV
// head][tile][TK][DV]. A block converting every tile it sees again is what made prompts over a
// kvct cache slower than over kvc4, and a prompt at depth 0 (the ubatch's exact rows read as
// F16) slower than over F16: a 512-token ubatch of 3 or 4 query heads per KV head is 25-32 blocks.
struct shared_tiles {
    int64_t n_tiles[KVC_FA_N_SRC] = {}; // per stream and KV head
    float * k[KVC_FA_N_SRC] = {};       // nullptr: each block converts the tiles it sees
    float * v[KVC_FA_N_SRC] = {};
    int64_t n_sk[KVC_FA_N_SRC] = {}, n_sv[KVC_FA_N_SRC] = {}; // streams of each source's K and V
    int64_t n_head_kv = 0, DK = 0, DV = 0;

    // Lays the sources' tiles out from p (none: only counts); returns the floats they take.
    size_t layout(const fa_src * ks, const fa_src * vs, int64_t n_stream, int64_t n_head_kv_, int64_t DK_, int64_t DV_,
                  float * p) {
        n_head_kv = n_head_kv_;
        DK = DK_;
        DV = DV_;
        size_t off = 0;
        for (int is = 0; is < KVC_FA_N_SRC; ++is) {
            n_tiles[is] = (ks[is].n + KVC_FA_TILE_KV - 1) / KVC_FA_TILE_KV;
            n_sk[is] = ks[is].n ? n_stream / ks[is].r3 : 0;
            n_sv[is] = ks[is].n ? n_stream / vs[is].r3 : 0;
            k[is] = p ? p + off : nullptr;
            off += (size_t) (n_sk[is] * n_head_kv * n_tiles[is] * KVC_FA_TILE_KV * DK);
            v[is] = p ? p + off : nullptr;
            off += (size_t) (n_sv[is] * n_head_kv * n_tiles[is] * KVC_FA_TILE_KV * DV);
        }
        return off;
    }

    const float * k_tile(int is, int64_t sk, int64_t hk, int64_t j0) const {
        return k[is] + ((sk * n_head_kv + hk) * n_tiles[is] + j0 / KVC_FA_TILE_KV) * KVC_FA_TILE_KV * DK;
    }
    const float * v_tile(int is, int64_t sv, int64_t hk, int64_t j0) const {
        return v[is] + ((sv * n_head_kv + hk) * n_tiles[is] + j0 / KVC_FA_TILE_KV) * KVC_FA_TILE_KV * DV;
    }
};

// Floats of the shared tiles: 0 when a node has one block of query tokens per KV head (nothing
// to share) and past KVC_FA_SHARED_MAX bytes (a long context keeps the per-block conversion).
size_t shared_floats(const fa_src * ks, const fa_src * vs, int64_t n_stream, int64_t n_head_kv, int64_t DK, int64_t DV,
                     int64_t n_q, int64_t G) {
    if (n_q <= prompt_block(fa_units(G, 1, n_head_kv, KVC_FA_TILE_Q))) {
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

// Query tokens [t0, t1) x query heads h0 .. h0 + gn - 1 of KV head hk in stream s, as the rows
// r = (t - t0) * gn + g of one tile; scratch: this thread's part of the plan's buffer; sh:
// the sources' tiles when the node shares them.
void prompt_item(const fa_node & a, int64_t s, int64_t hk, int64_t h0, int64_t gn, int64_t t0, int64_t t1, float * scratch,
                 const shared_tiles & sh) {
    const bool    ref = a.ref;
    const int64_t DK = a.DK, DV = a.DV;
    const int64_t TQ = KVC_FA_TILE_Q, TK = KVC_FA_TILE_KV;
    const int     R  = (int) ((t1 - t0) * gn);

    float * Qt  = scratch;           // [R][DK]
    float * KQ  = Qt + TQ * DK;      // [R][TK] scores, then probabilities
    float * MK  = KQ + TQ * TK;      // [R][TK] mask times slope
    float * VKQ = MK + TQ * TK;      // [R][DV]
    float * V32 = VKQ + TQ * DV;     // [TK][DV]
    float * K32 = V32 + TK * DV;     // [DK][TK], the tile transposed

    float M[KVC_FA_TILE_Q], S[KVC_FA_TILE_Q], slope[KVC_FA_TILE_Q];
    const ggml_fp16_t * mp[KVC_FA_TILE_Q];
    for (int r = 0; r < R; ++r) {
        const int64_t t = t0 + r / gn;
        const int64_t h = h0 + r % gn;
        memcpy(Qt + r * DK, a.q_row(t, h, s), DK * sizeof(float));
        mp[r]    = a.mask_row(t, h, s);
        slope[r] = a.slope(h);
        M[r] = -INFINITY;
        S[r] = 0.0f;
    }
    memset(VKQ, 0, (size_t) R * DV * sizeof(float));

    int64_t off = 0;
    for (int is = 0; is < KVC_FA_N_SRC; off += a.k[is].n, ++is) {
        const fa_src & K = a.k[is];
        const fa_src & V = a.v[is];
        if (K.n == 0) {
            continue;
        }
        const row_to_f32_t k_to_f32 = K.plans ? nullptr : get_row_to_f32(K.type, ref, is == KVC_FA_SRC_UBATCH);
        const row_to_f32_t v_to_f32 = get_row_to_f32(V.type, ref, is == KVC_FA_SRC_UBATCH);
        kvc_t_rope_walk walk;
        K.walk_init(walk, hk);

        for (int64_t j0 = 0; j0 < K.n; j0 += TK) {
            const int nk = (int) std::min(TK, K.n - j0);

            bool skip = true;
            for (int r = 0; r < R; ++r) {
                float * mk = MK + r * TK;
                for (int c = 0; c < nk; ++c) {
                    mk[c] = mp[r] ? slope[r] * GGML_CPU_FP16_TO_FP32(mp[r][off + j0 + c]) : 0.0f;
                    skip &= mk[c] == -INFINITY;
                }
                for (int c = nk; c < TK; ++c) {
                    mk[c] = -INFINITY;
                }
            }
            if (skip) {
                continue;
            }

            const bool    shared = sh.k[is] != nullptr;
            const float * Kt = K32;
            if (shared) {
                Kt = sh.k_tile(is, s / K.r3, hk, j0);
            } else {
                k_tile_f32(K, k_to_f32, j0, nk, hk, s, DK, &walk, K32);
            }
            memset(KQ, 0, (size_t) R * TK * sizeof(float));
            gemm_f32(KQ, Qt, Kt, R, (int) DK, (int) TK, ref);

            for (int r = 0; r < R; ++r) {
                float * kq = KQ + r * TK;
                const float * mk = MK + r * TK;
                for (int c = 0; c < TK; ++c) {
                    kq[c] = mk[c] == -INFINITY ? -INFINITY : a.score(kq[c], mk[c]);
                }
                fold_tile(kq, (int) TK, M[r], S[r], VKQ + r * DV, DV, ref);
            }

            const float * Vt = V32;
            if (shared) {
                Vt = sh.v_tile(is, s / V.r3, hk, j0);
            } else {
                v_tile_f32(V, v_to_f32, j0, nk, hk, s, DV, V32);
            }
            gemm_f32(VKQ, KQ, Vt, R, (int) TK, (int) DV, ref);
        }
    }

    for (int r = 0; r < R; ++r) {
        const int64_t t = t0 + r / gn;
        const int64_t h = h0 + r % gn;
        float * acc = VKQ + r * DV;
        if (a.sinks) {
            add_sink(((const float *) a.sinks->data)[h], M[r], S[r], acc, DV, ref);
        }
        write_row(a.out_row(t, h, s), acc, S[r], DV);
    }
}

void fa_prompt(const ggml_compute_params * params, const fa_node & a) {
    const int ith = params->ith;
    const int nth = params->nth;

    const size_t per_thread = prompt_scratch_floats(a.DK, a.DV);
    GGML_ASSERT(params->wsize >= per_thread * nth * sizeof(float) && "kvcomp: flash attention scratch too small");
    float * scratch = (float *) params->wdata + per_thread * ith;

    const fa_units units(a, KVC_FA_TILE_Q);
    const int64_t  qb      = prompt_block(units);
    const int64_t  n_qb    = (a.n_q + qb - 1) / qb;
    const int64_t  n_items = units.n * n_qb;

    // The shared tiles, split over the threads; a K tile walks its RoPE angles from an exact
    // start, so its floats do not depend on which thread made it.
    shared_tiles  sh;
    const size_t  n_shared = a.ref ? 0 : shared_floats(a.k, a.v, a.n_stream, a.n_head_kv, a.DK, a.DV, a.n_q, a.G);
    if (n_shared > 0 && params->wsize >= (per_thread * nth + n_shared) * sizeof(float)) {
        sh.layout(a.k, a.v, a.n_stream, a.n_head_kv, a.DK, a.DV, (float *) params->wdata + per_thread * nth);
        int64_t i0 = 0; // the first tile of the current (source, K or V)
        for (int is = 0; is < KVC_FA_N_SRC; ++is) {
            const fa_src & K = a.k[is];
            const fa_src & V = a.v[is];
            const int64_t  n_t = sh.n_tiles[is];
            const row_to_f32_t k_to_f32 = K.plans ? nullptr : get_row_to_f32(K.type, false, is == KVC_FA_SRC_UBATCH);
            const row_to_f32_t v_to_f32 = get_row_to_f32(V.type, false, is == KVC_FA_SRC_UBATCH);
            for (int kv = 0; kv < 2; ++kv) {
                const int64_t n = (kv == 0 ? sh.n_sk[is] : sh.n_sv[is]) * a.n_head_kv * n_t;
                // this thread's first tile of the range [i0, i0 + n): tiles go round the threads
                for (int64_t u = ((ith - i0) % nth + nth) % nth; u < n; u += nth) {
                    const int64_t hk = u / n_t % a.n_head_kv;
                    const int64_t j0 = u % n_t * KVC_FA_TILE_KV;
                    const int     nk = (int) std::min(KVC_FA_TILE_KV, K.n - j0);
                    const int64_t st = u / (n_t * a.n_head_kv);
                    if (kv == 0) {
                        kvc_t_rope_walk walk;
                        K.walk_init(walk, hk);
                        k_tile_f32(K, k_to_f32, j0, nk, hk, st * K.r3, a.DK, &walk, sh.k[is] + u * KVC_FA_TILE_KV * a.DK);
                    } else {
                        v_tile_f32(V, v_to_f32, j0, nk, hk, st * V.r3, a.DV, sh.v[is] + u * KVC_FA_TILE_KV * a.DV);
                    }
                }
                i0 += n;
            }
        }
    }

    if (ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);

    // the last query blocks see the most keys of a causal prompt: they go first
    for (int64_t i = ith; i < n_items; i = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        const fa_units::unit u = units.at(a, i % units.n);
        const int64_t b = n_qb - 1 - i / units.n;
        prompt_item(a, u.s, u.hk, u.h0, u.gn, b * qb, std::min(a.n_q, (b + 1) * qb), scratch, sh);
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

size_t ggml_kvc_cpu_flash_attn_ext_work_size(const struct ggml_tensor * dst) {
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
    return shared_floats(ks, vs, q->ne[3], k->ne[2], k->ne[0], v->ne[0], q->ne[1], q->ne[2] / k->ne[2]) * sizeof(float);
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

    if (a.n_q == 1 && a.DK <= KVC_DEC_MAX_D && a.DV <= KVC_DEC_MAX_D) {
        fa_decode(params, a);
    } else {
        fa_prompt(params, a);
    }
    return true;
}
