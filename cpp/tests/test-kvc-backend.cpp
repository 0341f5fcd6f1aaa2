// The kvc ops on every GPU backend of the build against the CPU backend, as upstream's
// test-backend-ops does for its types: same graph, same input bytes, outputs compared by NMSE.
// Every op must also be supported by the GPU backend itself, so nothing falls back to the CPU
// unnoticed. Covered: SET_ROWS (F32 and F16 rows), GET_ROWS, CPY both ways (from a strided
// view like the cache's K), MUL_MAT (K with flash attention off) and FLASH_ATTN_EXT for head
// sizes 64/128/256 at 1, 2 (vector kernel) and 8 queries (f16 tensor-core path), with GQA,
// masks, logit softcap, ALiBi and attention sinks. kvct K (transform-coded, read and written
// with its plans): SET_ROWS and FLASH_ATTN_EXT for head sizes 64/128/256, rows coded before RoPE
// and turned to their cells' positions, at 1, 2 and 8 queries.
//
// Exits 77 (skipped, CTest's SKIP_RETURN_CODE) when the machine has no GPU backend.

#include "ggml-kvcomp.h"
#include "kvc-test-plans.h"
#include "kvc-test-util.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

using namespace kvc_test;

namespace {

const ggml_type kvc_types[] = { GGML_TYPE_KVC8, GGML_TYPE_KVC4, GGML_TYPE_KVC3, GGML_TYPE_KVC2 };

// n_head plans of a kvct type for heads of d values, fitted to random statistics (pairs side
// by side, as NORMAL RoPE orders them), then a RoPE that turns every pair: a plans tensor's bytes.
std::vector<uint8_t> make_plans(ggml_type type, int64_t d, int64_t n_head, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> bytes(n_head*sizeof(kvc_t_plan) + sizeof(kvc_t_rope), 0);
    for (int64_t h = 0; h < n_head; ++h) {
        kvc_t_plan plan;
        if (!fit_random_plan(plan, type, (int) d, false, 3.0f, rng)) {
            fprintf(stderr, "test-kvc-backend: no plan for %s d=%lld\n", ggml_type_name(type), (long long) d);
            exit(1);
        }
        memcpy(bytes.data() + h*sizeof(kvc_t_plan), &plan, sizeof(plan));
    }
    const kvc_t_rope rope = make_rope((int) d, 1.0f);
    memcpy(bytes.data() + n_head*sizeof(kvc_t_plan), &rope, sizeof(rope));
    return bytes;
}

// Leaf contents, from the leaf's name: "mask" (0 / -inf, every row sees cell 0), "rows<N>"
// (distinct row ids below N), "pos" (cell positions, far from 0 and not in order), "plans<D>"
// (kvct plans of the node's K type for heads of D values), "kvct<D>" (kvct rows of heads of D
// values: random codes under plausible row scales), otherwise Gaussian values with outlier
// channels, quantized by the reference quantizer for kvc leaves.
void fill_leaf(ggml_tensor * t, uint32_t seed, std::vector<uint8_t> & bytes, ggml_type kvct_type) {
    std::mt19937 rng(seed);
    const int64_t n = ggml_nelements(t);
    bytes.assign(ggml_nbytes(t), 0);
    const std::string name = ggml_get_name(t);

    if (name == "pos") {
        for (int64_t i = 0; i < n; ++i) {
            ((int32_t *) bytes.data())[i] = (int32_t) (3000 + 7*i - 40*(i % 5));
        }
        return;
    }
    if (name.rfind("plans", 0) == 0) {
        const int64_t d = std::stoll(name.substr(5));
        const int64_t n_head = kvc_t_plans_n_head(bytes.size());
        bytes = make_plans(kvct_type, d, n_head, seed);
        return;
    }
    if (name.rfind("kvct", 0) == 0) {
        const int64_t d  = std::stoll(name.substr(4));
        const size_t  rs = ggml_row_size(t->type, d);
        std::uniform_int_distribution<int> byte(0, 255), scale(140, 175);
        for (size_t i = 0; i < bytes.size(); ++i) {
            bytes[i] = (uint8_t) (i % rs == 0 ? scale(rng) : byte(rng));
        }
        return;
    }

    if (name.rfind("rows", 0) == 0) {
        const int64_t n_rows = std::stoll(name.substr(4));
        std::vector<int64_t> perm(n_rows);
        for (int64_t i = 0; i < n_rows; ++i) {
            perm[i] = i;
        }
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int64_t i = 0; i < n; ++i) {
            if (t->type == GGML_TYPE_I64) {
                ((int64_t *) bytes.data())[i] = perm[i % n_rows];
            } else {
                ((int32_t *) bytes.data())[i] = (int32_t) perm[i % n_rows];
            }
        }
        return;
    }

