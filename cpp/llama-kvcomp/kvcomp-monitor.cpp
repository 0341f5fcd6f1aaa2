// The monitor: per layer/head metrics, perplexity windows, the degrade policy and the
// snapshot's text forms (docs/monitoring.md).

#include "kvcomp-monitor.h"

#include "kvcomp-monitor-source.h"

#include "llama-impl.h"

#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cmath>
#include <cstdio>
#include <cstring>

// degrade steps kept for the snapshot
static constexpr size_t KVCOMP_EVENTS_KEPT = 64;
// weight of a new value in the running mean of a head's buffer norm
static constexpr float  KVCOMP_L2_MEAN_ALPHA = 0.1f;
// refreshes a head's running mean sees before a jump is judged against it
static constexpr int32_t KVCOMP_L2_WARMUP = 4;

std::shared_ptr<llama_kvcomp_monitor> llama_kvcomp_monitor::get(llama_context * ctx, bool create, bool fresh) {
    static std::mutex registry_mtx;
    static std::map<const llama_context *, std::shared_ptr<llama_kvcomp_monitor>> registry;
    std::lock_guard<std::mutex> lock(registry_mtx);
    auto it = registry.find(ctx);
    if (it != registry.end() && !fresh) {
        return it->second;
    }
    if (!create) {
        return nullptr;
    }
    auto mon = std::make_shared<llama_kvcomp_monitor>(ctx);
    registry[ctx] = mon;
    return mon;
}

void llama_kvcomp_monitor::set_params(const llama_kvcomp_monitor_params & p) {
    params = p;
    std::lock_guard<std::mutex> lock(mtx);
    pub_params  = p;
    pub.enabled = p.enabled;
}

llama_kvcomp_monitor_params llama_kvcomp_monitor::get_params() const {
    return params;
}

void llama_kvcomp_monitor::on_ubatch(const llama_kv_cache & kv) {
    const auto caches = llama_kvcomp_caches(ctx);
    // one count per ubatch: the caches of a sliding-window model each see it
    if (!params.enabled || caches.empty() || caches[0] != &kv) {
        return;
    }
    if (n_ubatches++ % params.refresh == 0) {
        refresh();
    }
}

