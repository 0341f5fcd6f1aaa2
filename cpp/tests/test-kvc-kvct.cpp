// The kvct cache types on the CPU backend: SET_ROWS into a kvct cache and FLASH_ATTN_EXT with
// a kvct K (plans attached with ggml_kvct_set_plans, one per KV head), head sizes 64/128/256,
// prompt-like and decode shapes; and the state check of kvct rows. Rows have a different
// energy per RoPE pair (a plan then gives the pairs different bits), heads different scales.
// Each op is compared with
//  - the format's reference (quantize_row_kvct_ref / dequantize_row_kvct per head, with that
//    head's plan): bit-exact bytes for writes, NMSE <= 1e-8 for attention against attention
//    in double on the dequantized K (and V);
//  - attention in double on the unquantized rows, under a bound per K type;
//  - the kernels' scalar reference (use_ref) under 1e-9.

#include "kvc-test-util.h"
#include "kvc-common.h"
#include "ggml-cpu.h"
#include "ggml-kvcomp.h"

#include <algorithm>
#include <cmath>
#include <cstring>

using namespace kvc_test;

namespace {

const ggml_type KVCT_TYPES[] = { GGML_TYPE_KVCT5, GGML_TYPE_KVCT4, GGML_TYPE_KVCT3, GGML_TYPE_KVCT2 };
const int       HEAD_DIM[]   = { 64, 128, 256 };

// Attention output NMSE against f32 K (V f16): Gaussian rows whose pairs' energies fall by
// e^-8 across the head. The largest measured over these cases is about half of each bound
// (kvct5 1.1e-3, kvct4 4.7e-3, kvct3 2.1e-2, kvct2 8.4e-2).
double fa_bound(ggml_type t) {
    return t == GGML_TYPE_KVCT5 ? 2e-3 : t == GGML_TYPE_KVCT4 ? 8e-3 : t == GGML_TYPE_KVCT3 ? 3e-2 : 1.6e-1;
}

// pair p's energy in KV head h, and rows [n][n_head_kv][d] drawn with it. Steep: energies fall
// by e^-30 to a floor of 1e-4, so that a plan gives its first coefficients 8 bits.
float pair_energy(int h, int p, int d, bool steep = false) {
    const float fall = steep ? 30.0f : 8.0f, floor = steep ? 1e-4f : 0.05f;
    return (1.0f + 0.5f * (float) h) * (4.0f * std::exp(-fall * (float) p / (float) (d / 2)) + floor);
}

std::vector<float> make_k(int n, int n_head_kv, int d, uint32_t seed, bool steep = false) {
    std::vector<float> k = make_rows(dist::gaussian, n * n_head_kv, d, seed);
    for (int r = 0; r < n * n_head_kv; ++r) {
        for (int i = 0; i < d; ++i) {
            k[(size_t) r * d + i] *= std::sqrt(pair_energy(r % n_head_kv, i / 2, d, steep));
        }
    }
    return k;
}

// one plan per KV head, from the energies the rows are drawn with
std::vector<kvc_t_plan> make_plans(ggml_type type, int n_head_kv, int d, kvc_t_basis basis = KVC_T_BASIS_POOLED, bool neox = false,
                                   bool steep = false) {
    std::vector<kvc_t_plan> plans(n_head_kv);
    std::vector<int16_t> pair(d);
    std::vector<float> mean(d, 0.0f), k2(3 * d / 2), w(3 * d / 2);
    for (int h = 0; h < n_head_kv; ++h) {
        for (int p = 0; p < d / 2; ++p) {
            pair[2 * p] = (int16_t) (neox ? p : 2 * p);
            pair[2 * p + 1] = (int16_t) (neox ? p + d / 2 : 2 * p + 1);
            const float e = pair_energy(h, p, d, steep);
            k2[3 * p] = e;
            k2[3 * p + 1] = 0.0f;
            k2[3 * p + 2] = e;
            w[3 * p] = w[3 * p + 2] = 1.0f;
            w[3 * p + 1] = 0.0f;
        }
        const kvc_t_stats st = { d, (const int16_t (*)[2]) pair.data(), mean.data(), (const float (*)[3]) k2.data(),
                                 (const float (*)[3]) w.data() };
        GGML_ASSERT(kvc_t_plan_fit(&plans[h], &st, basis, kvc_t_type_row_bits(type, d)));
    }
    return plans;
}

// the plans and the layer's RoPE (none: rows coded after RoPE)
ggml_tensor * plans_tensor(graph_ctx & g, const std::vector<kvc_t_plan> & plans, const kvc_t_rope * rope = nullptr) {
    const size_t nb = plans.size() * sizeof(kvc_t_plan);
    ggml_tensor * t = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I8, (int64_t) (nb + sizeof(kvc_t_rope)));
    memcpy(t->data, plans.data(), nb);
    kvc_t_rope none;
    memset(&none, 0, sizeof(none));
    memcpy((char *) t->data + nb, rope ? rope : &none, sizeof(kvc_t_rope));
    return t;
}