    std::vector<float> x;
    if (name == "mask") {
        std::uniform_real_distribution<float> u(0.0f, 1.0f);
        x.resize(n);
        for (int64_t i = 0; i < n; ++i) {
            x[i] = (i % t->ne[0] == 0 || u(rng) < 0.7f) ? 0.0f : -INFINITY;
        }
    } else {
        const int64_t row = t->ne[0];
        x = make_rows(dist::outlier_channels, (int) (n / row), (int) row, seed);
    }

    if (t->type == GGML_TYPE_F32) {
        memcpy(bytes.data(), x.data(), bytes.size());
    } else if (t->type == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(x.data(), (ggml_fp16_t *) bytes.data(), n);
    } else {
        const std::vector<uint8_t> q = quantize_ref(t->type, x, (int) t->ne[0]);
        memcpy(bytes.data(), q.data(), bytes.size());
    }
}

struct run_result {
    bool                 supported = true;
    std::vector<float>   out; // dequantized when the output is a kvc tensor
    std::vector<uint8_t> raw; // a kvct output's bytes (no plan-free way to read them)
};

using build_fn = std::function<ggml_tensor *(ggml_context *)>;

run_result run_on(ggml_backend_t backend, const build_fn & build) {
    run_result res;
    ggml_init_params ip = { 256*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * out = build(ctx);

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        ggml_tensor * node = ggml_graph_node(gf, i);
        const bool is_view = node->op == GGML_OP_VIEW || node->op == GGML_OP_RESHAPE || node->op == GGML_OP_PERMUTE ||
                             node->op == GGML_OP_TRANSPOSE || node->op == GGML_OP_NONE;
        if (!is_view && !ggml_backend_supports_op(backend, node)) {
            res.supported = false;
        }
    }
    if (!res.supported) {
        ggml_free(ctx);
        return res;
    }

    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    ggml_type kvct_type = GGML_TYPE_COUNT;
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
        kvct_type = ggml_kvcomp_is_kvct(t->type) ? t->type : kvct_type;
    }
    uint32_t seed = 1234;
    std::vector<uint8_t> bytes;
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
        if (t->op == GGML_OP_NONE && t->view_src == nullptr) {
            fill_leaf(t, seed++, bytes, kvct_type);
            ggml_backend_tensor_set(t, bytes.data(), 0, bytes.size());
        }
    }

    ggml_backend_graph_compute(backend, gf);

    // the output of a SET_ROWS or CPY is a view of its destination: read the whole destination
    ggml_tensor * dst = out->view_src ? out->view_src : out;
    std::vector<uint8_t> raw(ggml_nbytes(dst));
    ggml_backend_tensor_get(dst, raw.data(), 0, raw.size());
    if (dst->type == GGML_TYPE_F32) {
        res.out.resize(ggml_nelements(dst));
        memcpy(res.out.data(), raw.data(), raw.size());
    } else if (dst->type == GGML_TYPE_F16) {
        res.out.resize(ggml_nelements(dst));
        ggml_fp16_to_fp32_row((const ggml_fp16_t *) raw.data(), res.out.data(), ggml_nelements(dst));
    } else if (ggml_kvcomp_is_kvct(dst->type)) {
        res.raw = raw;
    } else {
        res.out = dequantize(dst->type, raw.data(), (int) dst->ne[0], (int) ggml_nrows(dst));
    }

    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return res;
}

struct tester {
    ggml_backend_t cpu;
    ggml_backend_t gpu;
    report         rep;

    // ref_build: the CPU's graph when it lacks the op itself (it converts quantized data to and
    // from F32 only, so F16 <-> kvc copies are checked against a copy through F32)
    void compare(const std::string & name, const build_fn & build, double max_nmse, const build_fn & ref_build = nullptr) {
        const run_result ref = run_on(cpu, ref_build ? ref_build : build);
        const run_result got = run_on(gpu, build);
        if (!got.supported) {
            rep.check(false, "%s: not supported by %s", name.c_str(), ggml_backend_name(gpu));
            return;
        }
        bool finite = true;
        for (float v : got.out) {
            finite = finite && std::isfinite(v);
        }
        const double e = nmse(got.out.data(), ref.out.data(), ref.out.size());
        rep.check(got.out.size() == ref.out.size() && finite && e <= max_nmse, "%s: nmse %.2e <= %.0e", name.c_str(), e, max_nmse);
    }

