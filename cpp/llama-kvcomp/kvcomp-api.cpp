// The public C API of llama-kvcomp.h: modes, configuration and statistics of a context.

#include "kvcomp-buffer.h"
#include "kvcomp-monitor.h"
#include "kvcomp-monitor-source.h"
#include "kvcomp-state.h"
#include "llama-kvcomp.h"

#include "llama-impl.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct kvcomp_mode_row {
    const char * name;
    ggml_type    type_k;
    ggml_type    type_v;
    int32_t      window;
    int32_t      sinks;
    int32_t      merge_interval;
    float        pin_threshold;
    float        pin_budget;
    int32_t      tracker;
    ggml_type    type_k_stats; // K when the model's K statistics are loaded (--kv-comp-kstats)
    int32_t      k_layers;     // the per-layer K rule with them (llama_kvcomp_k_layers)
};

// The one mode table. Why each number: docs/reference.md, "Modes and the scale tracker".
constexpr kvcomp_mode_row KVCOMP_MODES[] = {
    // name              K               V               W    S   N   pin   budget tracker  K with statistics, its layers
    { "off",            GGML_TYPE_F16,  GGML_TYPE_F16,    0,  0,  1, 0.0f,  1.0f,  0,     GGML_TYPE_F16,   LLAMA_KVCOMP_K_LAYERS_SAME },
    { "low-latency",    GGML_TYPE_KVC4, GGML_TYPE_KVC4,   0,  0,  1, 0.0f,  1.0f,  1,     GGML_TYPE_KVCT4, LLAMA_KVCOMP_K_LAYERS_SAME },
    { "balanced",       GGML_TYPE_KVC4, GGML_TYPE_KVC3,  56,  4,  8, 0.0f,  1.0f,  1,     GGML_TYPE_KVCT4, LLAMA_KVCOMP_K_LAYERS_EDGES },
    { "high-precision", GGML_TYPE_KVC8, GGML_TYPE_KVC8,  32,  4,  8, 0.0f,  1.0f,  1,     GGML_TYPE_KVC8,  LLAMA_KVCOMP_K_LAYERS_SAME },
};
static_assert(sizeof(KVCOMP_MODES) / sizeof(KVCOMP_MODES[0]) == LLAMA_KVCOMP_MODE_CUSTOM, "one table row per mode");

// The most tokens a ubatch brings, which the buffer and the tracker size their inputs by: a
// split cache's ubatch takes the same number of tokens from every sequence in it
// (split_equal), one each at least, so sequences that outnumber n_ubatch make it larger.
uint32_t kvcomp_ubatch_max(const llama_context * ctx) {
    return std::max(llama_n_ubatch(ctx), llama_n_seq_max(ctx));
}

} // namespace

std::vector<llama_kv_cache *> llama_kvcomp_caches(llama_context * ctx) {
    llama_memory_t mem = ctx ? llama_get_memory(ctx) : nullptr;
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        return { kv };
    }
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        return { iswa->get_base(), iswa->get_swa() };
    }
    return {};
}


llama_kvcomp_params llama_kvcomp_default_params(void) {
    llama_kvcomp_params p;
    p.mode           = LLAMA_KVCOMP_MODE_CUSTOM;
    p.window         = 0;
    p.sinks          = 0;
    p.merge_interval = 1;
    p.merge_at       = 1.0f;
    p.pin_threshold  = 0.0f;
    p.pin_budget     = 1.0f;
    p.tracker        = 0;
    p.ema_shallow    = 0.1f;
    p.ema_deep       = 0.2f;
    p.keep_prompt    = 0;
    return p;
}

int32_t llama_kvcomp_mode_preset(int32_t mode, llama_kvcomp_params * params, ggml_type * type_k, ggml_type * type_v) {
    if (mode < 0 || mode >= LLAMA_KVCOMP_MODE_CUSTOM) {
        return -1;
    }
    const kvcomp_mode_row & row = KVCOMP_MODES[mode];
    if (params) {
        llama_kvcomp_params p = llama_kvcomp_default_params();
        p.mode           = mode;
        p.window         = row.window;
        p.sinks          = row.sinks;
        p.merge_interval = row.merge_interval;
        p.pin_threshold  = row.pin_threshold;
        p.pin_budget     = row.pin_budget;
        p.tracker        = row.tracker;
        *params = p;
    }
    if (type_k) {
        *type_k = row.type_k;
    }
    if (type_v) {
        *type_v = row.type_v;
    }
    return 0;
}

int32_t llama_kvcomp_mode_type_k_stats(int32_t mode) {
    return mode < 0 || mode >= LLAMA_KVCOMP_MODE_CUSTOM ? -1 : (int32_t) KVCOMP_MODES[mode].type_k_stats;
}