void llama_kvcomp_monitor::refresh() {
    llama_kvcomp_snapshot snap = {};
    std::vector<llama_kvcomp_head_snapshot> heads;
    std::vector<size_t> untracked; // heads whose layer no tracker follows
    const auto caches = llama_kvcomp_caches(ctx);
    for (llama_kv_cache * kv : caches) {
        llama_kvcomp_stats st = {};
        if (!llama_kvcomp_source_stats(*kv, st)) {
            continue;
        }
        snap.n_slots    += st.n_slots;
        snap.n_used     += st.n_used;
        snap.n_pinned   += st.n_pinned;
        snap.n_merges   += st.n_merges;
        snap.n_released += st.n_released;
        const size_t first = heads.size();
        llama_kvcomp_source_heads(*kv, heads);
        // The scales of every KV head come from the tracker's own per-head values: the rows
        // the buffer makes take them from llama_kvcomp_layer_stats, which holds the first
        // LLAMA_KVCOMP_MAX_HEADS heads only.
        const llama_kvcomp_tracker * tr = nullptr;
        int32_t il_cur = -1, ib = -1;
        for (size_t i = first; i < heads.size(); ++i) {
            llama_kvcomp_head_snapshot & hs = heads[i];
            if (hs.il != il_cur) {
                il_cur = hs.il;
                tr = llama_kvcomp_source_tracker(*kv, hs.il, ib);
            }
            if (tr) {
                llama_kvcomp_source_head_scales(*tr, ib, hs.head, hs.k_scale, hs.v_scale);
            } else {
                untracked.push_back(i);
            }
        }
    }
    // Nothing non-finite is published: such a value (a buffer norm while a held row is not
    // finite) is NaN in the snapshot, left out of the text forms and of the running means,
    // and counted.
    for (auto & h : heads) {
        for (float * v : { &h.k_rmse, &h.k_rmse_rel, &h.k_scale, &h.v_scale, &h.buf_l2_k, &h.buf_l2_v }) {
            if (!std::isfinite(*v)) {
                *v = NAN;
                ++n_nonfinite_own;
            }
        }
    }
    // A layer the tracker does not follow (no tracker, or a kvct K cache, whose plans take its
    // place) has no round-trip error or scales measured: NaN, so that it reads as absent
    // rather than as a perfect cache. Not counted as non-finite: nothing was left out.
    for (size_t i : untracked) {
        for (float * v : { &heads[i].k_rmse, &heads[i].k_rmse_rel, &heads[i].k_scale, &heads[i].v_scale }) {
            *v = NAN;
        }
    }
    std::sort(heads.begin(), heads.end(), [](const llama_kvcomp_head_snapshot & a, const llama_kvcomp_head_snapshot & b) {
        return a.il != b.il ? a.il < b.il : a.head < b.head;
    });
    count_tracker_nonfinite(caches);
    llama_kvcomp_params kp;
    llama_kvcomp_get_config(ctx, &kp);
    snap.mode       = kp.mode;
    snap.fill       = snap.n_slots > 0 ? (float) snap.n_used / (float) snap.n_slots : 0.0f;
    snap.n_heads    = (int32_t) heads.size();
    snap.n_ubatches = n_ubatches;
    snap.t_us       = ggml_time_us();
    snap.enabled    = params.enabled;
    warn(snap, heads);
    snap.n_nonfinite = n_nonfinite_own + n_nonfinite_trackers;

    std::lock_guard<std::mutex> lock(mtx);
    snap.n_warn_fill = pub.n_warn_fill + snap.n_warn_fill;
    snap.n_warn_l2   = pub.n_warn_l2 + snap.n_warn_l2;
    snap.n_seqs      = (int32_t) pub_seqs.size();
    snap.n_events    = pub.n_events;
    pub       = snap;
    pub_heads = std::move(heads);
}

void llama_kvcomp_monitor::count_tracker_nonfinite(const std::vector<llama_kv_cache *> & caches) {
    for (llama_kv_cache * kv : caches) {
        const llama_kvcomp_tracker * tr = llama_kvcomp_source_tracker(*kv);
        if (!tr) {
            continue;
        }
        // a tracker's count only grows; one seen for the first time (or made at the address
        // of a freed one) adds all of its count
        int64_t & seen = tracker_nonfinite_seen[tr];
        const int64_t n = llama_kvcomp_source_n_nonfinite(*tr);
        n_nonfinite_trackers += n >= seen ? n - seen : n;
        seen = n;
    }
}

void llama_kvcomp_monitor::publish_nonfinite() {
    std::lock_guard<std::mutex> lock(mtx);
    pub.n_nonfinite = n_nonfinite_own + n_nonfinite_trackers;
}