    // kvct rows of row_size bytes: at most max_frac of them may differ from the CPU's (a
    // candidate scale whose error ties the best one within rounding may win on either side)
    void compare_rows(const std::string & name, const build_fn & build, size_t row_size, double max_frac) {
        const run_result ref = run_on(cpu, build);
        const run_result got = run_on(gpu, build);
        if (!got.supported) {
            rep.check(false, "%s: not supported by %s", name.c_str(), ggml_backend_name(gpu));
            return;
        }
        const size_t n_rows = ref.raw.size() / row_size;
        size_t n_diff = 0;
        for (size_t r = 0; r < n_rows && got.raw.size() == ref.raw.size(); ++r) {
            n_diff += memcmp(got.raw.data() + r*row_size, ref.raw.data() + r*row_size, row_size) != 0;
        }
        rep.check(got.raw.size() == ref.raw.size() && n_rows > 0 && n_diff <= max_frac*n_rows,
                  "%s: %zu of %zu rows differ (at most %.0f%%)", name.c_str(), n_diff, n_rows, 100.0*max_frac);
    }
};

// A cache-like K/V: [d*n_head, n_cells] rows viewed as [d, n_cells, n_head].
ggml_tensor * cache_view(ggml_context * ctx, ggml_type type, int64_t d, int64_t n_cells, int64_t n_head) {
    ggml_tensor * t = ggml_new_tensor_2d(ctx, type, d*n_head, n_cells);
    return ggml_view_3d(ctx, t, d, n_cells, n_head, t->nb[1], ggml_row_size(type, d), 0);
}

void test_rows_and_copies(tester & t) {
    for (ggml_type type : kvc_types) {
        const char * tn = ggml_type_name(type);
        for (ggml_type src_type : { GGML_TYPE_F32, GGML_TYPE_F16 }) {
            for (ggml_type idx_type : { GGML_TYPE_I64, GGML_TYPE_I32 }) {
                // Quantization may pick another step than the CPU where two candidates tie
                // within rounding, so a few blocks can differ by one step.
                t.compare(std::string("SET_ROWS ") + ggml_type_name(src_type) + "->" + tn + " idx " + ggml_type_name(idx_type),
                    [&](ggml_context * ctx) {
                        ggml_tensor * dst  = ggml_new_tensor_3d(ctx, type, 256, 64, 2);
                        ggml_tensor * src  = ggml_new_tensor_3d(ctx, src_type, 256, 7, 2);
                        ggml_tensor * rows = ggml_new_tensor_1d(ctx, idx_type, 7);
                        ggml_set_name(rows, "rows64");
                        return ggml_set_rows(ctx, dst, src, rows);
                    }, 1e-3);
            }
        }
        t.compare(std::string("GET_ROWS ") + tn + "->f32", [&](ggml_context * ctx) {
            ggml_tensor * src  = ggml_new_tensor_3d(ctx, type, 192, 40, 3);
            ggml_tensor * rows = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 9, 3);
            ggml_set_name(rows, "rows40");
            return ggml_get_rows(ctx, src, rows);
        }, 1e-12);
        for (ggml_type ft : { GGML_TYPE_F32, GGML_TYPE_F16 }) {
            // via_f32: the CPU's reference, which converts quantized data to and from F32 only
            auto from_kvc = [&](bool via_f32) {
                return build_fn([&, via_f32](ggml_context * ctx) {
                    ggml_tensor * k = cache_view(ctx, type, 64, 100, 3);
                    return via_f32 ? ggml_cast(ctx, ggml_cast(ctx, k, GGML_TYPE_F32), ft)
                                   : ggml_cpy(ctx, k, ggml_new_tensor_3d(ctx, ft, 64, 100, 3));
                });
            };
            auto to_kvc = [&](bool via_f32) {
                return build_fn([&, via_f32](ggml_context * ctx) {
                    ggml_tensor * src = ggml_new_tensor_2d(ctx, ft, 128, 33);
                    return ggml_cpy(ctx, via_f32 ? ggml_cast(ctx, src, GGML_TYPE_F32) : src,
                                    ggml_new_tensor_2d(ctx, type, 128, 33));
                });
            };
            const bool f16 = ft == GGML_TYPE_F16;
            t.compare(std::string("CPY ") + tn + " K view->" + ggml_type_name(ft), from_kvc(false), f16 ? 1e-6 : 1e-12,
                      f16 ? from_kvc(true) : nullptr);
            t.compare(std::string("CPY ") + ggml_type_name(ft) + "->" + tn, to_kvc(false), 1e-3,
                      f16 ? to_kvc(true) : nullptr);
        }
        // The CPU multiplies kvc rows with Q rounded to q8_0; the reference takes the exact
        // product with the dequantized rows, which the GPU approaches with f16 operands.
        auto mul_mat = [&](bool dequantized) {
            return build_fn([&, dequantized](ggml_context * ctx) {
                ggml_tensor * k = cache_view(ctx, type, 128, 300, 2);
                ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 128, 5, 2);
                return ggml_mul_mat(ctx, dequantized ? ggml_cast(ctx, k, GGML_TYPE_F32) : k, q);
            });
        };
        t.compare(std::string("MUL_MAT ") + tn + " K view x f32 Q", mul_mat(false), 5e-6, mul_mat(true));
    }
}

