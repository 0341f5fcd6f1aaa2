// What the kvcomp tools share around llama.cpp's common library.
#pragma once

#include "common.h"
#include "log.h"

// The backend initialized, then the model and context of the tool's parameters (common_init()
// already called, callbacks set). The result's context is null, said in the log, when they
// cannot be made.
static inline common_init_result_ptr kvcomp_tool_context(common_params & params) {
    llama_backend_init();
    common_init_result_ptr init = common_init_from_params(params);
    if (!init->context()) {
        LOG_ERR("failed to create the context\n");
    }
    return init;
}
