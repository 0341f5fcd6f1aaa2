#pragma once

// The plans of a kvct K cache (docs/formats.md, "kvct"; docs/kv-rows.md): per layer and KV
// head, fitted from K statistics a calibration run measured on the model
// (llama-kvcomp-calibrate, `kvcomp calibrate`) at the bits of the cache's K type. They are
// fixed for the context's lifetime: a function of the model and the statistics file only,
// never of the requests served, so sequences stay isolated and a batched prompt equals
// token-by-token decoding as for any fixed cache type.

#include "ggml-kvcomp.h"
#include "kvc-transform.h"
#include "kvcomp-hash.h"
#include "kvcomp-storage.h"
#include "llama-kvcomp.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

// A statistics file (GGUF): per model layer and KV head, per RoPE pair of K's channels before
// RoPE (version 1: after RoPE), the mean of each channel, the centred second moments and the
// queries' weight.
struct llama_kvcomp_kstats {
    struct head {
        std::vector<int16_t> pair; // [d/2][2]
        std::vector<float>   mean; // [d]
        std::vector<float>   k2;   // [d/2][3]
        std::vector<float>   w;    // [d/2][3]
    };
    struct layer {
        int32_t d = 0;
        std::vector<head> heads; // empty: the file has no statistics of this layer
    };
    std::string        path;
    std::string        arch;
    uint64_t           n_tokens = 0;
    bool               pre_rope = false; // K measured before RoPE (plans turn rows per key)
    std::vector<layer> layers;           // by model layer
    std::vector<float> signature;        // of the model they were measured on

    // Whether the statistics were measured on `model`: "" when they were, the reason otherwise.
    std::string check_model(const std::vector<float> & model_signature) const;

    // nullptr and the reason in err when the file cannot be read, is not sealed (an older
    // version), was changed after it was written (checksum) or holds values no model's K makes
    static std::shared_ptr<llama_kvcomp_kstats> load(const std::string & path, std::string & err);
};

struct llama_kvcomp_plans {
    // a cache layer: its K tensor ([n_embd_k_gqa, cells, streams], a kvct type), model layer
    // and head size
    struct layer_desc {
        const ggml_tensor * k;
        int32_t il;
        int64_t d;
    };

    // Fits the plans of every cache layer and puts them beside the layer's K rows (the K
    // tensor's buffer type: host memory, or the rpc-server of the layer, whose CPU backend
    // reads them); throws std::runtime_error with the reason when the statistics do not fit
    // the cache (another model's shape, missing layers, statistics a plan refuses).
    llama_kvcomp_plans(const std::vector<layer_desc> & layers, const llama_kvcomp_kstats & stats);

    // cache layer ib: its plans as a tensor ([n_head_kv * sizeof(kvc_t_plan) + sizeof(kvc_t_rope)] I8)
    ggml_tensor * tensor(int32_t ib) const { return tensors[ib]; }

    // Plans fitted before RoPE: the cache codes K as the model computed it before RoPE, and
    // attention turns each row to its cell's position (the cells' positions are in
    // positions(ib), I32 [cells, streams], one copy per buffer type, which set_positions
    // fills before every ubatch). A RoPE shift of the cache then only moves positions.
    bool pre_rope() const { return pre; }
    ggml_tensor * positions(int32_t ib) const { return pos_of[ib]; }
    // every cell's position (0 for an empty one), [streams][cells]; sends each copy the
    // range that changed since the last call (one cell a decoded token)
    void set_positions(const std::vector<int32_t> & p);

    // Cache layer ib's RoPE, from the graph's RoPE node of K (op_params, frequency factors):
    // false, leaving the layer as it was, for a RoPE the plans' pairs cannot follow.
    bool set_rope(int32_t ib, const ggml_tensor * rope_node);
    bool has_rope(int32_t ib) const { return rope(ib).n_pairs > 0; }

    // One row of the K cache (every KV head, the layout of the cache's K rows) to F32, turned
    // to position p when the layer's rows were coded before RoPE.
    void row_to_f32(int32_t ib, const uint8_t * x, float * y, int64_t p) const;

    // A hash of every plan's bytes: a state saved under other plans is told apart.
    uint64_t fingerprint() const { return hash; }

    // Every layer's plans, one after the other: what a state carries, so that a context under
    // other plans can read its rows (recode).
    std::vector<kvc_t_plan> all() const;

    // Re-codes rows `rows` of cache layer ib's K tensor k, coded with `from` (that layer's plans
    // in another context's all(), one per KV head), with this context's plans. Decoding then
    // coding again loses what a second quantization loses (test-kvc-plans bounds it). Returns
    // the reason `from` cannot be read here ("" when the rows were re-coded): plans of another
    // shape, invalid ones, or rows coded on the other side of RoPE.
    std::string recode(int32_t ib, ggml_tensor * k, const kvc_t_plan * from, size_t n_from, bool from_pre_rope,
                       const std::vector<uint64_t> & rows) const;
    size_t n_head(int32_t ib) const { return plans[ib].size(); }
    size_t nbytes() const { return storage.nbytes(); }

private:
    std::vector<std::vector<kvc_t_plan>> plans; // [cache layer][KV head]
    // cache layer ib's RoPE (n_pairs 0 until set_rope), as its tensor holds it after its plans
    const kvc_t_rope & rope(int32_t ib) const { return ropes[ib]; }
    std::vector<kvc_t_rope>    ropes;
    std::vector<ggml_tensor *> tensors;
    bool                       pre = false;
    std::vector<ggml_tensor *> pos_of;   // [cache layer]: the positions in its buffer type
    std::vector<ggml_tensor *> pos_all;  // one per buffer type
    std::vector<int32_t>       pos_sent; // what every copy holds
    std::vector<size_t> row_size; // bytes of one head's row, per cache layer
    uint64_t hash = 0;
    llama_kvcomp_storage storage;
};