struct fa_case {
    int64_t   d, n_q, n_kv, n_head, n_head_kv;
    ggml_type tk, tv;
    float     max_bias, softcap;
    bool      sinks;
};

void test_flash_attn(tester & t) {
    std::vector<fa_case> cases;
    const std::pair<ggml_type, ggml_type> pairs[] = {
        { GGML_TYPE_KVC8, GGML_TYPE_KVC8 }, { GGML_TYPE_KVC4, GGML_TYPE_KVC4 }, { GGML_TYPE_KVC3, GGML_TYPE_KVC3 },
        { GGML_TYPE_KVC2, GGML_TYPE_KVC2 }, { GGML_TYPE_KVC8, GGML_TYPE_KVC4 }, { GGML_TYPE_KVC8, GGML_TYPE_KVC3 },
        { GGML_TYPE_KVC8, GGML_TYPE_KVC2 }, { GGML_TYPE_KVC4, GGML_TYPE_KVC3 }, { GGML_TYPE_KVC3, GGML_TYPE_KVC2 },
        { GGML_TYPE_F16,  GGML_TYPE_KVC4 }, { GGML_TYPE_KVC4, GGML_TYPE_KVC8 },
    };
    for (const auto & [tk, tv] : pairs) {
        for (int64_t d : { 64, 128, 256 }) {
            for (int64_t n_q : { 1, 2, 8 }) {
                cases.push_back({ d, n_q, 1024, 8, 2, tk, tv, 0.0f, 0.0f, false });
            }
        }
    }
    // long context (many chunks), softcap, ALiBi, sinks, no GQA
    cases.push_back({ 64,  1, 16384, 9, 3, GGML_TYPE_KVC4, GGML_TYPE_KVC4, 0.0f, 0.0f,  false });
    cases.push_back({ 256, 1, 4096,  4, 1, GGML_TYPE_KVC4, GGML_TYPE_KVC4, 0.0f, 30.0f, false });
    cases.push_back({ 128, 1, 512,   8, 8, GGML_TYPE_KVC8, GGML_TYPE_KVC8, 8.0f, 0.0f,  false });
    cases.push_back({ 64,  2, 768,   4, 2, GGML_TYPE_KVC3, GGML_TYPE_KVC3, 0.0f, 0.0f,  true  });

    for (const fa_case & c : cases) {
        char name[160];
        snprintf(name, sizeof(name), "FLASH_ATTN_EXT K=%s V=%s d=%lld n_q=%lld n_kv=%lld heads=%lld/%lld%s%s%s",
                 ggml_type_name(c.tk), ggml_type_name(c.tv), (long long) c.d, (long long) c.n_q, (long long) c.n_kv,
                 (long long) c.n_head, (long long) c.n_head_kv, c.softcap != 0.0f ? " softcap" : "",
                 c.max_bias != 0.0f ? " alibi" : "", c.sinks ? " sinks" : "");
        // the reference: the CPU's attention over K and V dequantized to f16 (its own kvc path
        // rounds Q to q8_0, further from the exact result than the GPU kernel)
        auto build = [&](bool dequantized) {
            return build_fn([&, dequantized](ggml_context * ctx) {
            ggml_tensor * q    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c.d, c.n_q, c.n_head);
            ggml_tensor * k    = cache_view(ctx, c.tk, c.d, c.n_kv, c.n_head_kv);
            ggml_tensor * v    = cache_view(ctx, c.tv, c.d, c.n_kv, c.n_head_kv);
            if (dequantized) {
                k = ggml_cast(ctx, ggml_cast(ctx, k, GGML_TYPE_F32), GGML_TYPE_F16);
                v = ggml_cast(ctx, ggml_cast(ctx, v, GGML_TYPE_F32), GGML_TYPE_F16);
            }
            ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, c.n_kv, c.n_q);
            ggml_set_name(mask, "mask");
            ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / std::sqrt((float) c.d), c.max_bias, c.softcap);
            ggml_prec_set_acc(out, GGML_PREC_F32);
            if (c.sinks) {
                ggml_flash_attn_ext_add_sinks(out, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, c.n_head));
            }
            return out;
            });
        };
        // 5e-4 as upstream's test-backend-ops where upstream's kernels run on f16 copies (8
        // queries, pairs without a kvc vector kernel); the kvc vector kernel reads K and V exactly
        const bool kvc_vec = c.tk != GGML_TYPE_F16 && c.tk <= c.tv && c.n_q <= 2;
        t.compare(name, build(false), kvc_vec ? 1e-5 : 5e-4, build(true));
    }
}