// A RoPE as a model's graph states it (ggml_rope_ext's op_params): NORMAL with plain
// frequencies (llama), or NEOX with a YaRN context extension (ext_factor 1, freq_scale 1/4)
struct rope_case {
    int   mode;
    float freq_base, freq_scale, ext_factor, attn_factor;
    const char * name;
};
const rope_case ROPE_CASES[] = {
    { GGML_ROPE_TYPE_NORMAL, 100000.0f, 1.0f, 0.0f, 1.0f, "normal" },
    { GGML_ROPE_TYPE_NEOX, 10000.0f, 0.25f, 1.0f, 1.0f, "neox+yarn" },
};
const int ROPE_N_CTX_ORIG = 2048;

// rows [n][n_head_kv][d] coded and decoded with the reference, head by head
std::vector<uint8_t> code_ref(const std::vector<kvc_t_plan> & plans, const std::vector<float> & x, ggml_type type, int d) {
    const size_t rs = ggml_row_size(type, d);
    std::vector<uint8_t> out(x.size() / d * rs);
    for (size_t r = 0; r < x.size() / d; ++r) {
        quantize_row_kvct_ref(&plans[r % plans.size()], &x[r * d], &out[r * rs]);
    }
    return out;
}

// SET_ROWS of n rows ([n_head_kv * d] each) into a kvct cache over 1 and 3 threads, from F32
// and F16: the bytes of every head's row are the reference's with that head's plan.
void test_set_rows(report & rep, ggml_type type, int d) {
    const int n_head_kv = 3, n = 5, n_dst = 9;
    graph_ctx g(64 * 1024 * 1024);
    const auto plans = make_plans(type, n_head_kv, d);
    const auto x = make_k(n, n_head_kv, d, 7 + d);
    std::vector<float> x16(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
        x16[i] = ggml_fp16_to_fp32(ggml_fp32_to_fp16(x[i]));
    }
    const int64_t rows[n] = { 4, 0, 8, 2, 5 };
    const size_t rs = ggml_row_size(type, (int64_t) d * n_head_kv);
    for (ggml_type ts : { GGML_TYPE_F32, GGML_TYPE_F16 }) {
        const auto ref = code_ref(plans, ts == GGML_TYPE_F32 ? x : x16, type, d);
        for (int n_threads : { 1, 3 }) {
            ggml_tensor * dst = ggml_new_tensor_2d(g.ctx, type, (int64_t) d * n_head_kv, n_dst);
            ggml_tensor * src = ggml_new_tensor_2d(g.ctx, ts, (int64_t) d * n_head_kv, n);
            ggml_tensor * idx = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I64, n);
            for (size_t i = 0; i < x.size(); ++i) {
                if (ts == GGML_TYPE_F32) {
                    ((float *) src->data)[i] = x[i];
                } else {
                    ((ggml_fp16_t *) src->data)[i] = ggml_fp32_to_fp16(x[i]);
                }
            }
            memcpy(idx->data, rows, sizeof(rows));
            memset(dst->data, 0, ggml_nbytes(dst));
            ggml_tensor * out = ggml_set_rows(g.ctx, dst, src, idx);
            ggml_kvct_set_plans(out, plans_tensor(g, plans));
            g.compute(out, n_threads);
            bool same = true;
            for (int r = 0; r < n; ++r) {
                same &= memcmp((uint8_t *) dst->data + rows[r] * rs, ref.data() + r * rs, rs) == 0;
            }
            rep.check(same, "SET_ROWS  %s d=%3d x %d heads from %s, %d threads: bytes equal quantize_row_kvct_ref per head",
                      ggml_type_name(type), d, n_head_kv, ggml_type_name(ts), n_threads);
        }
    }
}

