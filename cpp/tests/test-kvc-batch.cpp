// One arithmetic per query: a token's logits do not depend on how its prompt was cut into
// ubatches, on whether it is decoded again after a cut-back, nor on the other sequences of a
// unified cache. Usage: test-kvc-batch MODEL.gguf [K_STATS.gguf]
//
// For each cache (upstream's q8_0 as the reference, then every kvc type, every mode's knobs
// with the scale tracker off, and with K statistics the kvct K pair and the modes that take
// it), prompts of 38 and 512 tokens are decoded as one ubatch, as ubatches of 1, 7 and 32,
// as one ubatch followed by seq_rm of the last token and its decode alone (the buffer keeps
// the rows that cut-back needs: llama_kvcomp_seq_rm_exact must say so), and so again after
// N_REUSE more tokens with keep_prompt (a prompt llama-server reuses after a generation whose
// window has moved past the prompt's). The last token's logits of every way must equal the
// one-ubatch logits. On a unified cache the prompt and 24
// greedy tokens are decoded beside two other sequences whose cells lie between its own and
// whose tokens share its ubatches, and alone on the same cache; every logit of the two must
// be equal (every mode with its tracker too: a cache that several sequences share gives its
// stream no K offset, where one of its own has one). The bound is upstream q8_0's largest
// difference in the same run (0 on this build), not a tolerance for another kernel's
// rounding.

#include "kvc-llama-util.h"
#include "kvc-test-util.h"
#include "llama.h"
#include "llama-kvcomp.h"

#include <algorithm>
#include <string>

using namespace kvc_test;

namespace {

struct cache_config {
    std::string name;
    ggml_type   type_k, type_v;
    int32_t     mode;  // LLAMA_KVCOMP_MODE_CUSTOM: none
    bool        stats; // the K statistics are set
    bool        no_tracker = false; // the mode's knobs without the scale tracker
    bool        unified_only = false; // only the unified way (the tracker's offset is 0 there)
};

const int      WAY_UNIFIED   = -1;  // last_logits' way beside other sequences, with generation
const int      WAY_ALONE     = -2;  // its reference: the same on the same unified cache, alone
const int      WAY_REUSED    = -3;  // seq_rm's way after N_REUSE more tokens, with keep_prompt
const int      N_REUSE       = 72;  // past balanced's window and merge interval (56 + 8)
const int      N_GEN         = 24;  // greedy tokens the unified ways generate
const uint32_t UNIFIED_SEQS  = 3;
const uint32_t UNIFIED_EXTRA = 192; // cells for the other sequences and the generated tokens

struct runner {
    llama_model * model;
    const char *  stats_path;
    uint32_t      n_ctx;

    // one sequence in n_ctx cells, or UNIFIED_SEQS on a unified cache with room for the others
    llama_context * make(const cache_config & c, bool unified = false, bool keep_prompt = false) const {
        llama_context_params cp = test_ctx_params(c.type_k, unified ? UNIFIED_SEQS : 1, true, c.type_v);
        cp.n_ctx = unified ? n_ctx + UNIFIED_EXTRA : n_ctx;
        cp.n_batch = cp.n_ctx;
        cp.n_ubatch = cp.n_ctx;
        llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) {
            return nullptr;
        }
        if (c.stats && llama_kvcomp_set_k_stats(ctx, stats_path) != 0) {
            llama_free(ctx);
            return nullptr;
        }
        if (c.mode != LLAMA_KVCOMP_MODE_CUSTOM) {
            llama_kvcomp_params kp;
            ggml_type tk, tv;
            if (llama_kvcomp_mode_preset(c.mode, &kp, &tk, &tv) != 0) {
                llama_free(ctx);
                return nullptr;
            }
            kp.tracker = c.no_tracker ? 0 : kp.tracker;
            kp.keep_prompt = keep_prompt ? 1 : 0;
            if (llama_kvcomp_configure(ctx, &kp) != 0) {
                llama_free(ctx);
                return nullptr;
            }
        }
        return ctx;
    }

    // the last token's logits of toks[0, n) decoded in ubatches of `chunk` (0: one ubatch, then
    // seq_rm of the last token and its decode alone, WAY_REUSED the same after N_REUSE more
    // tokens; WAY_UNIFIED and WAY_ALONE: on_unified's logits of the prompt's last token and of
    // each generated one)
    std::vector<float> last_logits(const cache_config & c, const std::vector<llama_token> & toks, int n, int chunk) const {
        ctx_ptr p{ make(c, chunk == WAY_UNIFIED || chunk == WAY_ALONE, chunk == WAY_REUSED) };
        if (!p.ctx) {
            return {};
        }
        if (chunk == WAY_UNIFIED || chunk == WAY_ALONE) {
            return on_unified(p.ctx, toks, n, chunk == WAY_UNIFIED);
        }
        if (chunk > 0) {
            return decode(p.ctx, toks, 0, n, chunk);
        }
        if (decode(p.ctx, toks, 0, n, n).empty() ||
            (chunk == WAY_REUSED && decode(p.ctx, toks, n, n + N_REUSE, 1).empty()) ||
            llama_kvcomp_seq_rm_exact(p.ctx, 0, n - 1, -1) != 1 ||
            !llama_memory_seq_rm(llama_get_memory(p.ctx), 0, n - 1, -1)) {
            return {};
        }
        return decode(p.ctx, toks, n - 1, n, 1);
    }

