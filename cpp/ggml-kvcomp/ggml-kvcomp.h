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

// Two-source attention. A FLASH_ATTN_EXT node may read exact F16 rows beside its main K/V
// (the residual buffer's rows beside the quantized cells) under one online softmax and one
// mask. The exact rows come in two parts, read where they lie: the buffer's slots and the
// current ubatch's own rows (optional). Keys are numbered main cells first, then slots, then
// ubatch rows, and the mask has a column for each (mask->ne[0] >= their sum; a worst-case
// graph may have more). Each part has the main pair's head size, KV heads and streams and
// shares its permutation. The slots are F16; the ubatch's rows are F16 or F32, and F32 rows
// are read as their F16 rounding (what the slots keep of them), so the graph needs no cast.
// Set like the sinks, in these sources of the node:
#define GGML_KVCOMP_FA_SRC_K_EXACT  5
#define GGML_KVCOMP_FA_SRC_V_EXACT  6
#define GGML_KVCOMP_FA_SRC_K_UBATCH 7
#define GGML_KVCOMP_FA_SRC_V_UBATCH 8

GGML_API void ggml_flash_attn_ext_add_exact(struct ggml_tensor * a, struct ggml_tensor * k_exact, struct ggml_tensor * v_exact,
                                            struct ggml_tensor * k_ubatch, struct ggml_tensor * v_ubatch);

// Whether a FLASH_ATTN_EXT node reads a second source (above).
GGML_API bool ggml_flash_attn_ext_has_exact(const struct ggml_tensor * a);

// The op-support query's kvcomp rule, asked before a device's own answer: a node with a
// second attention source runs only where its kernel is (the CPU backend), since a backend
// that does not know the sources would silently attend the main cells alone.
struct ggml_backend_device;
GGML_API bool ggml_kvcomp_dev_supports_op(struct ggml_backend_device * dev, const struct ggml_tensor * op);

#ifdef __cplusplus
}
#endif
