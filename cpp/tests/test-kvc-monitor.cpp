// The monitor when a model's rows are not finite: no NaN/Inf reaches its statistics
// or its exports, it counts what it kept out, and it recovers. Usage: test-kvc-monitor MODEL.gguf
//
// Route: one token whose input embedding is NaN, decoded for a second sequence between the
// generation steps of a first. Its K/V rows and its logits come out NaN in every layer through
// the real graph and the real statistics path: the tracker's tap copies its K row as it came,
// the kvc quantizer stores it as zeros (docs/formats.md, "NaN/Inf"), a residual buffer keeps
// it in an F16 slot (its V norms become NaN; its K row is taken as 0, as the quantizer takes
// it, before the tracker's offset is removed), and its logits reach the first sequence's
// perplexity window when they are observed for it. The other real route, a state file with a
// NaN row, is refused by the state checks (kvcomp-state.cpp) before the monitor sees it, and
// writing NaN into the tracker's tap from here would skip the graph.
//
// Reference: the same run without the NaN step. The first sequence never attends to the
// second (its cells and slots are masked), so its logits, and every statistic once the bad
// row is left out, are those of the reference: the check is equality up to float summation
// order (REL_EQ), where a statistic that took the row in would be NaN or off by a whole row.
// Two configurations: low-latency (the tracker alone) and a residual buffer (window 16,
// merged every ubatch, so the rows held at the end do not depend on the merge schedule).

#include "kvc-llama-util.h"
#include "kvc-test-util.h"
#include "llama.h"
#include "llama-kvcomp.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

using namespace kvc_test;

