// Differential fuzzer of the residual buffer and the tracker. Usage:
//   test-kvc-fuzz MODEL.gguf [SECONDS [SEED]]
//
// Each run draws a buffer configuration and a sequence of the operations llama.cpp users
// apply to a cache (decodes of random lengths and ubatch sizes on two sequences, seq_rm from
// the end, seq_cp, seq_keep, a context shift, a state round trip) and applies it in lockstep
// to four contexts: f16, f16 with the configuration, kvc4, kvc4 with it. After every decode:
// - f16 with any configuration gives the f16 logits bit for bit (nothing is quantized);
// - over the run, the buffered kvc4 context is no further from f16 than plain kvc4 is:
//   mean KL to f16 at most KVC_FUZZ_MARGIN x plain kvc4's.
// Runs start with seeds SEED, SEED + 1, ... until SECONDS (default 150) have passed; a
// failing check names its seed, and `test-kvc-fuzz MODEL 1 SEED` replays that run alone.

#include "kvc-llama-util.h"
#include "kvc-test-util.h"
#include "llama-kvcomp.h"

#include <array>
#include <chrono>
#include <cstdlib>
#include <random>
#include <string>

using namespace kvc_test;

namespace {

// the buffered kvc4 context may come out at most this much further from f16 than plain kvc4
constexpr double KVC_FUZZ_MARGIN = 1.0;
constexpr int    N_OPS           = 14;
constexpr int    N_CTX           = 512;

struct fuzz_ctx {
    ctx_ptr c;
    const char * name;
};

struct run_result {
    bool   ok = true;
    int    n_decodes = 0;
    int    n_tokens  = 0;
    size_t n_diff = 0; // f16 logits that the buffered f16 context changed
    double kl_plain = 0.0, kl_buf = 0.0;
    std::string ops;
};

run_result fuzz_run(llama_model * model, const std::vector<llama_token> & toks, uint32_t seed) {
    std::mt19937 rng(seed);
    const auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

    llama_kvcomp_params kp = llama_kvcomp_default_params();
    const std::array<std::array<int, 2>, 4> shapes = { { { 4, 0 }, { 0, 2 }, { 8, 2 }, { 32, 4 } } };
    const auto & shape = shapes[pick(0, 3)];
    kp.window         = shape[0];
    kp.sinks          = shape[1];
    kp.merge_interval = pick(1, 8);
    kp.tracker        = pick(0, 1);
    const bool unified = pick(0, 1) == 1;

    run_result res;
    res.ops = "W" + std::to_string(kp.window) + " S" + std::to_string(kp.sinks) + " N" + std::to_string(kp.merge_interval) +
              " T" + std::to_string(kp.tracker) + (unified ? " unified:" : " split:");

    std::array<fuzz_ctx, 4> ctxs = { {
        { { make_ctx(model, GGML_TYPE_F16, 2, unified) }, "f16" },
        { { make_ctx(model, GGML_TYPE_F16, 2, unified) }, "f16+buffer" },
        { { make_ctx(model, GGML_TYPE_KVC4, 2, unified) }, "kvc4" },
        { { make_ctx(model, GGML_TYPE_KVC4, 2, unified) }, "kvc4+buffer" },
    } };
    for (size_t i = 0; i < ctxs.size(); ++i) {
        if (!ctxs[i].c.ctx || ((i == 1 || i == 3) && llama_kvcomp_configure(ctxs[i].c.ctx, &kp) != 0)) {
            res.ok = false;
            return res;
        }
    }

    // each sequence reads its own stretch of the prompt, indexed by position
    std::array<std::vector<llama_token>, 2> text;
    for (int s = 0; s < 2; ++s) {
        for (int p = 0; p < N_CTX; ++p) {
            text[s].push_back(toks[(p + 97 * s) % toks.size()]);
        }
    }
    std::array<int, 2> next = { 0, 0 }; // position of each sequence's next token
    const size_t n_vocab = (size_t) llama_vocab_n_tokens(llama_model_get_vocab(model));

    const auto each = [&](auto && f) {
        for (auto & fc : ctxs) {
            f(fc.c.ctx);
        }
    };
    for (int op = 0; op < N_OPS && res.ok; ++op) {
        const int kind = next[0] == 0 ? 0 : pick(0, 9);
        const int s = pick(0, 1);
        if (kind <= 3) {
            // decode n tokens in ubatches of `chunk`, keeping the sequence inside its share of the context
            const int room = N_CTX / 2 - 8 - next[s];
            if (room < 1) {
                res.ops += " full";
                continue;
            }
            const int n = std::min(room, pick(1, 48));
            const int chunk = std::array<int, 4>{ 1, 4, 16, n }[pick(0, 3)];
            res.ops += " d" + std::to_string(s) + ":" + std::to_string(n) + "/" + std::to_string(chunk);
            // every token's logits: one token's KL swings by an order of magnitude with the
            // rounding of a single code, the mean over a decode's tokens much less
            std::array<std::vector<float>, 4> out;
            for (size_t i = 0; i < ctxs.size(); ++i) {
                out[i] = decode(ctxs[i].c.ctx, text[s], next[s], next[s] + n, chunk, s, n);
            }
            if (std::any_of(out.begin(), out.end(), [&](const std::vector<float> & o) { return o.size() != n * n_vocab; })) {
                res.ok = false;
                break;
            }
            for (size_t j = 0; j < out[0].size(); ++j) {
                res.n_diff += out[1][j] != out[0][j];
            }
            for (size_t r = 0; r < out[0].size(); r += n_vocab) {
                res.kl_plain += kl_row(out[0].data() + r, out[2].data() + r, n_vocab);
                res.kl_buf   += kl_row(out[0].data() + r, out[3].data() + r, n_vocab);
                ++res.n_tokens;
            }
            ++res.n_decodes;
        } else if (kind == 4) {
            // cut back, as a reused prompt or a rejected draft does
            const int p0 = std::max(0, next[s] - pick(1, 40));
            res.ops += " rm" + std::to_string(s) + ":" + std::to_string(p0);
            each([&](llama_context * ctx) { llama_memory_seq_rm(llama_get_memory(ctx), s, p0, -1); });
        } else if (kind == 5 && next[0] > 0) {
            res.ops += " cp0>1";
            each([&](llama_context * ctx) {
                llama_memory_seq_rm(llama_get_memory(ctx), 1, -1, -1);
                llama_memory_seq_cp(llama_get_memory(ctx), 0, 1, -1, -1);
            });
            text[1] = text[0];
        } else if (kind == 6) {
            res.ops += " keep0";
            each([&](llama_context * ctx) { llama_memory_seq_keep(llama_get_memory(ctx), 0); });
        } else if (kind == 7 && next[s] > 24) {
            // context shift as llama-server does it: keep 4, drop k, move the rest down
            const int k = pick(4, next[s] - 12);
            res.ops += " shift" + std::to_string(s) + ":" + std::to_string(k);
            each([&](llama_context * ctx) {
                llama_memory_t mem = llama_get_memory(ctx);
                llama_memory_seq_rm(mem, s, 4, 4 + k);
                llama_memory_seq_add(mem, s, 4 + k, -1, -k);
            });
            text[s].erase(text[s].begin() + 4, text[s].begin() + 4 + k);
            text[s].resize(N_CTX, text[s].back());
        } else if (kind >= 8) {
            res.ops += " state";
            each([&](llama_context * ctx) {
                std::vector<uint8_t> st(llama_state_get_size(ctx));
                st.resize(llama_state_get_data(ctx, st.data(), st.size()));
                res.ok = res.ok && llama_state_set_data(ctx, st.data(), st.size()) == st.size();
            });
        }
        // what the caches hold is upstream's to say (seq_keep leaves a split cache's other
        // streams alone); the four must agree
        for (int q = 0; q < 2; ++q) {
            next[q] = llama_memory_seq_pos_max(llama_get_memory(ctxs[0].c.ctx), q) + 1;
            each([&](llama_context * ctx) { res.ok = res.ok && llama_memory_seq_pos_max(llama_get_memory(ctx), q) + 1 == next[q]; });
        }
    }
    return res;
}

} // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [SECONDS [SEED]]\n", argv[0]);
        return 2;
    }
    const double budget = argc > 2 ? std::atof(argv[2]) : 150.0;
    const uint32_t seed0 = argc > 3 ? (uint32_t) std::strtoul(argv[3], nullptr, 10) : 1;
    llama_model * model = load_test_model_file(argv[1]);
    if (!model) {
        return 2;
    }
    std::string prose;
    for (int i = 0; prose.size() < 4000; ++i) {
        prose += "Entry " + std::to_string(i) + ": the keeper logged the weather, the ships and the state of the lamp. ";
    }
    std::vector<llama_token> toks = test_tokenize(model, prose, 2048);
    const int n = (int) toks.size();

    report rep;
    rep.check(n >= 600, "prompt has %d tokens", n);
    const auto t0 = std::chrono::steady_clock::now();
    int n_runs = 0;
    for (uint32_t seed = seed0; n >= 600; ++seed) {
        const run_result r = fuzz_run(model, toks, seed);
        ++n_runs;
        const double kl_plain = r.kl_plain / std::max(1, r.n_tokens);
        const double kl_buf   = r.kl_buf / std::max(1, r.n_tokens);
        rep.check(r.ok && r.n_diff == 0 && kl_buf <= KVC_FUZZ_MARGIN * kl_plain,
            "seed %u (%s): %d decodes of %d tokens, f16+buffer changed %zu logits, mean KL to f16 kvc4+buffer %.2e <= %.1f x kvc4 %.2e",
            seed, r.ops.c_str(), r.n_decodes, r.n_tokens, r.n_diff, kl_buf, KVC_FUZZ_MARGIN, kl_plain);
        if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= budget) {
            break;
        }
    }
    rep.check(n_runs > 0, "%d runs in %.0f s", n_runs, budget);
    llama_model_free(model);
    llama_backend_free();
    return rep.finish("test-kvc-fuzz");
}
