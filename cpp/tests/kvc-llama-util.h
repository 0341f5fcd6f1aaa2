#pragma once

// Helpers of the C++ tests that run a real model through llama (test-kvc-llama, -fuzz,
// -monitor, -plans, -state): the model, the text's tokens, contexts, decoding, and the KL
// divergence of logits.

#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace kvc_test {

// A test's model from a file, with llama's log cut to errors and the backend up; nullptr
// after printing why.
inline llama_model * load_test_model_file(const char * path) {
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level == GGML_LOG_LEVEL_ERROR) {
            fputs(text, stderr);
        }
    }, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(path, llama_model_default_params());
    if (!model) {
        fprintf(stderr, "failed to load %s\n", path);
    }
    return model;
}

// The same from a test's command line (the one argument); nullptr also for a wrong usage.
inline llama_model * load_test_model(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]);
        return nullptr;
    }
    return load_test_model_file(argv[1]);
}

// The tokens of a test's text (BOS first), at most n_max of them.
inline std::vector<llama_token> test_tokenize(const llama_model * model, const std::string & text, int32_t n_max) {
    std::vector<llama_token> toks(n_max);
    const int n = llama_tokenize(llama_model_get_vocab(model), text.c_str(), (int32_t) text.size(), toks.data(), n_max,
                                 true, false);
    toks.resize(std::max(n, 0));
    return toks;
}

struct ctx_ptr {
    llama_context * ctx = nullptr;
    ~ctx_ptr() { llama_free(ctx); }
};

// The tests' context: 512 cells, 2 threads, flash attention; type_v: the V cache's type when
// it differs from K's (a mode's pair)
inline llama_context_params test_ctx_params(ggml_type type, uint32_t n_seq_max = 1, bool unified = true,
                                            ggml_type type_v = GGML_TYPE_COUNT) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = 512;
    cp.n_batch         = 512;
    cp.n_ubatch        = 512;
    cp.n_seq_max       = n_seq_max;
    cp.n_threads       = 2;
    cp.n_threads_batch = 2;
    cp.type_k          = type;
    cp.type_v          = type_v == GGML_TYPE_COUNT ? type : type_v;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.kv_unified      = unified;
    return cp;
}

inline llama_context * make_ctx(llama_model * model, ggml_type type, uint32_t n_seq_max = 1, bool unified = true,
                                ggml_type type_v = GGML_TYPE_COUNT) {
    return llama_init_from_model(model, test_ctx_params(type, n_seq_max, unified, type_v));
}

// Decodes tokens [i0, i1) of seq at positions i0.., in pieces of `chunk`; returns the logits
// of the last n_out tokens, one row of n_vocab after the other.
inline std::vector<float> decode(llama_context * ctx, const std::vector<llama_token> & toks, int i0, int i1, int chunk,
                                 llama_seq_id seq = 0, int n_out = 1) {
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    llama_batch batch = llama_batch_init(chunk, 0, 1);
    std::vector<float> out;
    for (int s = i0; s < i1; s += chunk) {
        const int n = std::min(chunk, i1 - s);
        batch.n_tokens = n;
        for (int j = 0; j < n; ++j) {
            batch.token[j]     = toks[s + j];
            batch.pos[j]       = s + j;
            batch.n_seq_id[j]  = 1;
            batch.seq_id[j][0] = seq;
            batch.logits[j]    = s + j >= i1 - n_out;
        }
        if (llama_decode(ctx, batch) != 0) {
            llama_batch_free(batch);
            return {};
        }
        for (int j = 0; j < n; ++j) {
            if (batch.logits[j]) {
                const float * l = llama_get_logits_ith(ctx, j);
                out.insert(out.end(), l, l + n_vocab);
            }
        }
    }
    llama_batch_free(batch);
    return out;
}

// The largest logit difference over the largest logit of b (INFINITY when either is missing).
inline double rel_diff(const std::vector<float> & a, const std::vector<float> & b) {
    if (a.empty() || a.size() != b.size()) {
        return INFINITY;
    }
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        num = std::max(num, (double) std::fabs(a[i] - b[i]));
        den = std::max(den, (double) std::fabs(b[i]));
    }
    return num / den;
}

// KL(softmax(ref) || softmax(a)) of one token's logits.
inline double kl_row(const float * ref, const float * a, size_t n) {
    const double mr = *std::max_element(ref, ref + n);
    const double ma = *std::max_element(a, a + n);
    double zr = 0.0, za = 0.0;
    for (size_t i = 0; i < n; ++i) {
        zr += std::exp(ref[i] - mr);
        za += std::exp(a[i] - ma);
    }
    double k = 0.0;
    for (size_t i = 0; i < n; ++i) {
        const double lr = ref[i] - mr - std::log(zr);
        const double la = a[i] - ma - std::log(za);
        k += std::exp(lr) * (lr - la);
    }
    return k;
}

} // namespace kvc_test