    // Sequence 0's prompt and N_GEN greedy tokens on a unified cache, its logits at each of
    // them one after the other. Beside others (as llama-server's slots share one): sequence 1
    // takes the first cells, sequences 0 and 2 come in one ubatch with their tokens
    // interleaved, then every step decodes sequence 0's token beside one of each other's, so
    // its keys sit at other cells, between keys it does not see, and its queries come in
    // ubatches of three. Alone: the prompt in one ubatch, then one token a step.
    static std::vector<float> on_unified(llama_context * ctx, const std::vector<llama_token> & toks, int n, bool others) {
        const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        const int n1 = 45, n2 = 29, o1 = 600, o2 = 800; // the others' lengths and where their text starts
        if ((int) toks.size() < o2 + n2 + N_GEN || n1 + n2 + 3 * N_GEN + 1 > (int) UNIFIED_EXTRA) {
            fprintf(stderr, "on_unified: %zu tokens of text, room for %u others' cells\n", toks.size(), UNIFIED_EXTRA);
            return {};
        }
        llama_batch batch = llama_batch_init(std::max(n + n2, n1), 0, 1);
        const auto add = [&](llama_token t, llama_pos pos, llama_seq_id seq, bool logits) {
            const int j = batch.n_tokens++;
            batch.token[j]     = t;
            batch.pos[j]       = pos;
            batch.n_seq_id[j]  = 1;
            batch.seq_id[j][0] = seq;
            batch.logits[j]    = logits;
        };
        // decodes the batch and appends sequence 0's logits; its greedy token in `next`
        std::vector<float> out;
        llama_token next = 0;
        const auto run = [&]() {
            const int32_t res = llama_decode(ctx, batch);
            if (res != 0) {
                fprintf(stderr, "on_unified: llama_decode of %d tokens returned %d\n", batch.n_tokens, res);
                return false;
            }
            for (int j = 0; j < batch.n_tokens; ++j) {
                if (batch.logits[j]) {
                    const float * l = llama_get_logits_ith(ctx, j);
                    out.insert(out.end(), l, l + n_vocab);
                    next = (llama_token) (std::max_element(l, l + n_vocab) - l);
                }
            }
            batch.n_tokens = 0;
            return true;
        };
        batch.n_tokens = 0;
        bool ok = true;
        if (others) {
            for (int i = 0; i < n1; ++i) {
                add(toks[o1 + i], i, 1, false);
            }
            ok = run();
        }
        int i2 = 0; // sequence 2's tokens so far
        for (int i = 0; ok && i < n; ++i) {
            add(toks[i], i, 0, i == n - 1);
            if (others && i % 3 == 1 && i2 < n2) {
                add(toks[o2 + i2], i2, 2, false);
                ++i2;
            }
        }
        ok = ok && run();
        for (int g = 0; ok && g < N_GEN; ++g) {
            if (others && g % 2 == 0) {
                add(toks[o1 + n1 + g], n1 + g, 1, false);
            }
            add(next, n + g, 0, true);
            if (others) {
                add(toks[o2 + i2 + g], i2 + g, 2, false);
            }
            if (others && g % 2 == 1) {
                add(toks[o1 + n1 + g], n1 + g, 1, false);
            }
            ok = run();
        }
        llama_batch_free(batch);
        return ok ? out : std::vector<float>();
    }
};

// Ordinary, varied text from a fixed generator (a repetitive prompt would hide how attention
// spreads over keys).
std::string sample_text() {
    static const char * words[] = { "the", "river", "carried", "old", "letters", "past", "a", "quiet", "town", "where",
                                    "nobody", "read", "them", "until", "winter", "came", "and", "children", "found",
                                    "paper", "boats", "under", "bridges", "of", "stone", "while", "their", "parents",
                                    "argued", "about", "prices", "bread", "lamps", "music", "every", "evening" };
    const size_t n_words = sizeof(words) / sizeof(words[0]);
    std::string text;
    uint32_t x = 12345;
    for (int i = 0; i < 1200; ++i) {
        x = x * 1103515245u + 12345u;
        text += words[(x >> 16) % n_words];
        text += (x >> 8) % 11 == 0 ? ". " : " ";
    }
    return text;
}

