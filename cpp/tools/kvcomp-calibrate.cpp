// K statistics for the kvct cache types (docs/formats.md, "kvct"): runs a text through the
// model with an exact cache and writes, per layer and KV head, what a kvct plan is fitted
// from (cpp/llama-kvcomp/kvcomp-plans.h): per RoPE pair of K's channels before RoPE (the RoPE
// output turned back), the channels' means and centred second moments, and the queries' mean
// energy on the pair, the same before and after RoPE (the
// weight of an error there). The first positions of every chunk are left out: the attention
// sinks sit far from the other rows, and the modes keep them exact. So is, in its layer, a
// token whose Q or K row holds a NaN or Inf (counted in the last line).
//
// Usage: llama-kvcomp-calibrate -m MODEL -f TEXT -o OUT.gguf [-c 512] [--chunks 16] [--skip-first 4]

#include "arg.h"
#include "common.h"
#include "log.h"
#include "kvcomp-plans.h"
#include "llama-kvcomp.h"
#include "kvcomp-tool.h"

#include "gguf.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// running sums of one layer
struct layer_sums {
    int64_t d = 0, n_kv = 0, n_head = 0;
    double  n_k = 0.0, n_q = 0.0;
    std::vector<double> k1;  // [n_kv][d]: sum of k
    std::vector<double> k2;  // [n_kv][d/2][3]: sum of ka ka, ka kb, kb kb (uncentred)
    std::vector<double> q2;  // [n_head][d]: sum of q^2
};

struct calib_state {
    int  skip_first = 4;
    int  neox = -1; // RoPE's pairing, from the first K RoPE node
    bool ok = true;
    int64_t n_nonfinite = 0; // Q or K rows left out
    std::vector<layer_sums> layers;
};

// tokens [skip, n_tok) of a [d, heads, n_tok] F32 RoPE output
bool read_rows(ggml_tensor * t, std::vector<float> & out) {
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
        LOG_ERR("%s is not contiguous F32\n", t->name);
        return false;
    }
    out.resize(ggml_nelements(t));
    ggml_backend_tensor_get(t, out.data(), 0, ggml_nbytes(t));
    return true;
}

// K's rows [d, heads, n_tok] of a RoPE output turned back to what the model computed before
// RoPE (token i of the ubatch is at position i), by the angles the kvct kernels turn them with
bool unturn_rows(const ggml_tensor * t, std::vector<float> & x) {
    const int64_t d = t->ne[0], nh = t->ne[1], n_tok = t->ne[2];
    std::vector<float> factors;
    if (t->src[2]) {
        factors.resize(d / 2);
        ggml_backend_tensor_get(t->src[2], factors.data(), 0, factors.size() * sizeof(float));
    }
    kvc_t_rope rope;
    if (!kvc_t_rope_from_op(&rope, (const int32_t *) t->op_params, factors.empty() ? nullptr : factors.data(), d)) {
        return false;
    }
    const bool neox = (((const int32_t *) t->op_params)[2] & GGML_ROPE_TYPE_NEOX) != 0;
    kvc_t_plan pairs = {};
    pairs.d = (int32_t) d;
    for (int64_t p = 0; p < d / 2; ++p) {
        pairs.pair[p][0] = (int16_t) (neox ? p : 2 * p);
        pairs.pair[p][1] = (int16_t) (neox ? p + d / 2 : 2 * p + 1);
    }
    std::vector<float> c(d / 2), s(d / 2);
    for (int64_t tok = 0; tok < n_tok; ++tok) {
        kvc_t_rope_cs(&rope, tok, c.data(), s.data());
        for (int64_t h = 0; h < nh; ++h) {
            kvc_t_rope_row(&pairs, c.data(), s.data(), 1, x.data() + (tok * nh + h) * d);
        }
    }
    return true;
}

