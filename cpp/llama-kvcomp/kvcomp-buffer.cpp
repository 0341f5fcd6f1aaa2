#include "kvcomp-buffer.h"

#include "llama-batch.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>

llama_kvcomp_buffer::llama_kvcomp_buffer(const llama_kv_cache & kv, const llama_kvcomp_params & params, uint32_t n_ubatch, uint32_t n_seq_max)
    : params(params) {
    // every query of a ubatch may need the exact rows of its own ubatch plus the window
    // and the sinks of each sequence
    const uint32_t n = n_ubatch + n_seq_max * (uint32_t) (params.window + params.sinks);
    slot_cell.assign(n, -1);
    // one more row, never attended: where a token without a slot writes its row
    const uint32_t n_rows = n + 1;
    slot_pos.assign(n, -1);
    cell_slot.assign(kv.get_size(), -1);

    ggml_init_params ip = { 2 * kv.layers.size() * ggml_tensor_overhead(), nullptr, true };
    ctx = ggml_init(ip);
    if (!ctx) {
        throw std::runtime_error("kvcomp: failed to create the buffer context");
    }

    int32_t max_il = 0;
    for (const auto & l : kv.layers) {
        max_il = std::max(max_il, (int32_t) l.il);
    }
    layer_of_il.assign(max_il + 1, -1);

    for (const auto & l : kv.layers) {
        layer_of_il[l.il] = (int32_t) k_buf.size();
        k_written.push_back(nullptr);
        v_written.push_back(nullptr);
        k_buf.push_back(ggml_new_tensor_2d(ctx, GGML_TYPE_F16, l.k->ne[0], n_rows));
        v_buf.push_back(ggml_new_tensor_2d(ctx, GGML_TYPE_F16, l.v->ne[0], n_rows));
        ggml_format_name(k_buf.back(), "kvcomp_k_l%u", l.il);
        ggml_format_name(v_buf.back(), "kvcomp_v_l%u", l.il);
    }

    // the slots live next to the cache they shadow
    buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_buffer_get_type(kv.layers[0].k->buffer));
    if (!buf) {
        ggml_free(ctx);
        throw std::runtime_error("kvcomp: failed to allocate the residual buffer");
    }
    ggml_backend_buffer_clear(buf, 0);

    LLAMA_LOG_INFO("kvcomp: residual buffer: window = %d, sinks = %d, %u slots, %.2f MiB\n",
            params.window, params.sinks, n, ggml_backend_buffer_get_size(buf) / (1024.0 * 1024.0));
}

llama_kvcomp_buffer::~llama_kvcomp_buffer() {
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

bool llama_kvcomp_buffer::is_exact(llama_pos key, llama_pos query) const {
    return key < params.sinks || key > query - params.window;
}

void llama_kvcomp_buffer::reset() {
    std::fill(slot_cell.begin(), slot_cell.end(), -1);
    std::fill(cell_slot.begin(), cell_slot.end(), -1);
}

void llama_kvcomp_buffer::apply(const llama_kv_cache & kv, const std::vector<uint32_t> & cells_ub, const llama_ubatch & ubatch) {
    const auto & cells = kv.v_cells[0];

    // the earliest query of each sequence from now on
    std::map<llama_seq_id, llama_pos> first_query;
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        for (int32_t s = 0; s < ubatch.n_seq_id[i]; ++s) {
            auto it = first_query.find(ubatch.seq_id[i][s]);
            if (it == first_query.end() || ubatch.pos[i] < it->second) {
                first_query[ubatch.seq_id[i][s]] = ubatch.pos[i];
            }
        }
    }

    for (uint32_t s = 0; s < n_slots(); ++s) {
        const int32_t c = slot_cell[s];
        if (c < 0) {
            continue;
        }
        // a removed, overwritten or shifted cell no longer matches the row in its slot
        bool keep = !cells.is_empty(c) && cells.pos_get(c) == slot_pos[s];
        if (keep && slot_pos[s] >= params.sinks) {
            keep = false;
            for (llama_seq_id seq = 0; seq < LLAMA_MAX_SEQ && !keep; ++seq) {
                if (!cells.seq_has(c, seq)) {
                    continue;
                }
                const auto it = first_query.find(seq);
                const llama_pos q = it != first_query.end() ? it->second : cells.seq_pos_max(seq) + 1;
                keep = is_exact(slot_pos[s], q);
            }
        }
        if (!keep) {
            cell_slot[c] = -1;
            slot_cell[s] = -1;
        }
    }

    // A slot follows the position (a ring) whenever it is free, so the keys reach attention
    // in the same order however the prompt was split into ubatches: attention sums in key
    // order, and a different order alone moves logits by ~1e-2 on SmolLM2.
    uint32_t next_free = 0;
    for (uint32_t i = 0; i < cells_ub.size(); ++i) {
        const uint32_t c = cells_ub[i];
        int32_t s = cell_slot[c];
        if (s < 0 && slot_cell[ubatch.pos[i] % n_slots()] < 0) {
            s = ubatch.pos[i] % n_slots();
        }
        if (s < 0) {
            while (next_free < n_slots() && slot_cell[next_free] >= 0) {
                ++next_free;
            }
            if (next_free == n_slots()) {
                // cannot happen with the sizing above; if it does, the token is attended
                // through its quantized row, which is correct, only not exact
                LLAMA_LOG_WARN("%s: residual buffer full, position %d stays quantized\n", __func__, ubatch.pos[i]);
                continue;
            }
            s = (int32_t) next_free;
        }
        slot_cell[s] = (int32_t) c;
        slot_pos[s]  = ubatch.pos[i];
        cell_slot[c] = s;
    }
}