// The GGUF keys and tensor names of a statistics file, shared with the tool that writes it.
#define LLAMA_KVCOMP_KSTATS_VERSION    4 // sealed and signed with the model; older ones are measured again
#define LLAMA_KVCOMP_KSTATS_KEY_PRE    "kvcomp.kstats.pre_rope"
#define LLAMA_KVCOMP_KSTATS_KEY_VER    "kvcomp.kstats.version"
#define LLAMA_KVCOMP_KSTATS_KEY_ARCH   "kvcomp.kstats.architecture"
#define LLAMA_KVCOMP_KSTATS_KEY_NTOK   "kvcomp.kstats.n_tokens"
#define LLAMA_KVCOMP_KSTATS_KEY_NEOX   "kvcomp.kstats.rope_neox"
// the digest of every other key and every tensor (llama_kvcomp_kstats_digest)
#define LLAMA_KVCOMP_KSTATS_KEY_SUM    "kvcomp.kstats.checksum"
// per model layer il: "kvcomp.kstats.<il>", F32 [8, d/2, n_head_kv]: per pair
// mean_a, mean_b, E[(ka-ma)^2], E[(ka-ma)(kb-mb)], E[(kb-mb)^2], w_aa, w_ab, w_bb
#define LLAMA_KVCOMP_KSTATS_TENSOR     "kvcomp.kstats.%d"
#define LLAMA_KVCOMP_KSTATS_PER_PAIR   8
// the least cosine between a file's signature and the model's (llama_kvcomp_kstats::check_model)
#define LLAMA_KVCOMP_KSTATS_MIN_COSINE 0.9
// the most values of a signature (llama_kvcomp_model_signature)
#define LLAMA_KVCOMP_SIGNATURE_MAX     4096
// F32 [n]: the model's signature (llama_kvcomp_model_signature) the statistics were measured on
#define LLAMA_KVCOMP_KSTATS_SIGNATURE  "kvcomp.kstats.signature"

// The digest a statistics file is sealed with: its keys but the checksum (name, type, value)
// and its tensors (name, type, shape, data) in the file's order. Inline: the tool that writes
// the file and the tests compute it too.
inline uint64_t llama_kvcomp_kstats_digest(const gguf_context * g, ggml_context * ctx) {
    kvcomp_hasher h;
    const auto add_str = [&](const char * s) { h.update(s, std::strlen(s) + 1); };
    for (int64_t i = 0; i < gguf_get_n_kv(g); ++i) {
        const char * name = gguf_get_key(g, i);
        if (std::strcmp(name, LLAMA_KVCOMP_KSTATS_KEY_SUM) == 0) {
            continue;
        }
        const int32_t type = gguf_get_kv_type(g, i);
        add_str(name);
        h.update(&type, sizeof(type));
        size_t size = 0;
        switch (type) {
            case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL:       size = 1; break;
            case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:                          size = 2; break;
            case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32:  size = 4; break;
            case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64:  size = 8; break;
            default: break;
        }
        if (type == GGUF_TYPE_STRING) {
            add_str(gguf_get_val_str(g, i));
        } else if (size > 0) {
            h.update(gguf_get_val_data(g, i), size);
        } else {
            // arrays: a statistics file has none, and one added later changes the digest by its length
            const size_t n = gguf_get_arr_n(g, i);
            h.update(&n, sizeof(n));
        }
    }
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        const char * name = gguf_get_tensor_name(g, i);
        const ggml_tensor * t = ggml_get_tensor(ctx, name);
        add_str(name);
        if (t) {
            const int32_t type = t->type;
            h.update(&type, sizeof(type));
            h.update(t->ne, sizeof(t->ne));
            if (t->data) {
                h.update(t->data, ggml_nbytes(t));
            }
        }
    }
    return h.digest();
}

// The model's signature as a vector, at most LLAMA_KVCOMP_SIGNATURE_MAX values (empty for a
// model that has none), as the loader compares it and the writers store it.
inline std::vector<float> llama_kvcomp_signature_of(const llama_model * model) {
    std::vector<float> sig(LLAMA_KVCOMP_SIGNATURE_MAX);
    sig.resize(std::max<int32_t>(0, llama_kvcomp_model_signature(model, sig.data(), (int32_t) sig.size())));
    return sig;
}

// Seals a statistics file about to be written: its checksum key, last.
inline void llama_kvcomp_kstats_seal(gguf_context * g, ggml_context * ctx) {
    gguf_remove_key(g, LLAMA_KVCOMP_KSTATS_KEY_SUM);
    gguf_set_val_u64(g, LLAMA_KVCOMP_KSTATS_KEY_SUM, llama_kvcomp_kstats_digest(g, ctx));
}