// Counts (in snap) and logs this refresh's warnings.
void llama_kvcomp_monitor::warn(llama_kvcomp_snapshot & snap, const std::vector<llama_kvcomp_head_snapshot> & heads) {
    // once per crossing, so a buffer that stays full does not flood the log
    const bool full = snap.n_slots > 0 && snap.fill > params.fill_warn;
    if (full && !fill_warned) {
        LLAMA_LOG_WARN("kvcomp: monitor: residual buffer %.0f%% full (%d of %d slots, threshold %.0f%%)\n",
                100.0f * snap.fill, snap.n_used, snap.n_slots, 100.0f * params.fill_warn);
        ++snap.n_warn_fill;
    }
    fill_warned = full;

    // A jump is a change of the rows' magnitude, not of their number: the norm per held row
    // is compared with its running mean, once that mean has seen a few refreshes.
    if (l2_mean.size() != heads.size()) {
        l2_mean.assign(heads.size(), 0.0f);
        n_l2_seen = 0;
    }
    if (snap.n_used == 0) {
        return;
    }
    const float per_row = 1.0f / std::sqrt((float) snap.n_used);
    int32_t n_jumped = 0;
    size_t worst = 0;
    float worst_ratio = 0.0f;
    for (size_t i = 0; i < heads.size(); ++i) {
        const float x = heads[i].buf_l2_k * per_row;
        if (!std::isfinite(x)) {
            continue; // not measured this refresh (counted): the mean stays as it was
        }
        const float ratio = l2_mean[i] > 0.0f ? x / l2_mean[i] : 0.0f;
        if (params.l2_jump > 0.0f && n_l2_seen >= KVCOMP_L2_WARMUP && ratio > params.l2_jump) {
            ++n_jumped;
            if (ratio > worst_ratio) {
                worst_ratio = ratio;
                worst = i;
            }
        }
        l2_mean[i] = l2_mean[i] > 0.0f ? l2_mean[i] + KVCOMP_L2_MEAN_ALPHA * (x - l2_mean[i]) : x;
    }
    ++n_l2_seen;
    // once per jump (its first refresh, however many heads), counted at every refresh
    if (n_jumped > 0 && !l2_warned) {
        LLAMA_LOG_WARN("kvcomp: monitor: buffer K norm per row jumped past %.1f x its mean in %d layer/heads "
                "(largest: layer %d head %d, %.1f x)\n", params.l2_jump, n_jumped, heads[worst].il, heads[worst].head,
                worst_ratio);
    }
    snap.n_warn_l2 += n_jumped;
    l2_warned = n_jumped > 0;
}

// log of the sum over t of exp(x[t] - mx), mx the largest x: exp is evaluated in float
// without calls or branches so that the compiler vectorizes the loop over the vocabulary at
// the baseline ISA (std::exp in double took ~1 ms a token over Gemma-3's 262k logits, 8% of a
// decode step). Each lane adds at most BLOCK / LANES terms in float before a double takes them.
// NaN anywhere gives NaN; -inf logits add nothing.
static double monitor_log_sum_exp(const float * x, int32_t n, float mx) {
    constexpr int32_t  LANES   = 16;
    constexpr int32_t  BLOCK   = 4096;
    constexpr uint32_t MINUS87 = 0xC2AE0000u; // -87.0f: exp is normal down to it
    double z      = 0.0;
    float  nan_in = 0.0f;
    for (int32_t b = 0; b < n; b += BLOCK) {
        const int32_t e = std::min(n, b + BLOCK);
        float acc[LANES] = {};
        float sum[LANES] = {};
        int32_t t = b;
        for (; t + LANES <= e; t += LANES) {
            for (int32_t j = 0; j < LANES; ++j) {
                float d = x[t + j] - mx;
                sum[j] += d;
                // clamped to -87 on its bits: a float comparison keeps GCC from vectorizing
                uint32_t db;
                std::memcpy(&db, &d, sizeof(d));
                db = db > MINUS87 ? MINUS87 : db;
                std::memcpy(&d, &db, sizeof(d));
                // d = k ln 2 + r, |r| <= ln 2 / 2; k rounded by the 1.5 * 2^23 shift
                const float kf = d * 1.44269504f + 12582912.0f;
                const float k  = kf - 12582912.0f;
                const float r  = d - k * 0.693359375f + k * 2.12194440e-4f;
                float p = 1.0f / 720;
                p = p * r + 1.0f / 120;
                p = p * r + 1.0f / 24;
                p = p * r + 1.0f / 6;
                p = p * r + 0.5f;
                p = p * r + 1.0f;
                p = p * r + 1.0f;
                uint32_t kb;
                std::memcpy(&kb, &kf, sizeof(kf));
                const uint32_t sb = (kb - 0x4B400000u + 127u) << 23;
                float s;
                std::memcpy(&s, &sb, sizeof(s));
                acc[j] += p * s;
            }
        }
        double zb = 0.0;
        for (; t < e; ++t) {
            zb += std::exp((double) (x[t] - mx));
            nan_in += x[t] - mx;
        }
        for (int32_t j = 0; j < LANES; ++j) {
            zb += acc[j];
            nan_in += sum[j];
        }
        z += zb;
    }
    return std::isnan(nan_in) ? (double) NAN : std::log(z);
}

