#pragma once

// The residual buffer: an F16 copy of the K/V rows of recent and sink tokens, attended
// instead of their quantized rows. Every row is also written to the quantized cache, so a
// slot can be released at any time without work ("merge" = release).
//
// The cache reports n_kv_main + n_slots cells; attention sees [main cells ; slots] and the
// mask shows each visible key once: from a slot when it is exact for the query, otherwise
// from the main cache. Exactness depends on positions only, so a batched prompt and
// token-by-token decoding see the same keys.

#include "llama-kvcomp.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <functional>
#include <vector>

class llama_kv_cache;
struct llama_ubatch;

struct llama_kvcomp_buffer {
    llama_kvcomp_buffer(const llama_kv_cache & kv, const llama_kvcomp_params & params, uint32_t n_ubatch, uint32_t n_seq_max);
    ~llama_kvcomp_buffer();

    // llama_kvcomp_configure on one cache; same return codes
    static int32_t attach(llama_kv_cache & kv, const llama_kvcomp_params & params, uint32_t n_ubatch, uint32_t n_seq_max);

    uint32_t n_slots() const { return (uint32_t) slot_cell.size(); }

    // After upstream placed the ubatch in `cells` (one stream): release slots no query can
    // still see exactly, and give every token of the ubatch a slot.
    void apply(const llama_kv_cache & kv, const std::vector<uint32_t> & cells, const llama_ubatch & ubatch);

    // Forgets every slot: the cells they shadow were replaced (state load). Those tokens are
    // attended through their quantized rows from now on.
    void reset();

    // Writes the ubatch's rows into the main cache (returned) and into the slots (kept for
    // the get() of the same layer in the same graph); `idxs` holds main rows then slot rows.
    ggml_tensor * cpy(ggml_context * ctx, ggml_tensor * cache, ggml_tensor * cur, ggml_tensor * idxs, int32_t il, bool is_k) const;

    // [main view ; slots], both as F32, along the cell dimension.
    ggml_tensor * get(ggml_context * ctx, ggml_tensor * main_view, int32_t il, bool is_k) const;

    // Slot index of each ubatch token, in the second half of a k/v idxs input.
    void set_input_slot_idxs(int64_t * dst, const std::vector<uint32_t> & cells) const;

    // fill_main(data, n_kv_main) writes upstream's mask for the main cells; this widens it.
    void set_input_kq_mask(const llama_kv_cache & kv, ggml_tensor * dst, const llama_ubatch * ubatch,
                           const std::function<void(float *, int64_t)> & fill_main) const;

private:
    bool is_exact(llama_pos key, llama_pos query) const;

    llama_kvcomp_params params;

    std::vector<int32_t>   slot_cell; // cell held by each slot, -1 when free
    std::vector<llama_pos> slot_pos;  // position the cell had when its row was written
    std::vector<int32_t>   cell_slot; // slot of each cell, -1 when none

    std::vector<ggml_tensor *> k_buf; // per cache layer: [n_embd_k_gqa, n_slots] F16
    std::vector<ggml_tensor *> v_buf;
    std::vector<int32_t>       layer_of_il; // model layer -> index in k_buf/v_buf

    // the slot writes of the graph being built, consumed by get() of the same layer
    mutable std::vector<ggml_tensor *> k_written;
    mutable std::vector<ggml_tensor *> v_written;

    ggml_context *          ctx = nullptr;
    ggml_backend_buffer_t   buf = nullptr;
};