ggml_tensor * llama_kvcomp_buffer::cpy(ggml_context * ctx0, ggml_tensor * cache, ggml_tensor * cur, ggml_tensor * idxs, int32_t il, bool is_k) const {
    const int64_t n_tokens = cur->ne[1];
    ggml_tensor * idx_main = ggml_view_1d(ctx0, idxs, n_tokens, 0);
    ggml_tensor * idx_slot = ggml_view_1d(ctx0, idxs, n_tokens, n_tokens * ggml_element_size(idxs));

    const int32_t ib = layer_of_il[il];
    (is_k ? k_written : v_written)[ib] = ggml_set_rows(ctx0, (is_k ? k_buf : v_buf)[ib], cur, idx_slot);

    return ggml_set_rows(ctx0, cache, cur, idx_main);
}

ggml_tensor * llama_kvcomp_buffer::get(ggml_context * ctx0, ggml_tensor * main_view, int32_t il, bool is_k) const {
    const int32_t ib = layer_of_il[il];

    // reading through the write of this graph (if any) orders the write before the read
    ggml_tensor * & written = (is_k ? k_written : v_written)[ib];
    ggml_tensor * slots = written ? written : (is_k ? k_buf : v_buf)[ib];
    written = nullptr;

    ggml_tensor * sv = ggml_view_4d(ctx0, slots, main_view->ne[0], main_view->ne[1], n_slots(), 1,
            ggml_row_size(slots->type, main_view->ne[0]), slots->nb[1], slots->nb[1] * n_slots(), 0);

    return ggml_concat(ctx0, ggml_cast(ctx0, main_view, GGML_TYPE_F32), ggml_cast(ctx0, sv, GGML_TYPE_F32), 2);
}

void llama_kvcomp_buffer::set_input_slot_idxs(int64_t * dst, const std::vector<uint32_t> & cells) const {
    for (size_t i = 0; i < cells.size(); ++i) {
        dst[i] = cell_slot[cells[i]] >= 0 ? cell_slot[cells[i]] : n_slots();
    }
}

void llama_kvcomp_buffer::set_input_kq_mask(const llama_kv_cache & kv, ggml_tensor * dst, const llama_ubatch * ubatch,
                                            const std::function<void(float *, int64_t)> & fill_main) const {
    const auto & cells = kv.v_cells[0];
    const int64_t n_kv    = dst->ne[0];
    const int64_t n_main  = n_kv - n_slots();
    const int64_t n_rows  = dst->ne[1] * dst->ne[2] * dst->ne[3];

    std::vector<float> main((size_t) n_main * n_rows);
    fill_main(main.data(), n_main);

    std::vector<float> row(n_kv);
    for (int64_t r = 0; r < n_rows; ++r) {
        const llama_pos p = ubatch->pos[r % ubatch->n_tokens];
        std::fill(row.begin() + n_main, row.end(), -INFINITY);
        for (int64_t j = 0; j < n_main; ++j) {
            const float m = main[r * n_main + j];
            row[j] = m;
            const int32_t s = j < (int64_t) cell_slot.size() ? cell_slot[j] : -1;
            if (s >= 0 && m != -INFINITY && is_exact(cells.pos_get(j), p)) {
                row[n_main + s] = m;
                row[j] = -INFINITY;
            }
        }
        if (dst->type == GGML_TYPE_F16) {
            ggml_fp32_to_fp16_row(row.data(), (ggml_fp16_t *) dst->data + r * n_kv, n_kv);
        } else {
            std::copy(row.begin(), row.end(), (float *) dst->data + r * n_kv);
        }
    }
}

llama_kvcomp_params llama_kvcomp_default_params(void) {
    return { 0, 0 };
}

int32_t llama_kvcomp_buffer::attach(llama_kv_cache & kv, const llama_kvcomp_params & params, uint32_t n_ubatch, uint32_t n_seq_max) {
    if (kv.v_trans || kv.n_stream != 1) {
        LLAMA_LOG_ERROR("%s: the residual buffer needs flash attention (-fa on) and a unified KV cache (--kv-unified) for now\n", __func__);
        return -2;
    }
    if (params.window == 0 && params.sinks == 0) {
        kv.kvcomp.reset();
        return 0;
    }
    try {
        kv.kvcomp = std::make_shared<llama_kvcomp_buffer>(kv, params, n_ubatch, n_seq_max);
    } catch (const std::exception & e) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, e.what());
        return -3;
    }
    return 0;
}

int32_t llama_kvcomp_configure(llama_context * ctx, const llama_kvcomp_params * params) {
    if (!ctx || !params || params->window < 0 || params->sinks < 0) {
        LLAMA_LOG_ERROR("%s: invalid parameters: window and sinks must be >= 0\n", __func__);
        return -1;
    }
    auto * kv = dynamic_cast<llama_kv_cache *>(llama_get_memory(ctx));
    if (!kv) {
        LLAMA_LOG_ERROR("%s: the residual buffer needs a plain KV cache (no sliding-window or recurrent layers) for now\n", __func__);
        return -2;
    }
    return llama_kvcomp_buffer::attach(*kv, *params, llama_n_ubatch(ctx), llama_n_seq_max(ctx));
}
