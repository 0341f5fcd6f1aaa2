#pragma once

// Per-layer K and V types of a KV cache (docs/reference.md, "KV cache types"): a rule
// (llama_kvcomp_set_k_layers) or a measured profile (llama_kvcomp_load_layers), both
// process-wide, read where the cache makes each layer's tensors (patch 0024).

#include "llama-kvcomp.h"

#include "ggml.h"

#include <cstdint>

// GGUF keys of a profile (`kvcomp calibrate --layers` writes one; docs/formats.md, "Layer
// profiles"); the two arrays are INT32 layer indices
#define LLAMA_KVCOMP_LAYERS_KEY_VER     "kvcomp.layers.version"
#define LLAMA_KVCOMP_LAYERS_KEY_ARCH    "kvcomp.layers.architecture"
#define LLAMA_KVCOMP_LAYERS_KEY_N_LAYER "kvcomp.layers.n_layer"
#define LLAMA_KVCOMP_LAYERS_KEY_K_DOWN  "kvcomp.layers.k_down" // a kvct4 K is stored as kvct3
#define LLAMA_KVCOMP_LAYERS_KEY_V_UP    "kvcomp.layers.v_up"   // a kvc3 V is stored as kvc4
#define LLAMA_KVCOMP_LAYERS_VERSION     1

// The K and V types of layer il (of n_layer) of a cache of model whose context asked for
// type_k/type_v: the profile's when one is loaded, else the rule's. Throws std::runtime_error
// when the profile was measured on a model of another architecture or layer count.
void llama_kvcomp_cache_layer_types(const struct llama_model & model, uint32_t il, uint32_t n_layer, ggml_type type_k,
                                    ggml_type type_v, ggml_type & layer_k, ggml_type & layer_v);
