// What coding K costs in KLD, before a cache type exists for the coder (docs/kv-rows.md):
// each chunk of a text is decoded once with an exact (F16) cache for reference logits and
// once per K coder, the coder replacing every K row with its coded value as the graph makes
// it; V and everything else stay exact. The coders:
//  - an upstream or kvc type name (q8_0, q4_0, iq4_nl, kvc4, ...): K after RoPE, turned by
//    the Hadamard matrix upstream turns a quantized cache's K by, through the type's
//    reference quantizer and back (what a -ctk of that type with -ctv f16 stores);
//  - pre-pairs:BPE, post-pairs:BPE: the transform-coded row (kvc-transform.h) at BPE bits
//    per value, its plan fitted per layer and KV head on the chunk's first ubatch (the moment
//    the scale tracker fixes its offset), K coded before RoPE with a rotation per RoPE pair
//    (RoPE then turns the coded row, as kernels would per key) or after RoPE with the pair's
//    statistics pooled. The queries' weight on a pair is their mean energy on it in that
//    ubatch, pooled over the pair.
// The graph's RoPE node of K (Kcur-<il>) is where this happens: before it runs for a pre-RoPE
// coder (its input was computed for the callback's previous request), after it for the rest.
//
// Usage: llama-kvcomp-ksim -m MODEL -f TEXT -c N_CTX --chunks N --kcode f16,kvc4,pre-pairs:4.5
//        [--exact-first N]
// Prints one table row per coder: bits per K value, mean KLD against the exact run and its
// standard error, over the second half of every chunk. --exact-first N leaves the keys of
// the first N positions exact, as the residual buffer's sinks keep them (and out of the
// plans' statistics).

#include "arg.h"
#include "common.h"
#include "log.h"
#include "kvc-transform.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

enum ksim_kind { KSIM_EXACT, KSIM_TYPE, KSIM_PRE_PAIRS, KSIM_POST_PAIRS };

struct ksim_coder {
    std::string name;
    ksim_kind   kind = KSIM_EXACT;
    ggml_type   type = GGML_TYPE_F16;
    float       bpe  = 16.0f;
};

struct ksim_state {
    const ksim_coder * coder = nullptr;
    bool calibrate = false;           // this ubatch fixes the plans (the chunk's first)
    int  pos0 = 0;                    // the position of the ubatch's first token
    int  exact_first = 0;             // keys at positions below stay exact (the buffer's sinks)
    bool ok = true;
    std::vector<std::vector<kvc_t_plan>> plans;  // [layer][KV head]
    std::vector<std::vector<float>>      qw;     // [layer]: per query head and channel, mean q^2 of this ubatch
    int64_t n_head = 0;
};

bool parse_coder(const std::string & s, ksim_coder & c) {
    c.name = s;
    const size_t colon = s.find(':');
    if (colon != std::string::npos) {
        const std::string kind = s.substr(0, colon);
        char * end = nullptr;
        c.bpe = strtof(s.c_str() + colon + 1, &end);
        if (*end != '\0' || !(c.bpe >= 1.0f && c.bpe <= 8.5f)) {
            return false;
        }
        c.kind = kind == "pre-pairs" ? KSIM_PRE_PAIRS : kind == "post-pairs" ? KSIM_POST_PAIRS : KSIM_EXACT;
        return c.kind != KSIM_EXACT;
    }
    if (s == "f16") {
        return true;
    }
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * tn = ggml_type_name((ggml_type) t);
        const auto * tr = ggml_get_type_traits((ggml_type) t);
        if (tn && s == tn && tr->from_float_ref && tr->to_float) {
            c.kind = KSIM_TYPE;
            c.type = (ggml_type) t;
            c.bpe  = 8.0f * (float) tr->type_size / (float) tr->blck_size;
            return true;
        }
    }
    return false;
}

// rows[n][d] *= H (normalized Sylvester Hadamard; its own inverse)
void hadamard_rows(float * x, int64_t n, int64_t d) {
    for (int64_t r = 0; r < n; ++r) {
        float * v = x + r * d;
        for (int64_t h = 1; h < d; h *= 2) {
            for (int64_t i = 0; i < d; i += 2 * h) {
                for (int64_t j = i; j < i + h; ++j) {
                    const float a = v[j], b = v[j + h];
                    v[j] = a + b;
                    v[j + h] = a - b;
                }
            }
        }
        const float s = 1.0f / sqrtf((float) d);
        for (int64_t i = 0; i < d; ++i) {
            v[i] *= s;
        }
    }
}

