// The two parts of a row's keys in the CPU attention kernel over kvc caches (kvc-fattn.cpp):
// the main cells and the exact keys, and the arithmetic they share.

#include "kvc-fattn.h"
#include "kvc-cpu.h"
#include "kvc-simd.h"
#include "simd-gemm.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace kvc_fa {

namespace {

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

// n_seen[c]: how many of the R rows of s (TK scores or mask values each) see key c
void count_seen(const float * s, int R, int * n_seen) {
    for (int c = 0; c < KVC_FA_TILE_KV; ++c) {
        n_seen[c] = 0;
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < KVC_FA_TILE_KV; ++c) {
            n_seen[c] += s[r * KVC_FA_TILE_KV + c] != -INFINITY;
        }
    }
}

bool row_finite(const float * v, int64_t W) {
    for (int64_t d = 0; d < W; ++d) {
        if (!std::isfinite(v[d])) {
            return false;
        }
    }
    return true;
}

// A value row that some rows of a block see and others do not (a later key of the same
// sequence, or another sequence's in a prompt that mixes them) may hold non-finite values,
// which the others' zero weights would still turn into NaN in simd_gemm's products. Such
// columns of the tile vt (TK x W, the first nk real) are zeroed before its gemm and listed in
// bad; add_columns then adds their terms to the rows that see them, as a row alone would get
// them (n_seen from count_seen). Returns how many there are.
int zero_mixed_nonfinite(float * vt, int64_t W, int nk, int R, const int * n_seen, int * bad) {
    int n_bad = 0;
    for (int c = 0; c < nk; ++c) {
        if (n_seen[c] > 0 && n_seen[c] < R && !row_finite(vt + c * W, W)) {
            memset(vt + c * W, 0, W * sizeof(float));
            bad[n_bad++] = c;
        }
    }
    return n_bad;
}

// acc[r][W] += p[r][c] * v for the columns c of bad that row r sees; row(c, v) reads c's values.
template <typename Seen, typename Row>
void add_columns(float * acc, const float * p, int64_t W, int R, const int * bad, int n_bad, const Seen & seen, const Row & row) {
    float v[KVC_MAX_ROW];
    for (int i = 0; i < n_bad; ++i) {
        row(bad[i], v);
        for (int r = 0; r < R; ++r) {
            if (!seen(r, bad[i])) {
                continue;
            }
            const float w = p[r * KVC_FA_TILE_KV + bad[i]];
            for (int64_t d = 0; d < W; ++d) {
                acc[r * W + d] += w * v[d];
            }
        }
    }
}

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

// A row's scores of a tile from its dot products kq and its mask mk (-inf: not seen).
void score_row(const fa_node & a, float * kq, const float * mk) {
    for (int c = 0; c < KVC_FA_TILE_KV; ++c) {
        kq[c] = mk[c] == -INFINITY ? -INFINITY : a.score(kq[c], mk[c]);
    }
}

// 8 rows of 8 floats (src, rows ld apart) as 8 columns (dst, rows ldd apart)
void transpose8(const float * GGML_RESTRICT src, int64_t ld, float * GGML_RESTRICT dst, int64_t ldd) {
#if defined(KVC_AVX2)
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm256_loadu_ps(src + i * ld);
    }
    for (int i = 0; i < 4; ++i) {
        t[2 * i]     = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        for (int h = 0; h < 2; ++h) {
            r[4 * i + 2 * h]     = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0x44);
            r[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0xEE);
        }
    }
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + i * ldd,       _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
#else
    for (int i = 0; i < 8; ++i) {
        for (int j = 0; j < 8; ++j) {
            dst[j * ldd + i] = src[i * ld + j];
        }
    }
#endif
}

// a thread's 8 rows of K before the transpose
std::vector<float> & k_rows_scratch(int64_t DK) {
    thread_local std::vector<float> kt;
    if (kt.size() < (size_t) (8 * DK)) {
        kt.resize(8 * DK);
    }
    return kt;
}

