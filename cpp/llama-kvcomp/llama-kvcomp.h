#pragma once

// kvcomp inside llama.cpp: the public C API.

#include "llama.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Knobs of the residual buffer (docs/design-residual-buffer.md).
struct llama_kvcomp_params {
    int32_t window;         // newest positions every query sees at full precision (0: none)
    int32_t sinks;          // first positions of each sequence kept at full precision (0: none)
    int32_t merge_interval; // slots of tokens that left the window are released every N ubatches (>= 1)
    float   merge_at;       // ... or as soon as this fraction of the slots is in use (0, 1]
    float   pin_threshold;  // relative quantization error ||x - deq(q(x))|| / ||x|| of a token above
                            // which it stays exact (0: no outlier pins)
    float   pin_budget;     // most cells pinned as outliers, in per cent of the cache size [0, 100]
};

LLAMA_API struct llama_kvcomp_params llama_kvcomp_default_params(void);

// Attaches (or, with window = sinks = pin_threshold = 0, removes) the residual buffer of the
// context's KV cache. Call it after the context is created; tokens already cached stay
// quantized for every later query. Returns 0 on success, a negative value with a logged
// reason otherwise: -1 invalid params, -2 unsupported cache layout (needs flash attention,
// one KV stream and a cache without sliding-window layers), -3 allocation failure.
LLAMA_API int32_t llama_kvcomp_configure(struct llama_context * ctx, const struct llama_kvcomp_params * params);

// What the residual buffer holds and has done, for tests and monitoring.
struct llama_kvcomp_stats {
    int32_t n_slots;         // slots allocated
    int32_t n_used;          // slots holding an exact row
    int32_t n_pinned;        // outlier pins among them
    int32_t n_pin_budget;    // most outlier pins
    int64_t n_merges;        // merge passes run
    int64_t n_released;      // slots released by merges
    int64_t n_overflow;      // rows that found no free slot and stayed quantized (0 unless mis-sized)
    float   pin_err_min;     // smallest error among the pins (0: none)
    float   evicted_err_max; // largest error of an outlier released for lack of budget (0: none)
};

// Returns 0 and fills stats, or -1 when the context has no residual buffer.
LLAMA_API int32_t llama_kvcomp_get_stats(struct llama_context * ctx, struct llama_kvcomp_stats * stats);

// Why params are invalid, or NULL when they are valid.
LLAMA_API const char * llama_kvcomp_params_error(const struct llama_kvcomp_params * params);

#ifdef __cplusplus
}
#endif