int32_t llama_kvcomp_monitor::observe(llama_seq_id seq_id, int32_t i, llama_token token) {
    if (!params.enabled) {
        return -1;
    }
    const float * logits = llama_get_logits_ith(ctx, i);
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    if (!logits || token < 0 || token >= n_vocab) {
        return -1;
    }
    // log p(token) under the model's own distribution, whatever the sampler did with it
    const float mx = *std::max_element(logits, logits + n_vocab);
    seq_state & st = seqs[seq_id];
    const double logp = (double) (logits[token] - mx) - monitor_log_sum_exp(logits, n_vocab, mx);
    ++st.n_tokens;
    if (!std::isfinite(logp)) {
        // non-finite logits: the token stays out of the window, which closes on finite ones
        ++n_nonfinite_own;
        publish_nonfinite();
        return 0;
    }
    st.logp_sum += logp;
    if (++st.n_in_window < params.ppl_window) {
        return 0;
    }

    const float ppl = (float) std::exp(-st.logp_sum / st.n_in_window);
    st.logp_sum = 0.0;
    st.n_in_window = 0;
    ++st.n_windows;
    // a window too improbable for a float is counted, keeps the last perplexity published,
    // and is above any baseline
    const bool finite = std::isfinite(ppl);
    if (finite) {
        st.ppl_last = ppl;
    } else {
        ++n_nonfinite_own;
        publish_nonfinite();
    }
    if (params.baseline_ppl > 0.0f) {
        st.ppl_baseline = params.baseline_ppl;
    } else if (st.ppl_baseline == 0.0f) {
        // no calibration profile: the sequence's first (finite) window is its baseline
        st.ppl_baseline = finite ? ppl : 0.0f;
        publish_seqs();
        return 0;
    }
    st.n_above = finite && ppl <= params.degrade_ratio * st.ppl_baseline ? 0 : st.n_above + 1;
    if (params.degrade_windows > 0 && st.n_above >= params.degrade_windows) {
        degrade(seq_id, st, ppl);
        for (auto & [id, other] : seqs) {
            other.n_above = 0;
        }
    }
    publish_seqs();
    return 0;
}

void llama_kvcomp_monitor::degrade(llama_seq_id seq_id, const seq_state & st, float ppl) {
    llama_kvcomp_params kp;
    llama_kvcomp_get_config(ctx, &kp);
    int32_t next = -1;
    switch (kp.mode) {
        case LLAMA_KVCOMP_MODE_HIGH_PRECISION: next = LLAMA_KVCOMP_MODE_BALANCED;    break;
        case LLAMA_KVCOMP_MODE_CUSTOM:         next = LLAMA_KVCOMP_MODE_BALANCED;    break;
        case LLAMA_KVCOMP_MODE_BALANCED:       next = LLAMA_KVCOMP_MODE_LOW_LATENCY; break;
        case LLAMA_KVCOMP_MODE_LOW_LATENCY:    next = LLAMA_KVCOMP_MODE_OFF;         break;
        default: return; // off is the bottom of the ladder
    }
    LLAMA_LOG_WARN("kvcomp: degrade: seq %d: window perplexity %.3f above %.2f x baseline %.3f for %d windows in a row: "
            "mode %s -> %s\n", seq_id, ppl, params.degrade_ratio, st.ppl_baseline, st.n_above,
            llama_kvcomp_mode_name(kp.mode), llama_kvcomp_mode_name(next));
    if (llama_kvcomp_set_mode(ctx, next) != 0) {
        LLAMA_LOG_ERROR("kvcomp: degrade: switching to %s failed, staying in %s\n", llama_kvcomp_mode_name(next),
                llama_kvcomp_mode_name(kp.mode));
        return;
    }
    llama_kvcomp_degrade_event ev = {};
    ev.t_us         = ggml_time_us();
    ev.seq_id       = seq_id;
    ev.mode_from    = kp.mode;
    ev.mode_to      = next;
    ev.ppl          = ppl;
    ev.ppl_baseline = st.ppl_baseline;
    ev.ratio        = params.degrade_ratio;
    ev.n_windows    = st.n_above;
    std::lock_guard<std::mutex> lock(mtx);
    pub_events.push_back(ev);
    if (pub_events.size() > KVCOMP_EVENTS_KEPT) {
        pub_events.erase(pub_events.begin());
    }
    ++pub.n_events;
    pub.mode = next;
}