// The plans of one layer from its K rows of this ubatch ([token][head][d]) and the queries'
// energies: RoPE's pairs are (i, i + d/2), upstream's NEOX order, or (2i, 2i+1), by the model.
bool fit_layer(ksim_state & st, int il, const std::vector<float> & k, int64_t d, int64_t n_kv, int64_t n_tok, bool neox) {
    const ksim_coder & c = *st.coder;
    if ((int) st.qw.size() <= il || st.qw[il].empty()) {
        LOG_ERR("layer %d: K came before its queries; the plan has no query weights\n", il);
        return false;
    }
    st.plans.resize(il + 1);
    st.plans[il].resize(n_kv);
    const std::vector<float> & qw = st.qw[il];
    const int64_t g = st.n_head / n_kv;
    for (int64_t h = 0; h < n_kv; ++h) {
        std::vector<int16_t> pair(d);
        std::vector<float>   mean(d, 0.0f), k2(3 * d / 2), w(3 * d / 2);
        for (int64_t p = 0; p < d / 2; ++p) {
            pair[2 * p]     = (int16_t) (neox ? p : 2 * p);
            pair[2 * p + 1] = (int16_t) (neox ? p + d / 2 : 2 * p + 1);
        }
        // the rows that will be coded: not the ones kept exact
        const int64_t t0 = std::min<int64_t>(n_tok - 1, std::max(0, st.exact_first - st.pos0));
        const double  n  = (double) (n_tok - t0);
        std::vector<double> m(d, 0.0);
        for (int64_t t = t0; t < n_tok; ++t) {
            for (int64_t i = 0; i < d; ++i) {
                m[i] += k[(t * n_kv + h) * d + i];
            }
        }
        for (int64_t i = 0; i < d; ++i) {
            mean[i] = (float) (m[i] / n);
        }
        for (int64_t p = 0; p < d / 2; ++p) {
            const int a = pair[2 * p], b = pair[2 * p + 1];
            double saa = 0.0, sab = 0.0, sbb = 0.0;
            for (int64_t t = t0; t < n_tok; ++t) {
                const double xa = k[(t * n_kv + h) * d + a] - mean[a];
                const double xb = k[(t * n_kv + h) * d + b] - mean[b];
                saa += xa * xa;
                sab += xa * xb;
                sbb += xb * xb;
            }
            k2[3 * p + 0] = (float) (saa / n);
            k2[3 * p + 1] = (float) (sab / n);
            k2[3 * p + 2] = (float) (sbb / n);
            double wq = 0.0;
            for (int64_t q = h * g; q < (h + 1) * g; ++q) {
                wq += 0.5 * (qw[q * d + a] + qw[q * d + b]);
            }
            w[3 * p + 0] = w[3 * p + 2] = (float) (wq / g);
            w[3 * p + 1] = 0.0f;
        }
        const kvc_t_stats stats = { (int32_t) d, (const int16_t (*)[2]) pair.data(), mean.data(),
                                    (const float (*)[3]) k2.data(), (const float (*)[3]) w.data() };
        const kvc_t_basis basis = c.kind == KSIM_PRE_PAIRS ? KVC_T_BASIS_PAIR_AXES : KVC_T_BASIS_POOLED;
        if (!kvc_t_plan_fit(&st.plans[il][h], &stats, basis, (int32_t) lroundf(c.bpe * (float) d))) {
            LOG_ERR("layer %d head %lld: the plan's statistics were refused\n", il, (long long) h);
            return false;
        }
    }
    return true;
}

// Codes the K rows of one layer in place in `t` ([d, n_kv, n_tok], contiguous F32).
bool code_rows(ksim_state & st, int il, ggml_tensor * t, bool neox) {
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
        LOG_ERR("%s: %s is not contiguous F32\n", __func__, t->name);
        return false;
    }
    const int64_t d = t->ne[0], n_kv = t->ne[1], n_tok = t->ne[2];
    std::vector<float> k(ggml_nelements(t));
    ggml_backend_tensor_get(t, k.data(), 0, ggml_nbytes(t));
    const int64_t n_exact = std::min<int64_t>(n_tok, std::max(0, st.exact_first - st.pos0));
    const std::vector<float> exact(k.begin(), k.begin() + n_exact * n_kv * d);
    const ksim_coder & c = *st.coder;
    if (c.kind == KSIM_TYPE) {
        const auto * tr = ggml_get_type_traits(c.type);
        std::vector<uint8_t> q(ggml_row_size(c.type, d));
        hadamard_rows(k.data(), n_kv * n_tok, d);
        for (int64_t r = 0; r < n_kv * n_tok; ++r) {
            tr->from_float_ref(k.data() + r * d, q.data(), d);
            tr->to_float(q.data(), k.data() + r * d, d);
        }
        hadamard_rows(k.data(), n_kv * n_tok, d);
    } else {
        if (st.calibrate && !fit_layer(st, il, k, d, n_kv, n_tok, neox)) {
            return false;
        }
        if ((int) st.plans.size() <= il || st.plans[il].empty()) {
            LOG_ERR("layer %d: no plan (the first ubatch did not reach it)\n", il);
            return false;
        }
        std::vector<uint8_t> q(kvc_t_row_size(st.plans[il][0].row_bits));
        for (int64_t tok = 0; tok < n_tok; ++tok) {
            for (int64_t h = 0; h < n_kv; ++h) {
                float * row = k.data() + (tok * n_kv + h) * d;
                quantize_row_kvct_ref(&st.plans[il][h], row, q.data());
                dequantize_row_kvct(&st.plans[il][h], q.data(), row);
            }
        }
    }
    std::copy(exact.begin(), exact.end(), k.begin());
    ggml_backend_tensor_set(t, k.data(), 0, ggml_nbytes(t));
    return true;
}

