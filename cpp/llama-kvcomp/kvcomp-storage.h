#pragma once

// Tensors kvcomp keeps beside the KV cache layers they serve (the residual buffer's slots, the
// tracker's stores): one ggml context and backend buffer per buffer type, so a layer's tensors
// live where its cells do, on another device or on the host of a split model's layer
// (docs/distributed.md), and attention reads them without a copy.

#include "ggml.h"
#include "ggml-backend.h"

#include <vector>

struct llama_kvcomp_storage {
    llama_kvcomp_storage() = default;
    llama_kvcomp_storage(const llama_kvcomp_storage &) = delete;
    llama_kvcomp_storage & operator=(const llama_kvcomp_storage &) = delete;
    ~llama_kvcomp_storage();

    // the context for tensors in buft, with room for n_tensors (the first call for a buft
    // makes it); throws std::runtime_error when it cannot
    ggml_context * ctx_for(ggml_backend_buffer_type_t buft, size_t n_tensors);
    // allocates every context's tensors in its buffer type and clears them; throws with the
    // name of what failed
    void alloc(const char * what);

    size_t nbytes() const;
    // every buffer in host memory
    bool is_host() const;
    void swap(llama_kvcomp_storage & other);

private:
    std::vector<ggml_backend_buffer_type_t> bufts;
    std::vector<ggml_context *>             ctxs;
    std::vector<ggml_backend_buffer_t>      bufs;
};