int32_t llama_kvcomp_mode_k_layers(int32_t mode) {
    return mode < 0 || mode >= LLAMA_KVCOMP_MODE_CUSTOM ? -1 : KVCOMP_MODES[mode].k_layers;
}

int32_t llama_kvcomp_type_from_name(const char * name) {
    for (int32_t t = 0; name && t < GGML_TYPE_COUNT; ++t) {
        const char * n = ggml_type_name((ggml_type) t);
        if (n && std::strcmp(n, name) == 0) {
            return t;
        }
    }
    return -1;
}

const char * llama_kvcomp_mode_name(int32_t mode) {
    if (mode == LLAMA_KVCOMP_MODE_CUSTOM) {
        return "custom";
    }
    return mode >= 0 && mode < LLAMA_KVCOMP_MODE_CUSTOM ? KVCOMP_MODES[mode].name : nullptr;
}

int32_t llama_kvcomp_mode_from_name(const char * name) {
    for (int32_t m = 0; name && m < LLAMA_KVCOMP_MODE_COUNT; ++m) {
        if (std::strcmp(name, llama_kvcomp_mode_name(m)) == 0) {
            return m;
        }
    }
    return -1;
}

const char * llama_kvcomp_params_error(const llama_kvcomp_params * p) {
    if (!p) {
        return "no parameters";
    }
    if (p->mode < 0 || p->mode >= LLAMA_KVCOMP_MODE_COUNT) {
        return "unknown mode";
    }
    if (p->window < 0) {
        return "the window must be >= 0";
    }
    if (p->sinks < 0) {
        return "the sink count must be >= 0";
    }
    if (p->merge_interval < 1) {
        return "the merge interval must be >= 1";
    }
    if (!(p->merge_at > 0.0f && p->merge_at <= 1.0f)) {
        return "merge-at must be a fraction in (0, 1]";
    }
    if (!(p->pin_threshold >= 0.0f && std::isfinite(p->pin_threshold))) {
        return "the pin threshold must be a finite value >= 0";
    }
    if (!(p->pin_budget >= 0.0f && p->pin_budget <= 100.0f)) {
        return "the pin budget must be a percentage in [0, 100]";
    }
    if (p->tracker != 0 && p->tracker != 1) {
        return "the tracker is on (1) or off (0)";
    }
    if (!(p->ema_shallow > 0.0f && p->ema_shallow <= 1.0f) || !(p->ema_deep > 0.0f && p->ema_deep <= 1.0f)) {
        return "the EMA weights must be in (0, 1]";
    }
    if (p->keep_prompt != 0 && p->keep_prompt != 1) {
        return "keep-prompt is on (1) or off (0)";
    }
    return nullptr;
}

int32_t llama_kvcomp_configure(llama_context * ctx, const llama_kvcomp_params * params) {
    llama_kvcomp_set_last_error("");
    const char * err = llama_kvcomp_params_error(params);
    if (!ctx || err) {
        return llama_kvcomp_fail(-1, std::string("invalid parameters: ") + (err ? err : "no context"));
    }
    // a window, sinks or a merge interval beyond the context could never be used up, and only
    // size the buffer past what the machine holds
    const uint32_t n_ctx = llama_n_ctx(ctx);
    const struct { const char * name; const char * flag; int32_t value; } bounded[] = {
        { "window",         "--kv-comp-window", params->window },
        { "sinks",          "--kv-comp-sinks",  params->sinks },
        { "merge interval", "--kv-comp-merge",  params->merge_interval },
    };
    for (const auto & b : bounded) {
        if ((uint32_t) b.value > n_ctx) {
            return llama_kvcomp_fail(-1, std::string(b.flag) + " " + std::to_string(b.value) + ": the " + b.name +
                                   " is larger than the context (" + std::to_string(n_ctx) + " tokens, -c)");
        }
    }
    const auto caches = llama_kvcomp_caches(ctx);
    if (caches.empty()) {
        return llama_kvcomp_fail(-2, "kvcomp needs a transformer KV cache (this model's memory is recurrent or hybrid)");
    }
    // a context whose caches have never been configured has no monitor yet: an entry left by
    // a freed context at the same address is not its
    const bool fresh = std::none_of(caches.begin(), caches.end(), [](const llama_kv_cache * kv) { return kv->kvcomp != nullptr; });
    const auto monitor = llama_kvcomp_monitor::get(ctx, true, fresh);
    for (llama_kv_cache * kv : caches) {
        const int32_t rc = llama_kvcomp_buffer::attach(*kv, *params, kvcomp_ubatch_max(ctx), llama_n_seq_max(ctx));
        if (rc != 0) {
            return rc;
        }
        if (kv->kvcomp) {
            kv->kvcomp->on_ubatch = [monitor](const llama_kv_cache & c) { monitor->on_ubatch(c); };
        }
    }
    return 0;
}