bool ksim_eval_cb(ggml_tensor * t, bool ask, void * user_data) {
    ksim_state & st = *(ksim_state *) user_data;
    const bool is_k    = strncmp(t->name, "Kcur", 4) == 0;
    const bool is_rope = t->op == GGML_OP_ROPE;
    const bool is_q    = strncmp(t->name, "Qcur-", 5) == 0 && is_rope;
    const ksim_coder & c = *st.coder;
    if (c.kind == KSIM_EXACT || !(is_k || is_q)) {
        return !ask;
    }
    int il = -1;
    if (is_rope && sscanf(t->name + 5, "%d", &il) != 1) {
        return false;
    }
    const bool neox = is_rope && (((const int32_t *) t->op_params)[2] & GGML_ROPE_TYPE_NEOX) != 0;
    if (is_k && is_rope && ((const int32_t *) t->op_params)[1] != t->ne[0]) {
        LOG_ERR("%s: RoPE turns %d of %lld channels; the pair coders need all of them\n", t->name,
                ((const int32_t *) t->op_params)[1], (long long) t->ne[0]);
        st.ok = false;
        return false;
    }
    if (ask) {
        // before K's RoPE runs: its input was computed for an earlier request
        if (is_k && is_rope && c.kind == KSIM_PRE_PAIRS) {
            st.ok = st.ok && code_rows(st, il, t->src[0], neox);
        }
        return true;
    }
    if (is_q && st.calibrate && c.kind != KSIM_TYPE) {
        // per query head and channel, the mean of q^2 over the ubatch's tokens
        const int64_t d = t->ne[0], nh = t->ne[1], n_tok = t->ne[2];
        std::vector<float> q(ggml_nelements(t));
        ggml_backend_tensor_get(t, q.data(), 0, ggml_nbytes(t));
        st.n_head = nh;
        st.qw.resize(il + 1);
        st.qw[il].assign(nh * d, 0.0f);
        for (int64_t tok = 0; tok < n_tok; ++tok) {
            for (int64_t i = 0; i < nh * d; ++i) {
                st.qw[il][i] += q[tok * nh * d + i] * q[tok * nh * d + i] / (float) n_tok;
            }
        }
    } else if (is_k && is_rope && c.kind != KSIM_PRE_PAIRS) {
        st.ok = st.ok && code_rows(st, il, t, neox);
    }
    return st.ok;
}

// log-softmax of n logits, in double
void log_softmax(const float * x, int n, std::vector<double> & out) {
    double m = x[0];
    for (int i = 1; i < n; ++i) {
        m = std::max(m, (double) x[i]);
    }
    double s = 0.0;
    for (int i = 0; i < n; ++i) {
        s += std::exp(x[i] - m);
    }
    const double ls = m + std::log(s);
    out.resize(n);
    for (int i = 0; i < n; ++i) {
        out[i] = x[i] - ls;
    }
}

} // namespace

