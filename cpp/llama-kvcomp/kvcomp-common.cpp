#include "kvcomp-common.h"

#include "arg.h"
#include "common.h"
#include "log.h"

#include <stdexcept>
#include <string>

static int32_t kvcomp_parse_count(const char * flag, int value) {
    if (value < 0) {
        throw std::invalid_argument(std::string(flag) + " must be >= 0, got " + std::to_string(value));
    }
    return value;
}

std::vector<common_arg> common_kvcomp_args() {
    std::vector<common_arg> args;
    args.push_back(common_arg(
        {"--kv-comp-window"}, "W",
        "kvcomp residual buffer: the newest W positions stay exact (F16) for every query (default: 0, off; "
        "needs -fa on and a unified KV cache)",
        [](common_params & params, int value) {
            params.kvcomp.window = kvcomp_parse_count("--kv-comp-window", value);
        }
    ).set_env("LLAMA_ARG_KV_COMP_WINDOW"));
    args.push_back(common_arg(
        {"--kv-comp-sinks"}, "S",
        "kvcomp residual buffer: the first S positions of each sequence stay exact (default: 0)",
        [](common_params & params, int value) {
            params.kvcomp.sinks = kvcomp_parse_count("--kv-comp-sinks", value);
        }
    ).set_env("LLAMA_ARG_KV_COMP_SINKS"));
    return args;
}

bool common_kvcomp_apply(llama_context * ctx, const common_params & params) {
    if (params.kvcomp.window == 0 && params.kvcomp.sinks == 0) {
        return true;
    }
    LOG_INF("kvcomp: window = %d, sinks = %d\n", params.kvcomp.window, params.kvcomp.sinks);
    if (llama_kvcomp_configure(ctx, &params.kvcomp) != 0) {
        LOG_ERR("kvcomp: the residual buffer could not be attached (see the reason above)\n");
        return false;
    }
    return true;
}