bool calib_eval_cb(ggml_tensor * t, bool ask, void * user_data) {
    calib_state & st = *(calib_state *) user_data;
    const bool is_k = strncmp(t->name, "Kcur-", 5) == 0 && t->op == GGML_OP_ROPE;
    const bool is_q = strncmp(t->name, "Qcur-", 5) == 0 && t->op == GGML_OP_ROPE;
    if (!is_k && !is_q) {
        return !ask;
    }
    if (ask) {
        return true;
    }
    int il = -1;
    if (sscanf(t->name + 5, "%d", &il) != 1 || il < 0) {
        return st.ok;
    }
    const int32_t * op = (const int32_t *) t->op_params;
    const int64_t d = t->ne[0], nh = t->ne[1], n_tok = t->ne[2];
    if (op[1] != d || d % 2 != 0) {
        LOG_ERR("%s: RoPE turns %d of %lld channels; the kvct pairs need all of them\n", t->name, op[1], (long long) d);
        st.ok = false;
        return false;
    }
    const int neox = (op[2] & GGML_ROPE_TYPE_NEOX) != 0;
    if (st.neox < 0) {
        st.neox = neox;
    } else if (st.neox != neox) {
        LOG_ERR("%s: layers pair RoPE's channels differently\n", t->name);
        st.ok = false;
        return false;
    }
    if ((int) st.layers.size() <= il) {
        st.layers.resize(il + 1);
    }
    layer_sums & l = st.layers[il];
    std::vector<float> x;
    if (!(st.ok = st.ok && read_rows(t, x))) {
        return false;
    }
    if (is_k && !unturn_rows(t, x)) {
        LOG_ERR("%s: a RoPE the kvct plans cannot follow (multi-section, partial or with an offset)\n", t->name);
        st.ok = false;
        return false;
    }
    const int64_t t0 = std::min<int64_t>(n_tok, st.skip_first);
    // a token whose row holds a non-finite value is left out of its layer's statistics
    const auto finite = [&](int64_t tok) {
        for (int64_t i = 0; i < nh * d; ++i) {
            if (!std::isfinite(x[tok * nh * d + i])) {
                ++st.n_nonfinite;
                return false;
            }
        }
        return true;
    };
    if (is_q) {
        if (l.q2.empty()) {
            l.n_head = nh;
            l.q2.assign(nh * d, 0.0);
        }
        for (int64_t tok = t0; tok < n_tok; ++tok) {
            if (!finite(tok)) {
                continue;
            }
            for (int64_t i = 0; i < nh * d; ++i) {
                const double v = x[tok * nh * d + i];
                l.q2[i] += v * v;
            }
            l.n_q += 1.0;
        }
        return st.ok;
    }
    if (l.k1.empty()) {
        l.d = d;
        l.n_kv = nh;
        l.k1.assign(nh * d, 0.0);
        l.k2.assign(nh * d / 2 * 3, 0.0);
    }
    for (int64_t tok = t0; tok < n_tok; ++tok) {
        if (!finite(tok)) {
            continue;
        }
        l.n_k += 1.0;
        for (int64_t h = 0; h < nh; ++h) {
            const float * r = x.data() + (tok * nh + h) * d;
            for (int64_t i = 0; i < d; ++i) {
                l.k1[h * d + i] += r[i];
            }
            for (int64_t p = 0; p < d / 2; ++p) {
                const double a = r[neox ? p : 2 * p];
                const double b = r[neox ? p + d / 2 : 2 * p + 1];
                double * s = &l.k2[(h * d / 2 + p) * 3];
                s[0] += a * a;
                s[1] += a * b;
                s[2] += b * b;
            }
        }
    }
    return st.ok;
}

bool write_stats(const calib_state & st, const llama_model * model, const std::string & arch, uint64_t n_tokens,
                 const std::string & path) {
    const std::vector<float> signature = llama_kvcomp_signature_of(model);
    const int64_t n_sig = (int64_t) signature.size();
    if (n_sig == 0) {
        LOG_ERR("the token embeddings (the statistics' signature) are missing or cannot be read back as F32\n");
        return false;
    }
    size_t n_bytes = ggml_tensor_overhead() + (size_t) n_sig * sizeof(float);
    for (const auto & l : st.layers) {
        n_bytes += (size_t) l.n_kv * (l.d / 2) * LLAMA_KVCOMP_KSTATS_PER_PAIR * sizeof(float) + ggml_tensor_overhead();
    }
    ggml_init_params ip = { n_bytes + ggml_tensor_overhead(), nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    gguf_context * g = gguf_init_empty();
    gguf_set_val_u32(g, LLAMA_KVCOMP_KSTATS_KEY_VER, LLAMA_KVCOMP_KSTATS_VERSION);
    gguf_set_val_str(g, LLAMA_KVCOMP_KSTATS_KEY_ARCH, arch.c_str());
    gguf_set_val_u64(g, LLAMA_KVCOMP_KSTATS_KEY_NTOK, n_tokens);
    gguf_set_val_bool(g, LLAMA_KVCOMP_KSTATS_KEY_NEOX, st.neox == 1);
    gguf_set_val_bool(g, LLAMA_KVCOMP_KSTATS_KEY_PRE, true);
    ggml_tensor * sig = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_sig);
    ggml_set_name(sig, LLAMA_KVCOMP_KSTATS_SIGNATURE);
    std::memcpy(sig->data, signature.data(), n_sig * sizeof(float));
    gguf_add_tensor(g, sig);
    for (size_t il = 0; il < st.layers.size(); ++il) {
        const layer_sums & l = st.layers[il];
        if (l.k1.empty() || l.q2.empty() || l.n_k < 2.0 || l.n_q < 1.0 || l.n_head % l.n_kv != 0) {
            LOG_ERR("layer %zu: no K or Q rows were seen\n", il);
            gguf_free(g);
            ggml_free(ctx);
            return false;
        }
        const int64_t d = l.d, g_per = l.n_head / l.n_kv;
        ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, LLAMA_KVCOMP_KSTATS_PER_PAIR, d / 2, l.n_kv);
        ggml_format_name(t, LLAMA_KVCOMP_KSTATS_TENSOR, (int) il);
        float * out = (float *) t->data;
        for (int64_t h = 0; h < l.n_kv; ++h) {
            for (int64_t p = 0; p < d / 2; ++p) {
                const int64_t a = st.neox ? p : 2 * p, b = st.neox ? p + d / 2 : 2 * p + 1;
                const double ma = l.k1[h * d + a] / l.n_k, mb = l.k1[h * d + b] / l.n_k;
                const double * s = &l.k2[(h * d / 2 + p) * 3];
                double wq = 0.0;
                for (int64_t q = h * g_per; q < (h + 1) * g_per; ++q) {
                    wq += 0.5 * (l.q2[q * d + a] + l.q2[q * d + b]) / l.n_q;
                }
                float * o = out + (h * (d / 2) + p) * LLAMA_KVCOMP_KSTATS_PER_PAIR;
                o[0] = (float) ma;
                o[1] = (float) mb;
                o[2] = (float) std::max(0.0, s[0] / l.n_k - ma * ma);
                o[3] = (float) (s[1] / l.n_k - ma * mb);
                o[4] = (float) std::max(0.0, s[2] / l.n_k - mb * mb);
                o[5] = (float) (wq / (double) g_per);
                o[6] = 0.0f;
                o[7] = o[5];
            }
        }
        gguf_add_tensor(g, t);
    }
    llama_kvcomp_kstats_seal(g, ctx);
    const bool ok = gguf_write_to_file(g, path.c_str(), false);
    if (!ok) {
        LOG_ERR("cannot write '%s'\n", path.c_str());
    }
    gguf_free(g);
    ggml_free(ctx);
    return ok;
}

} // namespace

