#pragma once

// kvcomp inside llama.cpp: the public C API.

#include "llama.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Knobs of the residual buffer (docs/design-residual-buffer.md).
struct llama_kvcomp_params {
    int32_t window; // newest positions every query sees at full precision (0: none)
    int32_t sinks;  // first positions of each sequence kept at full precision (0: none)
};

LLAMA_API struct llama_kvcomp_params llama_kvcomp_default_params(void);

// Attaches (or, with window = sinks = 0, removes) the residual buffer of the context's KV
// cache. Call it after the context is created; tokens already cached stay quantized for
// every later query. Returns 0 on success, a negative value with a logged reason otherwise:
// -1 invalid params, -2 unsupported cache layout (needs flash attention, one KV stream and
// a cache without sliding-window layers), -3 allocation failure.
LLAMA_API int32_t llama_kvcomp_configure(struct llama_context * ctx, const struct llama_kvcomp_params * params);

#ifdef __cplusplus
}
#endif
