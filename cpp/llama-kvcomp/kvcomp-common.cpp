#include "kvcomp-common.h"
#include "ggml-kvcomp.h"

#include "arg.h"
#include "common.h"
#include "log.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>

// The knobs, in the order they are logged; `set` marks those given on the command line (or in
// the environment), which --kv-comp MODE leaves alone whatever their order.
enum kvcomp_knob {
    KVCOMP_KNOB_WINDOW,
    KVCOMP_KNOB_SINKS,
    KVCOMP_KNOB_MERGE,
    KVCOMP_KNOB_MERGE_AT,
    KVCOMP_KNOB_PIN_THRESHOLD,
    KVCOMP_KNOB_PIN_BUDGET,
    KVCOMP_KNOB_TRACKER,
    KVCOMP_KNOB_EMA,
    KVCOMP_KNOB_COUNT,
};

static uint32_t & kvcomp_knobs_set() {
    static uint32_t set = 0;
    return set;
}

// Sets one knob and checks the whole set, so a bad value names its flag.
template <typename T>
static void kvcomp_set(common_params & params, const char * flag, kvcomp_knob knob, T llama_kvcomp_params::*field, T value) {
    llama_kvcomp_params p = params.kvcomp;
    p.*field = value;
    if (const char * err = llama_kvcomp_params_error(&p)) {
        throw std::invalid_argument(std::string(flag) + ": " + err);
    }
    params.kvcomp = p;
    kvcomp_knobs_set() |= 1u << knob;
}

// --kv-comp-kstats FILE (empty: auto or none)
static std::string & kvcomp_kstats_path() {
    static std::string path;
    return path;
}

// --kv-comp-kstats none: kvct K is off; without it (or with auto) the library measures the
// statistics itself when K is a kvct type (llama_kvcomp_set_k_stats_auto)
static bool & kvcomp_kstats_none() {
    static bool none = false;
    return none;
}

// --kv-comp-k-layers RULE (-1: the mode's rule with K statistics, else same)
static int32_t & kvcomp_k_layers_flag() {
    static int32_t rule = -1;
    return rule;
}

// The per-layer K rule of the contexts these params make: the flag's, else a mode's when its K
// statistics are given and K is its type for them. It is process-wide (llama_kvcomp_set_k_layers),
// so it is set before the context is made.
static void kvcomp_apply_k_layers(const common_params & params, ggml_type type_k) {
    int32_t rule = kvcomp_k_layers_flag();
    if (rule < 0) {
        const int32_t mode = params.kvcomp.mode;
        const bool preset = mode != LLAMA_KVCOMP_MODE_OFF && mode != LLAMA_KVCOMP_MODE_CUSTOM;
        rule = preset && !kvcomp_kstats_none() && type_k == (ggml_type) llama_kvcomp_mode_type_k_stats(mode) ?
            llama_kvcomp_mode_k_layers(mode) : LLAMA_KVCOMP_K_LAYERS_SAME;
    }
    llama_kvcomp_set_k_layers(rule);
}

// whether the K type in the params is a mode's (not given with -ctk), so K statistics given
// after the mode may still upgrade it
static bool & kvcomp_k_from_mode() {
    static bool from_mode = false;
    return from_mode;
}

void common_kvcomp_type_k_given() {
    kvcomp_k_from_mode() = false;
}