// attention in double over K [n_head_kv][n_kv][d] and V of the same shape; out [n_q][n_head][d]
std::vector<float> attention_ref(const std::vector<float> & q, const std::vector<float> & k, const std::vector<float> & v,
                                 const std::vector<float> & mask, int d, int n_q, int n_kv, int n_head, int n_head_kv, float scale) {
    std::vector<float> out((size_t) d * n_head * n_q);
    std::vector<double> s(n_kv);
    for (int h = 0; h < n_head; ++h) {
        const int hk = h / (n_head / n_head_kv);
        for (int iq = 0; iq < n_q; ++iq) {
            double mx = -INFINITY;
            for (int j = 0; j < n_kv; ++j) {
                double dot = 0.0;
                for (int i = 0; i < d; ++i) {
                    dot += (double) q[((size_t) h * n_q + iq) * d + i] * k[((size_t) hk * n_kv + j) * d + i];
                }
                s[j] = scale * dot + mask[(size_t) iq * n_kv + j];
                mx = std::max(mx, s[j]);
            }
            double sum = 0.0;
            for (int j = 0; j < n_kv; ++j) {
                s[j] = std::exp(s[j] - mx);
                sum += s[j];
            }
            for (int i = 0; i < d; ++i) {
                double acc = 0.0;
                for (int j = 0; j < n_kv; ++j) {
                    acc += s[j] * v[((size_t) hk * n_kv + j) * d + i];
                }
                out[((size_t) iq * n_head + h) * d + i] = (float) (acc / sum);
            }
        }
    }
    return out;
}

