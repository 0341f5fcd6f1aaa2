// The residual buffer in the graph: the writes of a ubatch's rows, the exact rows beside each
// layer's main cells for two-source attention (llama_kvcomp_add_exact), the graph inputs
// (slot rows, mask, exact-key order) and the RoPE shift of stored rows.

#include "kvcomp-buffer.h"

#include "llama-batch.h"
#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-impl.h"

#include "ggml-kvcomp.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

uint32_t llama_kvcomp_buffer::n_main(uint32_t n_kv, uint32_t kv_size, int32_t il, bool is_k) const {
    if (!buffered) {
        return n_kv;
    }
    const ggml_tensor * cur = (is_k ? k_cur : v_cur)[layer_of_il[il]];
    // (a reserve graph spans every stream; whatever the count, its main part is the whole cache)
    const uint32_t n_streams = ub_streams.empty() ? 1 : (uint32_t) ub_streams.size();
    const uint32_t extra = n_extra(cur ? (uint32_t) cur->ne[1] / n_streams : 0);
    GGML_ASSERT(n_kv > extra);
    // a worst-case reserve graph reports n_extra_max() on top of the whole cache
    return std::min(n_kv - extra, kv_size);
}

const void * llama_kvcomp_buffer::graph_id() const {
    // a graph that stores earlier rows again is not one to reuse, nor is the next one
    return &graph_ids[tracker ? tracker->graph_variant() : 0];
}

ggml_tensor * llama_kvcomp_buffer::cpy(ggml_context * ctx0, ggml_tensor * cache, ggml_tensor * cur, ggml_tensor * idxs, int32_t il, bool is_k) const {
    const int64_t n_tokens = cur->ne[1];
    ggml_tensor * idx_main = ggml_view_1d(ctx0, idxs, n_tokens, 0);
    ggml_tensor * idx_slot = ggml_view_1d(ctx0, idxs, n_tokens, n_tokens * ggml_element_size(idxs));

    const int32_t ib = layer_of_il[il];
    ggml_tensor * slots = (is_k ? k_buf : v_buf)[ib];
    if (tracker) {
        cur = tracker->transform(ctx0, cur, ib, is_k);
        if (ggml_tensor * again = tracker->reencoded(ib)) {
            // before this ubatch's rows, which may take the same slots
            cache = ggml_set_rows(ctx0, cache, again, tracker->reencode_rows(ctx0));
            if (buffered) {
                slots = ggml_set_rows(ctx0, slots, again, ggml_view_1d(ctx0, reencode_slots, again->ne[1], 0));
            }
        }
    }
    if (buffered) {
        (is_k ? k_read : v_read)[ib]       = slots;
        (is_k ? k_written : v_written)[ib] = ggml_set_rows(ctx0, slots, cur, idx_slot);
        (is_k ? k_cur : v_cur)[ib]         = cur;
    }

    ggml_tensor * rows = is_k && plans && plans->pre_rope() ? pre_rope_rows(ctx0, cur, ib) : cur;
    ggml_tensor * out = ggml_set_rows(ctx0, cache, rows, idx_main);
    if (is_k && plans) {
        ggml_kvct_set_plans(out, plans->tensor(ib));
    }
    return out;
}

// K rows as the model computed them before its RoPE, which cur (upstream's [n_embd_k_gqa,
// n_tokens] view of K) turned: the RoPE node's input, when the plans can follow that RoPE.
// Otherwise the layer codes cur itself, read without a turn: correct, with plans fitted for
// other rows (said once per layer).
ggml_tensor * llama_kvcomp_buffer::pre_rope_rows(ggml_context * ctx0, ggml_tensor * cur, int32_t ib) const {
    const ggml_tensor * rope = cur->op == GGML_OP_VIEW && cur->view_offs == 0 ? cur->src[0] : nullptr;
    if (!rope || rope->op != GGML_OP_ROPE || !ggml_are_same_shape(rope, rope->src[0]) || !plans->set_rope(ib, rope)) {
        if (!rope_warned[ib]) {
            LLAMA_LOG_WARN("kvcomp: cache layer %d: K does not come from a RoPE the kvct plans follow; its rows are coded "
                           "after RoPE\n", ib);
            rope_warned[ib] = true;
        }
        // a model's graphs build K alike, so a layer never has rows of both kinds
        GGML_ASSERT(!plans->has_rope(ib) && "kvcomp: a layer's K changed from RoPE rows to others within one context");
        return cur;
    }
    ggml_tensor * pre = rope->src[0];
    if (pre->nb[0] != ggml_type_size(pre->type) || pre->nb[1] != ggml_row_size(pre->type, pre->ne[0])) {
        pre = ggml_cont(ctx0, pre);
    }
    return ggml_view_2d(ctx0, pre, cur->ne[0], cur->ne[1], pre->nb[2], 0);
}

