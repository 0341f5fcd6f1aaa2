#include "kvcomp-common.h"

#include "arg.h"
#include "common.h"
#include "log.h"

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

// Sets one knob and checks the whole set, so a bad value names its flag.
template <typename T>
static void kvcomp_set(common_params & params, const char * flag, T llama_kvcomp_params::*field, T value) {
    llama_kvcomp_params p = params.kvcomp;
    p.*field = value;
    if (const char * err = llama_kvcomp_params_error(&p)) {
        throw std::invalid_argument(std::string(flag) + ": " + err);
    }
    params.kvcomp = p;
}

static float kvcomp_parse_float(const char * flag, const std::string & value) {
    size_t end = 0;
    float v = 0.0f;
    try {
        v = std::stof(value, &end);
    } catch (const std::exception &) {
        end = 0;
    }
    if (end == 0 || end != value.size()) {
        throw std::invalid_argument(std::string(flag) + ": not a number: '" + value + "'");
    }
    return v;
}

std::vector<common_arg> common_kvcomp_args() {
    std::vector<common_arg> args;
    args.push_back(common_arg(
        {"--kv-comp-window"}, "W",
        "kvcomp residual buffer: the newest W positions stay exact (F16) for every query (default: 0, off; "
        "needs -fa on and a unified KV cache)",
        [](common_params & params, int value) {
            kvcomp_set(params, "--kv-comp-window", &llama_kvcomp_params::window, value);
        }
    ).set_env("LLAMA_ARG_KV_COMP_WINDOW"));
    args.push_back(common_arg(
        {"--kv-comp-sinks"}, "S",
        "kvcomp residual buffer: the first S positions of each sequence stay exact (default: 0)",
        [](common_params & params, int value) {
            kvcomp_set(params, "--kv-comp-sinks", &llama_kvcomp_params::sinks, value);
        }
    ).set_env("LLAMA_ARG_KV_COMP_SINKS"));
    args.push_back(common_arg(
        {"--kv-comp-merge"}, "N",
        "kvcomp residual buffer: release the slots of tokens that left the window every N ubatches (default: 1)",
        [](common_params & params, int value) {
            kvcomp_set(params, "--kv-comp-merge", &llama_kvcomp_params::merge_interval, value);
        }
    ).set_env("LLAMA_ARG_KV_COMP_MERGE"));
    args.push_back(common_arg(
        {"--kv-comp-merge-at"}, "F",
        "kvcomp residual buffer: ... or as soon as this fraction of the slots is in use (default: 1.0)",
        [](common_params & params, const std::string & value) {
            kvcomp_set(params, "--kv-comp-merge-at", &llama_kvcomp_params::merge_at,
                kvcomp_parse_float("--kv-comp-merge-at", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_MERGE_AT"));
    args.push_back(common_arg(
        {"--kv-comp-pin-threshold"}, "E",
        "kvcomp residual buffer: keep tokens whose relative quantization error exceeds E exact (default: 0, off)",
        [](common_params & params, const std::string & value) {
            kvcomp_set(params, "--kv-comp-pin-threshold", &llama_kvcomp_params::pin_threshold,
                kvcomp_parse_float("--kv-comp-pin-threshold", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_PIN_THRESHOLD"));
    args.push_back(common_arg(
        {"--kv-comp-pin-budget"}, "P",
        "kvcomp residual buffer: at most P per cent of the cache's cells pinned as outliers (default: 1)",
        [](common_params & params, const std::string & value) {
            kvcomp_set(params, "--kv-comp-pin-budget", &llama_kvcomp_params::pin_budget,
                kvcomp_parse_float("--kv-comp-pin-budget", value));
        }
    ).set_env("LLAMA_ARG_KV_COMP_PIN_BUDGET"));
    return args;
}

bool common_kvcomp_apply(llama_context * ctx, const common_params & params) {
    const llama_kvcomp_params & p = params.kvcomp;
    if (p.window == 0 && p.sinks == 0 && p.pin_threshold == 0.0f) {
        return true;
    }
    LOG_INF("kvcomp: window = %d, sinks = %d, merge interval = %d, merge at = %.2f, pin threshold = %.3f, pin budget = %.2f%%\n",
        p.window, p.sinks, p.merge_interval, p.merge_at, p.pin_threshold, p.pin_budget);
    if (llama_kvcomp_configure(ctx, &p) != 0) {
        LOG_ERR("kvcomp: the residual buffer could not be attached (see the reason above)\n");
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
            if (opt.handler_int) {
                size_t end = 0;
                const int v = std::stoi(argv[i], &end);
                if (argv[i][end] != '\0') {
                    throw std::invalid_argument(std::string(opt.args[0]) + ": not a whole number: '" + argv[i] + "'");
                }
                opt.handler_int(kvcomp_bench_params(), v);
            } else {
                opt.handler_string(kvcomp_bench_params(), argv[i]);
            }
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

bool common_kvcomp_bench_apply(llama_context * ctx) {
    return common_kvcomp_apply(ctx, kvcomp_bench_params());
}