int32_t llama_kvcomp_set_k_stats(llama_context * ctx, const char * path) {
    llama_kvcomp_set_last_error("");
    if (!ctx || !path) {
        return llama_kvcomp_fail(-1, "llama_kvcomp_set_k_stats: no context or no path");
    }
    const auto caches = llama_kvcomp_caches(ctx);
    if (caches.empty()) {
        return llama_kvcomp_fail(-2, "kvcomp needs a transformer KV cache (this model's memory is recurrent or hybrid)");
    }
    std::string err;
    const auto stats = llama_kvcomp_kstats::load(path, err);
    if (!stats) {
        return llama_kvcomp_fail(-1, "K statistics: " + err);
    }
    err = stats->check_model(llama_kvcomp_signature_of(llama_get_model(ctx)));
    if (!err.empty()) {
        return llama_kvcomp_fail(-1, "K statistics: " + err);
    }
    for (llama_kv_cache * kv : caches) {
        const int32_t rc = llama_kvcomp_buffer::set_k_stats(*kv, stats, kvcomp_ubatch_max(ctx), llama_n_seq_max(ctx));
        if (rc != 0) {
            return rc;
        }
    }
    llama_kvcomp_k_stats_note() = std::string("read from ") + path;
    return 0;
}

std::string & llama_kvcomp_k_stats_note() {
    static thread_local std::string note;
    return note;
}

const char * llama_kvcomp_k_stats_source(void) {
    return llama_kvcomp_k_stats_note().c_str();
}

const char * llama_kvcomp_kvct_unfit(const llama_model * model, bool offload_kqv) {
    if (!model) {
        return "no model";
    }
    const auto & hp = model->hparams;
    if (hp.rope_type != LLAMA_ROPE_TYPE_NORM && hp.rope_type != LLAMA_ROPE_TYPE_NEOX) {
        return "the model's RoPE is none or multi-section, which the kvct plans cannot follow";
    }
    for (int il = 0; il < (int) hp.n_layer(); ++il) {
        if (hp.n_rot(il) != hp.n_embd_head_k(il)) {
            return "the model's RoPE turns part of a head's channels, and the kvct plans need all of them";
        }
        // the cache places each layer where the model placed it (llama_kv_cache, dev_layer)
        ggml_backend_dev_t dev = offload_kqv ? model->dev_layer(il) : nullptr;
        if (dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            return "the K cache is on a device without kvct kernels";
        }
    }
    return nullptr;
}

int32_t llama_kvcomp_model_signature(const llama_model * model, float * out, int32_t n_max) {
    // the token embeddings: a GET_ROWS weight, which no backend repacks (the CPU's repacked
    // MUL_MAT weights cannot be read back), so every machine reads the same values
    const ggml_tensor * w = model ? model->tok_embd : nullptr;
    if (!w || !w->buffer || !out || n_max <= 0) {
        return 0;
    }
    const ggml_type_traits * tt = ggml_get_type_traits(w->type);
    if (w->type != GGML_TYPE_F32 && !tt->to_float) {
        return -1;
    }
    // whole rows from the middle of the vocabulary (its first tokens are often special ones,
    // some never trained), or that row's leading whole blocks when one row is longer than n_max
    const int64_t n_rows = std::min<int64_t>(w->ne[1], std::max<int64_t>(1, n_max / w->ne[0]));
    const int64_t n_cols = std::min<int64_t>(w->ne[0], n_max - n_max % ggml_blck_size(w->type));
    const int64_t r0     = (w->ne[1] - n_rows) / 2;
    if (n_cols <= 0) {
        return 0;
    }
    std::vector<uint8_t> raw(n_rows * w->nb[1]);
    ggml_backend_tensor_get(w, raw.data(), r0 * w->nb[1], raw.size());
    for (int64_t r = 0; r < n_rows; ++r) {
        const uint8_t * row = raw.data() + r * w->nb[1];
        if (w->type == GGML_TYPE_F32) {
            std::memcpy(out + r * n_cols, row, n_cols * sizeof(float));
        } else {
            tt->to_float(row, out + r * n_cols, n_cols);
        }
    }
    return (int32_t) (n_rows * n_cols);
}