// Columns [0, nk) of a tile K32[DK][TK] from rows: row(c, y) writes key c's DK values to y;
// the columns past nk zero. Rows are read 8 at a time and their 8 x 8 blocks transposed in
// registers: storing a row's values one by one down its column (one store every TK floats)
// took as long as decoding a kvct row of 256 values. block(c0) may write keys c0 .. c0 + 7
// itself (true) when all 8 are there.
template <typename Block, typename Row>
void k_columns(float * K32, int64_t DK, int nk, const Block & block, const Row & row) {
    const int64_t TK = KVC_FA_TILE_KV;
    static_assert(KVC_FA_TILE_KV % 8 == 0, "a tile is whole blocks of 8 keys");
    GGML_ASSERT(DK % 8 == 0 && DK <= KVC_MAX_ROW);
    std::vector<float> & kt = k_rows_scratch(DK);
    for (int c0 = 0; c0 < TK; c0 += 8) {
        const int n = std::max(0, std::min(8, nk - c0));
        if (n == 8 && block(c0)) {
            continue;
        }
        for (int c = 0; c < n; ++c) {
            row(c0 + c, kt.data() + c * DK);
        }
        if (n < 8) {
            std::fill(kt.begin() + n * DK, kt.begin() + 8 * DK, 0.0f);
        }
        for (int64_t d = 0; d < DK; d += 8) {
            transpose8(kt.data() + d, DK, K32 + d * TK + c0, TK);
        }
    }
}

} // namespace

// as_f16: F32 rows are read as their F16 rounding
row_to_f32_t get_row_to_f32(ggml_type t, bool ref, bool as_f16) {
    if (t == GGML_TYPE_F32) {
        return as_f16 ? (ref ? row_f32_as_f16_ref : row_f32_as_f16_simd) : row_f32;
    }
    if (ref) {
        return ggml_get_type_traits(t)->to_float;
    }
    return t == GGML_TYPE_F16 ? row_f16_simd : ggml_kvc_cpu_get_to_float(t);
}

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