// FLASH_ATTN_EXT with a kvct K ([d, n_kv, n_head_kv], rows coded per head) and an F16 V; a
// decoded row serves every query head of its KV head (up to 16 at once, then another group).
// With a RoPE case, the rows are coded before RoPE (plans on the pairs' axes) and the node
// turns them to their cells' positions: runs of consecutive positions with jumps, some far
// out; the references then turn the rows with upstream's ROPE op.
void test_flash_attn(report & rep, ggml_type type, int d, int n_q, int n_kv, int n_threads, int n_head = 6,
                     const rope_case * rc = nullptr, bool steep = false) {
    const int n_head_kv = 2;
    const float scale = 1.0f / std::sqrt((float) d);
    graph_ctx g(256 * 1024 * 1024);
    const auto plans = make_plans(type, n_head_kv, d, rc ? KVC_T_BASIS_PAIR_AXES : KVC_T_BASIS_POOLED,
                                  rc && rc->mode == GGML_ROPE_TYPE_NEOX, steep);
    if (steep) {
        bool any8 = false;
        for (const kvc_t_plan & pl : plans) {
            any8 |= std::find(pl.bits, pl.bits + d, 8) != pl.bits + d;
        }
        rep.check(any8, "steep energies: %s d=%3d plans give a coefficient 8 bits", ggml_type_name(type), d);
    }

    // K drawn per cell as [n_kv][n_head_kv][d], stored head-major as the attention node reads it
    const auto kc = make_k(n_kv, n_head_kv, d, 41 + d, steep);
    std::vector<float> k((size_t) n_head_kv * n_kv * d);
    for (int j = 0; j < n_kv; ++j) {
        for (int h = 0; h < n_head_kv; ++h) {
            memcpy(&k[((size_t) h * n_kv + j) * d], &kc[((size_t) j * n_head_kv + h) * d], d * sizeof(float));
        }
    }
    const auto q = make_rows(dist::gaussian, n_head * n_q, d, 42 + d);
    auto v = make_rows(dist::gaussian, n_head_kv * n_kv, d, 43 + d);
    for (float & x : v) {
        x = ggml_fp16_to_fp32(ggml_fp32_to_fp16(x));
    }
    std::vector<float> mask((size_t) n_q * n_kv, 0.0f);
    for (int iq = 0; iq < n_q; ++iq) {
        for (int j = 0; j < n_kv; ++j) {
            if (j > n_kv - n_q + iq || (n_q == 1 && j % 5 == 2)) {
                mask[(size_t) iq * n_kv + j] = -INFINITY;
            }
        }
    }

    const size_t rs = ggml_row_size(type, d);
    ggml_tensor * tk = ggml_new_tensor_3d(g.ctx, type, d, n_kv, n_head_kv);
    std::vector<float> kd(k.size());
    for (int h = 0; h < n_head_kv; ++h) {
        for (int j = 0; j < n_kv; ++j) {
            uint8_t * row = (uint8_t *) tk->data + ((size_t) h * n_kv + j) * rs;
            quantize_row_kvct_ref(&plans[h], &k[((size_t) h * n_kv + j) * d], row);
            dequantize_row_kvct(&plans[h], row, &kd[((size_t) h * n_kv + j) * d]);
        }
    }
    ggml_tensor * tq = ggml_new_tensor_3d(g.ctx, GGML_TYPE_F32, d, n_q, n_head);
    ggml_tensor * tv = ggml_new_tensor_3d(g.ctx, GGML_TYPE_F16, d, n_kv, n_head_kv);
    ggml_tensor * tm = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F16, n_kv, n_q);
    memcpy(tq->data, q.data(), ggml_nbytes(tq));
    ggml_fp32_to_fp16_row(v.data(), (ggml_fp16_t *) tv->data, (int64_t) v.size());
    ggml_fp32_to_fp16_row(mask.data(), (ggml_fp16_t *) tm->data, (int64_t) mask.size());

    kvc_t_rope rope;
    ggml_tensor * plans_t = nullptr;
    if (rc) {
        ggml_tensor * pos = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n_kv);
        for (int j = 0; j < n_kv; ++j) {
            ((int32_t *) pos->data)[j] = j < n_kv / 2 ? 7 + j : j % 3 == 0 ? 40000 + 5 * j : 900 + j;
        }
        // rows turned by upstream's RoPE, [d, n_head_kv, n_kv] as a model's K
        auto turn = [&](std::vector<float> & rows) {
            ggml_tensor * x = ggml_new_tensor_3d(g.ctx, GGML_TYPE_F32, d, n_head_kv, n_kv);
            for (int j = 0; j < n_kv; ++j) {
                for (int h = 0; h < n_head_kv; ++h) {
                    memcpy((float *) x->data + ((size_t) j * n_head_kv + h) * d, &rows[((size_t) h * n_kv + j) * d], d * sizeof(float));
                }
            }
            ggml_tensor * r = ggml_rope_ext(g.ctx, x, pos, nullptr, d, rc->mode, ROPE_N_CTX_ORIG, rc->freq_base, rc->freq_scale,
                                            rc->ext_factor, rc->attn_factor, 32.0f, 1.0f);
            if (!plans_t) {
                GGML_ASSERT(kvc_t_rope_from_op(&rope, (const int32_t *) r->op_params, nullptr, d));
                plans_t = ggml_kvct_plans_view(g.ctx, plans_tensor(g, plans, &rope), pos);
            }
            g.compute(r, 1);
            for (int j = 0; j < n_kv; ++j) {
                for (int h = 0; h < n_head_kv; ++h) {
                    memcpy(&rows[((size_t) h * n_kv + j) * d], (float *) r->data + ((size_t) j * n_head_kv + h) * d, d * sizeof(float));
                }
            }
        };
        turn(k);
        turn(kd);
    } else {
        plans_t = plans_tensor(g, plans);
    }

    ggml_tensor * out = ggml_flash_attn_ext(g.ctx, tq, tk, tv, tm, scale, 0.0f, 0.0f);
    ggml_prec_set_acc(out, GGML_PREC_F32);
    ggml_kvct_set_plans(out, plans_t);
    g.compute(out, n_threads);
    const std::vector<float> got((float *) out->data, (float *) out->data + (size_t) d * n_head * n_q);
    g.compute(out, n_threads, true);
    const double e_ref = nmse(got.data(), (float *) out->data, got.size());

    const auto ref_deq = attention_ref(q, kd, v, mask, d, n_q, n_kv, n_head, n_head_kv, scale);
    const auto ref_f32 = attention_ref(q, k, v, mask, d, n_q, n_kv, n_head, n_head_kv, scale);
    const double e_deq = nmse(got.data(), ref_deq.data(), got.size());
    const double e_f32 = nmse(got.data(), ref_f32.data(), got.size());
    char kind[48];
    snprintf(kind, sizeof(kind), n_q > 1 ? "prompt of %d tokens" : n_head > 16 ? "decode, 10 heads per KV head" : "decode", n_q);
    char shape[128];
    snprintf(shape, sizeof(shape), "%s%s%s%s", kind, rc ? ", before RoPE " : "", rc ? rc->name : "", steep ? ", steep" : "");
    // Before RoPE the kernel turns a row by angles taken in double precision (in the SIMD path
    // a base's, turned by up to 16 steps); upstream's ROPE takes them in float, off by up to
    // about 1e-3 rad at position 40000: the bound against it widens to 1e-5 then.
    const double b_deq = rc ? 1e-5 : 1e-8;
    rep.check(e_ref <= 1e-9, "FLASH_ATTN_EXT %s K=%s d=%3d SIMD vs scalar reference: nmse %.2e <= 1e-9", shape, ggml_type_name(type), d, e_ref);
    rep.check(e_deq <= b_deq, "FLASH_ATTN_EXT %s K=%s d=%3d vs dequantized K: nmse %.2e <= %.0e", shape, ggml_type_name(type), d, e_deq, b_deq);
    rep.check(e_f32 <= fa_bound(type), "FLASH_ATTN_EXT %s K=%s d=%3d vs f32 K: nmse %.2e <= %.1e", shape, ggml_type_name(type), d,
              e_f32, fa_bound(type));
}

