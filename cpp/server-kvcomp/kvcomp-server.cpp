#include "kvcomp-server.h"

#include "server-common.h"

#include "common.h"

#include "llama-kvcomp.h"
#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

void kvcomp_server_defaults(common_params & params) {
    params.kvcomp.keep_prompt = 1;
}

// whether the context has a monitor that is on (--kv-comp-monitor off keeps one that has
// nothing current)
static bool kvcomp_monitoring(llama_context * ctx) {
    llama_kvcomp_snapshot snap = {};
    return ctx && llama_kvcomp_get_snapshot(ctx, &snap, nullptr, 0, nullptr, 0, nullptr, 0) == 0 && snap.enabled;
}

static bool kvcomp_snapshot_string(llama_context * ctx, int32_t format, int32_t layer, std::string & out) {
    if (!kvcomp_monitoring(ctx)) {
        return false;
    }
    const int64_t n = llama_kvcomp_snapshot_text(ctx, format, layer, nullptr, 0);
    if (n < 0) {
        return false;
    }
    out.assign((size_t) n + 1, '\0');
    llama_kvcomp_snapshot_text(ctx, format, layer, out.data(), out.size());
    out.resize((size_t) n);
    return true;
}

static server_http_res_ptr kvcomp_error(const std::string & message, error_type type) {
    auto res = std::make_unique<server_http_res>();
    const json err = format_error_response(message, type);
    res->status = json_value(err, "code", 500);
    res->data   = safe_json_to_str({ { "error", err } });
    return res;
}

// The series of the last context seen, kept monotonic across contexts. A sleeping server
// (--sleep-idle-seconds) has freed its context: the monitor of the last one is still
// registered under its address (only a name here, never dereferenced), so its final values
// go on being exported. A context created on waking has a new monitor (its start time says
// so) whose counters start at 0; each counter continues from where the last one ended.
struct kvcomp_metrics_state {
    std::mutex mtx;
    llama_context * last_ctx = nullptr;
    std::string start;                  // the exporting monitor's start time, as exported
    std::map<std::string, double> seen; // counter series -> value last exported by that monitor
    std::map<std::string, double> base; // ... -> what earlier monitors had counted
};

static std::string kvcomp_monotonic(kvcomp_metrics_state & st, const std::string & text) {
    static const std::string start_series = "llamacpp:kvcomp_monitor_start_time_seconds ";
    const size_t at = text.find("\n" + start_series);
    const std::string start = at == std::string::npos ? "" : text.substr(at + 1, text.find('\n', at + 1) - at - 1);
    if (start != st.start) {
        for (const auto & [series, v] : st.seen) {
            st.base[series] += v;
        }
        st.seen.clear();
        st.start = start;
    }
    std::string out;
    size_t pos = 0;
    while (pos < text.size()) {
        size_t end = text.find('\n', pos);
        end = end == std::string::npos ? text.size() : end + 1;
        std::string line = text.substr(pos, end - pos);
        pos = end;
        const size_t sp = line.rfind(' ');
        const std::string series = sp == std::string::npos ? "" : line.substr(0, sp);
        const std::string name = series.substr(0, series.find('{'));
        if (line.empty() || line[0] == '#' || name.size() < 6 || name.compare(name.size() - 6, 6, "_total") != 0) {
            out += line;
            continue;
        }
        double v = 0.0;
        try {
            v = std::stod(line.substr(sp + 1));
        } catch (const std::exception &) {
            out += line;
            continue;
        }
        st.seen[series] = v;
        char num[32];
        snprintf(num, sizeof(num), "%.17g", st.base[series] + v);
        out += series + " " + num + "\n";
    }
    return out;
}

server_http_context::handler_t kvcomp_server_metrics_handler(server_http_context::handler_t upstream,
                                                             std::function<llama_context *()> get_ctx) {
    auto st = std::make_shared<kvcomp_metrics_state>();
    return [upstream = std::move(upstream), get_ctx = std::move(get_ctx), st](const server_http_req & req) -> server_http_res_ptr {
        server_http_res_ptr res = upstream(req);
        if (!res || res->status != 200 || res->is_stream()) {
            return res;
        }
        std::lock_guard<std::mutex> lock(st->mtx);
        llama_context * ctx = get_ctx();
        st->last_ctx = ctx ? ctx : st->last_ctx;
        std::string text;
        if (kvcomp_snapshot_string(st->last_ctx, LLAMA_KVCOMP_FORMAT_PROMETHEUS, -1, text)) {
            res->data += kvcomp_monotonic(*st, text);
        }
        return res;
    };
}

