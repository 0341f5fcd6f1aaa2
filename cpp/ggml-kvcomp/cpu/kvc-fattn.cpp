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
#include "kvc-fattn.h"
#include "kvc-kvct-cpu.h"
#include "ggml-kvcomp.h"
#include "ggml-cpu.h"
#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

namespace {

using namespace kvc_fa;

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
    const auto unit_sc = [&](int64_t u) { return sc + u * pl.n_t * pl.gh * KVC_FA_TILE_KV; };
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
            main_scores(a, rows, g * pl.tps, std::min(pl.n_t, (g + 1) * pl.tps), none, unit_sc(u), pl.gh, M);
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
        main_values(a, rows, unit_sc(u), pl.gh, M, l * pl.W, pl.W, rows.VKQ, l == 0 ? rows.S : nullptr, none);
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
    std::vector<kvc_t_rows8>          rows8; // empty where this build has no such decoder
    std::vector<float>                rows8_tab;
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
    size_t n_tab = 0;
    for (int64_t h = 0; h < n_head; ++h) {
        kvc_t_decoder_init(&r.dec[h], (const kvc_t_plan *) kp->data + h);
        n_tab += kvc_t_rows8_floats(r.dec[h].plan);
    }
    r.rows8.clear();
    r.rows8_tab.assign(n_tab, 0.0f);
    if (n_tab > 0) {
        r.rows8.resize(n_head);
        for (int64_t h = 0, off = 0; h < n_head; ++h) {
            kvc_t_rows8_init(&r.rows8[h], &r.dec[h], r.rows8_tab.data() + off);
            off += (int64_t) kvc_t_rows8_floats(r.dec[h].plan);
        }
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
        a.k[0].rows8 = kr.rows8.empty() ? nullptr : kr.rows8.data();
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
