#pragma once

// The monitor of one context (docs/monitoring.md): it gathers per layer/head metrics from the
// caches' buffers and trackers (read through kvcomp-monitor-source.h) every `refresh` ubatches,
// keeps the perplexity windows of the sequences it is told about, steps the mode down the
// ladder when they stay above baseline, and publishes a snapshot that any thread may read (the
// HTTP threads of llama-server).

#include "llama-kvcomp.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

class llama_kv_cache;
struct llama_context;

struct llama_kvcomp_monitor {
    explicit llama_kvcomp_monitor(llama_context * ctx) : ctx(ctx) {}

    // the context's monitor, made on first use; (re)made when `fresh` (a context whose caches
    // carry no kvcomp state yet, so an old entry at the same address is stale)
    static std::shared_ptr<llama_kvcomp_monitor> get(llama_context * ctx, bool create, bool fresh = false);

    void set_params(const llama_kvcomp_monitor_params & p);
    llama_kvcomp_monitor_params get_params() const;

    // decoding thread: after each ubatch one of the context's caches placed
    void on_ubatch(const llama_kv_cache & kv);
    void refresh();
    int32_t observe(llama_seq_id seq_id, int32_t i, llama_token token);
    void seq_reset(llama_seq_id seq_id);

    // any thread
    void copy(llama_kvcomp_snapshot & snap, std::vector<llama_kvcomp_head_snapshot> & heads,
              std::vector<llama_kvcomp_seq_snapshot> & seqs, std::vector<llama_kvcomp_degrade_event> & events) const;
    std::string text(int32_t format, int32_t layer) const;

private:
    struct seq_state {
        int64_t n_tokens = 0;
        double  logp_sum = 0.0; // over the window being filled
        int32_t n_in_window = 0;
        int32_t n_windows = 0;
        int32_t n_above = 0;
        float   ppl_last = 0.0f;
        float   ppl_baseline = 0.0f;
    };

    void warn(llama_kvcomp_snapshot & snap, const std::vector<llama_kvcomp_head_snapshot> & heads);
    // ppl: the window's perplexity (inf when it overflows a float)
    void degrade(llama_seq_id seq_id, const seq_state & st, float ppl);
    void publish_seqs();
    void publish_nonfinite();
    // the trackers' counts of rows left out, folded into n_nonfinite_trackers
    void count_tracker_nonfinite(const std::vector<llama_kv_cache *> & caches);

    llama_context * ctx;
    llama_kvcomp_monitor_params params = llama_kvcomp_monitor_default_params();
    // when its counters started at 0 (exported, so that a reader sees a new monitor)
    const int64_t t_start_us = ggml_time_us();

    // decoding thread only
    int64_t n_ubatches = 0;
    bool    fill_warned = false;
    bool    l2_warned   = false; // a jump is logged at its first refresh only
    std::vector<float> l2_mean; // running mean of each head's K buffer norm per held row
    int32_t n_l2_seen = 0;
    std::map<llama_seq_id, seq_state> seqs;
    std::vector<float> logits_tmp;
    // non-finite values kept out of the statistics (docs/monitoring.md, "Non-finite values"):
    // by the monitor (buffer norms, log-probabilities, window perplexities), and by the
    // trackers (each one's count when last read)
    int64_t n_nonfinite_own = 0;
    int64_t n_nonfinite_trackers = 0;
    std::map<const void *, int64_t> tracker_nonfinite_seen;

    // what readers see, under mtx
    mutable std::mutex mtx;
    llama_kvcomp_monitor_params pub_params = llama_kvcomp_monitor_default_params();
    llama_kvcomp_snapshot pub = {};
    std::vector<llama_kvcomp_head_snapshot> pub_heads;
    std::vector<llama_kvcomp_seq_snapshot> pub_seqs;
    std::vector<llama_kvcomp_degrade_event> pub_events;
};