// A state's kvct rows pass when every head's scale code is one the quantizer writes.
void test_validate(report & rep) {
    const int d = 128;
    const auto plans = make_plans(GGML_TYPE_KVCT4, 2, d);
    const auto x = make_k(3, 2, d, 5);
    auto bytes = code_ref(plans, x, GGML_TYPE_KVCT4, d);
    const size_t rs = ggml_row_size(GGML_TYPE_KVCT4, d);
    rep.check(kvc_t_validate_rows(GGML_TYPE_KVCT4, d, bytes.data(), bytes.size()), "validate: coded rows pass");
    bytes[3 * rs] = KVC_E8_MAX + 1;
    rep.check(!kvc_t_validate_rows(GGML_TYPE_KVCT4, d, bytes.data(), bytes.size()), "validate: a scale code above %d is refused", KVC_E8_MAX);
    rep.check(!kvc_t_validate_rows(GGML_TYPE_KVCT4, d, bytes.data(), bytes.size() - 1), "validate: a partial row is refused");
    rep.check(!kvc_t_validate_rows(GGML_TYPE_KVCT4, 96, bytes.data(), bytes.size()), "validate: a head size kvct cannot hold is refused");
    rep.check(kvc_t_type_row_bits(GGML_TYPE_KVCT4, 64) == 288 && kvc_t_type_row_bits(GGML_TYPE_KVCT3, 256) == 896 &&
              kvc_t_type_row_bits(GGML_TYPE_KVCT2, 128) == 288 && kvc_t_type_row_bits(GGML_TYPE_KVCT5, 64) == 352 &&
              kvc_t_type_row_bits(GGML_TYPE_KVC4, 64) == 0 && kvc_t_type_row_bits(GGML_TYPE_KVCT4, 512) == 0,
              "row bits: 4.5, 3.5, 2.25 and 5.5 bits per value, none for other types or heads over %d", KVC_T_MAX_D);
}