// --kv-comp MODE: the mode's knobs and cache types, except what was given explicitly. A
// cache type counts as given when it is not upstream's default (f16). K is the mode's type for
// its K statistics (llama_kvcomp_mode_type_k_stats) unless they are turned off.
static void kvcomp_set_mode(common_params & params, const std::string & name) {
    const int32_t mode = llama_kvcomp_mode_from_name(name.c_str());
    llama_kvcomp_params preset;
    ggml_type type_k, type_v;
    if (mode < 0 || mode == LLAMA_KVCOMP_MODE_CUSTOM || llama_kvcomp_mode_preset(mode, &preset, &type_k, &type_v) != 0) {
        throw std::invalid_argument("--kv-comp: unknown mode '" + name + "' (off, low-latency, balanced, high-precision)");
    }
    llama_kvcomp_params & p = params.kvcomp;
    const uint32_t set = kvcomp_knobs_set();
    const auto keep = [&](kvcomp_knob k) { return (set >> k) & 1u; };
    p.mode = mode;
    if (!keep(KVCOMP_KNOB_WINDOW))        p.window         = preset.window;
    if (!keep(KVCOMP_KNOB_SINKS))         p.sinks          = preset.sinks;
    if (!keep(KVCOMP_KNOB_MERGE))         p.merge_interval = preset.merge_interval;
    if (!keep(KVCOMP_KNOB_MERGE_AT))      p.merge_at       = preset.merge_at;
    if (!keep(KVCOMP_KNOB_PIN_THRESHOLD)) p.pin_threshold  = preset.pin_threshold;
    if (!keep(KVCOMP_KNOB_PIN_BUDGET))    p.pin_budget     = preset.pin_budget;
    if (!keep(KVCOMP_KNOB_TRACKER))       p.tracker        = preset.tracker;
    if (!keep(KVCOMP_KNOB_EMA)) {
        p.ema_shallow = preset.ema_shallow;
        p.ema_deep    = preset.ema_deep;
    }
    if (params.cache_type_k == GGML_TYPE_F16) {
        params.cache_type_k = kvcomp_kstats_none() ? type_k : (ggml_type) llama_kvcomp_mode_type_k_stats(mode);
        kvcomp_k_from_mode() = true;
    }
    if (params.cache_type_v == GGML_TYPE_F16) {
        params.cache_type_v = type_v;
    }
    // quantized V and the buffer need flash attention; an explicit -fa off is refused later
    if (mode != LLAMA_KVCOMP_MODE_OFF && params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_AUTO) {
        params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    }
}

// The monitor's flags (not part of a mode), applied with the knobs.

static llama_kvcomp_monitor_params & kvcomp_monitor_params() {
    static llama_kvcomp_monitor_params params = llama_kvcomp_monitor_default_params();
    return params;
}

template <typename T>
static void kvcomp_set_monitor(const char * flag, T llama_kvcomp_monitor_params::*field, T value) {
    llama_kvcomp_monitor_params p = kvcomp_monitor_params();
    p.*field = value;
    if (const char * err = llama_kvcomp_monitor_params_error(&p)) {
        throw std::invalid_argument(std::string(flag) + ": " + err);
    }
    kvcomp_monitor_params() = p;
}

// --kv-comp-baseline: a perplexity, or a calibration profile (JSON with "ppl", written by
// `kvcomp profile`)
static float kvcomp_parse_baseline(const std::string & value) {
    size_t end = 0;
    try {
        const float v = std::stof(value, &end);
        if (end == value.size()) {
            return v;
        }
    } catch (const std::exception &) {
    }
    std::ifstream f(value);
    if (!f) {
        throw std::invalid_argument("--kv-comp-baseline: neither a number nor a readable file: '" + value + "'");
    }
    try {
        const nlohmann::json j = nlohmann::json::parse(f);
        return j.at("ppl").get<float>();
    } catch (const std::exception & e) {
        throw std::invalid_argument("--kv-comp-baseline: " + value + " is not a calibration profile (JSON with \"ppl\"): " + e.what());
    }
}

static bool kvcomp_parse_switch(const char * flag, const std::string & value) {
    if (value == "on" || value == "1") {
        return true;
    }
    if (value == "off" || value == "0") {
        return false;
    }
    throw std::invalid_argument(std::string(flag) + ": expected on or off, got '" + value + "'");
}

// A whole decimal number in int32's range: upstream's int flags read leading digits only
// ("32abc" is 32, "1e3" is 1).
static int32_t kvcomp_parse_int(const char * flag, const std::string & value) {
    size_t end = 0;
    long long v = 0;
    try {
        v = std::stoll(value, &end, 10);
    } catch (const std::out_of_range &) {
        throw std::invalid_argument(std::string(flag) + ": out of range: '" + value + "'");
    } catch (const std::exception &) {
        end = 0;
    }
    if (end == 0 || end != value.size() || std::isspace((unsigned char) value[0])) {
        throw std::invalid_argument(std::string(flag) + ": not a whole number: '" + value + "'");
    }
    if (v < INT32_MIN || v > INT32_MAX) {
        throw std::invalid_argument(std::string(flag) + ": out of range: '" + value + "'");
    }
    return (int32_t) v;
}