// the model layers the snapshot has rows for
static int32_t kvcomp_snapshot_layers(llama_context * ctx) {
    llama_kvcomp_snapshot snap = {};
    if (!ctx || llama_kvcomp_get_snapshot(ctx, &snap, nullptr, 0, nullptr, 0, nullptr, 0) != 0 || snap.n_heads <= 0) {
        return 0;
    }
    std::vector<llama_kvcomp_head_snapshot> heads(snap.n_heads);
    llama_kvcomp_get_snapshot(ctx, &snap, heads.data(), (int32_t) heads.size(), nullptr, 0, nullptr, 0);
    int32_t n = 0;
    for (const auto & h : heads) {
        n = std::max(n, h.il + 1);
    }
    return n;
}

// How often each key occurs in a query string ("a=1&a=2&b"): req.params keeps one value per key.
static std::map<std::string, int> kvcomp_query_counts(const std::string & query) {
    std::map<std::string, int> counts;
    size_t pos = 0;
    while (pos <= query.size() && !query.empty()) {
        size_t end = query.find('&', pos);
        end = end == std::string::npos ? query.size() : end;
        const std::string item = query.substr(pos, end - pos);
        if (!item.empty()) {
            ++counts[item.substr(0, item.find('='))];
        }
        pos = end + 1;
    }
    return counts;
}

server_http_context::handler_t kvcomp_server_handler(bool enabled, std::function<llama_context *()> get_ctx) {
    return [enabled, get_ctx = std::move(get_ctx)](const server_http_req & req) -> server_http_res_ptr {
        if (!enabled) {
            return kvcomp_error("This server does not support the kvcomp endpoint. Start it with `--metrics`", ERROR_TYPE_NOT_SUPPORTED);
        }
        // The rules of docs/monitoring.md ("Surfaces"): known parameters only, each at most
        // once, and a value to each that is given.
        for (const auto & [key, value] : req.params) {
            if (key != "layer" && key != "format") {
                return kvcomp_error("unknown query parameter '" + key + "' (layer, format)", ERROR_TYPE_INVALID_REQUEST);
            }
        }
        for (const auto & [key, n] : kvcomp_query_counts(req.query_string)) {
            if (n > 1) {
                return kvcomp_error("query parameter '" + key + "' given " + std::to_string(n) + " times (at most once)",
                    ERROR_TYPE_INVALID_REQUEST);
            }
        }
        const std::string fmt = req.get_param("format", "json");
        if (fmt != "json" && fmt != "prometheus") {
            return kvcomp_error("format must be json or prometheus, got '" + fmt + "'", ERROR_TYPE_INVALID_REQUEST);
        }
        llama_context * ctx = get_ctx();
        if (!kvcomp_monitoring(ctx)) {
            return kvcomp_error("kvcomp monitoring is off (start the server with --kv-comp MODE and --kv-comp-monitor on)",
                ERROR_TYPE_NOT_SUPPORTED);
        }
        int32_t layer = -1;
        if (req.params.count("layer") > 0) {
            // digits only: no sign, space or exponent (std::stol would take " +3")
            const std::string layer_str = req.get_param("layer");
            const bool digits = !layer_str.empty() && layer_str.size() <= 9 &&
                    std::all_of(layer_str.begin(), layer_str.end(), [](char c) { return c >= '0' && c <= '9'; });
            const long v = digits ? std::stol(layer_str) : -1;
            const int32_t n_layer = kvcomp_snapshot_layers(ctx);
            if (v < 0 || v >= n_layer) {
                return kvcomp_error("layer must be a whole number in [0, " + std::to_string(n_layer) + "), got '" + layer_str + "'",
                    ERROR_TYPE_INVALID_REQUEST);
            }
            layer = (int32_t) v;
        }
        const int32_t format = fmt == "json" ? LLAMA_KVCOMP_FORMAT_JSON : LLAMA_KVCOMP_FORMAT_PROMETHEUS;
        std::string text;
        if (!kvcomp_snapshot_string(ctx, format, layer, text)) {
            return kvcomp_error("kvcomp monitoring is off (start the server with --kv-comp MODE and --kv-comp-monitor on)",
                ERROR_TYPE_NOT_SUPPORTED);
        }
        auto res = std::make_unique<server_http_res>();
        res->status       = 200;
        res->content_type = format == LLAMA_KVCOMP_FORMAT_JSON ? "application/json; charset=utf-8" : "text/plain; version=0.0.4";
        res->data         = std::move(text);
        return res;
    };
}