double max_abs_diff(const std::vector<float> & a, const std::vector<float> & b) {
    if (a.empty() || a.size() != b.size()) {
        return INFINITY;
    }
    double d = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        d = std::max(d, (double) std::fabs(a[i] - b[i]));
    }
    return d;
}

const int CHUNKS[] = { 1, 7, 32, 0, WAY_REUSED, WAY_UNIFIED };

// The largest difference to one ubatch over the ways of CHUNKS, for a prompt of n tokens;
// `ways` gets each way's.
double worst_split(report & rep, const runner & r, const cache_config & c, const std::vector<llama_token> & toks, int n,
                   std::string & ways) {
    const std::vector<float> whole = r.last_logits(c, toks, n, n);
    rep.check(!whole.empty(), "%s decodes a %d-token prompt", c.name.c_str(), n);
    double worst = 0.0;
    for (const int chunk : CHUNKS) {
        if (c.unified_only && chunk != WAY_UNIFIED) {
            continue;
        }
        // beside others against alone on the same cache (a mode with its tracker keeps a K
        // offset on a cache of its own, none on a shared one)
        const double d = chunk == WAY_UNIFIED ?
            max_abs_diff(r.last_logits(c, toks, n, WAY_UNIFIED), r.last_logits(c, toks, n, WAY_ALONE)) :
            max_abs_diff(r.last_logits(c, toks, n, chunk), whole);
        char buf[64];
        snprintf(buf, sizeof(buf), "%s%s %.3g", ways.empty() ? "" : ", ", chunk > 0 ? std::to_string(chunk).c_str() : chunk == 0 ? "seq_rm" : chunk == WAY_REUSED ? "reused" : "unified", d);
        ways += buf;
        worst = std::max(worst, d);
    }
    return worst;
}

} // namespace

int main(int argc, char ** argv) {
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: %s MODEL.gguf [K_STATS.gguf]\n", argv[0]);
        return 1;
    }
    llama_model * model = load_test_model_file(argv[1]);
    if (!model) {
        return 1;
    }
    report rep;
    const char * stats = argc == 3 ? argv[2] : nullptr;

    std::vector<cache_config> configs = {
        { "kvc8", GGML_TYPE_KVC8, GGML_TYPE_KVC8, LLAMA_KVCOMP_MODE_CUSTOM, false },
        { "kvc4", GGML_TYPE_KVC4, GGML_TYPE_KVC4, LLAMA_KVCOMP_MODE_CUSTOM, false },
        { "kvc3", GGML_TYPE_KVC3, GGML_TYPE_KVC3, LLAMA_KVCOMP_MODE_CUSTOM, false },
    };
    for (int32_t m = LLAMA_KVCOMP_MODE_LOW_LATENCY; m <= LLAMA_KVCOMP_MODE_HIGH_PRECISION; ++m) {
        llama_kvcomp_params kp;
        ggml_type tk, tv;
        llama_kvcomp_mode_preset(m, &kp, &tk, &tv);
        configs.push_back({ std::string(llama_kvcomp_mode_name(m)) + " without the tracker", tk, tv, m, false, true });
        configs.push_back({ std::string(llama_kvcomp_mode_name(m)) + " with the tracker", tk, tv, m, false, false, true });
        const int32_t tks = llama_kvcomp_mode_type_k_stats(m);
        if (stats && tks != (int32_t) tk) {
            configs.push_back({ std::string(llama_kvcomp_mode_name(m)) + "+stats", (ggml_type) tks, tv, m, true, false });
        }
    }
    if (stats) {
        configs.push_back({ "kvct4/kvc4", GGML_TYPE_KVCT4, GGML_TYPE_KVC4, LLAMA_KVCOMP_MODE_CUSTOM, true });
    }

    const std::vector<llama_token> toks = test_tokenize(model, sample_text(), 4096);
    for (const int n : { 38, 512 }) {
        const runner r{ model, stats, (uint32_t) std::max(n + N_REUSE + 24, 512) };
        if ((int) toks.size() < n + N_REUSE) {
            rep.check(false, "the text gives %d tokens", n);
            continue;
        }
        const cache_config ref = { "q8_0", GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, LLAMA_KVCOMP_MODE_CUSTOM, false };
        std::string ways;
        const double bound = worst_split(rep, r, ref, toks, n, ways);
        rep.check(bound < 1e-3, "%d tokens: upstream q8_0 gives the same logits whatever the split (largest difference %.3g)", n, bound);
        for (const cache_config & c : configs) {
            ways.clear();
            const double d = worst_split(rep, r, c, toks, n, ways);
            rep.check(d <= bound, "%d tokens, %s: ubatches of 1, 7, 32, a re-decode after seq_rm (after a generation too) give one ubatch's logits, and beside others on a unified cache alone's (largest difference %.3g <= %.3g; %s)",
                      n, c.name.c_str(), d, bound, ways.c_str());
        }
    }
    llama_model_free(model);
    llama_backend_free();
    return rep.finish("test-kvc-batch");
}