static float kvcomp_parse_float(const char * flag, const std::string & value) {
    size_t end = 0;
    float v = 0.0f;
    try {
        v = std::stof(value, &end);
    } catch (const std::exception &) {
        end = 0;
    }
    if (end == 0 || end != value.size() || std::isspace((unsigned char) value[0])) {
        throw std::invalid_argument(std::string(flag) + ": not a number: '" + value + "'");
    }
    if (!std::isfinite(v)) {
        throw std::invalid_argument(std::string(flag) + ": not a finite number: '" + value + "'");
    }
    return v;
}

std::vector<common_arg> common_kvcomp_args() {
    std::vector<common_arg> args;
    args.push_back(common_arg(
        {"--kv-comp"}, "MODE",
        "kvcomp preset: off, low-latency (kvc4 K/V + scale tracker), balanced (kvc4 K, kvc3 V, 56-position window, "
        "merge every 8 steps), high-precision (kvc8 K and V, 32-position window, merge every 8 steps); sets -ctk/-ctv "
        "unless given and -fa on unless -fa is given (every mode but off has a quantized V cache, so -fa off is refused "
        "with it unless -ctv f16 is given too); --kv-comp-* flags override its knobs (default: off)",
        [](common_params & params, const std::string & value) {
            kvcomp_set_mode(params, value);
        }
    ).set_env("LLAMA_ARG_KV_COMP"));
    args.push_back(common_arg(
        {"--kv-comp-kstats"}, "FILE|auto|none",
        "kvcomp: the model's K statistics, from which a kvct K cache (-ctk kvct*, and the K of --kv-comp low-latency "
        "and balanced) fits its per-layer, per-head plans. auto (default): measured by the library on a built-in text "
        "on first use of the model and cached (KVCOMP_CACHE/kstats, else ~/.cache/kvcomp/kstats); FILE: a file "
        "`kvcomp calibrate` wrote; none: no statistics, the modes store K as kvc4",
        [](common_params & params, const std::string & value) {
            if (value.empty()) {
                throw std::invalid_argument("--kv-comp-kstats: empty path (FILE, auto or none)");
            }
            kvcomp_kstats_none() = value == "none";
            kvcomp_kstats_path() = value == "none" || value == "auto" ? std::string() : value;
            ggml_type mode_k = GGML_TYPE_COUNT;
            if (!kvcomp_k_from_mode() || llama_kvcomp_mode_preset(params.kvcomp.mode, nullptr, &mode_k, nullptr) != 0) {
                return;
            }
            const ggml_type stats_k = (ggml_type) llama_kvcomp_mode_type_k_stats(params.kvcomp.mode);
            if (kvcomp_kstats_none() && params.cache_type_k == stats_k) {
                params.cache_type_k = mode_k;
            } else if (!kvcomp_kstats_none() && params.cache_type_k == mode_k) {
                params.cache_type_k = stats_k;
            }
        }
    ).set_env("LLAMA_ARG_KV_COMP_KSTATS"));
    args.push_back(common_arg(
        {"--kv-comp-k-layers"}, "RULE",
        "kvcomp: per-layer K types: 'same' (every layer the -ctk type) or 'edges' (a kvct4 K cache stores its first "
        "layer and the last sixth of its layers as kvct3: 0.2 bits less K for a measured +0-5% KLD, docs/kv-rows.md); "
        "default: edges for --kv-comp balanced with K statistics (not --kv-comp-kstats none), same otherwise",
        [](common_params &, const std::string & value) {
            const int32_t rule = llama_kvcomp_k_layers_from_name(value.c_str());
            if (rule < 0) {
                throw std::invalid_argument("--kv-comp-k-layers: unknown rule '" + value + "' (same, edges)");
            }
            kvcomp_k_layers_flag() = rule;
        }
    ).set_env("LLAMA_ARG_KV_COMP_K_LAYERS"));
    args.push_back(common_arg(
        {"--kv-comp-layers"}, "FILE",
        "kvcomp: a per-layer profile of the model (`kvcomp calibrate --layers` writes it): in the layers it lists a kvct4 "
        "K is stored as kvct3 and a kvc3 V as kvc4, where the model's measured costs say a bit moved from K to V buys "
        "KLD; replaces --kv-comp-k-layers (docs/formats.md, \"Layer profiles\")",
        [](common_params &, const std::string & value) {
            if (llama_kvcomp_load_layers(value.c_str()) != 0) {
                const char * why = llama_kvcomp_last_error();
                throw std::invalid_argument(std::string("--kv-comp-layers: ") + (why ? why : "cannot load '" + value + "'"));
            }
        }
    ).set_env("LLAMA_ARG_KV_COMP_LAYERS"));
    args.push_back(common_arg(
        {"--kv-comp-window"}, "W",
        "kvcomp residual buffer: the newest W positions stay exact (F16) for every query (default: 0, off; "
        "needs -fa on; on an f16/f32 cache, which is exact already, it stays off)",
        [](common_params & params, const std::string & value) {
            kvcomp_set(params, "--kv-comp-window", KVCOMP_KNOB_WINDOW, &llama_kvcomp_params::window,
                kvcomp_parse_int("--kv-comp-window", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_WINDOW"));
    args.push_back(common_arg(
        {"--kv-comp-sinks"}, "S",
        "kvcomp residual buffer: the first S positions of each sequence stay exact (default: 0)",
        [](common_params & params, const std::string & value) {
            kvcomp_set(params, "--kv-comp-sinks", KVCOMP_KNOB_SINKS, &llama_kvcomp_params::sinks,
                kvcomp_parse_int("--kv-comp-sinks", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_SINKS"));
    args.push_back(common_arg(
        {"--kv-comp-merge"}, "N",
        "kvcomp residual buffer: release the slots of tokens that left the window every N ubatches (default: 1)",
        [](common_params & params, const std::string & value) {
            kvcomp_set(params, "--kv-comp-merge", KVCOMP_KNOB_MERGE, &llama_kvcomp_params::merge_interval,
                kvcomp_parse_int("--kv-comp-merge", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_MERGE"));
    args.push_back(common_arg(
        {"--kv-comp-merge-at"}, "F",
        "kvcomp residual buffer: ... or as soon as this fraction of the slots is in use (default: 1.0)",
        [](common_params & params, const std::string & value) {
            kvcomp_set(params, "--kv-comp-merge-at", KVCOMP_KNOB_MERGE_AT, &llama_kvcomp_params::merge_at,
                kvcomp_parse_float("--kv-comp-merge-at", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_MERGE_AT"));
    args.push_back(common_arg(
        {"--kv-comp-pin-threshold"}, "E",
        "kvcomp residual buffer: keep tokens whose relative quantization error exceeds E exact (default: 0, off)",
        [](common_params & params, const std::string & value) {
            kvcomp_set(params, "--kv-comp-pin-threshold", KVCOMP_KNOB_PIN_THRESHOLD, &llama_kvcomp_params::pin_threshold,
                kvcomp_parse_float("--kv-comp-pin-threshold", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_PIN_THRESHOLD"));
    args.push_back(common_arg(
        {"--kv-comp-pin-budget"}, "P",
        "kvcomp residual buffer: at most P per cent of the cache's cells pinned as outliers (default: 1)",
        [](common_params & params, const std::string & value) {
            kvcomp_set(params, "--kv-comp-pin-budget", KVCOMP_KNOB_PIN_BUDGET, &llama_kvcomp_params::pin_budget,
                kvcomp_parse_float("--kv-comp-pin-budget", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_PIN_BUDGET"));
    args.push_back(common_arg(
        {"--kv-comp-tracker"}, "on|off",
        "kvcomp scale tracker: per-layer K range statistics, and the K offset they yield removed before quantization "
        "(default: off; on in every mode but off)",
        [](common_params & params, const std::string & value) {
            kvcomp_set(params, "--kv-comp-tracker", KVCOMP_KNOB_TRACKER, &llama_kvcomp_params::tracker,
                (int32_t) kvcomp_parse_switch("--kv-comp-tracker", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_TRACKER"));
    args.push_back(common_arg(
        {"--kv-comp-keep-prompt"}, "on|off",
        "kvcomp residual buffer: each sequence keeps the exact rows its last prompt's final token read, through any "
        "generation, so a reused or restored prompt costs a cache hit and gives its first answer (W more slots per "
        "sequence; default: on in llama-server, off elsewhere)",
        [](common_params & params, const std::string & value) {
            params.kvcomp.keep_prompt = kvcomp_parse_switch("--kv-comp-keep-prompt", value) ? 1 : 0;
        }
    ).set_env("LLAMA_ARG_KV_COMP_KEEP_PROMPT"));
    args.push_back(common_arg(
        {"--kv-comp-ema"}, "A[,B]",
        "kvcomp scale tracker: EMA weight of the first layer's statistics, and of the last layer's (layers between are "
        "interpolated), each in (0, 1] (default: 0.1,0.2)",
        [](common_params & params, const std::string & value) {
            const size_t comma = value.find(',');
            const float a = kvcomp_parse_float("--kv-comp-ema", value.substr(0, comma));
            const float b = comma == std::string::npos ? a : kvcomp_parse_float("--kv-comp-ema", value.substr(comma + 1));
            kvcomp_set(params, "--kv-comp-ema", KVCOMP_KNOB_EMA, &llama_kvcomp_params::ema_shallow, a);
            kvcomp_set(params, "--kv-comp-ema", KVCOMP_KNOB_EMA, &llama_kvcomp_params::ema_deep, b);
        }
    ).set_env("LLAMA_ARG_KV_COMP_EMA"));
    args.push_back(common_arg(
        {"--kv-comp-monitor"}, "on|off",
        "kvcomp monitor: per layer/head metrics, perplexity windows of generated tokens and the degrade policy "
        "(default: on whenever kvcomp is)",
        [](common_params &, const std::string & value) {
            kvcomp_set_monitor("--kv-comp-monitor", &llama_kvcomp_monitor_params::enabled,
                (int32_t) kvcomp_parse_switch("--kv-comp-monitor", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_MONITOR"));
    args.push_back(common_arg(
        {"--kv-comp-ppl-window"}, "N",
        "kvcomp monitor: generated tokens per perplexity window (default: 64)",
        [](common_params &, const std::string & value) {
            kvcomp_set_monitor("--kv-comp-ppl-window", &llama_kvcomp_monitor_params::ppl_window,
                kvcomp_parse_int("--kv-comp-ppl-window", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_PPL_WINDOW"));
    args.push_back(common_arg(
        {"--kv-comp-degrade-ratio"}, "R",
        "kvcomp monitor: a window is above baseline when its perplexity exceeds R x the baseline (default: 1.2)",
        [](common_params &, const std::string & value) {
            kvcomp_set_monitor("--kv-comp-degrade-ratio", &llama_kvcomp_monitor_params::degrade_ratio,
                kvcomp_parse_float("--kv-comp-degrade-ratio", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_DEGRADE_RATIO"));
    args.push_back(common_arg(
        {"--kv-comp-degrade-windows"}, "K",
        "kvcomp monitor: K windows above baseline in a row step the mode down high-precision -> balanced -> "
        "low-latency -> off (default: 3; 0: never)",
        [](common_params &, const std::string & value) {
            kvcomp_set_monitor("--kv-comp-degrade-windows", &llama_kvcomp_monitor_params::degrade_windows,
                kvcomp_parse_int("--kv-comp-degrade-windows", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_DEGRADE_WINDOWS"));
    args.push_back(common_arg(
        {"--kv-comp-baseline"}, "PPL|FILE",
        "kvcomp monitor: baseline perplexity, or a calibration profile from `kvcomp profile` (default: each "
        "sequence's first window)",
        [](common_params &, const std::string & value) {
            kvcomp_set_monitor("--kv-comp-baseline", &llama_kvcomp_monitor_params::baseline_ppl, kvcomp_parse_baseline(value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_BASELINE"));
    args.push_back(common_arg(
        {"--kv-comp-fill-warn"}, "F",
        "kvcomp monitor: warn when this fraction of the residual buffer is in use (default: 0.8)",
        [](common_params &, const std::string & value) {
            kvcomp_set_monitor("--kv-comp-fill-warn", &llama_kvcomp_monitor_params::fill_warn,
                kvcomp_parse_float("--kv-comp-fill-warn", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_FILL_WARN"));
    args.push_back(common_arg(
        {"--kv-comp-l2-jump"}, "J",
        "kvcomp monitor: warn when a layer/head's buffer K norm exceeds J x its running mean (default: 2; 0: never)",
        [](common_params &, const std::string & value) {
            kvcomp_set_monitor("--kv-comp-l2-jump", &llama_kvcomp_monitor_params::l2_jump,
                kvcomp_parse_float("--kv-comp-l2-jump", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_L2_JUMP"));
    return args;
}

static void kvcomp_log_config(const llama_kvcomp_params & p, ggml_type type_k, ggml_type type_v) {
    const uint32_t set = kvcomp_knobs_set();
    const char * mode = llama_kvcomp_mode_name(p.mode);
    const auto src = [&](kvcomp_knob k) { return (set >> k) & 1u ? "flag" : mode; };
    LOG_INF("kvcomp: mode           = %s\n", mode);
    LOG_INF("kvcomp: type_k         = %s\n", ggml_type_name(type_k));
    LOG_INF("kvcomp: type_v         = %s\n", ggml_type_name(type_v));
    LOG_INF("kvcomp: window         = %d (%s)\n", p.window, src(KVCOMP_KNOB_WINDOW));
    LOG_INF("kvcomp: sinks          = %d (%s)\n", p.sinks, src(KVCOMP_KNOB_SINKS));
    LOG_INF("kvcomp: merge interval = %d (%s)\n", p.merge_interval, src(KVCOMP_KNOB_MERGE));
    LOG_INF("kvcomp: merge at       = %.2f (%s)\n", p.merge_at, src(KVCOMP_KNOB_MERGE_AT));
    LOG_INF("kvcomp: pin threshold  = %.3f (%s)\n", p.pin_threshold, src(KVCOMP_KNOB_PIN_THRESHOLD));
    LOG_INF("kvcomp: pin budget     = %.2f%% (%s)\n", p.pin_budget, src(KVCOMP_KNOB_PIN_BUDGET));
    LOG_INF("kvcomp: tracker        = %s (%s)\n", p.tracker ? "on" : "off", src(KVCOMP_KNOB_TRACKER));
    LOG_INF("kvcomp: ema            = %.3f,%.3f (%s)\n", p.ema_shallow, p.ema_deep, src(KVCOMP_KNOB_EMA));
    LOG_INF("kvcomp: keep prompt    = %s\n", p.keep_prompt ? "on" : "off");
    const llama_kvcomp_monitor_params & m = kvcomp_monitor_params();
    if (!m.enabled) {
        LOG_INF("kvcomp: monitor        = off\n");
        return;
    }
    const std::string baseline = m.baseline_ppl > 0.0f ? std::to_string(m.baseline_ppl) : "first window";
    LOG_INF("kvcomp: monitor        = on (window %d tokens, degrade after %d windows above %.2f x baseline %s, "
            "fill warning %.2f, L2 jump %.1f)\n", m.ppl_window, m.degrade_windows, m.degrade_ratio, baseline.c_str(),
            m.fill_warn, m.l2_jump);
}

static void kvcomp_log_needs_kstats(ggml_type type_k) {
    LOG_ERR("kvcomp: -ctk %s needs the model's K statistics, and --kv-comp-kstats none was given: drop it (they are "
            "measured on first use) or give a file\n", ggml_type_name(type_k));
}

// The K statistics of a context whose K is a kvct type: the file given, or measured by the
// library (cached per model).
static bool kvcomp_apply_kstats(llama_context * ctx) {
    ggml_type type_k = GGML_TYPE_COUNT, type_v = GGML_TYPE_COUNT;
    if (llama_kvcomp_get_cache_types(ctx, &type_k, &type_v) != 0 || !ggml_kvcomp_is_kvct(type_k) || kvcomp_kstats_none()) {
        return true;
    }
    // the measuring run's progress, in tenths, on one line
    const auto progress = [](float done, void * user_data) {
        int & shown = *(int *) user_data;
        if (shown < 0) {
            LOG_INF("kvcomp: measuring the model's K statistics on the built-in text (once per model) ");
            shown = 0;
        }
        for (; shown < (int) (done * 10.0f); ++shown) {
            LOG_CNT(".");
        }
        if (done >= 1.0f) {
            LOG_CNT(" done\n");
        }
        return true;
    };
    int shown = -1;
    const bool file = !kvcomp_kstats_path().empty();
    if ((file ? llama_kvcomp_set_k_stats(ctx, kvcomp_kstats_path().c_str()) :
                llama_kvcomp_set_k_stats_auto(ctx, nullptr, progress, &shown)) != 0) {
        const char * why = llama_kvcomp_last_error();
        LOG_ERR("kvcomp: the K statistics could not be applied: %s\n", why ? why : "see the reason above");
        return false;
    }
    LOG_INF("kvcomp: K statistics: %s\n", llama_kvcomp_k_stats_source());
    return true;
}

static bool kvcomp_check(const common_params & params, ggml_type type_k);

bool common_kvcomp_check(const common_params & params, llama_context_params & cparams, const llama_model * model) {
    // a mode whose kvct K cannot run here (the cache on a GPU or an RPC server, whose kvct
    // kernels are not there; a RoPE the plans cannot follow) keeps its plain K type rather than
    // fail to run
    ggml_type mode_k = GGML_TYPE_COUNT;
    const char * unfit = nullptr;
    if (kvcomp_k_from_mode() && ggml_kvcomp_is_kvct(cparams.type_k) && kvcomp_kstats_path().empty() &&
        llama_kvcomp_mode_preset(params.kvcomp.mode, nullptr, &mode_k, nullptr) == 0 &&
        (unfit = llama_kvcomp_kvct_unfit(model, cparams.offload_kqv)) != nullptr) {
        LOG_INF("kvcomp: %s: --kv-comp %s stores K as %s\n", unfit, llama_kvcomp_mode_name(params.kvcomp.mode),
                ggml_type_name(mode_k));
        cparams.type_k = mode_k;
    }
    return kvcomp_check(params, cparams.type_k);
}

bool common_kvcomp_check(const common_params & params) {
    return kvcomp_check(params, params.cache_type_k);
}

// The checks on params with K stored as type_k (which the context params may have changed).
static bool kvcomp_check(const common_params & params, ggml_type type_k) {
    kvcomp_apply_k_layers(params, type_k);
    const llama_kvcomp_params & p = params.kvcomp;
    const bool preset = p.mode != LLAMA_KVCOMP_MODE_OFF && p.mode != LLAMA_KVCOMP_MODE_CUSTOM;
    if (ggml_kvcomp_is_kvct(params.cache_type_v)) {
        LOG_ERR("kvcomp: -ctv %s: the kvct types code K rows only (V stays on the kvc types, docs/kv-rows.md): use -ctv kvc4 "
                "or kvc3\n", ggml_type_name(params.cache_type_v));
        return false;
    }
    const bool fa_off = params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED;
    // a mode's own message first: the fix is to drop -fa off, whichever of its types needs it
    if (fa_off && preset && ggml_is_quantized(params.cache_type_v)) {
        LOG_ERR("kvcomp: --kv-comp %s stores V as %s, which needs flash attention, and -fa off was given: drop -fa off "
                "(the mode turns flash attention on), or keep it and add -ctv f16\n", llama_kvcomp_mode_name(p.mode),
                ggml_type_name(params.cache_type_v));
        return false;
    }
    if (ggml_kvcomp_is_kvct(type_k)) {
        if (kvcomp_kstats_none()) {
            kvcomp_log_needs_kstats(type_k);
            return false;
        }
        if (fa_off) {
            LOG_ERR("kvcomp: -ctk %s needs flash attention, and -fa off was given: use -fa on\n",
                    ggml_type_name(type_k));
            return false;
        }
    }
    if (!fa_off || !ggml_is_quantized(params.cache_type_v)) {
        return true;
    }
    if (std::strncmp(ggml_type_name(params.cache_type_v), "kvc", 3) == 0) {
        LOG_ERR("kvcomp: -ctv %s needs flash attention, and -fa off was given: use -fa on, or -ctv f16\n",
                ggml_type_name(params.cache_type_v));
        return false;
    }
    return true;
}

bool common_kvcomp_apply(llama_context * ctx, const common_params & params) {
    llama_kvcomp_params p = params.kvcomp;
    if (!kvcomp_apply_kstats(ctx)) {
        return false;
    }
    if (p.mode == LLAMA_KVCOMP_MODE_CUSTOM && p.window == 0 && p.sinks == 0 && p.pin_threshold == 0.0f && p.tracker == 0) {
        return true;
    }
    // a mode's window, sinks and merge interval shrink to a smaller context; values given as
    // flags are the user's and are checked against it (llama_kvcomp_configure)
    const int32_t n_ctx = (int32_t) llama_n_ctx(ctx);
    const uint32_t set = kvcomp_knobs_set();
    if (!((set >> KVCOMP_KNOB_WINDOW) & 1u)) p.window         = std::min(p.window, n_ctx);
    if (!((set >> KVCOMP_KNOB_SINKS) & 1u))  p.sinks          = std::min(p.sinks, n_ctx);
    if (!((set >> KVCOMP_KNOB_MERGE) & 1u))  p.merge_interval = std::min(p.merge_interval, n_ctx);
    ggml_type type_k = GGML_TYPE_COUNT, type_v = GGML_TYPE_COUNT;
    llama_kvcomp_get_cache_types(ctx, &type_k, &type_v);
    kvcomp_log_config(p, type_k, type_v);
    // the reason is printed here too: llama-bench silences llama's log
    if (llama_kvcomp_configure(ctx, &p) != 0 || llama_kvcomp_set_monitor(ctx, &kvcomp_monitor_params()) != 0) {
        const char * why = llama_kvcomp_last_error();
        LOG_ERR("kvcomp: the configuration could not be applied: %s\n", why ? why : "see the reason above");
        return false;
    }
    return true;
}

// llama-bench parses its own command line; the flags are the same common_args, applied to a
// common_params of their own.
static common_params & kvcomp_bench_params() {
    static common_params params;
    return params;
}

bool common_kvcomp_bench_arg(int argc, char ** argv, int & i, bool & invalid_param) {
    for (const auto & opt : common_kvcomp_args()) {
        if (std::strcmp(argv[i], opt.args[0]) != 0) {
            continue;
        }
        if (++i >= argc) {
            invalid_param = true;
            return true;
        }
        try {
            opt.handler_string(kvcomp_bench_params(), argv[i]);
            // llama-bench takes K from -ctk: the mode's rule holds for the mode's K with statistics
            const int32_t mode = kvcomp_bench_params().kvcomp.mode;
            kvcomp_apply_k_layers(kvcomp_bench_params(), mode >= 0 && mode < LLAMA_KVCOMP_MODE_CUSTOM ?
                (ggml_type) llama_kvcomp_mode_type_k_stats(mode) : GGML_TYPE_COUNT);
        } catch (const std::exception & e) {
            fprintf(stderr, "error: %s\n", e.what());
            invalid_param = true;
        }
        return true;
    }
    return false;
}

void common_kvcomp_bench_usage() {
    for (const auto & opt : common_kvcomp_args()) {
        printf("  %s <%s>\n      %s\n", opt.args[0], opt.value_hint, opt.help.c_str());
    }
}

bool common_kvcomp_bench_check(const llama_context_params & cparams) {
    common_params params = kvcomp_bench_params();
    params.cache_type_k    = cparams.type_k;
    params.cache_type_v    = cparams.type_v;
    params.flash_attn_type = cparams.flash_attn_type;
    return common_kvcomp_check(params);
}

bool common_kvcomp_bench_apply(llama_context * ctx) {
    // llama-bench takes cache types from -ctk/-ctv only: a mode must be run on its own types
    // (K its type for the statistics when they are given)
    const common_params & params = kvcomp_bench_params();
    ggml_type want_k, want_v, type_k = GGML_TYPE_COUNT, type_v = GGML_TYPE_COUNT;
    const bool preset = llama_kvcomp_mode_preset(params.kvcomp.mode, nullptr, &want_k, &want_v) == 0 &&
                        llama_kvcomp_get_cache_types(ctx, &type_k, &type_v) == 0;
    // a mode runs on its plain K, or on its K for the statistics unless they are turned off
    if (preset && !kvcomp_kstats_none() && type_k == (ggml_type) llama_kvcomp_mode_type_k_stats(params.kvcomp.mode)) {
        want_k = type_k;
    }
    if (preset && (type_k != want_k || type_v != want_v)) {
        LOG_ERR("kvcomp: --kv-comp %s runs on -ctk %s -ctv %s in llama-bench (got %s/%s)\n", llama_kvcomp_mode_name(params.kvcomp.mode),
            ggml_type_name(want_k), ggml_type_name(want_v), ggml_type_name(type_k), ggml_type_name(type_v));
        return false;
    }
    if (llama_kvcomp_get_cache_types(ctx, &type_k, &type_v) == 0 && ggml_kvcomp_is_kvct(type_k) && kvcomp_kstats_none()) {
        kvcomp_log_needs_kstats(type_k);
        return false;
    }
    return common_kvcomp_apply(ctx, params);
}