int32_t llama_kvcomp_get_config(llama_context * ctx, llama_kvcomp_params * params) {
    const auto caches = llama_kvcomp_caches(ctx);
    if (!ctx || !params) {
        return -1;
    }
    *params = llama_kvcomp_default_params();
    if (!caches.empty() && caches[0]->kvcomp) {
        *params = caches[0]->kvcomp->get_params();
    } else {
        params->mode = LLAMA_KVCOMP_MODE_OFF;
    }
    return 0;
}

int32_t llama_kvcomp_get_cache_types(llama_context * ctx, ggml_type * type_k, ggml_type * type_v) {
    const auto caches = llama_kvcomp_caches(ctx);
    if (caches.empty() || !type_k || !type_v) {
        return -1;
    }
    llama_kvcomp_buffer::cache_types(*caches[0], *type_k, *type_v);
    return 0;
}

int32_t llama_kvcomp_set_mode(llama_context * ctx, int32_t mode) {
    llama_kvcomp_params p;
    if (llama_kvcomp_mode_preset(mode, &p, nullptr, nullptr) != 0) {
        return llama_kvcomp_fail(-1, "unknown mode " + std::to_string(mode));
    }
    ggml_type type_k = GGML_TYPE_F16, type_v = GGML_TYPE_F16;
    if (mode == LLAMA_KVCOMP_MODE_OFF && llama_kvcomp_get_cache_types(ctx, &type_k, &type_v) == 0 &&
        (type_k != GGML_TYPE_F16 || type_v != GGML_TYPE_F16)) {
        // "off" means full precision; the cache keeps its low-bit types, so every new token
        // stays exact in the residual buffer instead (as much memory as an F16 cache)
        p.window = (int32_t) llama_n_ctx_seq(ctx);
    }
    // a switch keeps what is not part of a mode
    llama_kvcomp_params cur;
    if (llama_kvcomp_get_config(ctx, &cur) == 0) {
        p.keep_prompt = cur.keep_prompt;
    }
    // a preset's window, sinks and merge interval shrink to a smaller context
    const int32_t n_ctx = (int32_t) llama_n_ctx(ctx);
    p.window         = std::min(p.window, n_ctx);
    p.sinks          = std::min(p.sinks, n_ctx);
    p.merge_interval = std::min(p.merge_interval, n_ctx);
    const int32_t rc = llama_kvcomp_configure(ctx, &p);
    if (rc == 0) {
        LLAMA_LOG_INFO("kvcomp: mode switched to %s for new tokens (cache types stay as created)\n", llama_kvcomp_mode_name(mode));
    }
    return rc;
}

int32_t llama_kvcomp_get_stats(llama_context * ctx, llama_kvcomp_stats * stats) {
    if (!stats) {
        return -1;
    }
    bool any = false;
    llama_kvcomp_stats sum = {};
    for (llama_kv_cache * kv : llama_kvcomp_caches(ctx)) {
        if (!kv->kvcomp) {
            continue;
        }
        const llama_kvcomp_stats st = kv->kvcomp->get_stats();
        sum.pin_err_min = st.n_pinned > 0 && (sum.n_pinned == 0 || st.pin_err_min < sum.pin_err_min) ? st.pin_err_min : sum.pin_err_min;
        sum.n_slots      += st.n_slots;
        sum.n_used       += st.n_used;
        sum.n_pinned     += st.n_pinned;
        sum.n_pin_budget += st.n_pin_budget;
        sum.n_merges     += st.n_merges;
        sum.n_released   += st.n_released;
        sum.n_overflow   += st.n_overflow;
        sum.evicted_err_max = std::max(sum.evicted_err_max, st.evicted_err_max);
        any = true;
    }
    if (!any) {
        return -1;
    }
    *stats = sum;
    return 0;
}

int32_t llama_kvcomp_seq_rm_exact(llama_context * ctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    if (!ctx) {
        return -1;
    }
    for (const llama_kv_cache * kv : llama_kvcomp_caches(ctx)) {
        if (!llama_kvcomp_buffer::rm_keeps_exact(*kv, seq_id, p0, p1)) {
            return 0;
        }
    }
    return 1;
}

int32_t llama_kvcomp_get_layer_stats(llama_context * ctx, int32_t il, llama_kvcomp_layer_stats * stats) {
    if (!stats) {
        return -1;
    }
    for (llama_kv_cache * kv : llama_kvcomp_caches(ctx)) {
        if (kv->kvcomp && kv->kvcomp->get_layer_stats(il, *stats)) {
            return 0;
        }
    }
    return -1;
}