// Keys [j0, j0 + nk) of KV head hk in stream s as one tile of F32 columns, K32[DK][TK] (the
// layout gemm_f32 multiplies), the columns past nk zero.
void k_tile_f32(const fa_src & K, row_to_f32_t to_f32, int64_t j0, int nk, int64_t hk, int64_t s, int64_t DK,
                kvc_t_rope_walk * walk, float * K32) {
    const bool rows8 = K.rows8 && K.rope && !K.ref;
    const auto block = [&](int c0) {
        if (!rows8) {
            return false;
        }
        int64_t pos[8];
        for (int c = 0; c < 8; ++c) {
            pos[c] = K.key_pos(j0 + c0 + c, s);
        }
        return kvc_t_decoder_rows8(&K.plans[hk], &K.rows8[hk], walk, (const uint8_t *) K.row(j0 + c0, hk, s), (int64_t) K.nb1,
                                   pos, K32 + c0, KVC_FA_TILE_KV);
    };
    k_columns(K32, DK, nk, block, [&](int c, float * y) { K.row_f32(to_f32, j0 + c, hk, s, y, DK, walk); });
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
        // A key no row sees adds a zero row: its cell may hold another sequence's non-finite
        // values, which a zero weight would still turn into NaN in simd_gemm's products.
        const int64_t j0 = t * TK;
        const int     nk = (int) std::min(TK, V.n - j0);
        int n_seen[KVC_FA_TILE_KV];
        count_seen(sc + t * ld * TK, R, n_seen);
        bool all_seen = true;
        for (int c = 0; c < nk; ++c) {
            all_seen = all_seen && n_seen[c] > 0;
        }
        const float * vs = sh.v && W == a.DV ? sh.v_tile(rows.s / V.r3, rows.hk, j0) : nullptr;
        const auto row = [&](int c, float * vt) {
            if (vs) {
                memcpy(vt, vs + c * W, W * sizeof(float));
            } else {
                v_to_f32(V.row(j0 + c, rows.hk, rows.s) + off, vt, W);
            }
        };
        const auto seen_by = [&](int r, int c) { return sc[(t * ld + r) * TK + c] != -INFINITY; };
        const float * Vt = vs && all_seen ? vs : rows.V32;
        // a shared tile with a column to zero is copied first
        for (int c = 0; c < nk && Vt == vs; ++c) {
            if (n_seen[c] < R && !row_finite(vs + c * W, W)) {
                Vt = rows.V32;
            }
        }
        for (int c = 0; c < TK && Vt == rows.V32; ++c) {
            float * vt = rows.V32 + c * W;
            if (c >= nk || n_seen[c] == 0) {
                memset(vt, 0, W * sizeof(float));
            } else {
                row(c, vt);
            }
        }
        int bad[KVC_FA_TILE_KV];
        const int n_bad = Vt == rows.V32 ? zero_mixed_nonfinite(rows.V32, W, nk, R, n_seen, bad) : 0;
        gemm_f32(acc, p, Vt, R, (int) TK, (int) W, a.ref);
        add_columns(acc, p, W, R, bad, n_bad, seen_by, row);
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

    // The tiles of the order's entries that some row sees: their keys, and their scores and
    // mask from the first pass, which the second reads again.
    struct exact_tile {
        int     nk;
        int64_t keys[KVC_FA_TILE_KV];
    };
    thread_local std::vector<exact_tile> tiles;
    thread_local std::vector<float>      kept;
    const size_t per_tile = 2 * (size_t) R * TK;
    tiles.clear();
    for (int64_t i0 = 0;; i0 += TK) {
        exact_tile t;
        int64_t cols[KVC_FA_TILE_KV];
        for (t.nk = 0; t.nk < TK && i0 + t.nk < n_x; ++t.nk) {
            const int64_t e = order ? order[i0 + t.nk] : i0 + t.nk;
            if (e < 0) {
                break;
            }
            t.keys[t.nk] = e;
            cols[t.nk] = off + e;
        }
        if (t.nk == 0) {
            break;
        }
        if (!rows.mask_tile(a, cols, t.nk)) {
            continue;
        }
        k_columns(rows.K32, DK, t.nk, [](int) { return false; }, [&](int c, float * y) {
            const int p = t.keys[c] < n1 ? 0 : 1;
            k_to_f32[p](a.k[1 + p].row(t.keys[c] - p * n1, rows.hk, rows.s), y, DK);
        });
        memset(rows.KQ, 0, (size_t) R * TK * sizeof(float));
        gemm_f32(rows.KQ, rows.Qt, rows.K32, R, (int) DK, (int) TK, ref);
        for (int r = 0; r < R; ++r) {
            float * kq = rows.KQ + r * TK;
            score_row(a, kq, rows.MK + r * TK);
            for (int c = 0; c < TK; ++c) {
                rows.M[r] = std::max(rows.M[r], kq[c]);
            }
        }
        tiles.push_back(t);
        kept.resize(tiles.size() * per_tile);
        float * k = kept.data() + (tiles.size() - 1) * per_tile;
        memcpy(k, rows.KQ, (size_t) R * TK * sizeof(float));
        memcpy(k + R * TK, rows.MK, (size_t) R * TK * sizeof(float));
    }

    for (size_t i = 0; i < tiles.size(); ++i) {
        const exact_tile & t = tiles[i];
        float * kq_all = kept.data() + i * per_tile;
        const float * mk = kq_all + R * TK;
        for (int r = 0; r < R; ++r) {
            float * kq = kq_all + r * TK;
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
        const auto row = [&](int c, float * vt) {
            const int p = t.keys[c] < n1 ? 0 : 1;
            v_to_f32[p](a.v[1 + p].row(t.keys[c] - p * n1, rows.hk, rows.s), vt, DV);
        };
        const auto seen_by = [&](int r, int c) { return mk[r * TK + c] != -INFINITY; };
        int n_seen[KVC_FA_TILE_KV];
        count_seen(mk, R, n_seen);
        for (int c = 0; c < TK; ++c) {
            float * vt = rows.V32 + c * DV;
            if (c < t.nk && n_seen[c] > 0) {
                row(c, vt);
            } else {
                memset(vt, 0, DV * sizeof(float));
            }
        }
        int bad[KVC_FA_TILE_KV];
        const int n_bad = zero_mixed_nonfinite(rows.V32, DV, t.nk, R, n_seen, bad);
        gemm_f32(rows.VKQ, kq_all, rows.V32, R, (int) TK, (int) DV, ref);
        add_columns(rows.VKQ, kq_all, DV, R, bad, n_bad, seen_by, row);
    }
}

// The end of a row: the sinks, then out = acc / S (zeros when nothing was visible).
void finish_row(const fa_node & a, int64_t h, float & M, float & S, float * acc) {
    if (a.sinks) {
        add_sink(((const float *) a.sinks->data)[h], M, S, acc, a.DV, a.ref);
    }
    write_row(acc, acc, S, a.DV);
}

} // namespace kvc_fa
