#include "kvcomp-storage.h"

#include <stdexcept>
#include <string>

llama_kvcomp_storage::~llama_kvcomp_storage() {
    for (ggml_backend_buffer_t b : bufs) {
        ggml_backend_buffer_free(b);
    }
    for (ggml_context * c : ctxs) {
        ggml_free(c);
    }
}

ggml_context * llama_kvcomp_storage::ctx_for(ggml_backend_buffer_type_t buft, size_t n_tensors) {
    for (size_t i = 0; i < bufts.size(); ++i) {
        if (bufts[i] == buft) {
            return ctxs[i];
        }
    }
    ggml_init_params ip = { n_tensors * ggml_tensor_overhead(), nullptr, true };
    ggml_context * c = ggml_init(ip);
    if (!c) {
        throw std::runtime_error("kvcomp: failed to create a ggml context");
    }
    bufts.push_back(buft);
    ctxs.push_back(c);
    return c;
}

void llama_kvcomp_storage::alloc(const char * what) {
    for (size_t i = bufs.size(); i < ctxs.size(); ++i) {
        ggml_backend_buffer_t b = ggml_backend_alloc_ctx_tensors_from_buft(ctxs[i], bufts[i]);
        if (!b) {
            throw std::runtime_error(std::string("kvcomp: failed to allocate the ") + what + " in " +
                                     ggml_backend_buft_name(bufts[i]));
        }
        ggml_backend_buffer_clear(b, 0);
        bufs.push_back(b);
    }
}

size_t llama_kvcomp_storage::nbytes() const {
    size_t n = 0;
    for (ggml_backend_buffer_t b : bufs) {
        n += ggml_backend_buffer_get_size(b);
    }
    return n;
}

bool llama_kvcomp_storage::is_host() const {
    for (ggml_backend_buffer_t b : bufs) {
        if (!ggml_backend_buffer_is_host(b)) {
            return false;
        }
    }
    return true;
}

void llama_kvcomp_storage::swap(llama_kvcomp_storage & other) {
    std::swap(bufts, other.bufts);
    std::swap(ctxs, other.ctxs);
    std::swap(bufs, other.bufs);
}