llama_kvcomp_monitor_params llama_kvcomp_monitor_default_params(void) {
    llama_kvcomp_monitor_params p;
    p.enabled         = 1;
    p.ppl_window      = 64;
    p.degrade_ratio   = 1.2f;
    p.degrade_windows = 3;
    p.baseline_ppl    = 0.0f;
    p.fill_warn       = 0.8f;
    p.l2_jump         = 2.0f;
    p.refresh         = 8;
    return p;
}

const char * llama_kvcomp_monitor_params_error(const llama_kvcomp_monitor_params * p) {
    if (!p) {
        return "no parameters";
    }
    if (p->enabled != 0 && p->enabled != 1) {
        return "the monitor is on (1) or off (0)";
    }
    if (p->ppl_window < 1) {
        return "the perplexity window must be >= 1 token";
    }
    if (!(p->degrade_ratio >= 1.0f && std::isfinite(p->degrade_ratio))) {
        return "the degrade ratio must be a finite value >= 1";
    }
    if (p->degrade_windows < 0) {
        return "the degrade window count must be >= 0 (0: never degrade)";
    }
    if (!(p->baseline_ppl >= 0.0f && std::isfinite(p->baseline_ppl))) {
        return "the baseline perplexity must be a finite value > 0 (or 0: from each sequence's first window)";
    }
    if (!(p->fill_warn > 0.0f && p->fill_warn <= 1.0f)) {
        return "the fill warning threshold must be a fraction in (0, 1]";
    }
    if (!(p->l2_jump == 0.0f || (p->l2_jump > 1.0f && std::isfinite(p->l2_jump)))) {
        return "the L2 jump factor must be > 1 (or 0: no warning)";
    }
    if (p->refresh < 1) {
        return "the refresh interval must be >= 1 ubatch";
    }
    return nullptr;
}

int32_t llama_kvcomp_set_monitor(llama_context * ctx, const llama_kvcomp_monitor_params * params) {
    const char * err = llama_kvcomp_monitor_params_error(params);
    if (!ctx || err) {
        LLAMA_LOG_ERROR("%s: invalid parameters: %s\n", __func__, err ? err : "no context");
        return -1;
    }
    llama_kvcomp_monitor::get(ctx, true)->set_params(*params);
    return 0;
}

int32_t llama_kvcomp_observe(llama_context * ctx, llama_seq_id seq_id, int32_t i, llama_token token) {
    const auto mon = llama_kvcomp_monitor::get(ctx, false);
    return mon ? mon->observe(seq_id, i, token) : -1;
}

void llama_kvcomp_seq_reset(llama_context * ctx, llama_seq_id seq_id) {
    if (const auto mon = llama_kvcomp_monitor::get(ctx, false)) {
        mon->seq_reset(seq_id);
    }
}

int32_t llama_kvcomp_monitor_refresh(llama_context * ctx) {
    const auto mon = llama_kvcomp_monitor::get(ctx, false);
    if (!mon || !mon->get_params().enabled) {
        return -1;
    }
    mon->refresh();
    return 0;
}

int32_t llama_kvcomp_get_snapshot(llama_context * ctx, llama_kvcomp_snapshot * snap, llama_kvcomp_head_snapshot * heads, int32_t n_heads_max,
                                  llama_kvcomp_seq_snapshot * seqs, int32_t n_seqs_max, llama_kvcomp_degrade_event * events,
                                  int32_t n_events_max) {
    const auto mon = llama_kvcomp_monitor::get(ctx, false);
    if (!mon || !snap) {
        return -1;
    }
    std::vector<llama_kvcomp_head_snapshot> h;
    std::vector<llama_kvcomp_seq_snapshot> s;
    std::vector<llama_kvcomp_degrade_event> e;
    mon->copy(*snap, h, s, e);
    const auto put = [](auto * dst, int32_t n_max, const auto & src) {
        if (dst) {
            std::copy_n(src.begin(), std::min<size_t>(src.size(), (size_t) std::max(0, n_max)), dst);
        }
    };
    put(heads, n_heads_max, h);
    put(seqs, n_seqs_max, s);
    put(events, n_events_max, e);
    return 0;
}

int64_t llama_kvcomp_snapshot_text(llama_context * ctx, int32_t format, int32_t layer, char * buf, size_t size) {
    const auto mon = llama_kvcomp_monitor::get(ctx, false);
    if (!mon || (format != LLAMA_KVCOMP_FORMAT_JSON && format != LLAMA_KVCOMP_FORMAT_PROMETHEUS)) {
        return -1;
    }
    const std::string text = mon->text(format, layer);
    if (buf && size > 0) {
        const size_t n = std::min(size - 1, text.size());
        std::memcpy(buf, text.data(), n);
        buf[n] = '\0';
    }
    return (int64_t) text.size();
}