ggml_tensor * llama_kvcomp_buffer::get(ggml_context * ctx0, ggml_tensor * main_view, int32_t il, bool is_k) const {
    const int32_t ib  = layer_of_il[il];
    if (is_k && plans) {
        // the attention node takes the plans from here (llama_kvcomp_add_exact finds them by name)
        ggml_tensor * pv = ggml_kvct_plans_view(ctx0, plans->tensor(ib), plans->has_rope(ib) ? plans->positions(ib) : nullptr);
        ggml_format_name(pv, "kvcomp_plans_k-%d", il);
        ggml_format_name(main_view, "kvcomp_main_k-%d", il);
    }
    if (!buffered) {
        return main_view;
    }
    const int64_t ne0 = main_view->ne[0];
    const int64_t ne1 = main_view->ne[1];
    const int64_t ns  = main_view->ne[3];
    // the first stream of the graph being built, which a reserve graph (all streams) does not
    // share with the last ubatch
    const size_t  s0  = main_view->view_offs / main_view->nb[3];

    ggml_tensor * & read    = (is_k ? k_read : v_read)[ib];
    ggml_tensor * & written = (is_k ? k_written : v_written)[ib];
    ggml_tensor * & cur     = (is_k ? k_cur : v_cur)[ib];
    const ggml_tensor * cache = main_view->view_src ? main_view->view_src : main_view;
    const bool device = cache->buffer && !ggml_kvcomp_buffer_cpu_kernels(cache->buffer);
    // (a layer that reads another layer's cache finds no write of its own in this graph)
    ggml_tensor * slots = device && written ? written : read ? read : (is_k ? k_buf : v_buf)[ib];

    // The exact rows: the slots, read where they lie, and the ubatch's own rows rounded to F16
    // as the slots hold them, so a key seen exactly is the same value in a batched prompt and
    // in a decode step (the ubatch's streams are consecutive, as upstream's views of the main
    // cache assume).
    ggml_tensor * exact = ggml_view_4d(ctx0, slots, ne0, ne1, n_slots(), ns,
            ggml_row_size(slots->type, ne0), slots->nb[1], slots->nb[1] * n_rows(), slots->nb[1] * n_rows() * s0);
    ggml_tensor * exact_ub = nullptr;
    if (cur) {
        const int64_t n_tps = cur->ne[1] / ns;
        exact_ub = ggml_view_4d(ctx0, cur, ne0, ne1, n_tps, ns, ggml_row_size(cur->type, ne0), cur->nb[1], cur->nb[1] * n_tps, 0);
    }
    const char c = is_k ? 'k' : 'v';
    if (written && !device) {
        // added to the graph after the layer's attention by llama_kvcomp_add_exact
        ggml_format_name(written, "kvcomp_write_%c-%d", c, il);
    }
    read    = nullptr;
    written = nullptr;
    cur     = nullptr;

    if (device) {
        // Device caches: the GPU kernels do not read the exact rows as their own sources, so
        // attention reads an F16 copy of the main cells joined to them, taken
        // after the slot write. (A cache on an rpc-server of this build on the CPU is read as
        // in host memory, by the server.)
        ggml_tensor * all = ggml_concat(ctx0, ggml_cast(ctx0, main_view, GGML_TYPE_F16), exact, 2);
        return exact_ub ? ggml_concat(ctx0, all, ggml_cast(ctx0, exact_ub, GGML_TYPE_F16), 2) : all;
    }
    // Host caches: attention reads the main cells where they lie and the exact rows as further
    // sources, attached to the node by llama_kvcomp_add_exact, which finds them by these names
    // (the ubatch's F32 rows are read as their F16 rounding, so no cast node).
    ggml_format_name(main_view, "kvcomp_main_%c-%d", c, il);
    ggml_format_name(exact, "kvcomp_exact_%c-%d", c, il);
    if (is_k) {
        ggml_tensor * order = ggml_view_2d(ctx0, exact_order, exact_order->ne[0], ns, exact_order->nb[1], 0);
        ggml_format_name(order, "kvcomp_order-%d", il);
    }
    if (exact_ub) {
        ggml_format_name(exact_ub, "kvcomp_ubatch_%c-%d", c, il);
    }
    return main_view;
}