int main(int argc, char ** argv) {
    calib_state st;
    int n_chunks = 16;
    std::string out;
    std::vector<char *> rest;
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        if ((a == "--chunks" || a == "--skip-first" || a == "-o") && i + 1 < argc) {
            const std::string v = argv[++i];
            if (a == "-o") {
                out = v;
            } else {
                char * end = nullptr;
                const long n = strtol(v.c_str(), &end, 10);
                if (*end != '\0' || n < 0 || n > 1000000) {
                    fprintf(stderr, "%s wants a count, got '%s'\n", a.c_str(), v.c_str());
                    return 1;
                }
                (a == "--chunks" ? n_chunks : st.skip_first) = (int) n;
            }
            continue;
        }
        rest.push_back(argv[i]);
    }
    common_params params;
    params.n_ctx = 512;
    if (!common_params_parse((int) rest.size(), rest.data(), params, LLAMA_EXAMPLE_IMATRIX)) {
        return 1;
    }
    if (params.prompt.empty() || out.empty() || n_chunks < 1 || params.n_ctx <= st.skip_first) {
        LOG_ERR("usage: %s -m MODEL -f TEXT -o OUT.gguf [-c N_CTX] [--chunks N] [--skip-first N]\n", argv[0]);
        return 1;
    }
    // one ubatch per chunk, so a token's index in the ubatch is its position; an exact cache
    params.n_batch = params.n_ubatch = params.n_ctx;
    params.cache_type_k = params.cache_type_v = GGML_TYPE_F16;
    params.cb_eval           = calib_eval_cb;
    params.cb_eval_user_data = &st;
    params.warmup            = false;
    common_init();
    auto init = kvcomp_tool_context(params);
    llama_context * ctx = init->context();
    if (!ctx) {
        return 1;
    }
    const llama_model * model = llama_get_model(ctx);
    char arch[128] = "";
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch));
    // a chunk is one ubatch (the context may have been padded past it)
    const int n_ctx = (int) std::min<uint32_t>((uint32_t) params.n_ctx, llama_n_ubatch(ctx));
    std::vector<llama_token> toks = common_tokenize(ctx, params.prompt, true);
    n_chunks = std::min<int>(n_chunks, (int) (toks.size() / n_ctx));
    if (n_chunks < 1) {
        LOG_ERR("the text has %zu tokens, fewer than one chunk of %d\n", toks.size(), n_ctx);
        return 1;
    }
    llama_batch batch = llama_batch_init(n_ctx, 0, 1);
    for (int chunk = 0; chunk < n_chunks; ++chunk) {
        llama_memory_clear(llama_get_memory(ctx), true);
        batch.n_tokens = n_ctx;
        for (int i = 0; i < n_ctx; ++i) {
            batch.token[i]     = toks[(size_t) chunk * n_ctx + i];
            batch.pos[i]       = i;
            batch.n_seq_id[i]  = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i]    = i == n_ctx - 1;
        }
        if (llama_decode(ctx, batch) != 0 || !st.ok) {
            LOG_ERR("decode failed in chunk %d\n", chunk);
            llama_batch_free(batch);
            return 1;
        }
    }
    llama_batch_free(batch);
    const uint64_t n_tokens = (uint64_t) n_chunks * (uint64_t) (n_ctx - st.skip_first);
    if (!write_stats(st, model, arch, n_tokens, out)) {
        return 1;
    }
    LOG_INF("kvcomp calibrate: K statistics of %zu layers over %llu tokens (%d chunks of %d; %lld rows left out for a "
            "non-finite value) -> %s\n", st.layers.size(), (unsigned long long) n_tokens, n_chunks, n_ctx,
            (long long) st.n_nonfinite, out.c_str());
    return 0;
}
