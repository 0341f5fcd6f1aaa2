#include "kvcomp-layers.h"
#include "kvcomp-state.h"

#include "gguf.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr const char * KVCOMP_K_LAYERS_NAMES[] = { "same", "edges" };
static_assert(sizeof(KVCOMP_K_LAYERS_NAMES) / sizeof(KVCOMP_K_LAYERS_NAMES[0]) == LLAMA_KVCOMP_K_LAYERS_COUNT,
              "one name per per-layer K rule");

std::atomic<int32_t> g_k_layers{LLAMA_KVCOMP_K_LAYERS_SAME};

// the loaded profile (empty path: none)
struct layers_profile {
    std::string       path;
    std::string       arch;
    uint32_t          n_layer = 0;
    std::vector<bool> k_down;
    std::vector<bool> v_up;
};

std::mutex     g_profile_mutex;
layers_profile g_profile;

// the INT32 layer indices of array key name (absent: none), each in [0, n_layer) and listed once
std::vector<bool> read_layers(gguf_context * g, const char * name, uint32_t n_layer, std::string & err) {
    std::vector<bool> out(n_layer, false);
    const int64_t id = gguf_find_key(g, name);
    // no layers: gguf-py leaves an empty array out, and an empty one has no element type to check
    if (id < 0 || (gguf_get_kv_type(g, id) == GGUF_TYPE_ARRAY && gguf_get_arr_n(g, id) == 0)) {
        return out;
    }
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != GGUF_TYPE_INT32) {
        err = std::string("no INT32 array ") + name;
        return out;
    }
    const int32_t * v = (const int32_t *) gguf_get_arr_data(g, id);
    for (size_t i = 0; i < gguf_get_arr_n(g, id); ++i) {
        if (v[i] < 0 || (uint32_t) v[i] >= n_layer || out[v[i]]) {
            err = std::string(name) + " lists layer " + std::to_string(v[i]) + (v[i] >= 0 && (uint32_t) v[i] < n_layer ? " twice" :
                  " of a model of " + std::to_string(n_layer) + " layers");
            return out;
        }
        out[v[i]] = true;
    }
    return out;
}

} // namespace

int32_t llama_kvcomp_set_k_layers(int32_t rule) {
    if (rule < 0 || rule >= LLAMA_KVCOMP_K_LAYERS_COUNT) {
        return llama_kvcomp_fail(-1, "unknown per-layer K rule " + std::to_string(rule));
    }
    g_k_layers = rule;
    return 0;
}

int32_t llama_kvcomp_get_k_layers(void) {
    return g_k_layers;
}

ggml_type llama_kvcomp_layer_type_k(int32_t rule, int32_t il, int32_t n_layer, ggml_type type_k) {
    if (rule != LLAMA_KVCOMP_K_LAYERS_EDGES || type_k != GGML_TYPE_KVCT4 || n_layer <= 0) {
        return type_k;
    }
    const int32_t n_last = (n_layer + 5) / 6;
    return il == 0 || il >= n_layer - n_last ? GGML_TYPE_KVCT3 : type_k;
}

const char * llama_kvcomp_k_layers_name(int32_t rule) {
    return rule >= 0 && rule < LLAMA_KVCOMP_K_LAYERS_COUNT ? KVCOMP_K_LAYERS_NAMES[rule] : nullptr;
}

int32_t llama_kvcomp_k_layers_from_name(const char * name) {
    for (int32_t r = 0; name && r < LLAMA_KVCOMP_K_LAYERS_COUNT; ++r) {
        if (std::strcmp(name, KVCOMP_K_LAYERS_NAMES[r]) == 0 || std::strcmp(name, std::to_string(r).c_str()) == 0) {
            return r;
        }
    }
    return -1;
}

int32_t llama_kvcomp_load_layers(const char * path) {
    if (!path) {
        std::lock_guard<std::mutex> lock(g_profile_mutex);
        g_profile = layers_profile();
        return 0;
    }
    gguf_init_params ip = { /*no_alloc =*/ true, /*ctx =*/ nullptr };
    gguf_context * g = gguf_init_from_file(path, ip);
    if (!g) {
        return llama_kvcomp_fail(-1, std::string("cannot read the layer profile '") + path + "' as a GGUF file (missing or damaged)");
    }
    layers_profile p;
    p.path = path;
    std::string err;
    const auto key = [&](const char * name, gguf_type type) {
        const int64_t id = gguf_find_key(g, name);
        return id >= 0 && gguf_get_kv_type(g, id) == type ? id : -1;
    };
    const int64_t k_ver  = key(LLAMA_KVCOMP_LAYERS_KEY_VER, GGUF_TYPE_UINT32);
    const int64_t k_arch = key(LLAMA_KVCOMP_LAYERS_KEY_ARCH, GGUF_TYPE_STRING);
    const int64_t k_n    = key(LLAMA_KVCOMP_LAYERS_KEY_N_LAYER, GGUF_TYPE_UINT32);
    if (k_ver < 0 || k_arch < 0 || k_n < 0) {
        err = "not a kvcomp layer profile (`kvcomp calibrate --layers` writes one)";
    } else if (gguf_get_val_u32(g, k_ver) != LLAMA_KVCOMP_LAYERS_VERSION) {
        err = "profile version " + std::to_string(gguf_get_val_u32(g, k_ver)) + ", this build reads " +
              std::to_string(LLAMA_KVCOMP_LAYERS_VERSION);
    } else {
        p.arch    = gguf_get_val_str(g, k_arch);
        p.n_layer = gguf_get_val_u32(g, k_n);
        p.k_down  = read_layers(g, LLAMA_KVCOMP_LAYERS_KEY_K_DOWN, p.n_layer, err);
        if (err.empty()) {
            p.v_up = read_layers(g, LLAMA_KVCOMP_LAYERS_KEY_V_UP, p.n_layer, err);
        }
    }
    gguf_free(g);
    if (!err.empty()) {
        return llama_kvcomp_fail(-1, std::string("layer profile '") + path + "': " + err);
    }
    std::lock_guard<std::mutex> lock(g_profile_mutex);
    g_profile = std::move(p);
    return 0;
}

void llama_kvcomp_cache_layer_types(const llama_model & model, uint32_t il, uint32_t n_layer, ggml_type type_k,
                                    ggml_type type_v, ggml_type & layer_k, ggml_type & layer_v) {
    std::lock_guard<std::mutex> lock(g_profile_mutex);
    const layers_profile & p = g_profile;
    if (p.path.empty()) {
        layer_k = llama_kvcomp_layer_type_k(g_k_layers, (int32_t) il, (int32_t) n_layer, type_k);
        layer_v = type_v;
        return;
    }
    char arch[64] = "";
    llama_model_meta_val_str(&model, "general.architecture", arch, sizeof(arch));
    if (p.arch != arch || p.n_layer != n_layer) {
        throw std::runtime_error("kvcomp: the layer profile '" + p.path + "' was measured on a " + p.arch + " model of " +
                                 std::to_string(p.n_layer) + " layers, this is a " + arch + " model of " +
                                 std::to_string(n_layer) + " (run `kvcomp calibrate --layers` on this model)");
    }
    layer_k = type_k == GGML_TYPE_KVCT4 && p.k_down[il] ? GGML_TYPE_KVCT3 : type_k;
    layer_v = type_v == GGML_TYPE_KVC3 && p.v_up[il] ? GGML_TYPE_KVC4 : type_v;
}