void llama_kvcomp_add_exact(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * fa) {
    const ggml_tensor * k = fa->src[1];
    const ggml_tensor * v = fa->src[2];
    if (k->op != GGML_OP_PERMUTE || v->op != GGML_OP_PERMUTE) {
        return;
    }
    int il_k = -1;
    int il_v = -1;
    if (ggml_kvcomp_is_kvct(k->type) && sscanf(k->src[0]->name, "kvcomp_main_k-%d", &il_k) == 1) {
        char name[GGML_MAX_NAME];
        snprintf(name, sizeof(name), "kvcomp_plans_k-%d", il_k);
        if (ggml_tensor * pv = ggml_get_tensor(ctx, name)) {
            ggml_kvct_set_plans(fa, pv);
        }
    }
    if (sscanf(k->src[0]->name, "kvcomp_main_k-%d", &il_k) != 1 || sscanf(v->src[0]->name, "kvcomp_main_v-%d", &il_v) != 1 ||
        il_k != il_v) {
        return;
    }
    auto find = [&](const char * part, char c) -> ggml_tensor * {
        char name[GGML_MAX_NAME];
        snprintf(name, sizeof(name), "kvcomp_%s_%c-%d", part, c, il_k);
        ggml_tensor * t = ggml_get_tensor(ctx, name);
        // the same permutation as the main K/V: [head size, keys, KV heads, streams]
        return t ? ggml_permute(ctx, t, 0, 2, 1, 3) : nullptr;
    };
    ggml_tensor * ke = find("exact", 'k');
    ggml_tensor * ve = find("exact", 'v');
    GGML_ASSERT(ke && ve && "kvcomp: the exact rows of a buffered layer are missing from its graph");
    ggml_flash_attn_ext_add_exact(fa, ke, ve, find("ubatch", 'k'), find("ubatch", 'v'));
    char order_name[GGML_MAX_NAME];
    snprintf(order_name, sizeof(order_name), "kvcomp_order-%d", il_k);
    if (ggml_tensor * order = ggml_get_tensor(ctx, order_name)) {
        ggml_flash_attn_ext_set_exact_order(fa, order);
    }
    for (const char c : { 'k', 'v' }) {
        char name[GGML_MAX_NAME];
        snprintf(name, sizeof(name), "kvcomp_write_%c-%d", c, il_k);
        if (ggml_tensor * w = ggml_get_tensor(ctx, name)) {
            // SET_ROWS reads sources 0-2; this one only orders the write after the node
            GGML_ASSERT(w->op == GGML_OP_SET_ROWS && !w->src[3]);
            w->src[3] = fa;
            ggml_build_forward_expand(gf, w);
        }
    }
}

void llama_kvcomp_buffer::set_input_slot_idxs(int64_t * dst, const llama_kv_cache::slot_info & sinfo) const {
    for (size_t s = 0; s < sinfo.n_stream(); ++s) {
        const stream_map & m = maps[sinfo.strm[s]];
        const int64_t offs = (int64_t) sinfo.strm[s] * n_rows();
        for (size_t i = 0; i < sinfo.size(); ++i) {
            const int32_t slot = m.cell_slot[sinfo.idxs[s][i]];
            dst[s * sinfo.size() + i] = offs + (slot >= 0 ? slot : n_slots());
        }
    }
}