namespace {

// equal up to the order of a float sum (buffer norms sum slots, which the NaN token shifted)
constexpr double REL_EQ = 1e-5;

constexpr int N_PROMPT = 64;
constexpr int N_GEN_1  = 8;  // steps before the NaN token
constexpr int N_GEN_2  = 15; // steps after the snapshot taken while it is held

struct snapshot {
    llama_kvcomp_snapshot top = {};
    std::vector<llama_kvcomp_head_snapshot> heads;
    std::vector<llama_kvcomp_seq_snapshot> seqs;
    std::string prom, json;
};

std::string snapshot_text(llama_context * ctx, int32_t format) {
    const int64_t n = llama_kvcomp_snapshot_text(ctx, format, -1, nullptr, 0);
    std::string s(n > 0 ? (size_t) n + 1 : 1, '\0');
    llama_kvcomp_snapshot_text(ctx, format, -1, s.data(), s.size());
    s.resize(n > 0 ? (size_t) n : 0);
    return s;
}

snapshot take_snapshot(llama_context * ctx) {
    llama_kvcomp_monitor_refresh(ctx);
    snapshot s;
    s.heads.resize(4096);
    s.seqs.resize(16);
    llama_kvcomp_get_snapshot(ctx, &s.top, s.heads.data(), (int32_t) s.heads.size(), s.seqs.data(), (int32_t) s.seqs.size(),
                              nullptr, 0);
    s.heads.resize(std::min<size_t>(s.heads.size(), std::max(0, s.top.n_heads)));
    s.seqs.resize(std::min<size_t>(s.seqs.size(), std::max(0, s.top.n_seqs)));
    s.prom = snapshot_text(ctx, LLAMA_KVCOMP_FORMAT_PROMETHEUS);
    s.json = snapshot_text(ctx, LLAMA_KVCOMP_FORMAT_JSON);
    return s;
}

// Whether every sample of a Prometheus text is a finite number, and the JSON has no
// non-finite literal (it writes null for them).
bool texts_finite(const snapshot & s) {
    size_t pos = 0;
    int n_samples = 0;
    while (pos < s.prom.size()) {
        const size_t end = std::min(s.prom.find('\n', pos), s.prom.size());
        const std::string line = s.prom.substr(pos, end - pos);
        pos = end + 1;
        if (line.empty() || line[0] == '#') {
            continue;
        }
        const std::string v = line.substr(line.rfind(' ') + 1);
        char * stop = nullptr;
        const double x = std::strtod(v.c_str(), &stop);
        if (*stop != '\0' || !std::isfinite(x)) {
            return false;
        }
        ++n_samples;
    }
    std::string json = s.json;
    std::transform(json.begin(), json.end(), json.begin(), [](unsigned char c) { return (char) std::tolower(c); });
    for (const char * bad : { ":nan", ":-nan", ":inf", ":-inf", ":+inf" }) {
        if (json.find(bad) != std::string::npos) {
            return false;
        }
    }
    return n_samples > 0 && !json.empty();
}

// How many samples of a Prometheus series (name followed by '{') the text has.
int count_samples(const std::string & prom, const std::string & name) {
    int n = 0;
    for (size_t at = prom.find("\n" + name + "{"); at != std::string::npos; at = prom.find("\n" + name + "{", at + 1)) {
        ++n;
    }
    return n;
}

struct run_result {
    bool ok = false;
    std::vector<float> logits; // seq 0's logits at every generation step, one row after the other
    snapshot held;             // after the step that folds the NaN token's rows (held in the buffer)
    snapshot final_;           // at the end, the NaN sequence removed
    std::vector<llama_kvcomp_layer_stats> layers;
};

llama_token argmax(const std::vector<float> & logits) {
    return (llama_token) (std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// Greedy steps of seq 0 from pos; the token each decode's logits give is observed right after
// it, as a server observes what it sampled. Appends each step's logits to out.
bool generate(llama_context * ctx, std::vector<float> & logits, int & pos, int n, std::vector<float> & out) {
    llama_batch batch = llama_batch_init(1, 0, 1);
    bool ok = true;
    for (int i = 0; i < n && ok; ++i) {
        const llama_token t = argmax(logits);
        batch.n_tokens     = 1;
        batch.token[0]     = t;
        batch.pos[0]       = pos++;
        batch.n_seq_id[0]  = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0]    = true;
        ok = llama_decode(ctx, batch) == 0;
        if (ok) {
            const float * l = llama_get_logits_ith(ctx, -1);
            std::copy(l, l + logits.size(), logits.begin());
            out.insert(out.end(), logits.begin(), logits.end());
            llama_kvcomp_observe(ctx, 0, -1, argmax(logits));
        }
    }
    llama_batch_free(batch);
    return ok;
}

// One token of seq 1 at position 0 whose input embedding is NaN; its logits are observed
// for seq 0, as a server would observe a token it sampled from them.
bool decode_nan_token(llama_context * ctx, llama_model * model) {
    const int32_t n_embd = llama_model_n_embd(model);
    llama_batch batch = llama_batch_init(1, n_embd, 1);
    std::fill(batch.embd, batch.embd + n_embd, NAN);
    batch.n_tokens     = 1;
    batch.pos[0]       = 0;
    batch.n_seq_id[0]  = 1;
    batch.seq_id[0][0] = 1;
    batch.logits[0]    = true;
    const bool ok = llama_decode(ctx, batch) == 0;
    llama_batch_free(batch);
    const float * l = ok ? llama_get_logits_ith(ctx, 0) : nullptr;
    return ok && l && std::isnan(l[0]) && llama_kvcomp_observe(ctx, 0, 0, 0) == 0;
}

run_result run(llama_model * model, const std::vector<llama_token> & toks, const llama_kvcomp_params & p, bool with_nan) {
    run_result r;
    ctx_ptr c{ make_ctx(model, GGML_TYPE_KVC4, 2) };
    llama_kvcomp_monitor_params mp = llama_kvcomp_monitor_default_params();
    mp.ppl_window      = 8;
    mp.degrade_windows = 0;    // the mode stays: both runs compare the same configuration
    mp.refresh         = 1000; // snapshots only where this test takes them
    if (!c.ctx || llama_kvcomp_configure(c.ctx, &p) != 0 || llama_kvcomp_set_monitor(c.ctx, &mp) != 0) {
        return r;
    }
    std::vector<float> logits = decode(c.ctx, toks, 0, N_PROMPT, 16);
    int pos = N_PROMPT;
    if (logits.empty() || llama_kvcomp_observe(c.ctx, 0, -1, argmax(logits)) != 0 ||
        !generate(c.ctx, logits, pos, N_GEN_1, r.logits)) {
        return r;
    }
    if (with_nan && !decode_nan_token(c.ctx, model)) {
        return r;
    }
    // the next step's update folds the NaN token's tap
    if (!generate(c.ctx, logits, pos, 1, r.logits)) {
        return r;
    }
    r.held = take_snapshot(c.ctx);
    if (with_nan && !llama_memory_seq_rm(llama_get_memory(c.ctx), 1, -1, -1)) {
        return r;
    }
    if (!generate(c.ctx, logits, pos, N_GEN_2, r.logits)) {
        return r;
    }
    r.final_ = take_snapshot(c.ctx);
    for (int32_t il = 0; il < llama_model_n_layer(model); ++il) {
        llama_kvcomp_layer_stats ls = {};
        if (llama_kvcomp_get_layer_stats(c.ctx, il, &ls) == 0) {
            r.layers.push_back(ls);
        }
    }
    r.ok = true;
    return r;
}

double rel(double a, double b) {
    return a == b ? 0.0 : std::fabs(a - b) / std::max(std::fabs(b), 1e-30);
}

// Largest relative difference between two runs' statistics (INFINITY when their shapes differ
// or a value is not finite).
double stats_diff(const run_result & a, const run_result & b) {
    double d = 0.0;
    const auto upd = [&](double x, double y) {
        d = std::max(d, std::isfinite(x) && std::isfinite(y) ? rel(x, y) : INFINITY);
    };
    if (a.final_.heads.size() != b.final_.heads.size() || a.layers.size() != b.layers.size() || a.layers.empty()) {
        return INFINITY;
    }
    for (size_t i = 0; i < a.final_.heads.size(); ++i) {
        const auto & x = a.final_.heads[i];
        const auto & y = b.final_.heads[i];
        if (x.il != y.il || x.head != y.head) {
            return INFINITY;
        }
        upd(x.k_rmse, y.k_rmse);
        upd(x.k_rmse_rel, y.k_rmse_rel);
        upd(x.k_scale, y.k_scale);
        upd(x.v_scale, y.v_scale);
        upd(x.buf_l2_k, y.buf_l2_k);
        upd(x.buf_l2_v, y.buf_l2_v);
    }
    for (size_t i = 0; i < a.layers.size(); ++i) {
        const auto & x = a.layers[i];
        const auto & y = b.layers[i];
        if (x.n_rows != y.n_rows) {
            return INFINITY;
        }
        upd(x.k_rms, y.k_rms);
        upd(x.k_rmse, y.k_rmse);
        upd(x.k_rmse_plain, y.k_rmse_plain);
        for (int h = 0; h < LLAMA_KVCOMP_MAX_HEADS; ++h) {
            upd(x.k_scale[h], y.k_scale[h]);
            upd(x.v_scale[h], y.v_scale[h]);
        }
    }
    return d;
}

void test_config(report & rep, llama_model * model, const std::vector<llama_token> & toks, const char * name,
                 const llama_kvcomp_params & p, bool buffered) {
    const run_result ref = run(model, toks, p, false);
    const run_result bad = run(model, toks, p, true);
    if (!ref.ok || !bad.ok) {
        rep.check(false, "%s: both runs decode (reference %d, with the NaN token %d)", name, ref.ok, bad.ok);
        return;
    }
    const int32_t n_layer = llama_model_n_layer(model);
    const size_t  n_heads = bad.final_.heads.size();

    // the first sequence does not see the second: its logits are the reference's
    double d_logits = bad.logits.size() == ref.logits.size() ? 0.0 : INFINITY;
    for (size_t i = 0; i < bad.logits.size() && i < ref.logits.size(); ++i) {
        d_logits = std::max(d_logits, std::isfinite(bad.logits[i]) ? (double) std::fabs(bad.logits[i] - ref.logits[i]) : INFINITY);
    }
    rep.check(d_logits <= 1e-4, "%s: seq 0's logits with a NaN token beside it = the reference's (max diff %.2e <= 1e-4)",
              name, d_logits);

    // While the NaN row is in the statistics' inputs: the tracker left it out of every layer
    // (n_layer rows), the window left out its log-probability (1), and a buffer's V norm of
    // every head could not be taken (1 per head), nothing else. Its K row is stored as k - c
    // with the NaN taken as 0 (kvcomp-tracker.cpp, transform), so the K norms stay finite.
    const int64_t want_held = n_layer + 1 + (buffered ? (int64_t) n_heads : 0);
    int n_nan_l2 = 0;
    for (const auto & h : bad.held.heads) {
        n_nan_l2 += std::isnan(h.buf_l2_k) + std::isnan(h.buf_l2_v);
    }
    rep.check(bad.held.top.n_nonfinite == want_held && ref.held.top.n_nonfinite == 0 && ref.final_.top.n_nonfinite == 0,
              "%s: non-finite values counted while held: %lld (want %lld = %d layers + 1 token%s), reference 0",
              name, (long long) bad.held.top.n_nonfinite, (long long) want_held, n_layer, buffered ? " + heads" : "");
    rep.check(texts_finite(bad.held) && texts_finite(bad.final_) &&
              bad.held.prom.find("\nllamacpp:kvcomp_nonfinite_total " + std::to_string(want_held) + "\n") != std::string::npos &&
              bad.held.json.find("\"nonfinite\":" + std::to_string(want_held) + ",") != std::string::npos,
              "%s: /metrics and JSON texts hold no NaN/Inf and export the count", name);
    // the norms that could not be taken are NaN in the struct and absent from /metrics;
    // every other per-head series is there for every head
    const int n_l2_held = count_samples(bad.held.prom, "llamacpp:kvcomp_buffer_l2");
    rep.check(count_samples(bad.held.prom, "llamacpp:kvcomp_k_rmse") == (int) n_heads &&
              count_samples(bad.held.prom, "llamacpp:kvcomp_k_scale") == (int) n_heads &&
              n_l2_held == 2 * (int) n_heads - n_nan_l2 && n_nan_l2 == (buffered ? (int) n_heads : 0),
              "%s: while held: %d buffer norms NaN in the snapshot, %d buffer_l2 samples exported of %zu", name, n_nan_l2,
              n_l2_held, 2 * n_heads);

    // recovered: once the row is gone (the sequence removed), every statistic is the reference's
    const double d = stats_diff(bad, ref);
    rep.check(d <= REL_EQ && count_samples(bad.final_.prom, "llamacpp:kvcomp_buffer_l2") == 2 * (int) n_heads,
              "%s: after recovery the head and layer statistics = the reference's (max rel diff %.2e <= %.0e)", name, d, REL_EQ);
    const bool seq_ok = bad.final_.seqs.size() == 1 && ref.final_.seqs.size() == 1 &&
                        bad.final_.seqs[0].n_windows == ref.final_.seqs[0].n_windows &&
                        bad.final_.seqs[0].n_windows == (1 + N_GEN_1 + 1 + N_GEN_2) / 8 &&
                        bad.final_.seqs[0].n_tokens == ref.final_.seqs[0].n_tokens + 1 &&
                        std::isfinite(bad.final_.seqs[0].ppl_last) &&
                        rel(bad.final_.seqs[0].ppl_last, ref.final_.seqs[0].ppl_last) <= REL_EQ;
    rep.check(seq_ok, "%s: seq 0's windows skip the NaN token: %d windows, perplexity %.4f = reference %.4f",
              name, bad.final_.seqs.empty() ? -1 : bad.final_.seqs[0].n_windows,
              bad.final_.seqs.empty() ? 0.0f : bad.final_.seqs[0].ppl_last,
              ref.final_.seqs.empty() ? 0.0f : ref.final_.seqs[0].ppl_last);
    rep.check(bad.final_.top.n_nonfinite == want_held,
              "%s: nothing more is counted after recovery (%lld)", name, (long long) bad.final_.top.n_nonfinite);
}

} // namespace

// A split cache whose second stream has a NaN token among its first rows: its K offset, the mean
// of its first 32 rows, must count that row as zero (as the quantizer stores it) and stay
// finite, and the tracker must cost the sequence no more than it costs one that starts with
// a real token: mean KL (last 8 tokens) of tracker on against tracker off on the same kvc4
// cache, with the NaN row, <= NAN_STREAM_MARGIN x that KL without it (+ 1e-3). With a NaN
// offset every later key of the stream is stored as zeros.
constexpr double NAN_STREAM_MARGIN = 3.0;

// The last 8 logits rows of sequence 1 on a split kvc4 cache, and the largest offset RMS.
std::vector<float> nan_stream_run(llama_model * model, const std::vector<llama_token> & toks, bool tracker, bool nan_first,
                                  float & offset_rms, bool & offsets_finite) {
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<float> out;
    ctx_ptr c{ make_ctx(model, GGML_TYPE_KVC4, 2, false) };
    llama_kvcomp_params p = llama_kvcomp_default_params();
    p.tracker = tracker ? 1 : 0;
    if (!c.ctx || llama_kvcomp_configure(c.ctx, &p) != 0) {
        return out;
    }
    decode(c.ctx, toks, 0, 40, 40, 0);
    // sequence 1 (its own stream): 3 tokens of text (BOS first: the attention sink stays), a
    // NaN token or the text's own at position 3, then 44 more
    const int32_t n_embd = llama_model_n_embd(model);
    const auto put = [&](llama_batch & b, int pos, bool logits) {
        b.pos[b.n_tokens] = pos; b.n_seq_id[b.n_tokens] = 1; b.seq_id[b.n_tokens][0] = 1; b.logits[b.n_tokens] = logits;
        ++b.n_tokens;
    };
    llama_batch head = llama_batch_init(3, 0, 1);
    for (int j = 0; j < 3; ++j) {
        head.token[j] = toks[j];
        put(head, j, false);
    }
    bool ok = llama_decode(c.ctx, head) == 0;
    llama_batch_free(head);
    llama_batch nb = llama_batch_init(1, nan_first ? n_embd : 0, 1);
    if (nan_first) {
        std::fill(nb.embd, nb.embd + n_embd, NAN);
    } else {
        nb.token[0] = toks[3];
    }
    put(nb, 3, false);
    ok = ok && llama_decode(c.ctx, nb) == 0;
    llama_batch_free(nb);
    llama_batch b = llama_batch_init(48, 0, 1);
    for (int j = 4; j < 48; ++j) {
        b.token[b.n_tokens] = toks[j];
        put(b, j, j >= 40);
    }
    const bool ok2 = ok && llama_decode(c.ctx, b) == 0;
    for (int j = 36; ok2 && j < 44; ++j) {
        const float * l = llama_get_logits_ith(c.ctx, j);
        out.insert(out.end(), l, l + n_vocab);
    }
    llama_batch_free(b);
    // one more step, so the host reads the offset the last graph made
    decode(c.ctx, toks, 40, 41, 1, 0);
    for (int32_t il = 0; tracker && il < llama_model_n_layer(model); ++il) {
        llama_kvcomp_layer_stats ls = {};
        if (llama_kvcomp_get_layer_stats(c.ctx, il, &ls) == 0) {
            offsets_finite = offsets_finite && std::isfinite(ls.k_offset_rms);
            offset_rms = std::max(offset_rms, ls.k_offset_rms);
        }
    }
    return out;
}

void test_nan_in_first_rows(report & rep, llama_model * model, const std::vector<llama_token> & toks) {
    const size_t n_vocab = (size_t) llama_vocab_n_tokens(llama_model_get_vocab(model));
    const auto mean_kl = [&](const std::vector<float> & a, const std::vector<float> & b) {
        bool finite = !a.empty() && a.size() == b.size();
        for (float v : b) {
            finite = finite && std::isfinite(v);
        }
        double kl = 0.0;
        for (size_t t = 0; finite && t < a.size() / n_vocab; ++t) {
            kl += kl_row(a.data() + t * n_vocab, b.data() + t * n_vocab, n_vocab) / (double) (a.size() / n_vocab);
        }
        return finite ? kl : INFINITY;
    };
    float rms = 0.0f, rms_ref = 0.0f;
    bool finite = true, finite_ref = true;
    const double kl_nan = mean_kl(nan_stream_run(model, toks, false, true, rms, finite),
                                  nan_stream_run(model, toks, true, true, rms, finite));
    const double kl_ref = mean_kl(nan_stream_run(model, toks, false, false, rms_ref, finite_ref),
                                  nan_stream_run(model, toks, true, false, rms_ref, finite_ref));
    rep.check(finite && rms > 0.0f && kl_nan <= NAN_STREAM_MARGIN * kl_ref + 1e-3,
              "NaN among a stream's first rows: offsets finite (largest RMS %.3g, %.3g without the NaN), tracker on vs "
              "off mean KL %.2e <= %.0f x %.2e (the same without the NaN) + 1e-3", rms, rms_ref, kl_nan,
              NAN_STREAM_MARGIN, kl_ref);
}

namespace {

// The buffer norms (buf_l2_k / buf_l2_v of the head snapshots) against a sum of their own: the
// rows the graph computes for the cache, caught by the scheduler's callback (the last tensor
// named Kcur-<il> / Vcur-<il> in each ubatch, K after RoPE), over the positions the buffer
// holds. With no sinks, no pins and no tracker (whose offset would be taken off the rows
// held), those are the last n_used of the one sequence decoded in order; merged every 4
// ubatches, the buffer also keeps released rows (spares) in the slots, which are not held.
// The slots hold the rows in F16 after upstream's Hadamard rotation of a quantized cache,
// which keeps a head's norm: each stored value is within half an F16 ulp (2^-11 of itself) of
// the rotated one, so the norms agree within 2^-11, plus 1e-5 for float sums. A row held too
// many or too few, or another head's channels, moves a norm by about 1/16 of a row's share
// (a few percent).
constexpr double BUF_L2_BOUND = 1.0 / 2048 + 1e-5;
struct kv_capture {
    std::vector<std::vector<float>> k, v;       // per layer, the rows in position order
    std::vector<std::vector<float>> k_ub, v_ub; // this ubatch's
};

bool capture_kv(ggml_tensor * t, bool ask, void * user_data) {
    int il = -1;
    char kind = 0;
    if (std::sscanf(t->name, "%ccur-%d", &kind, &il) != 2 || (kind != 'K' && kind != 'V') || il < 0) {
        return false;
    }
    if (ask) {
        return true;
    }
    auto * cap = (kv_capture *) user_data;
    auto & dst = kind == 'K' ? cap->k_ub : cap->v_ub;
    if ((size_t) il < dst.size() && t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
        dst[il].resize((size_t) ggml_nelements(t));
        ggml_backend_tensor_get(t, dst[il].data(), 0, ggml_nbytes(t));
    }
    return true;
}

void test_buffer_norms(report & rep, llama_model * model, const std::vector<llama_token> & toks) {
    const int32_t n_layer = llama_model_n_layer(model), n_head_kv = llama_model_n_head_kv(model);
    kv_capture cap;
    for (auto * v : { &cap.k, &cap.v, &cap.k_ub, &cap.v_ub }) {
        v->resize(n_layer);
    }
    llama_context_params cp = test_ctx_params(GGML_TYPE_KVC4);
    cp.cb_eval           = capture_kv;
    cp.cb_eval_user_data = &cap;
    ctx_ptr c{ llama_init_from_model(model, cp) };
    llama_kvcomp_params p = llama_kvcomp_default_params();
    p.window         = 16;
    p.merge_interval = 4;
    p.merge_at       = 1.0f;
    llama_kvcomp_monitor_params mp = llama_kvcomp_monitor_default_params();
    mp.refresh = 1000;
    bool ok = c.ctx && llama_kvcomp_configure(c.ctx, &p) == 0 && llama_kvcomp_set_monitor(c.ctx, &mp) == 0;
    // a prompt in ubatches of 16, then single tokens: the buffer fills, merges and wraps
    const int n_pos = N_PROMPT + 12;
    for (int i = 0; ok && i < n_pos;) {
        const int n = i < N_PROMPT ? 16 : 1;
        ok = !decode(c.ctx, toks, i, i + n, n).empty();
        for (int32_t il = 0; ok && il < n_layer; ++il) {
            ok = !cap.k_ub[il].empty() && !cap.v_ub[il].empty();
            cap.k[il].insert(cap.k[il].end(), cap.k_ub[il].begin(), cap.k_ub[il].end());
            cap.v[il].insert(cap.v[il].end(), cap.v_ub[il].begin(), cap.v_ub[il].end());
            cap.k_ub[il].clear();
            cap.v_ub[il].clear();
        }
        i += n;
    }
    llama_kvcomp_stats st = {};
    ok = ok && llama_kvcomp_get_stats(c.ctx, &st) == 0 && st.n_used > 0 && st.n_pinned == 0;
    const snapshot snap = ok ? take_snapshot(c.ctx) : snapshot{};
    double worst = ok && (int) snap.heads.size() == n_layer * n_head_kv ? 0.0 : INFINITY;
    for (const auto & h : snap.heads) {
        for (int kv = 0; kv < 2 && std::isfinite(worst); ++kv) {
            const std::vector<float> & rows = kv == 0 ? cap.k[h.il] : cap.v[h.il];
            const int64_t width = (int64_t) rows.size() / n_pos, d = width / n_head_kv;
            double sum = 0.0;
            for (int pos = n_pos - st.n_used; pos < n_pos; ++pos) {
                for (int64_t j = 0; j < d; ++j) {
                    const double x = rows[(size_t) pos * width + h.head * d + j];
                    sum += x * x;
                }
            }
            const double got = kv == 0 ? h.buf_l2_k : h.buf_l2_v;
            worst = (int64_t) rows.size() == (int64_t) n_pos * width ? std::max(worst, rel(got, std::sqrt(sum))) : INFINITY;
        }
    }
    rep.check(worst <= BUF_L2_BOUND, "buffer norms of %zu heads = those of the rows the graph made for the %d positions "
              "held, summed apart: max rel diff %.2e <= %.2e", snap.heads.size(), st.n_used, worst, BUF_L2_BOUND);
}

} // namespace

int main(int argc, char ** argv) {
    llama_model * model = load_test_model(argc, argv);
    if (!model) {
        return 2;
    }
    std::string text;
    for (int i = 0; text.size() < 1000; ++i) {
        text += "The monitor counts what it cannot measure, and block " + std::to_string(i) + " of the text varies. ";
    }
    std::vector<llama_token> toks = test_tokenize(model, text, 512);
    const int n = (int) toks.size();

    report rep;
    rep.check(n >= N_PROMPT, "prompt has %d tokens", n);
    if (n >= N_PROMPT) {
        llama_kvcomp_params p;
        llama_kvcomp_mode_preset(LLAMA_KVCOMP_MODE_LOW_LATENCY, &p, nullptr, nullptr);
        test_config(rep, model, toks, "low-latency", p, false);

        llama_kvcomp_mode_preset(LLAMA_KVCOMP_MODE_BALANCED, &p, nullptr, nullptr);
        p.mode           = LLAMA_KVCOMP_MODE_CUSTOM;
        p.window         = 16;
        p.sinks          = 0;
        p.merge_interval = 1;
        p.merge_at       = 1.0f;
        p.pin_threshold  = 0.0f;
        test_config(rep, model, toks, "window 16", p, true);
        test_nan_in_first_rows(rep, model, toks);
        test_buffer_norms(rep, model, toks);
    }
    llama_model_free(model);
    llama_backend_free();
    return rep.finish("test-kvc-monitor");
}
