#pragma once

// kvcomp KV-cache tensor types: the public API.
// Block layouts are in kvc-common.h, the formats are described in docs/formats.md.

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

// The kvc types occupy GGML_TYPE_KVC8 .. GGML_TYPE_KVC2 contiguously.
#define GGML_KVCOMP_TYPE_FIRST GGML_TYPE_KVC8
#define GGML_KVCOMP_TYPE_LAST  GGML_TYPE_KVC2

// Returns GGML_TYPE_COUNT when the name is not a kvc type.
GGML_API enum ggml_type ggml_kvcomp_type_from_name(const char * name);

#ifdef __cplusplus
}
#endif