void llama_kvcomp_buffer::set_input_kq_mask(const llama_kv_cache & kv, ggml_tensor * dst, const llama_ubatch * ubatch,
                                            const std::function<void(float *, int64_t)> & fill_main) const {
    if (plans && plans->pre_rope()) {
        // where attention turns the kvct rows to: every cell's position now (the ubatch's
        // cells included; a shift moved them)
        const ggml_tensor * pos = plans->positions(0);
        std::vector<int32_t> p(ggml_nelements(pos));
        for (int64_t strm = 0; strm < pos->ne[1]; ++strm) {
            const auto & cells = kv.v_cells[strm];
            for (int64_t c = 0; c < pos->ne[0]; ++c) {
                p[strm * pos->ne[0] + c] = cells.is_empty((uint32_t) c) ? 0 : cells.pos_get((uint32_t) c);
            }
        }
        plans->set_positions(p);
    }
    if (!buffered) {
        std::vector<float> main(ggml_nelements(dst));
        fill_main(main.data(), dst->ne[0]);
        if (dst->type == GGML_TYPE_F16) {
            ggml_fp32_to_fp16_row(main.data(), (ggml_fp16_t *) dst->data, (int64_t) main.size());
        } else {
            std::copy(main.begin(), main.end(), (float *) dst->data);
        }
        return;
    }
    const int64_t n_kv   = dst->ne[0];
    const int64_t n_ps   = (int64_t) ub_streams.size();
    const int64_t n_tps  = ubatch->n_tokens / n_ps;
    const int64_t n_main = n_kv - n_extra((uint32_t) n_tps);
    const int64_t n_rows = dst->ne[1] * dst->ne[2] * dst->ne[3];

    std::vector<float> main((size_t) n_main * n_rows);
    fill_main(main.data(), n_main);

    // Per stream plane, the exact keys in the order of the cells they hold: a key's turn in
    // attention then does not depend on whether it lies in a slot or among the ubatch's rows.
    // (A device cache's attention reads a copy in cell order and needs none.)
    if (ggml_kvcomp_buffer_cpu_kernels(exact_order->buffer)) {
        std::vector<int32_t> order(ggml_nelements(exact_order), -1);
        for (int64_t sp = 0; sp < n_ps; ++sp) {
            const stream_map & m = maps[ub_streams[sp]];
            int32_t * o = order.data() + sp * exact_order->ne[0];
            for (int64_t j = 0; j < n_main; ++j) {
                const int32_t e = m.exact_key((uint32_t) j, n_slots());
                if (e >= 0) {
                    *o++ = e;
                }
            }
        }
        ggml_backend_tensor_set(exact_order, order.data(), 0, order.size() * sizeof(int32_t));
    }

    std::vector<float> row(n_kv);
    for (int64_t r = 0; r < n_rows; ++r) {
        // rows are the ubatch's tokens, stream by stream
        const uint32_t strm = ub_streams[std::min(r / n_tps, n_ps - 1)];
        const auto & cells = kv.v_cells[strm];
        const stream_map & m = maps[strm];
        const llama_pos p = ubatch->pos[r % ubatch->n_tokens];
        std::fill(row.begin() + n_main, row.end(), -INFINITY);
        for (int64_t j = 0; j < n_main; ++j) {
            const float v = main[r * n_main + j];
            row[j] = v;
            if (v == -INFINITY) {
                continue;
            }
            const int32_t e = m.exact_key((uint32_t) j, n_slots());
            if (e < 0) {
                continue;
            }
            // a row of the ubatch is not a pin yet
            const bool pinned = e < (int32_t) n_slots() && m.cell_slot[j] >= 0 && m.slot_kinds[e] == SLOT_KIND_PINNED;
            if (is_exact(cells.pos_get(j), p, pinned)) {
                row[n_main + e] = v;
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

void llama_kvcomp_buffer::set_input_shift(const llama_kv_cache & kv) {
    int32_t * data = (int32_t *) shift_input->data;
    for (uint32_t strm = 0; strm < maps.size(); ++strm) {
        const auto & cells = kv.v_cells[strm];
        stream_map & m = maps[strm];
        int32_t * d = data + (size_t) strm * n_rows();
        for (uint32_t s = 0; s < n_slots(); ++s) {
            const int32_t c = m.slot_cell[s];
            d[s] = 0;
            // a slot written at the cell's old position moves with it
            if (c >= 0 && !cells.is_empty(c) && cells.get_shift(c) != 0 && cells.pos_get(c) - cells.get_shift(c) == m.slot_pos[s]) {
                d[s] = cells.get_shift(c);
                m.slot_pos[s] = cells.pos_get(c);
            }
        }
        d[n_slots()] = 0;
    }
}

namespace {

class llm_graph_input_kvcomp_shift : public llm_graph_input_i {
public:
    llm_graph_input_kvcomp_shift(const llama_kv_cache & kv, llama_kvcomp_buffer & buf) : kv(kv), buf(buf) {}

    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        buf.set_input_shift(kv);
    }

    const llama_kv_cache & kv;
    llama_kvcomp_buffer & buf;
};

} // namespace

ggml_tensor * llama_kvcomp_buffer::build_input_shift(const llama_kv_cache & kv, ggml_context * ctx0, llm_graph_result * res) {
    if (tracker) {
        tracker->resolve();
        tracker->on_shift();
    }
    shift_input = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, (int64_t) n_rows() * maps.size());
    ggml_set_input(shift_input);
    res->add_input(std::make_unique<llm_graph_input_kvcomp_shift>(kv, *this));
    return shift_input;
}

// Stored K rows (a [n_rot, n_head_kv, n_rows] view) moved by RoPE: undo the tracker's
// transform, unrotate, RoPE in F32 (upstream's own shift of an unquantized cache), rotate,
// transform again, store.
ggml_tensor * llama_kvcomp_buffer::shift_rows(const llama_kv_cache & kv, ggml_context * ctx0, const llama_cparams & cparams,
                                              ggml_tensor * view, ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors,
                                              float freq_base, float freq_scale, uint32_t il) const {
    const int32_t ib = layer_of_il[il];
    ggml_tensor * tmp = ggml_cast(ctx0, view, GGML_TYPE_F32);
    tmp = tracker ? tracker->unstore(ctx0, tmp, ib, false) : tmp;
    tmp = rot ? llama_mul_mat_hadamard(ctx0, tmp, rot) : tmp;
    tmp = kv.build_rope_shift(cparams, ctx0, tmp, shift, nullptr, factors, freq_base, freq_scale, il);
    tmp = rot ? llama_mul_mat_hadamard(ctx0, tmp, rot) : tmp;
    tmp = tracker ? tracker->unstore(ctx0, tmp, ib, true) : tmp;
    return ggml_cpy(ctx0, tmp, view);
}

ggml_tensor * llama_kvcomp_buffer::build_shift_main(const llama_kv_cache & kv, ggml_context * ctx0, const llama_cparams & cparams,
                                                    ggml_tensor * k_view, ggml_tensor * shift, ggml_tensor * rot,
                                                    ggml_tensor * factors, float freq_base, float freq_scale, uint32_t il) const {
    if (plans && plans->has_rope(layer_of_il[il])) {
        // rows before RoPE do not move: attention turns them to the cells' new positions
        return shift;
    }
    if (!tracker) {
        return kv.build_rope_shift(cparams, ctx0, k_view, shift, rot, factors, freq_base, freq_scale, il);
    }
    return shift_rows(kv, ctx0, cparams, k_view, shift, rot, factors, freq_base, freq_scale, il);
}

ggml_tensor * llama_kvcomp_buffer::build_shift(const llama_kv_cache & kv, ggml_context * ctx0, const llama_cparams & cparams,
                                               ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors,
                                               float freq_base, float freq_scale, uint32_t il) const {
    const auto & hparams = kv.hparams;
    ggml_tensor * slots = k_buf[layer_of_il[il]];

    const int64_t n_embd_head = hparams.n_embd_head_k(il);
    const int64_t n_rot       = hparams.n_rot(il);
    const int64_t n_embd_nope = hparams.n_lora_kv > 0 ? n_embd_head - n_rot : 0;
    ggml_tensor * view = ggml_view_3d(ctx0, slots, n_rot, hparams.n_head_kv(il), slots->ne[1],
            ggml_row_size(slots->type, n_embd_head), slots->nb[1], ggml_row_size(slots->type, n_embd_nope));
    return shift_rows(kv, ctx0, cparams, view, shift, rot, factors, freq_base, freq_scale, il);
}

ggml_tensor * llama_kvcomp_buffer::scale_q(ggml_context * ctx0, ggml_tensor * q, int32_t il) const {
    // K is stored as k - c, and softmax cancels q·c: Q stays as it is (a per-head basis of the
    // stored K would turn Q here)
    GGML_UNUSED(ctx0);
    GGML_UNUSED(il);
    return q;
}