int main(int argc, char ** argv) {
    // our options, taken out before upstream's parser sees the rest
    ksim_state st;
    std::vector<ksim_coder> coders;
    int n_chunks = 4;
    std::vector<char *> rest;
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        if ((a == "--kcode" || a == "--chunks" || a == "--exact-first") && i + 1 < argc) {
            const std::string v = argv[++i];
            if (a == "--chunks") {
                n_chunks = atoi(v.c_str());
                continue;
            }
            if (a == "--exact-first") {
                st.exact_first = atoi(v.c_str());
                continue;
            }
            size_t p0 = 0;
            while (p0 <= v.size()) {
                const size_t p1 = std::min(v.find(',', p0), v.size());
                ksim_coder c;
                if (!parse_coder(v.substr(p0, p1 - p0), c)) {
                    fprintf(stderr, "unknown K coder '%s' (a type name with a reference quantizer, pre-pairs:BPE or post-pairs:BPE)\n",
                            v.substr(p0, p1 - p0).c_str());
                    return 1;
                }
                coders.push_back(c);
                p0 = p1 + 1;
            }
            continue;
        }
        rest.push_back(argv[i]);
    }
    common_params params;
    if (!common_params_parse((int) rest.size(), rest.data(), params, LLAMA_EXAMPLE_IMATRIX)) {
        return 1;
    }
    if (params.prompt.empty() || params.n_ctx <= 0 || coders.empty() || n_chunks < 1 || st.exact_first < 0) {
        LOG_ERR("usage: %s -m MODEL -f TEXT -c N_CTX --chunks N --kcode CODER[,CODER...] [--exact-first N]\n", argv[0]);
        return 1;
    }
    common_init();
    llama_backend_init();

    ksim_coder exact;
    st.coder = &exact;
    params.cb_eval           = ksim_eval_cb;
    params.cb_eval_user_data = &st;
    params.warmup            = false;
    auto init = common_init_from_params(params);
    llama_context * ctx = init->context();
    if (!ctx) {
        LOG_ERR("failed to create the context\n");
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const int n_ctx   = params.n_ctx;
    const int n_ub    = (int) llama_n_ubatch(ctx);
    const int first   = n_ctx / 2;
    std::vector<llama_token> toks = common_tokenize(ctx, params.prompt, true);
    if ((int64_t) toks.size() < (int64_t) n_ctx * n_chunks || n_ctx % n_ub != 0) {
        LOG_ERR("need %d chunks of %d tokens (a multiple of the ubatch, %d); the text has %zu tokens\n", n_chunks, n_ctx, n_ub, toks.size());
        return 1;
    }

    // one pass over a chunk: the log-probabilities of its scored tokens, or their KLD against ref
    llama_batch batch = llama_batch_init(n_ub, 0, 1);
    auto run = [&](int chunk, const ksim_coder & c, std::vector<float> * ref, std::vector<double> * kld) {
        st.coder = &c;
        st.plans.clear();
        llama_memory_clear(llama_get_memory(ctx), true);
        std::vector<double> lp;
        for (int i0 = 0; i0 < n_ctx; i0 += n_ub) {
            batch.n_tokens = n_ub;
            for (int i = 0; i < n_ub; ++i) {
                batch.token[i]     = toks[(size_t) chunk * n_ctx + i0 + i];
                batch.pos[i]       = i0 + i;
                batch.n_seq_id[i]  = 1;
                batch.seq_id[i][0] = 0;
                batch.logits[i]    = i0 + i >= first;
            }
            st.calibrate = i0 == 0;
            st.pos0      = i0;
            if (llama_decode(ctx, batch) != 0 || !st.ok) {
                LOG_ERR("decode failed in chunk %d at token %d with K coder %s\n", chunk, i0, c.name.c_str());
                return false;
            }
            for (int i = std::max(i0, first); i < i0 + n_ub; ++i) {
                log_softmax(llama_get_logits_ith(ctx, i - i0), n_vocab, lp);
                float * r = ref->data() + (size_t) (i - first) * n_vocab;
                if (!kld) {
                    for (int v = 0; v < n_vocab; ++v) {
                        r[v] = (float) lp[v];
                    }
                    continue;
                }
                double kl = 0.0;
                for (int v = 0; v < n_vocab; ++v) {
                    kl += std::exp((double) r[v]) * ((double) r[v] - lp[v]);
                }
                kld->push_back(kl);
            }
        }
        return true;
    };

    std::vector<std::vector<double>> klds(coders.size());
    std::vector<float> ref((size_t) (n_ctx - first) * n_vocab);
    for (int chunk = 0; chunk < n_chunks; ++chunk) {
        if (!run(chunk, exact, &ref, nullptr)) {
            return 1;
        }
        for (size_t ic = 0; ic < coders.size(); ++ic) {
            if (!run(chunk, coders[ic], &ref, &klds[ic])) {
                return 1;
            }
        }
        fprintf(stderr, "chunk %d of %d done\n", chunk + 1, n_chunks);
    }
    llama_batch_free(batch);

    printf("| K coder (V exact) | bits per K value | mean KLD | standard error |\n|---|---:|---:|---:|\n");
    for (size_t ic = 0; ic < coders.size(); ++ic) {
        const std::vector<double> & k = klds[ic];
        double s = 0.0, s2 = 0.0;
        for (double v : k) {
            s += v;
            s2 += v * v;
        }
        const double n = (double) k.size();
        const double mean = s / n;
        const double se = std::sqrt(std::max(0.0, s2 / n - mean * mean) / std::max(1.0, n - 1.0));
        printf("| %s | %.2f | %.6f | %.6f |\n", coders[ic].name.c_str(), coders[ic].bpe, mean, se);
    }
    return 0;
}