const ggml_type kvct_types[] = { GGML_TYPE_KVCT4, GGML_TYPE_KVCT3, GGML_TYPE_KVCT2, GGML_TYPE_KVCT5 };

void test_kvct(tester & t) {
    for (ggml_type type : kvct_types) {
        for (int64_t d : { 64, 128, 256 }) {
            const int64_t n_head = 3;
            for (ggml_type src_type : { GGML_TYPE_F32, GGML_TYPE_F16 }) {
                char name[96];
                snprintf(name, sizeof(name), "SET_ROWS %s->%s d=%lld", ggml_type_name(src_type), ggml_type_name(type), (long long) d);
                t.compare_rows(name, [&](ggml_context * ctx) {
                    ggml_tensor * dst   = ggml_new_tensor_2d(ctx, type, d*n_head, 64);
                    ggml_tensor * src   = ggml_new_tensor_2d(ctx, src_type, d*n_head, 40);
                    ggml_tensor * rows  = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, 40);
                    ggml_tensor * plans = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, n_head*sizeof(kvc_t_plan) + sizeof(kvc_t_rope));
                    ggml_set_name(dst, ("kvct" + std::to_string(d)).c_str());
                    ggml_set_name(rows, "rows64");
                    ggml_set_name(plans, ("plans" + std::to_string(d)).c_str());
                    ggml_tensor * out = ggml_set_rows(ctx, dst, src, rows);
                    ggml_kvct_set_plans(out, plans);
                    return out;
                }, ggml_row_size(type, d), 0.02);
            }
            for (int64_t n_q : { 1, 2, 8 }) {
                for (ggml_type tv : { GGML_TYPE_KVC4, GGML_TYPE_KVC3 }) {
                    char name[128];
                    snprintf(name, sizeof(name), "FLASH_ATTN_EXT K=%s V=%s d=%lld n_q=%lld before RoPE", ggml_type_name(type),
                             ggml_type_name(tv), (long long) d, (long long) n_q);
                    const int64_t n_kv = 700, n_head_q = 6;
                    t.compare(name, [&](ggml_context * ctx) {
                        ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, n_q, n_head_q);
                        ggml_tensor * kc = ggml_new_tensor_2d(ctx, type, d*n_head, n_kv);
                        ggml_set_name(kc, ("kvct" + std::to_string(d)).c_str());
                        ggml_tensor * k = ggml_view_3d(ctx, kc, d, n_kv, n_head, kc->nb[1], ggml_row_size(type, d), 0);
                        ggml_tensor * v = cache_view(ctx, tv, d, n_kv, n_head);
                        ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_q);
                        ggml_set_name(mask, "mask");
                        ggml_tensor * plans = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, n_head*sizeof(kvc_t_plan) + sizeof(kvc_t_rope));
                        ggml_set_name(plans, ("plans" + std::to_string(d)).c_str());
                        ggml_tensor * pos = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_kv, 1);
                        ggml_set_name(pos, "pos");
                        ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / std::sqrt((float) d), 0.0f, 0.0f);
                        ggml_prec_set_acc(out, GGML_PREC_F32);
                        ggml_kvct_set_plans(out, ggml_kvct_plans_view(ctx, plans, pos));
                        return out;
                    }, 1e-5);
                }
            }
        }
    }
}

} // namespace

int main() {
    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    ggml_backend_t gpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_GPU, nullptr);
    if (gpu == nullptr) {
        printf("test-kvc-backend: no GPU backend on this machine (CPU-only build or no device); nothing to compare\n");
        ggml_backend_free(cpu);
        return 77;
    }
    printf("test-kvc-backend: %s vs %s\n", ggml_backend_name(gpu), ggml_backend_name(cpu));

    tester t = { cpu, gpu, {} };
    test_rows_and_copies(t);
    test_flash_attn(t);
    test_kvct(t);

    ggml_backend_free(gpu);
    ggml_backend_free(cpu);
    return t.rep.finish("test-kvc-backend");
}
