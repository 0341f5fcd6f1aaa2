#pragma once

// kvcomp KV-cache tensor types: the public API.
// Block layouts are in kvc-common.h, the formats are described in docs/formats.md.

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The kvc types occupy GGML_TYPE_KVC8 .. GGML_TYPE_KVC2 contiguously.
#define GGML_KVCOMP_TYPE_FIRST GGML_TYPE_KVC8
#define GGML_KVCOMP_TYPE_LAST  GGML_TYPE_KVC2

GGML_API bool           ggml_kvcomp_is_kvc_type(enum ggml_type type);

// Returns GGML_TYPE_COUNT when the name is not a kvc type.
GGML_API enum ggml_type ggml_kvcomp_type_from_name(const char * name);

// Quantizes nrows rows of n_per_row floats with the reference quantizer, returns bytes written.
GGML_API size_t ggml_kvcomp_quantize(enum ggml_type type, const float * src, void * dst, int64_t nrows, int64_t n_per_row);

#ifdef __cplusplus
}
#endif