// The RoPE of a node as the kernels take it: upstream's ROPE op on a row equals the row turned
// by kvc_t_rope_cs's angles; turning back gives the row again; a partial or multi-section
// RoPE is refused.
void test_rope(report & rep) {
    const int d = 64, n = 5;
    graph_ctx g(16 * 1024 * 1024);
    for (const rope_case & rc : ROPE_CASES) {
        ggml_tensor * x = ggml_new_tensor_3d(g.ctx, GGML_TYPE_F32, d, 1, n);
        const auto rows = make_rows(dist::gaussian, n, d, 9);
        memcpy(x->data, rows.data(), ggml_nbytes(x));
        ggml_tensor * pos = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n);
        const int32_t ps[n] = { 0, 1, 17, 3000, 30000 };
        memcpy(pos->data, ps, sizeof(ps));
        ggml_tensor * r = ggml_rope_ext(g.ctx, x, pos, nullptr, d, rc.mode, ROPE_N_CTX_ORIG, rc.freq_base, rc.freq_scale, rc.ext_factor,
                                        rc.attn_factor, 32.0f, 1.0f);
        g.compute(r, 1);
        kvc_t_rope rope;
        GGML_ASSERT(kvc_t_rope_from_op(&rope, (const int32_t *) r->op_params, nullptr, d));
        kvc_t_plan pairs = {};
        pairs.d = d;
        for (int p = 0; p < d / 2; ++p) {
            pairs.pair[p][0] = (int16_t) (rc.mode == GGML_ROPE_TYPE_NEOX ? p : 2 * p);
            pairs.pair[p][1] = (int16_t) (rc.mode == GGML_ROPE_TYPE_NEOX ? p + d / 2 : 2 * p + 1);
        }
        double e_fwd = 0.0, e_back = 0.0;
        for (int i = 0; i < n; ++i) {
            std::vector<float> y(rows.begin() + i * d, rows.begin() + (i + 1) * d);
            float c[KVC_T_MAX_D / 2], sn[KVC_T_MAX_D / 2];
            kvc_t_rope_cs(&rope, ps[i], c, sn);
            kvc_t_rope_row(&pairs, c, sn, 0, y.data());
            e_fwd = std::max(e_fwd, nmse(y.data(), (const float *) r->data + i * d, d));
            kvc_t_rope_row(&pairs, c, sn, 1, y.data());
            e_back = std::max(e_back, nmse(y.data(), rows.data() + i * d, d));
        }
        // upstream's angles are taken in float: about 2e-3 rad off at position 30000
        rep.check(e_fwd <= 1e-5, "RoPE %s: kvc_t_rope on rows at positions up to 30000 vs upstream's ROPE: nmse %.2e <= 1e-5", rc.name, e_fwd);
        rep.check(e_back <= 1e-12, "RoPE %s: turned and back: nmse %.2e <= 1e-12", rc.name, e_back);
    }
    int32_t op[16] = { 0, 32, GGML_ROPE_TYPE_NORMAL, 0, 2048 };
    const float base = 10000.0f, one = 1.0f;
    memcpy(op + 5, &base, sizeof(float));
    memcpy(op + 6, &one, sizeof(float));
    memcpy(op + 8, &one, sizeof(float));
    kvc_t_rope rope;
    rep.check(!kvc_t_rope_from_op(&rope, op, nullptr, 64), "RoPE: a RoPE of 32 of 64 channels is refused");
    op[1] = 64;
    op[2] = GGML_ROPE_TYPE_MROPE;
    rep.check(!kvc_t_rope_from_op(&rope, op, nullptr, 64), "RoPE: a multi-section RoPE is refused");
    op[2] = GGML_ROPE_TYPE_NORMAL;
    rep.check(kvc_t_rope_from_op(&rope, op, nullptr, 64) && rope.n_pairs == 32 && rope.theta[0] == 1.0f,
              "RoPE: a full NORMAL RoPE is taken (32 pairs, the first turning 1 rad per position)");
}

} // namespace

int main() {
    report rep;
    for (ggml_type t : KVCT_TYPES) {
        for (int d : HEAD_DIM) {
            test_set_rows(rep, t, d);
            test_flash_attn(rep, t, d, 7, 150, 2);
            test_flash_attn(rep, t, d, 1, 700, 3);
            // three blocks of query tokens: K's tiles converted once for all of them
            test_flash_attn(rep, t, d, 50, 150, 3);
        }
        test_flash_attn(rep, t, 128, 1, 300, 2, 20);
        for (const rope_case & rc : ROPE_CASES) {
            test_flash_attn(rep, t, 64, 7, 150, 2, 6, &rc);
            test_flash_attn(rep, t, 64, 50, 150, 3, 6, &rc);
            test_flash_attn(rep, t, 256, 1, 700, 3, 6, &rc);
        }
        // codes of 8 bits, and a head of two 64-value chunks turned pair by pair
        test_flash_attn(rep, t, 128, 1, 300, 2, 6, &ROPE_CASES[0], true);
        test_flash_attn(rep, t, 128, 7, 150, 2, 6, nullptr, true);
    }
    test_rope(rep);
    test_validate(rep);
    return rep.finish("test-kvc-kvct");
}