void llama_kvcomp_monitor::seq_reset(llama_seq_id seq_id) {
    seqs.erase(seq_id);
    publish_seqs();
}

void llama_kvcomp_monitor::publish_seqs() {
    std::vector<llama_kvcomp_seq_snapshot> out;
    for (const auto & [id, st] : seqs) {
        llama_kvcomp_seq_snapshot s = {};
        s.seq_id       = id;
        s.n_tokens     = st.n_tokens;
        s.n_windows    = st.n_windows;
        s.n_above      = st.n_above;
        s.ppl_last     = st.ppl_last;
        s.ppl_baseline = st.ppl_baseline;
        out.push_back(s);
    }
    std::lock_guard<std::mutex> lock(mtx);
    pub_seqs = std::move(out);
    pub.n_seqs = (int32_t) pub_seqs.size();
}

void llama_kvcomp_monitor::copy(llama_kvcomp_snapshot & snap, std::vector<llama_kvcomp_head_snapshot> & heads,
                                std::vector<llama_kvcomp_seq_snapshot> & seqs_out, std::vector<llama_kvcomp_degrade_event> & events) const {
    std::lock_guard<std::mutex> lock(mtx);
    snap     = pub;
    heads    = pub_heads;
    seqs_out = pub_seqs;
    events   = pub_events;
}

namespace {

// printf into a std::string
struct text_out {
    std::string s;

    void add(const char * fmt, ...) {
        char tmp[512];
        va_list ap;
        va_start(ap, fmt);
        const int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
        va_end(ap);
        s.append(tmp, (size_t) std::min<int>(n, (int) sizeof(tmp) - 1));
    }

    // JSON has no NaN/Inf: null
    void num(const char * key, double v, bool comma = true) {
        if (std::isfinite(v)) {
            add("\"%s\":%.9g%s", key, v, comma ? "," : "");
        } else {
            add("\"%s\":null%s", key, comma ? "," : "");
        }
    }

    // Prometheus: HELP and TYPE once per family
    void family(const char * name, const char * type, const char * help) {
        add("# HELP llamacpp:kvcomp_%s %s\n# TYPE llamacpp:kvcomp_%s %s\n", name, help, name, type);
    }

    // a value that is not finite is left out (the snapshot counts it in n_nonfinite)
    void sample(const char * name, const char * labels, double v) {
        if (std::isfinite(v)) {
            add("llamacpp:kvcomp_%s%s %.9g\n", name, labels, v);
        }
    }
};

const char * mode_str(int32_t mode) {
    const char * name = llama_kvcomp_mode_name(mode);
    return name ? name : "unknown";
}

} // namespace

std::string llama_kvcomp_monitor::text(int32_t format, int32_t layer) const {
    llama_kvcomp_snapshot snap;
    std::vector<llama_kvcomp_head_snapshot> heads;
    std::vector<llama_kvcomp_seq_snapshot> sq;
    std::vector<llama_kvcomp_degrade_event> events;
    llama_kvcomp_monitor_params mp;
    {
        std::lock_guard<std::mutex> lock(mtx);
        mp = pub_params;
    }
    copy(snap, heads, sq, events);
    if (layer >= 0) {
        heads.erase(std::remove_if(heads.begin(), heads.end(), [layer](const llama_kvcomp_head_snapshot & h) { return h.il != layer; }),
                    heads.end());
    }
    text_out o;

    if (format == LLAMA_KVCOMP_FORMAT_PROMETHEUS) {
        char lb[96];
        o.family("mode", "gauge", "Mode in force: 0 off, 1 low-latency, 2 balanced, 3 high-precision, 4 custom.");
        snprintf(lb, sizeof(lb), "{mode=\"%s\"}", mode_str(snap.mode));
        o.sample("mode", lb, snap.mode);
        o.family("monitor_start_time_seconds", "gauge", "When this monitor's counters started at 0 (seconds of ggml's clock).");
        o.sample("monitor_start_time_seconds", "", 1e-6 * (double) t_start_us);

        struct head_series { const char * name; const char * help; float llama_kvcomp_head_snapshot::*field; };
        const head_series hs[] = {
            { "k_rmse",          "K round-trip RMSE as stored, over the rows the tracker sampled.", &llama_kvcomp_head_snapshot::k_rmse },
            { "k_rmse_relative", "K round-trip RMSE over the sampled rows' RMS.",                   &llama_kvcomp_head_snapshot::k_rmse_rel },
            { "k_scale",         "Largest smoothed half-range of the head's K channels.",         &llama_kvcomp_head_snapshot::k_scale },
            { "v_scale",         "Smoothed half-range of the head's V rows.",                     &llama_kvcomp_head_snapshot::v_scale },
        };
        for (const auto & f : hs) {
            o.family(f.name, "gauge", f.help);
            for (const auto & h : heads) {
                snprintf(lb, sizeof(lb), "{layer=\"%d\",head=\"%d\"}", h.il, h.head);
                o.sample(f.name, lb, h.*f.field);
            }
        }
        o.family("buffer_l2", "gauge", "L2 norm of the head's rows held in the residual buffer.");
        for (const auto & h : heads) {
            snprintf(lb, sizeof(lb), "{layer=\"%d\",head=\"%d\",tensor=\"k\"}", h.il, h.head);
            o.sample("buffer_l2", lb, h.buf_l2_k);
            snprintf(lb, sizeof(lb), "{layer=\"%d\",head=\"%d\",tensor=\"v\"}", h.il, h.head);
            o.sample("buffer_l2", lb, h.buf_l2_v);
        }

        o.family("buffer_slots", "gauge", "Residual buffer slots, all caches.");
        o.sample("buffer_slots", "", snap.n_slots);
        o.family("buffer_slots_used", "gauge", "Residual buffer slots holding an exact row.");
        o.sample("buffer_slots_used", "", snap.n_used);
        o.family("buffer_fill_ratio", "gauge", "Fraction of the residual buffer's slots in use.");
        o.sample("buffer_fill_ratio", "", snap.fill);
        o.family("pinned_tokens", "gauge", "Tokens kept exact as outliers.");
        o.sample("pinned_tokens", "", snap.n_pinned);
        o.family("merges_total", "counter", "Merge passes of the residual buffer.");
        o.sample("merges_total", "", (double) snap.n_merges);
        o.family("released_total", "counter", "Slots released by merges.");
        o.sample("released_total", "", (double) snap.n_released);
        o.family("ubatches_total", "counter", "Ubatches seen by the monitor.");
        o.sample("ubatches_total", "", (double) snap.n_ubatches);
        o.family("warnings_total", "counter", "Monitor warnings: buffer fill above the threshold, buffer norm jumps.");
        o.sample("warnings_total", "{kind=\"fill\"}", (double) snap.n_warn_fill);
        o.sample("warnings_total", "{kind=\"l2\"}", (double) snap.n_warn_l2);
        o.family("degrade_steps_total", "counter", "Steps down the mode ladder taken by the degrade policy.");
        o.sample("degrade_steps_total", "", snap.n_events);
        o.family("nonfinite_total", "counter", "Non-finite values kept out of the statistics: sampled K/V rows per layer, "
                "buffer norms per refresh, generated tokens' log-probabilities, window perplexities.");
        o.sample("nonfinite_total", "", (double) snap.n_nonfinite);

        struct seq_series { const char * name; const char * type; const char * help; double (*value)(const llama_kvcomp_seq_snapshot &); };
        const seq_series ss[] = {
            { "window_perplexity", "gauge", "Perplexity of the last complete window of generated tokens, per slot (sequence).",
              [](const llama_kvcomp_seq_snapshot & q) { return (double) q.ppl_last; } },
            { "baseline_perplexity", "gauge", "Baseline perplexity the windows are compared with, per slot (0: not set yet).",
              [](const llama_kvcomp_seq_snapshot & q) { return (double) q.ppl_baseline; } },
            { "windows_above", "gauge", "Consecutive windows above the degrade threshold, per slot.",
              [](const llama_kvcomp_seq_snapshot & q) { return (double) q.n_above; } },
            { "generated_tokens_total", "counter", "Generated tokens observed, per slot, since its request started.",
              [](const llama_kvcomp_seq_snapshot & q) { return (double) q.n_tokens; } },
        };
        for (const auto & f : ss) {
            o.family(f.name, f.type, f.help);
            for (const auto & q : sq) {
                snprintf(lb, sizeof(lb), "{slot=\"%d\"}", q.seq_id);
                o.sample(f.name, lb, f.value(q));
            }
        }
        return o.s;
    }

    o.add("{\"mode\":\"%s\",\"mode_id\":%d,\"t_us\":%" PRId64 ",\"ubatches\":%" PRId64 ",", mode_str(snap.mode), snap.mode, snap.t_us,
            snap.n_ubatches);
    o.add("\"buffer\":{\"slots\":%d,\"used\":%d,\"pinned\":%d,", snap.n_slots, snap.n_used, snap.n_pinned);
    o.num("fill", snap.fill);
    o.add("\"merges\":%" PRId64 ",\"released\":%" PRId64 "},", snap.n_merges, snap.n_released);
    o.add("\"warnings\":{\"fill\":%" PRId64 ",\"l2\":%" PRId64 "},", snap.n_warn_fill, snap.n_warn_l2);
    o.add("\"nonfinite\":%" PRId64 ",", snap.n_nonfinite);
    o.add("\"monitor\":{\"ppl_window\":%d,", mp.ppl_window);
    o.num("degrade_ratio", mp.degrade_ratio);
    o.add("\"degrade_windows\":%d,", mp.degrade_windows);
    o.num("baseline_ppl", mp.baseline_ppl);
    o.num("fill_warn", mp.fill_warn);
    o.num("l2_jump", mp.l2_jump);
    o.add("\"refresh\":%d},", mp.refresh);

    o.add("\"layers\":[");
    int32_t cur = -1;
    for (const auto & h : heads) {
        if (h.il != cur) {
            o.add("%s{\"layer\":%d,\"heads\":[", cur < 0 ? "" : "]},", h.il);
        } else {
            o.add(",");
        }
        cur = h.il;
        o.add("{\"head\":%d,", h.head);
        o.num("k_rmse", h.k_rmse);
        o.num("k_rmse_rel", h.k_rmse_rel);
        o.num("k_scale", h.k_scale);
        o.num("v_scale", h.v_scale);
        o.num("buffer_l2_k", h.buf_l2_k);
        o.num("buffer_l2_v", h.buf_l2_v, false);
        o.add("}");
    }
    o.add("%s],", cur < 0 ? "" : "]}");

    o.add("\"sequences\":[");
    for (size_t i = 0; i < sq.size(); ++i) {
        const auto & s = sq[i];
        o.add("%s{\"seq_id\":%d,\"tokens\":%" PRId64 ",\"windows\":%d,\"windows_above\":%d,", i ? "," : "", s.seq_id, s.n_tokens,
                s.n_windows, s.n_above);
        o.num("ppl_last", s.ppl_last);
        o.num("ppl_baseline", s.ppl_baseline, false);
        o.add("}");
    }
    o.add("],\"degrade_steps\":%d,\"degrade_log\":[", snap.n_events);
    for (size_t i = 0; i < events.size(); ++i) {
        const auto & e = events[i];
        o.add("%s{\"t_us\":%" PRId64 ",\"seq_id\":%d,\"from\":\"%s\",\"to\":\"%s\",", i ? "," : "", e.t_us, e.seq_id,
                mode_str(e.mode_from), mode_str(e.mode_to));
        o.num("ppl", e.ppl);
        o.num("ppl_baseline", e.ppl_baseline);
        o.num("ratio", e.ratio);
        o.add("\"windows\":%d}", e.n_windows);
    }
    o.add("]}");
    return o.s;
}
